"""Tests for sparsetune.kernels (Triton kernels and their torch twins).

Without a GPU the Triton kernels run through the Triton interpreter, which must
be enabled before the kernel modules are imported (triton decides at decoration
time). Every comparison is against an independent float64 reference written
here, built from data that never went through the paged layout, plus a check
of the Triton kernels against their `*_ref` twins.
"""

from __future__ import annotations

import importlib
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from sparsetune.kernels import fused_ops, paged_decode  # noqa: E402

if not torch.cuda.is_available() and not paged_decode._INTERPRET:
    # Another test module imported the kernels before the interpreter was
    # enabled; re-create the jitted kernels in interpreter mode.
    fused_ops = importlib.reload(fused_ops)
    paged_decode = importlib.reload(paged_decode)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter turns loop bounds held in 1-element arrays into ints, which
# numpy >= 1.25 flags as deprecated; it is not our code.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
REPO = Path(__file__).resolve().parents[2]

# Relative-error bounds (||out - ref|| / ||ref|| against float64) by dtype.
DECODE_TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}
ELEMWISE_TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# Kernel vs its torch twin: identical math up to reduction order / rsqrt / exp
# implementation, so at most rare last-bit differences.
TWIN_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}

HUGE_BLOCK_ID = 2**30


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out64).all(), "output has NaN/inf"
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------- #
# Paged decode attention
# --------------------------------------------------------------------------- #


class DecodeCase:
    """Random decode problem with a deliberately hostile paged layout.

    K/V of every sequence are first drawn contiguously ([L, Hkv, D], kept for the
    float64 reference) and then scattered into a shuffled set of cache blocks.
    Everything that must never be read is NaN: free blocks, the tail slots of
    partial last blocks and two canary blocks just outside the cache (the cache
    is a view into a larger NaN buffer), which is where garbage table entries -1
    and num_blocks point. Any stray read therefore shows up as NaN.
    """

    def __init__(
        self,
        seq_lens: list[int],
        num_kv_heads: int,
        group: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        seed: int,
        extra_cols: int = 3,
        free_blocks: int = 3,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens_list = seq_lens
        self.batch = len(seq_lens)
        self.hkv, self.group, self.d, self.bs, self.dtype = num_kv_heads, group, head_dim, block_size, dtype
        self.hq = num_kv_heads * group
        self.scale = head_dim**-0.5
        n_blk = [math.ceil(L / block_size) for L in seq_lens]
        num_blocks = sum(n_blk) + free_blocks
        max_blocks = max(n_blk + [1]) + extra_cols

        shape = (num_blocks + 2, num_kv_heads, block_size, head_dim)
        self.k_store = torch.full(shape, float("nan"), dtype=dtype)
        self.v_store = torch.full(shape, float("nan"), dtype=dtype)
        self.k_cache, self.v_cache = self.k_store[1:-1], self.v_store[1:-1]

        perm = torch.randperm(num_blocks, generator=gen).tolist()
        free_ids = perm[sum(n_blk):]
        garbage = [-1, num_blocks, HUGE_BLOCK_ID] + free_ids
        table = torch.empty((self.batch, max_blocks), dtype=torch.int32)
        self.k_seqs, self.v_seqs = [], []
        cursor = 0
        for b, L in enumerate(seq_lens):
            ids = perm[cursor: cursor + n_blk[b]]
            cursor += n_blk[b]
            row = ids + [garbage[(b + j) % len(garbage)] for j in range(max_blocks - n_blk[b])]
            table[b] = torch.tensor(row, dtype=torch.int32)
            k = torch.randn((L, num_kv_heads, head_dim), generator=gen).to(dtype)
            v = torch.randn((L, num_kv_heads, head_dim), generator=gen).to(dtype)
            self.k_seqs.append(k)
            self.v_seqs.append(v)
            if L:
                t = torch.arange(L)
                blk = torch.tensor(ids, dtype=torch.long)[t // block_size]
                self.k_cache[blk, :, t % block_size, :] = k
                self.v_cache[blk, :, t % block_size, :] = v
        self.block_tables = table
        # Slightly larger than unit scores so the softmax is not nearly uniform.
        self.q = (2.0 * torch.randn((self.batch, self.hq, head_dim), generator=gen)).to(dtype)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)

    def to(self, device: str) -> "DecodeCase":
        # Move the whole NaN-padded stores (not just the views) so the canary
        # blocks around the cache stay in place on the device too.
        for name in ("k_store", "v_store", "block_tables", "q", "seq_lens"):
            setattr(self, name, getattr(self, name).to(device))
        self.k_cache, self.v_cache = self.k_store[1:-1], self.v_store[1:-1]
        return self

    def reference_fp64(self) -> torch.Tensor:
        """Attention in float64 from the contiguous per-sequence K/V."""
        out = torch.zeros((self.batch, self.hq, self.d), dtype=torch.float64)
        for b, L in enumerate(self.seq_lens_list):
            if L == 0:
                continue
            q = self.q[b].cpu().double().view(self.hkv, self.group, self.d)
            k = self.k_seqs[b].double().permute(1, 0, 2)  # [Hkv, L, D]
            v = self.v_seqs[b].double().permute(1, 0, 2)
            p = torch.softmax(q @ k.transpose(1, 2) * self.scale, dim=-1)
            out[b] = (p @ v).reshape(self.hq, self.d)
        return out

    def poisoned_out(self) -> torch.Tensor:
        return torch.full((self.batch, self.hq, self.d), float("nan"), dtype=self.dtype, device=self.q.device)

    def args(self):
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.scale


def check_zero_rows(out: torch.Tensor, seq_lens: list[int]) -> None:
    for b, L in enumerate(seq_lens):
        if L == 0:
            assert torch.equal(out[b].cpu(), torch.zeros_like(out[b].cpu())), f"row {b} (seq_len 0) not zero"


DECODE_CASES = [
    # (block_size, group, num_kv_heads, head_dim, dtype, seq_lens)
    (16, 4, 2, 64, torch.float32, [37, 0, 16, 150, 1]),
    (16, 3, 2, 32, torch.bfloat16, [100, 0, 17, 64]),
    (16, 1, 3, 64, torch.float16, [49, 129, 0]),
    (1, 4, 1, 32, torch.float32, [1, 0, 45, 20]),
    (1, 3, 2, 64, torch.bfloat16, [33, 0, 7]),
    (64, 3, 2, 32, torch.float32, [64, 0, 130, 5]),
    (64, 4, 2, 64, torch.float16, [200, 1, 0]),
    (64, 1, 2, 128, torch.bfloat16, [70, 0, 3]),
    (256, 8, 1, 16, torch.float32, [300, 0, 257]),
]


@pytest.mark.parametrize("block_size,group,hkv,head_dim,dtype,seq_lens", DECODE_CASES)
def test_paged_decode_matches_fp64(block_size, group, hkv, head_dim, dtype, seq_lens):
    seed = 1000 + DECODE_CASES.index((block_size, group, hkv, head_dim, dtype, seq_lens))
    case = DecodeCase(seq_lens, hkv, group, head_dim, block_size, dtype, seed=seed).to(DEVICE)
    ref64 = case.reference_fp64()
    tol = DECODE_TOL[dtype]

    ref = paged_decode.paged_decode_attention_ref(*case.args())
    assert ref.dtype == dtype and ref.shape == (case.batch, case.hq, head_dim)
    err_ref = rel_err(ref, ref64)
    assert err_ref < tol, f"ref rel err {err_ref:.3e} >= {tol}"
    check_zero_rows(ref, seq_lens)

    out = case.poisoned_out()
    res = paged_decode.paged_decode_attention(*case.args(), num_splits=3, out=out)
    assert res.data_ptr() == out.data_ptr() and res.dtype == dtype
    err = rel_err(out, ref64)
    assert err < tol, f"triton rel err {err:.3e} >= {tol} (ref: {err_ref:.3e})"
    check_zero_rows(out, seq_lens)

    auto = paged_decode.paged_decode_attention(*case.args())
    assert rel_err(auto, ref64) < tol
    pf = paged_decode.paged_decode_attention(*case.args(), num_splits=2, block_n=16, prefetch=True)
    assert rel_err(pf, ref64) < tol
    check_zero_rows(pf, seq_lens)


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_paged_decode_num_splits_agree():
    """1 split (direct store, no merge) and several splits (incl. more splits than
    tiles, i.e. empty splits) give the same answer, at several tile sizes and with
    the hand-pipelined (prefetch) loop."""
    seq_lens = [0, 5, 16, 97, 130]
    case = DecodeCase(seq_lens, num_kv_heads=2, group=4, head_dim=32, block_size=16, dtype=torch.float32, seed=7).to(DEVICE)
    ref64 = case.reference_fp64()
    outs = {}
    variants = [(1, 16, False), (3, 16, False), (8, 16, False), (1, 64, False), (3, 64, False), (8, 32, False),
                (1, 16, True), (3, 32, True), (8, 16, True)]
    for num_splits, block_n, prefetch in variants:
        out = paged_decode.paged_decode_attention(
            *case.args(), num_splits=num_splits, block_n=block_n, prefetch=prefetch, out=case.poisoned_out()
        )
        err = rel_err(out, ref64)
        assert err < 1e-5, f"splits={num_splits} block_n={block_n} prefetch={prefetch}: rel err {err:.3e}"
        check_zero_rows(out, seq_lens)
        outs[(num_splits, block_n, prefetch)] = out
    base = outs[(1, 16, False)]
    for key, out in outs.items():
        assert rel_err(out, base) < 1e-5, key


def test_paged_decode_strided_q_and_wide_table():
    """q as a strided view (as sliced out of a fused qkv output), a block table much
    wider than needed (auto num_splits then splits short sequences finely) and
    int64 seq_lens."""
    case = DecodeCase([40, 0, 19], num_kv_heads=3, group=3, head_dim=32, block_size=4, dtype=torch.float16, seed=11, extra_cols=700).to(DEVICE)
    ref64 = case.reference_fp64()
    qkv = torch.randn((case.batch, (case.hq + 2 * case.hkv) * case.d), dtype=case.dtype, device=DEVICE)
    q = qkv[:, : case.hq * case.d].view(case.batch, case.hq, case.d)
    q.copy_(case.q)
    assert not q.is_contiguous()
    splits = paged_decode.choose_num_splits(case.batch, case.hkv, case.block_tables.shape[1], case.bs)
    assert splits > 1
    out = paged_decode.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens.long(), case.scale)
    assert rel_err(out, ref64) < DECODE_TOL[case.dtype]
    check_zero_rows(out, case.seq_lens_list)


def test_paged_decode_rejects_bad_shapes():
    case = DecodeCase([5], num_kv_heads=2, group=2, head_dim=32, block_size=16, dtype=torch.float32, seed=3).to(DEVICE)
    q, k, v, bt, sl, scale = case.args()
    with pytest.raises(ValueError):
        paged_decode.paged_decode_attention(q[:, :3], k, v, bt, sl, scale)  # 3 q heads, 2 kv heads
    with pytest.raises(ValueError):
        paged_decode.paged_decode_attention(q, k, v, bt, sl, scale, block_n=8)  # tl.dot needs >= 16


def test_choose_num_splits_properties():
    choose = paged_decode.choose_num_splits
    # Long contexts at small batch are split; no split is shorter than 512 tokens.
    for batch, ctx in [(1, 32768), (8, 32768), (16, 16384), (64, 4096)]:
        s = choose(batch, 8, ctx // 16, 16)
        assert 1 < s <= 64 and ctx // s >= 512, (batch, ctx, s)
        # Enough programs to fill 132 SMs several times over (batch 1 hits the cap).
        assert batch * 8 * s >= (4 * 132 if batch > 1 else 8 * 64), (batch, ctx, s)
    # Short contexts or huge batches are not split at all.
    assert choose(8, 8, 512 // 16, 16) == 1
    assert choose(4096, 8, 4096 // 16, 16) == 1
    # More work from the batch -> never more splits.
    prev = 10**9
    for batch in [1, 2, 4, 8, 16, 32, 64, 128]:
        s = choose(batch, 8, 2048, 16)
        assert s <= prev
        prev = s
    # Only the block count * block size matters, not how it is divided.
    assert choose(8, 8, 2048, 16) == choose(8, 8, 512, 64)
    # Rows of selected blocks (a 2,048-token budget): about 4 programs per SM, rounded down (the
    # measured best at batch 8 and 16), none shorter than 128 tokens; rows short of 4 per SM are
    # split at least in two (Vortex's 53 x 8 rows: 162 us at two splits against 206 at one).
    assert [choose(b, 8, 128, 16, sparse=True) for b in (1, 4, 8, 16, 32, 53, 64, 66, 128)] == [16, 16, 8, 4, 2, 2, 2, 1, 1]
    for batch in (4, 8, 16, 32):
        assert batch * 8 * choose(batch, 8, 128, 16, sparse=True) <= 4 * 132
    for batch in (4, 8, 16, 32, 53, 64):
        assert choose(batch, 8, 128, 16, sparse=True) >= 2
    assert choose(53, 8, 8, 16, sparse=True) == 1  # 128 tokens a row: never shorter pieces


# --------------------------------------------------------------------------- #
# Sparse (block-sparse) paged decode attention
# --------------------------------------------------------------------------- #


class SparseSelection:
    """Per-(sequence, kv head) selection of logical blocks for a DecodeCase.

    Row (b, h) follows mode (b * Hkv + h) % 4 (or `modes` when given):
      0: min(K, n_blk) blocks, the last (possibly partial) block included;
      1: up to K blocks, the last block excluded;
      2: count 0;
      3: a random count in [1, min(K, n_blk)].
    The selected blocks are in random order, except that `last_first` puts the
    last block in front (then a BLOCK_N < block_size tile can cover only its
    padding). Entries past the count are garbage, first of all valid but
    unselected blocks of the sequence (reading one changes the result), then -1,
    a huge index, the first index past the sequence and an index into the
    table's garbage columns (whose cache blocks are NaN or out of bounds).
    """

    def __init__(self, case: DecodeCase, max_sel: int, seed: int, modes: list[int] | None = None,
                 last_first: bool = False, full: bool = False, shuffle: bool = True, unit: int | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.k = max_sel
        self.unit = unit or case.bs  # tokens per selected unit ("block" below)
        sel = torch.empty((case.batch, case.hkv, max_sel), dtype=torch.int32)
        counts = torch.zeros((case.batch, case.hkv), dtype=torch.int32)
        self.sets: dict[tuple[int, int], list[int]] = {}  # selected logical blocks
        max_blocks = case.block_tables.shape[1]
        for b, L in enumerate(case.seq_lens_list):
            n_blk = math.ceil(L / self.unit)
            for h in range(case.hkv):
                mode = 0 if full else (modes[(b * case.hkv + h) % len(modes)] if modes else (b * case.hkv + h) % 4)
                if mode == 0:
                    cnt = min(max_sel, n_blk)
                    pool = list(range(n_blk - 1))
                    chosen = ([n_blk - 1] if cnt else []) + [pool[i] for i in torch.randperm(len(pool), generator=gen)[: max(cnt - 1, 0)].tolist()]
                elif mode == 1:
                    cnt = min(max_sel, max(n_blk - 1, 0))
                    chosen = torch.randperm(max(n_blk - 1, 0), generator=gen)[:cnt].tolist()
                elif mode == 2:
                    chosen = []
                else:
                    top = min(max_sel, n_blk)
                    cnt = int(torch.randint(1, top + 1, (1,), generator=gen)) if top else 0
                    chosen = torch.randperm(n_blk, generator=gen)[:cnt].tolist()
                if full:
                    chosen = list(range(n_blk))
                if shuffle:
                    chosen = [chosen[i] for i in torch.randperm(len(chosen), generator=gen).tolist()]
                if last_first and n_blk - 1 in chosen:
                    chosen.remove(n_blk - 1)
                    chosen.insert(0, n_blk - 1)
                unselected = [x for x in range(n_blk) if x not in chosen]
                garbage = unselected[:1] + [HUGE_BLOCK_ID, -1] + unselected[1:2] + [n_blk, max_blocks * case.bs // self.unit - 1]
                row = chosen + [garbage[i % len(garbage)] for i in range(max_sel - len(chosen))]
                sel[b, h] = torch.tensor(row, dtype=torch.int32)
                counts[b, h] = len(chosen)
                self.sets[(b, h)] = chosen
        # A strided view (row stride > K) of a wider buffer full of garbage.
        wide = torch.full((case.batch, case.hkv, max_sel + 3), -7, dtype=torch.int32)
        wide[:, :, :max_sel] = sel
        self.sel_blocks = wide.to(DEVICE)[:, :, :max_sel]
        self.sel_counts = counts.to(DEVICE)

    def positions(self, case: DecodeCase, b: int, h: int) -> list[int]:
        """Explicit token positions attended by (b, h)."""
        L = case.seq_lens_list[b]
        u = self.unit
        return sorted(t for lb in self.sets[(b, h)] for t in range(lb * u, (lb + 1) * u) if t < L)

    def reference_fp64(self, case: DecodeCase) -> torch.Tensor:
        """float64 attention over the selected positions, from the contiguous K/V."""
        out = torch.zeros((case.batch, case.hq, case.d), dtype=torch.float64)
        for b in range(case.batch):
            for h in range(case.hkv):
                pos = torch.tensor(self.positions(case, b, h), dtype=torch.long)
                if pos.numel() == 0:
                    continue
                k = case.k_seqs[b][pos, h].double()  # [n, D]
                v = case.v_seqs[b][pos, h].double()
                q = case.q[b, h * case.group: (h + 1) * case.group].cpu().double()
                p = torch.softmax(q @ k.T * case.scale, dim=-1)
                out[b, h * case.group: (h + 1) * case.group] = p @ v
        return out

    def args(self, case: DecodeCase):
        return (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                self.sel_blocks, self.sel_counts, case.scale)


def check_zero_groups(out: torch.Tensor, case: DecodeCase, sel: SparseSelection) -> None:
    for b in range(case.batch):
        for h in range(case.hkv):
            if not sel.positions(case, b, h):
                rows = out[b, h * case.group: (h + 1) * case.group].cpu()
                assert torch.equal(rows, torch.zeros_like(rows)), f"(b={b}, h={h}) attends nothing but is not zero"


SPARSE_CASES = [
    # (block_size, group, num_kv_heads, head_dim, dtype, seq_lens, K, block_n)
    (16, 4, 2, 32, torch.float32, [37, 0, 160, 70], 4, None),
    (16, 3, 2, 32, torch.bfloat16, [129, 50, 0], 6, None),
    (1, 3, 2, 32, torch.bfloat16, [45, 0, 20], 24, None),
    (1, 1, 2, 32, torch.float32, [30, 3], 16, 16),
    (64, 1, 3, 32, torch.float32, [200, 5, 0, 64], 3, 16),
    (64, 4, 2, 32, torch.bfloat16, [130, 0, 104], 2, None),
    # the small selection blocks a search picks on the embedded model (#17), ragged batches
    (2, 3, 3, 64, torch.float32, [61, 0, 9, 128], 12, None),
    (4, 4, 2, 32, torch.float16, [70, 3, 0, 33], 9, 16),
    (8, 3, 2, 64, torch.bfloat16, [100, 17, 0], 7, None),
    (32, 2, 2, 32, torch.float32, [150, 0, 31, 65], 3, 16),
]


@pytest.mark.parametrize("block_size,group,hkv,head_dim,dtype,seq_lens,max_sel,block_n", SPARSE_CASES)
def test_sparse_paged_decode_matches_fp64(block_size, group, hkv, head_dim, dtype, seq_lens, max_sel, block_n):
    idx = SPARSE_CASES.index((block_size, group, hkv, head_dim, dtype, seq_lens, max_sel, block_n))
    case = DecodeCase(seq_lens, hkv, group, head_dim, block_size, dtype, seed=2000 + idx).to(DEVICE)
    sel = SparseSelection(case, max_sel, seed=3000 + idx)
    counts = sel.sel_counts.cpu()
    # The case exercises what it claims: empty and full (K) rows, and (for
    # block_size > 1) a partial last block both selected and not selected.
    assert (counts == 0).any() and (counts == max_sel).any()
    if block_size > 1:
        partial = {b for b, L in enumerate(seq_lens) if L % block_size}
        last_in = [(math.ceil(seq_lens[b] / block_size) - 1) in sel.sets[(b, h)] for b in partial for h in range(hkv)]
        assert any(last_in) and not all(last_in)
    ref64 = sel.reference_fp64(case)
    tol = DECODE_TOL[dtype]

    twin = paged_decode.sparse_paged_decode_attention_ref(*sel.args(case))
    assert twin.dtype == dtype and twin.shape == (case.batch, case.hq, head_dim)
    err_twin = rel_err(twin, ref64)
    assert err_twin < tol, f"ref twin rel err {err_twin:.3e} >= {tol}"
    check_zero_groups(twin, case, sel)

    out = case.poisoned_out()
    res = paged_decode.sparse_paged_decode_attention(*sel.args(case), num_splits=3, out=out, block_n=block_n)
    assert res.data_ptr() == out.data_ptr() and res.dtype == dtype
    err = rel_err(out, ref64)
    assert err < tol, f"triton rel err {err:.3e} >= {tol} (twin: {err_twin:.3e})"
    check_zero_groups(out, case, sel)
    assert rel_err(out, twin) < tol

    auto = paged_decode.sparse_paged_decode_attention(*sel.args(case), block_n=block_n)
    assert rel_err(auto, ref64) < tol
    check_zero_groups(auto, case, sel)


@pytest.mark.parametrize("block_size,dtype,block_n", [(16, torch.float32, 16), (1, torch.float32, 16), (64, torch.bfloat16, 32)])
def test_sparse_full_selection_equals_dense(block_size, dtype, block_n):
    """Selecting every block of every sequence is dense attention: in block order
    with one split it is the very same computation (bit-identical); shuffled, with
    several splits, it agrees to rounding."""
    seq_lens = [0, 5, 70]
    case = DecodeCase(seq_lens, num_kv_heads=2, group=3, head_dim=32, block_size=block_size, dtype=dtype, seed=17).to(DEVICE)
    max_sel = max(math.ceil(L / block_size) for L in seq_lens)
    in_order = SparseSelection(case, max_sel, seed=18, full=True, shuffle=False)
    shuffled = SparseSelection(case, max_sel, seed=19, full=True)
    dense1 = paged_decode.paged_decode_attention(*case.args(), num_splits=1, block_n=block_n)
    sparse1 = paged_decode.sparse_paged_decode_attention(*in_order.args(case), num_splits=1, block_n=block_n)
    assert torch.equal(sparse1, dense1)
    dense = paged_decode.paged_decode_attention(*case.args(), num_splits=3, block_n=block_n)
    sparse = paged_decode.sparse_paged_decode_attention(*shuffled.args(case), num_splits=3, block_n=block_n)
    assert rel_err(sparse, dense) < TWIN_TOL[dtype]
    assert rel_err(sparse, case.reference_fp64()) < DECODE_TOL[dtype]


UNIT_CASES = [
    # (block_size, unit, dtype, seq_lens, K, block_n): units of a few tokens inside cache blocks (#43)
    (16, 2, torch.float32, [37, 0, 160, 70], 24, None),
    (16, 1, torch.float32, [33, 5, 0], 20, 16),
    (16, 4, torch.bfloat16, [129, 50, 0], 12, None),
    (16, 8, torch.float16, [61, 0, 17, 128], 6, 32),
    (64, 2, torch.bfloat16, [200, 9, 0], 40, None),
]


@pytest.mark.parametrize("block_size,unit,dtype,seq_lens,max_sel,block_n", UNIT_CASES)
def test_sparse_units_inside_blocks_match_fp64(block_size, unit, dtype, seq_lens, max_sel, block_n):
    """Selected units smaller than a cache block: each row attends exactly the tokens of its units
    (ragged within blocks, the partial last unit cut at the sequence end, garbage past the count
    never read), against float64 attention over those positions."""
    idx = UNIT_CASES.index((block_size, unit, dtype, seq_lens, max_sel, block_n))
    case = DecodeCase(seq_lens, 2, 3, 32, block_size, dtype, seed=5000 + idx).to(DEVICE)
    sel = SparseSelection(case, max_sel, seed=5100 + idx, unit=unit)
    counts = sel.sel_counts.cpu()
    assert (counts == 0).any() and (counts == max_sel).any()
    ref64, tol = sel.reference_fp64(case), DECODE_TOL[dtype]
    twin = paged_decode.sparse_paged_decode_attention_ref(*sel.args(case), unit=unit)
    assert rel_err(twin, ref64) < tol
    check_zero_groups(twin, case, sel)
    for num_splits in (1, 3):
        out = paged_decode.sparse_paged_decode_attention(*sel.args(case), num_splits=num_splits, block_n=block_n,
                                                         out=case.poisoned_out(), unit=unit)
        assert rel_err(out, ref64) < tol, f"splits={num_splits}"
        check_zero_groups(out, case, sel)
    auto = paged_decode.sparse_paged_decode_attention(*sel.args(case), unit=unit)
    assert rel_err(auto, ref64) < tol


def test_units_of_a_whole_block_are_the_block_selection():
    """unit = block size is the block selection, bit for bit; units covering every token in order
    are dense attention."""
    case = DecodeCase([37, 0, 160, 70], 2, 4, 32, 16, torch.float32, seed=71).to(DEVICE)
    sel = SparseSelection(case, 5, seed=72)
    blocks = paged_decode.sparse_paged_decode_attention(*sel.args(case), num_splits=2)
    units = paged_decode.sparse_paged_decode_attention(*sel.args(case), num_splits=2, unit=16)
    assert torch.equal(blocks, units)
    full = SparseSelection(case, 80, seed=73, full=True, shuffle=False, unit=2)
    dense = paged_decode.paged_decode_attention(*case.args(), num_splits=1, block_n=16)
    sparse = paged_decode.sparse_paged_decode_attention(*full.args(case), num_splits=1, block_n=16, unit=2)
    assert torch.equal(sparse, dense)
    with pytest.raises(ValueError, match="unit must be a power of two dividing the block size 16"):
        paged_decode.sparse_paged_decode_attention(*sel.args(case), unit=3)


def test_sparse_num_splits_agree():
    """1 (direct store), 3 and 8 splits agree, including splits that start inside
    the padding of a selected partial last block (empty tiles, empty splits) and
    more splits than tiles."""
    seq_lens = [200, 7]
    case = DecodeCase(seq_lens, num_kv_heads=2, group=4, head_dim=32, block_size=64, dtype=torch.float32, seed=23).to(DEVICE)
    sel = SparseSelection(case, 3, seed=24, modes=[0, 3, 1, 2], last_first=True)
    ref64 = sel.reference_fp64(case)
    outs = {}
    for num_splits, block_n in [(1, 16), (3, 16), (8, 16), (3, 64)]:
        out = paged_decode.sparse_paged_decode_attention(
            *sel.args(case), num_splits=num_splits, block_n=block_n, out=case.poisoned_out()
        )
        err = rel_err(out, ref64)
        assert err < 1e-5, f"splits={num_splits} block_n={block_n}: rel err {err:.3e}"
        check_zero_groups(out, case, sel)
        outs[(num_splits, block_n)] = out
    base = outs[(1, 16)]
    for key, out in outs.items():
        assert rel_err(out, base) < 1e-5, key


def test_sparse_paged_decode_rejects_bad_shapes():
    case = DecodeCase([20, 9], num_kv_heads=2, group=2, head_dim=32, block_size=16, dtype=torch.float32, seed=5).to(DEVICE)
    sel = SparseSelection(case, 2, seed=6)
    q, k, v, bt, sl, sb, sc, scale = sel.args(case)
    with pytest.raises(ValueError):
        paged_decode.sparse_paged_decode_attention(q, k, v, bt, sl, sb[:, :1], sc, scale)  # Hkv mismatch
    with pytest.raises(ValueError):
        paged_decode.sparse_paged_decode_attention(q, k, v, bt, sl, sb, sc[:1], scale)  # batch mismatch
    with pytest.raises(ValueError):
        paged_decode.sparse_paged_decode_attention(q, k, v, bt, sl, sb[..., 0], sc, scale)  # not [B, Hkv, K]
    # K = 0: nothing can be selected, zeros without a launch.
    out = paged_decode.sparse_paged_decode_attention(q, k, v, bt, sl, sb[:, :, :0], torch.zeros_like(sc), scale,
                                                     out=case.poisoned_out())
    assert torch.equal(out, torch.zeros_like(out))


# --------------------------------------------------------------------------- #
# Fused ops
# --------------------------------------------------------------------------- #

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rms_norm_fp64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [96, 256])
def test_rms_norm(dtype, with_residual, hidden):
    gen = torch.Generator().manual_seed(hidden + 7 * with_residual)
    n, eps = 5, 1e-6
    x = (3.0 * torch.randn((n, hidden), generator=gen)).to(dtype).to(DEVICE)
    w = (1.0 + 0.5 * torch.randn((hidden,), generator=gen)).to(dtype).to(DEVICE)
    res = torch.randn((n, hidden), generator=gen).to(dtype).to(DEVICE) if with_residual else None
    x_before = x.clone()

    got = fused_ops.rms_norm(x, w, eps, res)
    twin = fused_ops.rms_norm_ref(x, w, eps, res)
    assert torch.equal(x, x_before), "input modified"
    if with_residual:
        out, new_res = got
        out_t, new_res_t = twin
        summed = (x.double() + res.double()).to(dtype)  # one rounding of the exact sum
        assert new_res.dtype == dtype and torch.equal(new_res, summed)
        assert torch.equal(new_res_t, summed)
        base = summed
    else:
        out, out_t = got, twin
        base = x
    assert out.dtype == dtype and out.shape == x.shape
    ref64 = rms_norm_fp64(base, w, eps)
    assert rel_err(out, ref64) < ELEMWISE_TOL[dtype] * 3
    assert rel_err(out_t, ref64) < ELEMWISE_TOL[dtype] * 3
    assert rel_err(out, out_t) < TWIN_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_ref_matches_hf_order(dtype):
    """The twin reproduces HF LlamaRMSNorm.forward bit for bit."""
    gen = torch.Generator().manual_seed(1)
    x = (4.0 * torch.randn((3, 64), generator=gen)).to(dtype)
    w = (1.0 + 0.3 * torch.randn((64,), generator=gen)).to(dtype)
    eps = 1e-5
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    hf = w * h.to(dtype)
    assert torch.equal(fused_ops.rms_norm_ref(x, w, eps), hf)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gen = torch.Generator().manual_seed(5)
    n, inter = 4, 1500  # not a multiple of the 1024 tile
    x = (3.0 * torch.randn((n, 2 * inter), generator=gen)).to(dtype).to(DEVICE)
    out = fused_ops.silu_and_mul(x)
    assert out.shape == (n, inter) and out.dtype == dtype
    g, u = x[:, :inter].double(), x[:, inter:].double()
    ref64 = g / (1.0 + torch.exp(-g)) * u
    assert rel_err(out, ref64) < ELEMWISE_TOL[dtype] * 2
    assert rel_err(out, fused_ops.silu_and_mul_ref(x)) < TWIN_TOL[dtype]


def make_cos_sin_cache(max_pos: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=-1).to(torch.float32)


def rope_fp64(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE in float64, written from the formula (not via the twin)."""
    x64 = x.double().cpu()
    half = x.shape[-1] // 2
    cs = cache.double().cpu()[positions.cpu().long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x1, x2 = x64[..., :half], x64[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def make_qkv(n: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = (2.0 * torch.randn((n, (hq + 2 * hkv) * d), generator=gen)).to(dtype).to(DEVICE)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(n, hkv, d)
    return qkv, q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,head_dim,pos_dtype", [(4, 2, 64, torch.int64), (9, 3, 32, torch.int32)])
def test_apply_rope(dtype, hq, hkv, head_dim, pos_dtype):
    n = 7
    cache = make_cos_sin_cache(4096, head_dim).to(DEVICE)
    positions = torch.tensor([3, 4095, 0, 17, 1000, 17, 2], dtype=pos_dtype, device=DEVICE)
    qkv, q, k = make_qkv(n, hq, hkv, head_dim, dtype, seed=hq)
    orig = qkv.clone()
    q0, k0 = q.clone(), k.clone()

    q_out, k_out = fused_ops.apply_rope(q, k, positions, cache)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr(), "not in place"
    tol = ELEMWISE_TOL[dtype] * 2
    assert rel_err(q, rope_fp64(q0, positions, cache)) < tol
    assert rel_err(k, rope_fp64(k0, positions, cache)) < tol
    # The v slice of the fused buffer is untouched.
    v_start = (hq + hkv) * head_dim
    assert torch.equal(qkv[:, v_start:], orig[:, v_start:])

    q_t, k_t = q0.clone(), k0.clone()
    fused_ops.apply_rope_ref(q_t, k_t, positions, cache)
    assert rel_err(q, q_t) < TWIN_TOL[dtype] and rel_err(k, k_t) < TWIN_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope(dtype):
    n, hq, hkv, d, eps = 5, 8, 2, 64, 1e-6
    gen = torch.Generator().manual_seed(9)
    cache = make_cos_sin_cache(512, d).to(DEVICE)
    positions = torch.randint(0, 512, (n,), generator=gen).to(DEVICE)
    qw = (1.0 + 0.5 * torch.randn((d,), generator=gen)).to(dtype).to(DEVICE)
    kw = (1.0 + 0.5 * torch.randn((d,), generator=gen)).to(dtype).to(DEVICE)
    qkv, q, k = make_qkv(n, hq, hkv, d, dtype, seed=10)
    q0, k0 = q.clone(), k.clone()

    fused_ops.qk_norm_rope(q, k, positions, cache, qw, kw, eps)
    q_ref = rope_fp64(rms_norm_fp64(q0, qw, eps), positions, cache)
    k_ref = rope_fp64(rms_norm_fp64(k0, kw, eps), positions, cache)
    tol = ELEMWISE_TOL[dtype] * 3
    assert rel_err(q, q_ref) < tol and rel_err(k, k_ref) < tol

    q_t, k_t = q0.clone(), k0.clone()
    fused_ops.qk_norm_rope_ref(q_t, k_t, positions, cache, qw, kw, eps)
    assert rel_err(q_t, q_ref) < tol and rel_err(k_t, k_ref) < tol
    assert rel_err(q, q_t) < TWIN_TOL[dtype] and rel_err(k, k_t) < TWIN_TOL[dtype]


# --------------------------------------------------------------------------- #
# GPU compilation (no GPU needed): every kernel variant must lower to sm_90 code
# --------------------------------------------------------------------------- #


def _ptxas_available() -> bool:
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists() or shutil.which("ptxas") is not None


@pytest.mark.skipif(not _ptxas_available(), reason="no ptxas to compile for sm_90")
def test_kernels_compile_for_hopper():
    """Ahead-of-time compile the kernels for sm_90 (H100/H200) without a GPU: the
    interpreter does not enforce GPU-only rules (tl.dot minimum sizes, layouts,
    shared-memory limits), the real compiler does."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_kernels.py"), "--compile-only", "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compile-only: all" in proc.stdout, proc.stdout[-3000:]
    # The block-sparse specialisation is among them (bs 1, 16, 64+, direct and merged).
    sparse_lines = [line for line in proc.stdout.splitlines() if "sparse=True" in line]
    assert len(sparse_lines) >= 4 and any("direct=True" in line for line in sparse_lines), proc.stdout[-3000:]


@pytest.mark.skipif(
    tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 3),
    reason="the Triton interpreter's loops break on numpy >= 2.3 (GPU hosts ship a newer numpy)",
)
@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_benchmark_script_cpu_smoke(tmp_path):
    """The GPU benchmark's whole flow (correctness gate, sweeps, SDPA reference,
    block-sparse points, fused ops, summary, JSON) on CPU with tiny shapes, so it cannot rot unnoticed
    before it gets scarce GPU time."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_kernels.py"), "--cpu-smoke", "--quick", "--skip-large",
         "--json-out", str(out_json)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    res = json.loads(out_json.read_text())
    assert [(r["batch"], r["ctx"]) for r in res["decode"]] == [(2, 96)]  # (3, 32) skipped as "large"
    point = res["decode"][0]
    assert point["best"]["us"] > 0 and "us" in point["sdpa_contiguous"]
    assert all(err < 1e-2 for err in res["correctness"].values())
    assert any(key.startswith("sparse_") for key in res["correctness"])
    assert [(r["batch"], r["ctx"], r["k_sel"]) for r in res["sparse"]] == [(1, 64, 2)]
    sp = res["sparse"][0]
    assert sp["rel_err_vs_ref"] < 1e-2 and sp["best"]["us"] > 0 and sp["dense_same_bytes"]["ctx"] == 2 * 16
    assert sp["kv_bytes"] == 1 * 2 * 2 * 16 * 32 * 2 * 2  # B * Hkv * K * bs * D * 2 bytes * (K and V)
    assert set(res["fused"]["3"]) == {"rms_norm", "rms_norm+residual", "silu_and_mul", "apply_rope", "qk_norm_rope"}
    assert all("us" in v for v in res["fused"]["3"].values())
