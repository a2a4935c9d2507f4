"""What one decode step costs: the bytes it reads (the benchmarks' byte floor) and its modeled time
(the search's speed on machines where decode speed is not measured).

**Bytes.** A decode step at batch B and context n reads every weight matrix once (of an untied
embedding only the batch's rows), on a dense layer the K/V of all n tokens, and on a sparse layer
the K/V of the units the flow attends (`DecodeFlow.attended_blocks`) plus, on the layers that
select, every unit's cached fields (a two-level flow: every page's, then the kept pages' units').
Fields are stored as the engine keeps them: in the pool's dtype, or in 8 bits (`field_dtype`).

**Time** (`modeled_step_seconds`). Bytes alone rank small units wrongly (2-token blocks read few
bytes but decode slower than dense on a GPU: #43), so the model counts what the step does, by
operation (`StepWork`): weight and K/V bytes, attention's per-unit work, the indexer's field bytes
and candidates, each top-k's row width (one program per row: rows beyond the GPU's SMs run in
further waves), the selection's launches, and a constant per step (fitted: 0 on the H200). Each count has a cost in seconds,
measured on a GPU and shipped as data (`perf/costs/*.json`: the GPU, the date, the command and
the fit's points; `benchmarks/bench_costs.py` and `benchmarks/fit_costs.py` make them). The
model is tested on GPU-measured points its costs were not fitted on (`tests/perf/test_cost_model.py`).
Rows wider than the radix select's (`MAX_WIDTH`) count as torch's top-k. Not counted: other GPUs
than the data's (the costs of one GPU are not another's).

**Memory** (`field_memory_share`): a flow's fields sit beside the KV pool, so with small units
fewer sequences fit in the same memory (per-unit fields at 2-token units add 25-50% to the KV).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from sparsetune.errors import SparsetuneError
from sparsetune.flow.base import DecodeFlow
from sparsetune.flow.shapes import field_bytes_per_block, field_bytes_per_unit, index_traits
from sparsetune.kernels.limits import TOPK_MAX_WIDTH as MAX_WIDTH
from sparsetune.models.config import ModelConfig


@dataclass(frozen=True)
class StepBytes:
    weights: int
    kv: int  # K and V read by attention
    fields: int  # the flow's cached fields read by its indexer

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.fields


def weight_bytes(cfg: ModelConfig, batch: int, dtype_bytes: int) -> int:
    """Weights one decode step reads: every matrix once; of an untied embedding, the batch's rows."""
    emb = cfg.vocab_size * cfg.hidden_size
    read = cfg.num_parameters() - (0 if cfg.tie_word_embeddings else emb - batch * cfg.hidden_size)
    return read * dtype_bytes


def forced_only(cfg: ModelConfig, flow: DecodeFlow) -> bool:
    """Whether the flow's indexer scores nothing (`F.keep_only_forced`: sinks and the local window)."""
    return index_traits(flow, cfg.head_dim, flow.const_dims(cfg.head_dim)).forced_only


def attended_tokens(cfg: ModelConfig, flow: DecodeFlow, context: int) -> int:
    """The tokens a sparse layer of `flow` attends in a sequence of `context` tokens (the budget's
    units; sinks and the local window only for an indexer that scores nothing)."""
    u = flow.unit
    units = flow.attended_blocks(-(-context // u), not forced_only(cfg, flow))
    return min(context, units * u - (-context) % u)  # the last unit (always kept) is partial


def decode_step_bytes(cfg: ModelConfig, flow: DecodeFlow | None, batch: int, context: int, dtype_bytes: int) -> StepBytes:
    """What one decode step reads with `flow` (None: dense) at `batch` sequences of `context` tokens."""
    kv_token_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    layers = cfg.num_hidden_layers
    weights = weight_bytes(cfg, batch, dtype_bytes)
    if flow is None:
        return StepBytes(weights, batch * context * kv_token_layer * layers, 0)
    nb = -(-context // flow.unit)
    sparse = [i for i in range(layers) if i not in flow.dense_layers]
    selecting = [i for i in sparse if not flow.select_layers or i in flow.select_layers]
    attended = attended_tokens(cfg, flow, context)
    kv = batch * kv_token_layer * (context * (layers - len(sparse)) + attended * len(sparse))
    page = flow.page_flow()
    if page is None:
        fields = batch * nb * field_bytes_per_unit(flow, cfg, dtype_bytes) * len(selecting)
    else:  # two levels: every block's fields, then those of the chosen blocks' units
        npages = -(-context // page.block_size)
        chosen = page.attended_blocks(npages) * (page.block_size // flow.unit)
        per = npages * field_bytes_per_unit(page, cfg, dtype_bytes) + chosen * field_bytes_per_unit(flow, cfg, dtype_bytes)
        fields = batch * per * len(selecting)
    return StepBytes(weights, kv, fields)


def kv_share(cfg: ModelConfig, flow: DecodeFlow | None, context: int) -> float:
    """The share of the context's K/V a decode step reads with `flow` (dense layers, the attended
    blocks, sinks and local window included; fields not): the "1/8 of the context" a budget means."""
    dense = decode_step_bytes(cfg, None, 1, context, 2).kv
    return decode_step_bytes(cfg, flow, 1, context, 2).kv / dense


def byte_floor_speedup(cfg: ModelConfig, flow: DecodeFlow | None, batch: int, context: int, dtype_bytes: int) -> float:
    """Dense step bytes over the flow's: the decode speedup at the byte floor."""
    return decode_step_bytes(cfg, None, batch, context, dtype_bytes).total / decode_step_bytes(
        cfg, flow, batch, context, dtype_bytes).total


# ---- modeled step time -------------------------------------------------------------------------------

COSTS_DIR = Path(__file__).with_name("costs")
DEFAULT_COSTS = "h200"
WORK = ("weight_bytes", "kv_bytes", "dense_pages", "units", "units_in_pages", "field_bytes", "candidates", "topk_lanes", "wide_topk", "launches", "step")


@dataclass(frozen=True)
class StepWork:
    """What one decode step does, summed over layers; `rows` is batch x KV heads."""
    weight_bytes: float  # weights read
    kv_bytes: float  # K and V attention reads (dense layers: all; sparse: the attended units)
    dense_pages: float  # rows x pages dense attention walks
    units: float  # rows x units sparse attention gathers (its per-unit work), units that are pages
    units_in_pages: float  # the same, for units smaller than a page (each found inside its page)
    field_bytes: float  # cached fields (and raw keys) the indexers read, both levels
    candidates: float  # rows x units (or pages) scored, both levels
    topk_lanes: float  # per top-k: its row's lanes (the radix select's registers) x waves of rows over the SMs
    wide_topk: float  # rows x width of top-ks on rows wider than the radix select's (torch's top-k instead)
    launches: float  # the selection's kernel launches (a level: indexer, top-k; two levels: and the units' map)
    step: float = 1.0  # the step's fixed part (norms, sampling, launches)

    def vector(self) -> list[float]:
        return [float(getattr(self, k)) for k in WORK]


def topk_lanes(width: int) -> int:
    """Lanes the radix select holds a row of `width` in: a power-of-two main tile and a small tail
    (`kernels.select_topk`)."""
    main = 1 << (max(1, width).bit_length() - 1)
    rest = width - main
    return main + (0 if rest <= 0 else 1 << (rest - 1).bit_length())


def decode_step_work(cfg: ModelConfig, flow: DecodeFlow | None, batch: int, context: int, num_sms: int,
                     page: int = 16, dtype_bytes: int = 2) -> StepWork:
    """`StepWork` of one decode step of `batch` sequences at `context` tokens (dense: on `page`-token pages)."""
    by = decode_step_bytes(cfg, flow, batch, context, dtype_bytes)
    rows = batch * cfg.num_key_value_heads
    layers = cfg.num_hidden_layers
    if flow is None:
        return StepWork(by.weights, by.kv, rows * -(-context // page) * layers, 0, 0, 0, 0, 0, 0, 0)
    sparse = [i for i in range(layers) if i not in flow.dense_layers]
    selecting = [i for i in sparse if not flow.select_layers or i in flow.select_layers]
    dense_pages = rows * -(-context // flow.block_size) * (layers - len(sparse))
    nb = -(-context // flow.unit)
    forced = forced_only(cfg, flow)  # runs the indexer once on dummy inputs: asked once
    units = rows * flow.attended_blocks(nb, not forced) * len(sparse)
    waves = -(-rows // num_sms)
    keys = cfg.num_key_value_heads * cfg.head_dim * dtype_bytes  # a token's raw keys, for an indexer that reads them
    page_flow = flow.page_flow()
    if forced:  # sinks and the local window: nothing scored, no top-k (one tensor function)
        scored, widths, extra = 0, [], 0
    elif page_flow is None:
        scored, widths = nb, [nb]
        extra = nb * flow.unit * keys if flow.uses_keys else 0
    else:
        npages = -(-context // page_flow.block_size)
        chosen = page_flow.attended_blocks(npages) * (flow.block_size // flow.unit)  # the kept pages' units
        scored, widths = npages + chosen, [npages, chosen]
        units = min(units, rows * chosen * len(sparse))  # no more than the kept pages hold
        extra = (npages * page_flow.block_size * keys if page_flow.uses_keys else 0) + \
            (chosen * flow.unit * keys if flow.uses_keys else 0)
    lanes = waves * sum(topk_lanes(w) for w in widths if w <= MAX_WIDTH)
    wide = rows * sum(w for w in widths if w > MAX_WIDTH)
    sel = len(selecting)
    inside = flow.unit < flow.block_size
    return StepWork(by.weights, by.kv, dense_pages, 0 if inside else units, units if inside else 0, by.fields + batch * extra * sel, rows * scored * sel,
                    lanes * sel, wide * sel, max(0, 3 * len(widths) - 1) * sel)


@dataclass(frozen=True)
class Costs:
    """Seconds per unit of each `StepWork` count on one GPU, as measured (`perf/costs/<name>.json`)."""
    gpu: str
    date: str
    num_sms: int
    seconds: dict[str, float]
    shape: tuple[str, int, int]  # (model, batch, context) the costs were tested at: a modeled search's default
    source: dict

    @classmethod
    def load(cls, name: str = DEFAULT_COSTS) -> "Costs":
        return _load_costs(name)

    def step_seconds(self, work: StepWork) -> float:
        return sum(self.seconds[k] * v for k, v in zip(WORK, work.vector()))

    def describe(self) -> str:
        return f"modeled step time on {self.gpu} (per-operation costs measured {self.date})"


@functools.lru_cache(maxsize=None)
def _load_costs(name: str) -> Costs:
    path = COSTS_DIR / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in COSTS_DIR.glob("*.json")))
        raise SparsetuneError(f"no measured decode costs named {name!r}; known: {known}")
    d = json.loads(path.read_text())
    missing = [k for k in WORK if k not in d["seconds"]]
    if missing:
        raise SparsetuneError(f"{path}: costs lack {', '.join(missing)}; refit with benchmarks/fit_costs.py")
    shape = d["shape"]
    return Costs(d["gpu"], d["date"], int(d["num_sms"]), {k: float(d["seconds"][k]) for k in WORK},
                 (shape["model"], int(shape["batch"]), int(shape["context"])), d.get("source", {}))


def modeled_step_seconds(cfg: ModelConfig, flow: DecodeFlow | None, batch: int, context: int,
                         costs: Costs | None = None, page: int = 16) -> float:
    """One decode step's modeled seconds (16-bit weights and KV) on `costs`' GPU."""
    costs = costs or Costs.load()
    return costs.step_seconds(decode_step_work(cfg, flow, batch, context, costs.num_sms, page))


def modeled_speedup(cfg: ModelConfig, flow: DecodeFlow | None, batch: int, context: int, costs: Costs | None = None) -> float:
    """Dense step time over the flow's, both modeled (dense on the flow's pages, as the search measures it)."""
    page = 16 if flow is None else flow.block_size
    return modeled_step_seconds(cfg, None, batch, context, costs, page) / modeled_step_seconds(
        cfg, flow, batch, context, costs)


def field_memory_share(cfg: ModelConfig, flow: DecodeFlow | None, dtype_bytes: int = 2) -> float:
    """The flow's fields per token over the K/V per token (a pool of `dtype_bytes`-byte elements; the
    fields in it, or in 8 bits): what the fields add to a sequence's memory, so how many fewer
    sequences fit (1 / (1 + share) as many)."""
    if flow is None:
        return 0.0
    per_token_fields = field_bytes_per_block(flow, cfg, dtype_bytes) / flow.block_size
    return per_token_fields / cfg.kv_bytes_per_token(dtype_bytes)


# ---- prefill FLOPs (a reuse flow's compute floor) -----------------------------------------------------

def prefill_flops(cfg: ModelConfig, token_layers: float, mlp_token_layers: float, attention_pairs: float) -> float:
    """Matmul FLOPs of a prefill that computes `token_layers` rows (Σ over layers), runs the MLP on
    `mlp_token_layers` of them and attends `attention_pairs` (row, key) pairs per query head (Σ over
    layers; `ReuseStats` counts all three): the attention projections, the MLP (gate, up, down) and
    QK^T + PV. Norms, RoPE and the LM head are left out (under 1% at long contexts)."""
    d, hd, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    proj = d * (hq + 2 * hkv) * hd + hq * hd * d
    mlp = 3 * d * cfg.intermediate_size
    return 2.0 * (proj * token_layers + mlp * mlp_token_layers) + 4.0 * hd * hq * attention_pairs


def full_prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """`prefill_flops` of a full causal prefill of `tokens` tokens (every row, every key before it)."""
    layers = cfg.num_hidden_layers
    return prefill_flops(cfg, layers * tokens, layers * tokens, layers * tokens * (tokens + 1) / 2)
