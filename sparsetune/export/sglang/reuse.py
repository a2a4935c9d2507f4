"""A reuse flow's prefill inside SGLang's own model forward (issue #44): the engine's plan, SGLang's model.

The engine runs a prompt with reused segments as a plan of rows (`reuse.executor.ReusePlan`, an
`engine.rows.Rows`): which tokens are computed from layer 0, the flow's selection at its selection
layer, the rows computed after it, each row attending over the whole prompt's KV with an exact
causal mask. This module runs those very plan objects inside SGLang's forward, on SGLang's pool
(`pool.PagedPool`, a `KVCache` over SGLang's buffers, with the request's page table):

- `ReuseStep`: one extend batch as a `RowsBatch`, a member per request: a reuse request's
  `ReusePlan`, a plain prompt's `Rows` over its extend. `place()` first writes each reuse request's
  reused KV into its own slots (`store.place`): its cached prefix's exact KV as it is (delta 0),
  each stored segment's keys rotated from position 0 to the segment's position. A reuse request
  is whole in the extend (its prompt's tokens all have slots of their own; what SGLang's prefix
  tree held of it is its `num_cached` prefix, copied, as the engine's plan takes a cached prefix).
- `wrap_model(model)` (an SGLang causal LM: `.model.layers`): with a step on the `ForwardBatch`
  (`fb.sparsetune_reuse`), the forward takes the step's first rows (ids and positions); each
  decoder layer gets the current rows' positions, and after it its output is narrowed to the rows
  the plan keeps (the engine narrows inside the layer, at the KV store; SGLang's layer runs whole,
  so the selection layer computes its attention and MLP for the dropped rows once more, unused);
  after the last layer the extend lengths are the rows left, so SGLang's logits processor reads
  each request's last row (always kept: its prompt's last token). The fields are restored after.
  0.5.16's layers pass (hidden, residual); 0.5.23's keep the residual on the batch
  (`residual_stream`): folded into the hidden state, then narrowed.
- `ReuseStep.attention` (what `SparsetuneBackend.forward_extend` runs when a step is set): the
  members store their rows' K/V (a plan's selection runs here, reading the placed KV before the
  store overwrites it) and attend (`Rows.attention`: the torch path on CPU, the row kernels on CUDA).

The scheduler side (finding and pinning what a request reuses) is `schedule`, the requests' side
`segments`. Differences from the engine: a flow that narrows the MLP (RedKnot's `mlp_rows`) is
refused, since SGLang's MLP runs every row; at a selection layer, a flow's attention pattern sees
the rows before the narrowing (no built-in flow has both); the stats count no token-layers (the
engine counts them in its MLP hook, which SGLang does not call).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from sparsetune.engine.rows import Rows, RowsBatch
from sparsetune.errors import SparsetuneError
from sparsetune.export.bundle import reuse_flow_problem
from sparsetune.export.sglang.pool import PagedPool, page_table
from sparsetune.export.sglang.store import place
from sparsetune.reuse.base import ReuseFlow
from sparsetune.reuse.executor import ReusePlan, ReuseStats, reused_tokens
from sparsetune.reuse.parts import ReuseLayout

logger = logging.getLogger(__name__)

@dataclass
class ReuseRequest:
    """One request's reuse, as the scheduler side found it: its layout (as the tokenizer process
    wrote it), its cached prefix (`num_cached` tokens of exact KV at `prefix_slots`), and the stored
    slots of each segment's head (`segments`: (span start, slots of its first tokens, stored at 0..);
    SGLang keeps whole pages of a segment, so a tail past them is not stored)."""

    layout: ReuseLayout
    num_cached: int = 0
    prefix_slots: torch.Tensor | None = None
    segments: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def reused(self, flow: ReuseFlow, device) -> torch.Tensor:
        """`[T]` bool: the tokens the flow takes as reused (`reused_tokens`), but those that have no KV
        to take: a segment's tail past its stored head, or a segment not stored, outside the cached
        prefix (computed as the engine computes the tokens of a plain part)."""
        mask = reused_tokens(flow, self.layout, device)
        have = torch.zeros_like(mask)
        have[: self.num_cached] = True
        for begin, slots in self.segments:
            have[begin : begin + slots.numel()] = True
        return mask & have


def check_flow(flow: ReuseFlow) -> None:
    """A reuse flow SGLang's forward can run (`bundle.reuse_flow_problem`)."""
    problem = reuse_flow_problem(type(flow))
    if problem:
        raise SparsetuneError(problem)


class ReuseStep:
    """One extend batch of SGLang run as rows (see the module docstring). `requests[i]`: the i-th
    request's reuse, or None for a plain prompt."""

    def __init__(self, flow: ReuseFlow, pool, req_to_token: torch.Tensor, fb, requests: list[ReuseRequest | None],
                 num_layers: int, scale: float, inv_freq: torch.Tensor, page_size: int, pins=None) -> None:
        check_flow(flow)
        self.pins = pins  # (a SegmentStore, what it pinned for these requests): let go after the forward
        self.flow, self.sgl_pool, self.req_to_token, self.inv_freq = flow, pool, req_to_token, inv_freq
        self.pool = PagedPool(pool, page_size)
        self.requests, self.rows = requests, fb.req_pool_indices.tolist()
        seq_lens, ext_lens = [int(n) for n in fb.seq_lens_cpu], [int(n) for n in fb.extend_seq_lens_cpu]
        pages = -(-max(seq_lens) // page_size)
        tables = page_table(req_to_token, fb.req_pool_indices, page_size, pages)
        dev = self.pool.k.device
        members, first, start = [], [], 0
        for i, r in enumerate(requests):
            t, prefix = seq_lens[i], seq_lens[i] - ext_lens[i]
            if r is None:
                m = Rows(self.pool, tables[i], t, torch.arange(prefix, t, device=dev), scale)
            else:
                if prefix or r.layout.num_tokens != t:
                    raise SparsetuneError(f"request {i}: a reuse request runs whole in its extend ({t} tokens, "
                                          f"{prefix} of SGLang's prefix; its layout has {r.layout.num_tokens})")
                stats = ReuseStats(prompt_tokens=t, num_layers=num_layers, num_kv_heads=self.pool.num_kv_heads,
                                   prefix_tokens=r.num_cached, segment_hits=len(r.segments),
                                   stored_tokens=sum(int(slots.numel()) for _, slots in r.segments))
                m = ReusePlan(self.pool, tables[i], flow, r.layout, r.reused(flow, dev), stats, num_layers, scale,
                              r.num_cached)
            first.append(start + m.positions - prefix)
            start += ext_lens[i]
            members.append(m)
        self.batch = RowsBatch(members)
        self.first = torch.cat(first)  # the extend's rows computed from layer 0
        self.pending: list | None = None  # a layer's narrowing, applied after the layer
        self.saved: dict | None = None

    def place(self) -> None:
        """Each reuse request's reused KV into its slots, every layer: its cached prefix as it is (exact
        KV, which the plan does not compute, whatever the flow), each segment's rotated from position 0
        to its position (not rotated: a flow that reuses KV as stored; none: a flow that reads none)."""
        src, dst, delta = [], [], []
        for row, r in zip(self.rows, self.requests):
            if r is None:
                continue
            if r.num_cached:
                src.append(r.prefix_slots[: r.num_cached])
                dst.append(self.req_to_token[row, : r.num_cached])
                delta.append(torch.zeros(r.num_cached, dtype=torch.long))
            for begin, slots in r.segments if self.flow.reads_cache else ():
                skip = max(0, r.num_cached - begin)  # inside the cached prefix: its exact KV is there
                n = slots.numel() - skip
                if n <= 0:
                    continue
                src.append(slots[skip:])
                dst.append(self.req_to_token[row, begin + skip : begin + skip + n])
                delta.append(torch.full((n,), begin if self.flow.realign else 0, dtype=torch.long))
        if src:
            place(self.sgl_pool, torch.cat(src).long(), torch.cat(dst).long(), torch.cat(delta), self.inv_freq)

    # ---- what SGLang's attention backend and the wrapped model call -------------------------------

    def attention(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_heads: int,
                  head_dim: int) -> torch.Tensor:
        """The step's rows at this layer: store their K/V (the plan's selection first), attend → `[n, Hq * D]`."""
        n = q.shape[0]
        qh = q.reshape(n, q_heads, head_dim)
        kh, vh = k.reshape(n, -1, head_dim), v.reshape(n, -1, head_dim)
        self.pending = self.batch.store_kv(layer_id, qh, kh, vh)
        return self.batch.attention(layer_id, qh).reshape(n, -1)

    @property
    def positions(self) -> torch.Tensor:
        return self.batch.positions

    def after_layer(self, out, fb, last: bool):
        """A decoder layer's output narrowed to the rows that go on; after the last layer, the extend
        lengths set to the rows left (what SGLang's logits processor reads)."""
        if self.pending is not None:
            subs, self.pending = self.pending, None
            if isinstance(out, tuple):  # 0.5.16: (hidden, residual)
                out = self.batch.narrow(subs, *out)
            else:  # 0.5.23: the residual waits on the batch; fold it in, narrow, hand it on
                from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

                (h,) = self.batch.narrow(subs, residual_batch.fold(out, fb))
                out = residual_batch.set_written(h, fb)
        if last:
            sizes = self.batch._sizes
            fb.extend_seq_lens = torch.tensor(sizes, dtype=fb.extend_seq_lens.dtype, device=fb.extend_seq_lens.device)
            fb.extend_seq_lens_cpu = list(sizes)
            fb.extend_num_tokens = sum(sizes)
            starts = getattr(fb, "extend_logprob_start_lens_cpu", None)
            if starts is not None:  # a plain request's input logprobs beside: a reuse request's last row only
                fb.extend_logprob_start_lens_cpu = [n if r is not None else a for a, n, r in zip(starts, sizes, self.requests)]
        return out

    SAVED = ("extend_seq_lens", "extend_seq_lens_cpu", "extend_num_tokens", "extend_logprob_start_lens_cpu")

    def save(self, fb) -> None:
        self.saved = {k: getattr(fb, k, None) for k in self.SAVED}

    def restore(self, fb) -> None:
        for k, v in (self.saved or {}).items():
            setattr(fb, k, v)

    def release(self) -> None:
        """Let go of the pins the plans held: their KV is in the requests' own slots now (a later
        write to a freed slot is ordered after this step's copies on the device)."""
        release_pins(self.pins)
        self.pins = None

    def finish(self) -> list[ReuseStats | None]:
        """Each request's counts (None: a plain prompt), read once the forward is done (a device sync)."""
        out = []
        for m in self.batch.members:
            if isinstance(m, ReusePlan):
                m.finish()
                m.stats.reused_tokens = int(m.from_segments.sum())
                out.append(m.stats)
            else:
                out.append(None)
        return out


def release_pins(pins) -> None:
    """Unpin what `schedule.take` handed a forward batch: (a SegmentStore, its pins)."""
    if pins:
        store, held = pins
        for pin in held:
            store.unpin(pin)


def step_of(fb) -> ReuseStep | None:
    return getattr(fb, "sparsetune_reuse", None)


def wrap_model(model) -> None:
    """Make an SGLang causal LM (`model.model.layers`) run a `ReuseStep` set on its forward batch;
    without one, its forward is untouched. Idempotent."""
    if getattr(model, "_sparsetune_reuse", False):
        return
    forward = model.forward

    def model_forward(input_ids, positions, forward_batch, *args, **kwargs):
        step = step_of(forward_batch)
        if step is None:
            return forward(input_ids, positions, forward_batch, *args, **kwargs)
        try:
            step.place()
            step.save(forward_batch)
            out = forward(input_ids[step.first], positions[step.first], forward_batch, *args, **kwargs)
        finally:
            step.restore(forward_batch)
            step.release()
        if logger.isEnabledFor(logging.INFO):  # --log-level info: what each reuse request computed (a sync)
            for stats in step.finish():
                if stats is not None:
                    logger.info("sparsetune reuse: %d tokens, %d from SGLang's prefix cache, %d from %d stored segments "
                                "(%.1f%% of them recomputed)", stats.prompt_tokens, stats.prefix_tokens,
                                stats.reused_tokens, stats.segment_hits, 100 * stats.recompute_ratio)
        return out

    layers = model.model.layers
    end = getattr(model.model, "end_layer", len(layers))
    for i in range(getattr(model.model, "start_layer", 0), end):
        _wrap_layer(layers[i], last=i == end - 1)
    model.forward = model_forward
    model._sparsetune_reuse = True


def _wrap_layer(layer, last: bool) -> None:
    forward = layer.forward

    def layer_forward(positions, hidden_states, forward_batch, *args, **kwargs):
        step = step_of(forward_batch)
        if step is None:
            return forward(positions, hidden_states, forward_batch, *args, **kwargs)
        out = forward(step.positions, hidden_states, forward_batch, *args, **kwargs)
        return step.after_layer(out, forward_batch, last)

    layer.forward = layer_forward
