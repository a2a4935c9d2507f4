"""The segment cache: KV of reusable text segments (documents, tool outputs, system prompts) kept in the paged pool.

A segment is content-addressed: its key hashes the model identity (`salt`),
a `namespace` (knowledge base, user, agent) and its token ids, so the same
tokens in the same namespace find the same KV wherever they appear in a
prompt, and two models or two tenants never share KV.

Its KV lives in whole blocks of the engine's pool, taken from the
`BlockManager` with the pool's layout (token i at slot
`blocks[i // block_size] * block_size + i % block_size`; the tail block is
partly filled). Filling is the caller's job: `insert` hands out blocks, the
engine writes the KV, then `mark_ready` makes the segment visible to `lookup`.

Eviction (`evict`, installed as `BlockManager.reclaim`, so a request short of
blocks evicts idle segments before it waits or preempts):

* Only idle segments go: not referenced (`refs == 0`, nobody is copying from
  them) and ready (a segment being filled is never evicted; `drop` it if the
  fill fails).
* Demand (`evict(n)`: a request, or an `insert`, needs `n` blocks that are not
  free): first unpinned idle segments, least recently used first; only if
  they do not cover the demand, pinned idle segments, least used first (fewest
  hits, then least recently used). A demand that free blocks cannot cover
  puts the pool, counted with the demand, above 100% and so above any
  watermark: that is the "beyond the watermark" case in which pinned segments
  yield. Eviction stops as soon as `n` blocks are freed, so pinned segments go
  only when live work would otherwise be refused.
* The cap (`cap` blocks, `EngineConfig.segment_cap` of the pool): an `insert` that would take the
  segments past it first evicts idle segments in the same order until it fits (a soft cap: if the
  held ones alone exceed it, the insert still goes ahead).
* `enforce_watermark()` (no demand; for the engine to call when it wants
  headroom, e.g. after inserts or when idle): while the pool's use (blocks not
  free / `num_blocks`) is above `watermark`, evict unpinned idle segments LRU,
  then pinned idle segments least-used first. At or below the watermark it
  evicts nothing, so pinned ("frozen") segments survive idle periods.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Collection, Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np

from sparsetune.engine.block_manager import BlockManager
from sparsetune.errors import SparsetuneError

_PERSON = b"sparsetune-seg1"  # blake2b personalisation: keys never collide with other blake2b uses


def _token_array(token_ids: SequenceOf[int]) -> np.ndarray:
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    return arr


def segment_key(token_ids: SequenceOf[int], namespace: str, salt: str) -> str:
    """Hex content hash of (salt, namespace, token ids).

    `salt` names the model and tokenizer (KV of one model is garbage to
    another); `namespace` keeps tenants apart. Both are length-prefixed, so no
    choice of strings can shift bytes from one field into the next; tokens are
    packed as little-endian int64 (exact and fast, unlike joining strings).
    """
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    for text in (salt, namespace):
        raw = text.encode("utf-8")
        h.update(struct.pack("<Q", len(raw)))
        h.update(raw)
    tokens = _token_array(token_ids).astype("<i8", copy=False)
    h.update(struct.pack("<Q", len(tokens)))
    h.update(tokens.tobytes())
    return h.hexdigest()


@dataclass(eq=False)
class Segment:
    """One cached segment. Identity matters (it is the cache's record), so no value equality."""

    key: str
    namespace: str
    token_ids: tuple[int, ...]
    blocks: list[int]  # whole pool blocks; the tail one holds num_tokens % block_size tokens (or is full)
    refs: int = 0  # requests copying from / reading the segment; > 0 → never evicted
    pinned: bool = False  # "frozen": survives idle eviction; yields only beyond the watermark
    hits: int = 0
    last_used: int = 0  # logical clock of the last lookup hit / insert / acquire
    ready: bool = False  # KV written by the engine; lookup only returns ready segments (False again once evicted)
    filling: bool = False  # its fill is queued or running (`reuse.executor.SegmentFill`)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class SegmentCache:
    """Segments' KV in pool blocks, with reference counts, pinning, LRU/LFU eviction and a watermark."""

    def __init__(self, blocks: BlockManager, block_size: int, salt: str, watermark: float = 0.9,
                 cap: int | None = None) -> None:
        if block_size != blocks.block_size:
            raise ValueError(f"block_size {block_size} differs from the pool's {blocks.block_size}")
        if not 0 < watermark <= 1:
            raise ValueError(f"watermark must be in (0, 1], got {watermark}")
        if blocks.reclaim is not None:
            raise RuntimeError("this BlockManager already has a reclaim callback (a second segment cache?)")
        self.blocks = blocks
        self.block_size = block_size
        self.salt = salt
        self.watermark = watermark
        self.cap = cap  # blocks stored segments may hold (None: the pool)
        self._segments: dict[str, Segment] = {}
        self._clock = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        blocks.reclaim = self.evict

    # -- keys and lookup ---------------------------------------------------

    def key(self, token_ids: SequenceOf[int], namespace: str) -> str:
        return segment_key(token_ids, namespace, self.salt)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def lookup(self, token_ids: SequenceOf[int], namespace: str) -> Segment | None:
        """The ready segment holding these tokens in this namespace, or None (a miss)."""
        seg = self._segments.get(self.key(token_ids, namespace))
        if seg is None or not seg.ready:
            self.misses += 1
            return None
        self.hits += 1
        seg.hits += 1
        seg.last_used = self._tick()
        return seg

    def __len__(self) -> int:
        return len(self._segments)

    def __contains__(self, seg: object) -> bool:
        return isinstance(seg, Segment) and self._segments.get(seg.key) is seg

    # -- insert and fill ---------------------------------------------------

    def insert(self, token_ids: SequenceOf[int], namespace: str, pinned: bool = False) -> Segment:
        """Blocks for a new segment (not ready until `mark_ready`); an existing key returns that segment.

        A returned segment that is not ready is being filled by whoever
        inserted it first. `pinned=True` also pins an existing segment.
        """
        arr = _token_array(token_ids)
        if len(arr) == 0:
            raise ValueError("a segment needs at least one token")
        key = self.key(arr, namespace)
        seg = self._segments.get(key)
        if seg is not None:
            seg.pinned = seg.pinned or pinned
            return seg
        need = -(-len(arr) // self.block_size)
        # an idle segment's block frees only if nobody else holds it (a prefix hit of a running request)
        reachable = self.blocks.num_free + sum(self.blocks.refs[b] == 1 for s in self._idle() for b in s.blocks)
        if need > reachable:
            raise SparsetuneError(
                f"a segment of {len(arr)} tokens needs {need} KV blocks but at most {reachable} of "
                f"{self.blocks.num_blocks} can be freed (the rest hold requests or segments in use); "
                f"raise --kv-memory or split the segment"
            )
        if self.cap is not None:  # idle segments beyond the cap go first, least recently used first
            held = sum(len(s.blocks) for s in self._segments.values())
            self._evict_while(lambda freed: held - freed + need > self.cap)
        seg = Segment(  # allocate evicts idle segments for the missing blocks (reclaim)
            key=key, namespace=namespace, token_ids=tuple(arr.tolist()), blocks=self.blocks.allocate(need),
            pinned=pinned, last_used=self._tick(),
        )
        self._segments[key] = seg
        return seg

    def start_fill(self, seg: Segment) -> None:
        """A fill of the segment is queued (a later lookup waits for it rather than fill it again)."""
        self._check_cached(seg)
        seg.filling = True

    def mark_ready(self, seg: Segment) -> None:
        """The engine has written the segment's KV: lookups may now return it."""
        self._check_cached(seg)
        seg.ready, seg.filling = True, False

    def unfill(self, seg: Segment) -> None:
        """Its queued fill will not run; dropped unless someone holds it."""
        seg.filling = False
        self._drop_orphan(seg)

    def get(self, key: str) -> Segment | None:
        """The segment stored under `key` (ready or not), without counting a lookup."""
        return self._segments.get(key)

    def drop(self, seg: Segment) -> None:
        """Remove a segment and free its blocks (e.g. its fill failed). It must not be referenced."""
        self._check_cached(seg)
        if seg.refs:
            raise RuntimeError(f"cannot drop segment {seg.key[:12]}: {seg.refs} reference(s) held")
        self._remove(seg)

    # -- references and pinning -------------------------------------------

    def acquire(self, seg: Segment) -> None:
        """Hold the segment (its blocks are being read); a held segment is never evicted."""
        self._check_cached(seg)
        seg.refs += 1
        seg.last_used = self._tick()

    def release(self, seg: Segment) -> None:
        """Let go of a held segment. The last holder of one that is neither filled nor being filled
        (its fill was cancelled) drops it: nobody would fill it, and eviction takes ready ones only."""
        if seg.refs <= 0:
            raise RuntimeError(f"release of segment {seg.key[:12]} without a matching acquire")
        seg.refs -= 1
        self._drop_orphan(seg)

    def _drop_orphan(self, seg: Segment) -> None:
        """A segment nobody holds, neither filled nor being filled, goes: nothing would fill it, and
        eviction takes ready ones only."""
        if not seg.refs and not seg.ready and not seg.filling and seg in self:
            self._remove(seg)

    def pin(self, seg: Segment) -> None:
        self._check_cached(seg)
        seg.pinned = True

    def unpin(self, seg: Segment) -> None:
        seg.pinned = False

    # -- eviction ------------------------------------------------------------

    def _idle(self) -> Iterable[Segment]:
        return (s for s in self._segments.values() if s.refs == 0 and s.ready)

    def _eviction_order(self) -> list[Segment]:
        """Idle segments in the order they go: unpinned by LRU, then pinned by fewest hits, then LRU."""
        idle = list(self._idle())
        unpinned = sorted((s for s in idle if not s.pinned), key=lambda s: s.last_used)
        pinned = sorted((s for s in idle if s.pinned), key=lambda s: (s.hits, s.last_used))
        return unpinned + pinned

    def evict(self, num_blocks: int) -> int:
        """Free at least `num_blocks` blocks if idle segments allow; return how many were freed.

        Demand eviction (also `BlockManager.reclaim`): unpinned idle segments
        LRU, then pinned idle segments least-used first, stopping once enough
        is freed. See the module docstring for why pinned ones may go here.
        """
        return self._evict_while(lambda freed: freed < num_blocks)

    def block_ids(self) -> set[int]:
        """The pool blocks the stored segments hold."""
        return {b for s in self._segments.values() for b in s.blocks}

    def clear(self, keep: Collection[str] = ()) -> int:
        """Evict every idle segment (pinned ones too) but those whose key is in `keep`; blocks freed."""
        freed = 0
        for seg in self._eviction_order():
            if seg.key not in keep:
                freed += self._remove(seg)
                self.evictions += 1
        return freed

    def usage(self) -> float:
        """Fraction of the pool's blocks in use (by anyone: requests and segments)."""
        return 1 - self.blocks.num_free / self.blocks.num_blocks

    def enforce_watermark(self) -> int:
        """Evict idle segments (unpinned LRU, then pinned least-used) until usage <= watermark; blocks freed."""
        return self._evict_while(lambda _: self.usage() > self.watermark)

    def _evict_while(self, more: Callable[[int], bool]) -> int:
        """Evict in `_eviction_order` while `more(blocks freed so far)` holds; blocks freed."""
        freed = 0
        for seg in self._eviction_order():
            if not more(freed):
                break
            freed += self._remove(seg)
            self.evictions += 1
        return freed

    def _remove(self, seg: Segment) -> int:
        del self._segments[seg.key]
        n = self.blocks.free_blocks(seg.blocks)
        seg.blocks = []
        seg.ready = False
        return n

    def _check_cached(self, seg: Segment) -> None:
        if self._segments.get(seg.key) is not seg:
            raise RuntimeError(f"segment {seg.key[:12]} is no longer in the cache (evicted or dropped)")

    # -- reporting ---------------------------------------------------------

    def stats(self) -> dict[str, int]:
        segs = self._segments.values()
        return {
            "segments": len(self._segments),
            "blocks": sum(len(s.blocks) for s in segs),
            "pinned": sum(s.pinned for s in segs),
            "referenced": sum(s.refs > 0 for s in segs),
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }
