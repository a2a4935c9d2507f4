"""PIE, position-independent reuse: move each segment's cached keys to their new positions (RoPE
realignment) and compute only the new tokens; no reused token is recomputed (A³'s PIE baseline)."""

from sparsetune.reuse import ReuseFlow


class PIE(ReuseFlow):
    name = "pie"
    source = "position-independent caching (A3 baseline PIE; EPIC arXiv 2410.15332 without LegoLink)"
