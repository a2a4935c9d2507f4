"""Hands out KV blocks to sequences (and to other owners, such as the segment cache) and takes them back.

Owners other than sequences (the segment cache of `sparsetune.reuse`) take
blocks with `allocate` and give them back with `free_blocks`. Such an owner may
also hold blocks it can give up on demand (idle cached segments); it installs
`reclaim`, and whenever a request for blocks finds too few free ones, the
manager calls `reclaim(missing)` before deciding. The scheduler thus makes room
by evicting idle segments without knowing that segments exist.

Prefix caching (`prefix_caching=True`): every full block a sequence has computed gets a chain hash
(the previous block's hash + this block's token ids, as vLLM and nano-vllm hash blocks), and a new
sequence whose prompt starts with the same blocks takes those blocks (reference-counted) instead
of computing them again. A block whose last holder finishes goes back to the free list but keeps
its hash until it is handed out again, so a later request can still find it (LRU by free order).
The chain starts from the sequence's `cache_salt` (a namespace: prompts of different salts never
share blocks, as SGLang's `cache_salt`). A stored segment's fill (`sparsetune.reuse`) is a prefill at
position 0 salted by its namespace, so its full blocks are found as a prefix too; KV a reuse flow
approximated is never hashed (`Sequence.cacheable`).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Collection

import numpy as np

from sparsetune.engine.sequence import Sequence


class BlockManager:
    # Called with the number of blocks missing; frees up to that many (or more) and returns how many it freed.
    reclaim: Callable[[int], int] | None

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.reclaim = None
        self.prefix_caching = prefix_caching
        self.refs = [0] * num_blocks
        self.block_hash: dict[int, bytes] = {}  # full, computed block → its chain hash
        self.by_hash: dict[bytes, int] = {}  # chain hash → block
        self.prefix_hits = 0  # blocks taken from the prefix cache

    def _take(self) -> int:
        """A free block for a new holder; a cached one loses its hash (its contents will change)."""
        block = self.free.popleft()
        h = self.block_hash.pop(block, None)
        if h is not None and self.by_hash.get(h) == block:
            del self.by_hash[h]
        self.refs[block] = 1
        return block

    def _put(self, blocks: list[int]) -> int:
        """Give back one reference to each block; returns how many became free."""
        freed = 0
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] < 0:
                raise RuntimeError(f"block {b} released more often than taken")
            if self.refs[b] == 0:
                self.free.append(b)
                freed += 1
        return freed

    @property
    def num_free(self) -> int:
        return len(self.free)

    def _make_room(self, need: int) -> bool:
        """True when `need` blocks are free, after asking `reclaim` for the missing ones."""
        missing = need - len(self.free)
        if missing > 0 and self.reclaim is not None:
            self.reclaim(missing)
        return need <= len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: the pool's admission rule (`perf.admission` checks runs by it)."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs to hold `num_tokens` tokens in total."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can grow to `num_tokens`; may reclaim (evict idle segments) to make it so."""
        return self._make_room(self.blocks_needed(seq, num_tokens))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if not self._make_room(need):
            raise RuntimeError("out of KV blocks; call can_grow first")
        seq.block_table.extend(self._take() for _ in range(need))

    def release(self, seq: Sequence) -> None:
        self._put(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.block_hashes = []

    # ---- prefix caching -------------------------------------------------------------------------

    def _chain(self, prev: bytes, tokens: list[int]) -> bytes:
        return hashlib.blake2b(prev + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()

    def match_prefix(self, seq: Sequence) -> int:
        """Give a new sequence the cached blocks its prompt starts with; returns the tokens covered.

        At least the prompt's last token is left to compute (its logits give the first output)."""
        if not self.prefix_caching or seq.block_table or seq.num_computed:
            return 0
        bs, prev = self.block_size, seq.cache_salt
        for i in range((seq.num_tokens - 1) // bs):
            h = self._chain(prev, seq.token_ids[i * bs : (i + 1) * bs])
            block = self.by_hash.get(h)
            if block is None:
                break
            if self.refs[block] == 0:
                self.free.remove(block)  # revive a cached free block
            self.refs[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            prev = h
        self.prefix_hits += len(seq.block_table)
        seq.num_computed = len(seq.block_table) * bs
        if not seq.num_preemptions:  # a preempted one finds its own blocks again: not a hit of its prompt
            seq.num_cached_tokens = seq.num_computed
        return seq.num_computed

    def forget_prefixes(self, keep: Collection[int] = ()) -> None:
        """Drop the hash of every block but those in `keep` (the blocks stay where they are): no later
        prompt finds them."""
        self.block_hash = {b: h for b, h in self.block_hash.items() if b in keep}
        self.by_hash = {h: b for h, b in self.by_hash.items() if b in keep}

    def commit(self, seq: Sequence) -> None:
        """Hash the sequence's newly computed full blocks so later prompts can find them (not those
        of a sequence whose KV a reuse flow approximated: `seq.cacheable` is False)."""
        if not self.prefix_caching or not seq.cacheable:
            return
        bs = self.block_size
        prev = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt
        for i in range(len(seq.block_hashes), min(seq.num_computed, seq.num_tokens) // bs):
            h = self._chain(prev, seq.token_ids[i * bs : (i + 1) * bs])
            block = seq.block_table[i]
            seq.block_hashes.append(h)
            if h not in self.by_hash:  # the first block with these contents is the one found
                self.by_hash[h] = block
                self.block_hash[block] = h
            prev = h

    def allocate(self, n: int) -> list[int]:
        """`n` blocks for an owner that is not a sequence; may reclaim to find them."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if not self._make_room(n):
            raise RuntimeError(f"out of KV blocks: {n} wanted, {len(self.free)} free")
        return [self._take() for _ in range(n)]

    def free_blocks(self, blocks: list[int]) -> int:
        """Take back blocks handed out by `allocate`; returns how many became free (a block a request
        also holds, as a prefix hit, stays taken)."""
        return self._put(blocks)
