"""The segment cache: content keys, refcounts, pinning, eviction order, and reclaim through the BlockManager."""

from __future__ import annotations

import pytest
import torch

from sparsetune.engine.block_manager import BlockManager
from sparsetune.engine.kv_cache import KVCache
from sparsetune.engine.scheduler import Scheduler
from sparsetune.engine.sequence import SamplingParams, Sequence
from sparsetune.errors import SparsetuneError
from sparsetune.reuse.segment_cache import SegmentCache, segment_key

BS = 4
SALT = "smollm2-135m|tok:abc"


def _cache(num_blocks: int = 16, watermark: float = 0.9) -> tuple[BlockManager, SegmentCache]:
    bm = BlockManager(num_blocks, BS)
    return bm, SegmentCache(bm, BS, SALT, watermark=watermark)


def _ready(cache: SegmentCache, tokens, ns: str = "kb", pinned: bool = False):
    seg = cache.insert(tokens, ns, pinned=pinned)
    cache.mark_ready(seg)
    return seg


def _seq(n: int) -> Sequence:
    return Sequence(list(range(n)), SamplingParams(max_tokens=1))


def test_key_is_content_addressed_and_separates_namespace_salt_tokens():
    toks = [5, 17, 300000, 2]
    k = segment_key(toks, "kb", SALT)
    assert k == segment_key(tuple(toks), "kb", SALT) == segment_key(torch.tensor(toks), "kb", SALT)
    assert k != segment_key(toks, "user-2", SALT)
    assert k != segment_key(toks, "kb", "other-model|tok:abc")
    assert k != segment_key([5, 17, 300000, 3], "kb", SALT)
    assert k != segment_key([17, 5, 300000, 2], "kb", SALT)  # order matters
    assert k != segment_key(toks[:3], "kb", SALT)
    # Length-prefixed fields: moving characters between salt and namespace changes the key.
    assert segment_key(toks, "ab", "c") != segment_key(toks, "b", "ca")


def test_lookup_hits_misses_and_not_ready():
    _, cache = _cache()
    assert cache.lookup([1, 2, 3], "kb") is None
    seg = cache.insert([1, 2, 3], "kb")
    assert cache.lookup([1, 2, 3], "kb") is None  # not filled yet
    assert cache.insert([1, 2, 3], "kb") is seg  # same key → same segment
    cache.mark_ready(seg)
    assert cache.lookup([1, 2, 3], "kb") is seg
    assert cache.lookup([1, 2, 3], "other") is None
    assert seg.hits == 1
    st = cache.stats()
    assert (st["hits"], st["misses"], st["segments"], len(cache)) == (1, 3, 1, 1)


def test_blocks_ceil_and_returned_on_eviction():
    bm, cache = _cache(num_blocks=16)
    for n, want in [(1, 1), (4, 1), (5, 2), (9, 3)]:
        seg = _ready(cache, list(range(100 * n, 100 * n + n)))
        assert len(seg.blocks) == want and seg.num_tokens == n
    assert bm.num_free == 16 - 7 and cache.stats()["blocks"] == 7
    assert cache.evict(100) == 7
    assert bm.num_free == 16 and len(cache) == 0 and sorted(bm.free) == list(range(16))
    assert seg.blocks == [] and not seg.ready


def test_slot_mapping_matches_pool_layout():
    bm, cache = _cache(num_blocks=8)
    bm.allocate(3)  # the segment does not start at block 0
    seg = cache.insert(list(range(10)), "kb")
    kv = KVCache(1, 8, 2, BS, 8, torch.float32, "cpu")
    slots = kv.slots(torch.tensor(seg.blocks), torch.arange(10)).tolist()
    assert slots == [seg.blocks[i // BS] * BS + i % BS for i in range(10)]
    k, v = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    kv.store(0, k, v, torch.tensor(slots))
    gk, gv = kv.gather(0, torch.tensor(seg.blocks), 10)
    assert torch.equal(gk, k.transpose(0, 1)) and torch.equal(gv, v.transpose(0, 1))


def test_lru_order_and_refs_protect():
    bm, cache = _cache(num_blocks=4)
    a, b, c, d = (_ready(cache, [i] * BS) for i in range(4))  # one block each; pool full
    cache.lookup([0] * BS, "kb")  # a is now the most recent
    cache.acquire(b)  # b is in use
    assert cache.evict(1) == 1 and c not in cache  # c is the least recent idle one
    assert cache.evict(1) == 1 and d not in cache
    assert cache.evict(1) == 1 and a not in cache
    assert cache.evict(1) == 0 and b in cache  # referenced: never evicted
    with pytest.raises(RuntimeError):
        cache.drop(b)
    cache.release(b)
    assert cache.evict(1) == 1 and len(cache) == 0 and bm.num_free == 4
    assert cache.stats()["evictions"] == 4


def test_filling_segment_is_not_evicted_and_drop_frees():
    bm, cache = _cache(num_blocks=4)
    seg = cache.insert(list(range(8)), "kb")  # not ready: the engine is writing it
    assert cache.evict(4) == 0 and seg in cache
    cache.drop(seg)
    assert bm.num_free == 4 and len(cache) == 0
    with pytest.raises(RuntimeError):
        cache.mark_ready(seg)


def test_release_below_zero_raises():
    _, cache = _cache()
    seg = _ready(cache, [1, 2])
    cache.acquire(seg)
    cache.release(seg)
    with pytest.raises(RuntimeError):
        cache.release(seg)


def test_pinned_survive_demand_when_unpinned_suffice_then_go_least_used_first():
    bm, cache = _cache(num_blocks=6)
    p_hot = _ready(cache, [1] * BS, pinned=True)
    p_cold = _ready(cache, [2] * BS, pinned=True)
    p_cold2 = _ready(cache, [3] * BS)
    cache.pin(p_cold2)
    u_old, u_new = _ready(cache, [4] * BS), _ready(cache, [5] * BS)
    for _ in range(3):
        cache.lookup([1] * BS, "kb")
    cache.lookup([2] * BS, "kb")  # p_cold: 1 hit, p_cold2: 0 hits, p_hot: 3 hits
    assert bm.num_free == 1
    assert cache.evict(2) == 2  # both unpinned go (LRU), every pinned one survives
    assert u_old not in cache and u_new not in cache and len(cache) == 3
    assert cache.evict(1) == 1 and p_cold2 not in cache  # pinned: fewest hits first
    assert cache.evict(1) == 1 and p_cold not in cache
    assert p_hot in cache


def test_watermark_keeps_pinned_below_and_evicts_least_used_above():
    bm, cache = _cache(num_blocks=10, watermark=0.5)
    pins = [_ready(cache, [i] * BS, pinned=True) for i in range(3)]
    for i, seg in enumerate(pins):
        for _ in range(3 - i):  # pins[0] most used, pins[2] least
            cache.lookup([i] * BS, "kb")
    u = _ready(cache, [9] * BS)
    assert cache.usage() == 0.4
    assert cache.enforce_watermark() == 0 and len(cache) == 4  # at or below: nothing goes
    extra = bm.allocate(3)  # requests push use to 0.7
    assert cache.enforce_watermark() == 2  # unpinned first, then the least used pinned one
    assert u not in cache and pins[2] not in cache and pins[0] in cache and pins[1] in cache
    assert cache.usage() == 0.5
    bm.free_blocks(extra)


def test_grow_reclaims_idle_segments_through_callback():
    bm, cache = _cache(num_blocks=8)
    busy = _ready(cache, list(range(8)))  # 2 blocks, in use
    cache.acquire(busy)
    old = _ready(cache, list(range(100, 108)))  # 2 blocks
    new = _ready(cache, list(range(200, 208)))  # 2 blocks
    seq = _seq(12)  # 3 blocks; 2 free
    assert bm.can_grow(seq, 12) and old not in cache and new in cache
    bm.grow(seq, 12)
    assert len(seq.block_table) == 3 and bm.num_free == 1
    other = _seq(16)
    assert bm.can_grow(other, 8) and new not in cache  # 2 needed, 1 free: new is evicted
    assert not bm.can_grow(other, 16)  # only the referenced segment is left
    with pytest.raises(RuntimeError):
        bm.grow(other, 16)
    assert busy in cache


def test_scheduler_prefill_makes_room_by_evicting_segments():
    bm, cache = _cache(num_blocks=8)
    for i in range(4):
        _ready(cache, [i] * 8)  # the pool is full of idle segments
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add(_seq(20))
    batch = sched.schedule()
    assert batch.is_prefill and batch.num_new_tokens == [20]
    assert len(cache) == 1 and bm.num_free == 1  # 5 blocks needed: three 2-block segments went


def test_block_manager_without_reclaim_unchanged():
    bm = BlockManager(4, BS)
    assert bm.reclaim is None
    seq = _seq(10)
    assert bm.blocks_needed(seq, 10) == 3 and bm.can_grow(seq, 10)
    bm.grow(seq, 10)
    owned = bm.allocate(1)
    assert bm.num_free == 0 and not bm.can_grow(seq, 13)
    with pytest.raises(RuntimeError):
        bm.grow(seq, 13)
    with pytest.raises(RuntimeError):
        bm.allocate(1)
    bm.free_blocks(owned)
    bm.release(seq)
    assert bm.num_free == 4 and seq.block_table == [] and seq.num_computed == 0


def test_segment_too_large_is_a_clear_error():
    bm, cache = _cache(num_blocks=4)
    held = _ready(cache, [7] * BS)
    cache.acquire(held)
    with pytest.raises(SparsetuneError, match="raise --kv-memory") as e:
        cache.insert(list(range(4 * BS)), "kb")
    assert "\n" not in str(e.value)
    assert held in cache and bm.num_free == 3  # nothing was evicted for a doomed insert
    with pytest.raises(SparsetuneError):
        cache.insert(list(range(5 * BS)), "kb")


def test_insert_evicts_idle_and_repins_existing():
    bm, cache = _cache(num_blocks=2)
    a = _ready(cache, [1] * BS)
    assert cache.insert([1] * BS, "kb", pinned=True) is a and a.pinned
    cache.unpin(a)
    b = cache.insert(list(range(2 * BS)), "kb")  # needs both blocks: a goes
    assert a not in cache and len(b.blocks) == 2
    with pytest.raises(RuntimeError):
        SegmentCache(bm, BS, SALT)  # one cache per pool


def test_cap_evicts_idle_segments_least_recent_first_and_is_soft_for_held_ones():
    bm = BlockManager(16, BS)
    cache = SegmentCache(bm, BS, SALT, cap=4)
    a, b = _ready(cache, [1] * 2 * BS), _ready(cache, [2] * 2 * BS)  # two blocks each: at the cap
    cache.lookup([1] * 2 * BS, "kb")  # a is the most recent now
    c = _ready(cache, [3] * 2 * BS)
    assert b not in cache and a in cache and c in cache and cache.stats()["blocks"] == 4
    cache.acquire(a)
    cache.acquire(c)
    d = _ready(cache, [4] * BS)  # only held segments left: the cap yields
    assert a in cache and c in cache and d in cache and cache.stats()["blocks"] == 5
    assert bm.num_free == 16 - 5


def test_an_idle_segment_a_request_also_holds_frees_nothing():
    """A stored segment's blocks can be a running request's prefix hit too: evicting the segment
    frees none of them, so a new segment that would need them is refused in one line (not an
    allocator error), and the blocks stay with the request."""
    bm, cache = _cache(num_blocks=8)
    held = _ready(cache, list(range(20)))  # 5 blocks, idle
    for b in held.blocks:  # a request's prefix hit on them (BlockManager.match_prefix)
        bm.refs[b] += 1
    with pytest.raises(SparsetuneError, match="can be freed"):
        cache.insert(list(range(100, 116)), "kb")  # 4 blocks: 3 free, the idle segment's 5 shared
    assert cache.evictions == 0 and all(bm.refs[b] == 2 for b in held.blocks)
    bm.free_blocks(list(held.blocks))  # the request finishes: now the segment alone holds them
    got = cache.insert(list(range(100, 116)), "kb")
    assert len(got.blocks) == 4 and cache.evictions == 1
