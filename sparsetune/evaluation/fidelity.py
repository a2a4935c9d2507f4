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

from dataclasses import dataclass
from typing import Any

import torch

_METRICS = ("cosine", "top1", "top10")


@dataclass
class FidelityTally:
    """Per-position sums, so turns and samples of any length pool into one micro-average; a
    sample record stores its sums (`to_record`) and summaries pool them back (`add_record`)."""

    cosine: float = 0.0
    top1: float = 0.0
    top10: float = 0.0
    positions: int = 0

    def add(self, flow: list[torch.Tensor], dense: list[torch.Tensor]) -> None:
        """Compare one turn's logits (`[V]` per position)."""
        n = min(len(flow), len(dense))
        if n == 0:
            return
        f = torch.stack(flow[:n]).double()
        d = torch.stack(dense[:n]).double()
        self.cosine += torch.nn.functional.cosine_similarity(f, d, dim=-1).sum().item()
        self.top1 += (f.argmax(-1) == d.argmax(-1)).double().sum().item()
        k = min(10, f.shape[-1])
        tf, td = f.topk(k, dim=-1).indices, d.topk(k, dim=-1).indices
        self.top10 += ((tf.unsqueeze(-1) == td.unsqueeze(-2)).any(-1).double().sum(-1) / k).sum().item()
        self.positions += n

    def to_record(self) -> dict[str, Any]:
        return {f"{m}_sum": getattr(self, m) for m in _METRICS} | {"positions": self.positions}

    def add_record(self, record: dict[str, Any]) -> None:
        for m in _METRICS:
            setattr(self, m, getattr(self, m) + record[f"{m}_sum"])
        self.positions += record["positions"]

    def summary(self) -> dict[str, float | int] | None:
        if self.positions == 0:
            return None
        n = self.positions
        return {m: round(getattr(self, m) / n, 6) for m in _METRICS} | {"positions": int(n)}
