"""Quest (Tang et al., 2024, arXiv 2406.10774; mit-han-lab/Quest).

Cache stage: the channel-wise max and min of the block's (post-RoPE) keys. Indexer: the
upper bound of q·k inside a block, score = Σ_d max(q_d·max_d, q_d·min_d), per query head;
the KV head's group shares one selection, so a block's score is the max over the group.
Quest keeps the first two layers dense.
"""

from sparsetune.flow import DecodeFlow, Param
from sparsetune.flow import ops as F


class Quest(DecodeFlow):
    name = "quest"
    source = "Quest, arXiv 2406.10774"
    dense_layers = Param((0, 1), kind=tuple, doc="layers that keep full attention (Quest: the first two)")

    def cache(self, k, v):
        return {"kmax": F.max(k, dim=1), "kmin": F.min(k, dim=1)}  # [1, 1, D] each

    def index(self, q, fields):
        # Σ_d max(q_d·max_d, q_d·min_d) = max·relu(q) + min·min(q, 0), as max_d >= min_d: two
        # matrix-vector products (tensor cores in the generated indexer), the same sum as the paper's.
        upper = F.add(F.gemm(fields["kmax"], F.relu(q)), F.gemm(fields["kmin"], F.minimum(q, 0.0)))  # [S, 1, G]
        return F.topk(F.max(upper, dim=2))  # [S, 1, 1]
