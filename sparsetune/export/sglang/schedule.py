"""The scheduler side of a reuse flow inside SGLang (issue #44): which requests reuse, and what they find.

A request reuses when its `custom_params` hold the layout the tokenizer process wrote
(`segments.LAYOUT`). In SGLang's scheduler process (0.5.16 and 0.5.23; the hooks' targets are the
same there, `HOOKS`):

- `Req._compute_max_prefix_len` (AROUND, `cap_prefix`): 0 for such a request. SGLang gives it no
  prefix of its own, so its whole prompt is in its extend with slots of its own, and its plan
  copies what SGLang's tree holds of its start, as the engine's plan takes a cached prefix.
- `ScheduleBatch.prepare_for_extend` (AROUND, `plan_batch`): before SGLang allocates the batch's
  slots (which may evict), each new such request is planned (`plan_request`): the tree's plain
  prefix of its prompt (under its own `extra_key`) and each segment's stored head (under the
  segment key of its namespace) are found and pinned; a segment not stored (or its tail past the
  stored head) is computed as prompt text. Its KV, approximate once a flow reuses, is never put in
  the tree (`skip_radix_cache_insert`).
- The plans wait by request id (`PLANNED`) until the attention backend's `init_forward_metadata`
  takes those of its forward batch (`take`, by the batch's `rids`) and makes the step of them
  (`reuse.ReuseStep`), which lets the pins go once its forward has run. SGLang plans a batch and
  runs it in one pass of its loop (one thread, overlap scheduling included), so a plan still there
  when the next batch is planned never ran: `sweep` lets it go. Nothing is put on the
  forward batch between: SGLang's runners hand the forward a `dataclasses.replace` copy of it
  (`EagerRunner.load_batch`), which keeps its fields only.

Segments get into the tree as SGLang keeps any prompt: a request whose prompt is the segment alone,
under its segment key (`store.segment_key`), at positions 0.. (the page-aligned head is kept).
"""

from __future__ import annotations

import logging
from typing import Any

from sparsetune.export.sglang.reuse import ReuseRequest, release_pins
from sparsetune.export.sglang.segments import LAYOUT, layout_spans
from sparsetune.export.sglang.store import SegmentStore
from sparsetune.reuse.parts import ReuseLayout, Span

logger = logging.getLogger(__name__)

# A request's plan, from its planning (`plan_batch`) to its forward (`take`): request id -> (its
# ReuseRequest, the store and the pins it holds). The scheduler's process only.
PLANNED: dict[str, tuple[ReuseRequest, SegmentStore, list]] = {}


_SPANS = "_sparsetune_spans"  # on a Req: its layout's spans once read (None: malformed, runs plain)


def spans_of(req) -> list[Span] | None:
    """A request's layout spans (None: a plain request; one whose prompt grew since, a retracted
    request's that goes on from its output, runs as a plain one). A malformed layout is logged (once
    per request: the scheduler asks at every pass) and the request runs as a plain one: nothing a
    request carries may stop the scheduler."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    if not params or LAYOUT not in params or getattr(req, "output_ids", None):
        return None
    if not hasattr(req, _SPANS):
        try:
            spans = layout_spans(params, len(req.origin_input_ids))
        except ValueError as e:
            logger.warning("sparsetune: request %s runs without reuse: %s", getattr(req, "rid", "?"), e)
            spans = None
        setattr(req, _SPANS, spans)
    return getattr(req, _SPANS)


def plan_request(ids: list[int], spans: list[Span], extra_key: str | None, store: SegmentStore) -> tuple[ReuseRequest, list]:
    """What the tree holds of a prompt with `spans`, pinned: its plain prefix (at most all but the
    last token, as SGLang caps a match) and each segment's stored head. Returns the plan's input and
    the pins."""
    prefix = store.match(ids[: len(ids) - 1], extra_key)
    pins = [store.pin(prefix)] if prefix.length else []
    found = []
    for span in spans:
        if span.reuse and span.end > prefix.length:  # a segment inside the cached prefix has its KV there
            hit = store.find(ids[span.start : span.end], span.namespace)
            if hit.length:
                pins.append(store.pin(hit))
                found.append((span.start, hit.slots))
    return ReuseRequest(ReuseLayout(list(ids), list(spans)), prefix.length, prefix.slots, found), pins


# ---- the hooks (HookRegistry: AROUND gets the original first) ----------------------------------------

def cap_prefix(original, req, input_len: int, *args, **kwargs) -> int:
    if spans_of(req):
        return 0
    return original(req, input_len, *args, **kwargs)


def plan_batch(original, batch, *args, **kwargs):
    sweep()
    store = SegmentStore(batch.tree_cache)
    # the slots SGLang's allocation next evicts for: the batch's tokens and a page per request (its own figure)
    page = getattr(batch.tree_cache.token_to_kv_pool_allocator, "page_size", 1)
    need = sum(len(r.get_fill_ids()) - _prefix_len(r) for r in batch.reqs) + len(batch.reqs) * page
    planned = []
    for req in batch.reqs:
        spans = spans_of(req)
        if spans:
            plan, pins = plan_request(list(req.origin_input_ids), spans, req.extra_key, store)
            if _room(batch.tree_cache) < need:  # SGLang admitted the batch counting what this pinned as evictable
                release_pins((store, pins))
                logger.info("sparsetune: request %s prefills without reuse: the pool is too full to hold its segments", req.rid)
                continue
            PLANNED[req.rid] = (plan, store, pins)
            planned.append(req)
    try:
        out = original(batch, *args, **kwargs)
    except BaseException:
        for req in planned:
            release_pins(PLANNED.pop(req.rid)[1:])
        raise
    for req in planned:
        req.skip_radix_cache_insert = True
    return out


def sweep() -> None:
    """Let go of plans no forward took. SGLang plans a batch and runs it in one pass of its scheduler's
    loop, so a plan still waiting when the next batch is planned will never run (its forward failed):
    its pins would hold their segments forever."""
    for rid in list(PLANNED):
        logger.warning("sparsetune: request %s's reuse plan was not run; its segments are let go", rid)
        release_pins(PLANNED.pop(rid)[1:])


def _prefix_len(req) -> int:
    """The prefix SGLang matched for a request (0.5.16: its slots; 0.5.23: a length)."""
    indices = getattr(req, "prefix_indices", None)
    return len(indices) if indices is not None else int(getattr(req, "prefix_len", 0) or 0)


def _room(tree) -> int:
    """Slots an allocation can have: free ones, and what eviction can free."""
    return tree.token_to_kv_pool_allocator.available_size() + tree.evictable_size()


def take(fb) -> tuple[list[ReuseRequest | None], tuple[SegmentStore, list]] | None:
    """The plans of a forward batch's requests (by its `rids`, in its order; None for a plain one) and
    the pins they hold, taken once; None when none of them reuses. A plan found in a batch that is no
    extend (none should be) is let go."""
    found = [PLANNED.pop(rid, None) for rid in getattr(fb, "rids", None) or ()]
    held = [f for f in found if f is not None]
    if not held:
        return None
    pins = (held[0][1], [pin for _, _, p in held for pin in p])  # one tree: the scheduler's
    if not fb.forward_mode.is_extend():
        release_pins(pins)
        return None
    return [None if f is None else f[0] for f in found], pins


HOOKS: list[tuple[str, Any, str]] = [
    ("sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len", cap_prefix, "AROUND"),
    ("sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend", plan_batch, "AROUND"),
]
