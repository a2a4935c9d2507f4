"""CacheBlend (Yao et al., EuroSys 2025, arXiv 2405.16444; YaoJiayi/CacheBlend, LMCache blender).

Layers before the check layer run every token. At the check layer each reused token's fresh KV is
compared with its realigned cached KV, and the `ratio` of reused tokens that deviate most (sum of
squared differences over heads and channels) are recomputed in all later layers, with the new
tokens. The original code compares V at layer 1 (`deviation=v`); LMCache v1 compares post-RoPE K.
"""

from sparsetune.flow import Param, Search
from sparsetune.reuse import ReuseFlow, RATIO_SEARCH


class CacheBlend(ReuseFlow):
    name = "cacheblend"
    source = "CacheBlend, arXiv 2405.16444"
    ratio = Param(0.15, low=0.0, high=1.0, doc="share of reused tokens recomputed (LMCache 0.15, original 0.16)",
                  search=RATIO_SEARCH)
    check_layer = Param(1, low=1, high=1024, doc="layer where deviations are measured; earlier layers run every token",
                        search=Search(layers="index", low=1, high=6))
    deviation = Param("v", choices=("v", "k"), doc="compare V (original) or post-RoPE K (LMCache v1)")

    def selection_layer(self, num_layers):
        return min(self.check_layer, num_layers - 1)

    def select(self, s):
        fresh, cached = (s.v, s.v_cached) if self.deviation == "v" else (s.k, s.k_cached)
        dev = (fresh.float() - cached.float()).square().sum(dim=(1, 2))
        return s.top(dev, self.recompute_count(int(s.reused.sum())))
