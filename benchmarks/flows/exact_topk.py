"""Exact max-logit block selection, a reference for the accuracy tables (not a published method,
not a built-in flow): a block's score is the largest q·k over its raw keys and the KV head's query
group, so it reads every key each step (the cost a block estimator exists to avoid)."""

from sparsetune.flow import DecodeFlow
from sparsetune.flow import ops as F


class ExactTopK(DecodeFlow):
    name = "exact_topk"
    source = "reference: exact per-token logits"
    uses_keys = True

    def index(self, q, fields):
        logits = F.gemm(fields["k"], q)  # [S, block, G]
        return F.topk(F.max(F.max(logits, dim=1), dim=2))
