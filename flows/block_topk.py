"""Block top-k with mean-key centroids (Kinetics, arXiv 2506.05333; Vortex `gqa_block_sparse_attention`).

Cache stage: the mean key of each block. Indexer: score every block by the dot product of each
query head of the KV head's group with the centroid, take the max over the group, and keep
the top-scoring blocks within the budget.
"""

from sparsetune.flow import DecodeFlow
from sparsetune.flow import ops as F


class BlockTopK(DecodeFlow):
    name = "block_topk"
    source = "Kinetics block top-k, arXiv 2506.05333"

    def cache(self, k, v):
        return {"centroid": F.mean(k, dim=1)}  # [1, 1, D]

    def index(self, q, fields):
        s = F.gemm(fields["centroid"], q)  # [S, 1, G]
        return F.topk(F.max(s, dim=2))  # [S, 1, 1]
