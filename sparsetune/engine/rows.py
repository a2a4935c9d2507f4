"""Attention of a subset of one sequence's rows over its KV in the pool: exact per-row causal masks
(consecutive rows as causal runs, scattered rows in one masked call), optionally narrowed per head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from sparsetune.engine.attention import causal_sdpa, prefill_backends
from sparsetune.engine.stages import stage

AttentionPattern = Callable[[torch.Tensor], torch.Tensor]  # row positions [n] → allowed keys [Hq, n, T] bool

_MASK_CHUNK_ELEMS = 1 << 26  # rows per masked attention call: a [Hq, rows, T] mask of ~64 M entries
_MIN_RUN = 64  # consecutive rows worth a causal call of their own


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
