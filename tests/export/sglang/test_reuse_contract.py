"""Reused segments on SGLang's own objects (0.5.16 and 0.5.23, CPU; issue #44): the request field
that marks them crosses SGLang's IPC, its prefix tree stores and pins them (`store.SegmentStore`),
and a segment placed at another position gets the keys RoPE gives there, as the engine realigns them.

- The parts and the layout travel in `custom_params` as JSON text through SGLang's own msgpack
  IPC (a list of objects does not: why the field is text).
- In SGLang's tree (`RadixCache` on 0.5.16, `UnifiedRadixCache` on 0.5.23, on a CPU pool): a
  segment stored under its namespace's key is found there at full length (its page-aligned head with
  pages of 4), never as a plain prefix nor in another namespace; a plain prefix and a segment of one
  prompt are each found; under a pool too small for both, eviction frees an idle segment but never a
  pinned one, whose slots keep their KV until it is unpinned.
- `store.place` writes the segment's keys rotated to the new position: equal (float32, 1e-5) to
  SGLang's own RoPE at that position and to the engine's (`engine.rope`, `kernels.fused_ops`), for
  plain and Llama-3-scaled frequencies; values bit for bit; the stored slots untouched.
"""

from __future__ import annotations

import json
from array import array

import pytest
import torch
from sglang.srt.managers import io_struct
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.sampling.sampling_params import SamplingParams
from trees import default_tree

from sparsetune.engine.rope import cos_sin_table, inv_frequencies
from sparsetune.export.sglang.segments import FIELD, LAYOUT
from sparsetune.export.sglang.store import SegmentStore, place, segment_key
from sparsetune.kernels.fused_ops import apply_rope_ref

H, D, LAYERS = 2, 16, 3


def tokenized(custom_params):
    """A TokenizedGenerateReqInput as the tokenizer process sends it (the fields a test needs)."""
    import inspect

    sig = inspect.signature(io_struct.TokenizedGenerateReqInput)
    kw = {n: None for n, p in sig.parameters.items() if p.default is inspect.Parameter.empty}
    kw.update(input_text="hi", input_ids=array("q", [1, 2, 3]), sampling_params=SamplingParams(max_new_tokens=4, custom_params=custom_params),
              return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, stream=False)
    return io_struct.TokenizedGenerateReqInput(**{k: v for k, v in kw.items() if k in sig.parameters})


def test_the_segment_fields_cross_sglangs_ipc_as_text():
    params = {FIELD: json.dumps([{"text": "doc", "reuse": True, "namespace": "kb"}, "question"]), LAYOUT: "[[0,3,\"kb\",false]]"}
    back = io_struct.msgpack_decode(io_struct.msgpack_encode(tokenized(params)))
    assert back.sampling_params.custom_params == params
    with pytest.raises(Exception, match="Expected `bool | int | float | str | null`"):  # why the parts go as text
        io_struct.msgpack_decode(io_struct.msgpack_encode(tokenized({FIELD: [{"text": "doc", "reuse": True}]})))


class Tree:
    """SGLang's default prefix tree for a plain model, over a CPU pool of `slots` KV slots."""

    def __init__(self, slots: int, page: int = 1) -> None:
        self.pool = MHATokenToKVPool(size=slots, page_size=page, dtype=torch.float32, head_num=H, head_dim=D, layer_num=LAYERS,
                                     device="cpu", enable_memory_saver=False)
        self.alloc = PagedTokenToKVPoolAllocator(slots, page, torch.float32, "cpu", self.pool, need_sort=False)
        rows = ReqToTokenPool(size=4, max_context_len=256, device="cpu", enable_memory_saver=False)
        self.tree = default_tree(disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=self.alloc, page_size=page)
        self.store = SegmentStore(self.tree)

    def put(self, ids: list[int], extra_key: str | None) -> torch.Tensor:
        """Insert a prompt's KV as SGLang's finish path does: fresh slots, the page-aligned head kept."""
        page = self.alloc.page_size
        kept = len(ids) // page * page
        slots = self.alloc.alloc(len(ids) if page == 1 else -(-len(ids) // page) * page)[: len(ids)]
        for layer in range(LAYERS):  # distinct KV per slot, to see what a slot holds later
            self.pool.get_key_buffer(layer)[slots] = slots.float()[:, None, None] + 1000 * layer
            self.pool.get_value_buffer(layer)[slots] = -slots.float()[:, None, None] - 1000 * layer
        self.tree.insert(InsertParams(key=RadixKey(array("q", ids[:kept]), extra_key=extra_key), value=slots[:kept].clone()))
        if kept < len(ids):
            self.alloc.free(slots[kept:])
        return slots[:kept]

    def plain(self, ids: list[int]) -> int:
        m = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids), extra_key=None)))
        return int(m.device_indices.numel()) if hasattr(m, "device_indices") else int(m.device_prefix_len)


SEG, OTHER, PREFIX = list(range(100, 110)), list(range(300, 312)), list(range(500, 508))


def test_a_stored_segment_is_found_in_its_namespace_only():
    t = Tree(128)
    slots = t.put(SEG, segment_key("kb"))
    hit = t.store.find(SEG, "kb")
    assert hit.length == len(SEG) and torch.equal(hit.slots, slots)
    assert t.store.find(SEG[:6], "kb").length == 6  # a stored segment's head
    assert t.store.find(SEG, "other").length == 0 and t.plain(SEG) == 0  # not across namespaces, not a plain prefix
    assert t.store.find(OTHER, "kb").length == 0
    # a prompt = a plain prefix, then the segment: each found where it is kept
    t.put(PREFIX, None)
    prompt = PREFIX + SEG + [7, 8]
    assert t.plain(prompt) == len(PREFIX) and t.store.find(prompt[len(PREFIX):len(PREFIX) + len(SEG)], "kb").length == len(SEG)
    paged = Tree(128, page=4)  # pages of 4: the page-aligned head of a 10-token segment is kept
    head = paged.put(SEG, segment_key("kb"))
    hit = paged.store.find(SEG, "kb")
    assert hit.length == 8 and torch.equal(hit.slots, head)


def test_eviction_frees_idle_segments_but_never_a_pinned_ones_slots():
    t = Tree(24)
    pinned_slots = t.put(SEG, segment_key("kb"))
    t.put(OTHER, segment_key("kb"))
    receipt = t.store.pin(t.store.find(SEG, "kb"))
    kv = [t.pool.get_key_buffer(layer)[pinned_slots].clone() for layer in range(LAYERS)]
    t.tree.evict(EvictParams(num_tokens=64))  # more than the tree holds: all it may free
    assert t.store.find(OTHER, "kb").length == 0  # the idle one is gone
    hit = t.store.find(SEG, "kb")
    assert hit.length == len(SEG) and torch.equal(hit.slots, pinned_slots)
    # the freed slots are handed out again; the pinned ones are not, and keep their KV
    fresh = t.alloc.alloc(t.alloc.available_size())
    assert not set(fresh.tolist()) & set(pinned_slots.tolist())
    assert all(torch.equal(t.pool.get_key_buffer(layer)[pinned_slots], kv[layer]) for layer in range(LAYERS))
    t.alloc.free(fresh)
    t.store.unpin(receipt)
    t.tree.evict(EvictParams(num_tokens=64))
    assert t.store.find(SEG, "kb").length == 0  # unpinned: evictable like any prefix


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_a_segment_placed_at_a_new_position_gets_the_keys_rope_gives_there(scaling, monkeypatch):
    from types import SimpleNamespace

    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.layers.rotary_embedding import get_rope

    # SGLang's RoPE reads one server setting (an RL mode) when it builds its table, and off CUDA looks
    # for a platform kernel it does not call in `forward_native`: no server and no GPU here
    monkeypatch.setattr(rope_base, "get_server_args", lambda: SimpleNamespace(rl_on_policy_target=None), raising=False)
    monkeypatch.setattr(rope_base, "_is_cpu", True, raising=False)

    theta, n, at, max_pos = 10000.0, 11, 37, 256
    g = torch.Generator().manual_seed(0)
    raw_k = torch.randn(LAYERS, n, H, D, generator=g)
    raw_v = torch.randn(LAYERS, n, H, D, generator=g)
    sgl_rope = get_rope(D, D, max_pos, theta, True, scaling, torch.float32)
    engine_table = cos_sin_table(D, theta, scaling, max_pos)

    def sglang_keys(k, start):  # SGLang's own RoPE of raw keys at positions start..
        pos = torch.arange(start, start + n)
        _, out = sgl_rope.forward_native(pos, torch.zeros(n, H * D), k.reshape(n, H * D).clone())
        return out.view(n, H, D)

    def engine_keys(k, start):  # the engine's RoPE (a full prefill's keys there)
        q, out = torch.zeros(n, H, D), k.clone()
        apply_rope_ref(q, out, torch.arange(start, start + n), engine_table)
        return out

    t = Tree(64)
    stored, dst = t.alloc.alloc(n), t.alloc.alloc(n)
    for layer in range(LAYERS):  # the segment's KV as its own prefill at 0.. wrote it
        t.pool.get_key_buffer(layer)[stored] = sglang_keys(raw_k[layer], 0)
        t.pool.get_value_buffer(layer)[stored] = raw_v[layer]
    before = [t.pool.get_key_buffer(layer)[stored].clone() for layer in range(LAYERS)]
    place(t.pool, stored, dst, torch.full((n,), at), inv_frequencies(D, theta, scaling))
    for layer in range(LAYERS):
        got = t.pool.get_key_buffer(layer)[dst]
        torch.testing.assert_close(got, sglang_keys(raw_k[layer], at), atol=1e-5, rtol=0)
        torch.testing.assert_close(got, engine_keys(raw_k[layer], at), atol=1e-5, rtol=0)
        assert torch.equal(t.pool.get_value_buffer(layer)[dst], raw_v[layer])
        assert torch.equal(t.pool.get_key_buffer(layer)[stored], before[layer])
