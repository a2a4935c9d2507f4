"""Experiment (issue #43): two levels whose page score bounds a page's best unit more tightly than
its mean key. Each 16-token page keeps the mean keys of its four 4-token sub-blocks; a page scores
the best of their q · centroid (max over the KV head's group); inside the best `coarse` x budget
pages, 2-token units are scored by q · their own mean key. Page fields: 4 x head_dim per page (1/4
of the 2-token units' fields), read for every page; units' fields only for the kept pages.
"""

from sparsetune.flow import TwoLevelFlow
from sparsetune.flow import ops as F


class Sub4Pages2L(TwoLevelFlow):
    name = "sub4_2l"
    source = "experiment: pages by their best 4-token sub-block centroid, then mean-key units"

    def cache_page(self, k, v):
        n = k.shape[1]
        return {
            "c0": F.mean(F.mul(k, F.mask_slice(k, 0, n // 4, dim=1)), dim=1),
            "c1": F.mean(F.mul(k, F.mask_slice(k, n // 4, 2 * n // 4, dim=1)), dim=1),
            "c2": F.mean(F.mul(k, F.mask_slice(k, 2 * n // 4, 3 * n // 4, dim=1)), dim=1),
            "c3": F.mean(F.mul(k, F.mask_slice(k, 3 * n // 4, n, dim=1)), dim=1),
        }

    def index_page(self, q, fields):
        best = F.maximum(F.maximum(F.gemm(fields["c0"], q), F.gemm(fields["c1"], q)),
                         F.maximum(F.gemm(fields["c2"], q), F.gemm(fields["c3"], q)))  # [S, 1, G]
        return F.topk(F.max(best, dim=2))

    def cache(self, k, v):
        return {"centroid": F.mean(k, dim=1)}

    def index(self, q, fields):
        return F.topk(F.max(F.gemm(fields["centroid"], q), dim=2))
