"""The scheduler side of reuse inside SGLang (0.5.16 and 0.5.23, CPU; issue #44): SGLang's real `Req`,
prefix tree and `HookRegistry`.

- `plan_request` finds what the tree holds of a prompt: its plain prefix (under the request's own
  key, at most all but the last token) and each segment's stored head (a segment stored whole, one
  stored only up to a page, one not stored: prompt text), pinned, so eviction under a full pool
  frees neither; the layout's segments are cut to what was found.
- The hooks resolve on both versions' real targets through SGLang's own registry; on a real `Req`
  the prefix cap is 0 for a request with segments and SGLang's own for a plain one; `plan_batch`
  plans each new request with segments before SGLang's allocation (letting go of plans no forward took), and keeps its KV out of the
  tree; `take` hands an extend's forward batch the plans of its requests (by their ids), once.
"""

from __future__ import annotations

import json
from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from trees import default_tree

from sparsetune.export.sglang import schedule
from sparsetune.export.sglang.segments import LAYOUT
from sparsetune.export.sglang.store import SegmentStore, segment_key
from sparsetune.loader import build_flow
from sparsetune.reuse.base import ReuseFlow
from sparsetune.reuse.parts import Span

P = 4


def tree(slots: int):
    kv = MHATokenToKVPool(size=slots, page_size=P, dtype=torch.float32, head_num=1, head_dim=8, layer_num=1, device="cpu",
                          enable_memory_saver=False)
    alloc = PagedTokenToKVPoolAllocator(slots, P, torch.float32, "cpu", kv, need_sort=False)
    rows = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    return default_tree(disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=alloc, page_size=P), alloc


def put(t, alloc, ids, extra_key):
    slots = alloc.alloc(len(ids))
    t.insert(InsertParams(key=RadixKey(array("q", ids), extra_key=extra_key), value=slots))
    return slots


HEAD, SEG, HALF, GONE = list(range(1, 9)), list(range(20, 32)), list(range(40, 50)), list(range(60, 68))
PROMPT = HEAD + [7, 7] + SEG + [8] + HALF + GONE + [9, 9, 9]


def spans():
    """The prompt's layout, every span, as the tokenizer process writes it."""
    a = len(HEAD) + 2
    b = a + len(SEG) + 1
    c = b + len(HALF)
    d = c + len(GONE)
    return [Span(0, a, False, "default"), Span(a, a + len(SEG), True, "kb"), Span(a + len(SEG), b, False, "default"),
            Span(b, c, True, "kb"), Span(c, d, True, "kb"), Span(d, len(PROMPT), False, "default")]


def test_a_plan_finds_and_pins_the_prefix_and_each_segments_stored_head():
    t, alloc = tree(96)
    head = put(t, alloc, HEAD, None)
    seg = put(t, alloc, SEG, segment_key("kb"))
    half = put(t, alloc, HALF[:8], segment_key("kb"))  # a page-aligned head, as SGLang keeps a 10-token prompt
    put(t, alloc, list(range(80, 96)), None)  # another prompt, idle
    store = SegmentStore(t)
    req, pins = schedule.plan_request(PROMPT, spans(), None, store)
    assert req.num_cached == len(HEAD) and torch.equal(req.prefix_slots, head)
    _, s1, _, s2, s3, _ = spans()
    assert [(a, b.tolist()) for a, b in req.segments] == [(s1.start, seg.tolist()), (s2.start, half.tolist())]
    assert req.layout.spans == spans()  # the flow sees the layout as written
    # ... and takes as reused what has KV to take: not the tail past a stored head, nor a segment not stored
    reused = req.reused(build_flow("cacheblend", {}, ReuseFlow), "cpu")
    want = torch.zeros(len(PROMPT), dtype=torch.bool)
    want[s1.start : s1.end] = True
    want[s2.start : s2.start + 8] = True
    assert torch.equal(reused, want) and not reused[s3.start : s3.end].any()
    assert len(pins) == 3
    t.evict(EvictParams(num_tokens=96))  # all it may free: the idle prompt, not the pinned
    assert store.match(list(range(80, 96)), None).length == 0
    assert store.match(HEAD, None).length == len(HEAD) and store.find(SEG, "kb").length == len(SEG)
    for pin in pins:
        store.unpin(pin)
    t.evict(EvictParams(num_tokens=96))
    assert store.find(SEG, "kb").length == 0


@pytest.fixture(autouse=True)
def no_plans_left():
    """Each test starts and ends with no plan waiting (`schedule.PLANNED` is the process's)."""
    schedule.sweep()
    yield
    schedule.sweep()


def request(rid: str, layout: str | None) -> Req:
    params = SamplingParams(max_new_tokens=4, custom_params=None if layout is None else {LAYOUT: layout})
    req = Req(rid, "", array("q", PROMPT), params)
    req.get_fill_ids = lambda: array("q", PROMPT)  # as admission leaves it: the whole prompt to extend
    return req


LAYOUT_OF_PROMPT = json.dumps([[0, 10, False, "default", False], [10, 22, True, "kb", False],
                               [22, len(PROMPT), False, "default", False]])


def test_the_hooks_resolve_on_sglangs_targets_and_a_plan_is_taken_by_request_id_once():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in schedule.HOOKS:  # each target exists in this version, and takes the hook
        HookRegistry.register(target, hook, getattr(HookType, kind))
    HookRegistry.apply_hooks()
    reuse, plain = request("r", LAYOUT_OF_PROMPT), request("p", None)
    assert reuse._compute_max_prefix_len(len(PROMPT)) == 0
    assert plain._compute_max_prefix_len(len(PROMPT)) == len(PROMPT) - 1  # SGLang's own
    t, alloc = tree(192)
    put(t, alloc, SEG, segment_key("kb"))
    batch = SimpleNamespace(reqs=[reuse, plain], tree_cache=t)
    seen = []
    schedule.plan_batch(lambda b: seen.append(t.protected_size()), batch)
    assert seen == [len(SEG)]  # pinned before SGLang's allocation ran
    plan, _, pins = schedule.PLANNED["r"]
    assert reuse.skip_radix_cache_insert and "p" not in schedule.PLANNED
    assert [(a, s.numel()) for a, s in plan.segments] == [(10, len(SEG))]
    # taken by the forward batch's request ids (what SGLang's copies of it keep), once, in its order
    assert schedule.take(SimpleNamespace(forward_mode=ForwardMode.EXTEND, rids=["p"])) is None
    requests, (store, held) = schedule.take(SimpleNamespace(forward_mode=ForwardMode.EXTEND, rids=["p", "r"]))
    assert requests == [None, plan] and held == pins and store.tree is t and not schedule.PLANNED
    assert schedule.take(SimpleNamespace(forward_mode=ForwardMode.EXTEND, rids=["p", "r"])) is None
    assert t.protected_size() == len(SEG)  # the forward lets go of what it took (ReuseStep.release)
    schedule.release_pins((store, held))
    assert t.protected_size() == 0
    schedule.plan_batch(lambda b: None, SimpleNamespace(reqs=[reuse], tree_cache=t))
    assert "r" in schedule.PLANNED and t.protected_size() == len(SEG)
    assert schedule.take(SimpleNamespace(forward_mode=ForwardMode.DECODE, rids=["r"])) is None  # no extend: let go
    assert not schedule.PLANNED and t.protected_size() == 0


def test_a_plan_no_forward_took_and_a_failed_allocation_let_their_segments_go(caplog):
    """SGLang plans a batch and runs it in one pass of its loop: a plan still waiting when the next batch
    is planned never ran, and is let go (with a warning); a batch whose allocation fails lets go of the
    plans it just made, and SGLang's error goes on."""
    t, alloc = tree(192)
    put(t, alloc, SEG, segment_key("kb"))
    schedule.plan_batch(lambda b: None, SimpleNamespace(reqs=[request("r", LAYOUT_OF_PROMPT)], tree_cache=t))
    assert "r" in schedule.PLANNED and t.protected_size() == len(SEG)
    schedule.plan_batch(lambda b: None, SimpleNamespace(reqs=[request("p", None)], tree_cache=t))
    assert not schedule.PLANNED and t.protected_size() == 0 and "r's reuse plan was not run" in caplog.text

    def fails(batch):
        raise RuntimeError("out of memory")

    failed = request("r2", LAYOUT_OF_PROMPT)
    with pytest.raises(RuntimeError, match="out of memory"):
        schedule.plan_batch(fails, SimpleNamespace(reqs=[failed], tree_cache=t))
    assert not schedule.PLANNED and t.protected_size() == 0 and not failed.skip_radix_cache_insert


def test_a_retracted_or_malformed_request_and_a_full_pool_prefill_without_reuse(caplog):
    """Nothing a request carries stops the scheduler: a retracted request (its prompt now holds its
    output too) and a malformed layout run as plain prompts, with SGLang's own prefix; when pinning a
    request's segments would leave SGLang's admitted batch without room, they are let go and it
    prefills whole."""
    retracted, broken = request("t", LAYOUT_OF_PROMPT), request("b", '[[0,3,true,"kb",false]]')
    retracted.output_ids = [5]
    for req in (retracted, broken):
        assert schedule.spans_of(req) is None
        assert schedule.cap_prefix(lambda r, n: n - 1, req, len(PROMPT)) == len(PROMPT) - 1
    assert caplog.text.count("runs without reuse") == 1  # once per request, however often the scheduler asks
    t, alloc = tree(48)
    put(t, alloc, SEG, segment_key("kb"))
    alloc.alloc(alloc.available_size() - 4 * P)  # what other requests hold: 16 slots free, the segment evictable
    req = request("r", LAYOUT_OF_PROMPT)  # 44 tokens: SGLang counted 16 free + 12 evictable as its room... and more
    batch = SimpleNamespace(reqs=[req], tree_cache=t)
    schedule.plan_batch(lambda b: None, batch)
    assert "r" not in schedule.PLANNED and t.protected_size() == 0  # let go: room stays as SGLang counted it
    roomy, alloc2 = tree(96)
    put(roomy, alloc2, SEG, segment_key("kb"))
    ok = request("r2", LAYOUT_OF_PROMPT)
    schedule.plan_batch(lambda b: None, SimpleNamespace(reqs=[ok], tree_cache=roomy))
    assert "r2" in schedule.PLANNED and roomy.protected_size() == len(SEG)
