"""Reading a Hugging Face safetensors checkpoint tensor by tensor, into the dtype and device the model runs in.

A folder holds either one `model.safetensors` (or any `*.safetensors` files) or shards listed by
`model.safetensors.index.json`. Tensors are read one at a time through `safe_open`, so peak memory stays near
the size of the model in its target dtype, never two copies of the checkpoint.

A folder prepared from a GGUF file (config, tokenizer and a `model.gguf` link) is read through
`kettle/tensors/gguf_file.py` instead: the same names and calls, with `weights.gguf` exposing the file's
quantized blocks to the load-time quantization (kettle/quantization/gguf_scheme.py). A vision-language GGUF's
folder also links its projector file (`mmproj.gguf`), whose vision tensors answer to the family's Hugging Face
names, dense (kettle/tensors/mmproj_file.py).

Loading shows its progress in distinct tensors read (`kettle/progress.py`: a bar on a terminal, a log line every
tenth otherwise), on the first rank only, so tensor-parallel shards do not draw over each other.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn

from kettle.progress import progress_bar
from kettle.tensors import distributed
from kettle.tensors.gguf_file import GgufTensors, folder_gguf
from kettle.tensors.mmproj_file import MmprojTensors, folder_mmproj

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Tensor name → file, from the shard index when there is one, else from every safetensors file's header."""
    index = folder / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    mapping = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            mapping.update(dict.fromkeys(handle.keys(), file))
    return mapping


class ReadProgress:
    """The distinct tensors read so far out of a checkpoint's `total`, as a progress bar: a tensor read again
    (slices of one fused projection, a tied embedding) counts once."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = progress_bar(total, "Loading weights", "tensor", enabled=enabled)
        self._seen: set[str] = set()

    def read(self, name: str) -> None:
        if name not in self._seen:
            self._seen.add(name)
            self._bar.update()

    def close(self) -> None:
        self._bar.close()


class LinearLoader(Protocol):
    """How projections load under a quantization scheme (kettle/quantization: `Scheme`, `GgufScheme`)."""

    def load_linear(self, weights: Weights, prefixes: list[str]) -> nn.Module | None:
        """The fused projections named `prefixes`, quantized; None to load them dense."""

    def quantize_tensor(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
        """A projection the loader built from reshaped tensors (regrouped heads, a transposed Conv1D),
        quantized; None to keep it dense."""


class CountedLoader:
    """A scheme's loader whose projections count in the loading progress (a GGUF scheme reads the file itself,
    not through `Weights.get`)."""

    def __init__(self, scheme: LinearLoader, progress: ReadProgress) -> None:
        self.scheme, self.progress = scheme, progress

    def load_linear(self, weights: Weights, prefixes: list[str]) -> nn.Module | None:
        layer = self.scheme.load_linear(weights, prefixes)
        if layer is not None:
            for prefix in prefixes:
                self.progress.read(f"{prefix}.weight")
        return layer

    def quantize_tensor(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
        return self.scheme.quantize_tensor(weight, bias)

    def load_vocabulary(self, weights: Weights, embed: str, head: str) -> nn.Module | None:
        return self._table("load_vocabulary", weights, embed, head)

    def load_embedding(self, weights: Weights, embed: str, head: str) -> nn.Module | None:
        return self._table("load_embedding", weights, embed, head)

    def _table(self, method: str, weights: Weights, embed: str, head: str) -> nn.Module | None:
        """The scheme's quantized table for `embed` by `method` (None where the scheme has no such loader),
        counted as read."""
        load = getattr(self.scheme, method, None)
        table = None if load is None else load(weights, embed, head)
        if table is not None:
            self.progress.read(embed)
        return table


class Weights:
    """Named tensors of one checkpoint. Floating-point tensors come back in `dtype`; others (quantized
    integer packs, scales kept as-is by their loaders) keep their stored dtype. Use as a context manager.

    `quantize` is how projections load when a quantization scheme applies (the scheme, a `LinearLoader`):
    the loaders ask it first, so each projection is quantized as it is read and the float weights of the
    whole model never sit in memory at once. None loads every projection as stored."""

    def __init__(
        self, folder: str | Path, dtype: torch.dtype, device: torch.device | str, quantize: LinearLoader | None = None
    ) -> None:
        self.folder = Path(folder)
        self.quantize = quantize
        self.dtype = dtype
        self.device = torch.device(device)
        gguf = folder_gguf(self.folder)
        # A GGUF model folder: its tensors come from the (memory-mapped) file, by Hugging Face name.
        self.gguf = None if gguf is None else GgufTensors(gguf)
        self._files = {} if self.gguf is not None else checkpoint_files(self.folder)
        mmproj = folder_mmproj(self.folder)
        self.vision = None if mmproj is None else MmprojTensors(mmproj)
        self._stored: dict[str, str] = {}  # another name a tensor answers to → its name in the file (`alias`)
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}
        # This shard's tensor-parallel rank and group: loaders that support tensor parallelism read only their
        # slice (`get_slice`); at world size 1 it changes nothing.
        self.tp = distributed.current()
        self.progress = ReadProgress(len(self.names), enabled=self.tp.rank == 0)
        if quantize is not None:
            # A quantization scheme may read the file itself (GGUF blocks): count what it loads here.
            self.quantize = CountedLoader(quantize, self.progress)

    def __enter__(self) -> Weights:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Releases the open files (their memory maps)."""
        self.progress.close()
        self._stack.close()
        self._handles.clear()

    @property
    def names(self) -> list[str]:
        names = self.gguf.names if self.gguf is not None else sorted(self._files)
        return names + (self.vision.names if self.vision is not None else [])

    def alias(self, rename: Callable[[str], str | None]) -> None:
        """Lets each stored tensor also answer to `rename(name)` (None: no other name), so a loader written for
        one layout reads another: a vision-language checkpoint's text model (`language_model.model.layers.0...`)
        under the names of the text family (`model.layers.0...`). Safetensors checkpoints only."""
        for name, file in list(self._files.items()):
            other = rename(name)
            if other is not None and other not in self._files:
                self._files[other] = file
                self._stored[other] = name

    def has(self, name: str) -> bool:
        if self.vision is not None and self.vision.has(name):
            return True
        return self.gguf.has(name) if self.gguf is not None else name in self._files

    def _handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(file, framework="pt", device="cpu"))
        return self._handles[file]

    def quantized_vocabulary(self, embed: str, head: str) -> nn.Module | None:
        """The LM head as the quantization scheme reads it from the file, where that one table also serves the
        embedding's rows (a GGUF file's tied Q8_0 table): then neither is loaded dense. None otherwise."""
        if self.quantize is None or self.tp.sharded:
            return None
        return self.quantize.load_vocabulary(self, embed, head)

    def quantized_embedding(self, embed: str, head: str) -> nn.Module | None:
        """The input embedding as the quantization scheme keeps it, where the file also has its own head tensor
        (an untied quantized GGUF table): a module whose `embed(ids)` gives the rows, and no dense table. None
        otherwise."""
        if self.quantize is None or self.tp.sharded:
            return None
        return self.quantize.load_embedding(self, embed, head)

    def get(self, name: str) -> torch.Tensor:
        """One tensor, converted to the target dtype (if floating point) and device."""
        if self.vision is not None and self.vision.has(name):
            self.progress.read(name)
            return self.vision.dense(name).to(device=self.device, dtype=self.dtype)
        if self.gguf is not None:
            tensor = self.gguf.dense(name).to(device=self.device, dtype=self.dtype)
            self.progress.read(name)
            return tensor
        if name not in self._files:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.folder}")
        self.progress.read(name)
        tensor = self._handle(self._files[name]).get_tensor(self._stored.get(name, name))
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.to(device=self.device, dtype=dtype)

    def shape(self, name: str) -> list[int]:
        """A tensor's shape, from the file header (nothing is read)."""
        if self.vision is not None and self.vision.has(name):
            return self.vision.shape(name)
        if self.gguf is not None:
            return self.gguf.shape(name)
        if name not in self._files:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.folder}")
        return list(self._handle(self._files[name]).get_slice(self._stored.get(name, name)).get_shape())

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) `start:stop` of a tensor, reading only that part of the file."""
        if self.gguf is not None or (self.vision is not None and self.vision.has(name)):  # dequantize, then slice
            tensor = self.get(name)
            return tensor[start:stop] if dim == 0 else tensor[:, start:stop]
        if name not in self._files:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.folder}")
        self.progress.read(name)
        view = self._handle(self._files[name]).get_slice(self._stored.get(name, name))
        tensor = view[start:stop] if dim == 0 else view[:, start:stop]
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.to(device=self.device, dtype=dtype)

    def get_optional(self, name: str) -> torch.Tensor | None:
        """The tensor, or None when the checkpoint lacks it (optional biases)."""
        return self.get(name) if self.has(name) else None

    def output_embedding(self, embedding: torch.Tensor, name: str, tied: bool) -> torch.Tensor:
        """The LM head: the input embedding itself (shared, not copied) when tied or absent from the checkpoint."""
        if tied or not self.has(name):
            return embedding
        return self.get(name)
