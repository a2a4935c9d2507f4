"""A forward over a subset of one sequence's rows, chosen per layer by the caller.

`CausalLM.forward(ids[rows.positions], rows=rows)` runs the decoder over the rows a `Rows` holds
instead of a batch through the attention backends. Per layer, after the input norm and q/k/v +
RoPE at `positions`, the model's layer calls

- `write_kv`: asks `continuing` which rows go on past this layer (it sees the rows' fresh q/k/v,
  and the pool still holds the KV this store overwrites) and `keep_cached` which (row, KV head)
  pairs keep the pool's KV instead of the fresh one; stores the rest at the rows' slots; narrows
  q, the residual and `positions` to the continuing rows;
- `attention`: those rows attend over the sequence's first `num_tokens` keys in the pool, row i
  seeing keys 0..i, narrowed per head by `attention_pattern`;
- `mlp`: the MLP of the rows `mlp_rows` names; the others take the residual path.

The hooks return None by default: every row goes on, stores fresh KV, attends causally and runs the
MLP, so a `Rows` over all of a sequence's tokens is a plain prefill. The reuse executor's plan
(`reuse/executor.py`) overrides them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from sparsetune.engine.attention import causal_sdpa, prefill_backends
from sparsetune.engine.kv_cache import KVCache
from sparsetune.engine.stages import stage

AttentionPattern = Callable[[torch.Tensor], torch.Tensor]  # row positions [n] → allowed keys [Hq, n, T] bool

_MASK_CHUNK_ELEMS = 1 << 26  # rows per masked attention call: a [Hq, rows, T] mask of ~64 M entries
_MIN_RUN = 64  # consecutive rows worth a causal call of their own


class Rows:
    """One sequence's rows `positions` (sorted, int64) of `num_tokens`, whose KV lives in `kv` at
    `block_table`; the hooks below choose what each layer computes (see the module docstring)."""

    def __init__(self, kv: KVCache, block_table: torch.Tensor, num_tokens: int, positions: torch.Tensor,
                 scale: float) -> None:
        self.kv, self.block_table, self.num_tokens, self.scale = kv, block_table, num_tokens, scale
        self.slots = kv.slots(block_table, torch.arange(num_tokens, device=kv.k.device))  # [T] every token's
        self.set_rows(positions)

    def set_rows(self, positions: torch.Tensor) -> None:
        """The rows computed from here on (one host copy plans their attention calls)."""
        self.positions = positions
        self.row_slots = self.slots[positions]
        self.runs = CausalRuns.of(positions)

    # ---- the hooks ----------------------------------------------------------------------------------

    def continuing(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        """Indices (into the current rows) of the rows that go on past this layer's KV store; None: all."""
        return None

    def keep_cached(self, layer: int) -> torch.Tensor | None:
        """`[n, Hkv]` bool: the (row, KV head) pairs whose KV in the pool is kept (not overwritten)."""
        return None

    def attention_pattern(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> AttentionPattern | None:
        """Per head, the keys a row may see (AND-ed with the causal mask; its own key always stays),
        from the rows' queries `[n, Hq, D]` and the keys `[Hkv, T, D]` as attention reads them."""
        return None

    def mlp_rows(self, layer: int) -> torch.Tensor | None:
        """`[n]` bool: the rows that run the MLP; None: all."""
        return None

    # ---- what the model's layer calls ---------------------------------------------------------------

    def write_kv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the rows' fresh K/V (but the pairs `keep_cached` names) → q and residual of the continuing rows."""
        sub = self.continuing(layer, q, k, v)
        keep = self.keep_cached(layer)
        if keep is not None:
            kc, vc = self.kv.read(layer, self.row_slots)
            m = keep[:, :, None]
            k, v = torch.where(m, kc, k), torch.where(m, vc, v)
        self.kv.store(layer, k, v, self.row_slots)
        if sub is None:
            return q, residual
        self.set_rows(self.positions[sub])
        return q[sub], residual[sub]

    def attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q `[n, Hq, D]` of the rows over the sequence's KV in the pool → `[n, Hq, D]`."""
        k, v = self.kv.gather(layer, self.block_table, self.num_tokens)  # [Hkv, T, D]
        pattern = self.attention_pattern(layer, q, k)
        if pattern is None:
            return attend_causal(q, self.positions, k, v, self.runs, self.scale)
        return attend_pattern(q, self.positions, k, v, pattern, self.scale)

    def mlp(self, layer: int, mlp: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        m = self.mlp_rows(layer)
        if m is None:
            return mlp(h)
        out, sub = torch.zeros_like(h), m.to(h.device).nonzero().squeeze(1)  # the rest: a zero MLP output
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
                   scale: float) -> torch.Tensor:
    """Like `attend_causal`, each head's rows seeing only the keys `pattern` allows (and their own key);
    chunks of rows bound the `[Hq, rows, T]` mask."""
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
            out[:, a : a + step] = F.scaled_dot_product_attention(
                qh[:, a : a + step].unsqueeze(0), k[:, :end].unsqueeze(0), v[:, :end].unsqueeze(0),
                attn_mask=mask.unsqueeze(0), scale=scale, enable_gqa=True).squeeze(0)
    return out.transpose(0, 1)
