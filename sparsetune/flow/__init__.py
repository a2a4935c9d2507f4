"""The flow language: decode flows (cache stage + indexer stage) and their runtime.

A flow program imports `DecodeFlow`, `Param` and `ops as F` from here; see `base.py`.
The names load lazily, so torch-free parts (`flow.params`) import without torch.
"""

__all__ = ["DecodeFlow", "Param"]


def __getattr__(name: str):
    if name == "DecodeFlow":
        from sparsetune.flow.base import DecodeFlow

        return DecodeFlow
    if name == "Param":
        from sparsetune.flow.params import Param

        return Param
    raise AttributeError(f"module 'sparsetune.flow' has no attribute {name!r}")
