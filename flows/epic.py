"""EPIC / LegoLink-k (arXiv 2410.15332; DerekHJH/epic `kvlink-k`): recompute the first `k` tokens of
every reused segment that does not start the prompt, from layer 0, next to the new tokens. Their
fresh KV repairs the attention-sink spike each separately prefilled chunk starts with."""

import torch

from sparsetune.flow import Param, Search
from sparsetune.reuse import ReuseFlow


class EPIC(ReuseFlow):
    name = "epic"
    source = "EPIC LegoLink-k, arXiv 2410.15332"
    k = Param(16, low=0, high=4096, doc="tokens recomputed at the start of each reused segment (headline 16)",
              search=Search(low=1, high=256, log=True))

    def initial_rows(self, layout):
        rows = torch.zeros(layout.num_tokens, dtype=torch.bool)
        for s in layout.segments:
            if s.start > 0:  # the true prefix is already where it was computed
                rows[s.start : min(s.end, s.start + self.k)] = True
        return rows
