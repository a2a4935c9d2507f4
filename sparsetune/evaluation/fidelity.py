"""Fidelity to dense: how closely a flow's next-token distributions follow full attention's.

The RedKnot metrics (seed 001, Table 4), taken at every generated position rather than the first
only: the dense run's output is teacher-forced through the flow, so both see the same tokens, and
the logit vectors are compared position by position.
  cosine: cosine similarity of the two logit vectors
  top1:   1 if both pick the same greedy token
  top10:  |top-10(flow) ∩ top-10(dense)| / 10
For a decode flow the first generated position comes from the (dense) prefill and so always agrees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FidelityTally:
    """Per-position sums, so samples of any length pool into one micro-average."""

    cosine: float = 0.0
    top1: float = 0.0
    top10: float = 0.0
    positions: int = 0
    per_task: dict[str, "FidelityTally"] = field(default_factory=dict)

    def add(self, flow: list[torch.Tensor], dense: list[torch.Tensor], task: str | None = None) -> dict[str, float]:
        """Compare one turn's logits (`[V]` per position); returns that turn's means."""
        n = min(len(flow), len(dense))
        if n == 0:
            return {"cosine": float("nan"), "top1": float("nan"), "top10": float("nan"), "positions": 0}
        f = torch.stack(flow[:n]).double()
        d = torch.stack(dense[:n]).double()
        cos = torch.nn.functional.cosine_similarity(f, d, dim=-1)
        top1 = (f.argmax(-1) == d.argmax(-1)).double()
        k = min(10, f.shape[-1])
        tf, td = f.topk(k, dim=-1).indices, d.topk(k, dim=-1).indices
        top10 = (tf.unsqueeze(-1) == td.unsqueeze(-2)).any(-1).double().sum(-1) / k
        sums = {"cosine": cos.sum().item(), "top1": top1.sum().item(), "top10": top10.sum().item()}
        for tally in [self] + ([self.per_task.setdefault(task, FidelityTally())] if task else []):
            tally.cosine += sums["cosine"]
            tally.top1 += sums["top1"]
            tally.top10 += sums["top10"]
            tally.positions += n
        return {k: v / n for k, v in sums.items()} | {"positions": n}

    def summary(self) -> dict[str, float | int] | None:
        if self.positions == 0:
            return None
        n = self.positions
        return {"cosine": round(self.cosine / n, 6), "top1": round(self.top1 / n, 6),
                "top10": round(self.top10 / n, 6), "positions": n}
