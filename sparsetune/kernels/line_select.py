"""LoopServe's line selection over a sampled causal attention map: two Triton kernels + torch twins.

A map `probs [H, n, T]` (float32; row r at position pos[r] attends keys 0..pos[r]) has a vertical
line per key j and a slash line per distance d (the entries pos[r] - j = d).
- `slash_masses`: per head, the mass of every slash line `[H, T]`. One program per (head, run of
  distances) walks the n rows, each a reversed contiguous run of the map: no atomics, no `[n, T]`
  index tensor (the torch twin scatters through one).
- `cover_histogram`: given every line's rank (`rank [H, 2T]`: verticals, then slashes by distance),
  the map's mass by the rank at which the union of the top lines first covers each entry (the
  better rank of its two lines), `[H, 2T + 1]` float64 (bin k + 1: covered once k lines are taken).
  One program per (head, row, run of keys) adds its entries into the bins (float64 atomics); the
  torch twin builds the `[H, n, T]` rank map and a float64 copy of the map, in rounds of heads.
`reuse.base.slash_masses` / `reuse.base.cover_histogram` run them on CUDA for `flows/loopserve` (issue #18: the selection's torch ops cost about
a third of LoopServe's prefill at 32K).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["distances", "slash_masses", "slash_masses_ref", "cover_histogram", "cover_histogram_ref"]

_CHUNK = 1 << 23  # map entries per round of the torch twin (heads are taken whole)


@triton.jit
def _slash_kernel(probs, pos, out, n, T, s_ph, s_pn, BLOCK: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    row = probs + h * s_ph  # row r's map, advanced a row at a time (64-bit pointer arithmetic)
    for r in range(n):
        p = tl.load(pos + r)
        acc += tl.load(row + (p - d), mask=(d <= p) & (d < T), other=0.0)
        row += s_pn
    tl.store(out + h * T + d, acc, mask=d < T)


@triton.jit
def _cover_kernel(probs, pos, rank, mass, T, s_ph, s_pn, BLOCK: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    j = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    p = tl.load(pos + r)
    live = (j < T) & (j <= p)
    x = tl.load(probs + h * s_ph + r * s_pn + j, mask=live, other=0.0)
    by_key = tl.load(rank + h * 2 * T + j, mask=live, other=0)
    by_dist = tl.load(rank + h * 2 * T + T + (p - j), mask=live, other=0)
    first = tl.minimum(by_key, by_dist)
    tl.atomic_add(mass + h * (2 * T + 1) + first + 1, x.to(tl.float64), mask=live & (x != 0), sem="relaxed")


def distances(pos: torch.Tensor, t: int) -> torch.Tensor:
    """`[n, T]`: how far each of `t` keys lies behind each row at `pos` (0 on and past the
    diagonal): the slash line a (row, key) entry is on."""
    return (pos[:, None] - torch.arange(t, device=pos.device)[None, :]).clamp(min=0)


def _check(probs: torch.Tensor, pos: torch.Tensor) -> None:
    if probs.dim() != 3 or probs.dtype != torch.float32 or probs.stride(-1) != 1 or pos.shape != probs.shape[1:2]:
        raise ValueError(f"probs must be [H, n, T] float32 (last dim contiguous) with pos [n], got "
                         f"{tuple(probs.shape)} {probs.dtype} and {tuple(pos.shape)}")


def slash_masses(probs: torch.Tensor, pos: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """`[H, T]` float32: per head, the map's mass at each distance d (entries pos[r] - j = d)."""
    _check(probs, pos)
    h, n, t = probs.shape
    out = torch.empty(h, t, dtype=torch.float32, device=probs.device)
    _slash_kernel[(h, triton.cdiv(t, block))](probs, pos.to(torch.int32).contiguous(), out, n, t,
                                              probs.stride(0), probs.stride(1), BLOCK=block, num_warps=4)
    return out


def slash_masses_ref(probs: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The torch twin: one scatter_add by each entry's distance (entries past the diagonal, zero in a
    causal map, land on distance 0)."""
    h, _, t = probs.shape
    dist = distances(pos, t).flatten()
    return torch.zeros(h, t, dtype=probs.dtype, device=probs.device).scatter_add_(1, dist.expand(h, -1), probs.flatten(1))


def cover_histogram(probs: torch.Tensor, pos: torch.Tensor, rank: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """`[H, 2T + 1]` float64: the map's mass by 1 + the better rank of each entry's two lines
    (`rank [H, 2T]`: key j's vertical at j, distance d's slash at T + d)."""
    _check(probs, pos)
    h, n, t = probs.shape
    mass = torch.zeros(h, 2 * t + 1, dtype=torch.float64, device=probs.device)
    _cover_kernel[(h, n, triton.cdiv(t, block))](probs, pos.to(torch.int32).contiguous(), rank.to(torch.int32).contiguous(),
                                                 mass, t, probs.stride(0), probs.stride(1), BLOCK=block, num_warps=4)
    return mass


def cover_histogram_ref(probs: torch.Tensor, pos: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """The torch twin, in rounds of whole heads (~32 bytes of temporaries per map entry)."""
    h, n, t = probs.shape
    dist = distances(pos, t).flatten()
    mass = torch.zeros(h, 2 * t + 1, dtype=torch.float64, device=probs.device)
    step = max(1, _CHUNK // (n * t))
    for a in range(0, h, step):
        r = rank[a : a + step]
        first = r[:, t:].gather(1, dist.expand(r.shape[0], -1)).view(-1, n, t)
        torch.minimum(first, r[:, None, :t], out=first)  # [h', n, T]: the entry is covered for k > first
        mass[a : a + step].scatter_add_(1, first.add_(1).flatten(1), probs[a : a + step].flatten(1).double())
    return mass
