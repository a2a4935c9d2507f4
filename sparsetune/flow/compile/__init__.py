"""Generate Triton kernels from a flow's stages: the compiled executor's fast path.

A stage is traced once on small dummy tensors (`flow.trace`). If every op is *block-local* (its
output for block s depends only on block s: elementwise ops, comparisons, `where`, `gemm`,
reductions over the inner axes, `transpose`, `mask_slice`, `fill`), the stage becomes one
Triton kernel: `build_indexer` (`indexer.py`), `build_cache` (`cache_stage.py`). Ops across
blocks (softmax/normalize/reductions over dim 0, conv1d), `reshape` and state (`F.save`) are
not block-local: such a flow keeps the Inductor path, and `why_not` says why.

`emit.py` turns the op graph into statements over named tiles, each op's emission read from its
`ops.Op`; a `KVLayout` (`layout.py`; this engine's: `paged.py`) says where the blocks are;
`cache.py` loads each source once and shares equal kernels.
"""

from __future__ import annotations

from sparsetune.flow.base import DecodeFlow
from sparsetune.flow.compile.cache_stage import CacheKernel, build_cache
from sparsetune.flow.compile.emit import ForcedOnly, NotBlockLocal
from sparsetune.flow.compile.indexer import IndexerKernel, build_indexer
from sparsetune.flow.compile.layout import KVLayout
from sparsetune.flow.compile.paged import PAGED, PagedBlocks, PagedLayout

__all__ = ["CacheKernel", "ForcedOnly", "IndexerKernel", "KVLayout", "NotBlockLocal", "PAGED", "PagedBlocks",
           "PagedLayout", "build_cache", "build_indexer", "why_not"]


def why_not(flow: DecodeFlow, group: int = 4, head_dim: int = 64, layout: KVLayout | None = None) -> dict[str, str | None]:
    """For each stage: None if it becomes a generated kernel, else the reason it does not."""
    reasons: dict[str, str | None] = {}
    for stage, build in (("cache", lambda: build_cache(flow, head_dim, layout)),
                         ("index", lambda: build_indexer(flow, group, head_dim, layout))):
        try:
            build()
            reasons[stage] = None
        except NotBlockLocal as e:
            reasons[stage] = str(e)
    return reasons
