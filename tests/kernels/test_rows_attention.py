"""Attention of rows at arbitrary positions (interpreted Triton kernel on CPU, the real one on a GPU).

The truth is a per-row loop in float64: row r's query heads, softmax over the keys 0..pos[r] of
its KV head. The kernel (fp32: IEEE products, fp32 accumulation) must match it to fp32 noise,
fp16 inputs to fp16 rounding; contiguous and paged KV (shuffled block tables), GQA groups that are
and are not powers of two, head dims that are not, row tiles cut short (ragged), unsorted rows.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from sparsetune.kernels.rows_attention import line_blocks, lines_attention, rows_attention, rows_attention_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def truth(q: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          sinks: list[int] | None = None, windows: list[int] | None = None, sees=None) -> torch.Tensor:
    """q [n, Hq, D], contiguous k, v [Hkv, T, D] → [n, Hq, D] float64, one row and head at a time:
    the keys j <= pos[r] with j < sink or pos[r] - j < window of the head's KV head, or those
    `sees(query head, pos[r], j)` names."""
    n, hq, _ = q.shape
    group = hq // k.shape[0]
    if sees is None:
        def sees(h, p, j):
            return j < (sinks[h // group] if sinks else 0) or p - j < (windows[h // group] if windows else p + 1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(n):
        p = int(pos[r])
        for h in range(hq):
            keys = [j for j in range(p + 1) if sees(h, p, j)]
            kh, vh = k[h // group, keys].double().cpu(), v[h // group, keys].double().cpu()
            out[r, h] = torch.softmax(kh @ q[r, h].double().cpu() * scale, 0) @ vh
    return out


def scattered(t: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """n sorted distinct positions in [0, t), the last token always among them (as a reuse plan has it)."""
    pos = torch.randperm(t - 1, generator=gen)[: n - 1].sort().values
    return torch.cat([pos, torch.tensor([t - 1])]).to(DEV)


def make(t: int, n: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=gen).to(DEV, dtype)
    k = torch.randn(hkv, t, d, generator=gen).to(DEV, dtype)
    v = torch.randn(hkv, t, d, generator=gen).to(DEV, dtype)
    return q, scattered(t, n, gen), k, v


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (9, 3, 64), (8, 2, 48)])  # groups 1, 3 (padded to 4), 4; D 48 padded
@pytest.mark.parametrize("tma", [True, False], ids=["descriptors", "pointers"])
def test_scattered_rows_match_the_float64_truth(hq, hkv, d, tma):
    q, pos, k, v = make(t=300, n=37, hq=hq, hkv=hkv, d=d, dtype=torch.float32)
    if tma:  # keys as KVCache.gather returns them: a view of a longer buffer (the descriptor ends at T, not the buffer)
        k = torch.cat([k, torch.full_like(k[:, :11], float("nan"))], 1)[:, :300]
        v = torch.cat([v, torch.full_like(v[:, :11], float("nan"))], 1)[:, :300]
    scale = d**-0.5
    want = truth(q, pos, k, v, scale)
    got = rows_attention(q, pos, k, v, scale, block_m=4, block_n=32, tma=tma)  # 37 rows: the last tile holds one
    assert (got.double().cpu() - want).abs().max() < 2e-5
    assert (rows_attention_ref(q, pos, k, v, scale).double().cpu() - want).abs().max() < 2e-5


def test_consecutive_rows_are_plain_causal_attention_and_row_order_does_not_matter():
    q, _, k, v = make(t=150, n=150, hq=6, hkv=2, d=64, dtype=torch.float32, seed=1)
    pos = torch.arange(150, device=DEV)
    want = truth(q, pos, k, v, 0.125)
    assert (rows_attention(q, pos, k, v, 0.125, block_m=8, block_n=32).double().cpu() - want).abs().max() < 2e-5
    perm = torch.randperm(150, generator=torch.Generator().manual_seed(2)).to(DEV)
    got = rows_attention(q[perm], pos[perm], k, v, 0.125, block_m=8, block_n=32)
    assert (got.double().cpu() - want[perm.cpu()]).abs().max() < 2e-5


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_paged_kv_through_a_shuffled_block_table_matches_the_truth(bs):
    t, hkv, d = 130, 2, 64
    q, pos, k, v = make(t=t, n=21, hq=4, hkv=hkv, d=d, dtype=torch.float32, seed=3)
    nb = -(-t // bs)
    table = torch.randperm(nb + 5, generator=torch.Generator().manual_seed(4))[:nb].to(DEV, torch.int32)
    kp = torch.randn(nb + 5, hkv, bs, d, device=DEV)  # garbage everywhere the table does not point
    vp = torch.randn(nb + 5, hkv, bs, d, device=DEV)
    for i in range(t):
        kp[table[i // bs], :, i % bs] = k[:, i]
        vp[table[i // bs], :, i % bs] = v[:, i]
    want = truth(q, pos, k, v, 0.125)
    got = rows_attention(q, pos, kp, vp, 0.125, block_table=table, block_m=2, block_n=16)
    assert (got.double().cpu() - want).abs().max() < 2e-5
    assert (rows_attention_ref(q, pos, kp, vp, 0.125, block_table=table).double().cpu() - want).abs().max() < 2e-5


def test_half_precision_inputs_round_like_half_precision():
    q, pos, k, v = make(t=200, n=16, hq=8, hkv=2, d=64, dtype=torch.float16, seed=5)
    want = truth(q, pos, k, v, 0.125)
    got = rows_attention(q, pos, k, v, 0.125, block_m=4, block_n=64)
    assert got.dtype == torch.float16
    assert (got.double().cpu() - want).abs().max() < 4e-3


@pytest.mark.parametrize("tma", [True, False], ids=["descriptors", "pointers"])
def test_values_past_every_row_of_a_tile_are_never_read_into_it(tma):
    """Keys and values past a tile's last row (below T) hold NaN and inf: masked tiles must not let
    them in (a zero probability times NaN is NaN). Rows stop at 20; T = 50; 32-key tiles."""
    q, pos, k, v = make(t=50, n=6, hq=4, hkv=2, d=64, dtype=torch.float32, seed=5)
    pos = torch.tensor([0, 3, 7, 11, 15, 20]).to(DEV)
    want = truth(q, pos, k, v, 0.125)
    k[:, 21:], v[:, 21:30], v[:, 30:] = float("nan"), float("inf"), float("nan")
    got = rows_attention(q, pos, k, v, 0.125, block_m=4, block_n=32, tma=tma)
    assert (got.double().cpu() - want).abs().max() < 2e-5
    everything = torch.ones(4, 50, dtype=torch.bool, device=DEV)  # every line: plain causal attention
    got = lines_attention(q, pos, k, v, 0.125, everything, everything, block_m=4, block_n=32, tma=tma)
    assert (got.double().cpu() - want).abs().max() < 2e-5


def test_a_row_at_position_zero_sees_only_its_own_key_and_no_rows_is_empty():
    q, _, k, v = make(t=40, n=3, hq=2, hkv=1, d=64, dtype=torch.float32, seed=6)
    pos = torch.tensor([0, 1, 39], device=DEV)
    got = rows_attention(q, pos, k, v, 0.125, block_m=2, block_n=16)
    assert torch.allclose(got[0], v[0, 0].expand(2, 64), atol=1e-6)
    assert (got.double().cpu() - truth(q, pos, k, v, 0.125)).abs().max() < 2e-5
    assert rows_attention(q[:0], pos[:0], k, v, 0.125).shape == (0, 2, 64)
    assert rows_attention(q[:0], pos[:0], k[:, :0], v[:, :0], 0.125).shape == (0, 2, 64)  # no keys either


@pytest.mark.parametrize("paged", [False, True])
def test_per_head_sinks_and_windows_match_the_truth(paged):
    # KV head 0 global (no window), 1 a wide window with sinks, 2 a window shorter than a key tile,
    # 3 sinks beyond some rows' positions; rows in tiles spanning close and far positions.
    t, hkv, d = 260, 4, 64
    q, pos, k, v = make(t=t, n=30, hq=8, hkv=hkv, d=d, dtype=torch.float32, seed=7)
    sinks, windows = [0, 4, 1, 40], [1 << 30, 100, 5, 33]
    want = truth(q, pos, k, v, 0.125, sinks, windows)
    st = torch.tensor(sinks, device=DEV, dtype=torch.int32)
    wt = torch.tensor(windows, device=DEV, dtype=torch.int32)
    if paged:
        bs = 8
        table = torch.randperm(t // bs + 1, generator=torch.Generator().manual_seed(8)).to(DEV, torch.int32)
        kp = torch.zeros(t // bs + 1, hkv, bs, d, device=DEV)
        vp = torch.zeros_like(kp)
        kp[table.long()] = torch.nn.functional.pad(k, (0, 0, 0, bs - t % bs)).view(hkv, -1, bs, d).transpose(0, 1)
        vp[table.long()] = torch.nn.functional.pad(v, (0, 0, 0, bs - t % bs)).view(hkv, -1, bs, d).transpose(0, 1)
        got = rows_attention(q, pos, kp, vp, 0.125, block_table=table, sinks=st, windows=wt, block_m=4, block_n=16)
    else:
        got = rows_attention(q, pos, k, v, 0.125, sinks=st, windows=wt, block_m=4, block_n=16)
    assert (got.double().cpu() - want).abs().max() < 2e-5
    ref = rows_attention_ref(q, pos, k, v, 0.125, sinks=st, windows=wt)
    assert (ref.double().cpu() - want).abs().max() < 2e-5
    # every row of a whole prompt too (consecutive rows: the unmasked middle tiles)
    allpos = torch.arange(t, device=DEV)
    qa = torch.randn(t, 8, d, generator=torch.Generator().manual_seed(9)).to(DEV)
    want = truth(qa, allpos, k, v, 0.125, sinks, windows)
    got = rows_attention(qa, allpos, k, v, 0.125, sinks=st, windows=wt, block_m=16, block_n=16)
    assert (got.double().cpu() - want).abs().max() < 2e-5


@pytest.mark.parametrize("consecutive", [False, True])
def test_vertical_and_slash_lines_match_the_truth_and_read_only_the_tiles_they_touch(consecutive):
    t, hq, hkv, d = 300, 6, 2, 64
    gen = torch.Generator().manual_seed(11)
    q, pos, k, v = make(t=t, n=40, hq=hq, hkv=hkv, d=d, dtype=torch.float32, seed=10)
    if consecutive:  # the new tokens at the end of a prompt, as LoopServe computes them
        pos = torch.arange(t - 40, t, device=DEV)
    vertical = torch.rand(hq, t, generator=gen) < 0.03
    vertical[:, :4] = True  # sinks, as the lines usually find them
    slash = torch.rand(hq, t, generator=gen) < 0.02
    slash[:, :8] = True  # the local band
    slash[0] = False  # a head with vertical lines only
    vertical[1] = False  # and one with slash lines only
    want = truth(q, pos, k, v, 0.125, sees=lambda h, p, j: bool(vertical[h, j] or slash[h, p - j]) or j == p)
    got = lines_attention(q, pos, k, v, 0.125, vertical.to(DEV), slash.to(DEV), block_m=16, block_n=16)
    assert (got.double().cpu() - want).abs().max() < 2e-5
    # The tiles each (row tile, head) reads: every one a row needs, none past the tile's last row, few
    blocks, counts = line_blocks(pos, vertical.to(DEV), slash.to(DEV), 16, 16)
    p = pos.cpu()
    for tile in range(blocks.shape[0]):
        rows = p[tile * 16 : (tile + 1) * 16]
        for h in range(hq):
            listed = set(blocks[tile, h, : counts[tile, h]].tolist())
            needed = {j // 16 for r in rows.tolist() for j in range(r + 1) if vertical[h, j] or slash[h, r - j] or j == r}
            assert needed <= listed and max(listed) * 16 <= int(rows.max())
    assert int(counts.sum()) < 0.8 * blocks.shape[0] * hq * blocks.shape[2]


def test_inputs_the_gpu_compiler_would_reject_are_refused_and_unbounded_windows_stay_unbounded():
    q, pos, k, v = make(t=64, n=8, hq=4, hkv=2, d=64, dtype=torch.float32, seed=12)
    with pytest.raises(ValueError, match="one dtype"):
        rows_attention(q.half(), pos, k, v, 0.125)
    with pytest.raises(ValueError, match="block_n must be at least 16"):
        rows_attention(q, pos, k, v, 0.125, block_n=8)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        rows_attention(q, pos, k, v, 0.125, block_m=3)
    huge = torch.tensor([1 << 40, 1 << 31], device=DEV)  # int64 "no window": not wrapped to a small one
    neg = torch.tensor([-5, 0], device=DEV)  # no sinks below zero
    want = truth(q, pos, k, v, 0.125)
    assert (rows_attention_ref(q, pos, k, v, 0.125, sinks=neg, windows=huge).double().cpu() - want).abs().max() < 2e-5
    got = rows_attention(q, pos, k, v, 0.125, sinks=neg, windows=huge, block_m=4, block_n=16)
    assert (got.double().cpu() - want).abs().max() < 2e-5


@pytest.mark.gpu  # the interpreter multiplies bfloat16 as raw bits; the GPU path is what runs them
@pytest.mark.parametrize("layout", ["contiguous", "pointers", "paged"])
def test_bfloat16_at_the_default_tiles_on_the_gpu(layout):
    paged = layout == "paged"
    tma = None if layout == "contiguous" else False  # contiguous: tensor descriptors on Hopper
    t, hkv, d = 700, 2, 128
    q, pos, k, v = make(t=t, n=150, hq=8, hkv=hkv, d=d, dtype=torch.bfloat16, seed=13)
    want = truth(q, pos, k, v, d**-0.5)
    if paged:
        table = torch.randperm(t // 16 + 1, generator=torch.Generator().manual_seed(14)).to(DEV, torch.int32)
        kp = torch.zeros(t // 16 + 1, hkv, 16, d, device=DEV, dtype=torch.bfloat16)
        vp = torch.zeros_like(kp)
        kp[table.long()] = torch.nn.functional.pad(k, (0, 0, 0, 16 - t % 16)).view(hkv, -1, 16, d).transpose(0, 1)
        vp[table.long()] = torch.nn.functional.pad(v, (0, 0, 0, 16 - t % 16)).view(hkv, -1, 16, d).transpose(0, 1)
        got = rows_attention(q, pos, kp, vp, d**-0.5, block_table=table)
    else:
        got = rows_attention(q, pos, k, v, d**-0.5, tma=tma)
    assert (got.double().cpu() - want).abs().max() < 2e-2
    vertical = torch.rand(8, t, generator=torch.Generator().manual_seed(15)) < 0.05
    slash = torch.rand(8, t, generator=torch.Generator().manual_seed(16)) < 0.05
    want = truth(q, pos, k, v, d**-0.5, sees=lambda h, p, j: bool(vertical[h, j] or slash[h, p - j]) or j == p)
    kv = dict(k=kp, v=vp, block_table=table) if paged else dict(k=k, v=v, tma=tma)
    got = lines_attention(q, pos, scale=d**-0.5, vertical=vertical.to(DEV), slash=slash.to(DEV), **kv)
    assert (got.double().cpu() - want).abs().max() < 2e-2
