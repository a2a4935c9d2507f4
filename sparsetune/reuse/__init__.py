"""KV-cache reuse: segments of earlier prompts reused at any position (segment cache, RoPE
realignment, reuse flows and the engine's executor for their recompute plans).

A reuse flow program imports `ReuseFlow` from here and `Param` from `sparsetune.flow`; see `flow.py`.
`ReuseFlow` loads lazily, so torch-free parts (`reuse.parts`) import without torch.
"""

__all__ = ["ReuseFlow"]


def __getattr__(name: str):
    if name == "ReuseFlow":
        from sparsetune.reuse.flow import ReuseFlow

        return ReuseFlow
    raise AttributeError(f"module 'sparsetune.reuse' has no attribute {name!r}")
