"""`SparsetuneBackend`: a bundle's decode flow as an SGLang attention backend (SGLang 0.5.13-0.5.16 and 0.5.23).

SGLang builds it through the plugin (`plugin.register`, `--attention-backend sparsetune`), with the
bundle from `SPARSETUNE_BUNDLE` or the server argument `--json-model-override-args
'{"sparsetune_bundle": "DIR"}'`. It wraps a stock dense backend (`triton` on a GPU, `torch_native`
on CPU; `SPARSETUNE_DENSE_BACKEND` picks another) for every extend (prefill) and for the flow's
dense layers, and decodes the sparse layers with this package's own flow machinery, the very
`FlowAttention` the embedded engine runs, on **SGLang's** KV pool:

- SGLang's pool is flat, `k_buffer[layer]` `[slots, Hkv, D]`, with `req_to_token[row, pos] -> slot`
  and pages of `page_size` consecutive slots. With page size = the flow's block size, its buffers
  viewed `[pages, Hkv, P, D]` (strided, not copied: `PagedPool`) and the page table
  `req_to_token[req_pool_indices, ::P] // P` are this engine's paged pool, pages the blocks and
  the field rows (`flow/compile/layout.py` says why no layout of its own is needed). Page 0 is
  SGLang's padding page: the null block that padded rows read and write.
- extend: the dense backend writes the KV and attends; then the flow's cache stage fills the
  fields of every page the extend completed (`FlowAttention.write_fields`).
- decode, sparse layer: the new K/V go into SGLang's pool, the cache stage updates the fields of a
  page the token completes, the indexer scores the request's pages, the radix-select top-k picks
  them, and the sparse paged attention reads the picked pages from SGLang's buffers.
- CUDA graphs: the dense backend's graph state and hooks, plus the page table gathered inside the
  graph (`init_forward_metadata_in_graph`) into a buffer as wide as the longest request
  SGLang admits; the flow's decode reads tensors only, as in the embedded engine's graphs.

A calibrated flow (DoubleSparse's channels) reads the bundle's calibration file, checked against the
served model's layers, KV heads and head_dim. A reuse bundle's reuse flow runs its prefill in
SGLang's model forward (`export.sglang.reuse`, planned by `export.sglang.schedule`, whose hooks
this backend registers in the scheduler's process; requests mark segments as `export.sglang.segments`
says): an extend that holds such a request is run by its `ReuseStep` here, not by the dense backend.
Out of scope (refused with one line when SGLang is launched so): a calibrated flow under tensor
parallelism (a rank would need its KV heads' global indices), a reuse flow that narrows the MLP per
row, MLA or hybrid (SWA) pools, the page-major pool, and a page size other than the bundle's block size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool

from sparsetune.engine.attention import AttentionMetadata
from sparsetune.errors import SparsetuneError
from sparsetune.export.bundle import BACKEND as NAME
from sparsetune.export.bundle import BUNDLE_ENV, calibration_of, flow_of, read_bundle, reuse_flow_of
from sparsetune.export.sglang.pool import PagedPool, page_table
from sparsetune.flow.attention import FlowAttention
from sparsetune.flow.base import DecodeFlow
from sparsetune.models.artifacts import load_calibration

DENSE_ENV = "SPARSETUNE_DENSE_BACKEND"
# The server-argument way to name the bundle: `--json-model-override-args '{"sparsetune_bundle": "DIR"}'`
# (SGLang merges those keys into the model's HF config, which every one of its processes reads).
CONFIG_KEY = "sparsetune_bundle"


def bundle_of(model_runner) -> str | None:
    """The bundle a launch names: the server argument (the HF config's `sparsetune_bundle`), else
    `SPARSETUNE_BUNDLE`."""
    hf = getattr(getattr(model_runner, "model_config", None), "hf_config", None)
    return getattr(hf, CONFIG_KEY, None) or os.environ.get(BUNDLE_ENV)


def load_flow(bundle: str | Path | None) -> tuple[DecodeFlow, dict[str, Any], Path]:
    """The decode flow a bundle holds (its parameters resolved), its manifest and its folder."""
    if not bundle:
        raise SparsetuneError(f"--attention-backend {NAME} needs a bundle: set {BUNDLE_ENV}=DIR or pass "
                              f"--json-model-override-args '{{\"{CONFIG_KEY}\": \"DIR\"}}' (`sparsetune export ... --out DIR` "
                              "writes one; its launch_sglang.sh sets the variable)")
    path = Path(bundle)
    manifest = read_bundle(path)  # checks the graph's sha256 against the manifest
    flow = flow_of(path, manifest)  # from the graph: no Python of the bundle runs
    return flow, manifest, path


def load_channels(path: Path, manifest: dict[str, Any], model_runner, layers: int, pool) -> list | None:
    """A calibrated flow's channel order from its bundle, checked against the served model (None: the
    flow is not calibrated). Tensor parallelism is refused: a rank holds some of the KV heads, and
    which ones is not the backend's to know."""
    found = calibration_of(path, manifest)
    if found is None:
        return None
    total = whole_model_only(model_runner, pool, f"flow {manifest['flow']!r} is calibrated (a channel order per KV head)")
    return load_calibration(found[0], layers, total, pool.head_dim,
                            fix="export again with the served model's calibration (`sparsetune export ... --model M`)")


def whole_model_only(model_runner, pool, what: str) -> int:
    """The model's KV heads, refusing a rank that holds only some of them (tensor parallelism), in one
    line that says `what` needs them all."""
    mc = getattr(model_runner, "model_config", None)
    total = mc.get_total_num_kv_heads() if hasattr(mc, "get_total_num_kv_heads") else pool.head_num
    if pool.head_num != total or (getattr(model_runner, "tp_size", 1) or 1) > 1:
        raise SparsetuneError(f"{what}: its bundle serves at --tp-size 1, and this rank holds {pool.head_num} of the "
                              f"model's {total} KV heads")
    return total


def in_effect(args, name: str):
    """A server argument's value in effect. 0.5.23 keeps the operator's input on `ServerArgs` and what
    SGLang resolved from it (a default it picked) apart: `resolution_result` reads the latter first;
    0.5.16 resolves in place."""
    try:
        from sglang.srt.arg_groups.overrides import resolution_result
    except ImportError:
        return getattr(args, name, None)
    return resolution_result(args, name, None)


def step_metadata(fb, req_to_token: torch.Tensor, page_size: int, pages: int | None = None) -> AttentionMetadata:
    """This engine's `AttentionMetadata` of an SGLang `ForwardBatch`. `pages`: the page table's
    width (a CUDA graph's fixed one); None: as wide as the batch's longest request needs."""
    b = fb.batch_size
    seq_lens = fb.seq_lens.to(torch.int32)
    decode = fb.forward_mode.is_decode()
    if decode:
        seq_cpu = fb.seq_lens_cpu.tolist() if fb.seq_lens_cpu is not None and pages is None else []
        qsl = list(range(b + 1))
        positions = seq_lens.long() - 1
    else:
        seq_cpu = fb.seq_lens_cpu.tolist()
        qsl = [0]
        for n in fb.extend_seq_lens_cpu:
            qsl.append(qsl[-1] + int(n))
        positions = fb.positions
    if pages is None:
        longest = max(seq_cpu) if seq_cpu else req_to_token.shape[1]
        pages = -(-int(longest) // page_size)
    return AttentionMetadata(
        is_prefill=not decode, positions=positions, slot_mapping=fb.out_cache_loc,
        block_tables=page_table(req_to_token, fb.req_pool_indices, page_size, pages), seq_lens=seq_lens,
        seq_lens_cpu=[int(n) for n in seq_cpu], query_start_loc_cpu=qsl, seq_ids=list(range(b)),
    )


class SparsetuneBackend(AttentionBackend):
    """The `sparsetune` attention backend; see the module docstring."""

    def __init__(self, model_runner, bundle: str | Path | None = None, dense: str | None = None,
                 executor: str | None = None) -> None:
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.flow, self.manifest, path = load_flow(bundle or bundle_of(model_runner))
        page = int(model_runner.page_size)
        if page != self.flow.block_size:
            raise SparsetuneError(f"SGLang's page size is {page} but the bundle's flow uses blocks of {self.flow.block_size} "
                                  f"tokens: launch with --page-size {self.flow.block_size}")
        if type(self.token_to_kv_pool) is not MHATokenToKVPool:
            raise SparsetuneError(f"the {NAME} backend runs on SGLang's MHATokenToKVPool (MHA/GQA models, no hybrid or "
                                  f"page-major pool); this model's pool is {type(self.token_to_kv_pool).__name__}")
        self.page_size = page
        cuda = torch.device(self.device).type == "cuda"
        dense = dense or os.environ.get(DENSE_ENV) or ("triton" if cuda else "torch_native")
        if dense == NAME or dense not in ATTENTION_BACKENDS:
            raise SparsetuneError(f"{DENSE_ENV}={dense!r}: not one of SGLang's attention backends "
                                  f"({', '.join(sorted(k for k in ATTENTION_BACKENDS if k != NAME))})")
        self.dense = ATTENTION_BACKENDS[dense](model_runner)
        self.dense_name = dense
        self.executor = executor or ("compiled" if cuda else "reference")
        # The engine's rule for which layers a flow runs on (its layer params checked against the model's)
        layers = getattr(getattr(model_runner, "model_config", None), "num_hidden_layers", None)
        pool = self.token_to_kv_pool
        layers = layers or getattr(pool, "end_layer", pool.layer_num - 1) + 1
        # dense decode (a reuse bundle's without a decode flow of its own): no sparse layer
        self.sparse = frozenset() if self.flow.full_attention else frozenset(self.flow.sparse_layers(layers))
        self.channels = load_channels(path, self.manifest, model_runner, layers, pool)
        self.pool = PagedPool(self.token_to_kv_pool, page)
        self.reuse = reuse_flow_of(path, self.manifest)  # a reuse bundle's reuse flow (None: a decode bundle)
        if self.reuse is not None:
            self._serve_reuse(model_runner, layers)
        self.attn: FlowAttention | None = None  # built at the first layer (its scaling)
        self.meta: AttentionMetadata | None = None
        self._graph_pages = 0  # the page table's width in CUDA graphs (0: no graphs)

    def _serve_reuse(self, model_runner, layers: int) -> None:
        """A reuse bundle: its flow's prefill runs in SGLang's model forward (`export.sglang.reuse`),
        planned by the scheduler hooks (`export.sglang.schedule`), registered here, in the scheduler's
        process, where SGLang builds this backend."""
        from sglang.srt.plugins.hook_registry import HookRegistry

        from sparsetune.engine.rope import inv_frequencies
        from sparsetune.export.sglang import reuse, schedule
        from sparsetune.export.sglang.segments import add_hooks
        from sparsetune.models.config import ModelConfig

        reuse.check_flow(self.reuse)
        self._check_reuse_launch(getattr(model_runner, "server_args", None))
        whole_model_only(model_runner, self.token_to_kv_pool,
                         f"reuse flow {self.reuse.name!r} selects tokens from all KV heads' keys (ranks would select apart)")
        hf = model_runner.model_config.hf_config
        cfg = ModelConfig.from_hf(hf.to_dict(), "the served model's config")  # the engine's RoPE rule
        self.reuse_layers, self.reuse_scale = layers, cfg.head_dim**-0.5
        self.inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(self.device)
        reuse.wrap_model(model_runner.model)
        add_hooks(schedule.HOOKS)
        HookRegistry.apply_hooks()

    def _check_reuse_launch(self, args) -> None:
        """What a reuse bundle's launch_sglang.sh sets, checked (its "$@" may undo it, and SGLang may pick
        a value the launch left unset): a reuse request prefills whole (no chunked prefill), eagerly (no
        prefill CUDA graph), in this backend, as one extend of one scheduler run by the model's `forward`."""
        if args is None:
            return
        fix = "as the bundle's launch_sglang.sh does"
        chunk = in_effect(args, "chunked_prefill_size")
        if (chunk or -1) > 0:
            raise SparsetuneError(f"--chunked-prefill-size {chunk}: a reuse bundle prefills a request whole; launch with "
                                  f"--chunked-prefill-size -1 ({fix})")
        cfg = getattr(args, "cuda_graph_config", None)  # what SGLang uses, the flag folded in
        phase = cfg.get("prefill") if isinstance(cfg, dict) else getattr(cfg, "prefill", None)
        graph = ((phase.get("backend") if isinstance(phase, dict) else getattr(phase, "backend", None))
                 or in_effect(args, "cuda_graph_backend_prefill"))
        if graph not in (None, "disabled"):
            raise SparsetuneError(f"--cuda-graph-backend-prefill {graph}: a reuse request's rows change per layer; launch "
                                  f"with --cuda-graph-backend-prefill disabled ({fix})")
        prefill = in_effect(args, "prefill_attention_backend")
        if prefill not in (None, NAME):
            raise SparsetuneError(f"--prefill-attention-backend {prefill}: a reuse bundle's prefill runs in the {NAME} "
                                  "backend; drop the flag")
        for flag, off in (("enable_pdmux", False), ("enable_two_batch_overlap", False), ("disaggregation_mode", "null"),
                          ("pp_size", 1)):
            value = in_effect(args, flag)
            if value not in (off, None):
                raise SparsetuneError(f"--{flag.replace('_', '-')} {value}: a reuse bundle serves without split prefill "
                                      "(pdmux), two-batch overlap, prefill/decode disaggregation and pipeline "
                                      "parallelism; drop the flag")

    # ---- metadata --------------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch) -> None:
        self.dense.init_forward_metadata(forward_batch)
        self.meta = step_metadata(forward_batch, self.req_to_token_pool.req_to_token, self.page_size)
        if self.reuse is None:
            return
        from sparsetune.export.sglang.reuse import ReuseStep, release_pins
        from sparsetune.export.sglang.schedule import take

        taken = take(forward_batch)  # the scheduler's plans for this batch's requests
        if taken is not None:
            requests, pins = taken
            try:
                forward_batch.sparsetune_reuse = ReuseStep(
                    self.reuse, self.token_to_kv_pool, self.req_to_token_pool.req_to_token, forward_batch, requests,
                    self.reuse_layers, self.reuse_scale, self.inv_freq, self.page_size, pins=pins)
            except Exception:
                release_pins(pins)  # nothing runs the step: its segments go back to the tree
                raise

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.dense.init_cuda_graph_state(max_bs, max_num_tokens)
        self._graph_pages = -(-self.req_to_token_pool.req_to_token.shape[1] // self.page_size)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.dense.get_cuda_graph_seq_len_fill_value()

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        self.dense.init_forward_metadata_out_graph(forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        self.dense.init_forward_metadata_in_graph(forward_batch)
        self.meta = step_metadata(forward_batch, self.req_to_token_pool.req_to_token, self.page_size,
                                  pages=self._graph_pages or None)

    # ---- attention -------------------------------------------------------------------------------

    def is_sparse(self, layer) -> bool:
        return layer.layer_id in self.sparse

    def flow_attention(self, layer) -> FlowAttention:
        if self.attn is None:
            self.attn = FlowAttention(self.flow, layer.scaling, executor=self.executor, calibration=self.channels)
        elif layer.scaling != self.attn.scale:
            raise SparsetuneError(f"layer {layer.layer_id} scales attention by {layer.scaling}, layer 0 by "
                                  f"{self.attn.scale}: the {NAME} backend needs one scale")
        return self.attn

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        step = getattr(forward_batch, "sparsetune_reuse", None)  # a reuse flow's rows (`export.sglang.reuse`)
        if step is not None:
            out = step.attention(layer.layer_id, q, k, v, layer.tp_q_head_num, layer.qk_head_dim)
        else:
            out = self.dense.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if self.is_sparse(layer):
            self.flow_attention(layer).write_fields(layer.layer_id, self.pool, self.meta)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if not self.is_sparse(layer):
            return self.dense.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if save_kv_cache and k is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc), k, v)
        attn = self.flow_attention(layer)
        attn.write_fields(layer.layer_id, self.pool, self.meta)
        qh = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        return attn.decode(layer.layer_id, qh, self.pool, self.meta).reshape(qh.shape[0], -1)
