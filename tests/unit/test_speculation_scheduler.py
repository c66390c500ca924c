"""The scheduler with a shard that speculates: a decode step may bring several tokens per request (accepted
drafts). Every token reaches its stream once and in order, requests end at max_new_tokens, cancelled ones leave,
the counters add up, and no KV block leaks over 200 mixed requests."""

from __future__ import annotations

import asyncio
import random

from kettle.proto import generate_pb2 as pb
from kettle.router import metrics
from kettle.router.blocks import BlockAllocator
from kettle.router.config import SchedulerConfig
from kettle.router.queue import Queue
from kettle.router.scheduler import Scheduler
from kettle.router.types import TokenEvent
from tests.unit.fake_client import FakeClient, make_entry


class SpeculatingClient(FakeClient):
    """A fake shard whose decodes accept 0-3 drafts per request and step (never past max_new_tokens)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.random = random.Random(seed)

    def _next_token(self, request_id: int, first: bool = False) -> pb.Generation:
        generation = super()._next_token(request_id, first)
        left = self.requests[request_id].stopping_parameters.max_new_tokens - self.generated[request_id]
        drafted = 0 if first else min(3, left)
        accepted = self.random.randint(0, drafted)
        for _ in range(accepted):
            generation.ClearField("generated_text")
            more = super()._next_token(request_id)
            generation.tokens.ids.extend(more.tokens.ids)
            generation.tokens.logprobs.extend(more.tokens.logprobs)
            generation.tokens.texts.extend(more.tokens.texts)
            generation.tokens.is_special.extend(more.tokens.is_special)
            if more.HasField("generated_text"):
                generation.generated_text.CopyFrom(more.generated_text)
        generation.draft_tokens, generation.accepted_tokens = drafted, accepted
        return generation


def tokens_of(entry) -> list[int]:
    items = []
    while not entry.channel.empty():
        items.append(entry.channel.get_nowait())
    return [e.token.id for e in items if isinstance(e, TokenEvent)]


def test_multi_token_steps_over_200_mixed_requests_leak_no_block():
    async def main():
        client = SpeculatingClient(seed=7)
        config = SchedulerConfig(block_size=4, num_blocks=256, max_batch_prefill_tokens=32, max_batch_total_tokens=1024)
        allocator = BlockAllocator(256, 4)
        queue = Queue(allocator, config.max_batch_total_tokens, config.max_batch_prefill_tokens, True)
        scheduler = Scheduler(client, queue, allocator, config)
        rng = random.Random(3)
        entries = [make_entry(i, input_len=rng.randint(1, 12), max_new=rng.randint(1, 12)) for i in range(200)]
        drafted, accepted = (
            metrics.SPECULATIVE_DRAFT_TOKENS._value.get(),
            metrics.SPECULATIVE_ACCEPTED_TOKENS._value.get(),
        )
        pending, steps = list(entries), 0
        while pending or scheduler.running or len(queue):
            for _ in range(rng.randint(0, 4)):
                if pending:
                    queue.append(pending.pop(0))
            if rng.random() < 0.05 and scheduler.running:
                rng.choice(entries[: 200 - len(pending)]).cancelled = True
            await scheduler.step()
            assert scheduler.ledger.check(scheduler._running.values())
            steps += 1
            assert steps < 5000
        assert allocator.free_blocks == 256
        for entry in entries:
            got = tokens_of(entry)
            assert got == list(range(1, len(got) + 1))  # once each, in order
            if not entry.cancelled:
                assert len(got) == entry.request.stopping.max_new_tokens
        assert metrics.SPECULATIVE_ACCEPTED_TOKENS._value.get() > accepted
        assert metrics.SPECULATIVE_DRAFT_TOKENS._value.get() > drafted

    asyncio.run(main())
