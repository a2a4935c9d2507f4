"""Attention of rows at arbitrary positions of one sequence: a Triton flash-attention forward + its torch twin.

`rows_attention(q [n, Hq, D], pos [n], k, v, scale)`: row r (query heads q[r], at position
pos[r] of the sequence) attends causally to the sequence's keys 0..pos[r]. The rows are what a
reuse flow recomputes (scattered through a prompt: issue #18) or a whole prompt (consecutive rows
are the plain causal case). Keys and values are either contiguous `[Hkv, T, D]` (on Hopper read
through tensor descriptors: TMA tiles, zeros past T) or the engine's paged pool
`[num_blocks, Hkv, block_size, D]` with the sequence's `block_table` (no gather copy; slower per
key than contiguous tiles by more than a gather costs, so the engine gathers: #18).
Per KV head, optional sinks and a window narrow what a row sees (key j <= p seen iff j < sink or
p - j < window: RedKnot's local heads, issue #18 item 2), one launch for global and local heads.
`lines_attention`: LoopServe's per-query-head vertical + slash lines, block-sparse (the MInference
way: per row tile and head, the list of key tiles the lines touch; the mask evaluated inside).

Design: one program owns BLOCK_M consecutive rows of `pos` and one KV head, with all the query
heads of that head's GQA group packed into the tile's M dimension (row-major: entry i is row
i // GROUP_P2, query head i % GROUP_P2), so each K/V tile is read once per group. Per-row key
limits come from `pos`: a program reads only the key tiles some row of it sees (key-block
skipping: past max(pos) of the tile, between the sinks and the earliest window), and runs the
tiles every row sees in full without a mask (below min(pos) + 1, within the latest window), the
others masked per row. Rows sorted by position
keep a tile's limits close; the result does not depend on the order. Online softmax in base 2,
fp32 accumulation; fp32 inputs multiply in IEEE fp32 (no TF32). Nothing is read on the host.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["rows_attention", "rows_attention_ref", "lines_attention", "line_blocks"]

_LOG2E = 1.4426950408889634
_NO_WINDOW = 2147483647


@triton.jit
def _step(acc, m_i, l_i, qt, k_base, v_base, kd, vd, h, bt, start, p, hi, klo, khi, win, vert, slash, d, s_kb, s_kt,
          s_vb, s_vt, scale_log2, D: tl.constexpr, D_P2: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
          BS: tl.constexpr, TMA: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr):
    """One key tile [start, start + BLOCK_N) into the online softmax. MASK 0: every row takes every
    key; 1: row r takes key j iff j <= pos[r], klo <= j < khi and pos[r] - j < win; 2 (lines): iff
    j <= pos[r] and j is on the head's vertical lines (vert[j]), its slash lines (slash[pos[r] - j])
    or j == pos[r]. TMA (contiguous KV): the tiles come through the tensor descriptors kd, vd
    (`[Hkv, T, D]`, zeros past T; keys in [hi, T) are read and masked like any key a row does not see)."""
    kk = start + tl.arange(0, BLOCK_N)
    ok = kk < hi
    if TMA:
        kt = tl.trans(kd.load([h, start, 0]).reshape(BLOCK_N, D_P2))
    else:
        if PAGED:  # token t: block bt[t // BS], slot t % BS
            blk = tl.load(bt + kk // BS, mask=ok, other=0).to(tl.int64)
            k_off, v_off = blk * s_kb + (kk % BS) * s_kt, blk * s_vb + (kk % BS) * s_vt
        else:
            k_off, v_off = kk.to(tl.int64) * s_kt, kk.to(tl.int64) * s_vt
        kt = tl.load(k_base + k_off[None, :] + d[:, None], mask=ok[None, :] & (d[:, None] < D), other=0.0)
    s = tl.dot(qt, kt, input_precision=PREC) * scale_log2  # [M, BLOCK_N] fp32
    if MASK == 1:
        j = kk[None, :]
        s = tl.where((j <= p[:, None]) & (j >= klo) & (j < khi) & (p[:, None] - j < win), s, float("-inf"))
    if MASK == 2:
        dist = p[:, None] - kk[None, :]
        causal = (dist >= 0) & ok[None, :]
        on = tl.load(vert + kk, mask=ok, other=0)[None, :] != 0
        on = on | (tl.load(slash + dist, mask=causal, other=0) != 0) | (dist == 0)
        s = tl.where(causal & on, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet (or never will)
    alpha = tl.exp2(m_i - m_safe)
    pr = tl.exp2(s - m_safe[:, None])
    if TMA:
        vt = vd.load([h, start, 0]).reshape(BLOCK_N, D_P2)
        if MASK != 0:  # a tile crossing hi: the values past it (zero probability) must not be NaN or inf either
            vt = tl.where(ok[:, None], vt, 0.0)
    else:
        vt = tl.load(v_base + v_off[:, None] + d[None, :], mask=ok[:, None] & (d[None, :] < D), other=0.0)
    acc = acc * alpha[:, None] + tl.dot(pr.to(vt.dtype), vt, input_precision=PREC)
    return acc, m_new, l_i * alpha + tl.sum(pr, 1)


@triton.jit
def _rows_attention_kernel(
    q, k, v, kd, vd, o, pos, bt, sinks, windows, n, scale_log2,
    s_qn, s_qh, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_on, s_oh,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, D_P2: tl.constexpr, PAGED: tl.constexpr, BS: tl.constexpr, TMA: tl.constexpr,
    PREC: tl.constexpr,
):
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK_M * GROUP_P2)
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # sorted rows: the last tiles see the most keys, start them first
    row = tile * BLOCK_M + i // GROUP_P2
    g = i % GROUP_P2
    head = h * GROUP + g
    live = (row < n) & (g < GROUP)
    p = tl.load(pos + row, mask=row < n, other=-1).to(tl.int32)
    d = tl.arange(0, D_P2)
    qt = tl.load(q + row.to(tl.int64)[:, None] * s_qn + head[:, None] * s_qh + d[None, :],
                 mask=live[:, None] & (d[None, :] < D), other=0.0)
    # Row r sees key j iff j <= pos[r] and (j < sink or pos[r] - j < win): this KV head's sinks and
    # window (plain causal: sink 0, an unbounded window). Over the tile's rows, pos in [pmin, pmax]:
    # A. the sinks [0, min(sink, pmax + 1)), masked;
    # B. keys [max(sink, pmin - win + 1), pmax + 1), some row sees each; among them every row sees
    #    [max(sink, pmax - win + 1), pmin + 1): its whole tiles run unmasked, the tiles around it masked.
    sink = tl.load(sinks + h)
    win = tl.load(windows + h)
    big = 2147483647  # _NO_WINDOW
    pmax = tl.max(p, 0)
    pmin = tl.min(tl.where(row < n, p, big), 0)
    hi = pmax + 1
    k_base = k + h.to(tl.int64) * s_kh
    v_base = v + h.to(tl.int64) * s_vh
    m_i = tl.full([BLOCK_M * GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_P2], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P2, D_P2], tl.float32)
    for start in range(0, tl.minimum(sink, hi), BLOCK_N):
        acc, m_i, l_i = _step(acc, m_i, l_i, qt, k_base, v_base, kd, vd, h, bt, start, p, hi, 0, sink, big, q, q, d, s_kb,
                              s_kt, s_vb, s_vt, scale_log2, D, D_P2, BLOCK_N, PAGED, BS, TMA, 1, PREC)
    b0 = (tl.maximum(sink, pmin - win + 1) // BLOCK_N) * BLOCK_N
    u0 = tl.maximum(b0, tl.cdiv(tl.maximum(sink, pmax - win + 1), BLOCK_N) * BLOCK_N)
    u1 = tl.maximum(u0, ((pmin + 1) // BLOCK_N) * BLOCK_N)
    for start in range(b0, u0, BLOCK_N):
        acc, m_i, l_i = _step(acc, m_i, l_i, qt, k_base, v_base, kd, vd, h, bt, start, p, hi, sink, big, win, q, q, d, s_kb,
                              s_kt, s_vb, s_vt, scale_log2, D, D_P2, BLOCK_N, PAGED, BS, TMA, 1, PREC)
    for start in range(u0, u1, BLOCK_N):
        acc, m_i, l_i = _step(acc, m_i, l_i, qt, k_base, v_base, kd, vd, h, bt, start, p, hi, sink, big, win, q, q, d, s_kb,
                              s_kt, s_vb, s_vt, scale_log2, D, D_P2, BLOCK_N, PAGED, BS, TMA, 0, PREC)
    for start in range(u1, hi, BLOCK_N):
        acc, m_i, l_i = _step(acc, m_i, l_i, qt, k_base, v_base, kd, vd, h, bt, start, p, hi, sink, big, win, q, q, d, s_kb,
                              s_kt, s_vb, s_vt, scale_log2, D, D_P2, BLOCK_N, PAGED, BS, TMA, 1, PREC)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o + row.to(tl.int64)[:, None] * s_on + head[:, None] * s_oh + d[None, :], out.to(o.dtype.element_ty),
             mask=live[:, None] & (d[None, :] < D))


@triton.jit
def _lines_attention_kernel(
    q, k, v, kd, vd, o, pos, bt, vert, slash, blocks, counts, n, T, NB, scale_log2,
    s_qn, s_qh, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_on, s_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
    PAGED: tl.constexpr, BS: tl.constexpr, TMA: tl.constexpr, PREC: tl.constexpr,
):
    """One program: BLOCK_M rows and one query head (its lines are its own), over the key tiles its
    list names (`blocks[tile, head, :counts[tile, head]]`)."""
    tile = tl.program_id(0)
    qh = tl.program_id(1)
    h = qh // GROUP
    row = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    live = row < n
    p = tl.load(pos + row, mask=live, other=-1).to(tl.int32)
    d = tl.arange(0, D_P2)
    qt = tl.load(q + row.to(tl.int64)[:, None] * s_qn + qh * s_qh + d[None, :], mask=live[:, None] & (d[None, :] < D),
                 other=0.0)
    hi = tl.max(p, 0) + 1
    k_base = k + h.to(tl.int64) * s_kh
    v_base = v + h.to(tl.int64) * s_vh
    line_v = vert + qh.to(tl.int64) * T
    line_s = slash + qh.to(tl.int64) * T
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P2], tl.float32)
    at = (tile * tl.num_programs(1) + qh).to(tl.int64)
    for i in range(tl.load(counts + at)):
        start = tl.load(blocks + at * NB + i) * BLOCK_N
        acc, m_i, l_i = _step(acc, m_i, l_i, qt, k_base, v_base, kd, vd, h, bt, start, p, hi, 0, 0, 0, line_v, line_s, d, s_kb,
                              s_kt, s_vb, s_vt, scale_log2, D, D_P2, BLOCK_N, PAGED, BS, TMA, 2, PREC)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o + row.to(tl.int64)[:, None] * s_on + qh * s_oh + d[None, :], out.to(o.dtype.element_ty),
             mask=live[:, None] & (d[None, :] < D))


def rows_attention(q: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   block_table: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                   windows: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None, tma: bool | None = None) -> torch.Tensor:
    """Rows q `[n, Hq, D]` at positions `pos` `[n]` over keys 0..pos[r] → `[n, Hq, D]` (q's dtype).

    Contiguous KV: k, v `[Hkv, T, D]`. Paged: k, v `[num_blocks, Hkv, block_size, D]` and
    `block_table` `[>= ceil(T / block_size)]` int32, the sequence's blocks in order.
    Per KV head h (both `[Hkv]` int, device tensors): a row at p sees key j <= p only if
    j < sinks[h] or p - j < windows[h] (RedKnot's local heads); the key tiles no row of a program
    sees are not read. Default: no sinks, unbounded windows (plain causal). `tma`: contiguous KV
    read through Hopper's tensor descriptors (default: where the GPU and the KV's alignment allow)."""
    n, hq, _ = q.shape
    hkv = _kv_heads(k, block_table)
    group = hq // hkv
    g2 = triton.next_power_of_2(group)
    wide = q.element_size() <= 2  # 16-bit: tensor cores, Hopper's usual 128-row tiles; fp32: IEEE FMAs, smaller
    tma = _use_tma(tma, k, v, block_table)
    # The tile sweeps' best (#18, BENCHMARKS.md), 16-bit: contiguous KV through descriptors 128 keys a tile
    # (head dim <= 128), through pointers 64, both 8 warps; paged 32 keys, 4 warps. fp32: 32 keys, 4 warps.
    big_tiles = wide and block_table is None
    block_m = block_m or max(1, (128 if wide else 64) // g2)
    block_n = block_n or ((128 if tma and q.shape[-1] <= 128 else 64) if big_tiles else 32)
    _check(q, k, hkv, block_m, block_n)
    out = torch.empty_like(q)
    if n == 0:
        return out
    kv = _kv_args(q, k, v, block_table, pos, block_n, tma)
    sinks, windows = _head_limits(sinks, windows, hkv, q.device)
    grid = (triton.cdiv(n, block_m), hkv)
    _rows_attention_kernel[grid](
        q, k, v, *kv["descs"], out, pos.contiguous(), kv["bt"], sinks, windows, n, scale * _LOG2E,
        q.stride(0), q.stride(1), *kv["strides"], out.stride(0), out.stride(1),
        GROUP=group, GROUP_P2=g2, BLOCK_M=block_m, BLOCK_N=block_n, **kv["consts"],
        num_warps=num_warps or (8 if big_tiles else 4), num_stages=num_stages or (3 if wide else 2),
    )
    return out


def _kv_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor | None,
             pos: torch.Tensor, block_n: int, tma: bool) -> dict:
    """The block table, the six K/V strides (block, head, token) and the tensor descriptors the
    kernels take, and the constants both kernels share (head dim, paging, block size, TMA, dot precision)."""
    if block_table is None:
        bs, bt = 1, pos  # bt: unused
        strides = (0, k.stride(0), k.stride(1), 0, v.stride(0), v.stride(1))
    else:
        bs, bt = k.shape[2], block_table.to(torch.int32).contiguous()
        strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need contiguous last dims")
    dim = q.shape[-1]
    d2 = max(16, triton.next_power_of_2(dim))
    # [Hkv, T, D] tiles of [1, block_n, D_P2]: zeros past T and past D
    descs = (TensorDescriptor(k, list(k.shape), list(k.stride()), [1, block_n, d2]),
             TensorDescriptor(v, list(v.shape), list(v.stride()), [1, block_n, d2])) if tma else (k, v)
    consts = {"D": dim, "D_P2": d2, "PAGED": block_table is not None, "BS": bs, "TMA": tma,
              "PREC": "ieee" if q.dtype == torch.float32 else "tf32"}
    return {"bt": bt, "strides": strides, "descs": descs, "consts": consts}


def _kv_heads(k: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """KV heads of contiguous `[Hkv, T, D]` or paged `[num_blocks, Hkv, block_size, D]` keys."""
    if block_table is None and k.dim() != 3:
        raise ValueError(f"contiguous k, v must be [Hkv, T, D], got {tuple(k.shape)}")
    if block_table is not None and k.dim() != 4:
        raise ValueError(f"paged k, v must be [num_blocks, Hkv, block_size, D], got {tuple(k.shape)}")
    return k.shape[0] if block_table is None else k.shape[1]


def _use_tma(tma: bool | None, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor | None) -> bool:
    """Whether the kernels read K and V through tensor descriptors: asked for (contiguous KV, 16-byte
    aligned base and strides), or by default where that is also fast (Hopper or datacenter Blackwell,
    or the interpreter on the CPU)."""
    def ok(x: torch.Tensor) -> bool:
        return x.data_ptr() % 16 == 0 and all(st * x.element_size() % 16 == 0 for st in x.stride()[:-1])

    # by default Hopper and datacenter Blackwell only: the 128-key tiles are sized for their ~228 KB of shared memory
    fast = all(not x.is_cuda or (9, 0) <= torch.cuda.get_device_capability(x.device) < (12, 0) for x in (k, v))
    if tma is None:
        return block_table is None and fast and ok(k) and ok(v)
    if tma and (block_table is not None or not (ok(k) and ok(v))):
        raise ValueError("tma reads contiguous KV with a 16-byte aligned base and strides only (no block_table)")
    return tma


def _head_limits(sinks, windows, hkv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head sinks and windows as int32 device tensors (no sinks, unbounded windows by default;
    clamped before the cast, so an int64 "unbounded" stays unbounded)."""
    sinks = torch.zeros(hkv, dtype=torch.int32, device=device) if sinks is None else sinks
    windows = torch.full((hkv,), _NO_WINDOW, dtype=torch.int32, device=device) if windows is None else windows
    if sinks.shape != (hkv,) or windows.shape != (hkv,):
        raise ValueError(f"sinks and windows must be [Hkv] = [{hkv}], got {tuple(sinks.shape)} / {tuple(windows.shape)}")
    return (sinks.to(device).clamp(0, _NO_WINDOW).to(torch.int32).contiguous(),
            windows.to(device).clamp(1, _NO_WINDOW).to(torch.int32).contiguous())


def _check(q: torch.Tensor, k: torch.Tensor, hkv: int, block_m: int, block_n: int) -> None:
    """The shapes both kernels need, and what the real compiler needs that the interpreter does not
    check: one dtype for q, k and v, power-of-two tiles, `tl.dot`'s inner dimension (the key tile) >= 16."""
    hq, dim = q.shape[1], q.shape[2]
    if hq % hkv or k.shape[-1] != dim or q.stride(-1) != 1:
        raise ValueError(f"q heads {hq} must be a multiple of KV heads {hkv}, head dims equal, last dims contiguous")
    if q.dtype != k.dtype:
        raise ValueError(f"q ({q.dtype}) and the KV ({k.dtype}) must have one dtype")
    for name, x in (("block_m", block_m), ("block_n", block_n)):
        if x < 1 or x & (x - 1):
            raise ValueError(f"{name} must be a power of two, got {x}")
    if block_n < 16:
        raise ValueError(f"block_n must be at least 16 (tl.dot), got {block_n}")


def line_blocks(pos: torch.Tensor, vertical: torch.Tensor, slash: torch.Tensor, block_m: int,
                block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `lines_attention`: per (tile of `block_m` rows, query head), the key tiles of `block_n`
    keys that hold a key some row of the tile sees: a vertical line's key, a key on a slash line
    of some row (distances [first - tile end + 1, last - tile start] hold a chosen one, by prefix
    sums), or a row's own key; never past the tile's last row. Rows sorted by position.
    → (blocks `[tiles, Hq, NB]` int32, the tile indices first and ascending; counts `[tiles, Hq]` int32)."""
    hq, t = vertical.shape
    n, nb = pos.numel(), triton.cdiv(t, block_n)
    tiles = triton.cdiv(n, block_m)
    dev = pos.device
    starts = torch.arange(nb, device=dev) * block_n
    first = pos[torch.arange(tiles, device=dev) * block_m]
    last = pos[(torch.arange(tiles, device=dev) * block_m + block_m - 1).clamp(max=n - 1)]
    on_v = torch.nn.functional.pad(vertical.bool(), (0, nb * block_n - t)).view(hq, nb, block_n).any(-1)  # [Hq, NB]
    cs = torch.nn.functional.pad(slash.int().cumsum(1, dtype=torch.int32), (1, 0))  # [Hq, T + 1]: chosen distances below x
    lo = (first[:, None] - starts[None, :] - block_n + 1).clamp(0, t)  # [tiles, NB]
    hi = (last[:, None] - starts[None, :] + 1).clamp(0, t)  # distances [lo, hi)
    on_s = (cs[:, hi] - cs[:, lo.clamp(max=hi)]) > 0  # [Hq, tiles, NB]
    own = torch.zeros(tiles * nb, dtype=torch.bool, device=dev)  # scatter_ of a scalar: no host copy, graph-safe
    own = own.scatter_(0, torch.arange(n, device=dev) // block_m * nb + pos // block_n, True).view(tiles, nb)
    causal = starts[None, :] <= last[:, None]  # [tiles, NB]
    mask = (on_v[None] | on_s.transpose(0, 1) | own[:, None]) & causal[:, None]  # [tiles, Hq, NB]
    ids = torch.where(mask, torch.arange(nb, device=dev, dtype=torch.int32), nb)
    return ids.sort(-1).values.to(torch.int32).contiguous(), mask.sum(-1).to(torch.int32).contiguous()


def lines_attention(q: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    vertical: torch.Tensor, slash: torch.Tensor, block_table: torch.Tensor | None = None,
                    block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                    tma: bool | None = None) -> torch.Tensor:
    """LoopServe's vertical + slash pattern: row r at pos[r], query head h, sees key j <= pos[r] iff
    `vertical[h, j]`, `slash[h, pos[r] - j]` or j == pos[r] (`[Hq, T]` bool each: T = the keys).
    Rows sorted by position (not checked: that would read the device); KV as for `rows_attention`.
    Each program reads only the key tiles `line_blocks` lists for it; the pattern's mask is
    evaluated per key inside them."""
    n, hq, _ = q.shape
    hkv = _kv_heads(k, block_table)
    _check(q, k, hkv, block_m, block_n)
    tma = _use_tma(tma, k, v, block_table)
    if vertical.shape != slash.shape or vertical.shape[0] != hq:
        raise ValueError(f"vertical and slash must be [Hq, T] = [{hq}, T], got {tuple(vertical.shape)} / {tuple(slash.shape)}")
    out = torch.empty_like(q)
    if n == 0:
        return out
    kv = _kv_args(q, k, v, block_table, pos, block_n, tma)
    t = vertical.shape[1]
    blocks, counts = line_blocks(pos, vertical, slash, block_m, block_n)
    _lines_attention_kernel[(blocks.shape[0], hq)](
        q, k, v, *kv["descs"], out, pos.contiguous(), kv["bt"], vertical.to(torch.int8).contiguous(), slash.to(torch.int8).contiguous(),
        blocks, counts, n, t, blocks.shape[2], scale * _LOG2E,
        q.stride(0), q.stride(1), *kv["strides"], out.stride(0), out.stride(1),
        GROUP=hq // hkv, BLOCK_M=block_m, BLOCK_N=block_n, **kv["consts"], num_warps=num_warps, num_stages=num_stages,
    )
    return out


def rows_attention_ref(q: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       block_table: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                       windows: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin (float64 inside): row r attends to keys 0..pos[r] (within each head's sinks and
    window); same arguments, q's dtype out."""
    if block_table is not None:  # [num_blocks, Hkv, bs, D] → [Hkv, T, D] in the sequence's order
        t = (int(pos.max()) + 1) if pos.numel() else 0
        nb = math.ceil(t / k.shape[2])
        k = k[block_table[:nb].long()].transpose(0, 1).reshape(k.shape[1], -1, k.shape[3])[:, :t]
        v = v[block_table[:nb].long()].transpose(0, 1).reshape(v.shape[1], -1, v.shape[3])[:, :t]
    group = q.shape[1] // k.shape[0]
    kd = k.double().repeat_interleave(group, 0)  # [Hq, T, D]
    vd = v.double().repeat_interleave(group, 0)
    s = torch.einsum("nhd,htd->hnt", q.double(), kd) * scale
    keys = torch.arange(kd.shape[1], device=q.device)
    p = pos.to(q.device)[None, :, None]
    sinks, windows = _head_limits(sinks, windows, k.shape[0], q.device)
    sink = sinks.repeat_interleave(group)[:, None, None]
    win = windows.repeat_interleave(group)[:, None, None]
    seen = (keys[None, None, :] <= p) & ((keys[None, None, :] < sink) | (p - keys[None, None, :] < win))
    s = s.masked_fill(~seen, float("-inf"))
    return torch.einsum("hnt,htd->nhd", torch.softmax(s, -1), vd).to(q.dtype)
