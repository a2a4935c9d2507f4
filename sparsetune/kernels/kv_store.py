"""K and V in and out of the paged pool: Triton kernels and their torch twins.

`store_kv`: one program per token moves its `kv_heads x head_dim` K and V rows to
`cache[slot // block_size, head, slot % block_size, :]`: 2 x 2 x heads x dim bytes,
so a 32K-token prefill writes at bandwidth instead of through `index_put`'s
generic indexing path, and a decode step stores K and V in one launch.
`gather_kv`: one sequence's pages out of the pool as contiguous `[kv_heads, T, head_dim]` K and
V, one program per run of pages of one head (a page of one head is one contiguous run in the
pool), K and V in one launch: at copy bandwidth where `index_select` moves these 4 KB runs at
about a third of it (H100, #18).
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


@triton.jit
def _gather_kv_kernel(
    kc_ptr, vc_ptr, ids_ptr, ko_ptr, vo_ptr, length, num_pages,
    stride_cb, stride_ch, stride_ct, stride_oh, stride_ot,
    PAGES: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):
    h = tl.program_id(1).to(tl.int64)
    page = tl.program_id(0) * PAGES + tl.arange(0, PAGES)
    blk = tl.load(ids_ptr + page, mask=page < num_pages, other=0).to(tl.int64)[:, None, None]
    t = tl.arange(0, BLOCK_SIZE)[None, :, None]
    d = tl.arange(0, DIM_PAD)[None, None, :]
    tok = page.to(tl.int64)[:, None, None] * BLOCK_SIZE + t
    mask = (tok < length) & (d < HEAD_DIM)
    src = blk * stride_cb + h * stride_ch + t * stride_ct + d
    dst = h * stride_oh + tok * stride_ot + d
    tl.store(ko_ptr + dst, tl.load(kc_ptr + src, mask=mask), mask=mask)
    tl.store(vo_ptr + dst, tl.load(vc_ptr + src, mask=mask), mask=mask)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, ids: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages `ids` (in order) of caches `[num_blocks, Hkv, block_size, D]` → the sequence's first
    `length` tokens as contiguous K and V `[Hkv, length, D]`."""
    _, heads, bs, dim = k_cache.shape
    if (k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype or k_cache.stride() != v_cache.stride()
            or k_cache.stride(-1) != 1 or bs & (bs - 1) or ids.numel() * bs < length):
        raise ValueError(f"gather_kv: {ids.numel()} pages of {bs} (a power of two) for {length} tokens, and K and V "
                         "caches of one shape, dtype and layout, last dim contiguous")
    ko = torch.empty(heads, length, dim, dtype=k_cache.dtype, device=k_cache.device)
    vo = torch.empty_like(ko)
    if length == 0:
        return ko, vo
    pages = triton.next_power_of_2(max(1, 8192 // (bs * dim)))  # ~16 KB of bf16 per program and tensor
    _gather_kv_kernel[(triton.cdiv(ids.numel(), pages), heads)](
        k_cache, v_cache, ids.contiguous(), ko, vo, length, ids.numel(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), ko.stride(0), ko.stride(1),
        PAGES=pages, BLOCK_SIZE=bs, HEAD_DIM=dim, DIM_PAD=triton.next_power_of_2(dim),
        num_warps=4,
    )
    return ko, vo


def gather_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, ids: torch.Tensor,
                  length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin: one index_select along the blocks of the head-major view each (the result
    comes out head-major; a view, not contiguous, past `length`)."""
    def one(cache: torch.Tensor) -> torch.Tensor:
        h, bs, d = cache.shape[1:]
        return torch.index_select(cache.transpose(0, 1), 1, ids).view(h, ids.numel() * bs, d)[:, :length]

    return one(k_cache), one(v_cache)
