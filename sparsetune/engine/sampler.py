"""Next-token sampling: greedy, or temperature with nucleus (top-p) filtering."""

from __future__ import annotations

import torch

from sparsetune.engine.ranges import stage


def sample(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """`logits [B, V]` float32 → token ids `[B]`. Rows with temperature 0 take the argmax."""
    with stage("sampling"):
        return _sample(logits, temperatures, top_ps, generator)


def _sample(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    greedy = logits.argmax(dim=-1)
    if bool((temperatures == 0).all()):
        return greedy
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(logits / t.unsqueeze(-1), dim=-1)
    if bool((top_ps < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_ps.unsqueeze(-1)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.where(temperatures > 0, drawn, greedy)
