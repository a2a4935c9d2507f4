"""Two-level sphere: pages by the bounding-sphere score, then mean-key units inside the best pages (issue #43).

First level (`cache_page`, `index_page`): each page keeps its mean key c and its radius
r = max_i |k_i - c|, and scores q·c + `radius_weight` x |q| r, max over the KV head's group (the
`sphere` flow's rule; at w = 1 the bound of the page's best q·k); the best `coarse` x budget pages
are kept. Second level (`cache`, `index`): inside them only, each `select_block`-token unit scored by
q · its mean key (Kinetics, arXiv 2506.05333), and the budget filled with the best units. The radius
keeps a page with one key unlike the rest, which its mean averages away: its pages keep more of the
attention mass than block_topk_2l's, yet on 80 held-out prompts at 2K and 1/8 it kept 79% of dense,
about what block_topk_2l keeps (BENCHMARKS.md "sphere_2l on prompts no search saw"). The page stays
the KV page (and SGLang's).
"""

from sparsetune.flow import Param, Search, TwoLevelFlow
from sparsetune.flow import ops as F


class Sphere2L(TwoLevelFlow):
    name = "sphere_2l"
    source = "bounding-sphere page scores, then mean-key units (Kinetics, arXiv 2506.05333) inside the best pages"
    radius_weight = Param(0.25, low=0.0, high=4.0, kind=float, doc="w: weight of |q| x the page's radius "
                          "(0: block_topk_2l; 1: the sphere's upper bound of q·k)", search=Search(low=0.0, high=1.0))

    def cache_page(self, k, v):
        c = F.mean(k, dim=1)  # [1, 1, D]
        return {"centroid": c, "radius": F.max(F.l2norm(F.sub(k, c), dim=2), dim=1)}  # radius: [1, 1, 1]

    def index_page(self, q, fields):
        qn = F.transpose(F.l2norm(q, dim=2))  # [1, 1, G]
        s = F.add(F.gemm(fields["centroid"], q), F.mul(fields["radius"], F.scale(qn, alpha=self.radius_weight)))
        return F.topk(F.max(s, dim=2))  # [S, 1, 1]

    def cache(self, k, v):
        return {"centroid": F.mean(k, dim=1)}  # [1, 1, D]

    def index(self, q, fields):
        return F.topk(F.max(F.gemm(fields["centroid"], q), dim=2))
