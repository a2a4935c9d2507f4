"""`DecodeFlow`: the base of every sparse-attention decode flow.

A flow declares hyperparameters as class attributes of type `Param` and two stages:

- `cache(self, k, v) -> {field: tensor}`: query-independent, runs when a selection unit is complete;
  `k`, `v` are one unit of one KV head, `[1, unit, head_dim]`; each field is `[1, r, c]`. The unit
  is the KV block (the page, `block_size`) unless `select_block` names a smaller one inside it:
  fields are kept per unit and the indexer ranks units.
- `index(self, q, fields) -> F.topk(score)`: every decode step, per layer; `q` is the query
  heads of one KV head's group, `[1, group, head_dim]`; each field comes back as `[S, r, c]`
  over the sequence's S units; `score` is `[S, 1, 1]`. `F.save(fields, name, x)` stores a
  new value of a field for the next step (state); with `uses_keys = True` the raw keys are
  field "k", `[S, unit, head_dim]` (tokens past the sequence end read as zeros).

Either stage may take a third parameter, `const`: per-layer, per-KV-head constants (name →
`[1, r, c]`). A `calibrated` flow gets `const["channels"]`, `[1, channels, head_dim]`: row i is
one-hot at the i-th most important channel of that layer's KV head, from an offline calibration
(`sparsetune flows calibrate`, `calibration/channels.py`), so `F.gemm(k, const["channels"])` keeps the
top channels of each key (DoubleSparse's label cache). A calibrated flow declares the params
`calibration` (a file, or "auto": the default file of the engine's model) and `channels`.

The runtime always keeps the first `sink_blocks` and last `local_blocks` units (the last one
holds the newest token) and fills the rest of the budget with the top-scoring units.

Two levels (`coarse`, with `select_block`): whole blocks are scored first, the best `coarse` x
budget of them kept, and only their units scored by `index`. The blocks are scored by the flow's
own stages run over whole blocks, or by `cache_page(self, k, v)` / `index_page(self, q, fields)`
where the flow defines them (e.g. a pricier rule over the few blocks, a cheaper one over the many
units); `page_flow()` is that first level.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, ClassVar, NamedTuple

import torch

from sparsetune.errors import SparsetuneError
from sparsetune.flow.ops import FT, Selection
from sparsetune.flow.params import Flow, Param, Search


class BudgetRule(NamedTuple):
    """Which blocks a sequence of `nb` blocks attends: its first `sink` and last `local` blocks
    always, and min(nb, max(ceil(ratio * nb), floor)) blocks in all, the product in float64.
    `blocks` (Python), `counts_of` (torch) and `TRITON_*` (the generated indexer) are the same rule.

    At run time the rule is a small float64 tensor on the device (`tensor`: sink, local, ratio,
    floor) that the indexer reads, so a new budget, sink or local setting is written into the
    same tensor: compiled kernels and captured CUDA graphs stay valid."""

    sink: int
    local: int
    ratio: float  # 0.0: a fixed budget, all in `floor`
    floor: int  # never fewer blocks (the always-kept ones included)

    # The generated indexer's parameter (a pointer to `tensor`), the statements that read it, and
    # the statements setting `want` (the blocks a row attends) from `nb`.
    TRITON_PARAM = "rule"
    TRITON_LOAD = ("SINK = tl.load(rule).to(tl.int32)", "LOCAL = tl.load(rule + 1).to(tl.int32)",
                   "RATIO = tl.load(rule + 2)", "FLOOR = tl.load(rule + 3).to(tl.int32)")
    TRITON = ("p = nb.to(tl.float64) * RATIO", "want = p.to(tl.int32)",
              "want = want + (want.to(tl.float64) < p).to(tl.int32)", "want = tl.minimum(tl.maximum(want, FLOOR), nb)")

    def blocks(self, nb: int) -> int:
        return min(nb, max(math.ceil(self.ratio * nb), self.floor))

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The rule as the runtime reads it: float64 `[sink, local, ratio, floor]`."""
        return torch.tensor([self.sink, self.local, self.ratio, self.floor], dtype=torch.float64, device=device)

    @staticmethod
    def counts_of(rule: torch.Tensor, nb: torch.Tensor) -> torch.Tensor:
        """`blocks` of every entry of an integer tensor, for the rule tensor `rule` (graph-safe)."""
        want = torch.ceil(nb.double() * rule[2]).long()
        return torch.minimum(torch.maximum(want, rule[3].long()), nb.long())

    @staticmethod
    def forced_of(rule: torch.Tensor, idx: torch.Tensor, nb: torch.Tensor) -> torch.Tensor:
        """Which block indices `idx` are always kept in sequences of `nb` blocks (broadcasting)."""
        return (idx < rule[0]) | (idx >= nb - rule[1])


# Fields kept in 8 bits (`field_dtype="fp8"`): e4m3, whose largest finite value is 448. A value is
# clamped to it before the cast (`to_store`, and the generated cache stage), so the torch and Triton
# paths agree on large ones (a plain cast does not saturate alike everywhere: the Triton interpreter's
# gives 256 for 500) and a field never holds NaN for a finite key.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def to_store(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as a field store of `dtype` holds it: clamped to e4m3's range first for 8-bit stores."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(dtype) if dtype == FP8 else x.to(dtype)


def from_store(t: torch.Tensor, like: torch.dtype) -> torch.Tensor:
    """A field store's values for math beside tensors of `like` (an 8-bit store widened; others as they are)."""
    return t.to(like) if t.dtype == FP8 else t


# Params the runtime reads (the budget rule and which layers select): no stage may read them, so a
# flow that changes only these keeps its compiled stages (`DecodeFlow.kernel_key`).
RUNTIME_PARAMS = ("budget", "budget_ratio", "sink_blocks", "local_blocks", "dense_layers", "select_layers", "coarse")


class DecodeFlow(Flow):
    full_attention: ClassVar[bool] = False  # True: no selection at all (the `dense` flow)
    uses_keys: ClassVar[bool] = False  # True: the indexer also gets the raw keys as field "k" [S, block, D]
    calibrated: ClassVar[bool] = False  # True: needs a channel calibration; stages get const["channels"]
    # True: the class defines `cache_page` and `index_page`, the stages of its first level (`page_flow`).
    page_stages: ClassVar[bool] = False
    # "": the flow's own level; "_page": the first level of a two-level flow with page stages (whose
    # `cache`/`index` are the flow's `cache_page`/`index_page`; a traced flow's graphs name them so).
    level: ClassVar[str] = ""
    # Which stages take `const` (found once per class, so the runtime's traced code only reads a dict).
    _takes_const: ClassVar[dict[str, bool]] = {"cache": False, "index": False}

    # Every selection flow accepts these (Vortex defaults: block 16, first block + last two). `search`:
    # the budget is searched as a share of the context, the block size over what small heads need;
    # `select_layers` only by flows built to share a selection across layers (TidalDecode declares
    # it): for the others it is one more dimension whose every non-empty value costs accuracy.
    block_size = Param(16, choices=(1, 2, 4, 8, 16, 32, 64), doc="tokens per KV block (the page; the selection "
                       "unit unless select_block is set)", search=Search(choices=(2, 4, 8, 16, 32)))
    select_block = Param(None, choices=(1, 2, 4, 8, 16, 32, 64), kind=int,
                         doc="tokens per selected unit inside a block (default: the whole block); fields are kept "
                         "per unit, and the budget, sink and local blocks count units", search=Search(off=True))
    coarse = Param(None, low=1.0, high=64.0, kind=float,
                   doc="two-level selection (with select_block): score whole blocks first by the same rule, keep "
                   "the best coarse x budget of them, and score only their units", search=Search(off=True))
    budget = Param(2048, low=1, high=1 << 22, log=True, doc="tokens attended per step, rounded up to whole units",
                   search=Search(off=True))
    budget_ratio = Param(None, low=0.0, high=1.0, kind=float, doc="budget as a fraction of the context (overrides budget)",
                         search=Search(low=1 / 64, high=1 / 2, log=True))
    sink_blocks = Param(1, low=0, high=1024, doc="first units always kept (attention sinks)", search=Search(low=0, high=4))
    local_blocks = Param(2, low=1, high=1024, doc="last units always kept (recent window; includes the current one)",
                         search=Search(low=1, high=8))
    dense_layers = Param((0,), kind=tuple, doc="layers that keep full attention (comma-separated indices)",
                         search=Search(layers="first", low=0, high=4))
    select_layers = Param((), kind=tuple, doc="layers that run the indexer; other sparse layers reuse the "
                          "latest selection (empty: every sparse layer selects)", search=Search(off=True))
    field_dtype = Param("auto", choices=("auto", "fp8"), doc="how the fields are stored: auto, in the KV pool's dtype; "
                        "fp8, in 8 bits (e4m3, saturating at +-448): half a 16-bit pool's field bytes, for the indexer "
                        "to read and the pool to hold", search=Search(off=True))

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        if self.select_block is not None and self.block_size % self.select_block:
            raise SparsetuneError(f"--param select_block={self.select_block} must divide block_size={self.block_size} "
                                  "(units inside a block); pick a smaller select_block or a larger block_size")
        if self.coarse is not None and self.unit == self.block_size:
            raise SparsetuneError(f"--param coarse={self.coarse} selects blocks, then units inside them: set "
                                  f"select_block below block_size={self.block_size} too")

    def store_dtype(self, pool: torch.dtype) -> torch.dtype:
        """The dtype of this flow's field stores beside a KV pool of `pool` (`field_dtype`)."""
        return FP8 if self.field_dtype == "fp8" else pool

    def field_itemsize(self, pool_bytes: int) -> int:
        """Bytes of one field element beside a pool of `pool_bytes`-byte elements."""
        return 1 if self.field_dtype == "fp8" else pool_bytes

    @property
    def unit(self) -> int:
        """Tokens per selected unit: `select_block`, else the whole block (the KV page)."""
        return self.select_block or self.block_size

    def page_flow(self) -> DecodeFlow | None:
        """The first level of a two-level flow (`coarse`; None: one level): the same flow over whole
        blocks, whose budget is `coarse` times this one's (in tokens, or as a share) and whose
        always-kept blocks hold every always-kept unit: `sink_blocks` units lie in the first
        ceil(sink * unit / block) blocks, `local_blocks` units in the last ceil(local * unit / block) + 1."""
        if self.coarse is None:
            return None
        p, u = self.block_size, self.unit
        ratio = None if self.budget_ratio is None else min(1.0, self.coarse * self.budget_ratio)
        params = {**self.params(), "select_block": None, "coarse": None, "budget_ratio": ratio,
                  "budget": min(1 << 22, math.ceil(self.coarse * self.budget)),
                  "sink_blocks": -(-self.sink_blocks * u // p), "local_blocks": -(-self.local_blocks * u // p) + 1}
        return type(self).page_level()(**{k: v for k, v in params.items() if k not in self.inapplicable})

    def runs_on_page(self, page: int) -> bool:
        """Whether this flow, its other params as they are, runs on KV pages of `page` tokens (the
        block size it declares; its units inside; a two-level flow's units smaller than the page)."""
        spec, unit = self.param_specs()["block_size"], self.select_block or page
        return (spec.choices is None or page in spec.choices) and page % unit == 0 and (self.coarse is None or unit < page)

    @classmethod
    def page_level(cls) -> type[DecodeFlow]:
        """The class of the first level: the class itself, or with page stages a subclass whose
        stages are `cache_page` / `index_page` (made once per class, so its kernel key is stable)."""
        if not cls.page_stages or cls.level:
            return cls
        made = cls.__dict__.get("_page_level")
        if made is None:
            attrs = {"level": "_page", "__module__": cls.__module__, "__doc__": f"The first level of {cls.__name__}.",
                     **({} if cls.uses_stage_graphs() else {"cache": cls.cache_page, "index": cls.index_page})}
            made = type(f"{cls.__name__}Pages", (cls,), attrs)
            cls._page_level = made
        return made

    @classmethod
    def uses_stage_graphs(cls) -> bool:
        """True for a flow whose stages replay traced graphs (`flow.graph.GraphFlow`), not methods."""
        return False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found = {n for n in ("cache_page", "index_page") if callable(getattr(cls, n, None))}  # own or inherited
        if found and found != {"cache_page", "index_page"}:
            raise TypeError(f"flow {cls.__name__} defines {found.pop()} alone: a first level needs both cache_page and "
                            "index_page")
        if found:
            cls.page_stages = True
        cls._takes_const = {s: "const" in inspect.signature(getattr(cls, s)).parameters for s in ("cache", "index")}
        if cls.calibrated and not {"calibration", "channels"} <= set(cls.param_specs()):
            raise TypeError(f"calibrated flow {cls.__name__} must declare the params `calibration` and `channels`")

    def sparse_layers(self, num_layers: int) -> list[int]:
        """The layers this flow runs on in a model of `num_layers` (all but its dense layers), its
        layer params checked: the one rule the engine (`LLM`) and the SGLang backend both follow."""
        bad = [i for i in self.dense_layers if not 0 <= i < num_layers]
        if bad:
            raise SparsetuneError(f"--param dense_layers: layer(s) {bad} out of range for a {num_layers}-layer model")
        sparse = [i for i in range(num_layers) if i not in self.dense_layers]
        if self.select_layers and sparse and sparse[0] not in self.select_layers:
            raise SparsetuneError(
                f"--param select_layers: the first sparse layer ({sparse[0]}) must select, "
                f"since later layers reuse its choice; got {list(self.select_layers)}"
            )
        return sparse

    # ---- the two stages a flow writes -------------------------------------------------------------

    def cache(self, k: FT, v: FT) -> dict[str, FT]:
        return {}

    def index(self, q: FT, fields: dict[str, FT]) -> Selection:
        raise NotImplementedError

    def const_dims(self, head_dim: int) -> dict[str, tuple[int, int]]:
        """The inner shape of each constant the stages get (a calibrated flow: "channels")."""
        return {"channels": (self.channels, head_dim)} if self.calibrated else {}

    def run_cache(self, k: FT, v: FT, const: dict[str, FT]) -> dict[str, FT]:
        """The cache stage, given the constants if it takes them (what the runtime and checker call)."""
        return self.cache(k, v, const) if self._takes_const["cache"] else self.cache(k, v)

    def run_index(self, q: FT, fields: dict[str, FT], const: dict[str, FT]) -> Selection:
        return self.index(q, fields, const) if self._takes_const["index"] else self.index(q, fields)

    # ---- budget ---------------------------------------------------------------------------------

    @property
    def budget_rule(self) -> BudgetRule:
        """The budget as a rule over a sequence's unit count (`budget_ratio` overrides `budget`)."""
        forced = self.sink_blocks + self.local_blocks
        if self.budget_ratio is not None:
            return BudgetRule(self.sink_blocks, self.local_blocks, float(self.budget_ratio), forced)
        return BudgetRule(self.sink_blocks, self.local_blocks, 0.0, max(-(-self.budget // self.unit), forced))

    def kernel_key(self) -> tuple:
        """What the compiled stages depend on: the class and every param but `RUNTIME_PARAMS`.
        Flows with equal keys share their stages' code (kernels, compiled functions)."""
        return (type(self), tuple((k, v) for k, v in self.params().items() if k not in RUNTIME_PARAMS))

    def attended_blocks(self, num_blocks: int, scores: bool = True) -> int:
        """Blocks a sparse layer attends in a sequence of `num_blocks` blocks: the budget's, or for an
        indexer that scores nothing (`F.keep_only_forced`, `scores=False`) the sink and local blocks."""
        if not scores:
            return min(num_blocks, self.sink_blocks + self.local_blocks)
        return self.budget_blocks(num_blocks)

    def budget_blocks(self, num_blocks: int) -> int:
        """Blocks attended for a sequence of `num_blocks` blocks (never fewer than the forced ones)."""
        return self.budget_rule.blocks(num_blocks)


class TwoLevelFlow(DecodeFlow):
    """A decode flow that selects in two levels by default: whole blocks (the KV pages, 16 tokens)
    first, the best `coarse` x budget of them kept, then `select_block`-token units inside those.
    Its stages score units; `cache_page` / `index_page`, where defined, score the blocks (else its
    stages do, over whole blocks). The search samples the unit and the multiple, not the page (1-token
    units are left out of it: their fields cost as much memory as the keys)."""

    block_size = Param(16, choices=(4, 8, 16, 32, 64), doc="tokens per KV page (scored first)", search=Search(off=True))
    select_block = Param(2, choices=(1, 2, 4, 8), kind=int, optional=True,
                         doc="tokens per unit scored inside the kept pages (off: the page)", search=Search(choices=(2, 4)))
    coarse = Param(2.0, low=1.0, high=64.0, kind=float, optional=True,
                   doc="pages kept, as a multiple of the budget (off: one level)", search=Search(low=1.25, high=8.0, log=True))


def on_head_dim(flow: DecodeFlow, params: dict[str, str], head_dim: int, other: int) -> dict[str, str]:
    """`params` (the flow's, as strings) for a model whose heads have `other` channels instead of
    `head_dim`: the same point. A calibrated flow's label channels keep their share of the head
    (DoubleSparse's r = head_dim / group factor: 32 of 64 channels is 64 of 128), so a speed taken
    on another architecture is the speed of the point whose accuracy was measured (the nearest
    value the param accepts; on a tie the larger, the slower); every other param (a share of the
    context, tokens, layer indices) reads the same on any head. A function, not a method: a flow
    file (an agent's candidate) cannot choose the point its speed is taken at."""
    if not flow.calibrated or head_dim == other:
        return dict(params)
    spec = type(flow).param_specs()["channels"]
    want = min(other, max(1, round(flow.channels * other / head_dim)))
    if spec.choices:
        allowed = [c for c in spec.choices if c <= other] or [min(spec.choices)]
        got = min(allowed, key=lambda c: (abs(c - want), -c))
    else:
        got = int(max(spec.low if spec.low is not None else 1, min(want, spec.high if spec.high is not None else want)))
    return {**params, "channels": str(got)}
