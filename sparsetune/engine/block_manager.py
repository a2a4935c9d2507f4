"""Hands out KV blocks to sequences (and to other owners, such as the segment cache) and takes them back.

Owners other than sequences (the segment cache of `sparsetune.reuse`) take
blocks with `allocate` and give them back with `free_blocks`. Such an owner may
also hold blocks it can give up on demand (idle cached segments); it installs
`reclaim`, and whenever a request for blocks finds too few free ones, the
manager calls `reclaim(missing)` before deciding. The scheduler thus makes room
by evicting idle segments without knowing that segments exist.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from sparsetune.engine.sequence import Sequence


class BlockManager:
    # Called with the number of blocks missing; frees up to that many (or more) and returns how many it freed.
    reclaim: Callable[[int], int] | None = None

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.reclaim = None

    @property
    def num_free(self) -> int:
        return len(self.free)

    def _make_room(self, need: int) -> bool:
        """True when `need` blocks are free, after asking `reclaim` for the missing ones."""
        missing = need - len(self.free)
        if missing > 0 and self.reclaim is not None:
            self.reclaim(missing)
        return need <= len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs to hold `num_tokens` tokens in total."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can grow to `num_tokens`; may reclaim (evict idle segments) to make it so."""
        return self._make_room(self.blocks_needed(seq, num_tokens))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if not self._make_room(need):
            raise RuntimeError("out of KV blocks; call can_grow first")
        seq.block_table.extend(self.free.popleft() for _ in range(need))

    def release(self, seq: Sequence) -> None:
        self.free.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0

    def allocate(self, n: int) -> list[int]:
        """`n` blocks for an owner that is not a sequence; may reclaim to find them."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if not self._make_room(n):
            raise RuntimeError(f"out of KV blocks: {n} wanted, {len(self.free)} free")
        return [self.free.popleft() for _ in range(n)]

    def free_blocks(self, blocks: list[int]) -> None:
        """Take back blocks handed out by `allocate`."""
        self.free.extend(blocks)
