"""`LLM`: the composition root. An `Engine` with a decode flow on its attention layers and a reuse
flow for prompts with reusable segments.

The engine knows neither: this is where flows are found (`registry`), sized into the KV pool,
attached as attention backends, and where a reuse flow's prefill is admitted into the engine.
"""

from __future__ import annotations

import time
from dataclasses import fields, replace
from typing import Callable, Sequence as Seq

import torch

from sparsetune.engine.config import EngineConfig
from sparsetune.engine.engine import Completion, Engine
from sparsetune.engine.sequence import SamplingParams, Sequence
from sparsetune.errors import SparsetuneError
from sparsetune.flow.base import DecodeFlow
from sparsetune.models.artifacts import resolve_calibration
from sparsetune.flow.defaults import tuned_config
from sparsetune.loader import build_flow, resolve_decode_flow
from sparsetune.reuse.executor import ReuseExecutor, ReuseStats
from sparsetune.reuse.base import ReuseFlow
from sparsetune.reuse.parts import ReuseLayout, encode_parts, is_parts, parse_parts_any
from sparsetune.reuse.segment_cache import SegmentCache


class LLM(Engine):
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        cfg = config or EngineConfig()
        known = {f.name for f in fields(EngineConfig)}
        unknown = [k for k in overrides if k not in known]
        if unknown:
            raise TypeError(f"unknown engine option {unknown[0]!r}")
        cfg, self.flow = _flows(replace(cfg, **overrides))  # checked before the model loads
        mcfg = cfg.check()[1]
        super().__init__(cfg, extra_elems_per_block=_flow_elems_per_block(self.flow, mcfg), capture=False)
        self._flow_backend = None  # the latest FlowAttention (kept across dense passes, to retune)
        self._route: tuple | None | bool = False  # what the installed attention routes (False: nothing yet)
        self._install_flow(self.flow)
        self._attach_segments()
        self.reuse_flow = self._build_reuse(cfg.reuse, cfg.reuse_params)

    def _attach_segments(self) -> None:
        """Segments live in the same pool; a request short of blocks evicts idle ones (reclaim)."""
        cfg, mcfg = self.config, self.model_config
        self.segments = SegmentCache(self.block_manager, cfg.block_size,
                                     salt=f"{self.resolved.name}|random={cfg.random_weights}|{self.dtype}",
                                     watermark=cfg.segment_watermark)
        self.reuse_executor = ReuseExecutor(self.model, self.kv, self.segments, mcfg.rope_scaling, mcfg.rope_theta)

    # ---- the decode flow ---------------------------------------------------------------------------

    def _install_flow(self, flow) -> None:
        """Route attention through `flow` (None: full attention), then capture decode graphs.

        The flow is attached before capture, so its indexer and selection are in the graphs. What
        the engine already has is reused: a flow of the last flow backend's kernel key retunes it
        (kernels, stores and calibration kept), and graphs are recaptured only when the routing or
        the selection width (a shape inside them) changed."""
        if self.config.prefix_caching and flow is not None:
            # Shared blocks would share a flow's per-block fields and state (h2o's running totals).
            raise SparsetuneError(f"prefix caching cannot be combined with the decode flow {flow.name!r} yet "
                                  "(its per-block state would be shared between requests); drop one of them")
        route, attn, sparse = None, None, []
        if flow is not None:
            sparse = _sparse_layers(flow, self.model_config.num_hidden_layers)
            attn = self._flow_backend
            if attn is not None and attn.flow.kernel_key() == flow.kernel_key():
                attn.retune(flow)
            else:
                attn = self._flow_backend = self._new_flow_backend(flow)
            width = attn.selection_width(self.runner.max_blocks_per_seq, self.model_config.head_dim)
            route = (id(attn), tuple(sparse), tuple(flow.select_layers), width)
        if self._route is not False and route == self._route:
            return  # same kernels on the same layers with the same shapes: the graphs stay valid
        self.set_attention(self.dense_attention())
        if attn is not None:
            self.set_attention(attn, sparse)
        self.capture_graphs()
        self._route = route

    @property
    def flow_name(self) -> str:
        """The decode flow's name; "dense" for full attention."""
        return self.flow.name if self.flow is not None else "dense"

    def set_attention(self, backend, layers=None) -> None:
        self._route = False  # routed by hand: the next flow installs afresh
        super().set_attention(backend, layers)

    def set_flow(self, flow: str | None, params: dict[str, str] | None = None) -> None:
        """Switch the decode flow of a live engine (same weights and KV pool). A flow that differs
        from the current one only in budget, sink or local blocks switches in place; other changes
        of dense or select layers recapture the graphs; another flow class or kernel param builds
        its backend (generated kernels are shared by source, so a flow seen before compiles nothing);
        another block size lays the KV pool out anew (`Engine.set_block_size`; the weights stay)."""
        if self.scheduler.has_work():
            raise RuntimeError("set_flow needs an idle engine")
        raw, cfg = tuned_config(replace(self.config, tuned=None), flow, dict(params or {}), users_block_size=False)
        size = str(raw.get("block_size", ""))
        cfg = replace(cfg, flow=flow, flow_params=raw,
                      block_size=int(size) if size.isdigit() else self.config.block_size)
        new = _build_flow(cfg, flow, cfg.flow_params)
        if new is not None and new.block_size != self.config.block_size:
            try:
                self._relayout(new)
            except BaseException:  # the pool kept its layout (Engine.set_block_size): the flow goes back on
                if self.has_pool:
                    self._install_flow(self.flow)
                raise
        self._install_flow(new)
        self.config, self.flow = replace(cfg, block_size=self.config.block_size), new

    def _relayout(self, flow) -> None:
        """A flow of another block size: the KV pool is laid out anew in its blocks (same token
        capacity, the weights kept; cached segments are dropped), its fields sized beside it."""
        # Nothing may keep the old pool alive: the flow backend's field stores, the segment cache
        # and the reuse executor (which holds the pool) go with it.
        self._flow_backend, self._route = None, False
        self.segments = self.reuse_executor = None
        try:
            self.set_block_size(flow.block_size, _flow_elems_per_block(flow, self.model_config))
        finally:  # a new pool either way (the old layout again when the new one did not fit)
            if self.has_pool:
                self._attach_segments()

    def _new_flow_backend(self, flow):
        from sparsetune.flow.attention import EXECUTORS, FlowAttention

        executor = self.config.flow_executor or ("compiled" if self.device.type == "cuda" else "reference")
        if executor not in EXECUTORS:
            raise SparsetuneError(f"--flow-executor {executor!r}: use one of {', '.join(EXECUTORS)}")
        calibration = None
        if flow.calibrated:  # per-layer channel order, for this model and its shapes
            mcfg = self.model_config
            calibration = resolve_calibration(flow.calibration, flow.name, self.resolved.name, self.resolved.random_weights,
                                              mcfg.num_hidden_layers, mcfg.num_key_value_heads, mcfg.head_dim)
        return FlowAttention(flow, self.model_config.head_dim**-0.5, executor=executor, calibration=calibration)

    # ---- the reuse flow ----------------------------------------------------------------------------

    def _build_reuse(self, name: str | None, params: dict[str, str] | None) -> ReuseFlow | None:
        if name is None:
            if params:
                raise SparsetuneError("--reuse-param needs a reuse flow: add --reuse NAME")
            return None
        flow = build_flow(name, params, ReuseFlow)
        flow.prepare(self.resolved.name, self.config.random_weights, self.model_config)
        return flow

    def set_reuse(self, flow: str | ReuseFlow | None, params: dict[str, str] | None = None) -> None:
        """Switch the reuse flow for prompts with segments (the segment cache is kept): a name or path
        with raw params, or a built `ReuseFlow` (None: segments run as plain text). The decode flow
        stays as it is: a reuse flow's own decode flow (`resolve_decode_flow`) comes with `set_flow`."""
        if isinstance(flow, ReuseFlow):
            self.reuse_flow = flow
            self.config = replace(self.config, reuse=flow.name, reuse_params={k: str(v) for k, v in flow.params().items()})
            return
        self.reuse_flow = self._build_reuse(flow, params)
        self.config = replace(self.config, reuse=flow, reuse_params=dict(params or {}))

    def cache_segments(self, layout: ReuseLayout) -> int:
        """Stage 1 of the reuse protocol: store every segment of `layout` that the cache lacks, each
        prefilled on its own at position 0 (a cache-building request); returns how many were new."""
        stats = ReuseStats()
        for seg in self.reuse_executor.fetch_segments(layout, stats):
            self.segments.release(seg)
        return stats.segment_misses

    def add_reuse_request(self, layout: ReuseLayout, params: SamplingParams,
                          arrival: float | None = None) -> tuple[Sequence, ReuseStats]:
        """Prefill a prompt with segments by the reuse flow's plan now, sample its first token, and
        hand it to the scheduler to decode with the others (`step` runs it from there)."""
        if self.reuse_flow is None:
            raise SparsetuneError("no reuse flow is set; pass --reuse NAME (or LLM(reuse=...))")
        ids = layout.token_ids
        seq = self.reserve(ids, params, arrival)
        try:
            table = torch.tensor(seq.block_table, dtype=torch.int32, device=self.device)
            logits, stats = self.reuse_executor.prefill(self.reuse_flow, layout, table)
            self.rebuild_fields(table, len(ids))
        except BaseException:
            self.abort(seq)
            raise
        self.segments.enforce_watermark()  # idle segments above the watermark go, pinned ones last
        self.stats.prefill_tokens += len(ids)
        self.stats.prefill_seconds += stats.seconds
        self.admit_prefilled(seq, logits)
        return seq, stats

    def add_prefilled(self, token_ids: list[int], params: SamplingParams, k: torch.Tensor, v: torch.Tensor,
                      logits: torch.Tensor, arrival: float | None = None) -> Sequence:
        """A prompt whose dense prefill was computed before (`k`, `v` `[layers, kv_heads, n, head_dim]`
        and its last position's `logits`, as `prompt_kv` gives them): written into its blocks, the
        decode flow's fields rebuilt, its first token sampled from `logits`; then decoded with the
        others. For decode flows this is the prefill they would run (theirs is dense)."""
        seq = self.reserve(token_ids, params, arrival)
        try:
            n = len(token_ids)
            table = torch.tensor(seq.block_table, dtype=torch.int32, device=self.device)
            slots = self.kv.slots(table, torch.arange(n, device=self.device))
            with torch.inference_mode():
                for layer in range(self.model_config.num_hidden_layers):
                    self.kv.store(layer, k[layer].transpose(0, 1), v[layer].transpose(0, 1), slots)
            self.rebuild_fields(table, n)
        except BaseException:
            self.abort(seq)
            raise
        self.admit_prefilled(seq, logits)
        return seq

    def add_with_pool_kv(self, token_ids: list[int], params: SamplingParams, arrival: float | None = None) -> Sequence:
        """A request whose prompt KV is taken to be in the blocks it is given, as they are (whatever
        the pool holds: for speed measurements, where the bytes a step reads matter and not their
        values): the decode flow's fields are built over them and it decodes with the others, its
        first step recomputing the last prompt token."""
        seq = self.reserve(token_ids, params, arrival)
        try:
            self.rebuild_fields(torch.tensor(seq.block_table, dtype=torch.int32, device=self.device), len(token_ids))
        except BaseException:
            self.abort(seq)
            raise
        self.admit_prefilled(seq)
        return seq

    def prompt_kv(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K and V `[layers, kv_heads, n, head_dim]` of a running request's prompt once it is
        prefilled (None before, or once its blocks are gone): what `add_prefilled` takes."""
        n = seq.num_prompt_tokens
        if seq.num_computed < n or not seq.block_table:
            return None
        table = torch.tensor(seq.block_table, dtype=torch.int32, device=self.device)
        kv = [self.kv.gather(layer, table, n) for layer in range(self.model_config.num_hidden_layers)]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    def rebuild_fields(self, table: torch.Tensor, num_tokens: int) -> None:
        """The decode flow's per-block fields of a prompt whose KV was written outside the step loop
        (`table`: its block table on the device)."""
        from sparsetune.flow.attention import FlowAttention

        with torch.inference_mode():  # the field stores are inference tensors
            for layer, backend in enumerate(self.backends):
                if isinstance(backend, FlowAttention):
                    backend.rebuild_fields(layer, self.kv, table, num_tokens)

    def generate(
        self,
        prompts: Seq[str | list[int] | list],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        chat: bool = True,
        on_token: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion with continuous batching; results in prompt order. A prompt given
        as parts (text and reusable segments) is prefilled by the reuse flow when one is set."""
        params_list = self._params_list(prompts, params)
        t0 = time.perf_counter()
        encoded, seqs, reuse = [], [], {}
        for prompt, p in zip(prompts, params_list):
            if is_parts(prompt):  # reusable segments: the reuse flow prefills it now
                layout = encode_parts(self.tokenizer, parse_parts_any(prompt), chat)
                encoded.append(layout.token_ids)
                if self.reuse_flow is None:
                    seqs.append(self.add_request(layout.token_ids, p, t0))
                else:
                    seq, stats = self.add_reuse_request(layout, p, t0)
                    seqs.append(seq)
                    reuse[seq.seq_id] = stats.to_dict()
            else:
                encoded.append(self.encode_prompt(prompt, chat))
                seqs.append(self.add_request(encoded[-1], p, t0))
        return self.run_to_completion(encoded, seqs, on_token, reuse)


def check_flows(cfg: EngineConfig) -> None:
    """Refuse what `LLM(cfg)` would refuse of its flows, without the model (no weights read, nothing
    converted): the decode and reuse flows' names and kinds, their `--param` values, and the decode
    flow's layers against the model's. `LLM` checks them before it loads the model; a caller that
    does work with the model first (eval sizes its KV pool from it, bench serve switches flows in
    after its dense cells) calls this before."""
    _flows(cfg)


def _flows(cfg: EngineConfig) -> tuple[EngineConfig, DecodeFlow | None]:
    """`cfg`'s decode flow (its `--flow`, else its reuse flow's own; the model's tuned defaults under
    the user's params), built and checked against the model's layers, and `cfg` with its name, params
    and block size (the pool's block size is the flow's granularity). The reuse flow is built to check
    it; `LLM` builds it again with the model (`_build_reuse`: its calibration)."""
    mcfg = cfg.check()[1]
    if cfg.reuse is not None:
        build_flow(cfg.reuse, cfg.reuse_params, ReuseFlow)
    flow_name, flow_params = resolve_decode_flow(cfg.flow, cfg.flow_params, cfg.reuse, cfg.reuse_params)
    if cfg.flow is not None:  # the user's flow (not a reuse flow's own): the model's tuned defaults under its params
        flow_params, cfg = tuned_config(cfg, cfg.flow, flow_params, users_block_size=True)
    flow = _build_flow(cfg, flow_name, flow_params)
    if flow is not None:
        _sparse_layers(flow, mcfg.num_hidden_layers)
    return replace(cfg, flow=flow_name, flow_params=dict(flow_params),
                   block_size=flow.block_size if flow is not None else cfg.block_size), flow


def _sparse_layers(flow, num_layers: int) -> list[int]:
    """The layers `flow` runs on in a model of `num_layers` (all but its dense layers), its layer
    params checked."""
    bad = [i for i in flow.dense_layers if not 0 <= i < num_layers]
    if bad:
        raise SparsetuneError(f"--param dense_layers: layer(s) {bad} out of range for a {num_layers}-layer model")
    sparse = [i for i in range(num_layers) if i not in flow.dense_layers]
    if flow.select_layers and sparse and sparse[0] not in flow.select_layers:
        raise SparsetuneError(
            f"--param select_layers: the first sparse layer ({sparse[0]}) must select, "
            f"since later layers reuse its choice; got {list(flow.select_layers)}"
        )
    return sparse


def _build_flow(cfg: EngineConfig, name: str | None, params: dict[str, str]):
    """The decode flow of `--flow`/`--param`; None for dense attention (no flow, or the "dense"
    flow: `LLM.flow` is None exactly when attention is dense). `--block-size` sets the flow's
    granularity unless the params set it; both set differently is an error."""
    if name is None:
        if params:
            raise SparsetuneError("--param needs --flow")
        return None
    raw = dict(params)
    if "block_size" not in raw:
        raw["block_size"] = str(cfg.block_size)
    elif str(raw["block_size"]) != str(cfg.block_size) and cfg.block_size != EngineConfig.block_size:
        raise SparsetuneError(
            f"--block-size {cfg.block_size} disagrees with --param block_size={raw['block_size']}; set it once"
        )
    flow = build_flow(name, raw)
    return None if flow.full_attention else flow


def _flow_elems_per_block(flow, mcfg) -> int:
    """A flow's per-block fields on its sparse layers, in pool elements: they live beside the pool."""
    if flow is None:
        return 0
    from sparsetune.flow.shapes import field_dims

    dims = field_dims(flow, mcfg.head_dim, flow.const_dims(mcfg.head_dim))
    layers = sum(1 for i in range(mcfg.num_hidden_layers) if i not in flow.dense_layers)
    return layers * mcfg.num_key_value_heads * sum(r * c for r, c in dims.values())
