"""Triton for the CUDA kernels' modules (they import it from here), where it can run them, and whether its
interpreter runs.

Triton is imported only where there is a CUDA device, or where something has imported it already: a server
without a GPU never pays its import (~0.16 s) and its teardown, even where Triton is installed. The tests' conftest
imports it on machines without a GPU after setting TRITON_INTERPRET=1: Triton's interpreter then runs the CUDA
kernels on CPU tensors, program by program in Python, which is how the tests check them there. The interpreter has
no timer, so autotuned kernels take their first config there (`tuning`).
"""

from __future__ import annotations

import sys

import torch

__all__ = ["INTERPRET", "tl", "triton", "tuning"]

triton = tl = None  # no Triton (a CPU install), or no use for it: the CUDA paths then run PyTorch's ops
if torch.cuda.is_available() or "triton" in sys.modules:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        pass

# Triton's own reading of TRITON_INTERPRET. `triton.knobs` came with Triton 3.4: an older one (a GPU install's)
# just counts as compiling, and the tests' CPU runs take the newer one from the test extras.
_knobs = getattr(triton, "knobs", None)
INTERPRET = bool(_knobs is not None and _knobs.runtime.interpret)


def tuning(names: tuple[str, ...], rows: list[tuple[int, ...]]) -> list:
    """Autotuning configs, one per row: the values of the block sizes `names`, then the warps and, when given, the
    pipeline stages. All of them on a GPU; the first under the interpreter."""
    configs = []
    for row in rows:
        launch = dict(zip(("num_warps", "num_stages"), row[len(names) :], strict=False))
        configs.append(triton.Config(dict(zip(names, row[: len(names)], strict=True)), **launch))
    return configs[:1] if INTERPRET else configs
