"""Prefix caching: KV blocks that hold a prompt's full blocks outlive the request, for later prompts to reuse.

A full block of prompt tokens is named by a chained hash: the hash of the previous block's hash and the block's
own token ids, so equal hashes mean equal whole prefixes, not just equal blocks. After a request's prefill the
router `commit`s its full prompt blocks under those hashes; a later prompt that starts with the same blocks gets
them back (reference counted, read-only) and reports them as `Allocation.cache_len`, so the shard computes only
the rest. Blocks no running request references stay cached until free blocks run out, then are evicted least
recently used first.

Only blocks the prompt wrote entirely are shared: the block that receives generated tokens stays private, and a
reused prefix is whole blocks, so a request never writes into a block someone else reads.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

from kettle.router.blocks import Allocation, blocks_for, slots_for

BlockHash = bytes


def block_hashes(
    prompt_ids: Sequence[int], block_size: int, namespace: str = "", images: Sequence[tuple[int, bytes]] = ()
) -> list[BlockHash]:
    """Chained hashes of the full blocks of `prompt_ids` (a trailing partial block has none).

    BLAKE2b rather than Python's `hash`: a collision would hand a request another prompt's K/V, silently. The
    chain starts from the namespace (a LoRA adapter's name): the same prompt under another adapter has other K/V.
    An image's tokens are one id repeated, whatever the image: its digest (`images`: first token, digest) joins
    the hash of the block that holds its first token, and the chain carries it to every later block.
    """
    hashes: list[BlockHash] = []
    previous = namespace.encode("utf-8", "surrogatepass")
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        tokens = array("q", prompt_ids[start : start + block_size]).tobytes()
        digests = b"".join(digest for first, digest in images if start <= first < start + block_size)
        previous = hashlib.blake2b(previous + tokens + digests, digest_size=16).digest()
        hashes.append(previous)
    return hashes


class PrefixCachingAllocator:
    """An `Allocator` over blocks 0..num_blocks-1 that shares and keeps full prompt blocks.

    Every block is in exactly one state: free (never committed, or dropped), referenced by running requests
    (`_refs`), or cached and unreferenced (`_evictable`, oldest first). `_cached` maps a hash to the block that
    holds it, and `_hash_of` the other way, for every committed block, referenced or not.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        # The prompt block hashes of each live allocation, committed once its prefill has written them.
        self._pending: dict[Allocation, list[BlockHash]] = {}

    @property
    def free_blocks(self) -> int:
        """Blocks a new request can take: free ones plus cached ones nobody references (evicted on demand)."""
        return len(self._free) + len(self._evictable)

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def cached_blocks(self) -> int:
        """Committed blocks, referenced or not."""
        return len(self._cached)

    def allocate(
        self,
        n_tokens: int,
        prompt_ids: Sequence[int] = (),
        reuse: bool = True,
        namespace: str = "",
        images: Sequence[tuple[int, bytes]] = (),
    ) -> Allocation | None:
        """Blocks for `n_tokens` tokens, starting with the cached blocks of the longest matching prompt prefix.

        None when too few blocks are free even after evicting every unreferenced cached block (the caller
        waits). `reuse=False` (a request that needs logprobs of every prompt token) skips the lookup; its
        blocks are still committed for later requests.
        """
        if n_tokens < 1:
            raise ValueError(f"cannot allocate {n_tokens} tokens")
        hashes = block_hashes(prompt_ids, self.block_size, namespace, images)
        hits = self._lookup(hashes, len(prompt_ids)) if reuse else []
        fresh = blocks_for(n_tokens, self.block_size) - len(hits)
        reclaimable = len(self._free) + len(self._evictable) - sum(b in self._evictable for b in hits)
        if fresh > reclaimable:
            return None
        for block in hits:
            self._acquire(block)
        blocks = (*hits, *(self._take_fresh() for _ in range(fresh)))
        allocation = Allocation(blocks, slots_for(blocks, n_tokens, self.block_size), len(hits) * self.block_size)
        self._pending[allocation] = hashes
        return allocation

    def _lookup(self, hashes: list[BlockHash], prompt_len: int) -> list[int]:
        """The cached blocks of the longest prefix, leaving the last prompt token to compute (it gives the logits)."""
        usable = (prompt_len - 1) // self.block_size
        hits: list[int] = []
        for block_hash in hashes[:usable]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _acquire(self, block: int) -> None:
        self._evictable.pop(block, None)
        self._refs[block] = self._refs.get(block, 0) + 1

    def _take_fresh(self) -> int:
        """A never-shared block: a free one, else the least recently used unreferenced cached one."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def commit(self, allocation: Allocation) -> None:
        """Makes the full prompt blocks of `allocation` reusable; call once its prefill has written them.

        A hash already cached in another block (two equal prompts prefilled together) keeps that block; this
        allocation's copy stays private and goes back to the free list when it ends.
        """
        hashes = self._pending.pop(allocation, [])
        for block, block_hash in zip(allocation.blocks, hashes, strict=False):
            if block in self._hash_of or block_hash in self._cached:
                continue
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash

    def references(self) -> dict[int, int]:
        """Referenced blocks and their counts; cached blocks nobody references are not among them."""
        return dict(self._refs)

    def free(self, allocation: Allocation) -> None:
        """Drops one reference to each block; unreferenced committed blocks stay cached, the others are freed.

        Blocks are released last first, so a chain's tail is evicted before its head: a head alone still serves
        a shorter prefix, a tail without its head serves nothing.
        """
        foreign = [b for b in allocation.blocks if b not in self._refs]
        if foreign:
            raise ValueError(f"blocks {foreign} are not allocated")
        self._pending.pop(allocation, None)
        for block in reversed(allocation.blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            del self._refs[block]
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)
