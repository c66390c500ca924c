"""CPU tensors in 2 MiB pages: the packed quantized weights and the KV cache, which a decode step streams whole.

Linux gives a process's anonymous memory transparent huge pages where the system says `always`, or where the
process asks with `madvise(MADV_HUGEPAGE)` under `madvise`, the common default (Debian's, Ubuntu's). A decode step
reads every weight once: in 4 KiB pages that is a TLB miss and a page walk every 4 KiB, in 2 MiB pages one every
2 MiB. A 1.7B Q4_K_M file's packed weights moved into huge pages decode 1.09-1.15x faster on the 2-core Zen 4
machine measured here (six alternated rounds, the same process; bench/RESULTS.md), and a first touch faults in 2 MiB
at a time instead of 4 KiB (the load's packing writes every page once). Where the system says `never`, or has no
such call, the advice is a no-op and the pages are the usual ones. `KETTLE_TUNING=huge-pages=off` keeps plain
allocations (PyTorch's), for measurement.
"""

from __future__ import annotations

import math
import mmap

import torch

from kettle import settings
from kettle.tensors import weight_arena

HUGE_PAGE = 2 * 2**20  # bytes: x86-64's transparent huge page; smaller tensors are left to PyTorch's allocator


def anonymous(nbytes: int) -> torch.Tensor:
    """`nbytes` zero bytes (uint8) in an anonymous mapping, advised into huge pages, starting on a 2 MiB boundary
    (a huge page maps only an aligned 2 MiB range); the tensor and its views keep the mapping alive."""
    advise = hasattr(mmap, "MADV_HUGEPAGE") and settings.current().huge_pages
    pad = HUGE_PAGE if advise and nbytes >= HUGE_PAGE else 0
    mapping = mmap.mmap(-1, max(nbytes + pad, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if pad:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping for as long as any view lives
    start = (-flat.data_ptr()) % HUGE_PAGE if pad else 0
    return flat[start : start + nbytes]


def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor: in huge pages from 2 MiB (`anonymous`), from PyTorch's allocator below."""
    return _allocate(shape, dtype, torch.empty)


def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor as `empty` places it (an anonymous mapping is zero already: nothing is written)."""
    return _allocate(shape, dtype, torch.zeros)


def placed(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s values, contiguous, where `empty` would place a tensor of its size: a copy in huge pages from 2 MiB,
    for weights computed in tensor ops at load (a GGUF type requantized, `Q8Linear`) rather than packed into `empty`
    by the kernels; the tensor itself below (or with huge-pages=off, made contiguous)."""
    if tensor.numel() * tensor.element_size() < HUGE_PAGE or not settings.current().huge_pages:
        return tensor.contiguous()
    return empty(*tensor.shape, dtype=tensor.dtype).copy_(tensor)


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, small) -> torch.Tensor:
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not settings.current().huge_pages:
        return small(*shape, dtype=dtype)
    flat = _reserved(nbytes)
    return (anonymous(nbytes) if flat is None else flat).view(dtype).view(shape)


def _reserved(nbytes: int) -> torch.Tensor | None:
    """`nbytes` zero bytes of the memory reserved for the weights (kettle/tensors/weight_arena.py), if any is left."""
    piece = weight_arena.take(nbytes)
    if piece is None:
        return None
    mapping, start = piece
    return torch.frombuffer(mapping, dtype=torch.uint8, offset=start, count=nbytes)
