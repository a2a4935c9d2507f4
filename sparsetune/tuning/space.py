"""A flow's search space: its declared `Param`s as Optuna distributions, define-by-run.

Every param with choices or a range is a dimension, searched over its `Search` (from the flow, or
inherited from the base class's declaration of the same param) or else over what it declares.
Params that are off, inapplicable to the flow, or without choices or a range (a calibration file)
are not. Layer sets are searched by their size, so a sampler can learn them: "first" layer sets
(dense layers) are the first N layers, "spread" sets (select layers) are N layers spread evenly
from the first sparse layer (N = 0: every sparse layer selects); a single layer ("index": a reuse
flow's boundary or check layer) is an integer capped at the model's last layer. A trial's values come back as
`--param` strings for `Flow.from_strings`: one path into a flow for the CLI and the search.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from sparsetune.errors import SparsetuneError
from sparsetune.flow.params import Flow, Param, Search

LAYER_SETS = ("first", "spread")  # layer sets, searched by size
LAYER_KINDS = LAYER_SETS + ("index",)  # and one layer


@dataclass(frozen=True)
class Dimension:
    """One searched param: its name (the trial param and the flow param), distribution and, for a
    layer set, how a size N becomes layers."""

    name: str
    distribution: BaseDistribution
    layers: str | None = None  # a layer set ("first", "spread"): its size N is the trial's value
    default: int | None = None  # the layer a None default stands for on this model (`Search.share`)


def search_of(cls: type[Flow], name: str, spec: Param) -> Search | None:
    """The `Search` of a param: the flow's own, else the one a base class declares for the same name."""
    if spec.search is not None:
        return spec.search
    for base in cls.__mro__[1:]:
        inherited = vars(base).get(name)
        if isinstance(inherited, Param) and inherited.search is not None:
            return inherited.search
    return None


def dimensions(cls: type[Flow], num_layers: int) -> list[Dimension]:
    """The flow's searched params, in declaration order, for a model of `num_layers` layers (none for
    full attention: nothing to tune)."""
    if getattr(cls, "full_attention", False):
        return []
    out = []
    for name, spec in cls.param_specs().items():
        if name in cls.inapplicable:
            continue
        search = search_of(cls, name, spec) or Search()
        if search.off:
            continue
        dim = _dimension(name, spec, search, num_layers)
        if dim is not None:
            out.append(dim)
    return out


def _dimension(name: str, spec: Param, search: Search, num_layers: int) -> Dimension | None:
    if search.layers is not None:
        if search.layers not in LAYER_KINDS:
            raise SparsetuneError(f"param {name}: Search(layers={search.layers!r}) must be one of {', '.join(LAYER_KINDS)}")
        low = int(search.low) if search.low is not None else int(spec.low or 0) if search.layers == "index" else 0
        high = min(int(search.high) if search.high is not None else num_layers - 1, num_layers - 1)
        dist = IntDistribution(min(low, high), high)
        if search.layers != "index":
            return Dimension(name, dist, search.layers)
        default = None if search.share is None else min(max(round(search.share * num_layers), dist.low), dist.high)
        return Dimension(name, dist, None, default)
    choices = search.choices if search.choices is not None else spec.choices
    if choices is not None:
        allowed = tuple(c for c in choices if spec.choices is None or c in spec.choices)
        return Dimension(name, CategoricalDistribution(allowed)) if len(allowed) > 1 else None
    low = search.low if search.low is not None else spec.low
    high = search.high if search.high is not None else spec.high
    if low is None or high is None or spec.type not in (int, float):
        return None  # a file, a string, an unbounded number: not a dimension
    log = spec.log if search.log is None else search.log
    if spec.type is int:
        return Dimension(name, IntDistribution(int(low), int(high), log=log))
    return Dimension(name, FloatDistribution(float(low), float(high), log=log))


def layer_set(kind: str, n: int, num_layers: int, dense: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The layers of a layer set of size `n`: the first n ("first"), or n layers spread evenly over
    the sparse ones from the first ("spread"; n = 0: the empty set, every sparse layer selects)."""
    if kind == "first":
        return tuple(range(n))
    sparse = [i for i in range(num_layers) if i not in dense]
    if n <= 0 or not sparse:
        return ()
    n = min(n, len(sparse))
    return tuple(sorted({sparse[(k * len(sparse)) // n] for k in range(n)}))


def suggest(trial: optuna.Trial, cls: type[Flow], num_layers: int, fixed: dict[str, str] | None = None) -> dict[str, str]:
    """Sample the flow's params on `trial` (define-by-run) and return them as `--param` strings;
    `fixed` params are not sampled (the user set them)."""
    fixed = dict(fixed or {})
    raw: dict[str, str] = {}
    sizes: dict[str, tuple[str, int]] = {}
    for dim in dimensions(cls, num_layers):
        if dim.name in fixed:
            continue
        d = dim.distribution
        if isinstance(d, CategoricalDistribution):
            value = trial.suggest_categorical(dim.name, d.choices)
        elif isinstance(d, IntDistribution):
            value = trial.suggest_int(dim.name, d.low, d.high, log=d.log)
        else:
            value = trial.suggest_float(dim.name, d.low, d.high, log=d.log)
        if dim.layers is not None:
            sizes[dim.name] = (dim.layers, int(value))
        else:
            raw[dim.name] = str(value)
    # The dense layers (a "first" set, or the user's) are known before the "spread" sets placed after them.
    dense = cls.param_specs()["dense_layers"].parse("dense_layers", fixed["dense_layers"]) if "dense_layers" in fixed else ()
    for name, (kind, n) in sorted(sizes.items(), key=lambda kv: kv[1][0]):  # "first" before "spread"
        layers = layer_set(kind, n, num_layers, dense)
        if kind == "first":
            dense = layers
        raw[name] = ",".join(map(str, layers))
    return {**raw, **fixed}


# ---- a flow's params across a process boundary ------------------------------------------------------

_KINDS = {t.__name__: t for t in (int, float, bool, tuple, str)}


def spec_dicts(cls: type[Flow]) -> dict[str, Any]:
    """What the search reads of a flow class (its params, each with its resolved `Search`, and
    what is inapplicable), as JSON: a proposed flow's class is built in a sandbox, and the search
    rebuilds this from it (`spec_class`) without running the flow's code."""
    params = {}
    for name, spec in cls.param_specs().items():
        search = search_of(cls, name, spec)
        params[name] = {"default": spec.default, "choices": spec.choices, "low": spec.low, "high": spec.high,
                        "log": spec.log, "kind": spec.type.__name__, "doc": spec.doc, "optional": spec.optional,
                        "search": None if search is None else asdict(search)}
    return {"name": cls.name, "params": params, "inapplicable": dict(cls.inapplicable)}


def spec_class(data: dict[str, Any]) -> type[Flow]:
    """A class with the params of `spec_dicts`'s flow and nothing else (no stages): enough to
    sample its points and check its `--param`s."""
    def tup(x: Any) -> Any:
        return tuple(x) if isinstance(x, list) else x

    attrs: dict[str, Any] = {"name": data["name"], "inapplicable": dict(data.get("inapplicable") or {})}
    for name, p in data["params"].items():
        kind = _KINDS.get(p["kind"])
        if kind is None:
            raise SparsetuneError(f"param {name}: kind {p['kind']!r} cannot cross into the search")
        default = tup(p["default"])
        s = p.get("search")
        search = None if s is None else Search(**{**s, "choices": tup(s.get("choices"))})
        attrs[name] = Param(default, tup(p["choices"]), p["low"], p["high"], p["log"], kind, p.get("doc", ""), search,
                            bool(p.get("optional", False)))
    return type(f"Spec_{data['name']}", (Flow,), attrs)
