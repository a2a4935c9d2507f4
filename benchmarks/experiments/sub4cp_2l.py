"""Experiment (issue #43): double_sparse_2l's page score with full-width units. Each 16-token page keeps the
mean keys of its four 4-token sub-blocks restricted to the layer's `channels` best channels
(DoubleSparse's calibration, `sparsetune flows calibrate`); a page scores the best of their
q[chans] · centroid (max over the KV head's group); inside the best `coarse` x budget pages, 2-token
units are scored by q · their full mean key, as block_topk_2l's. Page fields: 4 x channels a page.
"""

from sparsetune.flow import Param, TwoLevelFlow
from sparsetune.flow import ops as F


class Sub4ChannelPages2L(TwoLevelFlow):
    name = "sub4cp_2l"
    source = "experiment: pages by their best 4-token sub-block centroid on calibrated channels, units by their full mean key"
    calibrated = True
    calibration = Param("auto", doc="channel calibration file; auto: the model's default one")
    channels = Param(16, choices=(4, 8, 16, 32, 64), doc="channels r of each centroid (at most head_dim)")

    def cache_page(self, k, v, const):
        n = k.shape[1]
        c = const["channels"]
        return {f"c{i}": F.gemm(F.mean(F.mul(k, F.mask_slice(k, i * n // 4, (i + 1) * n // 4, dim=1)), dim=1), c)
                for i in range(4)}

    def index_page(self, q, fields, const):
        ql = F.gemm(q, const["channels"])
        best = F.maximum(F.maximum(F.gemm(fields["c0"], ql), F.gemm(fields["c1"], ql)),
                         F.maximum(F.gemm(fields["c2"], ql), F.gemm(fields["c3"], ql)))
        return F.topk(F.max(best, dim=2))

    def cache(self, k, v):
        return {"centroid": F.mean(k, dim=1)}

    def index(self, q, fields):
        return F.topk(F.max(F.gemm(fields["centroid"], q), dim=2))
