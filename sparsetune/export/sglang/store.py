"""Reused segments inside SGLang (issue #44): SGLang's own prefix tree as the segment store, and a
stored segment's KV placed at another position of a prompt.

**One cache.** A segment is kept where SGLang keeps prefixes: in its radix tree (`RadixCache` on
0.5.16, `UnifiedRadixCache` on 0.5.23), under a private `extra_key` per namespace
(`segment_key`), at positions 0..n-1, as a prompt of its own tokens would be. SGLang's LRU evicts
it like any prefix, and a pin (SGLang's lock on its node) keeps every slot of it while a request
reads it. A plain prompt's key has another `extra_key` (none, or the client's salt, which may not
start with `KEY_PREFIX`), so a segment is never a plain prefix hit, and a plain prefix never a
segment hit. With pages larger than one token SGLang keeps the page-aligned head of a segment; a
hit says how many of its tokens were found (the rest are computed).

**Placing.** SGLang caches keys after RoPE, so a segment found at positions 0..n-1 and reused at
p..p+n-1 has its keys rotated by the delta p into the request's own slots, and its values copied:
the engine's realignment kernel (`kernels.rope_realign`, the same math the engine applies to its
pool), run over each layer's flat buffer of SGLang's `MHATokenToKVPool` as a pool of 1-token pages.
The request's slots are SGLang's (allocated by its scheduler as for any prompt), so its release,
its decode and its own prefix caching stay stock.

The two SGLang versions differ in the tree's match result (slot ids on 0.5.16, a length and the
node's path on 0.5.23) and in its lock (`inc_lock_ref`/`dec_lock_ref` against `lock`/`unlock`);
`SegmentStore` is the one place that knows.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import torch

from sparsetune.kernels import rope_realign

KEY_PREFIX = "sparsetune-segment/"


def segment_key(namespace: str) -> str:
    """The `extra_key` a namespace's segments are stored under in SGLang's prefix tree."""
    return KEY_PREFIX + namespace


@dataclass(frozen=True)
class Hit:
    """What the store holds of a segment: its first `length` tokens, in `slots` (positions 0..)."""

    length: int
    slots: torch.Tensor
    node: Any  # the tree node the match ends at: what a pin locks


class SegmentStore:
    """Segments in SGLang's prefix tree (`tree`: the scheduler's `tree_cache`)."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        self.locks_by_receipt = hasattr(tree, "lock")  # 0.5.23: lock/unlock; 0.5.16: inc/dec_lock_ref

    def find(self, token_ids: list[int], namespace: str) -> Hit:
        """The longest stored head of segment `token_ids` in `namespace` (length 0: not stored)."""
        return self.match(token_ids, segment_key(namespace))

    def match(self, token_ids: list[int], extra_key: str | None) -> Hit:
        """The longest head of `token_ids` the tree holds under `extra_key` (a plain prompt's own key:
        its prefix-cache hit; a namespace's segment key: a stored segment)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        m = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", token_ids), extra_key=extra_key)))
        slots = getattr(m, "device_indices", None)
        if slots is None:  # 0.5.23: the matched length, and the slots along the node's path
            n = int(m.device_prefix_len)
            slots = self.tree.path_device_indices(m.last_device_node)[:n] if n else torch.empty(0, dtype=torch.int64)
        return Hit(int(slots.numel()), slots.to(torch.int64), m.last_device_node)

    def pin(self, hit: Hit) -> Any:
        """Keep the hit's slots from eviction until `unpin` of what this returns."""
        if self.locks_by_receipt:
            return self.tree.lock(hit.node)
        self.tree.inc_lock_ref(hit.node)
        return hit.node

    def unpin(self, receipt: Any) -> None:
        if self.locks_by_receipt:
            self.tree.unlock(receipt)
        else:
            self.tree.dec_lock_ref(receipt)


def place(pool: Any, src_slots: torch.Tensor, dst_slots: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """For every layer of SGLang's `MHATokenToKVPool` `pool`, in place: K[dst] = R(delta) K[src] and
    V[dst] = V[src] (flat slots; `delta` per token, the new position minus the stored one;
    `inv_freq` the model's, `engine.rope.inv_frequencies`). Destinations distinct and disjoint from
    the sources (fresh slots of the request, stored slots of the segments)."""
    first = pool.start_layer
    k0 = pool.get_key_buffer(first)
    fn = rope_realign.realign_kv if k0.is_cuda else rope_realign.realign_kv_ref
    src, dst, delta = (t.to(k0.device) for t in (src_slots, dst_slots, delta))
    for layer in range(first, first + pool.layer_num):
        k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        fn(k[None, :, :, None], v[None, :, :, None], src, dst, delta, inv_freq)  # [1, slots, H, 1, D]: 1-token pages
