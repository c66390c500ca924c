"""The KV block ledger: after every step, the blocks the pool counts as referenced must be exactly the blocks of
the live requests (plus those lent out for a moment, such as the health probe's).

A leak here is silent and fatal (the pool drains, then every long request waits forever), so the check runs
after every step. A mismatch is logged as an error and counted in `kettle_kv_ledger_violations`; tests assert
that the counter stays at 0.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

from kettle.router import metrics
from kettle.router.blocks import Allocation, Allocator
from kettle.router.queue import Entry

logger = logging.getLogger(__name__)


class BlockLedger:
    """Compares the allocator's references with the allocations of the live requests."""

    def __init__(self, allocator: Allocator) -> None:
        self._allocator = allocator
        self.lent: set[Allocation] = set()  # held outside the running set for a moment (the health probe)
        self.violations = 0

    def check(self, live: Iterable[Entry]) -> bool:
        """True when the ledger balances; otherwise logs what differs and counts a violation."""
        expected = Counter(b for e in live if e.allocation is not None for b in e.allocation.blocks)
        expected.update(b for allocation in self.lent for b in allocation.blocks)
        held = self._allocator.references()
        total = self._allocator.capacity // self._allocator.block_size
        if held == expected and self._allocator.free_blocks + len(held) == total:
            return True
        self.violations += 1
        metrics.KV_LEDGER_VIOLATIONS.inc()
        orphans = sorted(set(held) - set(expected))
        missing = sorted(set(expected) - set(held))
        logger.error(
            "KV block ledger out of balance: %d blocks held by no live request %s, %d live blocks not held %s, "
            "%d free + %d held of %d",
            len(orphans),
            orphans[:16],
            len(missing),
            missing[:16],
            self._allocator.free_blocks,
            len(held),
            total,
        )
        return False
