"""The kernel generator's names under their earlier module path (`engine/llm.py` reads
`field_dims` here): re-exported from `flow.compile` and `flow.trace`."""

from sparsetune.flow.compile import (  # noqa: F401
    CacheKernel, ForcedOnly, IndexerKernel, NotBlockLocal, build_cache, build_indexer, why_not,
)
from sparsetune.flow.trace import field_dims, saves_state  # noqa: F401
