"""TidalDecode (Yang et al., 2024, arXiv 2410.05076; DerrickYLJ/TidalDecode), at block level.

A few "select" layers score every block by the exact attention mass the current query gives
it (Σ over the block's tokens of exp(q·k/√d), the max over the KV head's query group) and
keep the top blocks; every other sparse layer reuses the latest selection (position
persistence), so most layers pay no selection cost. Defaults follow the paper's Llama-3-8B
setup: layers 0-1 dense, selection at layer 2 and a correction at layer 13.
"""

from sparsetune.flow import DecodeFlow, Param, Search
from sparsetune.flow import ops as F


class Tidal(DecodeFlow):
    name = "tidal"
    source = "TidalDecode, arXiv 2410.05076"
    uses_keys = True
    dense_layers = Param((0, 1), kind=tuple, doc="layers that keep full attention (TidalDecode: the first two)")
    select_layers = Param((2, 13), kind=tuple, doc="layers that select by exact attention; the others reuse it",
                          search=Search(layers="spread", low=1, high=4))  # searched: 1-4 selecting layers

    def index(self, q, fields):
        logits = F.gemm(fields["k"], q)  # [S, block, G]
        peak = F.max(F.max(logits, dim=1), dim=0)  # [1, 1, G]: per-head max, for a stable exp
        mass = F.sum(F.exp(F.scale(F.sub(logits, peak), alpha=q.shape[2] ** -0.5)), dim=1)  # [S, 1, G]
        probs = F.normalize(mass, dim=0)  # per head: the block's share of the attention (softmax mass)
        return F.topk(F.max(probs, dim=2))
