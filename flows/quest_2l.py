"""Two-level Quest: Quest's bound picks pages, then the mean key picks units inside them (issue #43).

First level (`cache_page`, `index_page`): Quest (arXiv 2406.10774) over whole pages: the upper bound
of q·k from each page's channel-wise key max and min, max over the KV head's group; the best
`coarse` x budget pages are kept. Second level (`cache`, `index`): inside the kept pages only, each
`select_block`-token unit scored by q · its mean key (Kinetics, arXiv 2506.05333), and the budget
filled with the best units. A 2-token unit's max and min would cost as many bytes as its keys; its
mean costs half. The page stays the KV page (and SGLang's).
"""

from sparsetune.flow import Param, TwoLevelFlow
from sparsetune.flow import ops as F


class Quest2L(TwoLevelFlow):
    name = "quest_2l"
    source = "Quest, arXiv 2406.10774, over pages; mean-key units inside the best pages"
    dense_layers = Param((0, 1), kind=tuple, doc="layers that keep full attention (Quest: the first two)")

    def cache_page(self, k, v):
        return {"kmax": F.max(k, dim=1), "kmin": F.min(k, dim=1)}  # [1, 1, D] each

    def index_page(self, q, fields):
        # Σ_d max(q_d·max_d, q_d·min_d) = max·relu(q) + min·min(q, 0), as max_d >= min_d
        upper = F.add(F.gemm(fields["kmax"], F.relu(q)), F.gemm(fields["kmin"], F.minimum(q, 0.0)))  # [S, 1, G]
        return F.topk(F.max(upper, dim=2))

    def cache(self, k, v):
        return {"centroid": F.mean(k, dim=1)}  # [1, 1, D]

    def index(self, q, fields):
        return F.topk(F.max(F.gemm(fields["centroid"], q), dim=2))
