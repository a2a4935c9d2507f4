"""KV-cache reuse: segments of earlier prompts reused at any position (segment cache, RoPE
realignment, reuse flows and the engine's executor for their recompute plans).

A reuse flow program imports `ReuseFlow` from here and `Param` from `sparsetune.flow`; see `flow.py`.
"""

from sparsetune.reuse.flow import ReuseFlow

__all__ = ["ReuseFlow"]
