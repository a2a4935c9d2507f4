"""DoubleSparse's label channels on block centroids: one mean key per block, on r channels.

DoubleSparse (Yang et al., 2024, arXiv 2408.07092) keeps every key on its KV head's r most important
channels (ranked offline by mean|q⊙k|, `sparsetune flows calibrate`) and scores tokens on them.
Block top-k (Kinetics, arXiv 2506.05333) keeps one mean key per block. Here each block keeps its
mean key on the r label channels, and a block scores max over the KV head's group of
q[chans] · centroid[chans]: small blocks' accuracy at r/head_dim of block top-k's field bytes (at
4-token blocks, 32 of the embedded model's 64 channels keep what block top-k keeps at 2K: BENCHMARKS.md).
"""

from sparsetune.flow import DecodeFlow, Param, Search
from sparsetune.flow import ops as F


class DoubleSparseCentroid(DecodeFlow):
    name = "double_sparse_centroid"
    source = "DoubleSparse, arXiv 2408.07092: label channels, on block centroids (Kinetics, arXiv 2506.05333)"
    calibrated = True
    calibration = Param("auto", doc="channel calibration file; auto: the default one of the model "
                        "(`sparsetune flows calibrate --model M`)")
    channels = Param(32, choices=(4, 8, 16, 32, 64, 128), doc="label channels r of every centroid (at most head_dim)",
                     search=Search(choices=(16, 32, 64)))

    def cache(self, k, v, const):
        return {"centroid": F.gemm(F.mean(k, dim=1), const["channels"])}  # [1, 1, r]: the block's label centroid

    def index(self, q, fields, const):
        return F.topk(F.max(F.gemm(fields["centroid"], F.gemm(q, const["channels"])), dim=2))
