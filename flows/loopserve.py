"""LoopServe (arXiv 2507.13681): online prefill sparsification with vertical and slash lines, and
progressive KV selection while decoding (the `loopserve_decode` flow, installed with this one).

Prefill (Alg. 2): cached segments are reused as they are (realigned, not recomputed: LoopServe
serves multi-turn dialogue, whose history is cached), and the new tokens attend sparsely. At every
layer the queries of the last `sample` computed rows (MInference's last-64 estimate) give each
query head a causal attention map over the prompt; a vertical line is a key column, a slash line a
diagonal (keys at distance d from the query). Each head takes its lines in descending order of
their mass on the sampled map until the union covers a fraction `alpha` of the map's mass, and
its rows attend only to keys on its chosen lines (and themselves). Difference from the paper's
greedy: lines are ranked by mass and the union's coverage is exact, where the paper compares
length-normalized marginal gains with an approximate overlap term.
"""

import torch

from sparsetune.flow import Param, Search
from sparsetune.reuse import ReuseFlow, Lines, attention_probs, cover_histogram, slash_masses


def cover_lines(probs: torch.Tensor, rows: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, the fewest top lines (vertical and slash, ranked together by mass) whose union holds
    at least `alpha` of the sampled mass: (vertical `[H, T]` bool, slash `[H, T]` bool by distance).

    The union of the top k lines covers an entry of the map once k passes the better rank of the
    entry's two lines (its key's vertical, its distance's slash), so one histogram of the entries'
    mass by that rank, summed up, is the coverage at every k at once."""
    h, n, t = probs.shape
    vertical, slash = probs.sum(dim=1), slash_masses(probs, rows)  # every line's mass: key j's, distance d's
    rank = torch.empty(h, 2 * t, dtype=torch.long, device=probs.device)
    order = torch.cat([vertical, slash], dim=1).argsort(dim=1, descending=True, stable=True)
    rank.scatter_(1, order, torch.arange(2 * t, device=probs.device).expand(h, -1))
    covered = cover_histogram(probs, rows, rank).cumsum(1)  # [:, k]: what the top k lines cover
    target = alpha * probs.sum(dim=(1, 2), dtype=torch.float64)  # summed in float64, no float64 copy of the map
    k = (covered < (target - 1e-6)[:, None]).sum(1)  # the fewest lines reaching the target
    pick = rank < k[:, None]
    return pick[:, :t], pick[:, t:]


class LoopServe(ReuseFlow):
    name = "loopserve"
    source = "LoopServe, arXiv 2507.13681"
    decode_flow = "loopserve_decode"
    alpha = Param(0.955, low=0.5, high=1.0, doc="share of the sampled attention mass the chosen lines cover (the paper's α)",
                  search=Search(low=0.8, high=0.99))
    sample = Param(64, low=1, high=4096, doc="last computed rows whose queries estimate the attention map",
                   search=Search(choices=(16, 32, 64, 128)))
    budget = Param(1024, low=1, high=1 << 22, log=True, doc="decode: tokens attended per step (the paper's B)",
                   search=Search(low=32, high=2048, log=True))
    interval = Param(16, low=1, high=256, doc="decode: steps between re-selections (the paper's n_d)",
                     search=Search(choices=(1, 4, 16, 64)))

    def decode_params(self):
        return {"budget": str(self.budget), "interval": str(self.interval)}

    def attention_pattern(self, s):
        rows = s.rows[-self.sample :]
        q = s.q[-self.sample :]
        probs = attention_probs(q, s.k, rows, s.scale)  # [Hq, n, T]
        vertical, slash = cover_lines(probs, rows, self.alpha)
        return Lines(vertical, slash)
