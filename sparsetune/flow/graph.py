"""A decode flow as data: its stages traced into op graphs, and the flow rebuilt from them.

An untrusted flow file (not a shipped built-in, not opted in with `--trust-flow-code`) never runs
in the host process. A sandboxed child (`loader`) imports it, and `describe` turns it into JSON:

- the class: `name` (an identifier), the published rule, the traits the runtime reads
  (`uses_keys`, `calibrated`, `full_attention`), `inapplicable`, and every `Param` declaration as
  plain values (`kind` one of int/float/str/bool/tuple, never a class of the file; `calibration`,
  a path the host opens, only "auto": the file names no path, the user does with `--param`);
- per head dimension, both stages traced (`trace_stages`) on dummy inputs: the ops called, in
  order, each argument a reference to an input or an earlier op's output, or a number, bool,
  None or a tuple of them. The indexer is traced at several query-group sizes and block counts;
  a flow whose op sequence changes with them (Python control flow on shapes) is not traceable.

The host reads that JSON back (`flow_class`, which validates every field) into a `DecodeFlow`
subclass whose stages *interpret* the graphs (`run_graph`): each node calls a flow op of
`ops.OPS` with the recorded arguments, so the host runs only the op set, never the file's Python.
The generated kernels, the reference executor and torch.compile all see the same op calls the
file made (the graph is replayed through the same `Op` objects, so tracing it records it again).

Graphs are per (params but the runtime ones, head dimension): `DecodeFlow.kernel_key`'s values.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from sparsetune.errors import SparsetuneError
from sparsetune.flow.base import RUNTIME_PARAMS, DecodeFlow
from sparsetune.flow.ops import OPS, FT, Fields, Op, Selection, save
from sparsetune.flow.params import Param, Search
from sparsetune.flow.trace import tracing
from sparsetune.flow.shapes import dummy_inputs
from sparsetune.flow.values import check_name

SCHEMA = "sparsetune.flowgraph/1"
# Head dimensions traced when a flow is described: those of the registered models (a graph is per
# head dimension: a stage may use it, e.g. a 1/sqrt(D) scale); another is traced when first needed.
HEAD_DIMS = (64, 128)
# A bundle serves a model chosen later: it holds the head dimensions of the common architectures.
BUNDLE_HEAD_DIMS = (32, 48, 64, 80, 96, 112, 128, 160, 192, 256)
# (query group, blocks) the indexer is traced at; equal graphs at each mean the graph holds for all.
_INDEX_SHAPES = ((2, 5), (3, 7), (1, 4))
_KINDS = {"int": int, "float": float, "str": str, "bool": bool, "tuple": tuple}
_TRAITS = ("uses_keys", "calibrated", "full_attention", "page_stages")
STAGES = ("cache", "index", "cache_page", "index_page")  # a graph pair per level; the page pair where defined
MAX_NODES = 4096


class NotTraceable(SparsetuneError):
    """The flow's stages cannot be captured as a graph (or a stored graph is malformed)."""


# ---- values <-> JSON ----------------------------------------------------------------------------------


def _enc(v: Any, ref: Callable[[FT], Any]) -> Any:
    if isinstance(v, FT):
        return {"ref": ref(v)}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, (tuple, list)):
        return {"tuple": [_enc(x, ref) for x in v]}
    raise NotTraceable(f"a stage passed a {type(v).__name__} to a flow op; ops take flow tensors, numbers and tuples")


def _dec(v: Any, ref: Callable[[Any], Any]) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dict) and len(v) == 1:
        (k, x), = v.items()
        if k == "ref":
            return ref(x)
        if k == "float" and x in ("inf", "-inf", "nan"):
            return float(x)
        if k == "tuple" and isinstance(x, list):
            return tuple(_dec(e, ref) for e in x)
    raise NotTraceable(f"a graph value {str(v)[:60]!r} is not a number, tuple or reference")


def _no_ref(_: Any) -> Any:
    raise NotTraceable("a declaration or param value holds a flow tensor or a reference")


def _plain(v: Any) -> Any:
    """A declaration's or param's value (default, choices, bounds) as JSON, checked to be plain."""
    return _enc(v, _no_ref)


def _unplain(v: Any) -> Any:
    """`_plain`'s inverse."""
    return _dec(v, _no_ref)


# ---- tracing (in the child that may run the file) ------------------------------------------------------


def _graph(nodes, inputs: dict[int, str], outputs: Callable[[Callable[[FT], Any]], dict]) -> dict[str, Any]:
    """The recorded op calls as JSON nodes; `inputs` names the stage's input tensors by id."""
    ids: dict[int, Any] = dict(inputs)

    def ref(t: FT) -> Any:
        if id(t) not in ids:
            raise NotTraceable("a stage used a flow tensor made outside the op set")
        return ids[id(t)]

    out = []
    for i, node in enumerate(nodes):
        out.append({"op": node.op.name, "args": [_enc(a, ref) for a in node.args],
                    "kwargs": {k: _enc(v, ref) for k, v in node.kwargs.items()}})
        ids[id(node.out)] = i
    if len(out) > MAX_NODES:
        raise NotTraceable(f"a stage calls {len(out)} ops (at most {MAX_NODES})")
    return {"nodes": out, **outputs(ref)}


def trace_stages(flow: DecodeFlow, head_dim: int) -> dict[str, Any]:
    """The stages of `flow` at `head_dim` as graphs: {"cache": ..., "index": ...}, and with page stages
    (`DecodeFlow.page_stages`) "cache_page" and "index_page", traced at the same params where the
    unit is the whole block: the params of a two-level flow's first level (`page_flow`), the only
    ones its page stages run at (they may assume a whole page)."""
    out = _trace_pair(flow, head_dim)
    if flow.page_stages and not flow.level and flow.unit == flow.block_size:
        page = type(flow).page_level()(**_own_params(flow))
        out.update({f"{s}_page": g for s, g in _trace_pair(page, head_dim).items()})
    return out


def _own_params(flow: DecodeFlow) -> dict[str, Any]:
    return {k: v for k, v in flow.params().items() if k not in flow.inapplicable}


def _trace_pair(flow: DecodeFlow, head_dim: int) -> dict[str, Any]:
    x = dummy_inputs(flow, head_dim)
    names = {id(x.k): "k", id(x.v): "v", **{id(t): f"c:{n}" for n, t in x.const.items()}}
    with tracing() as t:
        fields = flow.run_cache(x.k, x.v, x.const)
    if not isinstance(fields, dict) or not all(isinstance(n, str) and isinstance(v, FT) for n, v in fields.items()):
        raise NotTraceable("cache() must return a dict of flow tensors")
    for n in fields:
        check_name(n, "field name")
    cache = _graph(t.nodes, names, lambda ref: {"out": {n: ref(v) for n, v in fields.items()}})
    dims = {n: tuple(v.shape[1:]) for n, v in fields.items()}
    cache["dims"] = {n: list(d) for n, d in dims.items()}
    index = None
    for group, nb in _INDEX_SHAPES:
        q, f = x.index(dims, group, nb)
        names = {id(q): "q", **{id(dict.__getitem__(f, n)): f"f:{n}" for n in f},
                 **{id(c): f"c:{n}" for n, c in x.const.items()}}
        with tracing() as t:
            sel = flow.run_index(q, f, x.const)
        if not isinstance(sel, Selection):
            raise NotTraceable("index() must end in `return F.topk(score)` (or F.keep_only_forced())")
        g = _graph(t.nodes, names, lambda ref: {
            "score": None if sel.score is None else ref(sel.score),
            "saved": {n: ref(v) for n, v in f.saved.items()}, "read": sorted(f.read)})
        if index is not None and g != index:
            raise NotTraceable("its indexer calls different ops for different query groups or block counts "
                               "(Python control flow on shapes)")
        index = g
    return {"cache": cache, "index": index}


def describe(cls: type[DecodeFlow], params: dict[str, Any], head_dims: tuple[int, ...] = HEAD_DIMS,
             block_sizes: bool = True) -> dict[str, Any]:
    """The class's declarations and its stages traced at `params` for each head dimension, and with
    `block_sizes` at each declared block size beside (the dimension a search varies most: one child
    run covers it; a bundle holds its own params' graphs only)."""
    decl: dict[str, Any] = {}
    for n, p in cls.param_specs().items():
        check_name(n, "param name")
        kind = next((k for k, t in _KINDS.items() if p.kind is t), None) if p.kind is not None else None
        if p.kind is not None and kind is None:
            raise NotTraceable(f"param {n!r}: kind must be one of {', '.join(_KINDS)}")
        decl[n] = {"default": _plain(p.default), "choices": _plain(p.choices), "low": _plain(p.low),
                   "high": _plain(p.high), "log": bool(p.log), "kind": kind, "doc": str(p.doc),
                   "optional": bool(p.optional),
                   "search": None if p.search is None else {k: _plain(getattr(p.search, k))
                                                           for k in Search.__dataclass_fields__}}
    flow = cls.from_strings(params)
    graphs: dict[str, Any] = {}
    if isinstance(flow, GraphFlow):  # a traced flow described again (a bundle of it): one child for every dim
        flow.prefetch(head_dims)
    if not cls.full_attention:
        sizes = (cls.param_specs()["block_size"].choices or ()) if block_sizes else ()
        own = _own_params(flow)
        unit = own.get("select_block")  # kept where it fits inside the block (else the block is the unit)
        others = [cls.from_strings({**own, "block_size": b, "coarse": None,
                                    **({"select_block": unit if b % unit == 0 else None} if unit else {})})
                  for b in sizes if b != flow.block_size]
        # A two-level flow's first level: the class at its params (the page stages traced with them).
        first = [type(flow)(**_own_params(f)) for f in [flow.page_flow()] if f is not None]
        for f in [flow] + first + others:
            graphs[graph_key(f)] = {str(d): trace_stages(f, d) for d in head_dims}
    return {
        "schema": SCHEMA, "name": check_name(cls.name), "source": str(cls.source),
        "traits": {k: bool(getattr(cls, k)) for k in _TRAITS},
        "inapplicable": {str(k): str(v) for k, v in cls.inapplicable.items()},
        "params": decl, "key": graph_key(flow), "graphs": graphs,
    }


def graph_key(flow: DecodeFlow) -> str:
    """The params the stages' graphs depend on (all but the runtime ones), as one string."""
    vals = {k: v for k, v in flow.params().items() if k not in RUNTIME_PARAMS}
    return json.dumps({k: _plain(v) for k, v in sorted(vals.items())}, sort_keys=True)


# ---- the host: a flow class over graphs -----------------------------------------------------------------


def run_graph(g: dict[str, Any], inputs: dict[str, FT], fields: Fields | None = None) -> Callable[[Any], FT]:
    """Replay a stage's graph on real inputs (names as `trace_stages` wrote them): each node one
    call of a flow op from `ops.OPS`. Returns the lookup of a value by its reference."""
    vals: dict[Any, FT] = {}

    def ref(x: Any) -> FT:
        if isinstance(x, int) and not isinstance(x, bool) and x in vals:
            return vals[x]
        if isinstance(x, str):
            kind, _, name = x.partition(":")
            if kind == "f" and fields is not None and name in fields:
                return fields[name]
            if x in inputs:
                return inputs[x]
        raise NotTraceable(f"the graph refers to {str(x)[:40]!r}, which it has not computed")

    for i, node in enumerate(g["nodes"]):
        op = OPS.get(node.get("op")) if isinstance(node, dict) else None
        if not isinstance(op, Op):
            raise NotTraceable(f"graph node {i}: {str(node)[:60]!r} is not a flow op")
        args = [_dec(a, ref) for a in node.get("args", [])]
        kwargs = {str(k): _dec(v, ref) for k, v in node.get("kwargs", {}).items()}
        vals[i] = op(*args, **kwargs)
    return ref


class GraphFlow(DecodeFlow):
    """A decode flow whose stages replay traced graphs (`flow_class` makes one per description).
    `graphs`: key (`graph_key`) → head dim → the two stage graphs; `fetch(params, head_dim)` traces
    a missing pair (the registry's sandboxed child) and returns graphs by key and head dim, or is
    None (a bundle: only the graphs it holds)."""

    graphs: dict[str, dict[str, dict[str, Any]]] = {}
    fetch: Callable[[dict[str, Any], tuple[int, ...]], dict[str, dict[str, Any]]] | None = None
    origin: str = ""

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        self._stage_graphs: dict[tuple[int, str], dict[str, Any]] = {}

    @classmethod
    def uses_stage_graphs(cls) -> bool:
        return True

    def _stage(self, head_dim: int, stage: str) -> dict[str, Any]:
        """A stage's graph (of this level: the first level of a two-level flow replays the page
        stages), found once per instance: the runtime calls the stages inside torch.compile, where
        the lookup (JSON of the params) would break the compiled graph."""
        g = self._stage_graphs.get((head_dim, stage))
        if g is None:
            g = self._stage_graphs[(head_dim, stage)] = self._find(head_dim, stage + self.level)
        return g

    def _find(self, head_dim: int, stage: str) -> dict[str, Any]:
        key = graph_key(self)
        cls = type(self)
        if str(head_dim) not in cls.graphs.get(key, {}):
            self.prefetch((head_dim,))
        by_dim = cls.graphs.get(key, {})
        if str(head_dim) not in by_dim or stage not in by_dim[str(head_dim)]:
            raise SparsetuneError(f"flow {self.name!r} ({cls.origin}) has no traced {stage} graph for head dimension "
                                  f"{head_dim} at these params; traced: {', '.join(by_dim) or 'none'}")
        return by_dim[str(head_dim)][stage]

    def prefetch(self, head_dims: tuple[int, ...]) -> None:
        """Trace these params at the head dimensions not held yet, in one fetch (if the class has one)."""
        cls, key = type(self), graph_key(self)
        missing = tuple(d for d in head_dims if str(d) not in cls.graphs.get(key, {}))
        if missing and cls.fetch is not None:
            for k, v in cls.fetch(self.params(), missing).items():
                cls.graphs.setdefault(k, {}).update(_checked_keyed(v))

    def run_cache(self, k: FT, v: FT, const: dict[str, FT]) -> dict[str, FT]:
        g = self._stage(k.data.shape[-1], "cache")
        ref = run_graph(g, {"k": k, "v": v, **{f"c:{n}": t for n, t in const.items()}})
        return {n: ref(r) for n, r in g["out"].items()}

    def run_index(self, q: FT, fields: Fields, const: dict[str, FT]) -> Selection:
        g = self._stage(q.data.shape[-1], "index")
        for n in g["read"]:
            if n in fields:
                fields[n]  # noqa: B018 - marks the field read, as the traced stage did
        ref = run_graph(g, {"q": q, **{f"c:{n}": t for n, t in const.items()}}, fields)
        for n, r in g["saved"].items():
            save(fields, n, ref(r))
        return Selection(None if g["score"] is None else ref(g["score"]))


def flow_class(desc: dict[str, Any], fetch: Callable | None = None, origin: str = "") -> type[GraphFlow]:
    """The `GraphFlow` subclass of a description (`describe`'s JSON), every field validated."""
    try:
        if desc.get("schema") != SCHEMA:
            raise NotTraceable(f"schema {str(desc.get('schema'))[:40]!r}, expected {SCHEMA!r}")
        attrs: dict[str, Any] = {"name": check_name(desc["name"]), "source": str(desc.get("source", ""))[:500],
                                 "origin": origin, "fetch": fetch}
        traits = desc.get("traits", {})
        attrs.update({k: bool(traits.get(k, False)) for k in _TRAITS})
        attrs["inapplicable"] = {check_name(k, "param name"): str(v)[:300] for k, v in desc.get("inapplicable", {}).items()}
        for n, p in desc["params"].items():
            check_name(n, "param name")
            if hasattr(GraphFlow, n) and not isinstance(getattr(GraphFlow, n), Param):  # level, page_stages, graphs, ...
                raise NotTraceable(f"param {n!r} would replace the runtime's attribute of that name; rename it")
            kind = p.get("kind")
            if kind is not None and kind not in _KINDS:
                raise NotTraceable(f"param {n!r}: kind {str(kind)[:20]!r}")
            search = p.get("search")
            attrs[n] = Param(_unplain(p.get("default")), choices=_unplain(p.get("choices")), low=_unplain(p.get("low")),
                             high=_unplain(p.get("high")), log=bool(p.get("log")), kind=_KINDS.get(kind) if kind else None,
                             doc=str(p.get("doc", ""))[:500], optional=bool(p.get("optional", False)),
                             search=None if search is None else Search(**{k: _unplain(search.get(k)) for k in
                                                                         Search.__dataclass_fields__ if k in search}))
        cal = attrs.get("calibration")
        if isinstance(cal, Param) and (cal.default != "auto" or cal.choices is not None):
            raise SparsetuneError("param 'calibration' of a flow file must be 'auto' with no choices: a path it names "
                                  "is one the host would open; pass your own with --param calibration=FILE")
        for k in ("low", "high"):
            for n, p in attrs.items():
                if isinstance(p, Param) and getattr(p, k) is not None and not isinstance(getattr(p, k), (int, float)):
                    raise NotTraceable(f"param {n!r}: {k} is not a number")
        graphs = {str(k): _checked_keyed(v) for k, v in desc.get("graphs", {}).items()}
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise NotTraceable(f"malformed flow description ({type(e).__name__}: {str(e)[:80]})") from None
    attrs["graphs"] = graphs
    return type(f"{attrs['name']}_graph", (GraphFlow,), attrs)


def _checked_keyed(by_dim: dict[str, Any]) -> dict[str, Any]:
    return {str(int(d)): _checked_graphs(g) for d, g in by_dim.items()}


def _checked_graphs(g: dict[str, Any]) -> dict[str, Any]:
    """A stage pair's JSON, shape-checked (every op name in the op set; values decode)."""
    if set(g) - set(STAGES) or not {"cache", "index"} <= set(g) or ("cache_page" in g) != ("index_page" in g):
        raise NotTraceable(f"a graph entry holds stages {sorted(map(str, g))[:6]}; expected cache and index "
                           "(and cache_page, index_page)")
    for stage in g:
        nodes = g[stage]["nodes"]
        if not isinstance(nodes, list) or len(nodes) > MAX_NODES:
            raise NotTraceable(f"{stage} graph: nodes must be a list of at most {MAX_NODES}")
        for node in nodes:
            if not isinstance(OPS.get(node["op"]), Op):
                raise NotTraceable(f"{stage} graph: {str(node['op'])[:40]!r} is not a flow op")
    for level in ("", "_page"):
        if f"cache{level}" not in g:
            continue
        for n in g[f"cache{level}"]["out"]:
            check_name(n, "field name")
        for n in list(g[f"index{level}"]["saved"]) + list(g[f"index{level}"]["read"]):
            check_name(n, "field name")
    return g
