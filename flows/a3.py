"""A³, attention-aware KV cache fusion (arXiv 2511.17560), eq. 3-5.

Layer 0 runs every token; at layer 1 each reused (document) token is scored by the attention the
question's tokens give it, s(d) = Σ_j softmax(q_j Kᵀ/√h)_d (summed over heads), and the top
`ratio` of the reused tokens are recomputed with the question from layer 1 on. The question is the
prompt's last span of new tokens (with a chat template: the user's question and the template tail).
"""

import torch

from sparsetune.flow import Param, Search
from sparsetune.reuse import ReuseFlow, RATIO_SEARCH


class A3(ReuseFlow):
    name = "a3"
    source = "A3, arXiv 2511.17560"
    ratio = Param(0.15, low=0.0, high=1.0, doc="share of reused tokens recomputed (the paper's r)", search=RATIO_SEARCH)
    layer = Param(1, low=1, high=1024, doc="layer whose question attention scores the document tokens",
                  search=Search(layers="index", low=1, high=6))

    def selection_layer(self, num_layers):
        return min(self.layer, num_layers - 1)

    def select(self, s):
        last = s.layout.spans[-1]
        if last.reuse:  # no question after the documents: the final tokens probe instead
            question = torch.arange(max(0, s.num_tokens - 64), s.num_tokens, device=s.q.device)
        else:
            start = last.start
            for span in reversed(s.layout.spans):  # the whole trailing run of new text
                if span.reuse:
                    break
                start = span.start
            question = torch.arange(start, s.num_tokens, device=s.q.device)
        return s.top(s.attention_mass(question), self.recompute_count(int(s.reused.sum())))
