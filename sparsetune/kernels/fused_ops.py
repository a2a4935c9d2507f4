"""Small fused per-layer Triton kernels, each with a torch reference twin (`*_ref`).

The engine calls the Triton versions on CUDA and the `*_ref` versions on CPU; a
pair has identical signatures and semantics (including which arguments are
modified in place). Rounding follows HF transformers' Llama/Qwen3 modules so the
fp32 paths agree with HF to the last bit in the reference twins, and to
reduction-order noise in the kernels:

* rms_norm:      h = x.float(); h = h * rsqrt(mean(h^2) + eps); out = weight * h.to(x.dtype)
                 (with a residual, x := (x + residual) rounded to x.dtype first).
* silu_and_mul:  out = silu(gate) * up, silu rounded to the dtype before the product
                 (as HF's act_fn(gate_proj(x)) * up_proj(x) does).
* apply_rope:    neox / rotate_half style, computed in fp32, rounded once.

None of the Triton wrappers reads tensor values on the host, so all of them can
be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "rms_norm",
    "rms_norm_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "apply_rope",
    "apply_rope_ref",
    "qk_norm_rope",
    "qk_norm_rope_ref",
    "cast_rtne",
]

_INTERPRET: bool = bool(triton.knobs.runtime.interpret)


@triton.jit
def cast_rtne(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """`x.to(dtype)` with round-to-nearest-even, as the GPU does.

    The Triton interpreter truncates fp32 -> bf16 (round toward zero), which would
    make interpreted bf16 results biased and unlike the GPU's. With EMULATE_BF16
    (set only when interpreting) the value is first rounded to the nearest bf16
    with integer ops, so the interpreter's truncating cast becomes exact. On the
    GPU path EMULATE_BF16 is False and this is a plain cast.
    """
    if EMULATE_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        bits = (bits >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def _check_gpu_or_interpret(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cuda" and not _INTERPRET:
        raise RuntimeError(f"{name} needs CUDA tensors (or TRITON_INTERPRET=1); use {name}_ref on CPU")


def _rows_warps(block: int) -> int:
    # ~512 elements per warp: 8 warps for a 4096-wide row, 16 for 8192+.
    return int(min(16, max(1, block // 512)))


# --------------------------------------------------------------------------- #
# RMSNorm (optionally fused with the residual add)
# --------------------------------------------------------------------------- #


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    res_ptr,
    res_out_ptr,
    stride_x,
    stride_o,
    stride_r,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dtype = x_ptr.dtype.element_ty

    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the activation dtype before normalising, exactly
        # like HF's `hidden = residual + hidden` in bf16 followed by the norm.
        s = cast_rtne(x + r, dtype, EMULATE_BF16)
        tl.store(res_out_ptr + row * stride_ro + offs, s, mask=mask)
        x = s.to(tl.float32)

    var = tl.sum(x * x, axis=0) / n_cols
    y = cast_rtne(x * tl.rsqrt(var + eps), dtype, EMULATE_BF16)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = cast_rtne(w * y.to(tl.float32), out_ptr.dtype.element_ty, EMULATE_BF16)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x [N, H] (any leading dims are flattened).

    Returns `out` if residual is None, else `(out, new_residual)` with
    new_residual = x + residual (fp32 add, stored in x.dtype) and
    out = rmsnorm(new_residual) * weight. Inputs are not modified; outputs are
    new tensors in x.dtype.
    """
    _check_gpu_or_interpret(x, "rms_norm")
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({hidden},)")
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    out = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(hidden)
    if block > 65536:
        raise ValueError(f"hidden size {hidden} too large for the single-tile rms_norm kernel")
    weight = weight.contiguous()

    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        new_res = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device)
        r_args = (r2, new_res, r2.stride(0), new_res.stride(0))
    else:
        r_args = (x2, out, 0, 0)  # placeholders, never touched

    if n_rows > 0:
        _rms_norm_kernel[(n_rows,)](
            x2,
            weight,
            out,
            r_args[0],
            r_args[1],
            x2.stride(0),
            out.stride(0),
            r_args[2],
            r_args[3],
            hidden,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            EMULATE_BF16=_INTERPRET,
            num_warps=_rows_warps(block),
        )
    out = out.view(x.shape)
    if residual is None:
        return out
    return out, new_res.view(x.shape)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of `rms_norm`; follows HF LlamaRMSNorm's operation order exactly."""
    dtype = x.dtype
    if residual is not None:
        x = (x.float() + residual.float()).to(dtype)
    h = x.float()
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    out = (weight * h.to(dtype)).to(dtype)
    if residual is None:
        return out
    return out, x


# --------------------------------------------------------------------------- #
# SiLU-and-multiply (gated MLP activation)
# --------------------------------------------------------------------------- #


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    dtype = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = cast_rtne(g / (1.0 + tl.exp(-g)), dtype, EMULATE_BF16).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, cast_rtne(act * u, dtype, EMULATE_BF16), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*I] = concat(gate, up) -> silu(gate) * up, [..., I] in x.dtype (new tensor)."""
    _check_gpu_or_interpret(x, "silu_and_mul")
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"last dim must be even, got {two_i}")
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    out = torch.empty((n_rows, inter), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(max(inter, 16)))
    if n_rows > 0 and inter > 0:
        _silu_and_mul_kernel[(n_rows, triton.cdiv(inter, block))](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            inter,
            BLOCK=block,
            EMULATE_BF16=_INTERPRET,
            num_warps=4,
        )
    return out.view(*x.shape[:-1], inter)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch twin of `silu_and_mul` (HF rounding order: silu in dtype, then product)."""
    inter = x.shape[-1] // 2
    gate, up = x[..., :inter], x[..., inter:]
    return torch.nn.functional.silu(gate) * up


# --------------------------------------------------------------------------- #
# RoPE (neox / rotate_half), optionally preceded by per-head q/k RMSNorm (Qwen3)
# --------------------------------------------------------------------------- #


@triton.jit
def _rope_heads(
    x_ptr,
    stride_h,
    w_ptr,
    cos,
    sin,
    eps,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """Rotate (and optionally RMS-normalise) every head of one token, in place."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < NUM_HEADS)[:, None]
    dtype = x_ptr.dtype.element_ty
    p1 = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        # Per-head RMSNorm with the same roundings as the unfused
        # rms_norm -> apply_rope sequence (normed value and weight product both
        # rounded to the activation dtype).
        ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        rstd = tl.rsqrt(ms + eps)[:, None]
        w1 = tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d).to(tl.float32)[None, :]
        x1 = cast_rtne(x1 * rstd, dtype, EMULATE_BF16).to(tl.float32)
        x2 = cast_rtne(x2 * rstd, dtype, EMULATE_BF16).to(tl.float32)
        x1 = cast_rtne(w1 * x1, dtype, EMULATE_BF16).to(tl.float32)
        x2 = cast_rtne(w2 * x2, dtype, EMULATE_BF16).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    tl.store(p1, cast_rtne(o1, dtype, EMULATE_BF16), mask=mask)
    tl.store(p2, cast_rtne(o2, dtype, EMULATE_BF16), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    qw_ptr,
    kw_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    # One program per token: cos/sin are loaded once and shared by all q and k heads.
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_d)[None, :]
    _rope_heads(
        q_ptr + tok * stride_qt, stride_qh, qw_ptr, cos, sin, eps,
        NUM_Q_HEADS, Q_HEADS_PAD, HALF, NORM, EMULATE_BF16,
    )
    _rope_heads(
        k_ptr + tok * stride_kt, stride_kh, kw_ptr, cos, sin, eps,
        NUM_K_HEADS, K_HEADS_PAD, HALF, NORM, EMULATE_BF16,
    )


def _launch_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_gpu_or_interpret(q, "apply_rope")
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [N, Hq, D] / k [N, Hkv, D] expected, got {tuple(q.shape)} / {tuple(k.shape)}")
    n_tok, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.dtype != torch.float32:
        raise ValueError(
            f"cos_sin_cache must be fp32 [max_pos, {head_dim}], got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}"
        )
    if positions.shape != (n_tok,):
        raise ValueError(f"positions shape {tuple(positions.shape)} != ({n_tok},)")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k and cos_sin_cache need a contiguous last dim (they are updated in place)")
    norm = q_weight is not None
    if norm:
        assert k_weight is not None
        if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,):
            raise ValueError("q_weight / k_weight must be [head_dim]")
        q_weight = q_weight.contiguous()
        k_weight = k_weight.contiguous()
    else:
        q_weight = k_weight = cos_sin_cache  # placeholders, never read
    positions = positions.contiguous()
    if n_tok > 0:
        _rope_kernel[(n_tok,)](
            q,
            k,
            positions,
            cos_sin_cache,
            q_weight,
            k_weight,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos_sin_cache.stride(0),
            float(eps),
            NUM_Q_HEADS=num_q_heads,
            Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
            NUM_K_HEADS=num_k_heads,
            K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
            HALF=head_dim // 2,
            NORM=norm,
            EMULATE_BF16=_INTERPRET,
            num_warps=4,
        )
    return q, k


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE applied IN PLACE to q [N, Hq, D] and k [N, Hkv, D]; returns (q, k).

    cos_sin_cache is fp32 [max_pos, D]: cos in columns [:D/2], sin in [D/2:].
    q and k may be strided views (e.g. slices of a fused qkv projection) as long
    as their last dim is contiguous. Math in fp32, one rounding to the dtype.
    """
    return _launch_rope(q, k, positions, cos_sin_cache, None, None, 0.0)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation (rotate_half / neox pairs: dim i with dim i + D/2) of `x` by angles with these cos/sin."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of `apply_rope` (also in place; returns (q, k))."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]  # [N, D]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    for x in (q, k):
        x.copy_(rotate_pairs(x.float(), cos, sin))
    return q, k


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3 attention prologue, IN PLACE: per-head RMSNorm (weights [D]) then RoPE.

    Equivalent to `rms_norm` on every head of q (with q_weight) and k (with
    k_weight) followed by `apply_rope`, in one pass over q and k. Returns (q, k).
    """
    return _launch_rope(q, k, positions, cos_sin_cache, q_weight, k_weight, eps)


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of `qk_norm_rope` (in place; returns (q, k))."""
    q.copy_(rms_norm_ref(q, q_weight, eps))
    k.copy_(rms_norm_ref(k, k_weight, eps))
    return apply_rope_ref(q, k, positions, cos_sin_cache)
