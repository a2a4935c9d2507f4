"""KV-cache reuse: segments of earlier prompts reused at any position (segment cache, RoPE
realignment, reuse flows and the engine's executor for their recompute plans).

A reuse flow program imports `ReuseFlow` and the helpers below from here (`from sparsetune.reuse
import ReuseFlow, RATIO_SEARCH`) and `Param` from `sparsetune.flow`; see `base.py`. The names
load lazily, so torch-free parts (`reuse.parts`) import without torch.
"""

__all__ = ["ReuseFlow", "RATIO_SEARCH", "HeadWindows", "Lines", "SelectionInputs", "LayerInputs",
           "attention_probs", "attention_mass", "slash_masses", "cover_histogram"]


def __getattr__(name: str):
    if name in __all__:
        from sparsetune.reuse import base

        return getattr(base, name)
    raise AttributeError(f"module 'sparsetune.reuse' has no attribute {name!r}")
