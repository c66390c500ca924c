"""KV block allocation: which blocks of the shards' paged KV cache each request owns.

The router decides, the shards obey: a request gets all the blocks it can ever need at admission
(prompt + max_new_tokens), so a running request never has to be preempted for memory. The `Allocator`
protocol is what the queue and scheduler depend on, so a prefix-caching allocator (which hands out blocks
already holding a shared prompt prefix and reports it as `cache_len`) can replace `BlockAllocator`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Allocation:
    """The KV blocks of one request and the cache slot of each of its tokens."""

    blocks: tuple[int, ...]
    slots: tuple[int, ...]
    # Prompt tokens whose K/V these blocks already hold (a shared prefix); always 0 without prefix caching.
    cache_len: int = 0


class Allocator(Protocol):
    """What the queue and scheduler need from a KV block allocator."""

    block_size: int

    @property
    def free_blocks(self) -> int: ...

    @property
    def capacity(self) -> int:
        """Tokens the whole cache holds: no request longer than this can ever run."""
        ...

    def allocate(
        self,
        n_tokens: int,
        prompt_ids: Sequence[int] = (),
        reuse: bool = True,
        namespace: str = "",
        images: Sequence[tuple[int, bytes]] = (),
    ) -> Allocation | None:
        """`namespace`: K/V computed under it (a LoRA adapter) is shared only with prompts of the same one.
        `images`: (first token, digest) of each image of the prompt, whose tokens are all the same id."""
        ...

    def commit(self, allocation: Allocation) -> None:
        """The prefill of `allocation` has written its prompt's K/V: its full prompt blocks may be shared."""
        ...

    def free(self, allocation: Allocation) -> None: ...

    def references(self) -> dict[int, int]:
        """Each block some allocation holds, with how many hold it (checked by the block ledger)."""
        ...


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `n_tokens` tokens."""
    return -(-n_tokens // block_size)


def slots_for(blocks: Sequence[int], n_tokens: int, block_size: int) -> tuple[int, ...]:
    """The cache slot of each token: block b holds slots b*block_size .. b*block_size+block_size-1."""
    slots = [b * block_size + i for b in blocks for i in range(block_size)]
    return tuple(slots[:n_tokens])


class BlockAllocator:
    """A free list over blocks 0..num_blocks-1: no sharing, no eviction.

    Blocks are handed out lowest-first and returned to the back of the list, so the order is deterministic
    (tests and logs can name blocks) and recently freed blocks are reused last.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    def allocate(
        self,
        n_tokens: int,
        prompt_ids: Sequence[int] = (),
        reuse: bool = True,
        namespace: str = "",
        images: Sequence[tuple[int, bytes]] = (),
    ) -> Allocation | None:
        """Blocks for `n_tokens` tokens, or None when too few are free (the caller waits and retries).

        `prompt_ids`, `reuse` and `namespace` are unused here; a prefix-caching allocator matches the prompt
        against cached blocks.
        """
        if n_tokens < 1:
            raise ValueError(f"cannot allocate {n_tokens} tokens")
        needed = blocks_for(n_tokens, self.block_size)
        if needed > len(self._free):
            return None
        blocks = tuple(self._free.popleft() for _ in range(needed))
        self._used.update(blocks)
        return Allocation(blocks, slots_for(blocks, n_tokens, self.block_size))

    def commit(self, allocation: Allocation) -> None:
        """Nothing to do: no block is ever shared."""

    def references(self) -> dict[int, int]:
        return dict.fromkeys(self._used, 1)

    def free(self, allocation: Allocation) -> None:
        """Returns the blocks of `allocation`; freeing a block twice is a bug and raises."""
        foreign = [b for b in allocation.blocks if b not in self._used]
        if foreign:
            raise ValueError(f"blocks {foreign} are not allocated")
        self._used.difference_update(allocation.blocks)
        self._free.extend(allocation.blocks)
