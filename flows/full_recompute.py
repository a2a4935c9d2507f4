"""Full recompute: ignore every cached segment and prefill the whole prompt (the quality upper bound
and the TTFT baseline of every reuse flow; EPIC's `fr`)."""

from sparsetune.reuse import ReuseFlow


class FullRecompute(ReuseFlow):
    name = "full_recompute"
    source = "baseline (EPIC `fr`, CacheBlend full prefill)"
    reads_cache = False
