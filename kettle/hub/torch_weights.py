"""Pickled PyTorch checkpoints (`.bin`, `.pt`, `.pth`) → safetensors, done once per checkpoint folder.

Shards load safetensors only: they memory-map, and they cannot run code the way a pickle can. A folder that
ships only pickled weights is copied into the conversion cache with every weight file rewritten as
safetensors (and its index, if sharded); each written file is read back and compared with the source.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kettle.progress import progress_bar

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# Files with a pickle suffix that are not model weights (saved by the Trainer next to a checkpoint).
NOT_WEIGHTS = {"training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"}
INDEX_NAMES = ("pytorch_model.bin.index.json", "model.pt.index.json")


def has_safetensors(folder: Path) -> bool:
    return any(folder.glob("*.safetensors"))


def pickled_weight_files(folder: Path) -> list[Path]:
    """The folder's pickled weight files, in name order."""
    files = [
        path
        for path in folder.iterdir()
        if path.suffix in PICKLE_SUFFIXES and path.name not in NOT_WEIGHTS and not path.name.startswith("rng_state")
    ]
    return sorted(files)


def safetensors_name(pickle_name: str) -> str:
    """`pytorch_model-00001-of-00002.bin` → `model-00001-of-00002.safetensors` (transformers' naming)."""
    stem = Path(pickle_name).stem
    if stem.startswith("pytorch_model"):
        stem = "model" + stem[len("pytorch_model") :]
    return f"{stem}.safetensors"


def convert_pickled_folder(source: Path, out_dir: Path) -> None:
    """Copies everything but the pickled weights from `source`, then writes their safetensors versions."""
    weights = pickled_weight_files(source)
    for path in source.iterdir():
        if path.is_file() and path not in weights and path.name not in INDEX_NAMES:
            shutil.copy2(path, out_dir / path.name)
    # Progress when there are several files: a sharded checkpoint takes minutes.
    with progress_bar(len(weights), "Converting to safetensors", "file", enabled=len(weights) > 1) as bar:
        for path in weights:
            convert_file(path, out_dir / safetensors_name(path.name))
            bar.update()
    _convert_index(source, out_dir)


def convert_file(source: Path, target: Path) -> None:
    """Rewrites one pickled state dict as safetensors and checks every tensor reads back equal."""
    import torch
    from safetensors.torch import load_file, save_file

    state = torch.load(source, map_location="cpu", weights_only=True)
    if "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    tensors = _unshare({name: value for name, value in state.items() if isinstance(value, torch.Tensor)})
    save_file(tensors, target, metadata={"format": "pt"})
    written = load_file(target)
    for name, tensor in tensors.items():
        if not torch.equal(written[name], tensor):
            raise RuntimeError(f"converting {source} changed tensor {name!r}")


def _unshare(tensors: dict) -> dict:
    """safetensors refuses tensors that share memory (tied embeddings): give each later alias its own copy."""
    seen: set[int] = set()
    result = {}
    for name, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr()
        result[name] = tensor.clone().contiguous() if pointer in seen else tensor.contiguous()
        seen.add(pointer)
    return result


def _convert_index(source: Path, out_dir: Path) -> None:
    for name in INDEX_NAMES:
        index_path = source / name
        if not index_path.exists():
            continue
        index = json.loads(index_path.read_text())
        index["weight_map"] = {key: safetensors_name(file) for key, file in index.get("weight_map", {}).items()}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return
