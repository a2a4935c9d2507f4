"""Switching flows on a live engine: a flow that differs only in runtime params (budget, sink and
local blocks, dense and select layers) retunes the loaded backend in place, and decodes exactly
as a backend built for it from scratch; compiled stages are shared by kernel key and a retune
compiles nothing."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from sparsetune.engine.sequence import SamplingParams
from sparsetune.flow.attention import FlowAttention
from sparsetune.flow.stages import flow_stages
from sparsetune.llm import LLM
from sparsetune.loader import build_flow
from helpers import HEAD_DIM, paged_case, prefill_cache, selected_sets

PROMPT = "Name the planets of the solar system in order from the sun, with one fact about each. " * 6


def test_kernel_key_holds_every_param_but_the_runtime_ones():
    a = build_flow("quest", {"budget": "64"})
    b = build_flow("quest", {"budget_ratio": "0.2", "sink_blocks": "3", "local_blocks": "1", "dense_layers": "0,5"})
    assert a.kernel_key() == b.kernel_key() and flow_stages(a, "reference") is flow_stages(b, "reference")
    assert build_flow("quest", {"block_size": "8"}).kernel_key() != a.kernel_key()
    assert build_flow("block_topk").kernel_key() != a.kernel_key()
    assert build_flow("h2o", {"decay": "0.9"}).kernel_key() != build_flow("h2o").kernel_key()
    assert flow_stages(a, "compiled") is not flow_stages(a, "reference")


def _greedy(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0))[0].token_ids


@pytest.mark.parametrize("name,first,second", [
    ("quest", {"budget": "64"}, {"budget": "96", "sink_blocks": "2", "local_blocks": "1", "dense_layers": "0,1,7"}),
    ("tidal", {"budget": "64"}, {"budget_ratio": "0.25", "select_layers": "2,9,20"}),
])
def test_retuned_backend_decodes_like_a_fresh_one(smollm, name, first, second):
    try:
        smollm.apply(smollm.setup.with_flow(name, first))
        backend = smollm.engine.backends[5]
        assert isinstance(backend, FlowAttention)
        _greedy(smollm)  # fields and the rule tensor exist before the switch
        smollm.apply(smollm.setup.with_flow(name, second))
        assert smollm.engine.backends[5] is backend and backend.flow.params() == smollm.flow.params()
        dense = set(smollm.flow.dense_layers)
        assert [i for i, b in enumerate(smollm.engine.backends) if b is backend] == [i for i in range(30) if i not in dense]
        retuned = _greedy(smollm)
        retuned_selection = {layer: sel for layer, sel in backend.last_selection.items() if layer not in dense}
    finally:
        smollm.apply(smollm.setup.with_flow(None))
    fresh = LLM(model="smollm2-135m", device="cpu", max_num_seqs=8, flow=name, params=second)
    assert fresh.engine.backends[5] is not backend
    assert _greedy(fresh) == retuned
    for layer, (blocks, counts) in retuned_selection.items():  # the last decode step, layer by layer
        want_blocks, want_counts = fresh.engine.backends[layer].last_selection[layer]
        assert torch.equal(counts, want_counts)
        assert all(set(blocks[b, h, :n].tolist()) == set(want_blocks[b, h, :n].tolist())
                   for b in range(counts.shape[0]) for h in range(counts.shape[1]) for n in [int(counts[b, h])])


def test_dense_pass_keeps_the_flow_backend(smollm):
    """An eval alternates dense and flow passes: coming back to the flow reuses its backend."""
    try:
        smollm.apply(smollm.setup.with_flow("quest", {"budget": "64"}))
        backend = smollm.engine.backends[5]
        smollm.apply(smollm.setup.with_flow(None))
        assert not any(isinstance(b, FlowAttention) for b in smollm.engine.backends)
        smollm.apply(smollm.setup.with_flow("quest", {"budget": "128"}))
        assert smollm.engine.backends[5] is backend and backend.flow.budget == 128
    finally:
        smollm.apply(smollm.setup.with_flow(None))


def test_compiled_stages_do_not_recompile_on_retune():
    """The compiled executor (torch.compile, C++ on CPU) traces a kernel key once per shape: a new
    budget, sink or local setting of the same selection width is a tensor write, not a recompile;
    a new width is one new variant. Each retuned selection equals the reference executor's."""
    lens = [30 * 16 + 7, 11 * 16]
    kv, bt, meta, q = paged_case(16, lens, seed=4)
    # width 33 blocks: budget 96 tokens = 6 blocks; 6 blocks again with other sinks, locals or 81 tokens.
    same_width = [{"budget": "96"}, {"budget": "96", "sink_blocks": "2", "local_blocks": "3"}, {"budget": "81"},
                  {"budget": "96", "sink_blocks": "0", "local_blocks": "1"}]
    flows = [build_flow("block_topk", {**p, "dense_layers": ""}) for p in same_width]
    comp = FlowAttention(flows[0], HEAD_DIM**-0.5, executor="compiled")
    prefill_cache(comp, kv, bt, lens)
    graphs = None
    for flow in flows:
        comp.retune(flow)
        ref = FlowAttention(flow, HEAD_DIM**-0.5)
        prefill_cache(ref, kv, bt, lens)
        assert selected_sets(comp, kv, bt, meta, q) == selected_sets(ref, kv, bt, meta, q)
        if graphs is None:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile after the first flow
    comp.retune(build_flow("block_topk", {"budget": "160", "dense_layers": ""}))  # 10 blocks: a new shape
    comp.select(0, q, kv, meta)
    assert counters["stats"]["unique_graphs"] == graphs + 1


def test_a_flow_of_another_block_size_relays_the_pool_and_keeps_the_weights():
    """A search moves between block sizes on one engine: the pool is laid out anew in the flow's
    blocks (same token capacity, same weight tensors), and the engine then decodes exactly like
    one built for that flow; dense attention on the new layout still matches the old one."""
    llm = LLM(model="smollm2-135m", device="cpu", max_num_seqs=8)
    weight = llm.engine.model.lm_head.weight
    ptr, tokens = weight.data_ptr(), llm.engine.kv.num_blocks * llm.engine.kv.block_size
    dense = _greedy(llm)
    params = {"block_size": "4", "budget": "64"}
    llm.apply(llm.setup.with_flow("quest", params))
    assert (llm.engine.kv.block_size, llm.config.block_size, llm.engine.block_manager.block_size) == (4, 4, 4)
    assert llm.engine.kv.num_blocks * 4 == tokens and weight.data_ptr() == ptr
    got = _greedy(llm)
    assert got == _greedy(LLM(model="smollm2-135m", device="cpu", max_num_seqs=8, flow="quest", params=params))
    llm.apply(llm.setup.with_flow("block_topk", {"budget": "64"}))  # no block size given: the pool's
    assert llm.flow.block_size == 4 and llm.engine.kv.block_size == 4
    llm.apply(llm.setup.with_flow(None))
    assert _greedy(llm) == dense


def test_a_relayout_that_does_not_fit_leaves_the_engine_as_it_was(monkeypatch):
    """A search trial whose block size needs more memory than there is fails alone: the engine
    keeps its layout and decodes as before."""
    from sparsetune.errors import SparsetuneError

    llm = LLM(model="smollm2-135m", device="cpu", max_num_seqs=8, flow="block_topk", params={"budget": "64"})
    before = _greedy(llm)
    check = llm.engine._check_memory

    def refuse_small_blocks(num_blocks: int) -> None:
        if llm.config.block_size == 2:
            raise SparsetuneError("the KV pool needs more memory than there is")
        check(num_blocks)

    monkeypatch.setattr(llm.engine, "_check_memory", refuse_small_blocks)
    with pytest.raises(SparsetuneError, match="needs more memory"):
        llm.apply(llm.setup.with_flow("quest", {"block_size": "2", "budget": "64"}))
    assert llm.engine.kv.block_size == 16 and llm.config.block_size == 16 and llm.flow.name == "block_topk"
    assert isinstance(llm.engine.backends[5], FlowAttention) and llm.engine.backends[5].flow.name == "block_topk"
    assert _greedy(llm) == before


def test_stages_generate_a_kernel_per_shape():
    """Engines of different models share a flow's stages (a search's accuracy and speed engines):
    the generated kernels are per head dimension and group, never the first engine's."""
    stages = flow_stages(build_flow("quest"), "compiled")
    small, big = stages.indexer_kernel(3, 64), stages.indexer_kernel(4, 128)
    assert small is not big and stages.indexer_kernel(3, 64) is small
    assert stages.cache_kernel(64) is not stages.cache_kernel(128) and stages.cache_kernel(64) is stages.cache_kernel(64)


def test_units_inside_pages_decode_like_pages_of_the_unit(smollm):
    """quest with 2-token units inside 16-token pages selects and decodes as quest with 2-token
    pages: the same units chosen at every layer of the last step, the same tokens and logits
    (float32), on a pool whose page stays 16."""
    sp = SamplingParams(max_tokens=6, temperature=0.0, keep_logits=True)
    runs = {}
    try:
        for key, params in (("pages", {"block_size": "2", "budget": "64"}),
                            ("units", {"block_size": "16", "select_block": "2", "budget": "64"})):
            smollm.apply(smollm.setup.with_flow("quest", params))
            assert smollm.engine.kv.block_size == int(params["block_size"])
            seq = smollm.engine.add_request(smollm.encode_prompt(PROMPT), sp)
            while smollm.engine.scheduler.has_work():
                smollm.engine.step()
            runs[key] = (seq.completion_ids, torch.stack(seq.logits), {
                layer: sel for layer, sel in smollm.engine.backends[5].last_selection.items()})
    finally:
        smollm.apply(smollm.setup.with_flow(None))
    (ids_p, logits_p, sel_p), (ids_u, logits_u, sel_u) = runs["pages"], runs["units"]
    assert ids_u == ids_p
    torch.testing.assert_close(logits_u, logits_p, rtol=1e-4, atol=1e-4)
    assert sel_p.keys() == sel_u.keys() and len(sel_p) == 28
    for layer, (blocks, counts) in sel_u.items():
        want_blocks, want_counts = sel_p[layer]
        assert torch.equal(counts, want_counts)
        assert all(set(blocks[0, h, :n].tolist()) == set(want_blocks[0, h, :n].tolist())
                   for h in range(counts.shape[1]) for n in [int(counts[0, h])])


def test_two_level_flow_with_every_block_kept_is_its_one_level_flow(smollm):
    """On the embedded model, a two-level quest whose first level keeps every block (coarse x
    budget_ratio >= 1) decodes exactly as quest over the same units in one level; with a smaller
    coarse it keeps fewer blocks and still decodes (every layer's units inside its chosen blocks);
    turning coarse off again on the live engine gives the one-level flow back."""
    sp = SamplingParams(max_tokens=6, temperature=0.0, keep_logits=True)
    one = {"select_block": "2", "budget_ratio": "0.125"}
    runs = {}
    try:
        for key, params in (("one", one), ("all blocks", {**one, "coarse": "8"}), ("two", {**one, "coarse": "2"}),
                            ("one again", one)):  # coarse off again: a one-level backend, not a retune
            smollm.apply(smollm.setup.with_flow("quest", params))
            seq = smollm.engine.add_request(smollm.encode_prompt(PROMPT), sp)
            while smollm.engine.scheduler.has_work():
                smollm.engine.step()
            backend = smollm.engine.backends[5]
            pages = None if backend.pages is None else backend.pages.last_selection[5]
            runs[key] = (seq.completion_ids, torch.stack(seq.logits), backend.last_selection[5], pages)
    finally:
        smollm.apply(smollm.setup.with_flow(None))
    assert runs["all blocks"][0] == runs["one"][0] == runs["one again"][0] and runs["one again"][3] is None
    torch.testing.assert_close(runs["all blocks"][1], runs["one"][1], rtol=1e-4, atol=1e-4)  # units in another order
    (a, na), (b, nb) = runs["all blocks"][2], runs["one"][2]
    assert torch.equal(na, nb) and all(set(a[0, h, :n].tolist()) == set(b[0, h, :n].tolist())
                                       for h in range(na.shape[1]) for n in [int(na[0, h])])
    (units, counts), (pages, kept) = runs["two"][2], runs["two"][3]
    nblocks = -(-(len(smollm.encode_prompt(PROMPT)) + 5) // 16)
    assert int(kept.max()) < nblocks  # the first level cut
    for h in range(counts.shape[1]):
        chosen = set(pages[0, h, : int(kept[0, h])].tolist())
        assert {u * 2 // 16 for u in units[0, h, : int(counts[0, h])].tolist()} <= chosen
