"""Per-head reuse flows (LoopServe, RedKnot): each rule against a direct torch implementation, the
engine paths against plain prefill and pie, and the head profile against HF transformers' own
attention maps."""

from __future__ import annotations

import json

import pytest
import torch

from sparsetune.loader import build_flow
from sparsetune.setup import resolve
from sparsetune.flow.attention import FlowAttention
from sparsetune.reuse import ReuseFlow
from sparsetune.reuse.base import LayerInputs
from sparsetune.calibration.heads import PREFIXES, profile_heads
from sparsetune.reuse.head_classes import global_heads
from sparsetune.reuse.parts import ReuseLayout, Span
from helpers import (
    HEAD_DIM, HKV, GROUP, paged_case, prefill_cache, selected_sets, reference_selection, DOC_A, reuse_parts, reuse_logits, plain_logits,
)

# ---- LoopServe --------------------------------------------------------------------------------------


def _lines_reference(probs: torch.Tensor, rows: list[int], alpha: float) -> tuple[set[int], set[int]]:
    """One head: lines ranked by mass (verticals before slashes on ties), added one at a time until the
    union of their entries holds alpha of the map's mass, the union counted entry by entry."""
    n, t = probs.shape
    vert = [(float(probs[:, j].sum()), 0, j) for j in range(t)]
    slash = [(float(sum(probs[r, rows[r] - d] for r in range(n) if rows[r] - d >= 0)), 1, d) for d in range(t)]
    order = sorted(range(2 * t), key=lambda i: -(vert + slash)[i][0])  # stable: ties keep verticals first
    v, s, total = set(), set(), float(probs.sum())
    for i in order:
        _, kind, x = (vert + slash)[i]
        (v if kind == 0 else s).add(x)
        covered = sum(float(probs[r, j]) for r in range(n) for j in range(t) if j in v or rows[r] - j in s)
        if covered >= alpha * total - 1e-6:
            break
    return v, s


@pytest.mark.parametrize("one_head_a_round", [False, True])
@pytest.mark.parametrize("alpha", [0.5, 0.8, 0.955])
def test_loopserve_lines_match_the_greedy_cover(alpha, one_head_a_round, monkeypatch):
    import sys

    from sparsetune.loader import get_flow_class

    from sparsetune.kernels import line_select

    module = sys.modules[get_flow_class("loopserve", ReuseFlow).__module__]
    if one_head_a_round:  # what a long map does: the torch twin takes the heads in rounds, to bound the temporaries
        monkeypatch.setattr(line_select, "_CHUNK", 1)
    cover_lines = module.cover_lines
    g = torch.Generator().manual_seed(int(alpha * 1000))
    rows = [9, 10, 12, 13]
    t = 14
    logits = torch.randn(3, len(rows), t, generator=g, dtype=torch.float64) * 2
    logits.masked_fill_(torch.arange(t)[None, None, :] > torch.tensor(rows)[None, :, None], float("-inf"))
    probs = torch.softmax(logits, -1)
    vertical, slash = cover_lines(probs, torch.tensor(rows), alpha)
    for h in range(3):
        v, s = _lines_reference(probs[h], rows, alpha)
        assert set(vertical[h].nonzero().view(-1).tolist()) == v
        assert set(slash[h].nonzero().view(-1).tolist()) == s


def test_loopserve_prefill_at_full_coverage_equals_pie(smollm):
    """alpha 1: every line with mass is chosen, so the new rows see every earlier key, as pie's do;
    a small alpha really drops keys."""
    pie, _, layout, _ = reuse_logits(smollm, "pie", reuse_parts())
    full, stats, _, _ = reuse_logits(smollm, "loopserve", reuse_parts(), {"alpha": "1.0"})
    torch.testing.assert_close(full, pie, rtol=1e-4, atol=1e-4)
    sparse, _, _, _ = reuse_logits(smollm, "loopserve", reuse_parts(), {"alpha": "0.5"})
    assert (sparse - pie).abs().max() > 1e-2
    assert stats.recomputed_reused == 0 and stats.segment_hits == 2


def test_loopserve_brings_its_decode_flow():
    s = resolve(reuse="loopserve", reuse_params={"budget": "64", "interval": "8"})
    assert s.flow.name == "loopserve_decode" and (s.flow.params["budget"], s.flow.params["interval"]) == (64, 8)
    assert s.flow.origin["budget"] == "reuse" and s.reuse.params["budget"] == 64
    s = resolve(flow="quest", params={"budget": "32"}, reuse="loopserve")
    assert s.flow.name == "quest" and s.flow.params["budget"] == 32
    assert resolve(reuse="sparsex").flow is None
    assert resolve(flow="dense", reuse="loopserve").flow is None  # dense stays dense


def test_loopserve_decode_reselects_every_interval():
    """Direct torch rule: each step adds every block's exact attention share (summed over the query
    group) to a window total; every `interval` steps the window total becomes the frozen score and
    the window restarts; before the first re-selection the running window total selects."""
    lens = [14 * 16 + 3, 9 * 16]
    kv, bt, meta, _ = paged_case(16, lens, seed=4)
    interval = 3
    attn = FlowAttention(build_flow("loopserve_decode", {"budget": "64", "interval": str(interval)}), HEAD_DIM**-0.5)
    prefill_cache(attn, kv, bt, lens)
    state = [{"window": torch.zeros(-(-n // 16), HKV, dtype=torch.float64), "chosen": None, "tick": 0} for n in lens]
    g = torch.Generator().manual_seed(1)
    for step in range(2 * interval + 2):
        q = torch.randn(len(lens), HKV * GROUP, HEAD_DIM, generator=g, dtype=torch.float64)
        got = selected_sets(attn, kv, bt, meta, q)
        for b, n in enumerate(lens):
            nblocks, st = -(-n // 16), state[b]
            for h in range(HKV):
                keys = kv.k[0][bt[b, :nblocks].long(), h].reshape(-1, HEAD_DIM)[:n]
                probs = torch.softmax(q[b, h * GROUP : (h + 1) * GROUP] @ keys.T * HEAD_DIM**-0.5, -1)  # [G, n]
                share = torch.zeros(GROUP, nblocks * 16, dtype=torch.float64)
                share[:, :n] = probs
                st["window"][:, h] += share.view(GROUP, nblocks, 16).sum(-1).sum(0)
            st["tick"] += 1
            if st["tick"] >= interval:
                st["chosen"], st["window"], st["tick"] = st["window"].clone(), torch.zeros_like(st["window"]), 0
            score = st["window"] if st["chosen"] is None else st["chosen"]
            for h in range(HKV):
                assert got[b][h] == reference_selection(score[:, h], nblocks, 4, 1, 2), (step, b, h)


# ---- RedKnot ----------------------------------------------------------------------------------------

L, T, HQ, D = 4, 40, 4, 8
SPANS = [Span(0, 5, False, "d"), Span(5, 21, True, "d"), Span(21, 24, False, "d"), Span(24, 38, True, "d"),
         Span(38, 40, False, "d")]


def _redknot(**params) -> ReuseFlow:
    f = build_flow("redknot", {k: str(v) for k, v in params.items()}, ReuseFlow)
    f.set_head_scores(torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.05]]))
    return f


def test_redknot_head_classes_are_the_top_scores():
    scores = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.05]])
    assert global_heads(scores, 0.25).nonzero().tolist() == [[0, 1], [1, 0]]
    f = _redknot(global_ratio=0.25, dense_layers=1)
    assert f._global.tolist() == [[True, True], [True, False], [False, False], [False, False]]


def test_redknot_local_heads_keep_cached_kv_outside_sinks_and_each_segments_window():
    f = _redknot(global_ratio=0.25, dense_layers=1, window=6, sink=2)
    layout = ReuseLayout(list(range(T)), SPANS)
    reused = layout.reused_mask()
    rows = torch.arange(T)
    assert f.keep_cached(0, L, rows, layout, reused) is None  # dense layer: every head global
    keep = f.keep_cached(2, L, rows, layout, reused)  # both heads local
    for i in range(T):
        seg = next((s for s in SPANS if s.reuse and s.start <= i < s.end), None)
        want = seg is not None and i >= 2 and i - seg.start >= 6
        assert keep[i].tolist() == [want, want], i
    keep1 = f.keep_cached(1, L, rows, layout, reused)  # head 0 global, head 1 local
    assert not keep1[:, 0].any() and torch.equal(keep1[:, 1], keep[:, 1])


def _layer_inputs(layer: int, seed: int = 0) -> LayerInputs:
    g = torch.Generator().manual_seed(seed)
    layout = ReuseLayout(list(range(T)), SPANS)
    return LayerInputs(layout, layer, L, layout.reused_mask(), torch.arange(T),
                       torch.randn(T, HQ, D, generator=g, dtype=torch.float64),
                       torch.randn(T, 2, D, generator=g, dtype=torch.float64), D**-0.5)


def test_redknot_local_heads_see_sinks_and_window_only():
    f = _redknot(global_ratio=0.25, dense_layers=1, window=6, sink=2)
    s = _layer_inputs(1)
    assert f.attention_pattern(_layer_inputs(0)) is None
    allowed = f.attention_pattern(s)(torch.tensor([3, 17, 39]))  # [HQ, 3, T]
    for h in range(HQ):
        local = h >= HQ // 2  # layer 1: KV head 0 global, KV head 1 local; query heads 2, 3 read head 1
        for r, i in enumerate([3, 17, 39]):
            want = [not local or j < 2 or i - j < 6 for j in range(T)]
            assert allowed[h, r].tolist() == want


def test_redknot_sparse_ffn_keeps_the_tokens_holding_the_mass():
    f = _redknot(ffn_layer=2, ffn_mass=0.5, ffn_recent=5)
    assert f.mlp_rows(_layer_inputs(1)) is None
    s = _layer_inputs(3)
    got = f.mlp_rows(s)
    mass = torch.zeros(T, dtype=torch.float64)  # Σ heads, recent rows of softmax over keys 0..i
    for h in range(HQ):
        for i in range(T - 5, T):
            mass[: i + 1] += torch.softmax(s.k[: i + 1, h // 2] @ s.q[i, h] * s.scale, 0)
    order = sorted(range(T), key=lambda j: -float(mass[j]))
    want, held = set(), 0.0
    for j in order:
        want.add(j)
        held += float(mass[j])
        if held >= 0.5 * float(mass.sum()):
            break
    want |= set(range(T - 5, T)) | {i for i in range(T) if not s.reused[i]}
    assert set(got.nonzero().view(-1).tolist()) == want
    assert len(want) < T  # the rule really skips tokens here


def test_redknot_head_paged_kv_fraction():
    f = _redknot(global_ratio=0.25, dense_layers=1, window=6, sink=2)
    layout = ReuseLayout(list(range(T)), SPANS)
    glob = 3  # two dense-layer heads + (1, 0)
    assert f.head_paged_kv_fraction(layout) == pytest.approx((glob * T + (8 - glob) * 8) / (8 * T))


def test_redknot_with_every_head_global_equals_plain_prefill(smollm, head_file):
    params = {"head_classes": head_file, "global_ratio": "1.0", "ffn_layer": "1000"}
    logits, stats, layout, _ = reuse_logits(smollm, "redknot", reuse_parts(), params)
    torch.testing.assert_close(logits, plain_logits(smollm, layout), rtol=1e-4, atol=1e-4)
    assert stats.fresh_kv == stats.num_layers * stats.num_kv_heads * stats.reused_tokens


def test_redknot_reuses_local_heads_and_skips_mlp_rows(smollm, head_file):
    params = {"head_classes": head_file, "window": "8", "ffn_layer": "20"}
    logits, stats, layout, _ = reuse_logits(smollm, "redknot", reuse_parts(), params)
    d = stats.to_dict()
    assert 0.1 < d["fresh_kv_fraction"] < 0.9 and d["mlp_fraction"] < 1.0 and d["compute_fraction"] == 1.0
    assert 0 < d["head_paged_kv_fraction"] < 1
    assert (logits - plain_logits(smollm, layout)).abs().max() > 1e-3


def test_redknot_without_a_profile_says_which_command_to_run(smollm, tmp_path, monkeypatch):
    from sparsetune.errors import SparsetuneError

    monkeypatch.setenv("SPARSETUNE_MODELS", str(tmp_path / "models"))
    with pytest.raises(SparsetuneError, match="sparsetune flows profile-heads --model smollm2-135m"):
        smollm.use_reuse("redknot")


def test_profile_heads_matches_hf_attention_maps(smollm, tmp_path):
    """prefix shift and edge mass recomputed from HF transformers' eager attention probabilities."""
    from transformers import AutoModelForCausalLM

    sink, window, n = 2, 16, 40
    text = DOC_A * 2
    path = profile_heads(text=text, chunks=1, chunk_tokens=n, sink=sink, window=window, device="cpu",
                         out=tmp_path / "p.json")
    data = json.loads(path.read_text())
    hf = AutoModelForCausalLM.from_pretrained(str(smollm.resolved.weights_dir), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    tok = smollm.tokenizer
    chunk = tok.encode(text)[:n]

    def maps(ids):
        with torch.no_grad():
            return [a[0].double() for a in hf(torch.tensor([ids]), output_attentions=True).attentions]  # [Hq, T, T]

    alone = maps(chunk)
    cfg = smollm.model_config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    shift = torch.zeros(cfg.num_hidden_layers, cfg.num_attention_heads, dtype=torch.float64)
    edge = torch.zeros_like(shift)
    for pre in PREFIXES:
        p = len(tok.encode(pre))
        for li, m in enumerate(maps(tok.encode(pre) + chunk)):
            rows = m[:, p:]  # [Hq, n, p + n]
            shift[li] += 1 - torch.nn.functional.cosine_similarity(rows[:, :, p:].flatten(1), alone[li].flatten(1), dim=1)
            pos, keys = torch.arange(p, p + n), torch.arange(p + n)
            inside = (keys[None] < sink) | (pos[:, None] - keys[None] < window)
            edge[li] += (rows * ~inside).sum(-1).mean(-1)
    per_kv = lambda x: (x / 2).view(cfg.num_hidden_layers, -1, group).amax(-1)  # noqa: E731
    torch.testing.assert_close(torch.tensor(data["prefix_shift"], dtype=torch.float64), per_kv(shift), atol=2e-3, rtol=0)
    torch.testing.assert_close(torch.tensor(data["edge_mass"], dtype=torch.float64), per_kv(edge), atol=2e-3, rtol=0)
    assert data["chunks"] == 1 and data["chunk_tokens"] == n
