"""Two-level DoubleSparse: pages by their best sub-block on calibrated channels, then units (issue #43).

A page's mean key is too weak a filter for 2-token units inside it (block_topk_2l); the best of its
four sub-block centroids bounds its best unit far more tightly, and DoubleSparse's label channels
(Yang et al., 2024, arXiv 2408.07092: each layer's KV-head channels ranked offline by mean|q⊙k|,
`sparsetune flows calibrate`) make both levels cheap. First level: each page keeps the mean keys
of its four sub-blocks restricted to the `channels` best channels; a page scores the best of
q[chans] · centroid (max over the KV head's group); the best `coarse` x budget pages are kept.
Second level: inside those pages only, each `select_block`-token unit scored by q[chans] · its own
mean key on the same channels (Kinetics' block centroid, arXiv 2506.05333), and the budget filled
with the best units. The page stays the KV page (and SGLang's).
"""

from sparsetune.flow import Param, Search, TwoLevelFlow
from sparsetune.flow import ops as F


class DoubleSparse2L(TwoLevelFlow):
    name = "double_sparse_2l"
    source = "DoubleSparse, arXiv 2408.07092, in two levels: pages by their best sub-block, then units, on label channels"
    calibrated = True
    calibration = Param("auto", doc="channel calibration file; auto: the default one of the model "
                        "(`sparsetune flows calibrate --model M`)")
    channels = Param(32, choices=(8, 16, 32, 64, 128), doc="label channels r of every centroid (at most head_dim)",
                     search=Search(choices=(16, 32, 64)))

    def cache_page(self, k, v, const):
        n = k.shape[1]
        return {f"c{i}": F.gemm(F.mean(F.mul(k, F.mask_slice(k, i * n // 4, (i + 1) * n // 4, dim=1)), dim=1),
                                const["channels"]) for i in range(4)}  # [1, 1, r] each: a sub-block's label centroid

    def index_page(self, q, fields, const):
        ql = F.gemm(q, const["channels"])  # [1, G, r]
        best = F.maximum(F.maximum(F.gemm(fields["c0"], ql), F.gemm(fields["c1"], ql)),
                         F.maximum(F.gemm(fields["c2"], ql), F.gemm(fields["c3"], ql)))  # [S, 1, G]
        return F.topk(F.max(best, dim=2))

    def cache(self, k, v, const):
        return {"centroid": F.gemm(F.mean(k, dim=1), const["channels"])}  # [1, 1, r]

    def index(self, q, fields, const):
        return F.topk(F.max(F.gemm(fields["centroid"], F.gemm(q, const["channels"])), dim=2))
