"""A GGUF file's header read in one pass: scalar metadata and where each tensor lies, nothing else.

`gguf.GGUFReader` builds a NumPy view for every item of every metadata array; the bundled model's tokenizer
arrays (49,152 tokens, 48,900 merges) make that 6 s a parse on a busy 2-core machine, paid on every start.
The model needs none of those arrays (the tokenizer is prepared once, by transformers), so this reader steps
over them by their lengths and keeps only scalars, short arrays of numbers (a projector's image mean and std,
Qwen2-VL's rotary sections: `SHORT_ARRAY` items at most) and the tensor table: ~0.1 s. Torch-free (the launcher
reads the architecture with it). Little-endian files only, as llama.cpp writes them.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

# GGUF value types → struct format of a scalar (8: string and 9: array are read by hand).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
SHORT_ARRAY = 64  # arrays of numbers up to this long are read as lists; longer ones are stepped over
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: `dims` innermost first (GGUF's order), `qtype` the ggml type number, `offset`
    its absolute position in the file."""

    name: str
    dims: tuple[int, ...]
    qtype: int
    offset: int


@dataclass(frozen=True)
class GgufHeader:
    """Scalar metadata (`fields`; arrays are left out) and the tensor table of one GGUF file."""

    fields: dict[str, object]
    tensors: list[TensorInfo]


_FORMATS = {fmt: struct.Struct("<" + fmt) for fmt in (*_SCALARS.values(), "Q")}


class _Cursor:
    def __init__(self, data) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        form = _FORMATS[fmt]
        (value,) = form.unpack_from(self.data, self.pos)
        self.pos += form.size
        return value

    def skip_strings(self, count: int) -> None:
        """Steps over `count` strings by their lengths, none decoded: a vocabulary's ~100,000 (this loop is on
        every start's path, in the shard's load: a `take` per string cost 0.07-0.1 s of it)."""
        length, data, pos = _FORMATS["Q"].unpack_from, self.data, self.pos
        for _ in range(count):
            pos += 8 + length(data, pos)[0]
        self.pos = pos

    def string(self) -> str:
        size = self.take("Q")
        self.pos += size
        return bytes(self.data[self.pos - size : self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        """A scalar, a string or a short array of numbers (a list); any other array is stepped over (None)."""
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            if kind not in _SCALARS:
                raise _Unreadable(f"its header holds a value of unknown type {kind} (corrupt, or a newer GGUF)")
            return self.take(_SCALARS[kind])
        item, count = self.take("I"), self.take("Q")
        if item in _SCALARS and count <= SHORT_ARRAY:
            values = struct.unpack_from(f"<{count}{_SCALARS[item]}", self.data, self.pos)
            self.pos += count * struct.calcsize(_SCALARS[item])
            return list(values)
        if item in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[item])
        elif item == _STRING:  # a vocabulary
            self.skip_strings(count)
        else:
            for _ in range(count):
                self.value(item)
        return None


class _Unreadable(Exception):
    """What in a header stops the read (worded for `read_header`'s ValueError)."""


def read_header(path: Path) -> GgufHeader:
    """The header of the GGUF file at `path`; a ValueError naming the file and what is wrong when it is not one, or
    is cut short or corrupt within its header (one line: the launcher prints it as it is).

    A file read again unchanged (same inode, size and modification time) is not parsed again: a first start's
    preparation reads the header three times and the shard's load twice, ~0.05 s each for a 49,152-token
    vocabulary stepped over. The header returned is then shared: callers read it and do not change it."""
    stat = os.stat(path)
    return _read_once(Path(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_once(path: Path, _inode: int, _size: int, _modified_ns: int) -> GgufHeader:
    with open(path, "rb") as file:
        # Read before the mapping: an empty file cannot be mapped, and is no GGUF file either.
        if file.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not begin with 'GGUF')")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                return _read(data)
            except struct.error:  # a read past the end of the mapping
                raise ValueError(f"{path} is truncated: its header runs past the end of the file") from None
            except _Unreadable as error:
                raise ValueError(f"{path} is not a readable GGUF file: {error}") from None


def _read(data) -> GgufHeader:
    cursor = _Cursor(data)
    cursor.pos = 4
    cursor.take("I")  # version
    n_tensors, n_fields = cursor.take("Q"), cursor.take("Q")
    fields = {}
    for _ in range(n_fields):
        key = cursor.string()
        fields[key] = cursor.value(cursor.take("I"))
    infos = [_tensor_info(cursor) for _ in range(n_tensors)]
    if cursor.pos > len(data):  # the last string or array stepped over ran past the end, unread
        raise struct.error("past the end")
    alignment = int(fields.get("general.alignment") or DEFAULT_ALIGNMENT)
    start = -(-cursor.pos // alignment) * alignment
    tensors = [TensorInfo(name, dims, qtype, start + offset) for name, dims, qtype, offset in infos]
    return GgufHeader(fields, tensors)


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    dims = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
    return name, dims, cursor.take("I"), cursor.take("Q")
