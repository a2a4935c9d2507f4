"""Decode flows: full budget equals dense; reduced-budget selections equal the published rules
implemented directly in torch; the checker rejects bad programs with the offending line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from sparsetune.engine.attention import AttentionMetadata
from sparsetune.engine.kv_cache import KVCache
from sparsetune.errors import SparsetuneError
from sparsetune.flow.check import check_flow
from sparsetune.loader import build_flow, get_flow_class
from sparsetune.flow.attention import FlowAttention
from sparsetune.models.artifacts import synthetic_calibration
from helpers import HEAD_DIM, HKV, GROUP, paged_case, prefill_cache, selected_sets, reference_selection, block_keys


@pytest.mark.parametrize("name", ["quest", "block_topk", "sphere"])
@pytest.mark.parametrize("block_size", [2, 4, 16])  # 2: the granularity that keeps >= 95% of dense on the default model
def test_selection_matches_published_rule(name, block_size):
    lens = [23 * block_size + 5, 9 * block_size, 40 * block_size - 1]
    kv, bt, meta, q = paged_case(block_size, lens, seed=block_size)
    flow = build_flow(name, {"budget": str(6 * block_size), "block_size": str(block_size), "sink_blocks": "1", "local_blocks": "2"})
    attn = FlowAttention(flow, HEAD_DIM**-0.5)
    prefill_cache(attn, kv, bt, lens)
    got = selected_sets(attn, kv, bt, meta, q)
    for b, n in enumerate(lens):
        nblocks, nfull = -(-n // block_size), n // block_size
        for h in range(HKV):
            keys = block_keys(kv, bt, b, h, nfull)  # only full blocks have cache-stage fields
            s = _rule_scores(name, keys, q[b, h * GROUP : (h + 1) * GROUP])
            score = torch.cat([s, torch.zeros(nblocks - nfull, dtype=s.dtype)])  # partial block is forced anyway
            want = reference_selection(score, nblocks, 6, 1, 2)
            assert got[b][h] == want, (name, b, h)
            assert len(want) < nblocks  # the budget really cut something
    if name == "sphere":  # the radius term decides somewhere: not block top-k's selection
        plain = FlowAttention(build_flow("block_topk", {"budget": str(6 * block_size), "block_size": str(block_size),
                                                        "sink_blocks": "1", "local_blocks": "2"}), HEAD_DIM**-0.5)
        prefill_cache(plain, kv, bt, lens)
        assert selected_sets(plain, kv, bt, meta, q) != got


@pytest.mark.parametrize("name", ["quest", "block_topk", "sphere"])
@pytest.mark.parametrize("unit", [1, 2, 4])
def test_units_inside_blocks_select_and_attend_by_the_published_rule(name, unit):
    """`select_block` units inside 16-token blocks: fields per unit, the published rule over units
    (sinks, local window and budget counted in units), and decode attends exactly the tokens of the
    chosen units (float64 reference over those positions)."""
    page = 16
    lens = [23 * page + 5, 9 * page, 40 * page - 1]
    kv, bt, meta, q = paged_case(page, lens, seed=40 + unit)
    flow = build_flow(name, {"budget": str(24 * unit), "block_size": "16", "select_block": str(unit),
                             "sink_blocks": "1", "local_blocks": "2"})
    attn = FlowAttention(flow, HEAD_DIM**-0.5)
    prefill_cache(attn, kv, bt, lens)
    got = selected_sets(attn, kv, bt, meta, q)
    out = attn.decode(0, q, kv, meta)
    for b, n in enumerate(lens):
        nunits, nfull = -(-n // unit), n // unit
        pos = torch.arange(nfull * unit)
        tokens = kv.k[0][bt[b, pos // page].long(), :, pos % page]  # [nfull * unit, Hkv, D]
        for h in range(HKV):
            keys = tokens[:, h].reshape(nfull, unit, HEAD_DIM)
            qg = q[b, h * GROUP : (h + 1) * GROUP]
            s = _rule_scores(name, keys, qg)
            score = torch.cat([s, torch.zeros(nunits - nfull, dtype=s.dtype)])
            want = reference_selection(score, nunits, 24, 1, 2)
            assert got[b][h] == want, (name, b, h)
            assert len(want) < nunits
            seen = torch.tensor(sorted(t for x in want for t in range(x * unit, (x + 1) * unit) if t < n))
            k = kv.k[0][bt[b, seen // page].long(), h, seen % page]
            v = kv.v[0][bt[b, seen // page].long(), h, seen % page]
            ref = torch.softmax(qg @ k.T * HEAD_DIM**-0.5, dim=-1) @ v
            torch.testing.assert_close(out[b, h * GROUP : (h + 1) * GROUP], ref, rtol=1e-5, atol=1e-5)  # fp32 softmax


def _rule_scores(name, keys, qg, channels=None):
    """The published rule's score of each group of keys `[n, size, D]` for the group's queries `qg`
    (`channels`: the KV head's calibrated channels, for the rules on them)."""
    if name == "quest":  # Σ_d max(q_d·max_d, q_d·min_d), max over the group
        kmax, kmin = keys.amax(1), keys.amin(1)
        return torch.maximum(qg[:, None] * kmax[None], qg[:, None] * kmin[None]).sum(-1).amax(0)
    if name == "sphere":  # q·c + w |q| max_i |k_i - c|, max over the group (w: the default 0.25)
        c = keys.mean(1)
        radius = (keys - c[:, None]).norm(dim=-1).amax(1)  # [n]
        return (qg @ c.T + 0.25 * qg.norm(dim=-1)[:, None] * radius[None]).amax(0)
    if name == "sub_blocks_on_channels":  # the best of four sub-block centroids, on the channels
        n, size, _ = keys.shape
        cents = keys.reshape(n, 4, size // 4, -1).mean(2)[..., channels]  # [n, 4, r]
        return (cents @ qg[:, channels].T).amax((1, 2))
    if name == "mean_on_channels":
        return (qg[:, channels] @ keys.mean(1)[:, channels].T).amax(0)
    return (qg @ keys.mean(1).T).amax(0)  # block top-k: max over the group of q·mean(k)


@pytest.mark.parametrize("block_size", [4, 16])
def test_double_sparse_centroid_selects_by_the_label_centroid_rule(block_size):
    """Each block's mean key on the KV head's calibrated channels, scored by the group's queries on
    the same channels (max over the group): the blocks a plain torch ranking picks."""
    lens = [23 * block_size + 5, 9 * block_size, 40 * block_size - 1]
    kv, bt, meta, q = paged_case(block_size, lens, seed=60 + block_size)
    flow = build_flow("double_sparse_centroid", {"budget": str(6 * block_size), "block_size": str(block_size),
                                                 "sink_blocks": "1", "local_blocks": "2", "channels": "8"})
    calib = synthetic_calibration(1, HKV, HEAD_DIM)
    attn = FlowAttention(flow, HEAD_DIM**-0.5, calibration=calib)
    prefill_cache(attn, kv, bt, lens)
    got = selected_sets(attn, kv, bt, meta, q)
    for b, n in enumerate(lens):
        nblocks, nfull = -(-n // block_size), n // block_size
        for h in range(HKV):
            keys = block_keys(kv, bt, b, h, nfull)
            s = _rule_scores("mean_on_channels", keys, q[b, h * GROUP : (h + 1) * GROUP], calib[0][h][:8])
            want = reference_selection(torch.cat([s, torch.zeros(nblocks - nfull, dtype=s.dtype)]), nblocks, 6, 1, 2)
            assert got[b][h] == want, (b, h)
            assert len(want) < nblocks
    # not block top-k's rule: on all channels other blocks win somewhere
    plain = build_flow("block_topk", {"budget": str(6 * block_size), "block_size": str(block_size),
                                      "sink_blocks": "1", "local_blocks": "2"})
    other = FlowAttention(plain, HEAD_DIM**-0.5)
    prefill_cache(other, kv, bt, lens)
    assert selected_sets(other, kv, bt, meta, q) != got


# (flow, its rule over blocks, its rule over units): quest and block_topk run their own rule at both
# levels; quest_2l's page stages are Quest's bound and its units are scored by the mean key;
# double_sparse_2l's pages by their best sub-block centroid and its units by their mean key, both on
# the KV head's calibrated channels; sphere_2l's pages by the sphere score, its units by the mean key.
TWO_LEVEL = [("quest", "quest", "quest"), ("block_topk", "block_topk", "block_topk"),
             ("quest_2l", "quest", "block_topk"), ("block_topk_2l", "block_topk", "block_topk"),
             ("double_sparse_2l", "sub_blocks_on_channels", "mean_on_channels"), ("sphere_2l", "sphere", "block_topk")]


@pytest.mark.parametrize("name,page_rule,unit_rule", TWO_LEVEL)
@pytest.mark.parametrize("unit,coarse", [(2, 2.0), (4, 1.5), (1, 3.0)])
def test_two_level_selection_is_every_unit_scored_inside_the_top_blocks(name, page_rule, unit_rule, unit, coarse,
                                                                        tmp_path):
    """A two-level flow (`coarse`): the page rule over whole 16-token blocks keeps the best
    coarse x budget of them (its always-kept blocks hold the always-kept units), then the units are
    ranked inside those blocks only: exactly the units a plain torch ranking of every unit picks once
    the units outside the chosen blocks are struck out. quest_2l runs from an untrusted copy too:
    its page stages replayed from traced graphs."""
    page, budget = 16, 24 * unit
    lens = [23 * page + 5, 9 * page, 40 * page - 1]
    kv, bt, meta, q = paged_case(page, lens, seed=50 + unit)
    spec = name
    if name == "quest_2l" and unit == 2:  # not the shipped file's bytes: a traced graph flow
        spec = str(tmp_path / "my_quest_2l.py")
        (tmp_path / "my_quest_2l.py").write_text(get_flow_class("quest_2l").path.read_text().replace(
            '"quest_2l"', '"my_quest_2l"'))
    flow = build_flow(spec, {"budget": str(budget), "select_block": str(unit), "coarse": str(coarse),
                             "sink_blocks": "1", "local_blocks": "2", **({"channels": "8"} if get_flow_class(name).calibrated else {})})
    assert flow.uses_stage_graphs() == (spec != name)
    first = flow.page_flow()
    assert (first.sink_blocks, first.local_blocks) == (1, 2) and first.budget == -(-int(coarse * budget) // 1)
    calib = synthetic_calibration(1, HKV, HEAD_DIM) if flow.calibrated else None
    attn = FlowAttention(flow, HEAD_DIM**-0.5, calibration=calib)
    prefill_cache(attn, kv, bt, lens)
    prefill_cache(attn.pages, kv, bt, lens)
    got = selected_sets(attn, kv, bt, meta, q)
    for b, n in enumerate(lens):
        nunits, nfull = -(-n // unit), n // unit
        npages, pfull = -(-n // page), n // page
        pos = torch.arange(npages * page).clamp(max=n - 1)
        tokens = kv.k[0][bt[b, pos // page].long(), :, pos % page]
        for h in range(HKV):
            qg = q[b, h * GROUP : (h + 1) * GROUP]
            ch = calib[0][h][:flow.channels] if calib else None
            pscore = torch.cat([_rule_scores(page_rule, tokens[: pfull * page, h].reshape(pfull, page, HEAD_DIM), qg, ch),
                                torch.zeros(npages - pfull, dtype=q.dtype)])
            pages = reference_selection(pscore, npages, first.budget_blocks(npages), 1, 2)
            uscore = torch.cat([_rule_scores(unit_rule, tokens[: nfull * unit, h].reshape(nfull, unit, HEAD_DIM), qg, ch),
                                torch.zeros(nunits - nfull, dtype=q.dtype)])
            inside = torch.tensor([x * unit // page in pages for x in range(nunits)])
            want = reference_selection(uscore.masked_fill(~inside, float("-inf")), nunits, flow.budget_blocks(nunits), 1, 2)
            assert got[b][h] == want, (name, b, h)
            assert all(inside[x] for x in want)
            if b == 2:  # the longest: both levels cut
                assert len(want) < inside.sum() < nunits


def test_a_unit_must_divide_the_block():
    with pytest.raises(SparsetuneError, match="select_block=32 must divide block_size=16"):
        build_flow("quest", {"select_block": "32"})


def test_streaming_keeps_sinks_and_window_only():
    lens = [50 * 16 + 3, 3 * 16]
    kv, bt, meta, q = paged_case(16, lens)
    attn = FlowAttention(build_flow("streaming", {"sink_blocks": "2", "local_blocks": "5"}), HEAD_DIM**-0.5)
    got = selected_sets(attn, kv, bt, meta, q)
    assert got[0] == [set(range(2)) | set(range(46, 51))] * HKV
    assert got[1] == [set(range(3))] * HKV


@pytest.mark.parametrize("name,extra", [("quest", {}), ("block_topk", {}), ("streaming", {"local_blocks": "4096"}),
                                        ("block_topk", {"block_size": "1"}), ("h2o", {}), ("tidal", {}),
                                        ("double_sparse", {}), ("double_sparse", {"block_size": "1", "channels": "8"}),
                                        ("double_sparse_centroid", {"block_size": "4"}),
                                        ("quest", {"select_block": "2"}), ("block_topk", {"select_block": "4"}),
                                        ("quest", {"select_block": "2", "coarse": "2"}), ("sphere", {"block_size": "4"}),
                                        ("sphere", {"radius_weight": "1.0", "select_block": "2"}), ("sphere_2l", {})])
def test_full_budget_equals_dense(name, extra):
    report = check_flow(get_flow_class(name, all_problems=True), extra, head_dim=HEAD_DIM, group=GROUP)
    assert report.full_budget_rel_err is not None and report.full_budget_rel_err < 1e-6  # fp32 softmax, other summation order


def test_check_reports_cost():
    r = check_flow(get_flow_class("quest", all_problems=True), head_dim=64, group=4)
    assert r.fields == {"kmax": [1, 64], "kmin": [1, 64]}
    assert r.field_bytes_per_block == 2 * 2 * 64
    # Per block: 2 products + max over G*D, a sum to G, a max to 1: 4*G*D + G*(D) ... at least 3*G*D.
    assert r.indexer_flops_per_block >= 3 * 4 * 64


BAD_FLOWS = {
    "uses torch": ("s = torch.zeros(1)\n        return F.topk(s)", "`torch` is not allowed", 1),
    "unknown op": ("return F.topk(F.frobnicate(q))", "unknown op F.frobnicate", 1),
    "bad shapes": ('s = F.gemm(fields["c"], F.transpose(q))\n        return F.topk(F.max(s, dim=2))', "inner dims differ", 1),
    "score rank": ('return F.topk(F.gemm(fields["c"], q))', "F.topk needs a score of shape [S, 1, 1]", 1),
    "missing field": ('return F.topk(F.max(F.gemm(fields["nope"], q), dim=2))', "field 'nope' is not written", 1),
}


@pytest.mark.parametrize("case", list(BAD_FLOWS))
def test_check_rejects_bad_programs_with_line(case, tmp_path):
    body, message, line_offset = BAD_FLOWS[case]
    head = [
        "from sparsetune.flow import DecodeFlow",
        "from sparsetune.flow import ops as F",
        "",
        "",
        "class Bad(DecodeFlow):",
        '    name = "bad"',
        "",
        "    def cache(self, k, v):",
        '        return {"c": F.mean(k, dim=1)}',
        "",
        "    def index(self, q, fields):",
    ]
    lines = head + ["        " + li.strip() for li in body.splitlines()]
    path = tmp_path / "bad.py"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SparsetuneError) as e:
        check_flow(get_flow_class(str(path), all_problems=True))
    msg = str(e.value)
    assert message in msg, msg
    assert f"bad.py:{len(head) + line_offset}:" in msg, msg  # points at the offending line


def test_check_rejects_unread_field(tmp_path):
    path = tmp_path / "unread.py"
    path.write_text(textwrap.dedent('''
        from sparsetune.flow import DecodeFlow
        from sparsetune.flow import ops as F


        class Unread(DecodeFlow):
            name = "unread"

            def cache(self, k, v):
                return {"c": F.mean(k, dim=1), "extra": F.max(k, dim=1)}

            def index(self, q, fields):
                return F.topk(F.max(F.gemm(fields["c"], q), dim=2))
    '''))
    with pytest.raises(SparsetuneError, match="extra written by cache\\(\\) but never read"):
        check_flow(get_flow_class(str(path), all_problems=True))


@pytest.mark.parametrize("raw,needle", [({"budget": "lots"}, "expected int"), ({"block_size": "12"}, "must be one of"),
                                        ({"bugdet": "5"}, "has no parameter 'bugdet'"), ({"local_blocks": "0"}, "must be in")])
def test_param_errors(raw, needle):
    with pytest.raises(SparsetuneError, match=needle):
        build_flow("quest", raw)


@pytest.mark.parametrize("key", ["budget", "budget_ratio"])
def test_streaming_refuses_a_budget(key):
    """StreamingLLM's window is its budget: a budget it would silently ignore is an error naming the fix."""
    with pytest.raises(SparsetuneError, match="local_blocks"):
        build_flow("streaming", {key: "0.5" if key == "budget_ratio" else "512"})


def test_flows_new_then_check_passes(tmp_path):
    out = tmp_path / "my_flow.py"
    run = [sys.executable, "-m", "sparsetune.cli.main"]
    assert subprocess.run([*run, "flows", "new", "my_flow", "--out", str(out)], capture_output=True).returncode == 0
    proc = subprocess.run([*run, "flows", "check", str(out), "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["name"] == "my_flow" and report["full_budget_rel_err"] < 1e-6


@pytest.mark.slow  # >= 10 s on 2 CPU cores
@pytest.mark.parametrize("flow", ["quest", "tidal"])
def test_engine_generous_budget_equals_dense(smollm, flow):
    from sparsetune.llm import LLM
    from sparsetune.engine.sequence import SamplingParams

    prompts = ["What is the capital of France?", "Name three primary colours and say which one you like most."]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    dense = [o.token_ids for o in smollm.generate(prompts, params)]
    llm = LLM(model="smollm2-135m", device="cpu", num_kv_blocks=64, flow=flow, params={"budget": "4096"})
    assert [o.token_ids for o in llm.generate(prompts, params)] == dense


def test_engine_small_budget_really_selects(smollm):
    from sparsetune.llm import LLM
    from sparsetune.engine.sequence import SamplingParams

    llm = LLM(model="smollm2-135m", device="cpu", num_kv_blocks=64, flow="block_topk",
              params={"budget": "32", "block_size": "8", "dense_layers": "0"})
    llm.generate(["Describe a sunset over the ocean in two vivid sentences, please."], SamplingParams(max_tokens=4))
    attn = llm.engine.backends[5]
    blocks, counts = attn.last_selection[5]
    nblocks = -(-(llm.stats.prefill_tokens + 3) // 8)
    assert int(counts.max()) == 4 < nblocks  # 32 tokens of 8 = 4 blocks out of ~8
    assert llm.engine.backends[0].name == "dense"


@pytest.mark.parametrize("name", ["quest", "block_topk", "double_sparse", "double_sparse_centroid", "sphere"])
def test_compiled_executor_equals_reference(name):
    """torch.compile'd stages (Inductor; C++ on CPU, Triton on GPU) select exactly what the reference does."""

    lens = [30 * 16 + 7, 11 * 16]
    kv, bt, meta, q = paged_case(16, lens, seed=3)
    flow = build_flow(name, {"budget": "96"})
    cal = synthetic_calibration(1, HKV, HEAD_DIM) if flow.calibrated else None
    ref = FlowAttention(flow, HEAD_DIM**-0.5, calibration=cal)
    comp = FlowAttention(flow, HEAD_DIM**-0.5, executor="compiled", calibration=cal)
    for attn in (ref, comp):
        prefill_cache(attn, kv, bt, lens)
    # Decode-time cache stage through each executor: the block of a token that completes it.
    pos = torch.tensor([lens[0] - 1 + 9, lens[1] - 1])  # second row completes its last block
    phys = bt.gather(1, (pos // 16).view(-1, 1)).view(-1).long()
    for attn in (ref, comp):
        attn.run_cache(0, kv, phys, phys, fixed_shape=True)
    for f in ref.fields[0]:
        assert torch.allclose(ref.fields[0][f], comp.fields[0][f], atol=1e-6, rtol=1e-6)
    assert selected_sets(ref, kv, bt, meta, q) == selected_sets(comp, kv, bt, meta, q)


@pytest.mark.parametrize("sx,sy", [(5, 1), (1, 5), (5, 5), (1, 1)])
def test_gemm_op_matches_einsum(sx, sy):
    from sparsetune.flow import ops as F
    from sparsetune.flow.ops import FT

    g = torch.Generator().manual_seed(sx * 10 + sy)
    x = torch.randn(3, sx, 4, 8, generator=g, dtype=torch.float64)
    y = torch.randn(3, sy, 2, 8, generator=g, dtype=torch.float64)
    want = torch.einsum("rsmk,rsnk->rsmn", x.expand(3, max(sx, sy), 4, 8), y.expand(3, max(sx, sy), 2, 8))
    assert torch.allclose(F.gemm(FT(x), FT(y)).data, want)


def test_h2o_state_accumulates_across_steps():
    """H2O's running total per block equals the sum of per-step estimated masses (direct torch)."""
    lens = [20 * 16 + 5, 12 * 16 + 1]
    kv, bt, meta, _ = paged_case(16, lens, seed=7)
    flow = build_flow("h2o", {"budget": "64", "decay": "0.9"})
    attn = FlowAttention(flow, HEAD_DIM**-0.5)
    prefill_cache(attn, kv, bt, lens)
    g = torch.Generator().manual_seed(9)
    acc = [torch.zeros(-(-n // 16), HKV, dtype=torch.float64) for n in lens]
    for step in range(3):
        q = torch.randn(len(lens), HKV * GROUP, HEAD_DIM, generator=g, dtype=torch.float64)
        got = selected_sets(attn, kv, bt, meta, q)
        for b, n in enumerate(lens):
            nblocks, nfull = -(-n // 16), n // 16
            for h in range(HKV):
                cent = kv.k[0][bt[b, :nblocks].long(), h].mean(1)  # [nblocks, D]
                cent[nfull:] = 0  # the partial block's fields were never computed (zeros)
                logit = (q[b, h * GROUP : (h + 1) * GROUP] @ cent.T).amax(0)  # [nblocks]
                acc[b][:, h] = 0.9 * acc[b][:, h] + torch.softmax(logit * HEAD_DIM**-0.5, 0)
                stored = attn.fields[0]["acc"][bt[b, :nblocks].long(), h].view(-1)
                assert torch.allclose(stored, acc[b][:, h], atol=1e-9), (step, b, h)
                assert got[b][h] == reference_selection(acc[b][:, h], nblocks, 4, 1, 2)


def test_tidal_selects_by_attention_mass_and_reuses():
    lens = [18 * 16 + 9, 25 * 16]
    kv, bt, meta, q = paged_case(16, lens, seed=5)
    kv = KVCache(3, kv.num_blocks, HKV, 16, HEAD_DIM, torch.float64, "cpu")  # 3 layers, same layout
    kv.k.normal_(generator=torch.Generator().manual_seed(2))
    kv.v.normal_(generator=torch.Generator().manual_seed(3))
    flow = build_flow("tidal", {"budget": "80", "dense_layers": "", "select_layers": "0"})
    attn = FlowAttention(flow, HEAD_DIM**-0.5)
    first = selected_sets(attn, kv, bt, meta, q)  # layer 0 selects
    for b, n in enumerate(lens):
        nblocks = -(-n // 16)
        for h in range(HKV):
            keys = kv.k[0][bt[b, :nblocks].long(), h].reshape(-1, HEAD_DIM)[:n]  # [n, D] real tokens
            logits = q[b, h * GROUP : (h + 1) * GROUP] @ keys.T * HEAD_DIM**-0.5  # [G, n]
            probs = torch.softmax(logits, -1)  # exact attention
            mass = torch.zeros(GROUP, nblocks * 16, dtype=torch.float64)
            mass[:, :n] = probs
            score = mass.view(GROUP, nblocks, 16).sum(-1).amax(0)
            assert first[b][h] == reference_selection(score, nblocks, 5, 1, 2)
    q2 = torch.randn_like(q)
    blocks0, counts0 = attn.select(0, q, kv, meta)
    blocks1, counts1 = attn.select(1, q2, kv, meta)  # not a select layer: reuses layer 0's choice
    assert torch.equal(blocks0, blocks1) and torch.equal(counts0, counts1)


def test_a_started_block_loses_the_previous_owners_fields():
    """A decode write that starts a block zeroes its fields (they may hold another request's state,
    e.g. loopserve's counters); a prefill zeroes its partial last block."""
    lens = [5 * 16 + 1, 3 * 16 + 7]  # row 0's new token starts block 5
    kv, bt, meta, _ = paged_case(16, lens, seed=1)
    attn = FlowAttention(build_flow("loopserve_decode", {"budget": "64"}), HEAD_DIM**-0.5)
    for t in attn.stores(0, kv).values():
        t.fill_(7.0)
    attn.write_fields(0, kv, meta)
    started, other = bt[0, 5].item(), bt[1, 3].item()
    for t in attn.fields[0].values():
        assert (t[started] == 0).all() and (t[other] == 7.0).all()
    prefill = AttentionMetadata(True, torch.tensor([0]), torch.zeros(1, dtype=torch.long), bt[1:],
                                torch.tensor([lens[1]], dtype=torch.int32), [lens[1]], [0, lens[1]], [0])
    attn.write_fields(0, kv, prefill)
    for t in attn.fields[0].values():
        assert (t[other] == 0).all() and not (t[bt[1, 0].item()] == 7.0).all()
