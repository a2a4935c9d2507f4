"""`LLM`: the engine's front door. Builds model, KV pool, scheduler and runner; runs requests."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

import torch

from sparsetune.device import resolve_device, resolve_dtype
from sparsetune.engine.attention import AttentionBackend, DenseAttention, LayerHooks
from sparsetune.engine.block_manager import BlockManager
from sparsetune.engine.config import EngineConfig
from sparsetune.engine.kv_cache import KVCache
from sparsetune.engine.model import CausalLM
from sparsetune.engine.runner import DEFAULT_GRAPH_BATCH_SIZES, ModelRunner
from sparsetune.engine.sampler import sample
from sparsetune.engine.scheduler import Batch, Scheduler
from sparsetune.engine.sequence import SamplingParams, Sequence, Status
from sparsetune.errors import SparsetuneError
from sparsetune.flow.registry import build_flow, decode_flow_for
from sparsetune.reuse.executor import ReuseExecutor, ReuseStats
from sparsetune.reuse.flow import ReuseFlow
from sparsetune.reuse.parts import ReuseLayout, encode_parts, is_parts, parse_parts_any
from sparsetune.reuse.segment_cache import SegmentCache
from sparsetune.models.resolve import ResolvedModel, resolve_model
from sparsetune.models.weights import init_random, load_safetensors_dir

CPU_DEFAULT_KV_MEMORY = 2 << 30


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    reuse: dict | None = None  # `ReuseStats.to_dict()` of a prompt prefilled by a reuse flow

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    preemptions: int = 0
    first_token_seconds: list[float] = field(default_factory=list)


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        cfg = config or EngineConfig()
        for k, v in overrides.items():
            if not hasattr(cfg, k):
                raise TypeError(f"unknown engine option {k!r}")
            setattr(cfg, k, v)
        cfg.check()
        self.config = cfg
        cfg.flow, cfg.flow_params = decode_flow_for(cfg.flow, cfg.flow_params, cfg.reuse, cfg.reuse_params)
        self.flow = self._build_flow()
        self.device = resolve_device(cfg.device)
        self.resolved: ResolvedModel = resolve_model(cfg.model, cfg.random_weights)
        spec = self.resolved.spec
        self.dtype = resolve_dtype(cfg.dtype, self.device, spec.gpu_dtype if spec else "bfloat16")
        mcfg = self.resolved.config
        self.model_config = mcfg
        self.tokenizer = self.resolved.load_tokenizer()
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else mcfg.eos_token_ids

        max_len = min(mcfg.max_position_embeddings, cfg.max_model_len or mcfg.max_position_embeddings)
        torch.manual_seed(cfg.seed)
        with torch.device(self.device):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                self.model = CausalLM(mcfg, max_positions=max_len)
            finally:
                torch.set_default_dtype(prev)
        if self.resolved.weights_dir is None:
            init_random(self.model, cfg.seed)
        else:
            load_safetensors_dir(self.model, self.resolved.weights_dir)
        self.model.eval()

        num_blocks = self._num_kv_blocks(max_len)
        if num_blocks < 1:
            raise SparsetuneError("the KV pool has no room for a single block; raise --kv-memory")
        self._check_memory(num_blocks)
        self.kv = KVCache(
            mcfg.num_hidden_layers, num_blocks, mcfg.num_key_value_heads, cfg.block_size, mcfg.head_dim,
            self.dtype, self.device,
        )
        self.max_model_len = min(max_len, num_blocks * cfg.block_size)
        self.backends: list[AttentionBackend] = [DenseAttention(mcfg.head_dim**-0.5)] * mcfg.num_hidden_layers
        self.hooks = LayerHooks()
        self.block_manager = BlockManager(num_blocks, cfg.block_size, prefix_caching=cfg.prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv, self.backends, self.hooks, cfg.max_num_seqs, self.max_model_len)
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.stats = EngineStats()
        self._install_flow(self.flow)
        # Segments live in the same pool; a request short of blocks evicts idle ones (reclaim).
        self.segments = SegmentCache(self.block_manager, cfg.block_size,
                                     salt=f"{self.resolved.name}|random={cfg.random_weights}|{self.dtype}",
                                     watermark=cfg.segment_watermark)
        self.reuse_executor = ReuseExecutor(self.model, self.kv, self.segments, mcfg.rope_scaling, mcfg.rope_theta)
        self.reuse_flow = self._build_reuse(cfg.reuse, cfg.reuse_params)

    def _install_flow(self, flow) -> None:
        """Route attention through `flow` (None or dense: full attention), then capture decode graphs.

        The flow is attached before capture, so its indexer and selection are in the graphs."""
        if self.config.prefix_caching and flow is not None and not flow.full_attention:
            # Shared blocks would share a flow's per-block fields and state (h2o's running totals).
            raise SparsetuneError(f"prefix caching cannot be combined with the decode flow {flow.name!r} yet "
                                  "(its per-block state would be shared between requests); drop one of them")
        self.set_attention(DenseAttention(self.model_config.head_dim**-0.5))
        if flow is not None and not flow.full_attention:
            self._attach_flow(flow)
        if self.device.type == "cuda" and self.config.cuda_graph:
            self.runner.capture_graphs(self.config.cuda_graph_batch_sizes or DEFAULT_GRAPH_BATCH_SIZES)

    def set_flow(self, flow: str | None, params: dict[str, str] | None = None) -> None:
        """Switch the decode flow of a live engine (same weights and KV pool); recaptures graphs."""
        if self.scheduler.has_work():
            raise RuntimeError("set_flow needs an idle engine")
        block_size = self.config.block_size
        self.config.flow, self.config.flow_params = flow, dict(params or {})
        new = self._build_flow()
        if self.config.block_size != block_size:
            self.config.block_size = block_size
            raise SparsetuneError(f"the KV pool uses blocks of {block_size}; a flow with block_size "
                                  f"{new.block_size} needs a new engine")
        self.flow = new
        self._install_flow(new)

    def _build_reuse(self, name: str | None, params: dict[str, str] | None) -> ReuseFlow | None:
        if name is None:
            if params:
                raise SparsetuneError("--reuse-param needs a reuse flow: add --reuse NAME")
            return None
        flow = build_flow(name, params, ReuseFlow)
        flow.prepare(self.resolved.name, self.config.random_weights, self.model_config)
        return flow

    def set_reuse(self, flow: str | None, params: dict[str, str] | None = None) -> None:
        """Switch the reuse flow for prompts with segments (the segment cache is kept). The decode flow
        stays as it is: a reuse flow's own decode flow (`decode_flow_for`) comes with `set_flow`."""
        self.reuse_flow = self._build_reuse(flow, params)
        self.config.reuse, self.config.reuse_params = flow, dict(params or {})

    # ---- setup ----------------------------------------------------------------------------------

    def _num_kv_blocks(self, max_len: int) -> int:
        cfg, mcfg = self.config, self.model_config
        per_block = self._bytes_per_block()
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_memory is not None:
            return cfg.kv_memory // per_block
        if self.device.type == "cpu":
            # No point in more than max_num_seqs full-length sequences.
            return min(CPU_DEFAULT_KV_MEMORY // per_block, cfg.max_num_seqs * -(-max_len // cfg.block_size))
        free, _total = torch.cuda.mem_get_info(self.device)
        # Reserve the prefill activations of a full token budget (hidden, qkv, gate/up, a few temporaries).
        e = self.dtype.itemsize
        act = cfg.max_num_batched_tokens * e * (
            6 * mcfg.hidden_size + 3 * mcfg.intermediate_size
            + 2 * (mcfg.num_attention_heads + 2 * mcfg.num_key_value_heads) * mcfg.head_dim
        )
        budget = int(free * cfg.gpu_memory_utilization) - act - (1 << 30)
        return max(0, budget // per_block)

    def _check_memory(self, num_blocks: int) -> None:
        """A KV pool larger than the device's memory is refused before it is allocated."""
        need = num_blocks * self._bytes_per_block()
        if self.device.type == "cuda":
            have, what = torch.cuda.mem_get_info(self.device)[0], "free GPU memory"
        else:
            have, what = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the machine's memory"
        if need > have:
            raise SparsetuneError(f"the KV pool needs {need / 2**30:.1f} GiB but {what} is {have / 2**30:.1f} GiB; "
                                  "lower --batch or --context, or set --kv-memory")

    def _bytes_per_block(self) -> int:
        """Pool bytes per KV block: keys and values of every layer, plus the flow's fields."""
        cfg, mcfg = self.config, self.model_config
        return KVCache.bytes_per_block(mcfg.num_hidden_layers, mcfg.num_key_value_heads, cfg.block_size, mcfg.head_dim,
                                       self.dtype) + self._flow_bytes_per_block()

    def _flow_bytes_per_block(self) -> int:
        """A flow's per-block fields on its sparse layers: they live beside the pool, sized like it."""
        flow, mcfg = self.flow, self.model_config
        if flow is None or flow.full_attention:
            return 0
        from sparsetune.flow.codegen import field_dims

        dims = field_dims(flow, mcfg.head_dim, flow.const_dims(mcfg.head_dim))
        layers = sum(1 for i in range(mcfg.num_hidden_layers) if i not in flow.dense_layers)
        return layers * mcfg.num_key_value_heads * sum(r * c for r, c in dims.values()) * self.dtype.itemsize

    def _build_flow(self):
        """Resolve --flow/--param; the KV block size follows the flow's `block_size`."""
        cfg = self.config
        if cfg.flow is None:
            if cfg.flow_params:
                raise SparsetuneError("--param needs --flow")
            return None

        raw = dict(cfg.flow_params)
        if "block_size" not in raw:
            raw["block_size"] = str(cfg.block_size)  # --block-size sets the flow's granularity too
        elif str(raw["block_size"]) != str(cfg.block_size) and cfg.block_size != EngineConfig.block_size:
            raise SparsetuneError(
                f"--block-size {cfg.block_size} disagrees with --param block_size={raw['block_size']}; set it once"
            )
        flow = build_flow(cfg.flow, raw)
        cfg.block_size = flow.block_size
        return flow

    def _attach_flow(self, flow) -> None:
        from sparsetune.flow.runtime import EXECUTORS, FlowAttention

        n = self.model_config.num_hidden_layers
        bad = [i for i in flow.dense_layers if not 0 <= i < n]
        if bad:
            raise SparsetuneError(f"--param dense_layers: layer(s) {bad} out of range for a {n}-layer model")
        sparse = [i for i in range(n) if i not in flow.dense_layers]
        if flow.select_layers and sparse and sparse[0] not in flow.select_layers:
            raise SparsetuneError(
                f"--param select_layers: the first sparse layer ({sparse[0]}) must select, "
                f"since later layers reuse its choice; got {list(flow.select_layers)}"
            )
        executor = self.config.flow_executor or ("compiled" if self.device.type == "cuda" else "reference")
        if executor not in EXECUTORS:
            raise SparsetuneError(f"--flow-executor {executor!r}: use one of {', '.join(EXECUTORS)}")
        calibration = None
        if flow.calibrated:  # per-layer channel order, for this model and its shapes
            from sparsetune.flow.calibrate import resolve_calibration

            mcfg = self.model_config
            calibration = resolve_calibration(flow, self.resolved.name, self.resolved.random_weights,
                                              n, mcfg.num_key_value_heads, mcfg.head_dim)
        attn = FlowAttention(flow, self.model_config.head_dim**-0.5, executor=executor, calibration=calibration)
        self.set_attention(attn, sparse)

    def set_attention(self, backend: AttentionBackend, layers: Seq[int] | None = None) -> None:
        """Route attention of `layers` (default: all) through `backend`. Takes effect for new graphs."""
        for i in range(len(self.backends)) if layers is None else layers:
            self.backends[i] = backend
        self.runner.graphs.clear()

    def set_hooks(self, hooks: LayerHooks) -> None:
        """Install per-layer hooks (see `LayerHooks`). Takes effect for new graphs."""
        self.hooks = hooks
        self.runner.hooks = hooks
        self.runner.graphs.clear()

    # ---- requests ---------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int], chat: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SparsetuneError(f"{self.resolved.name} has no tokenizer files; add them or pass token ids")
            if not prompt.strip():
                raise SparsetuneError("the prompt is empty; pass some text with --prompt")
            return self.tokenizer.chat_prompt(prompt) if chat else self.tokenizer.encode(prompt)
        if not prompt:
            raise SparsetuneError("the prompt is empty")
        return list(prompt)

    def add_request(self, token_ids: list[int], params: SamplingParams) -> Sequence:
        self._check_prompt(token_ids)
        seq = Sequence(list(token_ids), params)
        self.scheduler.add(seq)
        return seq

    def _check_prompt(self, token_ids: list[int]) -> None:
        if len(token_ids) + 1 > self.max_model_len:
            raise SparsetuneError(
                f"the prompt has {len(token_ids)} tokens but the context holds {self.max_model_len} "
                f"(prompt plus at least one new token); shorten the prompt"
                + ("" if self.max_model_len >= self.model_config.max_position_embeddings else " or raise --kv-memory")
            )
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise SparsetuneError(f"prompt token ids must be in [0, {vocab})")

    def step(self) -> list[Sequence]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        t0 = time.perf_counter()
        logits = self.runner.run(batch)
        sampling = [i for i in range(len(batch.seqs)) if not batch.is_prefill or batch.completes_prefill(i)]
        sampled: dict[int, int] = {}
        if sampling:
            seqs = [batch.seqs[i] for i in sampling]
            toks = self._sample(seqs, logits if not batch.is_prefill else logits[sampling])
            sampled = {s.seq_id: t for s, t in zip(seqs, toks)}
        dt = time.perf_counter() - t0
        self._account(batch, dt)
        finished = self.scheduler.postprocess(batch, sampled, self.eos_token_ids, self.max_model_len)
        self.stats.preemptions = self.scheduler.num_preemptions
        return finished

    def _sample(self, seqs: list[Sequence], rows: torch.Tensor) -> list[int]:
        """Next token of each sequence from its logits row (greedy, sampled, or teacher-forced)."""
        if all(s.params.temperature == 0 for s in seqs):
            toks = rows.argmax(dim=-1).tolist()  # greedy: no per-step parameter tensors
        else:
            temps = torch.tensor([s.params.temperature for s in seqs], device=self.device)
            top_ps = torch.tensor([s.params.top_p for s in seqs], device=self.device)
            toks = sample(rows, temps, top_ps, self.generator).tolist()
        for i, s in enumerate(seqs):
            if s.params.forced_tokens:
                toks[i] = s.params.forced_tokens[s.num_completion_tokens]
            if s.params.keep_logits:
                s.logits.append(rows[i].float().cpu())
        return toks

    def _account(self, batch: Batch, seconds: float) -> None:
        s = self.stats
        s.steps += 1
        if batch.is_prefill:
            s.prefill_tokens += sum(batch.num_new_tokens)
            s.prefill_seconds += seconds
        else:
            s.decode_tokens += len(batch.seqs)
            s.decode_seconds += seconds

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        chat: bool = True,
        on_token: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion with continuous batching; results in prompt order."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        t0 = time.perf_counter()
        encoded, seqs, reuse = [], [], {}
        for prompt, p in zip(prompts, params_list):
            if is_parts(prompt):  # reusable segments: the reuse flow prefills it now
                layout = encode_parts(self.tokenizer, parse_parts_any(prompt), chat)
                encoded.append(layout.token_ids)
                if self.reuse_flow is None:
                    seqs.append(self.add_request(layout.token_ids, p))
                else:
                    seq, stats = self.add_reuse_request(layout, p)
                    self.stats.first_token_seconds.append(time.perf_counter() - t0)
                    seqs.append(seq)
                    reuse[seq.seq_id] = stats.to_dict()
            else:
                encoded.append(self.encode_prompt(prompt, chat))
                seqs.append(self.add_request(encoded[-1], p))
        while self.scheduler.has_work():
            before = {s.seq_id: s.num_tokens for s in seqs}
            self.step()
            if on_token is not None:
                on_token(sum(s.num_tokens - before[s.seq_id] for s in seqs))
            for s in seqs:
                if s.num_completion_tokens == 1 and before[s.seq_id] == s.num_prompt_tokens:
                    self.stats.first_token_seconds.append(time.perf_counter() - t0)
        return [
            Completion(
                ids, s.completion_ids, self.tokenizer.decode(s.completion_ids) if self.tokenizer else None,
                s.finish_reason, reuse.get(s.seq_id),
            )
            for ids, s in zip(encoded, seqs)
        ]

    def cache_segments(self, layout: ReuseLayout) -> int:
        """Stage 1 of the reuse protocol: store every segment of `layout` that the cache lacks, each
        prefilled on its own at position 0 (a cache-building request); returns how many were new."""
        stats = ReuseStats()
        for seg in self.reuse_executor.fetch_segments(layout, stats):
            self.segments.release(seg)
        return stats.segment_misses

    def add_reuse_request(self, layout: ReuseLayout, params: SamplingParams) -> tuple[Sequence, ReuseStats]:
        """Prefill a prompt with segments by the reuse flow's plan now, sample its first token, and
        hand it to the scheduler to decode with the others (`step` runs it from there)."""
        if self.reuse_flow is None:
            raise SparsetuneError("no reuse flow is set; pass --reuse NAME (or LLM(reuse=...))")
        ids = layout.token_ids
        self._check_prompt(ids)
        seq = Sequence(list(ids), params)
        if not self.block_manager.can_grow(seq, len(ids)):
            raise SparsetuneError(f"a {len(ids)}-token prompt does not fit in the free KV pool; raise --kv-memory")
        self.block_manager.grow(seq, len(ids))
        try:
            table = torch.tensor(seq.block_table, dtype=torch.int32, device=self.device)
            logits, stats = self.reuse_executor.prefill(self.reuse_flow, layout, table)
            from sparsetune.flow.runtime import FlowAttention

            with torch.inference_mode():  # the field stores are inference tensors
                for layer, backend in enumerate(self.backends):  # the decode flow's per-block fields
                    if isinstance(backend, FlowAttention):
                        backend.rebuild_fields(layer, self.kv, table, len(ids))
        except BaseException:
            self.block_manager.release(seq)
            raise
        self.segments.enforce_watermark()  # idle segments above the watermark go, pinned ones last
        self.stats.prefill_tokens += len(ids)
        self.stats.prefill_seconds += stats.seconds
        tok = self._sample([seq], logits[None])[0]
        self.scheduler.add_prefilled(seq, tok, self.eos_token_ids, self.max_model_len)
        return seq, stats

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits `[n, V]` at every prompt position (prefill in chunks, through the pool)."""
        if self.scheduler.has_work():
            raise RuntimeError("prompt_logits needs an idle engine")
        seq = self.add_request(token_ids, SamplingParams(max_tokens=1))
        self.scheduler.waiting.remove(seq)
        out = []
        try:
            while seq.num_computed < seq.num_tokens:
                n = min(self.config.max_num_batched_tokens, seq.num_tokens - seq.num_computed)
                if not self.block_manager.can_grow(seq, seq.num_computed + n):
                    raise SparsetuneError("the prompt does not fit in the KV pool; raise --kv-memory")
                self.block_manager.grow(seq, seq.num_computed + n)
                out.append(self.runner.run(Batch(True, [seq], [n]), all_logits=True))
                seq.num_computed += n
        finally:
            self.block_manager.release(seq)
            seq.status = Status.FINISHED
        return torch.cat(out)
