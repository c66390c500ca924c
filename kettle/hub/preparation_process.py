"""What the model's preparation process (kettle/launcher/prepare.py) sets up for itself: it is short-lived and never
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

And one it must not do. A stop (SIGTERM from the launcher, or Ctrl-C) unwinds the process as KeyboardInterrupt, so a
conversion removes its temporary folder. Raised while torch's import runs Python from C++ (pybind11 callbacks), the
exception reaches C++ code that cannot pass it on: `terminate called after throwing an instance of
'pybind11::error_already_set'`, an abort that leaves the folder and its lock behind (seen once in a few dozen runs
of the launcher's stop test under load). Interrupted halfway, an import can also leave an extension that refuses a
second load (numpy's). So a stop that arrives during the first import of torch or of transformers (~1.5 s and ~1 s)
is held and raised once that import is done.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.abc
import importlib.machinery
import signal
import sys
from collections.abc import Iterator


class _BeforeTransformers(importlib.abc.MetaPathFinder):
    """Finds nothing; the first import of transformers first marks torch.distributed unavailable."""

    def find_spec(self, name, path, target=None):
        if name == "transformers":
            sys.meta_path.remove(self)
            with _stops_held():  # torch.distributed's import runs C++ too
                import torch.distributed

            torch.distributed.is_available = lambda: False
        return None


class _StopsHeldDuring(importlib.abc.MetaPathFinder):
    """Finds each of `names` where the path finder does, the first time, with a loader that runs its module under
    `_stops_held`."""

    def __init__(self, *names: str) -> None:
        self.names = set(names)

    def find_spec(self, name, path, target=None):
        if name not in self.names:
            return None
        self.names.discard(name)
        if not self.names:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _HeldLoader(spec.loader)
        return spec


class _HeldLoader(importlib.abc.Loader):
    """A module's own loader, its code run with stops held; anything else asked of it (resources, source) is the
    original's."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        with _stops_held():
            self._loader.exec_module(module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


_stops = {"held": False, "pending": False}


def _stop(signum: int, frame) -> None:
    """SIGINT and SIGTERM: KeyboardInterrupt now, or once `_stops_held` ends."""
    if _stops["held"]:
        _stops["pending"] = True
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def _stops_held() -> Iterator[None]:
    """A stop that arrives inside the block is raised as KeyboardInterrupt when the block is done."""
    outer, _stops["held"] = _stops["held"], True
    try:
        yield
    finally:
        _stops["held"] = outer
    if _stops["pending"] and not outer:
        _stops["pending"] = False
        raise KeyboardInterrupt


def set_up() -> None:
    """Called first in the preparation's process: no cyclic collection, torch.distributed unavailable from
    transformers' first import on (only a preparation that converts imports them; a later start's look-up
    imports neither), and SIGINT and SIGTERM (the launcher's stop) raised as KeyboardInterrupt, except during
    the first imports of torch and transformers, which they wait for."""
    gc.disable()
    # _BeforeTransformers first: it finds nothing, and transformers' import then goes on to the held loader
    sys.meta_path[:0] = [_BeforeTransformers(), _StopsHeldDuring("torch", "transformers")]
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
