"""Move a reused segment's cached KV to new positions: fused copy-and-rotate over the paged pool.

Keys are cached post-RoPE (neox / rotate_half: pair i couples dims i and i + D/2 and
turns by `pos * inv_freq[i]`). A reused text segment's KV was computed at positions
p..p+L-1 and must sit at p'..p'+L-1 in the new sequence. Each pair's RoPE is a 2-D
rotation R(a) by a = pos * inv_freq[i], and rotations compose: R(p') = R(p' - p) R(p).
So the cached key R(p) k is realigned exactly (up to rounding) by one rotation by the
*delta* p' - p, without ever recovering the pre-RoPE k:

    x1' = x1 * cos(d * f) - x2 * sin(d * f)        d = p' - p (any sign), f = inv_freq[i]
    x2' = x2 * cos(d * f) + x1 * sin(d * f)

Values carry no position and are copied bit for bit. Llama3 rope scaling only
reshapes inv_freq (no attention-magnitude factor), so passing the scaled inv_freq
(`sparsetune.engine.rope.inv_frequencies`) is all it takes; the same holds for
any scaling that is a pure frequency change.

Precondition (not checked: it would need a host sync): the destination slots are
distinct and no destination slot is also a source slot. Programs read sources
and write destinations in no particular order, so an overlap would race. Slot
s is `block * block_size + offset`, the engine's flat slot.

`realign_kv` (Triton) and `realign_kv_ref` (torch, the engine's CPU path) share
one signature and both update the pools in place.

Kernel design (memory bound: it reads K and V and writes K and V, 4 * L * T * H * D
elements, so the only goal is to stream those bytes at HBM speed):

* grid = (cdiv(T, BLOCK_T), layer groups). A program owns BLOCK_T tokens x all KV
  heads for a run of consecutive layers: the slots, deltas and the cos/sin tile are
  loaded / computed once and reused for every layer and head it moves, so the
  transcendental work is amortised over H x layers-per-program rows and is never
  on the critical path. cos/sin come from delta * inv_freq in registers (no table
  reads, so any delta works, negative included).
* Per layer a program moves [BLOCK_T, H, D] of K and of V as two [BLOCK_T, H, D/2]
  halves each; every token row is D contiguous elements (D * 2 bytes in bf16), so the
  loads and stores are full-width vector accesses along head_dim and the row
  addresses are 16-element aligned (the strides are multiples of 16).
* BLOCK_T * H_pad * D ~ 4096 elements per tensor per layer with 4 warps keeps each
  thread at ~32 K + 32 V elements in flight, small enough for high occupancy; the
  layer groups are sized so that the grid has ~16K programs (many waves, small
  tail), which also leaves more than enough programs for short segments.
* fp32 math, one round-to-nearest-even store in the pool dtype; V never leaves its
  dtype. All indices are int64 (a pool easily exceeds 2^31 elements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsetune.kernels.fused_ops import _INTERPRET, _check_gpu_or_interpret, cast_rtne, rotate_pairs

__all__ = ["realign_kv", "realign_kv_ref"]

# Elements of one [BLOCK_T, H_pad, D] tile per tensor, and the grid size the layer
# grouping aims for (~120 waves of 132 SMs at 1 program each; many more resident).
_TILE_ELEMS = 4096
_TARGET_PROGRAMS = 16384


@triton.jit
def _realign_kv_kernel(
    k_ptr, v_ptr, src_ptr, dst_ptr, delta_ptr, inv_freq_ptr,
    num_tokens, num_layers, layers_per_prog,
    stride_l, stride_b, stride_h, stride_t,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < num_tokens
    src = tl.load(src_ptr + t, mask=t_mask, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + t, mask=t_mask, other=0).to(tl.int64)
    # |delta| < 2^24, so the conversion is exact and the angle is one fp32 product,
    # rounded exactly like the engine's cos/sin table (pos * inv_freq in fp32).
    delta = tl.load(delta_ptr + t, mask=t_mask, other=0).to(tl.float32)

    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HALF)
    # [BLOCK_T, HEADS_PAD, 1] row offsets within one layer; BLOCK_SIZE is a power of two
    # so // and % are shifts.
    src_row = ((src // BLOCK_SIZE) * stride_b + (src % BLOCK_SIZE) * stride_t)[:, None, None]
    dst_row = ((dst // BLOCK_SIZE) * stride_b + (dst % BLOCK_SIZE) * stride_t)[:, None, None]
    head_off = (h.to(tl.int64) * stride_h)[None, :, None]
    src_off = src_row + head_off + d[None, None, :]
    dst_off = dst_row + head_off + d[None, None, :]
    # The mask is constant along head_dim, so it does not stop vectorisation.
    mask = t_mask[:, None, None] & (h < NUM_HEADS)[None, :, None]

    freq = tl.load(inv_freq_ptr + d)
    angle = delta[:, None, None] * freq[None, None, :]  # [BLOCK_T, 1, HALF]
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    dtype = k_ptr.dtype.element_ty

    # int64 loop bounds make `layer * stride_l` int64 (one layer can exceed 2^31 / L elements).
    l_start = tl.program_id(1).to(tl.int64) * layers_per_prog
    l_end = tl.minimum(l_start + layers_per_prog, num_layers)
    for layer in range(l_start, l_end):
        base = layer * stride_l
        x1 = tl.load(k_ptr + base + src_off, mask=mask, eviction_policy="evict_first").to(tl.float32)
        x2 = tl.load(k_ptr + base + src_off + HALF, mask=mask, eviction_policy="evict_first").to(tl.float32)
        v1 = tl.load(v_ptr + base + src_off, mask=mask, eviction_policy="evict_first")
        v2 = tl.load(v_ptr + base + src_off + HALF, mask=mask, eviction_policy="evict_first")
        tl.store(k_ptr + base + dst_off, cast_rtne(x1 * cos - x2 * sin, dtype, EMULATE_BF16), mask=mask)
        tl.store(k_ptr + base + dst_off + HALF, cast_rtne(x2 * cos + x1 * sin, dtype, EMULATE_BF16), mask=mask)
        tl.store(v_ptr + base + dst_off, v1, mask=mask)
        tl.store(v_ptr + base + dst_off + HALF, v2, mask=mask)


def _check_args(
    k_pool: torch.Tensor, v_pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
    delta: torch.Tensor, inv_freq: torch.Tensor,
) -> None:
    if k_pool.dim() != 5 or v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ValueError(
            f"realign_kv: k/v pools must be [L, B+1, H, bs, D] of one shape and dtype, got "
            f"{tuple(k_pool.shape)} {k_pool.dtype} / {tuple(v_pool.shape)} {v_pool.dtype}"
        )
    head_dim = k_pool.shape[-1]
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"realign_kv: head_dim must be a power of two, got {head_dim}")
    n = src_slots.shape[0] if src_slots.dim() == 1 else -1
    if n < 0 or dst_slots.shape != (n,) or delta.shape != (n,):
        raise ValueError(
            f"realign_kv: src_slots {tuple(src_slots.shape)}, dst_slots {tuple(dst_slots.shape)} and "
            f"delta {tuple(delta.shape)} must all be [T]"
        )
    if inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"realign_kv: inv_freq shape {tuple(inv_freq.shape)} != ({head_dim // 2},)")


def _layers_per_program(num_tokens: int, num_layers: int, block_t: int, target: int) -> int:
    """Consecutive layers per program: as many as keep the grid near `target` programs,
    balanced so that every group gets (almost) the same number of layers."""
    t_blocks = triton.cdiv(num_tokens, block_t)
    per = min(num_layers, max(1, triton.cdiv(num_layers * t_blocks, target)))
    return triton.cdiv(num_layers, triton.cdiv(num_layers, per))


def _launch(
    k_pool: torch.Tensor, v_pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
    delta: torch.Tensor, inv_freq: torch.Tensor, layers_per_program: int | None = None,
) -> None:
    _check_gpu_or_interpret(k_pool, "realign_kv")
    _check_args(k_pool, v_pool, src_slots, dst_slots, delta, inv_freq)
    if k_pool.stride(-1) != 1 or k_pool.stride() != v_pool.stride():
        raise ValueError("realign_kv needs a contiguous head_dim and identically laid out K/V pools")
    num_layers, _, heads, block_size, head_dim = k_pool.shape
    n = src_slots.shape[0]
    if n == 0 or num_layers == 0:
        return
    if block_size & (block_size - 1):
        raise ValueError(f"realign_kv: block_size must be a power of two, got {block_size}")
    heads_pad = triton.next_power_of_2(heads)
    block_t = min(max(1, _TILE_ELEMS // (heads_pad * head_dim)), triton.next_power_of_2(n))
    lpp = layers_per_program or _layers_per_program(n, num_layers, block_t, _TARGET_PROGRAMS)
    grid = (triton.cdiv(n, block_t), triton.cdiv(num_layers, lpp))
    _realign_kv_kernel[grid](
        k_pool, v_pool, src_slots.contiguous(), dst_slots.contiguous(), delta.contiguous(),
        inv_freq.to(device=k_pool.device, dtype=torch.float32).contiguous(),
        n, num_layers, lpp,
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), k_pool.stride(3),
        NUM_HEADS=heads, HEADS_PAD=heads_pad, HALF=head_dim // 2, BLOCK_SIZE=block_size,
        BLOCK_T=block_t, EMULATE_BF16=_INTERPRET, num_warps=4,
    )


def realign_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
) -> None:
    """For every layer, KV head and token t, IN PLACE: K[dst[t]] = R(delta[t]) K[src[t]], V[dst[t]] = V[src[t]].

    k_pool, v_pool: the whole paged pools `[L, B+1, H, bs, D]` (fp32 / bf16 / fp16, D a
    power of two, head_dim contiguous). src_slots, dst_slots: `[T]` integer flat slots
    (`block * bs + offset`), destinations distinct and disjoint from the sources.
    delta: `[T]` integer position deltas p_new - p_old (any sign). inv_freq: `[D/2]`
    (scaled if the model scales RoPE). Math in fp32, one rounding to the pool dtype.
    Reads no tensor values on the host (CUDA-graph capturable).
    """
    _launch(k_pool, v_pool, src_slots, dst_slots, delta, inv_freq)


def realign_kv_ref(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
) -> None:
    """Torch twin of `realign_kv` (in place). Computes in fp32, or in fp64 for fp64 pools
    (angles included, given an fp64 inv_freq), which is what makes it a tight reference."""
    _check_args(k_pool, v_pool, src_slots, dst_slots, delta, inv_freq)
    block_size = k_pool.shape[3]
    cdt = torch.float64 if k_pool.dtype == torch.float64 else torch.float32
    angle = delta.to(cdt)[:, None] * inv_freq.to(device=k_pool.device, dtype=cdt)[None, :]
    cos, sin = angle.cos()[:, None, None], angle.sin()[:, None, None]  # [T, 1, 1, D/2]
    src, dst = src_slots.long(), dst_slots.long()
    src_b, src_o, dst_b, dst_o = src // block_size, src % block_size, dst // block_size, dst % block_size
    # [B+1, bs, L, H, D] views: indexing (block, offset) yields [T, L, H, D] and writes through.
    kt, vt = k_pool.permute(1, 3, 0, 2, 4), v_pool.permute(1, 3, 0, 2, 4)
    k = kt[src_b, src_o].to(cdt)
    v = vt[src_b, src_o]  # gathered (copied) before any write: no aliasing even if misused
    kt[dst_b, dst_o] = rotate_pairs(k, cos, sin).to(k_pool.dtype)
    vt[dst_b, dst_o] = v
