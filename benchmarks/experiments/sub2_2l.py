"""Experiment (issue #43): as `sub4_2l`, with the page scored by the best of its two 8-token
sub-block centroids (page fields: 2 x head_dim per page)."""

from sparsetune.flow import TwoLevelFlow
from sparsetune.flow import ops as F


class Sub2Pages2L(TwoLevelFlow):
    name = "sub2_2l"
    source = "experiment: pages by their best 8-token sub-block centroid, then mean-key units"

    def cache_page(self, k, v):
        n = k.shape[1]
        return {"c0": F.mean(F.mul(k, F.mask_slice(k, 0, n // 2, dim=1)), dim=1),
                "c1": F.mean(F.mul(k, F.mask_slice(k, n // 2, n, dim=1)), dim=1)}

    def index_page(self, q, fields):
        return F.topk(F.max(F.maximum(F.gemm(fields["c0"], q), F.gemm(fields["c1"], q)), dim=2))

    def cache(self, k, v):
        return {"centroid": F.mean(k, dim=1)}

    def index(self, q, fields):
        return F.topk(F.max(F.gemm(fields["centroid"], q), dim=2))
