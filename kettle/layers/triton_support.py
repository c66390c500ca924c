"""Triton where it is installed (the CUDA kernels' modules import it from here), and whether its interpreter runs.

With TRITON_INTERPRET=1, Triton runs kernels on CPU tensors, program by program in Python: that is how the tests
check the CUDA kernels on machines without a GPU (tests/conftest.py turns it on there). The interpreter has no
timer, so autotuned kernels take their first config there (`tuning`).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the CUDA backends then hand everything to PyTorch's ops
    triton = tl = None

# Triton's own reading of TRITON_INTERPRET. `triton.knobs` came with Triton 3.4: an older one (a GPU install's)
# just counts as compiling, and the tests' CPU runs take the newer one from the test extras.
_knobs = getattr(triton, "knobs", None)
INTERPRET = bool(_knobs is not None and _knobs.runtime.interpret)


def tuning(configs: list) -> list:
    """Autotuning configs: all of them on a GPU, the first under the interpreter."""
    return configs[:1] if INTERPRET else configs
