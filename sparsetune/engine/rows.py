"""A forward over a subset of one sequence's rows, chosen per layer by the caller.

`CausalLM.forward(ids[rows.positions], rows=rows)` runs the decoder over the rows a `Rows` holds
instead of a batch through the attention backends. Per layer, after the input norm and q/k/v +
RoPE at `positions`, the model's layer calls

- `write_kv`: asks `continuing` which rows go on past this layer (it sees the rows' fresh q/k/v,
  and the pool still holds the KV this store overwrites) and `keep_cached` which (row, KV head)
  pairs keep the pool's KV instead of the fresh one; stores the rest at the rows' slots; narrows
  q, the residual and `positions` to the continuing rows;
- `attention`: those rows attend over the sequence's first `num_tokens` keys in the pool, row i
  seeing keys 0..i, narrowed per head by `attention_pattern`: a mask function, or one of the
  structured patterns below, which on CUDA run block-sparse in `kernels/rows_attention` (key tiles
  no row sees are not read), as do scattered rows without a pattern; rows that are all long
  consecutive runs (a full recompute) take the flash causal call, and the torch path (CPU, or a
  mask function) runs SDPA; all of them read the keys gathered from the pool once per layer
  (`KVCache.gather`: contiguous tiles beat paged gathers by far more than the copy costs);
- `mlp`: the MLP of the rows `mlp_rows` names; the others take the residual path.

The hooks return None by default: every row goes on, stores fresh KV, attends causally and runs the
MLP, so a `Rows` over all of a sequence's tokens is a plain prefill. The reuse executor's plan
(`reuse/executor.py`) overrides them.

`RowsBatch` runs several sequences' `Rows` in one forward: their rows are packed, so the projections
and the MLP run once for all of them; each member stores its KV, narrows and attends over its own
sequence. This is how the scheduler runs a prefill step that holds a `PlannedPrefill` (a request
whose prefill is a plan of rows: a reuse request, or a cache-building fill of a stored segment)
beside other plans and plain prompts' chunks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Union

import numpy as np
import torch
import torch.nn.functional as F

from sparsetune.engine.attention import causal_sdpa, prefill_backends
from sparsetune.engine.kv_cache import KVCache
from sparsetune.engine.ranges import stage
from sparsetune.kernels import line_select
from sparsetune.kernels.rows_attention import lines_attention, rows_attention

MaskFn = Callable[[torch.Tensor], torch.Tensor]  # row positions [n] → allowed keys [Hq, n, T] bool

_MASK_CHUNK_ELEMS = 1 << 26  # rows per masked attention call: a [Hq, rows, T] mask of ~64 M entries
_MIN_RUN = 64  # consecutive rows worth a causal call of their own


@dataclass
class HeadWindows:
    """Per KV head h, a row at p sees key j <= p iff j < sinks[h] or p - j < windows[h] (RedKnot's
    local heads: sinks and a window; a global head: no sinks, a window of `UNBOUNDED`). Called with
    row positions, it is the mask function it stands for, `[Hq, n, T]` (`group` query heads per KV head)."""

    sinks: torch.Tensor  # [Hkv] int
    windows: torch.Tensor  # [Hkv] int
    group: int
    num_tokens: int
    UNBOUNDED = 2**31 - 1

    def __call__(self, pos: torch.Tensor) -> torch.Tensor:
        keys = torch.arange(self.num_tokens, device=pos.device)
        sinks, windows = self.sinks.to(pos.device)[:, None, None], self.windows.to(pos.device)[:, None, None]
        near = (keys[None, None, :] < sinks) | (pos[None, :, None] - keys[None, None, :] < windows)  # [Hkv, n, T]
        return near.repeat_interleave(self.group, 0)

    def pairs(self, pos: torch.Tensor) -> torch.Tensor:
        """(row, key) pairs the rows at `pos` attend, summed over rows, averaged over heads (float64)."""
        p1 = pos.double()[None, :] + 1  # keys 0..p
        w, s = self.windows.to(pos.device).double()[:, None], self.sinks.to(pos.device).double()[:, None]
        seen = torch.minimum(w, p1) + (torch.minimum(s, p1 - w)).clamp(min=0)  # the window, then sinks before it
        return seen.sum(1).mean()


@dataclass
class Lines:
    """Per query head h, a row at p sees key j <= p iff `vertical[h, j]` or `slash[h, p - j]`
    (LoopServe's vertical and slash lines; `[Hq, T]` bool each, slash indexed by distance). Called
    with row positions, it is the mask function it stands for, `[Hq, n, T]`."""

    vertical: torch.Tensor
    slash: torch.Tensor

    distances = staticmethod(line_select.distances)  # `[n, T]`: the slash line each (row, key) entry is on

    def __call__(self, pos: torch.Tensor) -> torch.Tensor:
        h, t = self.vertical.shape
        by_slash = self.slash.gather(1, self.distances(pos, t).flatten().expand(h, -1)).view(h, pos.numel(), t)
        return self.vertical[:, None, :] | by_slash

    def pairs(self, pos: torch.Tensor) -> torch.Tensor:
        """(row, key) pairs the rows at `pos` attend (the lines and the own key), summed over rows,
        averaged over heads (float64). Per head and row p: vertical keys <= p + slash distances <= p
        - keys on both (sum_j vertical[j] slash[p - j], a convolution, by FFT) + the own key if on neither."""
        v, s = self.vertical.double(), self.slash.double()
        t = v.shape[1]
        both = torch.fft.irfft(torch.fft.rfft(v, 2 * t) * torch.fft.rfft(s, 2 * t), 2 * t)[:, :t].round()
        union = v.cumsum(1) + s.cumsum(1) - both + (1 - torch.maximum(v, s[:, :1]))
        return union[:, pos].sum(1).mean()


AttentionPattern = Union[MaskFn, HeadWindows, Lines]


def use_kernels(q: torch.Tensor) -> bool:
    """Whether the rows' attention runs in the Triton kernels (CUDA) or the torch path."""
    return q.is_cuda


class Rows:
    """One sequence's rows `positions` (sorted, int64) of `num_tokens`, whose KV lives in `kv` at
    `block_table`; the hooks below choose what each layer computes (see the module docstring)."""

    def __init__(self, kv: KVCache, block_table: torch.Tensor, num_tokens: int, positions: torch.Tensor,
                 scale: float) -> None:
        self.kv, self.block_table, self.num_tokens, self.scale = kv, block_table, num_tokens, scale
        self.slots = kv.slots(block_table, torch.arange(num_tokens, device=kv.k.device))  # [T] every token's
        # Σ over layers of the (row, key) pairs attended, averaged over query heads: the attention's
        # FLOPs are 4 · head_dim · Hq · this (perf.cost.prefill_flops). Counted on the device.
        self.attention_pairs = torch.zeros((), dtype=torch.float64, device=kv.k.device)
        self.set_rows(positions)

    def set_rows(self, positions: torch.Tensor) -> None:
        """The rows computed from here on."""
        self.positions = positions
        self.row_slots = self.slots[positions]
        self._runs: CausalRuns | None = None

    @property
    def runs(self) -> CausalRuns:
        """How the torch path splits the rows into attention calls (one host copy, on first use)."""
        if self._runs is None:
            self._runs = CausalRuns.of(self.positions)
        return self._runs

    # ---- the hooks ----------------------------------------------------------------------------------

    def continuing(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        """Indices (into the current rows) of the rows that go on past this layer's KV store; None: all."""
        return None

    def keep_cached(self, layer: int) -> torch.Tensor | None:
        """`[n, Hkv]` bool: the (row, KV head) pairs whose KV in the pool is kept (not overwritten)."""
        return None

    def attention_pattern(self, layer: int, q: torch.Tensor, keys: Callable[[], torch.Tensor]) -> AttentionPattern | None:
        """Per head, the keys a row may see (AND-ed with the causal mask; its own key always stays),
        from the rows' queries `[n, Hq, D]` and `keys()`, the keys `[Hkv, T, D]` as attention reads
        them (gathered from the pool on the first call only)."""
        return None

    def mlp_rows(self, layer: int) -> torch.Tensor | None:
        """`[n]` bool: the rows that run the MLP; None: all."""
        return None

    # ---- what the model's layer calls ---------------------------------------------------------------

    def write_kv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the rows' fresh K/V (but the pairs `keep_cached` names) → q and residual of the continuing rows."""
        sub = self.store_kv(layer, q, k, v)
        if sub is None:
            return q, residual
        self.set_rows(self.positions[sub])
        return q[sub], residual[sub]

    def store_kv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        """`write_kv`'s store: the rows' fresh K/V at their slots (but the pairs `keep_cached` names);
        returns `continuing`'s answer, the rows that go on past this layer (None: all), for the caller
        to narrow to (the engine at once; a host whose layer runs whole, SGLang's, after the layer)."""
        sub = self.continuing(layer, q, k, v)
        keep = self.keep_cached(layer)
        if keep is not None:
            kc, vc = self.kv.read(layer, self.row_slots)
            m = keep[:, :, None]
            k, v = torch.where(m, kc, k), torch.where(m, vc, v)
        with stage("kv_store"):
            self.kv.store(layer, k, v, self.row_slots)
        return sub

    def attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q `[n, Hq, D]` of the rows over the sequence's KV in the pool → `[n, Hq, D]`."""
        if not self.positions.numel():
            return torch.empty_like(q)
        gathered = functools.cache(lambda: self.kv.gather(layer, self.block_table, self.num_tokens))  # [Hkv, T, D] x 2
        pattern = self.attention_pattern(layer, q, lambda: gathered()[0])
        structured = isinstance(pattern, (HeadWindows, Lines))
        if pattern is None:
            self.attention_pairs += (self.positions + 1).sum()
        elif structured:
            self.attention_pairs += pattern.pairs(self.positions)
        # All rows in long consecutive runs (a full recompute, a layer recomputing every row): the flash
        # causal kernels beat the row kernel there; a mixed set runs in the row kernel whole (measured
        # faster than splitting it: BENCHMARKS.md, #18).
        # The kernels read the gathered KV, not the pool: contiguous tiles (TMA on Hopper) beat the paged
        # gathers by far more than the gather costs (32K, H100: 5.94 ms with it vs 8.39 ms paged; BENCHMARKS.md, #18).
        k, v = gathered()
        if use_kernels(q) and (structured or (pattern is None and self.runs.rest is not None)):
            with stage("attention"):
                if isinstance(pattern, Lines):
                    return lines_attention(q, self.positions, k, v, self.scale, pattern.vertical, pattern.slash)
                sinks, windows = (None, None) if pattern is None else (pattern.sinks, pattern.windows)
                return rows_attention(q, self.positions, k, v, self.scale, sinks=sinks, windows=windows)
        if pattern is None:
            return attend_causal(q, self.positions, k, v, self.runs, self.scale)
        return attend_pattern(q, self.positions, k, v, pattern, self.scale,
                              pairs=None if structured else self.attention_pairs)

    def mlp(self, layer: int, mlp: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return masked_mlp(mlp, h, self.mlp_rows(layer))


class PlannedPrefill:
    """A request prefilled by a plan of rows instead of in full (`Sequence.plan`): the engine's side of a
    reuse request (`reuse/executor.py`), so the engine schedules one without knowing what it reuses.

    The scheduler calls `admit(num_cached)` when it first reaches the request, after giving it the
    prefix-cache blocks its prompt starts with (`num_cached` tokens of exact KV, shared with other
    requests: the plan never writes them, and computes their rows only where its selection needs
    them): the plan takes what it reuses (acquired so nothing evicts it) and returns the
    cache-building requests that must run first (themselves `PlannedPrefill`s with `cache_only`), or
    None when the pool has no room yet; the request's own blocks are taken then too (or, if they do
    not fit, `cancel()` and those requests' `cancel()` undo the admission, to be tried again after a
    step; the prefix blocks stay, as a plain prompt's do while it waits for room). It runs
    the request once `ready()`, whole in one prefill step (never chunked: a plan's selection may need
    every row of a layer), costing `num_rows()` of the step's token budget. `rows(table)` writes the
    reused KV into the request's blocks and returns the rows to compute; `done()` follows the step.
    `cancel()` gives back what `admit` took (an aborted request)."""

    cache_only: bool = False  # True: fills blocks it does not own (a stored segment's); samples no token

    def admit(self, num_cached: int = 0) -> list | None:
        return []

    def wanted(self) -> bool:
        """False: nobody waits for it any more (a fill whose requests were aborted); the scheduler drops it."""
        return True

    def ready(self) -> bool:
        return True

    def num_rows(self) -> int:
        raise NotImplementedError

    def rows(self, block_table: torch.Tensor) -> Rows:
        raise NotImplementedError

    def done(self) -> None:
        """After the step that ran `rows` (its logits sampled)."""

    def cancel(self) -> None:
        """The request is aborted: give back what `admit` took."""


class RowsBatch:
    """Several sequences' `Rows` run as one forward (see the module docstring): the packed rows go
    through the projections and the MLP together; KV stores, narrowing and attention are per member."""

    def __init__(self, members: list[Rows]) -> None:
        self.members = members
        self._sizes = [m.positions.numel() for m in members]
        self._positions: torch.Tensor | None = None

    @property
    def positions(self) -> torch.Tensor:
        if self._positions is None:
            self._positions = torch.cat([m.positions for m in self.members])
        return self._positions

    def last_rows(self) -> list[int]:
        """Each member's last row among the packed rows the forward ends with."""
        ends = np.cumsum(self._sizes)
        return [int(e) - 1 for e in ends]

    def write_kv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.narrow(self.store_kv(layer, q, k, v), q, residual)

    def store_kv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list | None:
        """Each member's `Rows.store_kv`: their answers (None: every member's rows go on)."""
        subs = [m.store_kv(layer, qi, ki, vi) for m, qi, ki, vi in zip(self.members, *(x.split(self._sizes) for x in (q, k, v)))]
        return None if all(s is None for s in subs) else subs

    def narrow(self, subs: list | None, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each member to the rows `store_kv` said go on, and the packed tensors `xs` with them."""
        if subs is None:
            return xs
        parts = [x.split(self._sizes) for x in xs]
        out = [[] for _ in xs]
        for i, (m, sub) in enumerate(zip(self.members, subs)):
            if sub is not None:
                m.set_rows(m.positions[sub])
            for j in range(len(xs)):
                out[j].append(parts[j][i] if sub is None else parts[j][i][sub])
        self._sizes = [m.positions.numel() for m in self.members]
        self._positions = None
        return tuple(torch.cat(o) for o in out)

    def attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return torch.cat([m.attention(layer, qi) for m, qi in zip(self.members, q.split(self._sizes))])

    def mlp(self, layer: int, mlp: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        masks = [m.mlp_rows(layer) for m in self.members]
        if all(x is None for x in masks):
            return mlp(h)
        return masked_mlp(mlp, h, torch.cat([torch.ones(n, dtype=torch.bool, device=h.device) if x is None
                                             else x.to(h.device) for n, x in zip(self._sizes, masks)]))


def masked_mlp(mlp: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The MLP of the rows `keep` names (None: all); the others take the residual path (a zero output)."""
    if keep is None:
        return mlp(h)
    out, sub = torch.zeros_like(h), keep.to(h.device).nonzero().squeeze(1)
    out[sub] = mlp(h[sub])
    return out


@dataclass
class CausalRuns:
    """How a row set attends. A run of consecutive positions [a, b) (row indices; keys 0..end-1) is
    one causal call with bottom-right alignment, exact for consecutive rows and run by the
    flash/cuDNN kernels, which skip the masked half; the scattered rest (`rest` row indices) shares
    one call with an explicit per-row mask over keys 0..rest_end-1 (its cost is rows × rest_end)."""

    runs: list[tuple[int, int, int]]
    rest: torch.Tensor | None
    rest_end: int

    @staticmethod
    def of(positions: torch.Tensor) -> CausalRuns:
        pos = positions.cpu().numpy()
        cut = np.flatnonzero(np.diff(pos) != 1) + 1
        starts, ends = np.r_[0, cut], np.r_[cut, len(pos)]
        long = ends - starts >= _MIN_RUN
        runs = [(int(a), int(b), int(pos[b - 1]) + 1) for a, b in zip(starts[long], ends[long])]
        rest_rows = np.flatnonzero(np.repeat(~long, ends - starts))
        if not len(rest_rows):
            return CausalRuns(runs, None, 0)
        return CausalRuns(runs, torch.from_numpy(rest_rows).to(positions.device), int(pos[rest_rows].max()) + 1)


def attend_causal(q: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: CausalRuns,
                  scale: float) -> torch.Tensor:
    """Rows at sorted positions `pos` (q `[n, Hq, D]`) over keys `[Hkv, T, D]`, row i seeing keys 0..i."""
    qh = q.transpose(0, 1)  # [Hq, n, D]
    out = torch.empty_like(qh)
    with stage("attention"), prefill_backends():
        for a, b, end in runs.runs:
            out[:, a:b] = causal_sdpa(qh[:, a:b], k[:, :end], v[:, :end], end - (b - a), scale)
        if runs.rest is not None:
            sel, end = runs.rest, runs.rest_end
            mask = torch.arange(end, device=q.device)[None, :] <= pos[sel][:, None]
            out[:, sel] = F.scaled_dot_product_attention(
                qh[:, sel].unsqueeze(0), k[:, :end].unsqueeze(0), v[:, :end].unsqueeze(0), attn_mask=mask,
                scale=scale, enable_gqa=True).squeeze(0)
    return out.transpose(0, 1)  # [n, Hq, D]


def attend_pattern(q: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: AttentionPattern,
                   scale: float, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """Like `attend_causal`, each head's rows seeing only the keys `pattern` allows (and their own key);
    chunks of rows bound the `[Hq, rows, T]` mask. `pairs`: a counter the attended (row, key) pairs,
    averaged over heads, are added to."""
    qh, t = q.transpose(0, 1), k.shape[1]
    out = torch.empty_like(qh)
    keys = torch.arange(t, device=q.device)
    step = max(1, _MASK_CHUNK_ELEMS // (qh.shape[0] * t))
    with stage("attention"), prefill_backends():
        for a in range(0, pos.numel(), step):
            p = pos[a : a + step]
            end = int(p[-1]) + 1
            mask = pattern(p).to(q.device)[:, :, :end] & (keys[None, None, :end] <= p[None, :, None])
            mask |= keys[None, None, :end] == p[None, :, None]
            if pairs is not None:
                pairs += mask.sum(dtype=torch.float64) / mask.shape[0]
            out[:, a : a + step] = F.scaled_dot_product_attention(
                qh[:, a : a + step].unsqueeze(0), k[:, :end].unsqueeze(0), v[:, :end].unsqueeze(0),
                attn_mask=mask.unsqueeze(0), scale=scale, enable_gqa=True).squeeze(0)
    return out.transpose(0, 1)
