"""Two-level block top-k: mean-key centroids of pages, then of finer units inside the best pages (issue #43).

First level: each page scored by q · its mean key (Kinetics, arXiv 2506.05333), max over the KV
head's group; the best `coarse` x budget pages kept. Second level: inside those pages only, each
`select_block`-token unit scored by the same rule over its own keys, and the budget filled with the
best units. With no page stages of its own, the flow's stages run at both levels. The page stays
the KV page (and SGLang's).
"""

from sparsetune.flow import TwoLevelFlow
from sparsetune.flow import ops as F


class BlockTopK2L(TwoLevelFlow):
    name = "block_topk_2l"
    source = "Kinetics block top-k, arXiv 2506.05333, in two levels (pages, then units inside the best pages)"

    def cache(self, k, v):
        return {"centroid": F.mean(k, dim=1)}  # [1, 1, D]

    def index(self, q, fields):
        return F.topk(F.max(F.gemm(fields["centroid"], q), dim=2))  # [S, 1, G] -> [S, 1, 1]
