"""Segment reuse with query-driven sparse recomputation, after SparseX (arXiv 2606.01751, Alg. 1).

No SparseX code is public; this follows the paper's algorithm. Layers before the boundary run
every token (full attention). At the boundary, Sparse-Q, the queries of all non-reused tokens,
score each reused token by the attention it receives, s_j = Σ_i softmax(Q_sq Kᵀ/√d)[i, j]
(aggregated over heads), and the top `ratio` of the reused tokens are kept. Overflow adds one block
of reused tokens on each side of every non-reused span (the seams), and when the prompt ends in
reused text the last 64 tokens of the final segment are added (tail fallback). From the boundary on
only these rows and the non-reused tokens are recomputed.
"""

from sparsetune.flow import Param, Search
from sparsetune.reuse import ReuseFlow, RATIO_SEARCH

BOUNDARY_SHARE = 0.15  # the default boundary, as a share of the layers


class SparseX(ReuseFlow):
    name = "sparsex"
    source = "SparseX, arXiv 2606.01751"
    ratio = Param(0.15, low=0.0, high=1.0, doc="share of reused tokens selected by Sparse-Q (top-k)", search=RATIO_SEARCH)
    boundary_layer = Param(None, low=0, high=1024, kind=int,
                           doc="first sparse layer (earlier: full); default 15% of the layers (paper: 15-20% for small dense models)",
                           search=Search(layers="index", low=0, high=8, share=BOUNDARY_SHARE))
    overflow = Param(16, low=0, high=4096, doc="reused tokens added on each side of every non-reused span (one block)",
                     search=Search(choices=(0, 8, 16, 32)))
    tail = Param(64, low=0, high=4096, doc="tail fallback: last tokens of the final segment when the prompt ends in one",
                 search=Search(choices=(0, 32, 64, 128)))

    def selection_layer(self, num_layers):
        layer = round(BOUNDARY_SHARE * num_layers) if self.boundary_layer is None else self.boundary_layer
        return min(layer, num_layers - 1)

    def select(self, s):
        t, reused = s.num_tokens, s.reused
        sparse_q = (~reused).nonzero().squeeze(1)
        keep = s.top(s.attention_mass(sparse_q), self.recompute_count(int(reused.sum())))
        for span in s.layout.spans:
            if not span.reuse:
                keep[max(0, span.start - self.overflow) : span.start] = True
                keep[span.end : min(t, span.end + self.overflow)] = True
        last = s.layout.spans[-1]
        if last.reuse:
            keep[max(last.start, last.end - self.tail) : last.end] = True
        return keep & reused
