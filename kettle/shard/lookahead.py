"""Overlap scheduling: the next decode step, computed while the router handles the last one.

Between two steps the router receives the tokens, hands them to the streams, drops what stopped and sends the
next call; on a small machine that round trip costs about a third of a decode step. So as soon as a call has
answered, the shard computes the next step of the batch it kept (forward and token choice, `PagedRunner.compute`)
and holds the result. When the router's next call is exactly that step (a Decode of the same batch, with the
same requests), the held result is applied and answered at once; any other call (new requests joining, a
request filtered out, a cleared cache) drops it first and the call runs as it always did.

Outputs stay exactly those of the plain path. The computed step changed nothing the call would see: request
state is only touched when the result is applied, the K/V rows it wrote are the ones the real step writes (and
lie in blocks the router has not handed to anyone else yet: it frees blocks only between calls, which the shard
serves in order after this step), and the sampling generators it moved are put back when it is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kettle.proto import generate_pb2 as pb
from kettle.shard.batch import Batch
from kettle.shard.runner import Computed, PagedRunner

logger = logging.getLogger(__name__)


@dataclass
class Lookahead:
    """One batch's next decode step, computed ahead of the call that asks for it."""

    batch_id: int
    request_ids: tuple[int, ...]
    computed: Computed
    generators: list[tuple[torch.Generator, torch.Tensor]]  # each sampling generator with its state before

    @classmethod
    def start(cls, runner: PagedRunner, batch: Batch) -> Lookahead | None:
        """Computes `batch`'s next step; None when it cannot be computed ahead (a prompt still in prefill needs
        the router's next chunk) or computing it failed (the real call will meet the failure and report it)."""
        if any(r.in_prefill for r in batch.requests):
            return None
        generators = [(r.generator, r.generator.get_state()) for r in batch.requests if r.params.sampling]
        try:
            computed = runner.compute(batch.requests)
        except Exception:
            logger.debug("the step computed ahead failed; the call will run it again", exc_info=True)
            _restore(generators)
            return None
        return cls(batch.id, tuple(r.id for r in batch.requests), computed, generators)

    def matches(self, batches: Sequence[pb.CachedBatch]) -> bool:
        """Whether a Decode of `batches` is exactly the step computed here."""
        if len(batches) != 1 or batches[0].chunk_lens:
            return False
        return batches[0].id == self.batch_id and tuple(batches[0].request_ids) == self.request_ids

    def drop(self) -> None:
        """Forgets the computed step: the generators go back to where the call will expect them."""
        _restore(self.generators)


def _restore(generators: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    for generator, state in generators:
        generator.set_state(state)
