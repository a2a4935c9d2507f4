"""Paged-KV decode attention: flash-decoding (split-K) Triton kernels + torch reference.

KV cache layout (per layer), shared with the engine:
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    (HND inside a block: one head's block is a contiguous block_size*head_dim run)
    block_tables:     int32 [batch, max_blocks_per_seq]; token t of sequence b lives
                      at block block_tables[b, t // block_size], slot t % block_size.
                      Entries past ceil(seq_len / block_size) are garbage and are
                      never dereferenced.
    seq_lens:         int32 [batch], number of valid KV tokens (0 = padding row).

Design of the Triton path (decode is memory bound: the goal is to stream every KV
byte exactly once at close to HBM bandwidth):

* Stage 1 (`_paged_decode_split_kernel`), grid (batch * num_kv_heads, num_splits).
  One program owns one (sequence, kv head, split) and ALL the query heads of that
  kv head's GQA group, so K/V are read once per group, never once per query head.
  The group is padded to >= 16 rows because `tl.dot` needs every dim >= 16 on
  real GPUs; the padding costs tensor-core FLOPs, which are free here, and no
  memory traffic. Each loop iteration gathers BLOCK_N tokens (spanning several
  cache blocks when block_size < BLOCK_N) and runs an online (base-2) softmax.
  The split boundaries are computed in-kernel from the *actual* seq_len, so a
  short sequence in a wide block table still spreads evenly over the splits.
  Two loop flavours: the default plain loop, which Triton's pipeliner (num_stages
  >= 3) turns into async copies with the block-id lookup prefetched, and
  `prefetch=True`, a hand-pipelined loop that requests the next K/V tile into
  registers before consuming the current one (use with num_stages=1). Which is
  faster on a given GPU is for benchmarks/bench_kernels.py to say.
* Stage 2 (`_merge_splits_kernel`), grid (num_q_heads, batch): log-sum-exp merge
  of the per-split partial outputs. Skipped when num_splits == 1 (stage 1 then
  writes the normalised output directly).
* Block-sparse decode (`sparse_paged_decode_attention`) is the same two stages
  with the stage-1 constexpr SPARSE=True (the dense specialisation compiles to
  exactly the code it had before the flag existed). Each (sequence, kv head)
  attends over its selected logical blocks sel_blocks[b, h, :sel_counts[b, h]]:
  the index space j in [0, count * block_size) is split like a dense sequence;
  token j lives in logical block sel_blocks[b, h, j // block_size], offset
  j % block_size, i.e. cache block block_tables[b, that block], and counts if
  its position is < seq_len (the last block may be partial). The lookup is one
  more gather than dense (selection -> block table -> cache); a tile may then
  hold no valid token, which the online softmax tolerates (EMPTY_SAFE).

Everything the host decides (num_splits, tile sizes, grid) depends on tensor
SHAPES only and nothing reads tensor values on the host, so the call can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_ops import cast_rtne
from .limits import DEFAULT_NUM_SMS, num_sms

__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "sparse_paged_decode_attention",
    "sparse_paged_decode_attention_ref",
    "choose_num_splits",
    "DEFAULT_NUM_SMS",
]

# Target number of stage-1 programs per SM. All programs of a launch have about
# the same length, so they retire in lock-step waves of (SMs x resident programs,
# ~3-5 per SM here); many short programs (~8 waves) keep the idle tail of the
# last wave small. The price is the fp32 partial output of every split, which
# is D*4 bytes per (query head, split) against 2*D*2 bytes per (kv head, token)
# of KV: with >= 512 tokens per split that is ~1-2% extra traffic.
# Measured on an H200 (BENCHMARKS.md): half the splits of a 32-per-SM target ran
# 3% faster at 8x32K, 16x16K and 64x4K, so the target is 16.
_TARGET_PROGRAMS_PER_SM = 16
# Below this many tokens per split the fixed per-program cost (q load, pipeline
# prologue, partial store) stops being amortised.
_MIN_TOKENS_PER_SPLIT = 512
# Block-sparse rows are short (the budget, e.g. 2,048 tokens), so every program of a launch runs in
# one or two waves and its prologue (selection -> block table -> K/V, three dependent loads) is not
# hidden behind other programs. Measured on an H200 (BENCHMARKS.md, #17, `bench_decode_overhead.py`):
# about 4 programs per SM is fastest at batch 8 and 16 x 2,048 selected tokens (8 splits at batch 8:
# 24.9 us against 27.8 with the dense rule's 4; 1,024 programs were slower at both batches).
# Rounded down, that leaves rows between 2 and 4 per SM one split each: a wave of resident programs
# and a sliver of a second. Measured on an H100 (BENCHMARKS.md, #43, `bench_sparse_splits.py`): 424
# rows (Vortex's 53 sequences of Qwen3-1.7B) of 2,048 tokens ran 206 us at one split (72% of the
# byte floor) and 162 us at two (92%), 408 rows alike, so such rows get two (measured at 408 and 424
# rows; at 265-407 and 425-527 by the same wave arithmetic, not measured).
_SPARSE_PROGRAMS_PER_SM = 4
_SPARSE_MIN_TOKENS_PER_SPLIT = 128
# Bounds the merge kernel's per-program tile and the partial buffers.
_MAX_SPLITS = 64
_LOG2E = 1.4426950408889634

# The kernels are jitted when this module is imported; triton decides at that
# moment whether they run interpreted (TRITON_INTERPRET=1) or compiled.
_INTERPRET: bool = bool(triton.knobs.runtime.interpret)


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_blocks: int,
    block_size: int,
    num_sms: int = DEFAULT_NUM_SMS,
    sparse: bool = False,
) -> int:
    """Number of KV splits per (sequence, kv head); a pure function of shapes.

    Aims for about `_TARGET_PROGRAMS_PER_SM * num_sms` stage-1 programs (`sparse`: rows of
    selected blocks, `_SPARSE_PROGRAMS_PER_SM`, rounded down, and at least two splits while the
    rows alone are fewer than that), but never splits the widest
    possible row (max_blocks * block_size tokens) into pieces shorter than
    `_MIN_TOKENS_PER_SPLIT` (`_SPARSE_MIN_TOKENS_PER_SPLIT`). It must not depend on seq_lens
    (tensor values) so that a captured CUDA graph stays valid for any lengths.
    """
    pairs = max(1, batch * num_kv_heads)
    max_tokens = max(1, max_blocks * block_size)
    if sparse:
        target = _SPARSE_PROGRAMS_PER_SM * num_sms
        want = max(target // pairs, 2 if pairs < target else 1)
        cap = max_tokens // _SPARSE_MIN_TOKENS_PER_SPLIT
    else:
        want = triton.cdiv(_TARGET_PROGRAMS_PER_SM * num_sms, pairs)
        cap = max_tokens // _MIN_TOKENS_PER_SPLIT
    return int(max(1, min(want, cap, _MAX_SPLITS)))


def _default_block_n(head_dim: int, elem_size: int) -> int:
    # ~16 KiB per K (and per V) tile: 64 tokens for bf16/fp16 with head_dim 128,
    # which fits K+V tiles in shared memory with room for >= 3 resident programs
    # per SM (~100 registers/thread at 4 warps, per an sm_90 AOT compile). fp32
    # caches use an exact fp32 dot without tensor cores, whose register use grows
    # fast with the tile: 8 KiB (16 tokens at D=128) avoids spills there.
    # Never below 16 tokens (tl.dot minimum).
    tile_bytes = 16 * 1024 if elem_size <= 2 else 8 * 1024
    tokens = max(1, tile_bytes // (head_dim * elem_size))
    tokens = 1 << (tokens.bit_length() - 1)  # round down to a power of two
    return int(max(16, min(64, tokens)))


@triton.jit
def _load_block_ids(bt_row, tile_start, end, offs_n, BLOCK_SIZE: tl.constexpr):
    """Cache block of every token of the tile [tile_start, tile_start + BLOCK_N).

    Lanes at or past `end` are masked: they are never loaded, which is what keeps
    garbage block-table entries from being dereferenced (here or in the K/V load).
    """
    tok = tile_start + offs_n
    return tl.load(bt_row + tok // BLOCK_SIZE, mask=tok < end, other=0).to(tl.int64)


@triton.jit
def _load_kv_tile(
    k_head, v_head, blk, tile_start, end, offs_n, offs_d,
    stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE: tl.constexpr,
):
    """Gather the [BLOCK_N, HEAD_DIM] K and V tiles (zeros past `end`)."""
    tok = tile_start + offs_n
    valid = (tok < end)[:, None]
    slot = tok % BLOCK_SIZE
    k = tl.load(k_head + (blk * stride_kb + slot * stride_kt)[:, None] + offs_d[None, :], mask=valid, other=0.0)
    v = tl.load(v_head + (blk * stride_vb + slot * stride_vt)[:, None] + offs_d[None, :], mask=valid, other=0.0)
    return k, v


@triton.jit
def _gather_kv(k_head, v_head, blk, slot, valid, offs_d, stride_kb, stride_kt, stride_vb, stride_vt):
    """K and V rows (cache block `blk`, slot `slot`) of every lane; zeros where not `valid`."""
    mask = valid[:, None]
    k = tl.load(k_head + (blk * stride_kb + slot * stride_kt)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_head + (blk * stride_vb + slot * stride_vt)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _load_sparse_ids(sel_row, bt_row, tile_start, end, seq_len, offs_n, BLOCK_SIZE: tl.constexpr,
                     UNIT: tl.constexpr):
    """SPARSE tile: cache block, slot and validity of selected-token indices
    j = tile_start + offs_n of one (sequence, kv head).

    j // UNIT picks the selected unit u = sel_row[j // UNIT] (UNIT tokens, a divisor of
    BLOCK_SIZE: a whole cache block when equal) and j % UNIT the offset in it, the token at
    position u * UNIT + j % UNIT, in slot pos % BLOCK_SIZE of logical block pos // BLOCK_SIZE;
    the token is valid if j < end (so entries of sel_row at or past the count are never
    loaded) and its position lies inside the sequence (the partial last unit). Only valid
    lanes look up the block table, and a (contract-violating) selected index outside
    [0, ceil(seq_len / UNIT)) is masked out rather than dereferenced.
    """
    j = tile_start + offs_n
    in_sel = j < end
    u = tl.load(sel_row + j // UNIT, mask=in_sel, other=0)
    pos = u * UNIT + j % UNIT
    valid = in_sel & (u >= 0) & (u < tl.cdiv(seq_len, UNIT)) & (pos < seq_len)
    slot = pos % BLOCK_SIZE
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return blk, slot, valid


@triton.jit
def _attend_tile(
    q, k, v, valid, m_i, l_i, acc, qk_scale,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, EMULATE_BF16: tl.constexpr,
    EMPTY_SAFE: tl.constexpr = False,
):
    """One online-softmax step (base 2) of the GROUP_PAD query rows over a tile.

    EMPTY_SAFE: the tile may have no valid token at all (while the running max is
    still -inf), as a SPARSE tile that only covers the tail of a partial last
    block; exp2 is then taken relative to 0 instead of -inf (no NaN) and the
    tile contributes nothing. The dense loop never needs it.
    """
    kv_dtype = k.dtype
    if UPCAST_DOT:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    if EMPTY_SAFE:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # P is rounded to the cache dtype for the tensor-core PV product (the
    # standard flash-attention trade-off); l_i keeps the fp32 row sums.
    p_lo = cast_rtne(p, kv_dtype, EMULATE_BF16)
    if UPCAST_DOT:
        p_lo = p_lo.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_lo, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    max_blocks,  # block_tables.shape[1]
    num_splits,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    sel_ptr,  # SPARSE only: int32 [B, Hkv, K] selected logical units (UNIT tokens each)
    sel_counts_ptr,  # SPARSE only: int32 [B, Hkv]
    max_sel,  # SPARSE only: K
    stride_sb,
    stride_sh,
    stride_cb,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PREFETCH: tl.constexpr,
    SPARSE: tl.constexpr = False,
    UNIT: tl.constexpr = 1,  # SPARSE only: tokens per selected unit (a divisor of BLOCK_SIZE)
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // NUM_KV_HEADS
    kvh = pid_bh % NUM_KV_HEADS

    # Clamp to what the block table can address so that a bad seq_len can never
    # make the kernel read past the table row; negative lengths act as 0.
    seq_len = tl.load(seq_lens_ptr + b)
    seq_len = tl.minimum(tl.maximum(seq_len, 0), max_blocks * BLOCK_SIZE)

    if SPARSE:
        # The index space is the concatenation of the selected units, j in
        # [0, count * UNIT); tokens past seq_len (partial last unit) are
        # masked per lane in the loop.
        cnt = tl.load(sel_counts_ptr + b * stride_cb + kvh * stride_ch)
        n_tok = tl.minimum(tl.maximum(cnt, 0), max_sel) * UNIT
    else:
        n_tok = seq_len

    # Split the *actual* length into num_splits runs of whole BLOCK_N tiles.
    num_tiles = tl.cdiv(n_tok, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, n_tok)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # query heads served by this kv head

    kv_dtype = k_ptr.dtype.element_ty
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )
    q = cast_rtne(q, kv_dtype, EMULATE_BF16)  # no-op when q already has the cache dtype
    if UPCAST_DOT:
        q = q.to(tl.float32)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_btb
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)

    if SPARSE:
        # Two-level gather: selected logical block -> block table -> cache. A tile
        # may hold no valid token (e.g. only the tail of a selected partial last
        # block when BLOCK_SIZE > BLOCK_N), hence EMPTY_SAFE.
        sel_row = sel_ptr + b.to(tl.int64) * stride_sb + kvh.to(tl.int64) * stride_sh
        for tile_start in range(start, end, BLOCK_N):
            blk, slot, valid = _load_sparse_ids(sel_row, bt_row, tile_start, end, seq_len, offs_n, BLOCK_SIZE, UNIT)
            k, v = _gather_kv(k_head, v_head, blk, slot, valid, offs_d, stride_kb, stride_kt, stride_vb, stride_vt)
            m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale,
                                         DOT_PRECISION, UPCAST_DOT, EMULATE_BF16, True)
    # Dense: every iteration has >= 1 valid token (start < end, tiles start inside
    # the split), so the running max is finite after the first one and exp2 never
    # sees (-inf) - (-inf).
    elif PREFETCH:
        # Software pipelining by hand, in registers: the K/V tile of the next
        # iteration is requested before the current one is consumed, and the
        # block ids one tile further ahead, so neither the table lookup nor the
        # KV fetch is on the critical path. Costs ~one K+V tile of registers.
        # Meant for num_stages=1 (Triton's own pipeliner off).
        blk_n1 = _load_block_ids(bt_row, start, end, offs_n, BLOCK_SIZE)
        k_n1, v_n1 = _load_kv_tile(k_head, v_head, blk_n1, start, end, offs_n, offs_d,
                                   stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
        blk_n2 = _load_block_ids(bt_row, start + BLOCK_N, end, offs_n, BLOCK_SIZE)
        for tile_start in range(start, end, BLOCK_N):
            k = k_n1
            v = v_n1
            k_n1, v_n1 = _load_kv_tile(k_head, v_head, blk_n2, tile_start + BLOCK_N, end, offs_n, offs_d,
                                       stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
            blk_n2 = _load_block_ids(bt_row, tile_start + 2 * BLOCK_N, end, offs_n, BLOCK_SIZE)
            m_i, l_i, acc = _attend_tile(q, k, v, (tile_start + offs_n) < end, m_i, l_i, acc, qk_scale,
                                         DOT_PRECISION, UPCAST_DOT, EMULATE_BF16)
    else:
        # Plain loop; with num_stages >= 3 Triton's pipeliner prefetches the
        # block ids and turns the K/V loads into async copies.
        for tile_start in range(start, end, BLOCK_N):
            blk = _load_block_ids(bt_row, tile_start, end, offs_n, BLOCK_SIZE)
            k, v = _load_kv_tile(k_head, v_head, blk, tile_start, end, offs_n, offs_d,
                                 stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
            m_i, l_i, acc = _attend_tile(q, k, v, (tile_start + offs_n) < end, m_i, l_i, acc, qk_scale,
                                         DOT_PRECISION, UPCAST_DOT, EMULATE_BF16)

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]  # empty split / seq_len 0 -> zeros
    if DIRECT_OUT:
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, cast_rtne(o, out_ptr.dtype.element_ty, EMULATE_BF16), mask=g_mask[:, None])
    else:
        p_ptrs = part_o_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
        tl.store(p_ptrs, o, mask=g_mask[:, None])
        # log2-sum-exp2 of this split's scores; -inf marks an empty split.
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits

    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (seq_len 0)
    w = tl.exp2(lse - m)  # exactly 0 for empty splits
    o = tl.load(
        part_o_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_mask[:, None],
        other=0.0,
    )
    num = tl.sum(o * w[:, None], 0)
    den = tl.sum(w, 0)
    res = num / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, cast_rtne(res, out_ptr.dtype.element_ty, EMULATE_BF16))


def _check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, fn_name):
    """Shape/dtype checks shared by the dense and sparse entry points (shapes only).

    Returns (block_tables, seq_lens) as int32 with a contiguous last dim."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"bad shapes q={tuple(q.shape)} k={tuple(k_cache.shape)} v={tuple(v_cache.shape)}")
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, kv_dim = k_cache.shape
    if kv_dim != head_dim:
        raise ValueError(f"head_dim mismatch: q {head_dim} vs cache {kv_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} vs batch {batch}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must share a dtype")
    if q.is_cuda and k_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{fn_name} runs on float16, bfloat16 or float32 caches on a GPU, got {k_cache.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    if seq_lens.dtype != torch.int32:
        seq_lens = seq_lens.to(torch.int32)
    seq_lens = seq_lens.contiguous()
    if q.device.type != "cuda" and not _INTERPRET:
        raise RuntimeError(
            f"{fn_name} needs CUDA tensors (or TRITON_INTERPRET=1); use {fn_name}_ref on CPU"
        )
    return block_tables, seq_lens


def _prepare_out(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be [B, Hq, D] with a contiguous last dim, got {tuple(out.shape)}")
    return out


def _resolve_block_n(block_n: int | None, head_dim: int, elem_size: int) -> int:
    if block_n is None:
        block_n = _default_block_n(head_dim, elem_size)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    return block_n


def _launch_decode(
    q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, block_n, num_warps, num_stages, prefetch,
    sel_blocks=None, sel_counts=None, unit=None,
) -> torch.Tensor:
    """Stage 1 (+ stage 2 when split) for validated arguments; dense unless sel_* given."""
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    num_splits = max(1, int(num_splits))
    block_n = _resolve_block_n(block_n, head_dim, k_cache.element_size())

    is_fp32 = k_cache.dtype == torch.float32
    # fp32 caches need exact fp32 products (tf32 would lose ~3 digits). The
    # interpreter mis-handles bf16 tl.dot (it multiplies raw bit patterns), so
    # there the operands are upcast to fp32 after rounding: numerically the same
    # products as the bf16 tensor-core path.
    dot_precision = "ieee" if is_fp32 else "tf32"
    upcast_dot = _INTERPRET and k_cache.dtype == torch.bfloat16

    direct = num_splits == 1
    if direct:
        part_o = out  # unused placeholders
        part_lse = out
        p_strides = (0, 0, 0)
        l_strides = (0, 0)
    else:
        part_o = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        p_strides = part_o.stride()[:3]
        l_strides = part_lse.stride()[:2]

    sparse = sel_blocks is not None
    if sparse:
        sparse_args = (sel_blocks, sel_counts, sel_blocks.shape[2], sel_blocks.stride(0), sel_blocks.stride(1),
                       sel_counts.stride(0), sel_counts.stride(1))
    else:
        # Unused by the dense specialisation (SPARSE=False is a constexpr).
        sparse_args = (seq_lens, seq_lens, 0, 0, 0, 0, 0)

    grid = (batch * num_kv_heads, num_splits)
    _paged_decode_split_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_o,
        part_lse,
        float(scale) * _LOG2E,
        max_blocks,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *p_strides,
        *l_strides,
        *sparse_args,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        DIRECT_OUT=direct,
        DOT_PRECISION=dot_precision,
        UPCAST_DOT=upcast_dot,
        EMULATE_BF16=_INTERPRET,
        PREFETCH=bool(prefetch) and not sparse,
        SPARSE=sparse,
        UNIT=unit or block_size,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not direct:
        _merge_splits_kernel[(num_q_heads, batch)](
            part_o,
            part_lse,
            out,
            num_splits,
            *p_strides,
            *l_strides,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
            EMULATE_BF16=_INTERPRET,
            num_warps=4 if num_splits * head_dim >= 2048 else 2,
        )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    prefetch: bool = False,
) -> torch.Tensor:
    """Single-token (decode) attention over a paged KV cache, Triton split-K.

    Args:
        q: [B, Hq, D] query of the one new token per sequence (last dim contiguous).
        k_cache, v_cache: [num_blocks, Hkv, block_size, D] (last dim contiguous).
        block_tables: int32 [B, max_blocks_per_seq].
        seq_lens: int32 [B]; rows with 0 produce zeros.
        scale: softmax scale (usually D ** -0.5).
        num_splits: KV splits per (sequence, kv head); default `choose_num_splits`.
        out: optional [B, Hq, D] output buffer (last dim contiguous).
        block_n: tokens per loop iteration (power of two >= 16); default by dtype/D.
        num_warps, num_stages: launch config for the main kernel. With 3 stages
            Triton's pipeliner prefetches the block-table entries of the next
            tile and issues the K/V copies asynchronously (one buffer each); with
            2 the table lookup sits on the critical path of every iteration.
        prefetch: use the hand-pipelined loop (next K/V tile fetched into
            registers while the current one is consumed); pair with num_stages=1.

    Returns [B, Hq, D] in q's dtype (or `out`). No host synchronisation happens.
    """
    block_tables, seq_lens = _check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, "paged_decode_attention")
    out = _prepare_out(q, out)
    if num_splits is None:
        batch, num_kv_heads, block_size = q.shape[0], k_cache.shape[1], k_cache.shape[2]
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1], block_size, num_sms(q.device))
    block_n = _resolve_block_n(block_n, q.shape[2], k_cache.element_size())
    if q.shape[0] == 0:
        return out
    return _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, block_n,
                          num_warps, num_stages, prefetch)


def sparse_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sel_blocks: torch.Tensor,
    sel_counts: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    unit: int | None = None,
) -> torch.Tensor:
    """Block-sparse decode attention over a paged KV cache (same kernel, SPARSE=True).

    The query heads of kv head h of sequence b attend (exact fp32 softmax) over
    the tokens of the selected *logical* units only (`unit` tokens each, a power
    of two dividing the cache block size bs; default bs: units are whole blocks):
        {u * unit + off : u in sel_blocks[b, h, :sel_counts[b, h]], 0 <= off < unit,
                          u * unit + off < seq_lens[b]}
    (the token at position p of sequence b is slot p % bs of cache block
    block_tables[b, p // bs]: units inside a block are read ragged, as chosen).

    Args (beyond `paged_decode_attention`'s):
        sel_blocks: int32 [B, Hkv, K] logical unit indices in
            [0, ceil(seq_len / unit)), unique within a row, any order. Entries at
            positions >= sel_counts[b, h] are never read.
        sel_counts: int32 [B, Hkv] in [0, K]; 0 (or seq_len 0) gives zeros.
        num_splits: default `choose_num_splits(B, Hkv, K, unit, sms, sparse=True)`:
            K selected units are the widest a row can be.

    The selection order only changes the summation order. A selected index out
    of range is ignored (masked), never dereferenced. Host decisions depend on
    shapes only (CUDA-graph capturable); no host synchronisation happens.
    """
    block_tables, seq_lens = _check_decode_args(
        q, k_cache, v_cache, block_tables, seq_lens, "sparse_paged_decode_attention"
    )
    batch, num_kv_heads, block_size = q.shape[0], k_cache.shape[1], k_cache.shape[2]
    unit = _check_unit(unit, block_size)
    if sel_blocks.dim() != 3 or tuple(sel_blocks.shape[:2]) != (batch, num_kv_heads):
        raise ValueError(f"sel_blocks must be [B={batch}, Hkv={num_kv_heads}, K], got {tuple(sel_blocks.shape)}")
    if tuple(sel_counts.shape) != (batch, num_kv_heads):
        raise ValueError(f"sel_counts must be [B={batch}, Hkv={num_kv_heads}], got {tuple(sel_counts.shape)}")
    if sel_blocks.dtype != torch.int32 or sel_blocks.stride(2) != 1:
        sel_blocks = sel_blocks.to(torch.int32).contiguous()
    if sel_counts.dtype != torch.int32:
        sel_counts = sel_counts.to(torch.int32)
    out = _prepare_out(q, out)
    max_sel = sel_blocks.shape[2]
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_sel, unit, num_sms(q.device), sparse=True)
    block_n = _resolve_block_n(block_n, q.shape[2], k_cache.element_size())
    if batch == 0:
        return out
    if max_sel == 0:  # nothing can be selected: all zeros (shape-only decision)
        return out.zero_()
    return _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, block_n,
                          num_warps, num_stages, False, sel_blocks=sel_blocks, sel_counts=sel_counts, unit=unit)


def _check_unit(unit: int | None, block_size: int) -> int:
    """The selection unit: a power of two dividing the cache block size (default: the block)."""
    if unit is None:
        return block_size
    if unit < 1 or unit & (unit - 1) or block_size % unit:
        raise ValueError(f"unit must be a power of two dividing the block size {block_size}, got {unit}")
    return unit


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain torch reference (and the engine's CPU path); same contract as above.

    Per sequence: gather its blocks, flatten to [Hkv, L, D], attend with every
    query head of each GQA group (query head i uses kv head i // group, as HF's
    repeat_kv does) in fp32. Reads seq_lens on the host, so not graph-capturable.
    """
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)

    def gather(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
        # [n_blk, Hkv, bs, D] gathered, then ONE copy that both transposes to
        # [Hkv, n_blk, bs, D] and converts to fp32; first seq_len tokens kept.
        picked = cache.index_select(0, blocks)
        flat = torch.empty(
            (num_kv_heads, blocks.numel(), block_size, head_dim), dtype=torch.float32, device=cache.device
        )
        flat.copy_(picked.transpose(0, 1))
        return flat.view(num_kv_heads, -1, head_dim)[:, :seq_len]

    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len <= 0:
            continue
        n_blk = (seq_len + block_size - 1) // block_size
        blocks = block_tables[b, :n_blk].long()
        k = gather(k_cache, blocks, seq_len)  # [Hkv, L, D] fp32
        v = gather(v_cache, blocks, seq_len)
        qg = q[b].float().view(num_kv_heads, group, head_dim)
        scores = torch.matmul(qg, k.transpose(1, 2)) * scale  # [Hkv, G, L]
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v)  # [Hkv, G, D]
        out[b] = o.reshape(num_q_heads, head_dim).to(q.dtype)
    return out


def sparse_paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sel_blocks: torch.Tensor,
    sel_counts: torch.Tensor,
    scale: float,
    unit: int | None = None,
) -> torch.Tensor:
    """Plain torch twin of `sparse_paged_decode_attention` (same contract).

    Per (sequence, kv head): list the selected token positions, gather their K/V
    rows through the block table, attend with the group's query heads in fp32.
    Reads seq_lens / sel_counts on the host, so not graph-capturable.
    """
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    max_sel = sel_blocks.shape[2]
    unit = _check_unit(unit, block_size)
    out = torch.zeros_like(q)
    offs = torch.arange(unit, device=q.device)
    lens = seq_lens.tolist()
    counts = sel_counts.tolist()
    for b in range(batch):
        seq_len = lens[b]
        if seq_len <= 0:
            continue
        table = block_tables[b].long()
        for h in range(num_kv_heads):
            cnt = min(counts[b][h], max_sel)
            if cnt <= 0:
                continue
            logical = sel_blocks[b, h, :cnt].long()
            pos = (logical[:, None] * unit + offs[None, :]).reshape(-1)
            pos = pos[(pos >= 0) & (pos < seq_len)]  # drops the partial last unit's tail
            if pos.numel() == 0:
                continue
            phys = table[pos // block_size]
            slot = pos % block_size
            k = k_cache[phys, h, slot].float()  # [n, D]
            v = v_cache[phys, h, slot].float()
            heads = slice(h * group, (h + 1) * group)
            probs = torch.softmax(q[b, heads].float() @ k.T * scale, dim=-1)  # [G, n]
            out[b, heads] = (probs @ v).to(q.dtype)
    return out
