"""`Engine`: model, KV pool, scheduler and runner; runs requests of token ids (or text) to completion.

A closed layer: it knows attention only as `AttentionBackend`s installed per layer (`set_attention`)
and never imports flows or reuse. `sparsetune.llm.LLM` composes it with a decode flow and a reuse flow.

The request API, for servers, benchmarks and search workers:
`add_request` (optionally with an arrival time) → `step` until `has_work` is false, `abort` at any
time, `admit_prefilled` for a prompt whose KV was written outside the step loop (reuse, or a
benchmark's synthetic context), `eager` to bypass captured CUDA graphs, and on every `Sequence` its
`events` (arrival, scheduled, first token, each token, finish) on the `time.perf_counter` clock.
Greedy decode steps overlap (`EngineConfig.overlap`, on where graphs replay): `step` launches the
next step on the device's tokens before it reads the last one's, so the host's work hides behind
the GPU's; a step's tokens then come with the call after the one that launched it.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence as Seq

import torch

from sparsetune.device import release_memory, resolve_device, resolve_dtype
from sparsetune.engine.attention import AttentionBackend, DenseAttention
from sparsetune.engine.block_manager import BlockManager
from sparsetune.engine.config import DEFAULT_BLOCK_SIZE, EngineConfig
from sparsetune.engine.kv_cache import KVCache
from sparsetune.engine.model import CausalLM
from sparsetune.engine.rows import PlannedPrefill
from sparsetune.engine.runner import DEFAULT_GRAPH_BATCH_SIZES, ModelRunner
from sparsetune.engine.sampler import sample
from sparsetune.engine.scheduler import Batch, Scheduler
from sparsetune.engine.sequence import SamplingParams, Sequence, Status
from sparsetune.errors import OutOfMemory, SparsetuneError
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
class _InFlight:
    """A greedy decode step launched and not yet read (`Engine.step` with overlap)."""

    batch: Batch
    toks: torch.Tensor  # its tokens on the device: the next step's input ids
    host: torch.Tensor  # their copy on the host, valid once `ready` completes
    ready: torch.cuda.Event | None
    t0: float


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    preemptions: int = 0
    first_token_seconds: list[float] = field(default_factory=list)
    planned_batches: list[int] = field(default_factory=list)  # per step with plans: the requests planned in it (fills not counted)


class Engine:
    def __init__(self, config: EngineConfig, extra_bytes_per_block: Callable[[torch.dtype], int] | None = None,
                 capture: bool = True) -> None:
        """`extra_bytes_per_block`: bytes per KV block kept beside keys and values (a decode flow's
        per-block fields), given the pool's dtype, so the pool is sized for both. `capture`: capture decode CUDA graphs
        now (a caller that installs other attention first captures later, `capture_graphs`)."""
        config.check()
        if config.block_size is None:
            config = replace(config, block_size=DEFAULT_BLOCK_SIZE)
        self.config = cfg = config
        self.device = resolve_device(cfg.device)
        self.resolved: ResolvedModel = resolve_model(cfg.model, cfg.random_weights)
        spec = self.resolved.spec
        self.dtype = resolve_dtype(cfg.dtype, self.device, spec.gpu_dtype if spec else "bfloat16")
        mcfg = self.resolved.config
        self.model_config = mcfg
        self.extra_bytes_per_block = extra_bytes_per_block(self.dtype) if extra_bytes_per_block else 0
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

        self._max_len = max_len
        num_blocks = self._num_kv_blocks(max_len)
        if num_blocks < 1:
            raise SparsetuneError("the KV pool has no room for a single block; raise --kv-memory")
        self._build_pool(num_blocks)
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.stats = EngineStats()
        self._inflight: _InFlight | None = None
        self._last_read = 0.0
        pinned = self.device.type == "cuda"
        self._tok_bufs = [torch.empty(cfg.max_num_seqs, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        if capture:
            self.capture_graphs()

    def _build_pool(self, num_blocks: int) -> None:
        """The KV pool of `num_blocks` blocks of `config.block_size`, its block manager, scheduler and
        runner; attention is dense on every layer."""
        cfg, mcfg = self.config, self.model_config
        self._check_memory(num_blocks)
        self.kv = KVCache(
            mcfg.num_hidden_layers, num_blocks, mcfg.num_key_value_heads, cfg.block_size, mcfg.head_dim,
            self.dtype, self.device,
        )
        self.max_model_len = min(self._max_len, num_blocks * cfg.block_size)
        self.backends: list[AttentionBackend] = [self.dense_attention()] * mcfg.num_hidden_layers
        self.block_manager = BlockManager(num_blocks, cfg.block_size, prefix_caching=cfg.prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   interleave=cfg.schedule == "interleave")
        self.runner = ModelRunner(self.model, self.kv, self.backends, cfg.max_num_seqs, self.max_model_len)

    @property
    def has_pool(self) -> bool:
        """False only after `set_block_size` could rebuild neither layout: the engine cannot run."""
        return hasattr(self, "runner")

    def set_block_size(self, block_size: int, extra_bytes_per_block: int | None = None) -> None:
        """Lay the KV pool out anew in blocks of `block_size` tokens, holding as many tokens as before
        (the weights stay; what the pool held is dropped): an idle engine only. Attention goes back
        to dense on every layer and captured graphs are dropped (`capture_graphs` takes new ones).
        `extra_bytes_per_block`: the per-block fields kept beside K and V at the new size."""
        if self.scheduler.has_work():
            raise RuntimeError("set_block_size needs an idle engine")
        if block_size < 1 or block_size & (block_size - 1):
            raise SparsetuneError(f"--block-size must be a power of two (got {block_size})")
        tokens = self.kv.num_blocks * self.kv.block_size
        before = (self.config, self.extra_bytes_per_block, self.kv.num_blocks)
        self.config = replace(self.config, block_size=block_size)
        if extra_bytes_per_block is not None:
            self.extra_bytes_per_block = extra_bytes_per_block
        # Free the old pool, the graphs and the backends (with a flow's field stores) first.
        self.runner.graphs.clear()
        del self.kv, self.runner
        self.backends = []
        release_memory()
        try:
            self._build_pool(-(-tokens // block_size))
        except BaseException as e:  # out of memory: the engine keeps its old layout and stays usable
            self.config, self.extra_bytes_per_block, num_blocks = before
            try:
                self._build_pool(num_blocks)
            except BaseException:
                short = isinstance(e, (OutOfMemory, torch.OutOfMemoryError))
                raise (OutOfMemory if short else SparsetuneError)(
                    f"the KV pool in blocks of {block_size} did not fit ({e}) and the old one could not be rebuilt; "
                    "start a new engine") from None
            raise

    def set_prefix_caching(self, on: bool) -> None:
        """Share computed prompt blocks between requests (`EngineConfig.prefix_caching`), or stop: an
        idle engine only; the prefix index starts empty either way."""
        if on == self.config.prefix_caching:
            return
        if self.scheduler.has_work():
            raise RuntimeError("set_prefix_caching needs an idle engine")
        self.config = replace(self.config, prefix_caching=on)
        self.block_manager.prefix_caching = on
        self.block_manager.forget_prefixes()

    # ---- attention and graphs ----------------------------------------------------------------------

    def dense_attention(self) -> DenseAttention:
        return DenseAttention(self.model_config.head_dim**-0.5)

    def set_attention(self, backend: AttentionBackend, layers: Seq[int] | None = None) -> None:
        """Route attention of `layers` (default: all) through `backend`. Captured graphs are dropped
        (they hold the old backend's kernels); `capture_graphs` takes new ones."""
        for i in range(len(self.backends)) if layers is None else layers:
            self.backends[i] = backend
        self.runner.graphs.clear()

    def capture_graphs(self) -> None:
        """Capture decode CUDA graphs for the installed attention (CUDA with `cuda_graph` on; else nothing)."""
        if self.device.type == "cuda" and self.config.cuda_graph:
            self.runner.capture_graphs(self.config.cuda_graph_batch_sizes or DEFAULT_GRAPH_BATCH_SIZES)

    @property
    def eager(self) -> bool:
        """True: decode steps run eagerly even where graphs are captured (profiling, debugging)."""
        return not self.runner.use_graphs

    @eager.setter
    def eager(self, value: bool) -> None:
        self.runner.use_graphs = not value

    @contextmanager
    def eager_mode(self) -> Iterator[None]:
        """Run decode steps eagerly inside the block; the graphs come back after it."""
        before = self.eager
        self.eager = True
        try:
            yield
        finally:
            self.eager = before

    def decode_graph(self, batch_size: int) -> torch.cuda.CUDAGraph | None:
        """The captured decode graph that serves `batch_size` requests (None: no graph for it), for
        timing a replay alone (benchmarks)."""
        size = next((s for s in sorted(self.runner.graphs) if s >= batch_size), None)
        return None if size is None else self.runner.graphs[size]

    @property
    def graph_batch_sizes(self) -> list[int]:
        """The batch sizes with a captured decode graph."""
        return sorted(self.runner.graphs)

    @property
    def uses_graphs(self) -> bool:
        """Decode steps replay captured graphs (captured and not eager)."""
        return bool(self.runner.graphs) and self.runner.use_graphs

    # ---- the KV pool -------------------------------------------------------------------------------

    def _num_kv_blocks(self, max_len: int) -> int:
        cfg, mcfg = self.config, self.model_config
        per_block = self.bytes_per_block()
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
        need = num_blocks * self.bytes_per_block()
        if self.device.type == "cuda":
            have, what = torch.cuda.mem_get_info(self.device)[0], "free GPU memory"
        else:
            have, what = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the machine's memory"
        if need > have:
            raise OutOfMemory(f"the KV pool needs {need / 2**30:.1f} GiB but {what} is {have / 2**30:.1f} GiB; "
                                  "lower --batch or --context, or set --kv-memory")

    def bytes_per_block(self) -> int:
        """Pool bytes per KV block: keys and values of every layer, plus `extra_bytes_per_block`."""
        cfg, mcfg = self.config, self.model_config
        return KVCache.bytes_per_block(mcfg.num_hidden_layers, mcfg.num_key_value_heads, cfg.block_size, mcfg.head_dim,
                                       self.dtype) + self.extra_bytes_per_block

    # ---- requests ----------------------------------------------------------------------------------

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

    def add_request(self, token_ids: list[int], params: SamplingParams, arrival: float | None = None,
                    plan: PlannedPrefill | None = None, cache_salt: bytes = b"") -> Sequence:
        """Queue a prompt; `arrival` (perf_counter seconds, default now) is its first event. `plan`: its
        prefill is that plan of rows (a reuse request, `engine/rows.py`); `cache_salt`: its prefix-cache
        namespace (prompts share cached blocks only with prompts of the same salt)."""
        self._check_prompt(token_ids)
        seq = Sequence(list(token_ids), params, plan=plan, cache_salt=cache_salt)
        seq.events.arrival = time.perf_counter() if arrival is None else arrival
        self.scheduler.add(seq)
        return seq

    def rebuild_fields(self, block_table: torch.Tensor, num_tokens: int) -> None:
        """The attention backends' per-block fields of a prompt whose KV was written outside the step
        loop (`block_table`: its block table on the device)."""
        with torch.inference_mode():  # the field stores are inference tensors
            self.runner.rebuild_fields(block_table, num_tokens)

    def _check_prompt(self, token_ids: list[int]) -> None:
        if len(token_ids) + 1 > self.max_model_len:
            raise SparsetuneError(
                f"the prompt has {len(token_ids)} tokens but the context holds {self.max_model_len} "
                f"(prompt plus at least one new token); shorten the prompt" + self._context_fix()
            )
        vocab = self.model_config.vocab_size
        if len(token_ids) and (min(token_ids) < 0 or max(token_ids) >= vocab):  # builtins: half a generator's time at 32K ids
            raise SparsetuneError(f"prompt token ids must be in [0, {vocab})")

    def _context_fix(self) -> str:
        """What else lengthens the context: the pool (--kv-memory) or the cap the user set (--max-model-len)."""
        if self.max_model_len < self._max_len:
            return " or raise --kv-memory"
        if self._max_len < self.model_config.max_position_embeddings:
            return " or raise --max-model-len"
        return ""

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is (waiting, mid-prefill, decoding); its blocks are freed and it
        finishes with reason "abort". A finished request is left as it is."""
        if self.scheduler.abort(seq):
            seq.events.finished = time.perf_counter()

    def reserve(self, token_ids: list[int], params: SamplingParams, arrival: float | None = None) -> Sequence:
        """A request that owns KV blocks for its whole prompt but is not scheduled: the caller writes
        the prompt's KV into `seq.block_table` itself, then hands it over with `admit_prefilled`
        (or gives the blocks back with `abort`)."""
        self._check_prompt(token_ids)
        seq = Sequence(list(token_ids), params)
        seq.events.arrival = time.perf_counter() if arrival is None else arrival
        if not self.block_manager.can_grow(seq, len(token_ids)):
            raise SparsetuneError(f"a {len(token_ids)}-token prompt does not fit in the free KV pool; raise --kv-memory")
        self.block_manager.grow(seq, len(token_ids))
        return seq

    def admit_prefilled(self, seq: Sequence, logits: torch.Tensor | None = None) -> bool:
        """Schedule a `reserve`d request whose prompt KV is in its blocks. With the last prompt
        position's `logits`, its first token is sampled now (True when that token already finishes
        it); without, the last prompt token is recomputed by its first decode step (the pool holds
        every earlier position)."""
        seq.events.scheduled = time.perf_counter()
        seq.cacheable = False  # its KV was not written by this engine's prefill: never a prefix-cache hit
        if logits is None:
            self.scheduler.admit_running(seq, seq.num_tokens - 1)
            return False
        tok = self._sample([seq], logits[None])[0]
        self.scheduler.admit_running(seq, seq.num_tokens)
        done = self.scheduler.append_token(seq, tok, self.eos_token_ids, self.max_model_len)
        self._token_events([seq], time.perf_counter())
        return done

    @property
    def overlap(self) -> bool:
        """Greedy decode steps overlap the host's work with the GPU's (`EngineConfig.overlap`)."""
        on = self.config.overlap
        return self.uses_graphs if on is None else on

    def step(self) -> list[Sequence]:
        """Run one scheduled batch (a prefill chunk, or a decode token for every running request).

        With `overlap`, a decode batch of greedy requests is launched and its tokens are read at the
        next call, after that call has launched the following step on them (their ids stay on the
        device): the same batch again, the usual steady state, where no request is waiting and none
        ends by length. The host then schedules, stages and postprocesses while the GPU computes.
        A request that stops on a token still has that following step computed; it is dropped
        unread. Returns the requests that finished (with overlap: in the step read by this call)."""
        if self._inflight is not None:
            return self._advance()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        t0 = time.perf_counter()
        for s in batch.seqs:
            if s.events.scheduled is None:
                s.events.scheduled = t0
        if not batch.is_prefill and self.overlap and self._greedy_only(batch.seqs):
            self._inflight = self._launch(batch, t0)
            return []
        planned = [s for s in batch.seqs if s.plan is not None]
        logits = self.runner.run_rows(batch) if planned else self.runner.run(batch)
        sampling = [i for i in range(len(batch.seqs)) if (not batch.is_prefill or batch.completes_prefill(i))
                    and not (batch.seqs[i].plan is not None and batch.seqs[i].plan.cache_only)]
        sampled: dict[int, int] = {}
        if sampling:
            seqs = [batch.seqs[i] for i in sampling]
            toks = self._sample(seqs, logits if not batch.is_prefill else logits[sampling])
            sampled = {s.seq_id: t for s, t in zip(seqs, toks)}
        if planned:
            self.stats.planned_batches.append(sum(not s.plan.cache_only for s in planned))
            for s in planned:
                s.plan.done()
                s.cacheable = s.cacheable and s.plan.cache_only  # a plan's KV is not a prefill's: never a prefix hit
        t1 = self._last_read = time.perf_counter()
        self._account(batch, t1 - t0)
        finished = self.scheduler.postprocess(batch, sampled, self.eos_token_ids, self.max_model_len)
        self._token_events([s for s in batch.seqs if s.seq_id in sampled], t1)
        self.stats.preemptions = self.scheduler.num_preemptions
        return finished

    @staticmethod
    def _greedy_only(seqs: list[Sequence]) -> bool:
        """Tokens the device picks alone: greedy, not teacher-forced, no logits kept on the host."""
        return all(s.params.temperature == 0 and not s.params.forced_tokens and not s.params.keep_logits for s in seqs)

    def _launch(self, batch: Batch, t0: float, ids_ahead: torch.Tensor | None = None) -> _InFlight:
        """Queue a greedy decode step (`ids_ahead`: one step ahead, `ModelRunner.prepare`) and the
        copy of its tokens to the host; nothing waits for the GPU."""
        toks = self.runner.run(batch, ids_ahead=ids_ahead).argmax(dim=-1)
        prev = self._inflight  # still unread: the other buffer
        buf = self._tok_bufs[0]
        if prev is not None and prev.host.data_ptr() == buf.data_ptr():
            buf = self._tok_bufs[1]
        host = buf[: len(batch.seqs)]
        host.copy_(toks, non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return _InFlight(batch, toks, host, ready, t0)

    def _advance(self) -> list[Sequence]:
        """Launch the step after the one in flight where it is the same batch again, then read the
        one in flight and advance its requests."""
        cur = self._inflight
        assert cur is not None
        nxt = self._batch_after(cur.batch) if self.overlap else None  # overlap off since (eager mode): read only
        self._inflight = None if nxt is None else self._launch(nxt, time.perf_counter(), ids_ahead=cur.toks)
        if cur.ready is not None:
            cur.ready.synchronize()
        toks = cur.host.tolist()
        t1 = time.perf_counter()
        live = [i for i, s in enumerate(cur.batch.seqs) if s.status == Status.RUNNING]  # not stopped or aborted since
        batch = Batch(False, [cur.batch.seqs[i] for i in live], [1] * len(live))
        if live:  # a step left in flight after its last request stopped counts no time, however late it is read
            self._account(batch, t1 - max(cur.t0, self._last_read))
            self._last_read = t1
        finished = self.scheduler.postprocess(batch, {cur.batch.seqs[i].seq_id: toks[i] for i in live},
                                              self.eos_token_ids, self.max_model_len)
        self._token_events(batch.seqs, t1)
        return finished

    def _batch_after(self, batch: Batch) -> Batch | None:
        """The decode batch after `batch` (whose tokens are not appended yet), when it is `batch`
        again: the running requests, all of them in it, nothing waiting, none ending by length at
        its token, each with a block for the next position (taken here). Else None."""
        sched = self.scheduler
        if sched.waiting or len(sched.running) != len(batch.seqs) or any(a is not b for a, b in zip(sched.running, batch.seqs)):
            return None
        for s in batch.seqs:
            if s.num_completion_tokens + 1 >= s.params.max_tokens or s.num_tokens + 1 >= self.max_model_len:
                return None
        for s in batch.seqs:
            if not self.block_manager.can_grow(s, s.num_tokens + 1):
                return None
            self.block_manager.grow(s, s.num_tokens + 1)
        return Batch(False, list(batch.seqs), [1] * len(batch.seqs))

    @staticmethod
    def _token_events(seqs: list[Sequence], now: float) -> None:
        for s in seqs:
            ev = s.events
            if ev.first_token is None:
                ev.first_token = now
            ev.tokens.append(now)
            if s.status == Status.FINISHED:
                ev.finished = now

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
        prompts: Seq,
        params: SamplingParams | Seq[SamplingParams] | None = None,
        chat: bool = True,
        on_token: Callable[[int], None] | None = None,
        admit: Callable[..., tuple[list[int], Sequence]] | None = None,
    ) -> list[Completion]:
        """Run prompts (text or token ids) to completion with continuous batching; results in prompt
        order. `admit(prompt, params, arrival, chat)` → (token ids, request): how a prompt enters
        (default `admit_prompt`; `LLM` admits prompts with reusable segments its own way)."""
        params_list = self._params_list(prompts, params)
        t0 = time.perf_counter()
        encoded, seqs = [], []
        for prompt, p in zip(prompts, params_list):
            ids, seq = (admit or self.admit_prompt)(prompt, p, t0, chat)
            encoded.append(ids)
            seqs.append(seq)
        return self.run_to_completion(encoded, seqs, on_token)

    def admit_prompt(self, prompt: str | list[int], params: SamplingParams, arrival: float | None = None,
                     chat: bool = True) -> tuple[list[int], Sequence]:
        """A text or token-id prompt, encoded and added to the scheduler."""
        ids = self.encode_prompt(prompt, chat)
        return ids, self.add_request(ids, params, arrival)

    @staticmethod
    def _params_list(prompts: Seq, params: SamplingParams | Seq[SamplingParams] | None) -> list[SamplingParams]:
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        return params_list

    def run_to_completion(
        self, encoded: list[list[int]], seqs: list[Sequence], on_token: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """Step until the engine is idle; `on_token(n)`: `n` new tokens of `seqs` after each step.
        Each request's time to first token (from its arrival) goes to `stats.first_token_seconds`."""
        while self.scheduler.has_work():
            before = sum(s.num_tokens for s in seqs)
            self.step()
            if on_token is not None:
                on_token(sum(s.num_tokens for s in seqs) - before)
        self.stats.first_token_seconds += [s.events.first_token - s.events.arrival for s in seqs
                                           if s.events.first_token is not None]
        return [
            Completion(ids, s.completion_ids, self.tokenizer.decode(s.completion_ids) if self.tokenizer else None,
                       s.finish_reason)
            for ids, s in zip(encoded, seqs)
        ]

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits `[n, V]` at every prompt position (prefill in chunks, through the pool)."""
        if self.scheduler.has_work():
            raise RuntimeError("prompt_logits needs an idle engine")
        self._check_prompt(token_ids)
        seq = Sequence(list(token_ids), SamplingParams(max_tokens=1))
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
