"""What the model's preparation process (kettle/launcher/prepare.py) turns off, because it is short-lived and never
runs a process group.

A first start of a GGUF file waits for this process: on a 2-core machine its ~4.3 s are most of the start, and its
imports of torch and transformers are most of those. Two costs in it buy nothing there:
- transformers 5 imports `torch.distributed.tensor` (and with it sympy and torch.fx's symbolic shapes) with its
  model config classes wherever `torch.distributed.is_available()`, for tensor-parallel loading the preparation
  never does: ~0.7 s. The process reports torch.distributed as unavailable, which transformers asks before those
  imports. Only here: the shards' tensor parallelism uses torch.distributed, and they never run this.
- Python's cyclic garbage collector walks every object the imports made each time the metadata's parse (hundreds
  of thousands of strings) fills a generation: the parse of a 1.7B file's vocabulary and merges took 0.35-0.6 s
  with it, 0.22 s without. What the process allocates goes with it when it exits, moments later.
"""

from __future__ import annotations

import gc
import importlib.abc
import sys


class _BeforeTransformers(importlib.abc.MetaPathFinder):
    """Finds nothing; the first import of transformers first marks torch.distributed unavailable."""

    def find_spec(self, name, path, target=None):
        if name == "transformers":
            sys.meta_path.remove(self)
            import torch.distributed

            torch.distributed.is_available = lambda: False
        return None


def set_up() -> None:
    """Called first in the preparation's process: no cyclic collection, and torch.distributed unavailable from
    transformers' first import on (only a preparation that converts imports them; a later start's look-up
    imports neither)."""
    gc.disable()
    sys.meta_path.insert(0, _BeforeTransformers())
