"""`LLM`: the composition root. An `Engine` (model, KV pool, scheduler, runner), a decode flow on
its attention layers and a reuse flow for prompts with reusable segments, all as one resolved
`Setup` (`sparsetune.setup`).

The engine knows no flow: this is where a setup's flows are built, sized into the KV pool, attached
as attention backends, and where a reuse flow's prefill is admitted into the engine. `apply(setup)`
moves a live engine from one setup to another doing only what changed: a retune (same kernels), a
graph recapture (other layers or widths), a new backend (another flow class) or a pool relayout
(another page size; the weights stay).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Callable, Sequence as Seq

import torch

from sparsetune.engine.config import EngineConfig
from sparsetune.engine.engine import Completion, Engine
from sparsetune.engine.sequence import SamplingParams, Sequence, Status
from sparsetune.errors import SparsetuneError
from sparsetune.flow.base import DecodeFlow
from sparsetune.flow.shapes import field_bytes_per_block
from sparsetune.models.artifacts import resolve_calibration
from sparsetune.reuse.base import ReuseFlow
from sparsetune.reuse.executor import ReuseExecutor, ReuseStats
from sparsetune.reuse.parts import ReuseLayout, encode_parts, is_parts, parse_parts_any
from sparsetune.reuse.segment_cache import SegmentCache
from sparsetune.setup import FlowSetup, Setup, resolve, resolve_options


class LLM:
    def __init__(self, setup: Setup | EngineConfig | None = None, **options: Any) -> None:
        """`setup`: a resolved `Setup` (`setup.resolve`); an `EngineConfig` or keyword options
        (`flow=`, `params=`, `reuse=`, `reuse_params=`, `executor=`, `defaults=` and any
        `EngineConfig` field) are resolved here (`setup.resolve_options`), so `LLM(flow="quest",
        model=...)` works."""
        if not isinstance(setup, Setup):
            setup = resolve_options(setup, **options)
        elif options:
            raise TypeError("pass a Setup or options, not both")
        self.setup = setup
        self.flow: DecodeFlow | None = setup.flow.build() if setup.flow is not None else None
        mcfg = setup.engine.check()[1]
        self.engine = Engine(setup.engine, capture=False,
                             extra_bytes_per_block=lambda dtype: field_bytes_per_block(self.flow, mcfg, dtype.itemsize))
        self._flow_backend = None  # the latest FlowAttention (kept across dense passes, to retune)
        self._route: tuple | None | bool = False  # what the installed attention routes (False: nothing yet)
        self._check_sharing(self.flow, setup.engine.prefix_caching, setup.executor)
        self._install_flow(self.flow, setup.executor)
        self._attach_segments()
        self.reuse_flow = self._build_reuse(setup)
        self._kept_reuse: tuple | None = None  # (setup, flow) of the reuse flow before the current one

    # ---- what callers read of the engine -----------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def resolved(self):
        return self.engine.resolved

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    @property
    def stats(self):
        return self.engine.stats

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def encode_prompt(self, prompt: str | list[int], chat: bool = True) -> list[int]:
        return self.engine.encode_prompt(prompt, chat)

    def __getattr__(self, name: str):
        """`LLM` was an `Engine` subclass: the engine's other attributes still answer, with a warning
        naming their new place (`llm.engine`)."""
        engine = self.__dict__.get("engine")
        if engine is None or name.startswith("__") or not hasattr(engine, name):
            raise AttributeError(f"'LLM' object has no attribute {name!r}")
        warnings.warn(f"LLM.{name} is the engine's: use llm.engine.{name}", DeprecationWarning, stacklevel=2)
        return getattr(engine, name)

    def _attach_segments(self) -> None:
        """Segments live in the same pool; a request short of blocks evicts idle ones (reclaim)."""
        eng = self.engine
        self.segments = SegmentCache(eng.block_manager, eng.config.block_size,
                                     salt=f"{eng.resolved.name}|random={eng.config.random_weights}|{eng.dtype}",
                                     watermark=eng.config.segment_watermark,
                                     cap=int(eng.config.segment_cap * eng.block_manager.num_blocks))
        self.reuse_executor = ReuseExecutor(eng.model_config, eng.kv, self.segments)

    # ---- the setup ---------------------------------------------------------------------------------

    @property
    def flow_name(self) -> str:
        """The decode flow's name; "dense" for full attention."""
        return self.flow.name if self.flow is not None else "dense"

    def apply(self, setup: Setup) -> None:
        """Move this engine to `setup` (same weights and KV pool). A decode flow that differs from the
        current one only in budget, sink or local blocks switches in place; other changes of dense or
        select layers recapture the graphs; another flow class or kernel param builds its backend
        (generated kernels are shared by source, so a flow seen before compiles nothing); another page
        size, or fields larger than the pool reserved beside its blocks, lays the KV pool out anew
        (`Engine.set_block_size`, as many tokens; the weights stay). The reuse flow is
        swapped (the segment cache is kept), and prefix caching turned on or off as the setup says.
        The setup must be for this engine's model, weights, device and dtype; its other engine
        options (pool memory, batch limits) stay this engine's."""
        if self.engine.scheduler.has_work():
            raise RuntimeError("apply needs an idle engine")
        other = self._other_engine(setup.engine)
        if other is not None:
            raise SparsetuneError(f"the setup is for {other[0]} {other[1]!r}; this engine runs {other[2]!r}: that needs a new LLM")
        new = setup.flow.build() if setup.flow is not None else None
        self._check_sharing(new, setup.engine.prefix_caching, setup.executor)
        self.engine.set_prefix_caching(setup.engine.prefix_caching)
        if new is not None and (new.block_size != self.engine.config.block_size
                                or self._field_bytes(new) > self.engine.extra_bytes_per_block):
            try:  # another page size, or fields larger than the pool reserved (units inside its pages)
                self._relayout(new)
            except BaseException:  # the pool kept its layout (Engine.set_block_size): the flow goes back on
                if self.engine.has_pool:
                    self._install_flow(self.flow, self.setup.executor)
                raise
        self._install_flow(new, setup.executor)
        self.flow = new
        if setup.reuse != self.setup.reuse:  # the one built last comes back as it was (prepared)
            kept = self._kept_reuse
            self._kept_reuse = (self.setup.reuse, self.reuse_flow) if self.reuse_flow is not None else kept
            self.reuse_flow = kept[1] if kept is not None and kept[0] == setup.reuse else self._build_reuse(setup)
        self.setup = replace(setup, engine=self.engine.config)

    def _other_engine(self, e: EngineConfig) -> tuple[str, Any, Any] | None:
        """What of `e` this engine does not run (option, wanted, running): another model, weights,
        device or dtype; None: it runs `e`'s flows as it is ("auto" device and dtype match any)."""
        from sparsetune.device import resolve_device, resolve_dtype

        if e.random_weights != self.resolved.random_weights:
            return "random_weights", e.random_weights, self.resolved.random_weights
        if e.model != self.setup.engine.model and e.check()[0] != self.resolved.name:
            return "model", e.model, self.resolved.name
        if e.device is not None and resolve_device(e.device) != self.device:
            return "device", e.device, str(self.device)
        if e.dtype is not None and resolve_dtype(e.dtype, self.device, "bfloat16") != self.dtype:
            return "dtype", e.dtype, str(self.dtype).removeprefix("torch.")
        return None

    def _executor(self, executor: str | None) -> str:
        """A flow's executor: the one given, else compiled on CUDA and the reference elsewhere."""
        return executor or ("compiled" if self.device.type == "cuda" else "reference")

    def _check_sharing(self, flow: DecodeFlow | None, prefix_caching: bool, executor: str | None) -> None:
        """Prefix caching shares blocks, and with them a decode flow's per-block fields: a function of
        the block's keys, so any flow may share them, but not state an indexer saves (F.save: h2o's
        running totals belong to one request). Asked of the flow's shared stages, which the backend
        installed next uses too."""
        if not prefix_caching or flow is None:
            return
        from sparsetune.flow.stages import flow_stages

        levels = [f for f in (flow, flow.page_flow()) if f is not None]  # a two-level flow's first level too
        if any(flow_stages(f, self._executor(executor)).traits(self.model_config.head_dim).saves_state for f in levels):
            raise SparsetuneError(f"prefix caching cannot be combined with the decode flow {flow.name!r}: its indexer "
                                  "saves per-request state in its blocks (F.save); drop --prefix-caching or pick a "
                                  "flow without F.save")

    def set_flow(self, flow: str | None, params: dict[str, Any] | None = None) -> None:
        """Deprecated: `apply(llm.setup.with_flow(flow, params))`."""
        warnings.warn("LLM.set_flow is replaced by LLM.apply(llm.setup.with_flow(flow, params))", DeprecationWarning,
                      stacklevel=2)
        self.apply(self.setup.with_flow(flow, params))

    def _install_flow(self, flow: DecodeFlow | None, executor: str | None) -> None:
        """Route attention through `flow` (None: full attention), then capture decode graphs.

        The flow is attached before capture, so its indexer and selection are in the graphs. What
        the engine already has is reused: a flow of the last flow backend's kernel key retunes it
        (kernels, stores and calibration kept), and graphs are recaptured only when the routing or
        the selection width (a shape inside them) changed."""
        eng = self.engine
        route, attn, sparse = None, None, []
        if flow is not None:
            sparse = flow.sparse_layers(self.model_config.num_hidden_layers)
            attn = self._flow_backend
            executor = self._executor(executor)
            if attn is not None and attn.executor == executor and attn.serves(flow):
                attn.retune(flow)
            else:
                attn = self._flow_backend = self._new_flow_backend(flow, executor)
            width = attn.selection_shape(eng.runner.max_blocks_per_seq, self.model_config.head_dim)
            route = (id(attn), tuple(sparse), tuple(flow.select_layers), width)
        if self._route is not False and route == self._route:
            return  # same kernels on the same layers with the same shapes: the graphs stay valid
        # Cached prefix blocks hold the fields of the attention that computed them (none under dense
        # attention, another flow's, other layers'): a new routing starts the prefix index afresh.
        eng.block_manager.forget_prefixes()
        eng.set_attention(eng.dense_attention())
        if attn is not None:
            eng.set_attention(attn, sparse)
        eng.capture_graphs()
        self._route = route

    def set_attention(self, backend, layers=None) -> None:
        """Route attention by hand (tests, benchmarks): the next setup installs its flow afresh."""
        self._route = False
        self.engine.set_attention(backend, layers)

    def _field_bytes(self, flow: DecodeFlow) -> int:
        """Bytes of `flow`'s fields per KV block beside this engine's pool (`field_bytes_per_block`)."""
        return field_bytes_per_block(flow, self.model_config, self.engine.dtype.itemsize)

    def _relayout(self, flow: DecodeFlow) -> None:
        """A flow of another block size: the KV pool is laid out anew in its blocks (same token
        capacity, the weights kept; cached segments are dropped), its fields sized beside it."""
        # Nothing may keep the old pool alive: the flow backend's field stores, the segment cache
        # and the reuse executor (which holds the pool) go with it.
        self._flow_backend, self._route = None, False
        self.segments = self.reuse_executor = None
        try:
            self.engine.set_block_size(flow.block_size, self._field_bytes(flow))
        finally:  # a new pool either way (the old layout again when the new one did not fit)
            if self.engine.has_pool:
                self._attach_segments()

    def _new_flow_backend(self, flow: DecodeFlow, executor: str):
        from sparsetune.flow.attention import FlowAttention

        calibration = None
        if flow.calibrated:  # per-layer channel order, for this model and its shapes
            mcfg, res = self.model_config, self.resolved
            calibration = resolve_calibration(flow.calibration, flow.name, res.name, res.random_weights,
                                              mcfg.num_hidden_layers, mcfg.num_key_value_heads, mcfg.head_dim)
        return FlowAttention(flow, self.model_config.head_dim**-0.5, executor=executor, calibration=calibration)

    # ---- the reuse flow ----------------------------------------------------------------------------

    def _build_reuse(self, setup: Setup) -> ReuseFlow | None:
        if setup.reuse is None:
            return None
        flow = setup.reuse.build(ReuseFlow)
        flow.prepare(self.resolved.name, self.config.random_weights, self.model_config)
        return flow

    def set_reuse(self, flow: str | ReuseFlow | None, params: dict[str, Any] | None = None) -> None:
        """Deprecated: `apply(...)` with a setup whose `reuse` is the flow. A built `ReuseFlow` (tests
        of a flow's own instance) is still taken as it is; the decode flow stays as it is."""
        warnings.warn("LLM.set_reuse is replaced by LLM.apply(setup)", DeprecationWarning, stacklevel=2)
        self.use_reuse(flow, params)

    def use_reuse(self, flow: str | ReuseFlow | None, params: dict[str, Any] | None = None) -> None:
        """Switch the reuse flow only (the decode flow and the segment cache stay): a name or path with
        params, or a built `ReuseFlow` (taken as it is). A reuse flow's own decode flow comes with a
        setup resolved with it (`setup.resolve(reuse=...)`)."""
        if isinstance(flow, ReuseFlow):
            self.reuse_flow = flow
            self.setup = replace(self.setup, reuse=FlowSetup.of(flow))
            return
        reuse = None if flow is None else resolve(replace(self.setup.engine, block_size=None), reuse=flow,
                                                  reuse_params=params).reuse
        self.setup = replace(self.setup, reuse=reuse)
        self.reuse_flow = self._build_reuse(self.setup)

    def cache_segments(self, layouts: ReuseLayout | Seq[ReuseLayout]) -> int:
        """Stage 1 of the reuse protocol: store every segment of `layouts` that the cache lacks, each
        prefilled alone at position 0 (cache-building requests, batched by the scheduler and run now
        with whatever else the engine holds); returns how many were new."""
        segs, fills, misses = [], [], 0
        try:
            for layout in [layouts] if isinstance(layouts, ReuseLayout) else layouts:
                got, new, counts = self.reuse_executor.lookup(layout)
                segs += got
                fills += new
                misses += counts.segment_misses
        except BaseException:  # nothing queued: what was taken goes back
            self.reuse_executor.let_go(segs, fills)
            raise
        try:
            for f in fills:
                self.engine.scheduler.add(f)
            while any(f.status != Status.FINISHED for f in fills):
                self.engine.step()
        except BaseException:  # interrupted: its fills leave the engine (a finished one stays stored)
            for f in fills:
                self.engine.abort(f)
            raise
        finally:
            self.reuse_executor.let_go(segs, [])
        return misses

    # ---- admission ---------------------------------------------------------------------------------

    def add_reuse_request(self, layout: ReuseLayout, params: SamplingParams,
                          arrival: float | None = None) -> tuple[Sequence, ReuseStats]:
        """Queue a prompt with segments: the scheduler prefills it by the reuse flow's plan (its
        segment misses filled first), batched with other requests, then it decodes with the others.
        The stats fill in when its prefill step runs."""
        if self.reuse_flow is None:
            raise SparsetuneError("no reuse flow is set; pass --reuse NAME (or LLM(reuse=...))")
        plan = self.reuse_executor.request(self.reuse_flow, layout)
        return self.engine.add_request(layout.token_ids, params, arrival, plan=plan), plan.stats

    def add_parts(self, layout: ReuseLayout, params: SamplingParams,
                  arrival: float | None = None) -> tuple[Sequence, ReuseStats | None]:
        """Queue a prompt of parts: by the reuse flow's plan (`add_reuse_request`), or without a reuse
        flow as plain text (no stats)."""
        if self.reuse_flow is None:
            return self.engine.add_request(layout.token_ids, params, arrival), None
        return self.add_reuse_request(layout, params, arrival)

    def add_prefilled(self, token_ids: list[int], params: SamplingParams, kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                      logits: torch.Tensor | None = None, arrival: float | None = None) -> Sequence:
        """A request whose prompt KV is already computed: `kv` (K and V `[layers, kv_heads, n, head_dim]`,
        as `prompt_kv` gives them) is written into its blocks and its first token sampled from the
        last position's `logits`; without `kv`, the KV is taken to be whatever its blocks hold (speed
        measurements, where the bytes a step reads matter and not their values) and its first step
        recomputes the last prompt token. Either way the decode flow's fields are built over the
        blocks and it decodes with the others (an eval's stored dense prefill, the search's measured
        decode steps, `bench serve --prefill disaggregated`). For decode flows this is the prefill
        they would run (theirs is dense)."""
        eng = self.engine
        seq = eng.reserve(token_ids, params, arrival)
        try:
            table = torch.tensor(seq.block_table, dtype=torch.int32, device=self.device)
            if kv is not None:
                slots = eng.kv.slots(table, torch.arange(len(token_ids), device=self.device))
                with torch.inference_mode():
                    for layer in range(self.model_config.num_hidden_layers):
                        k, v = (x[layer].to(self.device, non_blocking=True).transpose(0, 1) for x in kv)  # on the host too
                        eng.kv.store(layer, k, v, slots)
            eng.rebuild_fields(table, len(token_ids))
        except BaseException:
            eng.abort(seq)
            raise
        eng.admit_prefilled(seq, logits)
        return seq

    def prompt_kv(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K and V `[layers, kv_heads, n, head_dim]` of a running request's prompt once it is
        prefilled (None before, or once its blocks are gone): what `add_prefilled` takes."""
        n = seq.num_prompt_tokens
        if seq.num_computed < n or not seq.block_table:
            return None
        table = torch.tensor(seq.block_table, dtype=torch.int32, device=self.device)
        kv = [self.engine.kv.gather(layer, table, n) for layer in range(self.model_config.num_hidden_layers)]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    def generate(
        self,
        prompts: Seq[str | list[int] | list],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        chat: bool = True,
        on_token: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion with continuous batching; results in prompt order. A prompt given
        as parts (text and reusable segments) is prefilled by the reuse flow when one is set."""
        reuse: list[ReuseStats | None] = []  # per prompt, in order: its reuse prefill's stats

        def admit(prompt, p: SamplingParams, t0: float, chat: bool) -> tuple[list[int], Sequence]:
            stats = None
            if not is_parts(prompt):
                ids, seq = self.engine.admit_prompt(prompt, p, t0, chat)
            else:
                layout = encode_parts(self.tokenizer, parse_parts_any(prompt), chat)
                ids, (seq, stats) = layout.token_ids, self.add_parts(layout, p, t0)
            reuse.append(stats)
            return ids, seq

        outs = self.engine.generate(prompts, params, chat, on_token, admit=admit)
        for out, stats in zip(outs, reuse):
            out.reuse = None if stats is None else stats.to_dict()
        return outs
