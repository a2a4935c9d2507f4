"""The compiled executor's own kernels: the radix-select top-k and the generated indexer.

Without a GPU both run through the Triton interpreter (enabled before any kernel module is
imported). The top-k is checked against a brute-force ranking written here; the generated
indexer against the reference executor's scores (float64 paged data) and selections.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import textwrap

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from sparsetune.kernels import paged_decode  # noqa: E402
from sparsetune.kernels import select_topk as topk_mod  # noqa: E402

if not torch.cuda.is_available() and not topk_mod._INTERPRET:
    topk_mod = importlib.reload(topk_mod)  # imported earlier without the interpreter

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def brute_force(scores: torch.Tensor, counts: torch.Tensor, k_max: int) -> torch.Tensor:
    out = torch.zeros(scores.shape[0], k_max, dtype=torch.int32)
    for r in range(scores.shape[0]):
        k = int(counts[r])
        ranked = sorted(range(scores.shape[1]), key=lambda i: (-scores[r, i].item(), i))[:k]
        out[r, :k] = torch.tensor(sorted(ranked), dtype=torch.int32)
    return out


@pytest.mark.parametrize("pass_bits", [1, 2])
@pytest.mark.parametrize("width", [1, 37, 64, 300])
def test_select_topk_matches_brute_force(pass_bits, width, monkeypatch):
    monkeypatch.setattr(topk_mod, "PASS_BITS", pass_bits)
    g = torch.Generator().manual_seed(width)
    rows = 6
    s = torch.randn(rows, width, generator=g)
    s[0, : min(3, width)] = float("inf")  # always-kept blocks
    s[1, width // 2 :] = float("-inf")  # past the sequence
    s[2] = torch.randint(0, 4, (width,), generator=g).float()  # many ties: lower index wins
    s[3] = -s[3].abs()  # negative floats keep their order
    s[4] = -s[4].abs()
    s[4, ::3], s[4, 1::3] = -0.0, 0.0  # -0.0 ties with +0.0: the lower index wins
    k_max = min(width, 17)
    counts = torch.tensor([min(width, 5), min(width // 2 + (width == 1), 9), k_max, 0, k_max, 1], dtype=torch.int32)
    want = brute_force(s, counts, k_max)
    got = topk_mod.select_topk(s.to(DEVICE), counts.to(DEVICE), k_max).cpu()
    assert torch.equal(got, want)
    assert torch.equal(topk_mod.select_topk_ref(s, counts, k_max), want)


@pytest.mark.parametrize("pass_bits", [1, 2])
def test_select_topk_runs_rows_of_a_32k_context_at_block_2_in_the_kernel(pass_bits, monkeypatch):
    """16,394 blocks (32K tokens at block 2, plus the engine's ten spare table columns) stay in
    the kernel; the torch twin, which sorts, is only the reference here."""
    g = torch.Generator().manual_seed(2)
    s = torch.randn(3, 16394, generator=g)
    s[:, 16384:] = float("-inf")
    s[:, :2] = float("inf")
    s[2, 100:4000] = 0.5  # a long run of ties
    counts = torch.tensor([1024, 7, 3000], dtype=torch.int32)
    want = topk_mod.select_topk_ref(s, counts, 3000)
    monkeypatch.setattr(topk_mod, "PASS_BITS", pass_bits)
    monkeypatch.setattr(topk_mod, "select_topk_ref", lambda *a: pytest.fail("went to the torch twin"))
    assert torch.equal(topk_mod.select_topk(s.to(DEVICE), counts.to(DEVICE), 3000).cpu(), want)


# ---- the generated indexer and cache stage ------------------------------------------------------

from sparsetune.flow.compile import PagedBlocks, PagedLayout, build_cache, build_indexer, why_not  # noqa: E402
from sparsetune.flow.compile import indexer as indexer_mod  # noqa: E402
from sparsetune.flow.compile.emit import p2  # noqa: E402
from sparsetune.models.artifacts import synthetic_calibration  # noqa: E402
from sparsetune.loader import build_flow  # noqa: E402
from sparsetune.flow.attention import FlowAttention  # noqa: E402
from sparsetune.flow.stages import candidate_units  # noqa: E402
from helpers import GROUP, HEAD_DIM, HKV, paged_case, prefill_cache  # noqa: E402

# Every block-local op, non-power-of-two group (3) and slices, all three gemm forms.
WIDE_FLOW = textwrap.dedent('''
    from sparsetune.flow import DecodeFlow
    from sparsetune.flow import ops as F


    class Wide(DecodeFlow):
        name = "wide"

        def cache(self, k, v):
            return {"kmax": F.max(k, dim=1), "kmin": F.min(k, dim=1), "ksum": F.sum(k, dim=1),
                    "vn": F.l2norm(F.transpose(v), dim=2), "keys": F.scale(k, alpha=0.5, beta=0.1)}

        def index(self, q, fields):
            qm = F.mul(q, F.mask_slice(q, 0, 20, dim=2, inside=1.0, outside=0.5))
            up = F.maximum(F.mul(qm, fields["kmax"]), F.mul(qm, fields["kmin"]))  # [S, G, D]
            s1 = F.mean(F.sum(up, dim=2), dim=1)
            s2 = F.max(F.max(F.gemm(fields["keys"], q), dim=1), dim=2)  # [S, bs, G] first
            c = F.gemm(fields["ksum"], q)  # [S, 1, G]
            s3 = F.min(F.sigmoid(F.div(c, 8.0)), dim=2)
            vn = F.gemm(F.transpose(fields["vn"]), F.abs(q))  # [S, 1, G]
            s4 = F.l2norm(F.log(F.add(F.relu(vn), 1.0)), dim=2)
            s5 = F.sum(F.silu(F.sub(F.exp(F.scale(c, alpha=0.01)), F.fill(c, 1.0))), dim=2)
            ex = F.exp(F.scale(F.gemm(fields["keys"], q), alpha=0.01))  # [S, bs, G], padding exp(0) = 1
            s6 = F.max(F.gemm(ex, F.exp(F.scale(c, alpha=0.01))), dim=1)  # contracts over G = 3
            mix = F.add(F.add(F.add(s1, s2), s6), F.add(F.minimum(s3, s4), s5))
            return F.topk(F.where(F.gt(s2, 0.0), mix, F.scale(mix, alpha=2.0)))
''')


def _case(block_size: int, lens: list[int], seed: int):
    """tests/flow/test_flows.py's random paged case, on the device the kernels run on."""
    kv, bt, meta, q = paged_case(block_size, lens, seed)
    if DEVICE != "cpu":
        kv.k, kv.v = kv.k.to(DEVICE), kv.v.to(DEVICE)
        bt, q = bt.to(DEVICE), q.to(DEVICE)
        meta = dataclasses.replace(meta, positions=meta.positions.to(DEVICE), slot_mapping=meta.slot_mapping.to(DEVICE),
                                   block_tables=bt, seq_lens=meta.seq_lens.to(DEVICE))
    return kv, bt, meta, q


def _flow(name: str, block_size: int, tmp_path, **extra):
    params = {"budget": str(6 * block_size), "block_size": str(block_size), **extra}
    if name == "streaming":  # no budget: sinks + a window
        params = {"block_size": str(block_size), "local_blocks": "6", **extra}
    if name == "wide":
        path = tmp_path / "wide.py"
        path.write_text(WIDE_FLOW)
        name = str(path)
    return build_flow(name, params)


def _attn(flow, executor="reference", use_triton=None):
    calib = synthetic_calibration(1, HKV, HEAD_DIM) if flow.calibrated else None
    return FlowAttention(flow, HEAD_DIM**-0.5, use_triton=use_triton, executor=executor, calibration=calib)


CASES = [("block_topk", 4, {}), ("quest", 16, {}), ("quest", 1, {"budget_ratio": "0.3"}),
         ("double_sparse", 4, {"channels": "8"}), ("double_sparse_centroid", 4, {"channels": "8"}), ("wide", 4, {}),
         ("quest", 2, {}), ("block_topk", 8, {}), ("quest", 64, {}),  # every selection block a search draws
         # selection units inside the blocks (#43): the layout splits each block into its units
         ("quest", 16, {"select_block": "2"}), ("block_topk", 16, {"select_block": "4"}),
         ("wide", 16, {"select_block": "4"}), ("double_sparse", 8, {"channels": "8", "select_block": "1"}),
         ("sphere", 4, {}), ("sphere", 16, {"select_block": "2", "radius_weight": "1.0"})]


@pytest.mark.parametrize("name,block_size,extra", CASES)
def test_generated_stages_equal_reference(name, block_size, extra, tmp_path):
    """Generated cache stage == reference fields; generated indexer == reference masked scores
    and block counts (float64 paged data; the kernels compute in fp32)."""
    lens = [23 * block_size + 5, 9 * block_size, 40 * block_size - 1]
    kv, bt, meta, q = _case(block_size, lens, seed=block_size)
    flow = _flow(name, block_size, tmp_path, **extra)
    assert why_not(flow, GROUP, HEAD_DIM) == {"cache": None, "index": None}
    ref = _attn(flow)
    prefill_cache(ref, kv, bt, lens)
    gen = _attn(flow, "compiled", use_triton=True)
    prefill_cache(gen, kv, bt, lens)
    for field, want in ref.fields[0].items():
        torch.testing.assert_close(gen.fields[0][field], want, rtol=1e-5, atol=1e-5)
    rule = flow.budget_rule.tensor(q.device)
    args = (q, ref.unit_table(bt), meta.seq_lens, ref.fields[0], None, HKV, flow.unit, ref.null_unit(kv),
            ref.constants(0, kv), rule)
    want_score, want_counts, _, _ = ref.stages.score_tensors(*args)
    indexer = gen.stages.indexer_kernel(GROUP, HEAD_DIM)
    score, counts = indexer(q, PagedBlocks(bt, kv.null_block), meta.seq_lens, ref.fields[0], None, ref.constants(0, kv),
                            HKV, rule)
    assert torch.equal(counts, want_counts)
    assert torch.equal(torch.isinf(score), torch.isinf(want_score))
    torch.testing.assert_close(score.double(), want_score.double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,block_size,extra", [("block_topk", 4, {}), ("quest", 16, {"select_block": "2"}),
                                                    ("double_sparse_centroid", 4, {"channels": "8"}), ("sphere", 4, {})])
def test_fp8_fields_are_the_fields_rounded_and_score_alike(name, block_size, extra, tmp_path):
    """8-bit fields (`field_dtype=fp8`): the reference executor stores its own fields rounded by torch's
    e4m3 cast after clamping at +-448 (`flow.base.to_store`); the generated cache stage stores the
    same values (its own rounding in fp32 arithmetic, `cache_stage.fp8_round`: ties to even,
    subnormals, saturation); the generated indexer reading them scores as the reference does.
    Keys scaled over six decades, so fields reach past 448 and below e4m3's normal range."""
    from sparsetune.flow.base import FP8, to_store

    lens = [23 * block_size + 5, 9 * block_size, 40 * block_size - 1]
    kv, bt, meta, q = _case(block_size, lens, seed=block_size + 3)
    g = torch.Generator().manual_seed(1)
    kv.k = kv.k * (10.0 ** (torch.rand(kv.k.shape, generator=g, dtype=kv.k.dtype) * 6 - 3)).to(kv.k.device)
    blk = int(bt[0, 1])  # one block of nearly equal keys: a spread (the sphere's radius) below e4m3's normal range
    kv.k[0, blk] = kv.k[0, blk, :, :1] + 1e-4 * torch.randn(kv.k[0, blk].shape, generator=g, dtype=kv.k.dtype).to(kv.k.device)
    auto, fp8 = (_flow(name, block_size, tmp_path, **extra, **more) for more in ({}, {"field_dtype": "fp8"}))
    ref_auto, ref, gen = _attn(auto), _attn(fp8), _attn(fp8, "compiled", use_triton=True)
    for attn in (ref_auto, ref, gen):
        prefill_cache(attn, kv, bt, lens)
    for field, want in ref_auto.fields[0].items():
        got_ref, got_gen = ref.fields[0][field], gen.fields[0][field]
        assert got_ref.dtype == got_gen.dtype == FP8
        assert (want.abs() > 448).any() and ((want.abs() < 2**-6) & (want != 0)).any()  # both ends exercised
        assert torch.equal(got_ref.float(), to_store(want, FP8).float())
        assert torch.equal(got_gen.float(), got_ref.float())
        assert not torch.isnan(got_gen.float()).any()
    rule = fp8.budget_rule.tensor(q.device)
    args = (q, ref.unit_table(bt), meta.seq_lens, ref.fields[0], None, HKV, fp8.unit, ref.null_unit(kv),
            ref.constants(0, kv), rule)
    want_score, want_counts, _, _ = ref.stages.score_tensors(*args)
    score, counts = gen.stages.indexer_kernel(GROUP, HEAD_DIM)(q, PagedBlocks(bt, kv.null_block), meta.seq_lens,
                                                               ref.fields[0], None, ref.constants(0, kv), HKV, rule)
    assert torch.equal(counts, want_counts)
    assert torch.equal(torch.isinf(score), torch.isinf(want_score))
    torch.testing.assert_close(score.double(), want_score.double(), rtol=1e-4, atol=1e-4)
    _assert_selects_alike(ref, gen, q, kv, meta)


@pytest.mark.parametrize("field_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,block_size", [("block_topk", 2), ("block_topk", 16), ("quest", 4)])
def test_generated_indexer_tensor_core_products(name, dtype, block_size, field_dtype, tmp_path, monkeypatch):
    """Over 16-bit stores (or 8-bit ones, whose values both 16-bit dtypes hold), a field-times-query
    product (block_topk's centroid; quest's max and min against relu(q) and min(q, 0)) runs as one
    `tl.dot` a program (`Emitter.dot_matvec`; exact fp32 under the interpreter, tensor cores on a
    GPU): the same scores as the reference's fp32 math and as the kernel's own broadcast form, the
    same counts (group 3: a padded query row; a table wider than the sequences, its garbage entries
    never read)."""
    lens = [23 * block_size + 5, 9 * block_size, 40 * block_size - 1]
    kv, bt, meta, q = _case(block_size, lens, seed=block_size + 7)
    kv.k, kv.v, q = kv.k.to(dtype), kv.v.to(dtype), q.to(dtype)
    flow = _flow(name, block_size, tmp_path, field_dtype=field_dtype)
    ref = _attn(flow)
    prefill_cache(ref, kv, bt, lens)
    rule = flow.budget_rule.tensor(q.device)
    args = (q, bt, meta.seq_lens, ref.fields[0], None, HKV, block_size, kv.null_block, ref.constants(0, kv), rule)
    want_score, want_counts, _, _ = ref.stages.score_tensors(*args)
    indexer = _attn(flow, "compiled", use_triton=True).stages.indexer_kernel(GROUP, HEAD_DIM)
    stored = dtype if field_dtype == "auto" else torch.float8_e4m3fn
    assert all(f.dtype == stored for f in ref.fields[0].values()) and indexer.block_s_dot >= 16
    assert indexer.dot_dtype(q, list(ref.fields[0].values())) is not None
    call = (q, PagedBlocks(bt, kv.null_block), meta.seq_lens, ref.fields[0], None, ref.constants(0, kv), HKV, rule)
    score, counts = indexer(*call)
    monkeypatch.setattr(indexer_mod, "DOT_PRODUCTS", False)
    plain, _ = indexer(*call)
    assert torch.equal(counts, want_counts)
    assert torch.equal(torch.isinf(score), torch.isinf(want_score))
    torch.testing.assert_close(score.double(), want_score.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(score, plain, rtol=1e-5, atol=1e-5)


def _assert_selects_alike(ref, gen, q, kv, meta, step=0):
    """The same number of units and the same set of them in every (request, KV head) row."""
    want, want_n = ref.select(0, q, kv, meta)
    got, got_n = gen.select(0, q, kv, meta)
    assert torch.equal(got_n, want_n)
    for b in range(want.shape[0]):
        for h in range(want.shape[1]):
            n = int(want_n[b, h])
            assert set(got[b, h, :n].tolist()) == set(want[b, h, :n].tolist()), (step, b, h)


@pytest.mark.parametrize("name", ["block_topk", "quest", "h2o", "tidal", "streaming", "double_sparse", "sphere"])
def test_generated_executor_selects_like_reference(name, tmp_path):
    """The compiled executor on the Triton path (generated kernels where block-local, else the
    compiled torch indexer; radix-select top-k) picks the reference executor's blocks."""
    block_size = 4
    lens = [23 * block_size + 5, 9 * block_size, 40 * block_size - 1]
    kv, bt, meta, q = _case(block_size, lens, seed=3)
    extra = {"select_layers": ""} if name == "tidal" else {}
    flow = _flow(name, block_size, tmp_path, dense_layers="", **extra)
    ref, gen = _attn(flow), _attn(flow, "compiled", use_triton=True)
    for attn in (ref, gen):
        prefill_cache(attn, kv, bt, lens)
    for step in range(2):  # h2o: the saved state must evolve the same way
        _assert_selects_alike(ref, gen, q, kv, meta, step)
    assert ("generated" in gen.paths["index"]) == (name in ("block_topk", "quest", "double_sparse", "sphere"))


# A two-level flow's second level: (flow, page, unit) scored over candidate lists.
CANDIDATE_CASES = [("quest", 16, "2"), ("block_topk", 16, "4"), ("wide", 16, "4"), ("keys", 16, "2"),
                   ("double_sparse", 8, "1")]


def _two_level_flow(name: str, page: int, unit: str, tmp_path, **extra):
    if name == "keys":
        (tmp_path / "keys.py").write_text(KEYS_FLOW)
        name = str(tmp_path / "keys.py")
    extra = {"channels": "8", **extra} if name in ("double_sparse", "double_sparse_2l") else extra
    return _flow(name, page, tmp_path, select_block=unit, **extra)


@pytest.mark.parametrize("name,page,unit", CANDIDATE_CASES)
def test_generated_candidate_indexer_equals_reference(name, page, unit, tmp_path):
    """The generated indexer over the units of chosen blocks (`candidates=True`) gives the
    reference's `score_candidates` scores and counts over `candidate_units`: blocks in any order,
    the last one always chosen, the first sometimes, entries past each row's kept count garbage."""
    lens = [23 * page + 5, 9 * page, 40 * page - 1]
    kv, bt, meta, q = _case(page, lens, seed=11)
    flow = _two_level_flow(name, page, unit, tmp_path)
    ref = _attn(flow)
    prefill_cache(ref, kv, bt, lens)
    u = page // flow.unit
    g = torch.Generator().manual_seed(5)
    kp = 7
    npages = [-(-n // page) for n in lens]
    rows = []
    for r in range(len(lens) * HKV):
        n = npages[r // HKV]
        perm = torch.randperm(n - 1, generator=g)[: kp - 1]
        rows.append(torch.cat([torch.tensor([n - 1]), perm, torch.full((kp - 1 - len(perm),), 10**6)]))
    pages = torch.stack(rows).to(torch.int32)
    kept = torch.randint(1, kp + 1, (len(rows),), generator=g).to(torch.int32)
    kept[0] = kp
    pages, kept = pages.to(DEVICE), kept.to(DEVICE)
    rule = flow.budget_rule.tensor(q.device)
    keys = kv.k[0] if flow.uses_keys else None
    want, want_n = ref.stages.score_candidates(q, ref.unit_table(bt), meta.seq_lens, ref.fields[0], keys, HKV, flow.unit,
                                               ref.null_unit(kv), ref.constants(0, kv), rule,
                                               candidate_units(pages, kept, u))
    kernel = _attn(flow, "compiled", use_triton=True).stages.indexer_kernel(GROUP, HEAD_DIM, candidates=True)
    got, got_n = kernel(q, PagedBlocks(bt, kv.null_block), meta.seq_lens, ref.fields[0], keys, ref.constants(0, kv), HKV,
                        rule, pages=(pages, kept))
    assert (want_n < torch.tensor([flow.budget_blocks(-(-lens[r // HKV] // flow.unit)) for r in range(len(rows))],
                                  dtype=torch.int32, device=DEVICE)).any()  # a cap at the list
    assert torch.equal(got_n, want_n)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.isinf(got).any() and torch.isfinite(got).any()
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,page,unit", CANDIDATE_CASES[:3] + [("quest_2l", 16, "2"), ("double_sparse_2l", 16, "2"),
                                                                     ("sphere_2l", 16, "4")])
def test_generated_executor_selects_two_levels_like_reference(name, page, unit, tmp_path):
    """A two-level flow on the compiled executor's Triton path (generated first-level indexer,
    radix select, generated candidate indexer, radix select) picks the reference's units."""
    lens = [23 * page + 5, 9 * page, 40 * page - 1]
    kv, bt, meta, q = _case(page, lens, seed=12)
    flow = _two_level_flow(name, page, unit, tmp_path, coarse="2", dense_layers="")
    ref, gen = _attn(flow), _attn(flow, "compiled", use_triton=True)
    for attn in (ref, gen):
        prefill_cache(attn, kv, bt, lens)
        prefill_cache(attn.pages, kv, bt, lens)
    _assert_selects_alike(ref, gen, q, kv, meta)
    assert "kept blocks' units" in gen.paths["index_units"] and "index_units" not in ref.paths


@pytest.mark.parametrize("name,block_size,unit", [("quest", 4, None), ("double_sparse", 4, None), ("quest", 16, "2")])
def test_generated_cache_stage_at_decode(name, block_size, unit, tmp_path):
    """At decode the generated cache stage finds each request's block (or unit inside it) from its
    position and writes the fields only for one the new token completes (else the null row)."""
    u = int(unit or block_size)
    lens = [23 * block_size + u + 1, 9 * block_size, 40 * block_size]  # the 2nd and 3rd complete a unit
    kv, bt, meta, q = _case(block_size, lens, seed=5)
    flow = _flow(name, block_size, tmp_path, **({"select_block": unit} if unit else {}))
    ref, gen = _attn(flow), _attn(flow, "compiled", use_triton=True)
    for attn in (ref, gen):
        stores = attn.stores(0, kv)
        pos = meta.seq_lens.long() - 1
        phys = attn.unit_table(bt).gather(1, (pos // u).view(-1, 1)).view(-1).long()
        if attn is ref:
            done = (pos % u) == u - 1
            ref.run_cache(0, kv, phys, torch.where(done, phys, ref.null_unit(kv)))
        else:
            gen.stages.cache_kernel(HEAD_DIM).decode(kv.k[0], kv.v[0], pos, PagedBlocks(bt, kv.null_block), meta.seq_lens, stores,
                                         gen.constants(0, kv))
    scratch = ref.null_unit(kv)  # the null block's rows are scratch
    for field, want in ref.fields[0].items():
        got = gen.fields[0][field]
        torch.testing.assert_close(got[:scratch], want[:scratch], rtol=1e-5, atol=1e-5)
        written = want[:scratch].flatten(1).abs().sum(1) > 0
        assert int(written.sum()) == 2  # exactly the two completed units


@pytest.mark.parametrize("extra", [{}, {"budget": "20", "sink_blocks": "0", "local_blocks": "1"}, {"budget_ratio": "0.1"},
                                   {"budget_ratio": "0.7", "sink_blocks": "3"}, {"budget_ratio": "0.3333333333333333"}])
def test_generated_counts_follow_budget_rule(extra):
    """The generated indexer's block counts, and the reference's, are `flow.budget_blocks(nb)` for
    every nb up to 64 (the ratio in float64: with float32's 0.1, ceil(0.1 * 10) would be 2)."""
    bs, hkv, width = 2, 1, 64
    flow = build_flow("quest", {"block_size": str(bs), **extra})
    lens = torch.arange(1, width + 1) * bs - 1  # nb = 1 .. 64
    table = torch.zeros(width, width, dtype=torch.int32)  # every block reads block 0: counts only
    stores = {n: torch.randn(2, hkv, 1, HEAD_DIM, dtype=torch.float64) for n in ("kmax", "kmin")}
    q = torch.randn(width, hkv * GROUP, HEAD_DIM, dtype=torch.float64)
    want = torch.tensor([flow.budget_blocks(int(n)) for n in range(1, width + 1)], dtype=torch.int32)
    ref = _attn(flow).stages.score_tensors(q, table, lens.int(), stores, None, hkv, bs, 1, {}, flow.budget_rule.tensor())[1]
    got = build_indexer(flow, GROUP, HEAD_DIM)(
        q.to(DEVICE), PagedBlocks(table.to(DEVICE), 1), lens.int().to(DEVICE), {n: t.to(DEVICE) for n, t in stores.items()},
        None, {}, hkv, flow.budget_rule.tensor(DEVICE))[1].cpu()
    assert torch.equal(ref, want) and torch.equal(got, want)


def test_one_indexer_serves_every_budget(tmp_path):
    """Flows that differ only in budget, sink and local blocks share one generated indexer (one
    object, one kernel: those are kernel arguments), and with each flow's rule it selects the
    blocks the reference executor selects."""
    block_size = 4
    lens = [23 * block_size + 5, 9 * block_size, 40 * block_size - 1]
    kv, bt, meta, q = _case(block_size, lens, seed=7)
    settings = [{"budget": "24"}, {"budget": "40", "sink_blocks": "3", "local_blocks": "1"},
                {"budget_ratio": "0.3", "sink_blocks": "0", "local_blocks": "4"}]
    flows = [_flow("quest", block_size, tmp_path, dense_layers="", **extra) for extra in settings]
    shared = build_indexer(flows[0], GROUP, HEAD_DIM)
    counts = []
    for flow in flows:
        ref, gen = _attn(flow), _attn(flow, "compiled", use_triton=True)
        for attn in (ref, gen):
            prefill_cache(attn, kv, bt, lens)
        want, want_n = ref.select(0, q, kv, meta)
        got, got_n = gen.select(0, q, kv, meta)
        assert gen.stages.indexer_kernel(GROUP, HEAD_DIM) is shared and "generated" in gen.paths["index"]
        assert torch.equal(got_n, want_n)
        for b in range(len(lens)):
            for h in range(HKV):
                n = int(want_n[b, h])
                assert set(got[b, h, :n].tolist()) == set(want[b, h, :n].tolist()), (flow.params(), b, h)
        counts.append(want_n.tolist())
    assert len({str(c) for c in counts}) == len(settings)  # the settings really select differently
    assert shared.kernel is build_indexer(flows[-1], GROUP, HEAD_DIM).kernel


# A flow whose indexer reads the raw keys (`uses_keys`): the layout's token loads.
KEYS_FLOW = textwrap.dedent('''
    from sparsetune.flow import DecodeFlow
    from sparsetune.flow import ops as F


    class Keys(DecodeFlow):
        name = "keys"
        uses_keys = True

        def cache(self, k, v):
            return {"kmax": F.max(k, dim=1)}

        def index(self, q, fields):
            best = F.max(F.max(F.gemm(fields["k"], q), dim=1), dim=2)  # [S, 1, 1]
            return F.topk(F.add(best, F.max(F.sum(F.mul(q, fields["kmax"]), dim=2), dim=1)))
''')


@dataclasses.dataclass(frozen=True)
class TokenLayout(PagedLayout):
    """The indexer half of a token-paged target, written against `KVLayout` alone: a token's slot
    is `req_to_token[b, pos]` in K `[slots, Hkv, D]`; pages of `page` slots are the field rows."""

    page: int = 4

    def grid(self, blocks):
        return blocks[0].shape[0], blocks[0].shape[1] // self.page

    def index_params(self):
        return ["rt", "stride_rt", "NULL"]

    def index_rows(self, block_size):
        return [f"blk = tl.load(rt + b * stride_rt + j * {block_size}, mask=live, other=NULL * {block_size}).to(tl.int64)"
                f" // {block_size}"]

    def index_args(self, blocks):
        return [blocks[0], blocks[0].stride(0), blocks[1]]

    def pool_params(self, var):
        return [f"{var}_ptr", f"{var}_s0", f"{var}_s1"]

    def pool_args(self, pool):
        return [pool, pool.stride(0), pool.stride(1)]

    def token_tile(self, var, pool, block_size, head_dim, over_s, extra=""):
        assert over_s  # the indexer's blocks j
        t, d = f"tl.arange(0, {p2(block_size)})", f"tl.arange(0, {p2(head_dim)})"
        mask = f"({t} < {block_size})[None, :, None] & ({d} < {head_dim})[None, None, :]{extra}"
        return [f"slot = tl.load(rt + b * stride_rt + j[:, None, None] * {block_size} + {t}[None, :, None], mask={mask},"
                " other=0).to(tl.int64)",
                f"{var} = tl.load({pool}_ptr + slot * {pool}_s0 + h * {pool}_s1 + {d}[None, None, :], mask={mask},"
                " other=0.0).to(tl.float32)"]


def test_kv_layouts_score_alike(tmp_path):
    """The paged target's indexer for a key-reading flow equals the reference executor; a
    token-paged target (`TokenLayout`) over the same KV, laid out as slots, scores the same."""
    block_size = 4
    lens = [23 * block_size + 5, 9 * block_size, 40 * block_size - 1]
    kv, bt, meta, q = _case(block_size, lens, seed=9)
    path = tmp_path / "keys.py"
    path.write_text(KEYS_FLOW)
    flow = build_flow(str(path), {"block_size": str(block_size), "budget": str(6 * block_size)})
    ref = _attn(flow)
    prefill_cache(ref, kv, bt, lens)
    stores, k_pool = ref.fields[0], kv.k[0]
    rule = flow.budget_rule.tensor(q.device)
    want_score, want_counts, _, _ = ref.stages.score_tensors(q, bt, meta.seq_lens, stores, k_pool, HKV, block_size,
                                                             kv.null_block, {}, rule)
    paged = build_indexer(flow, GROUP, HEAD_DIM)
    score, counts = paged(q, PagedBlocks(bt, kv.null_block), meta.seq_lens, stores, k_pool, {}, HKV, rule)
    assert torch.equal(counts, want_counts) and torch.equal(torch.isinf(score), torch.isinf(want_score))
    torch.testing.assert_close(score.double(), want_score.double(), rtol=1e-4, atol=1e-4)

    token = build_indexer(flow, GROUP, HEAD_DIM, TokenLayout(block_size))
    assert token is not paged and "stride_rt" in token.source and "stride_bt" not in token.source
    slots = k_pool.permute(0, 2, 1, 3).reshape(-1, HKV, HEAD_DIM)  # slot = block * block_size + token
    pos = torch.arange(bt.shape[1] * block_size, device=bt.device)
    req_to_token = (bt[:, pos // block_size] * block_size + pos % block_size).to(torch.int32)
    got, got_counts = token(q, (req_to_token, kv.null_block), meta.seq_lens, stores, slots, {}, HKV, rule)
    assert torch.equal(got_counts, counts)
    torch.testing.assert_close(got, score)


@pytest.mark.parametrize("name", ["quest", "block_topk", "keys"])
def test_sglang_pool_runs_through_the_paged_layout(name, tmp_path):
    """SGLang's pool (flat `[slots, Hkv, D]` K/V, `req_to_token` rows in another order than the
    batch's, row 0 padding) with page size = block size needs no layout of its own: its buffer
    viewed `[pages, Hkv, P, D]` (strided, not copied) and a page table `req_to_token[rpi, ::P] // P`
    are a paged pool. The generated cache stage (extend and decode), the indexer and the sparse
    attention give on it exactly what they give on this engine's pool holding the same KV."""
    block_size = 4
    lens = [23 * block_size + 5, 9 * block_size, 40 * block_size]  # at decode the 2nd and 3rd complete a block
    kv, bt, meta, q = _case(block_size, lens, seed=11)
    if name == "keys":
        (tmp_path / "keys.py").write_text(KEYS_FLOW)
        flow = build_flow(str(tmp_path / "keys.py"), {"block_size": str(block_size), "budget": str(6 * block_size)})
    else:
        flow = _flow(name, block_size, tmp_path)
    # SGLang's layout of the same KV: slot = page * P + offset, requests in rows B..1 of req_to_token
    k_flat, v_flat = (t[0].permute(0, 2, 1, 3).reshape(-1, HKV, HEAD_DIM).clone() for t in (kv.k, kv.v))
    rpi = torch.arange(bt.shape[0], 0, -1, device=bt.device)
    pos = torch.arange(bt.shape[1] * block_size, device=bt.device)
    r2t = torch.zeros(bt.shape[0] + 1, pos.numel(), dtype=torch.int32, device=bt.device)
    r2t[rpi] = (bt[:, pos // block_size] * block_size + pos % block_size).to(torch.int32)
    # what a backend builds per step: the strided views and the page table
    k_view, v_view = (t.view(-1, block_size, HKV, HEAD_DIM).permute(0, 2, 1, 3) for t in (k_flat, v_flat))
    assert k_view.data_ptr() == k_flat.data_ptr() and not k_view.is_contiguous()
    pages = (r2t[rpi][:, ::block_size] // block_size).to(torch.int32)
    gen = _attn(flow, "compiled", use_triton=True)
    consts = gen.constants(0, kv)
    cache = build_cache(flow, HEAD_DIM)
    full = torch.cat([bt[i, : n // block_size] for i, n in enumerate(lens)]).long()
    stores = {}
    for mode in ("extend", "decode"):
        want = {n: torch.zeros_like(t) for n, t in gen.stores(0, kv).items()}
        got = {n: torch.zeros_like(t) for n, t in want.items()}
        if mode == "extend":
            cache(kv.k[0], kv.v[0], full, full, want, consts)
            cache(k_view, v_view, full, full, got, consts)
            stores = got
        else:
            last = meta.seq_lens.long() - 1
            cache.decode(kv.k[0], kv.v[0], last, PagedBlocks(bt, kv.null_block), meta.seq_lens, want, consts)
            cache.decode(k_view, v_view, last, PagedBlocks(pages, kv.null_block), meta.seq_lens, got, consts)
        for field, w in want.items():
            assert int((w[:-1].flatten(1).abs().sum(1) > 0).sum()) == (len(full) if mode == "extend" else 2)
            torch.testing.assert_close(got[field][:-1], w[:-1], rtol=0, atol=0)  # the null row is scratch
    rule = flow.budget_rule.tensor(q.device)
    indexer = build_indexer(flow, GROUP, HEAD_DIM)
    want_score, want_counts = indexer(q, PagedBlocks(bt, kv.null_block), meta.seq_lens, stores, kv.k[0], consts, HKV, rule)
    score, counts = indexer(q, PagedBlocks(pages, kv.null_block), meta.seq_lens, stores, k_view, consts, HKV, rule)
    assert torch.equal(counts, want_counts) and torch.isfinite(score).sum() > score.numel() // 4
    finite = torch.isfinite(want_score)
    assert torch.equal(finite, torch.isfinite(score))
    torch.testing.assert_close(score[finite], want_score[finite], rtol=0, atol=0)
    # the sparse attention over the selected blocks reads the view through the page table alike
    # (in float32 on a GPU: the kernel compiles for 16- and 32-bit caches; the interpreter takes float64)
    b = q.shape[0]
    dt = torch.float32 if q.is_cuda else q.dtype
    k_view, v_view = (t.to(dt).view(-1, block_size, HKV, HEAD_DIM).permute(0, 2, 1, 3) for t in (k_flat, v_flat))
    sel = score.topk(int(counts.max()), dim=1).indices.view(b, HKV, -1).to(torch.int32)
    args = (meta.seq_lens, sel, counts.view(b, HKV), HEAD_DIM**-0.5)
    want_out = paged_decode.sparse_paged_decode_attention(q.to(dt), kv.k[0].to(dt), kv.v[0].to(dt), bt, *args)
    got_out = paged_decode.sparse_paged_decode_attention(q.to(dt), k_view, v_view, pages, *args)
    assert want_out.abs().sum() > 0
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=0)


@pytest.mark.parametrize("per_sm", [1, 2])
@pytest.mark.parametrize("candidates", [False, True])
def test_a_tiled_indexer_scores_alike_at_any_tile_count(per_sm, candidates, tmp_path, monkeypatch):
    """A flow with math over the query and constants alone (DoubleSparse's query on its channels)
    gets a tiled indexer: a program computes that math once and scores TILES x BLOCK_S entries in a
    loop. On a device of one SM a program takes every tile of its row (per_sm 1) or half of them,
    the last tile ragged (per_sm 2): the reference's scores and counts either way."""
    page, unit = (16, 1) if candidates else (8, 1)  # 7 chosen pages of 16 units: two tiles a row
    lens = [23 * page + 5, 9 * page, 40 * page - 1]
    kv, bt, meta, q = _case(page, lens, seed=13)
    flow = _two_level_flow("double_sparse", page, str(unit), tmp_path) if candidates else \
        _flow("double_sparse", page, tmp_path, channels="8", select_block=str(unit))
    ref = _attn(flow)
    prefill_cache(ref, kv, bt, lens)
    rule = flow.budget_rule.tensor(q.device)
    kernel = _attn(flow, "compiled", use_triton=True).stages.indexer_kernel(GROUP, HEAD_DIM, candidates=candidates)
    assert kernel.tiled and "for t in range(TILES):" in kernel.source
    monkeypatch.setattr(indexer_mod, "num_sms", lambda device: 1)
    monkeypatch.setattr(indexer_mod, "PROGRAMS_PER_SM", per_sm)
    call = (q, PagedBlocks(bt, kv.null_block), meta.seq_lens, ref.fields[0], None, ref.constants(0, kv), HKV, rule)
    args = (q, ref.unit_table(bt), meta.seq_lens, ref.fields[0], None, HKV, flow.unit, ref.null_unit(kv),
            ref.constants(0, kv), rule)
    if candidates:
        npages = [-(-n // page) for n in lens]
        pages = torch.stack([torch.arange(n - 1, n - 8, -1) for n in npages for _ in range(HKV)]).to(torch.int32).to(DEVICE)
        kept = torch.full((pages.shape[0],), 7, dtype=torch.int32, device=DEVICE)
        want, want_n = ref.stages.score_candidates(*args[:-1], rule, candidate_units(pages, kept, page // unit))
        got, got_n = kernel(*call, pages=(pages, kept))
        cols = pages.shape[1] * page // unit
    else:
        want, want_n, _, _ = ref.stages.score_tensors(*args)
        got, got_n = kernel(*call)
        cols = bt.shape[1] * page // unit
    rows, per_row = len(lens) * HKV, -(-cols // kernel.block_s)
    assert kernel.tiles(rows, per_row, q.device) == min(indexer_mod.MAX_TILES, per_row, rows * per_row // per_sm) > 1
    assert torch.equal(got_n, want_n)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,tiled", [("quest", False), ("double_sparse", True), ("block_topk", False)])
def test_only_costly_row_math_tiles_the_indexer(name, tiled, tmp_path):
    """A program computes the row's own math once either way; a tiled kernel (fewer programs, each
    looping over tiles) pays only where that math is costly: DoubleSparse's query on its channels (a
    product, constants to load). Quest's positive and negative query parts are a few register ops,
    and a program a tile keeps more loads in flight (its scoring ran at 45% of its byte floor tiled,
    87-91% at one tile a program, H100: BENCHMARKS.md)."""
    flow = _flow(name, 16, tmp_path, **({"channels": "8"} if name == "double_sparse" else {}))
    kernel = build_indexer(flow, GROUP, HEAD_DIM)
    assert kernel.tiled == tiled
    assert ("for t in range(TILES):" in kernel.source) == tiled
    if name == "quest":  # it has row math of its own, computed once a program; quest_2l's pages too
        assert "tl.maximum(q_in, 0.0)" in kernel.source.split("j = ")[0]
        pages = build_indexer(build_flow("quest_2l", {}).page_flow(), GROUP, HEAD_DIM)
        assert "tl.maximum(q_in, 0.0)" in pages.source and not pages.tiled
