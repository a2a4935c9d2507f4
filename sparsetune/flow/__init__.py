"""The flow language: decode flows (cache stage + indexer stage) and their runtime.

A flow program imports `DecodeFlow`, `Param` and `ops as F` from here; see `base.py`.
"""

from sparsetune.flow.base import DecodeFlow
from sparsetune.flow.params import Param

__all__ = ["DecodeFlow", "Param"]
