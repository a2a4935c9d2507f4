"""Naive reuse: concatenate each segment's cached KV exactly as it was stored (keys keep the RoPE of
their old positions) and compute only the new tokens: the lower bound (A³'s FullReuse, EPIC `naive`)."""

from sparsetune.reuse import ReuseFlow


class NaiveReuse(ReuseFlow):
    name = "naive_reuse"
    source = "baseline (A3 FullReuse / EPIC naive)"
    realign = False
