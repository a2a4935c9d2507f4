"""SGLang's default prefix tree for a plain model, as each supported version builds it: the one place
the tests here tell the versions' trees apart (`RadixCache` on 0.5.16, `UnifiedRadixCache` with the
full-attention component on 0.5.23)."""

from __future__ import annotations

import sglang


def default_tree(**params):
    """The tree over `params` (CacheInitParams' fields: the pools, the allocator, the page size)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    if sglang.__version__.startswith("0.5.16"):
        from sglang.srt.mem_cache.radix_cache import RadixCache

        return RadixCache(CacheInitParams(**params))
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return UnifiedRadixCache(CacheInitParams(**params, tree_components=(ComponentType.FULL,)))
