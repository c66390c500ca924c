"""The tensor-parallel process group of a shard: who this rank is, and the few collectives the layers need.

Every shard process is one rank of one `torch.distributed` group (gloo on the CPU, NCCL on CUDA), formed from
the `MASTER_ADDR` / `MASTER_PORT` variables the launcher sets. The group is process-wide state in
torch.distributed anyway, so the shard records it here once (`set_current`) and the model loaders read it
through `Weights.tp` without any loader signature changing. At world size 1 nothing is initialised and every
collective is a no-op, so a single shard runs exactly the code it ran before tensor parallelism existed.

Nothing may hang forever: the group has a timeout (`KETTLE_DISTRIBUTED_TIMEOUT`, seconds), after which a
collective waiting on a rank that stopped answering fails; a rank that dies outright closes its connections,
so its peers fail at once. A shard whose collective fails exits (`_or_exit`), and each launcher's supervisor
stops its server when any of its shards exits.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kettle import settings

log = logging.getLogger(__name__)

# Exit code of a shard whose tensor-parallel peers are gone.
PEER_LOST_EXIT = 3


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group; `group` is None at world size 1 (no collectives)."""

    rank: int = 0
    world_size: int = 1
    group: object | None = None
    device: torch.device | None = None  # where small collective tensors live (None: CPU)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.world_size > 1 and self.group is None:
            raise ValueError("a tensor-parallel context with several ranks needs a process group")

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks in place (row-parallel outputs, vocab-parallel embeddings)."""
        if self.sharded:
            _or_exit(lambda: dist.all_reduce(x, group=self.group))
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's `x` along the last dimension, in rank order (same shape on every rank)."""
        if not self.sharded:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        _or_exit(lambda: dist.all_gather(parts, x.contiguous(), group=self.group))
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks, so all ranks run the same shapes)."""
        if not self.sharded:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        _or_exit(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group))
        return int(tensor.item())


def _or_exit(collective) -> None:
    """Runs a collective; if it fails (a peer died, or stopped answering past the timeout) the group is broken
    for good, so this shard exits at once: its launcher then stops the server with a clear log line, even when
    the dead peer belonged to another host's launcher (--nnodes), instead of serving errors forever."""
    try:
        collective()
    except RuntimeError as error:
        log.critical("Tensor-parallel collective failed, a peer shard is gone or stuck; exiting: %s", error)
        logging.shutdown()
        os._exit(PEER_LOST_EXIT)


_current = TensorParallel()


def current() -> TensorParallel:
    """The group this process joined (`init_distributed`), or the single-rank context."""
    return _current


def set_current(tp: TensorParallel) -> None:
    global _current
    _current = tp


def timeout() -> timedelta:
    """The collectives' timeout: KETTLE_DISTRIBUTED_TIMEOUT seconds, else 300 (`kettle.settings`)."""
    return timedelta(seconds=settings.current().distributed_timeout_s)


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(rank: int, world_size: int, device: torch.device) -> TensorParallel:
    """Joins the launcher's group (env:// rendezvous at MASTER_ADDR:MASTER_PORT) and makes it current.

    World size 1 joins nothing. Blocks until every rank has joined, or fails after the timeout. Joining the
    group this process already belongs to returns it again.
    """
    if (_current.rank, _current.world_size) == (rank, world_size) and (world_size == 1 or dist.is_initialized()):
        return _current
    if world_size == 1:
        tp = TensorParallel(device=device)
    else:
        backend = backend_for(device)
        extra = {"device_id": device} if device.type == "cuda" else {}
        log.info(
            "Rank %d/%d joining the %s group at %s:%s",
            rank,
            world_size,
            backend,
            os.environ.get("MASTER_ADDR", "localhost"),
            os.environ.get("MASTER_PORT", "29500"),
        )
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout(), **extra)
        tp = TensorParallel(rank, world_size, dist.group.WORLD, device)
    set_current(tp)
    return tp


def shutdown() -> None:
    """Leaves the group (at the end of a clean stop); harmless when none was joined."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    set_current(TensorParallel())
