"""Multi-objective search over flows and their params (`sparsetune search`); calling the package
runs one: `sparsetune.search(["quest", "block_topk"], trials=20)` (`sparsetune.api.search`)."""

import sys

from sparsetune import SearchModule

sys.modules[__name__].__class__ = SearchModule
