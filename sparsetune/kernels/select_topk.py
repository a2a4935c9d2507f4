"""Per-row top-k selection of KV blocks on device: a Triton radix select + its torch twin.

`select_topk(scores [R, W] fp32, counts [R] int32, k_max) -> [R, k_max] int32`: row r keeps
the indices of its `counts[r]` largest scores (ties: the lower index wins), written in
ascending index order into `out[r, :counts[r]]`; the rest of the row is 0. The sparse decode
kernel reads only the first `counts[r]` entries, so neither score order nor padding matters.

Why not `torch.topk`: it sorts (a radix sort plus a gather, ~28 µs per layer for 128 rows of
2K blocks on an H200) while the selection needs only the set. Here one program owns one row,
holds its scores in registers as uint32 keys with the floats' order (negative floats flip every
bit, the others set the sign bit, so ±inf work as never-kept / always-kept markers), and finds
the k-th largest key from the top, one bit per counting pass over registers (no memory traffic),
then writes the winners with a prefix sum. (A 16-bin histogram per 4 bits measured no faster at
2K-wide rows and 2.5x slower at 16K: `bench_indexer.py --topk-block-sizes`, BENCHMARKS.md.)
Nothing is read on the host: the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsetune.kernels.limits import TOPK_MAX_WIDTH

__all__ = ["select_topk", "select_topk_ref", "MAX_WIDTH"]

_INTERPRET: bool = bool(triton.knobs.runtime.interpret)
MAX_WIDTH = TOPK_MAX_WIDTH  # wider rows use the twin (torch)
NUM_WARPS = 0  # 0: by row width
PASS_BITS = 1  # key bits per counting pass: 1 (measured) or 2 (one packed sum; bench_indexer.py --topk-block-sizes)


@triton.jit
def _keys(scores, stride_s, r, offs, W):
    """Row r's scores at `offs` as uint32 keys with the floats' order (negative floats flip every
    bit, the others set the sign bit; -0.0 is +0.0 first); past the row: 0, at or below everything
    (it is never counted: `valid` masks it). Scores are never NaN (the indexers map NaN to a finite
    floor, `flow.stages`)."""
    valid = offs < W
    bits = tl.load(scores + r * stride_s + offs, mask=valid, other=0.0).to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 ties with +0.0
    key = tl.where(bits < 0, ~bits, bits | -2147483648).to(tl.uint32, bitcast=True)
    return tl.where(valid, key, 0), valid


@triton.jit
def _packed(key, c1, c2, c3):
    """Per key, whether it is at or above each of three candidates, as one int64 (21 bits each)."""
    return (key >= c1).to(tl.int64) + ((key >= c2).to(tl.int64) << 21) + ((key >= c3).to(tl.int64) << 42)


@triton.jit
def _select_topk_kernel(
    scores, counts, out, W, K, stride_s, stride_o, K_PAD: tl.constexpr, MAIN: tl.constexpr, TAIL: tl.constexpr,
    PASS_BITS: tl.constexpr,
):
    # The row is held as a power-of-two main tile plus a small tail tile, so a width just past a
    # power of two (the engine's 2058 blocks) costs 2048 + 16 lanes, not 4096.
    r = tl.program_id(0)
    offs = tl.arange(0, MAIN)
    offs2 = MAIN + tl.arange(0, TAIL)
    key, valid = _keys(scores, stride_s, r, offs, W)
    key2, valid2 = _keys(scores, stride_s, r, offs2, W)
    k = tl.load(counts + r)
    # Find t, the k-th largest key, from the top: a 1-bit pass keeps the bit if at least k keys are
    # at or above t with it set. Every array op is 1-D over the row's own layout (the kernel before,
    # int64 keys and 2 bits per pass over a [4, W] broadcast, was 1.3-1.5x slower). A pass costs
    # its reductions over the row (two: the main tile and the tail), so PASS_BITS 2 counts the three
    # candidates of a 2-bit digit in one int64 sum (21 bits each), halving the reductions.
    t = tl.zeros([], dtype=tl.uint32)
    one = tl.full([], 1, dtype=tl.uint32)
    if PASS_BITS == 1:
        for i in tl.static_range(32):
            cand = t | (one << (31 - i))
            n = tl.sum((key >= cand).to(tl.int32), axis=0) + tl.sum((key2 >= cand).to(tl.int32), axis=0)
            t = tl.where(n >= k, cand, t)
    else:
        for i in tl.static_range(16):
            shift = 30 - 2 * i
            c1, c2, c3 = t | (one << shift), t | ((one + one) << shift), t | ((one + one + one) << shift)
            n = tl.sum(_packed(key, c1, c2, c3), axis=0) + tl.sum(_packed(key2, c1, c2, c3), axis=0)
            digit = (((n & 0x1FFFFF) >= k).to(tl.uint32) + (((n >> 21) & 0x1FFFFF) >= k).to(tl.uint32)
                     + ((n >> 42) >= k).to(tl.uint32))  # the counts fall with the candidate: a prefix passes
            t = t | (digit << shift)
    # t is now the k-th largest key: take everything above it, then ties in index order.
    above, above2 = key > t, key2 > t
    tie, tie2 = (valid & (key == t)).to(tl.int32), (valid2 & (key2 == t)).to(tl.int32)
    room = k - tl.sum(above.to(tl.int32), axis=0) - tl.sum(above2.to(tl.int32), axis=0)
    take = above | ((tie > 0) & (tl.cumsum(tie, axis=0) <= room))
    take2 = above2 | ((tie2 > 0) & (tl.sum(tie, axis=0) + tl.cumsum(tie2, axis=0) <= room))
    pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
    pos2 = tl.sum(take.to(tl.int32), axis=0) + tl.cumsum(take2.to(tl.int32), axis=0) - 1
    tl.store(out + r * stride_o + pos, offs, mask=take)
    tl.store(out + r * stride_o + pos2, offs2, mask=take2)
    slot = tl.arange(0, K_PAD)
    tl.store(out + r * stride_o + slot, tl.zeros([K_PAD], dtype=tl.int32), mask=(slot >= k) & (slot < K))


def select_topk(scores: torch.Tensor, counts: torch.Tensor, k_max: int) -> torch.Tensor:
    """Triton path (CUDA, or CPU under TRITON_INTERPRET=1); rows wider than MAX_WIDTH use the twin."""
    if scores.dim() != 2 or counts.shape != scores.shape[:1]:
        raise ValueError(f"scores must be [R, W] and counts [R], got {tuple(scores.shape)} / {tuple(counts.shape)}")
    rows, width = scores.shape
    if width > MAX_WIDTH or k_max > width:
        return select_topk_ref(scores, counts, k_max)
    if scores.device.type != "cuda" and not _INTERPRET:
        raise RuntimeError("select_topk needs CUDA tensors (or TRITON_INTERPRET=1); use select_topk_ref on CPU")
    scores = scores.float()
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    out = torch.empty(rows, k_max, dtype=torch.int32, device=scores.device)
    main = 1 << (width.bit_length() - 1)  # the largest power of two <= width
    tail = triton.next_power_of_2(max(1, width - main))
    _select_topk_kernel[(rows,)](
        scores, counts.to(torch.int32).contiguous(), out, width, k_max, scores.stride(0), out.stride(0),
        K_PAD=triton.next_power_of_2(k_max), MAIN=main, TAIL=tail, PASS_BITS=PASS_BITS,
        num_warps=NUM_WARPS or (4 if main <= 1024 else 8 if main <= 8192 else 16 if main <= 16384 else 32),
    )
    return out


def select_topk_ref(scores: torch.Tensor, counts: torch.Tensor, k_max: int) -> torch.Tensor:
    """Torch twin with the same output: the selected indices ascending, then zeros."""
    rows, width = scores.shape
    order = torch.sort(scores.float(), dim=1, descending=True, stable=True).indices  # ties: lower index first
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(width, device=scores.device).expand(rows, width))
    take = rank < counts.long()[:, None]
    # Winners go to their rank among winners (ascending index); the others to a spare column.
    pos = torch.where(take, take.long().cumsum(1) - 1, width)
    out = torch.zeros(rows, width + 1, dtype=torch.int32, device=scores.device)
    out.scatter_(1, pos, torch.arange(width, device=scores.device, dtype=torch.int32).expand(rows, width).contiguous())
    return out[:, :k_max].contiguous()
