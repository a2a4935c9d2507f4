"""Write new tokens' K and V into the paged pool: a Triton kernel and its torch twin.

One program per token moves its `kv_heads x head_dim` K and V rows to
`cache[slot // block_size, head, slot % block_size, :]`: 2 x 2 x heads x dim bytes,
so a 32K-token prefill writes at bandwidth instead of through `index_put`'s
generic indexing path, and a decode step stores K and V in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cb, stride_ch, stride_ct,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < NUM_KV_HEADS
    dst = blk * stride_cb + h * stride_ch + off * stride_ct + d
    k = tl.load(k_ptr + n * stride_kn + h * stride_kh + d, mask=mask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + n * stride_vn + h * stride_vh + d, mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v `[N, Hkv, D]` (last dim contiguous) → caches `[num_blocks, Hkv, block_size, D]` at flat `slots [N]`."""
    n, heads, dim = k.shape
    if v.shape != k.shape or slots.shape != (n,):
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)} and slots {tuple(slots.shape)} disagree")
    if n == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("store_kv needs contiguous last dims and identically laid out K/V caches")
    _store_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), HEAD_DIM=dim, BLOCK_SIZE=k_cache.shape[2],
        num_warps=4 if heads * dim >= 1024 else 1,
    )


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    block_size = k_cache.shape[2]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v.to(v_cache.dtype)
