"""KV-reuse flows: the engine's recompute plans against plain prefill, each flow's selected token set
against a direct torch implementation of its published rule, and bad segment specs."""

from __future__ import annotations

import pytest
import torch

from sparsetune.engine.sequence import SamplingParams, Status
from sparsetune.errors import SparsetuneError
from sparsetune.loader import build_flow
from sparsetune.reuse import ReuseFlow
from sparsetune.reuse.base import SelectionInputs
from sparsetune.reuse.parts import ReuseLayout, Span, encode_parts, parse_parts
from helpers import DOC_A, plain_logits, reuse_logits, reuse_parts


def test_full_recompute_equals_plain_prefill(smollm):
    logits, stats, layout, _ = reuse_logits(smollm, "full_recompute", reuse_parts())
    ref = plain_logits(smollm, layout)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    assert stats.reused_tokens == 0 and stats.compute_fraction == 1.0
    t = layout.num_tokens  # every row attends keys 0..i on every layer
    assert stats.attention_pairs == stats.num_layers * t * (t + 1) // 2


@pytest.mark.parametrize("flow,params", [("cacheblend", {}), ("a3", {}), ("sparsex", {}), ("sparsex", {"boundary_layer": "0"}),
                                         ("epic", {"k": "4096"})])
def test_selection_flows_at_full_ratio_equal_plain_prefill(smollm, flow, params):
    """ratio 1: every reused token is recomputed after the selection layer and every token before it,
    so the plan (selection layer, fresh-KV write, row slicing) must reproduce plain prefill
    (boundary 0: the selection layer is the first one, which still sees every token's q/k/v)."""
    logits, stats, layout, _ = reuse_logits(smollm, flow, reuse_parts(), params if flow == "epic" else {"ratio": "1.0", **params})
    torch.testing.assert_close(logits, plain_logits(smollm, layout), rtol=1e-4, atol=1e-4)
    assert stats.segment_hits == 2 and stats.recompute_ratio == 1.0


@pytest.mark.parametrize("min_run", [64, 2])  # rows as one masked group, or as causal runs
def test_reused_prefix_with_sparse_rows_equals_plain_prefill(smollm, min_run, monkeypatch):
    """A segment at position 0 was computed exactly as the prompt's prefix would be, so pie (only the
    new tokens computed, attending with the per-row causal mask over cached + fresh KV) is exact."""
    monkeypatch.setattr("sparsetune.engine.rows._MIN_RUN", min_run)
    parts = [{"text": DOC_A, "reuse": True, "namespace": "kb"}, "\n\nWhat is the secret code of the blue door?"]
    logits, stats, layout, _ = reuse_logits(smollm, "pie", parts)
    assert stats.segment_hits == 1 and 0 < stats.compute_fraction < 0.6
    torch.testing.assert_close(logits, plain_logits(smollm, layout), rtol=1e-4, atol=1e-4)


def test_realignment_in_the_engine_moves_keys_to_their_new_positions(smollm):
    """Layer 0's keys depend only on the token and its position: after realignment the reused segment's
    cached keys equal the keys a full prefill computes there; naive reuse leaves them at position 0."""
    _, _, layout, full_k = reuse_logits(smollm, "full_recompute", reuse_parts())
    _, _, _, pie_k = reuse_logits(smollm, "pie", reuse_parts())
    _, _, _, naive_k = reuse_logits(smollm, "naive_reuse", reuse_parts())
    seg = layout.segments[1]
    assert seg.start > 0
    sl = slice(seg.start, seg.end)
    torch.testing.assert_close(pie_k[:, sl], full_k[:, sl], rtol=1e-4, atol=1e-4)
    assert (naive_k[:, sl] - full_k[:, sl]).abs().max() > 1e-2


def test_reuse_generation_and_pin(smollm):
    parts = reuse_parts()
    parts[1] = {**parts[1], "pin": True}
    smollm.use_reuse("cacheblend")
    try:
        outs = smollm.generate([parts, parts], SamplingParams(max_tokens=6, ignore_eos=True), chat=False)
    finally:
        smollm.use_reuse(None)
    assert outs[0].reuse["segment_hits"] + outs[0].reuse["segment_misses"] == 2
    assert outs[1].reuse["segment_hits"] == 2 and outs[1].reuse["reuse_ratio"] > 0.5
    assert outs[0].token_ids == outs[1].token_ids and len(outs[1].token_ids) == 6
    seg = smollm.segments.lookup(smollm.tokenizer.encode(DOC_A), "kb")
    assert seg is not None and seg.pinned


def test_reuse_prefill_fills_the_decode_flows_fields(smollm):
    """KV written by a reuse prefill gets the decode flow's cache stage (quest: channel max/min of each
    full block), and the partial last block zero fields, whatever the blocks held before."""
    smollm.apply(smollm.setup.with_flow("quest", {"budget": "64"}))
    smollm.use_reuse("pie")
    try:
        layout = encode_parts(smollm.tokenizer, parse_parts(reuse_parts()), chat=False)
        attn, layer, bs = smollm.engine.backends[5], 5, smollm.engine.kv.block_size
        with torch.inference_mode():  # as the engine makes them: inference tensors
            attn.fields.pop(layer, None)
            for t in attn.stores(layer, smollm.engine.kv).values():
                t.fill_(7.0)
        seq, _ = smollm.add_reuse_request(layout, SamplingParams(max_tokens=3, ignore_eos=True))
        while seq.status == Status.WAITING:  # its segments' fills, then its own prefill step
            smollm.engine.step()
        n, table = len(layout.token_ids), seq.block_table
        full = torch.tensor(table[: n // bs], dtype=torch.long)
        keys = smollm.engine.kv.k[layer][full]  # [blocks, Hkv, bs, D]
        torch.testing.assert_close(attn.fields[layer]["kmax"][full].squeeze(2), keys.amax(2))
        torch.testing.assert_close(attn.fields[layer]["kmin"][full].squeeze(2), keys.amin(2))
        assert n % bs and (attn.fields[layer]["kmax"][table[n // bs]] == 0).all()
        while smollm.engine.scheduler.has_work():
            smollm.engine.step()
    finally:
        smollm.use_reuse(None)
        smollm.apply(smollm.setup.with_flow(None))


# ---- each flow's selection rule against a direct torch implementation ------------------------------

T, HQ, HKV, D = 40, 4, 2, 8


def _case(seed: int = 0, tail_reused: bool = False) -> SelectionInputs:
    g = torch.Generator().manual_seed(seed)
    spans = [Span(0, 5, False, "d"), Span(5, 17, True, "d"), Span(17, 20, False, "d"), Span(20, 34, True, "d")]
    spans.append(Span(34, 40, tail_reused, "d"))
    layout = ReuseLayout(list(range(T)), spans)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return SelectionInputs(layout, 1, layout.reused_mask(), r(T, HQ, D), r(T, HKV, D), r(T, HKV, D),
                           r(T, HKV, D), r(T, HKV, D), D**-0.5)


def _mass_reference(s: SelectionInputs, queries: list[int]) -> torch.Tensor:
    """Σ_heads Σ_queries softmax(q·k / √d) over keys 0..i, head by head, query by query."""
    mass = torch.zeros(T, dtype=torch.float64)
    for h in range(HQ):
        kh = s.k[:, h // (HQ // HKV)]
        for i in queries:
            p = torch.softmax((kh[: i + 1] @ s.q[i, h]) * s.scale, dim=0)
            mass[: i + 1] += p
    return mass


def _top(score: torch.Tensor, among: torch.Tensor, n: int) -> set[int]:
    idx = [i for i in range(T) if among[i]]
    return set(sorted(idx, key=lambda i: -float(score[i]))[:n])


def _chosen(flow: str, s: SelectionInputs, params: dict[str, str] | None = None) -> set[int]:
    f = build_flow(flow, params or {}, ReuseFlow)
    return set(f.select(s).nonzero().squeeze(1).tolist())


@pytest.mark.parametrize("dev", ["v", "k"])
def test_cacheblend_selects_largest_kv_deviation(dev):
    s = _case(1)
    n = round(0.15 * 26)
    fresh, old = (s.v, s.v_cached) if dev == "v" else (s.k, s.k_cached)
    deviation = torch.stack([((fresh[t] - old[t]) ** 2).sum() for t in range(T)])
    assert _chosen("cacheblend", s, {"deviation": dev}) == _top(deviation, s.reused, n)


def test_a3_selects_by_question_attention():
    s = _case(2)
    want = _top(_mass_reference(s, list(range(34, 40))), s.reused, round(0.3 * 26))
    assert _chosen("a3", s, {"ratio": "0.3"}) == want


@pytest.mark.parametrize("tail_reused", [False, True])
def test_sparsex_selects_sparse_q_top_k_overflow_and_tail(tail_reused):
    s = _case(3, tail_reused)
    nr = [i for i in range(T) if not s.reused[i]]
    reused = s.reused
    want = _top(_mass_reference(s, nr), reused, round(0.2 * int(reused.sum())))
    ov = 2
    for span in s.layout.spans:  # one "block" (here 2 tokens) of reused tokens each side of new text
        if not span.reuse:
            want |= {i for i in range(span.start - ov, span.start) if i >= 0 and reused[i]}
            want |= {i for i in range(span.end, span.end + ov) if i < T and reused[i]}
    if tail_reused:  # the prompt ends in reused text: its last `tail` tokens are recomputed
        want |= set(range(40 - 3, 40))
    assert _chosen("sparsex", s, {"ratio": "0.2", "overflow": str(ov), "tail": "3"}) == want


def test_epic_recomputes_the_first_k_tokens_of_each_non_leading_segment():
    layout = ReuseLayout(list(range(30)), [Span(0, 8, True, "d"), Span(8, 10, False, "d"), Span(10, 25, True, "d"),
                                           Span(25, 30, False, "d")])
    rows = build_flow("epic", {"k": "4"}, ReuseFlow).initial_rows(layout)
    assert set(rows.nonzero().squeeze(1).tolist()) == {10, 11, 12, 13}


def test_static_flows_compute_no_reused_token():
    layout = ReuseLayout(list(range(12)), [Span(0, 4, False, "d"), Span(4, 12, True, "d")])
    for name in ("pie", "naive_reuse"):
        f = build_flow(name, {}, ReuseFlow)
        assert not f.initial_rows(layout).any() and f.selection_layer(30) is None
    assert build_flow("sparsex", {}, ReuseFlow).selection_layer(30) == round(0.15 * 30)


# ---- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("parts,needle", [
    ("just text", "non-empty list of parts"),
    ([{"reuse": True}], r"prompt\[0\].text"),
    ([{"text": "a", "reused": True}], "unknown field"),
    ([{"text": "a", "pin": True}], "add \"reuse\": true"),
    ([{"text": "a", "reuse": "yes"}], "true or false"),
    ([{"text": "a", "reuse": True, "namespace": ""}], "namespace"),
    ([3], "expected a string or an object"),
])
def test_bad_segment_specs(parts, needle):
    with pytest.raises(SparsetuneError, match=needle):
        parse_parts(parts)


def test_decode_flow_is_not_a_reuse_flow(smollm):
    with pytest.raises(SparsetuneError, match="decode flow, not a reuse flow; pass it with --flow quest"):
        smollm.use_reuse("quest")
    with pytest.raises(SparsetuneError, match="has no parameter 'ratoi'"):
        smollm.use_reuse("cacheblend", {"ratoi": "0.1"})


# ---- the rag workload through sparsetune eval ----------------------------------------------------

@pytest.mark.parametrize("task", ["rag", "chat", "agent"])
def test_reuse_sample_holds_its_answer_in_one_reusable_segment(smollm, task):
    from sparsetune.evaluation.reuse_tasks import REUSE_TASKS
    from sparsetune.evaluation.samples import final_prompt_tokens
    from sparsetune.evaluation.tasks import build_samples

    (s,) = build_samples(task, smollm.tokenizer, 1024, 1, 0)
    segs = [p for p in s.segments if p.get("reuse")]
    assert len(segs) == REUSE_TASKS[task].count and "".join(p["text"] for p in s.segments) == s.turns[0].user
    assert sum(s.turns[0].answers[0] in d["text"] for d in segs) == 1
    assert segs[s.meta["position"]]["text"].count(s.turns[0].answers[0]) == 1
    assert len({p["namespace"] for p in segs}) == 1 and abs(final_prompt_tokens(smollm.tokenizer, s) - 1024) <= 51


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_eval_rag_with_a_reuse_flow(smollm, tmp_path):
    import json

    from sparsetune.api import eval as evaluate

    res = evaluate("dense", model="smollm2-135m", tasks=["rag"], context=768, samples=2, batch=2, out=tmp_path,
                   reuse="cacheblend", reuse_params={"ratio": "0.2"}, llm=smollm)
    smollm.use_reuse(None)
    ru = res["reuse"]
    assert ru["flow"] == "cacheblend" and ru["params"]["ratio"] == 0.2 and ru["requests"] == 2
    assert ru["reuse_ratio"] > 0.8 and abs(ru["recompute_ratio"] - 0.2) < 0.01 and ru["ttft_p50_s"] > 0
    assert res["dense_accuracy"] is not None and res["fidelity"]["positions"] > 0  # the reference ran
    recs = [json.loads(line) for line in (tmp_path.glob("*/samples.jsonl").__next__()).read_text().splitlines()]
    assert all(r["reuse"]["segment_hits"] == 6 for r in recs)  # stage 1 stored every document first
    assert "-cacheblend-smollm2-135m" in res["run_dir"] and "dense" not in res["run_dir"]
