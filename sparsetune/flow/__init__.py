"""The flow language: decode flows (cache stage + indexer stage) and their runtime.

A flow program imports `DecodeFlow` (or `TwoLevelFlow`: two-level selection by default), `Param`
(and `Search`, to set how the search samples a param) and `ops as F` from here; see `base.py`.
The names load lazily, so torch-free parts (`flow.params`) import without torch.
"""

__all__ = ["DecodeFlow", "Param", "Search", "TwoLevelFlow"]


def __getattr__(name: str):
    if name in ("DecodeFlow", "TwoLevelFlow"):
        from sparsetune.flow import base

        return getattr(base, name)
    if name in ("Param", "Search"):
        from sparsetune.flow import params

        return getattr(params, name)
    raise AttributeError(f"module 'sparsetune.flow' has no attribute {name!r}")
