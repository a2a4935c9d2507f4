"""Global and local KV heads (RedKnot): the head classes a head profile's scores imply."""

from __future__ import annotations

import torch


def global_heads(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """`[layers, kv_heads]` bool: the top `ratio` of all heads by score (at least one when ratio > 0)."""
    flat = scores.flatten()
    count = min(flat.numel(), max(1 if ratio > 0 else 0, round(ratio * flat.numel())))
    out = torch.zeros(flat.numel(), dtype=torch.bool)
    out[flat.argsort(descending=True, stable=True)[:count]] = True
    return out.view_as(scores)
