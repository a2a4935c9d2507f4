"""H2O, heavy-hitter oracle (Zhang et al., 2023, arXiv 2306.14048; FMInference/H2O), at block level.

H2O keeps the keys with the largest *accumulated* attention (the sum of the softmax mass each
key has received from all queries so far) plus a recent window. Here, per KV head and block:
each decode step estimates the block's attention mass as a softmax over blocks of the best
query head's logit against the block's mean key, adds it to the block's running total (state
carried across steps with F.save, `decay` < 1 forgets slowly), and keeps the blocks with the
largest totals; the recent window is `local_blocks`. Differences from the paper: the mass is
estimated from centroids instead of exact per-token probabilities, selection is per KV group,
and a block's total starts when the block is cached (prefill attention is not counted).
"""

from sparsetune.flow import DecodeFlow, Param
from sparsetune.flow import ops as F


class H2O(DecodeFlow):
    name = "h2o"
    source = "H2O, arXiv 2306.14048"
    decay = Param(1.0, low=0.5, high=1.0, doc="multiplier of the running total each step (1: plain sum)")

    def cache(self, k, v):
        centroid = F.mean(k, dim=1)  # [1, 1, D]
        return {"centroid": centroid, "acc": F.fill(F.sum(centroid, dim=2), 0.0)}  # acc: [1, 1, 1]

    def index(self, q, fields):
        logit = F.max(F.gemm(fields["centroid"], q), dim=2)  # [S, 1, 1]
        mass = F.softmax(logit, dim=0, scale=q.shape[2] ** -0.5)  # over the sequence's blocks
        acc = F.add(F.scale(fields["acc"], alpha=self.decay), mass)
        F.save(fields, "acc", acc)
        return F.topk(acc)
