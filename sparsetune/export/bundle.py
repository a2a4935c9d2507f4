"""A bundle: one tuned decode flow, or a reuse flow with the decode flow it runs with, packed for
serving (issues #16, #44).

    DIR/
      <flow>.py          the flow's source, byte for byte (its sha256 is in the manifest): to read
      calibration.json   a calibrated flow's channel order (`models.artifacts`), the model's file the
                         export resolved (its sha256 is in the manifest; the flow's `calibration`
                         param names it); checked against the served model's shapes at launch
      flow.graph.json    the flow as data (`flow.graph.describe`: its params' declarations and both
                         stages traced into op graphs at the bundle's params): what serves it (its
                         sha256 is in the manifest, and checked when SGLang loads the bundle)
      bundle.json        the manifest: the flow, its resolved parameters, the model and what was
                         measured where (the search's figures with their confidence interval)
      sglang.json        how SGLang serves it: the attention backend, page size = block size, the
                         environment, the SGLang versions the backend supports, whether SGLang has
                         a native flag for the flow (no sparse flow has one on 0.5.16 or 0.5.23)
      launch_sglang.sh   `launch_sglang.sh MODEL_PATH [launch_server args]`: checks the bundle and
                         SGLang, then `python -m sglang.launch_server` with the backend
      <reuse>.py         a reuse bundle's reuse flow, byte for byte (schema `REUSE_SCHEMA`; the manifest's
                         "reuse": its name, file, sha256, resolved params, whether it is a built-in as
                         shipped). Its decode flow is the files above: the one given, else the reuse flow's
                         own (LoopServe's), else `dense`. A reuse flow is Python over the engine (no graph):
                         a built-in is recognised by its hash; any other file loads only with the trust
                         opt-in (`loader`), in checking and in serving alike.

A bundle is made from a search's run folder (a confirmed point, by `--trial` or a `--pick` rule; a
decode or a reuse search) or from a flow and `--param`s alone (`--reuse` and `--reuse-param` for a
reuse bundle); `check_bundle` re-reads one and names every problem (a
changed source or graph, parameters the flow does not declare or accept, or that change what the
graphs compute). What serves a bundle (the SGLang backend) reads it through `read_bundle`, so a
bundle that does not check does not load, and builds the flow from the graph (`flow_of`): no
Python of the bundle runs, trusted or not. The file names a bundle writes are fixed or the flow's
`name`, an identifier (`flow.values.check_name`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparsetune.errors import SparsetuneError
from sparsetune.records import file_sha256, package_version, write_json
from sparsetune.tuning.frontier import default_pick, pick_point

SCHEMA = "sparsetune.bundle/1"
REUSE_SCHEMA = "sparsetune.reuse-bundle/1"  # its own schema: a sparsetune that serves decode bundles only refuses it
MANIFEST = "bundle.json"
SGLANG_CONFIG = "sglang.json"
LAUNCH = "launch_sglang.sh"
GRAPH = "flow.graph.json"
CALIBRATION = "calibration.json"
# Serving in SGLang (`export/sglang/`): the backend's name, the variable that gives it the bundle,
# and the SGLang versions it is contract-tested on (ranges, oldest to newest): 0.5.13 (the first with
# the out-of-graph / in-graph metadata hooks and the pools on the backend) to 0.5.16, and 0.5.23 (the
# current release; its backend interface, pools and plugin loader are 0.5.16's). 0.5.17-0.5.22 are
# untested, so refused.
BACKEND = "sparsetune"
BUNDLE_ENV = "SPARSETUNE_BUNDLE"
SUPPORTED = (((0, 5, 13), (0, 5, 16)), ((0, 5, 23), (0, 5, 23)))


def _flow_source(run_dir: Path, flow: str) -> Path:
    """A built-in flow's file, or a proposed flow's from the run's candidates."""
    from sparsetune.loader import builtin_flows

    builtin = builtin_flows()
    if flow in builtin:
        return builtin[flow]
    for path in sorted((run_dir / "candidates").glob(f"*/{flow}.py")):
        return path
    raise SparsetuneError(f"flow {flow!r} of {run_dir} is neither built in nor among its candidates/")


def point_of_run(run_dir: Path, trial: str | None = None, pick: str | None = None) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """(flow file, the chosen confirmed point's row, the search's summary) of a run folder; by
    default the fastest confirmed point that holds the search's accuracy bar."""
    summary_path = run_dir / "frontier.json"
    if not summary_path.is_file():
        raise SparsetuneError(f"{run_dir} has no frontier.json: pass a search's run folder (runs/<study>), "
                              "or --flow with --param for a bundle without a search")
    summary = json.loads(summary_path.read_text())
    if summary.get("kind") not in ("decode", "reuse"):
        raise SparsetuneError(f"{run_dir} holds a search of kind {summary.get('kind')!r}; export takes a decode or a reuse "
                              "search's run folder")
    held = summary.get("confirmed_frontier") or []
    if trial is not None:
        rows = held + summary.get("not_confirmed", []) + summary.get("defaults", [])
        row = next((r for r in rows if r["trial"] == trial), None)
        if row is None:
            raise SparsetuneError(f"--trial {trial!r}: not on the confirmed frontier of {run_dir}, nor a default or a "
                                  f"point that failed confirmation there (a confirmed point another one beats is not "
                                  f"kept; confirmed frontier: {', '.join(r['trial'] for r in held) or 'none'})")
        if not row.get("holds"):
            raise SparsetuneError(f"--trial {trial}: it did not hold on fresh prompts "
                                  f"({row.get('confirmed_accuracy')} of dense); pick a point of the confirmed frontier")
    else:
        row = pick_point(held, pick or default_pick(summary.get("min_accuracy")))
    return _flow_source(run_dir, row["flow"]), row, summary


# ---- writing, reading, checking -------------------------------------------------------------------

def _resolve(flow_file: Path, raw: dict[str, str], trust: bool | None = None, *, reuse: bool = False) -> tuple[type, dict[str, str]]:
    """The flow class (a decode flow, or with `reuse` a reuse flow) and every declared parameter that
    has a value, as text (the given ones validated)."""
    from sparsetune.flow.base import DecodeFlow
    from sparsetune.loader import load_file
    from sparsetune.reuse.base import ReuseFlow

    cls = load_file(flow_file, trust=trust)
    want, other = (ReuseFlow, "--reuse takes a reuse flow") if reuse else (DecodeFlow, "--flow takes a decode flow")
    if not issubclass(cls, want):
        raise SparsetuneError(f"{flow_file} is not a {'reuse' if reuse else 'decode'} flow: {other}"
                              + ("" if reuse else " (export a reuse flow with --reuse)"))
    flow = cls.from_strings(raw)
    return cls, as_text(flow)


def as_text(flow) -> dict[str, str]:
    """A flow's typed param values as the manifest keeps them (tuples comma-joined; None left out,
    except "off" where the default is on: an optional param turned off, e.g. a two-level flow's coarse)."""
    specs, out = flow.param_specs(), {}
    for k, v in flow.params().items():
        if v is None:
            if specs[k].default is not None:
                out[k] = "off"
            continue
        out[k] = ",".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
    return out


# The files a bundle writes besides its flow's source (what `--force` replaces; nothing else is touched).
_WRITES = (MANIFEST, SGLANG_CONFIG, LAUNCH, GRAPH, CALIBRATION)


def write_bundle(out: Path, flow_file: Path | None, params: dict[str, str], *, reuse: tuple[Path, dict[str, str]] | None = None,
                 model: str | None = None, measured: dict[str, Any] | None = None, origin: dict[str, Any] | None = None,
                 overwrite: bool = False, trust: bool | None = None) -> dict[str, Any]:
    """Write a bundle to `out` (a new folder, or an existing bundle with `overwrite`: only the files a
    bundle writes are replaced); returns the manifest. `reuse`: a reuse flow's file and params (a
    reuse bundle; `flow_file` None: the reuse flow's own decode flow, else dense). `trust`: as
    `loader.load_file`."""
    from sparsetune.flow.graph import BUNDLE_HEAD_DIMS, describe
    from sparsetune.loader import flow_path
    from sparsetune.setup import reuse_decode

    rcls = rresolved = None
    decode_given, given = flow_file is not None, dict(params)
    if reuse is not None:
        rcls, rresolved = _resolve(reuse[0], reuse[1], trust, reuse=True)
        own = None if decode_given else reuse_decode(rcls.from_strings(rresolved), None, params)
        if own is not None:
            flow_file, params = flow_path(own[0]), {k: str(v) for k, v in own[1].items()}
        elif not decode_given:
            if params:
                raise SparsetuneError(f"--param needs --flow: reuse flow {rcls.name!r} brings no decode flow of its own")
            flow_file = flow_path("dense")
    elif flow_file is None:
        raise SparsetuneError("a bundle needs a decode flow (--flow) or a reuse flow (--reuse)")
    cls, resolved = _resolve(flow_file, params, trust)
    if rcls is not None and rcls.name == cls.name:
        raise SparsetuneError(f"the reuse flow and the decode flow are both named {cls.name!r}: a bundle keeps each as "
                              "NAME.py; rename one")
    is_bundle = (out / MANIFEST).is_file()
    if out.exists() and not (overwrite and is_bundle):
        raise SparsetuneError(f"{out} exists; pick a new --out folder" + (" (or --force to replace that bundle)" if is_bundle else ""))
    calibration = _calibration(cls, resolved, model)
    cal_bytes = None if calibration is None else calibration[0].read_bytes()  # before --force clears the folder
    if calibration is not None:  # the bundle's own copy serves it
        resolved, params = {**resolved, "calibration": CALIBRATION}, {**params, "calibration": CALIBRATION}
    source_bytes = flow_file.read_bytes()
    reuse_bytes = None if reuse is None else reuse[0].read_bytes()
    flow = cls.from_strings(resolved)
    graph = json.dumps(describe(cls, flow.params(), BUNDLE_HEAD_DIMS, block_sizes=False), sort_keys=True)
    setup = None
    if model is not None:
        setup = _setup(model, flow_file if decode_given else None, params if decode_given else given,
                       reuse)
    try:
        if out.exists():
            for name in _WRITES + _old_sources(out):
                (out / name).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        source = out / f"{cls.name}.py"
        source.write_bytes(source_bytes)
        (out / GRAPH).write_text(graph)
        if cal_bytes is not None:
            (out / CALIBRATION).write_bytes(cal_bytes)
        reuse_entry = None
        if reuse_bytes is not None:
            from sparsetune.loader import builtin_hashes

            rsource = out / f"{rcls.name}.py"
            rsource.write_bytes(reuse_bytes)
            digest = file_sha256(rsource)
            reuse_entry = {"flow": rcls.name, "source": rsource.name, "source_sha256": digest, "params": rresolved,
                           "builtin": builtin_hashes().get(digest) == rsource.name}
        manifest = {
            "schema": SCHEMA if reuse_entry is None else REUSE_SCHEMA,
            "flow": cls.name,
            "source": source.name,
            "source_sha256": file_sha256(source),
            "graph": GRAPH,
            "graph_sha256": file_sha256(out / GRAPH),
            **({} if calibration is None else {"calibration_sha256": file_sha256(out / CALIBRATION),
                                               "calibration_shape": list(calibration[1])}),
            "params": resolved,
            "block_size": int(resolved["block_size"]),
            **({} if reuse_entry is None else {"reuse": reuse_entry}),
            "model": model,
            "field_memory_share": None if model is None else _field_share(flow, model),
            "origin": origin or {"from": "params"},
            "measured": measured,
            "measured_params": (rresolved if reuse_entry else resolved) if measured else None,
            "setup": None if setup is None else setup.to_dict(),
            "sparsetune": package_version("sparsetune"),
        }
        served = sglang_config(manifest)
        write_json(out / MANIFEST, manifest)
        write_json(out / SGLANG_CONFIG, served)
        (out / LAUNCH).write_text(launch_script(manifest, served["server_args"]))
        (out / LAUNCH).chmod(0o755)
    except OSError as e:
        raise SparsetuneError(f"cannot write the bundle to {out}: {e.strerror}; pick a writable --out folder") from None
    return manifest


def _calibration(cls, resolved: dict[str, str], model: str | None) -> tuple[Path, tuple[int, int, int]] | None:
    """A calibrated flow's calibration file (its `calibration` param: a file, or "auto", the model's)
    and its (layers, KV heads, head_dim), checked against the model's where the model is known; None
    for other flows."""
    if not cls.calibrated:
        return None
    from sparsetune.models.artifacts import calibration_path, calibration_shape
    from sparsetune.models.resolve import model_config, model_name

    model = None if model is None else model_name(model)  # the name `flows calibrate` files it under
    path = calibration_path(resolved.get("calibration", "auto"), cls.name, model)
    shape = calibration_shape(path)
    if model is not None:
        cfg = model_config(model)[1]
        want = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        if shape != want:
            raise SparsetuneError(f"calibration file {path} is for {shape[0]} layers x {shape[1]} KV heads x head_dim "
                                  f"{shape[2]}, {model} has {want[0]} x {want[1]} x {want[2]}: calibrate this model "
                                  f"(`sparsetune flows calibrate --model {model}`) or pass its file")
    return path, shape


def _field_share(flow, model: str) -> float | None:
    """The decode flow's fields per token over the K/V per token on `model` (`perf.cost.field_memory_share`):
    what it adds beside SGLang's KV pool."""
    from sparsetune.models.resolve import model_config
    from sparsetune.perf.cost import field_memory_share

    return 0.0 if flow.full_attention else round(field_memory_share(model_config(model, True)[1], flow), 4)


def _setup(model: str, flow_file: Path | None, params: dict[str, str], reuse: tuple[Path, dict[str, str]] | None = None):
    """The bundle's setup: its flows with the params as given, on its model (`setup.resolve`, the
    params as they are: a search's point, or a flow's already over the model's tuned defaults).
    `flow_file` None with `reuse`: the decode flow the reuse flow brings, as `resolve` derives it."""
    from sparsetune.engine.config import EngineConfig
    from sparsetune.setup import resolve

    return resolve(EngineConfig(model=model), flow=None if flow_file is None else str(flow_file),
                   params=params, defaults="published",
                   reuse=None if reuse is None else str(reuse[0]), reuse_params=None if reuse is None else reuse[1])


def _old_sources(out: Path) -> tuple[str, ...]:
    """The flow files an existing bundle's manifest names (decode and reuse), those that are plain file names."""
    try:
        m = json.loads((out / MANIFEST).read_text())
        names = [m.get("source"), (m.get("reuse") or {}).get("source")]
    except (OSError, ValueError, AttributeError):
        return ()
    return tuple(n for n in names if isinstance(n, str) and Path(n).name == n and n.endswith(".py"))


def flow_of(path: Path, manifest: dict[str, Any]):
    """The decode flow a checked bundle serves, built from its graph (no Python of the bundle runs)."""
    from sparsetune.flow.graph import flow_class

    desc = json.loads((path / manifest["graph"]).read_text())
    return flow_class(desc, origin=f"bundle {path}").from_strings(manifest["params"])


def serving_problem(manifest: dict[str, Any]) -> str | None:
    """Why SGLang cannot serve a checked bundle with this sparsetune, whatever SGLang's version (None: it can):
    a reuse flow SGLang's model forward cannot run (`reuse_flow_problem`)."""
    r = manifest.get("reuse")
    if r is None:
        return None
    from sparsetune.loader import builtin_flows
    from sparsetune.reuse.base import ReuseFlow
    from sparsetune.setup import lookup_flow_class

    # a built-in's rule by its name (a file of the user's: the backend checks it when it loads it, with the opt-in)
    cls = lookup_flow_class(r["flow"], ReuseFlow) if r.get("builtin") and r["flow"] in builtin_flows() else None
    return (cls is not None and reuse_flow_problem(cls)) or None


def reuse_flow_problem(cls) -> str | None:
    """What keeps SGLang's model forward from running a reuse flow class (None: nothing): its MLP runs every row."""
    from sparsetune.reuse.base import ReuseFlow

    if cls.mlp_rows is not ReuseFlow.mlp_rows:
        return (f"reuse flow {cls.name!r} narrows the MLP per row (mlp_rows), which SGLang's model forward cannot: "
                "serve it on sparsetune's engine")
    return None


def reuse_flow_of(path: Path, manifest: dict[str, Any]):
    """The reuse flow a checked reuse bundle serves, with its params (None: a decode bundle). Its file
    is Python: a built-in as shipped loads; another only with the trust opt-in (`loader.load_file`)."""
    r = manifest.get("reuse")
    if r is None:
        return None
    from sparsetune.loader import load_file

    return load_file(path / r["source"]).from_strings(r["params"])


def sglang_config(manifest: dict[str, Any]) -> dict[str, Any]:
    """`sglang.json`: what serving the bundle in SGLang takes (`launch_sglang.sh` is its command line)."""
    reuse = manifest.get("reuse")
    dense = manifest["flow"] == "dense" and reuse is None  # a reuse flow needs the backend even with dense decode
    return {
        "sglang": supported_specs(),
        "plugin": "sparsetune (entry point sglang.srt.plugins; pip install sparsetune in SGLang's environment)",
        "server_args": {"attention_backend": "triton" if dense else BACKEND, "page_size": manifest["block_size"],
                        # a reuse request's prefill narrows its rows per layer (no prefill CUDA graph) and runs
                        # whole in one extend (no chunked prefill), as the engine runs it
                        **({} if reuse is None else {"cuda_graph_backend_prefill": "disabled", "chunked_prefill_size": -1})},
        "env": {} if dense else {BUNDLE_ENV: "this bundle's folder (launch_sglang.sh sets it)"},
        "native": ("dense attention is SGLang's own backend: no plugin needed" if dense else
                   f"SGLang {supported_versions()} has no launch flag for "
                   f"{manifest['flow'] if reuse is None else reuse['flow']!r}: the {BACKEND} attention backend (plugin) runs it"),
        "cuda_graph": "on: the backend captures the flow's decode with the dense backend's graph hooks",
        "memory": memory_note(manifest.get("field_memory_share")),
        **({} if reuse is None else {"reuse": {
            "flow": reuse["flow"],
            "client": "custom_params.sparsetune_parts: the prompt's parts as the engine takes them, as a JSON string "
                      "(README, 'Reuse flows in SGLang')",
            "served": serving_problem(manifest) or "yes"}}),
    }


def memory_note(share: float | None) -> str:
    """What the flow's fields take beside SGLang's KV pool, and how much lower --mem-fraction-static goes."""
    rule = ("SGLang sizes its pool from --mem-fraction-static F (weights and KV), so take F' with (F' - w) x (1 + s) "
            "<= F - w, w the weights' share of the GPU's memory")
    if share == 0:
        return "the flow keeps no fields: SGLang's own --mem-fraction-static applies"
    if share is None:
        return ("the flow's per-page fields are allocated beside SGLang's KV pool, s times its bytes (export with --model "
                f"to have s computed for the served model): {rule}")
    example = 0.116 + (0.80 - 0.116) / (1 + share)  # Qwen3-8B bf16 on a 141 GB GPU at SGLang's usual 0.80
    return (f"the flow's fields take s = {share:.0%} of the KV pool's bytes again, beside it: {rule} (e.g. an 8B model "
            f"on a 141 GB GPU, F 0.80: F' {example:.2f})")


def launch_script(manifest: dict[str, Any], args: dict[str, Any]) -> str:
    """`launch_sglang.sh` of a bundle, launching SGLang with `sglang.json`'s server args."""
    reuse = manifest.get("reuse")
    what = f"flow ({manifest['flow']})" if reuse is None else f"reuse flow ({reuse['flow']}, decode: {manifest['flow']})"
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in args.items())
    return f"""#!/usr/bin/env bash
# Serve a model with this bundle's {what} inside SGLang. Written by `sparsetune export`.
#   ./launch_sglang.sh MODEL_PATH [more python -m sglang.launch_server arguments]
# MODEL_PATH: a Hugging Face-format model folder (or hub id) that SGLang loads
# (`sparsetune models path NAME` prints one for a model sparsetune knows).
# PYTHON: the interpreter of SGLang's environment, with sparsetune installed there (default python3).
set -euo pipefail
py="${{PYTHON:-python3}}"
here="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
model="${{1:-}}"
if [ -z "$model" ]; then echo "usage: $0 MODEL_PATH [sglang.launch_server args]" >&2; exit 2; fi
shift
if ! "$py" -c "import sparsetune.cli.main" 2>/dev/null; then
  echo "sparsetune is not installed beside SGLang in $py's environment (SGLang loads this bundle's backend from it): pip install sparsetune there, or set PYTHON to SGLang's interpreter" >&2
  exit 2
fi
"$py" -m sparsetune.cli.main export --check "$here" --require-sglang --model "$model"
export {BUNDLE_ENV}="$here"
exec "$py" -m sglang.launch_server --model-path "$model" {flags} "$@"
"""


def export_run(run_dir: Path, out: Path, *, trial: str | None = None, pick: str | None = None,
               overwrite: bool = False) -> dict[str, Any]:
    """A bundle of a search's confirmed point (a decode flow, or a reuse flow with the decode flow it
    brings), with the figures the search measured for it."""
    flow_file, row, summary = point_of_run(run_dir, trial, pick)
    config = json.loads((run_dir / "search.json").read_text())["search"] if (run_dir / "search.json").is_file() else {}
    reuse = summary.get("kind") == "reuse"
    on = ", ".join(config.get("tasks") or ()) if reuse else "RULER-style suite"
    measured = {
        "accuracy": {"on": f"{summary['model']}, {on or 'the reuse workloads'} at {summary['context']} tokens",
                     "search": row["relative_accuracy"], "confirmed": row["confirmed_accuracy"],
                     "interval_95": row.get("interval"), "relative_to": "dense on the same prompts" if not reuse else
                     "full recompute (dense) on the same prompts",
                     "dense_accuracy": (summary.get("dense") or {}).get("accuracy")},
        "speedup": row["speedup"], "speedup_of": "time to first token" if reuse else "decode step",
        "speed_kind": row.get("speed_kind"), "speed_note": summary.get("speed_note"),
        "speed_shape": {k: config.get(k) for k in ("speed_model", "speed_batch", "speed_context") if k in config},
        ("compute_share" if reuse else "kv_share"): row.get("share"),
    }
    origin = {"from": "search", "run_dir": str(run_dir), "study": summary.get("study"), "trial": row["trial"]}
    # A proposed flow (the run's candidates/) is never trusted: it is traced in the sandbox (built-ins
    # are recognised by their hash either way).
    decode, params, reused = (None, {}, (flow_file, row["params"])) if reuse else (flow_file, row["params"], None)
    return write_bundle(out, decode, params, reuse=reused, model=summary.get("model"), measured=measured,
                        origin=origin, overwrite=overwrite, trust=False)


def read_bundle(path: Path) -> dict[str, Any]:
    """The manifest of a bundle that checks, else one error naming every problem."""
    problems = check_bundle(path)
    if problems:
        raise SparsetuneError(f"bundle {path} does not check: " + "; ".join(problems))
    return json.loads((path / MANIFEST).read_text())


def check_bundle(path: Path) -> list[str]:
    """Every problem of a bundle: missing or unreadable files, a source or graph that changed since
    export, parameters the flow does not declare or accept, or that differ from the resolved ones or
    change what the graphs compute. Params edited since the search measured the bundle's figures are
    reported as such (the figures no longer apply)."""
    from sparsetune.flow.graph import flow_class, graph_key

    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return [f"no {MANIFEST} in {path} (is it a bundle? `sparsetune export ... --out DIR` writes one)"]
    try:
        m = json.loads(manifest_path.read_text())
    except (ValueError, OSError) as e:
        return [f"{MANIFEST} is not readable JSON ({e}); export again"]
    if not isinstance(m, dict) or m.get("schema") not in (SCHEMA, REUSE_SCHEMA):
        return [f"{MANIFEST}: schema {m.get('schema') if isinstance(m, dict) else None!r}, expected {SCHEMA!r} "
                f"(or {REUSE_SCHEMA!r}); export again"]
    if (m["schema"] == REUSE_SCHEMA) != isinstance(m.get("reuse"), dict):
        return [f"{MANIFEST}: schema {m['schema']!r} " + ("without a reuse flow" if m["schema"] == REUSE_SCHEMA else
                                                          "with a reuse flow") + "; export again"]
    missing = [k for k in ("flow", "source", "source_sha256", "params", "graph", "graph_sha256") if k not in m]
    if missing:
        return [f"{MANIFEST} lacks {', '.join(missing)} (written by an older sparsetune?); export again"]
    bad = [k for k in ("flow", "source", "source_sha256", "graph", "graph_sha256") if not isinstance(m[k], str)]
    if bad or not isinstance(m["params"], dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                            for k, v in m["params"].items()):
        return [f"{MANIFEST}: {', '.join(bad) or 'params'} must be " + ("text" if bad else "an object of text values")
                + "; export again"]
    problems = []
    for key, digest_key in (("source", "source_sha256"), ("graph", "graph_sha256")):
        f = path / m[key]
        if Path(m[key]).name != m[key] or not f.is_file():
            return [f"the flow {key} {m[key]!r} is not in the bundle"]
        problems += _changed(f, m[digest_key])
    if problems:
        return problems
    try:
        desc = json.loads((path / m["graph"]).read_text())
        cls = flow_class(desc, origin=f"bundle {path}")
        flow = cls.from_strings(m["params"])
    except ValueError as e:
        return [f"{m['graph']} is not JSON ({e}); export again"]
    except SparsetuneError as e:
        return [str(e)]
    resolved = as_text(flow)
    if cls.name != m["flow"]:
        problems.append(f"{m['graph']} holds flow {cls.name!r}, the manifest says {m['flow']!r}")
    problems += _unresolved("params", m["params"], resolved)
    if not flow.full_attention and graph_key(flow) not in cls.graphs:  # dense: no stages, so no graphs
        traced, now = json.loads(next(iter(cls.graphs))), json.loads(graph_key(flow))
        diff = ", ".join(f"{k}={m['params'].get(k)}" for k in now if now[k] != traced.get(k))
        problems.append(f"params {diff} change what the flow computes, and its graphs were traced at other values; "
                        "export again with them")
    elif flow.page_flow() is not None and graph_key(flow.page_flow()) not in cls.graphs:  # coarse set after export
        problems.append(f"coarse={m['params'].get('coarse')} selects in two levels, but the bundle holds no graphs "
                        "of its first level (it was exported with one); export again with coarse")
    if flow.calibrated:
        problems += _calibration_problems(path, m)
    elif "calibration_shape" in m or "calibration_sha256" in m:
        problems.append(f"{MANIFEST} names a calibration, but flow {m['flow']!r} is not calibrated; export again")
    if str(m.get("block_size")) != resolved.get("block_size"):
        problems.append(f"block_size {m.get('block_size')!r} differs from the flow's {resolved.get('block_size')!r}")
    if m.get("setup") is not None:  # the setup it was exported as (params edited since are named apart)
        from sparsetune.setup import Setup

        try:
            Setup.from_dict(m["setup"], f"{MANIFEST}'s setup")
        except SparsetuneError as e:
            problems.append(f"{e}; export again")
    if m["schema"] == REUSE_SCHEMA:
        problems += _reuse_problems(path, m["reuse"])
    try:
        served = json.loads((path / SGLANG_CONFIG).read_text())["server_args"]
    except (OSError, ValueError, KeyError, TypeError):
        return problems + [f"{SGLANG_CONFIG} is missing or unreadable; export again"]
    if str(served.get("page_size")) != resolved.get("block_size"):
        problems.append(f"{SGLANG_CONFIG}: page_size {served.get('page_size')!r} is not the flow's block size "
                        f"{resolved.get('block_size')!r} (SGLang's pages are the flow's blocks)")
    return problems


def _reuse_problems(path: Path, r: dict[str, Any]) -> list[str]:
    """A reuse bundle's reuse flow: its file there, unchanged, loadable here (a built-in as shipped, or
    any file with the trust opt-in: `loader`), its params as that flow resolves them."""
    bad = [k for k in ("flow", "source", "source_sha256") if not isinstance(r.get(k), str)]
    if bad or not isinstance(r.get("params"), dict) or not all(isinstance(v, str) for v in r["params"].values()):
        return [f"{MANIFEST}: reuse.{', reuse.'.join(bad) or 'params'} must be " + ("text" if bad else "an object of text values")
                + "; export again"]
    f = path / r["source"]
    if Path(r["source"]).name != r["source"] or not f.is_file():
        return [f"the reuse flow source {r['source']!r} is not in the bundle"]
    changed = _changed(f, r["source_sha256"])
    if changed:
        return changed
    try:  # a built-in as shipped loads; another file only with the trust opt-in (the loader's one rule)
        cls, resolved = _resolve(f, r["params"], reuse=True)
    except SparsetuneError as e:
        return [str(e)]
    problems = [] if cls.name == r["flow"] else [f"{r['source']} holds reuse flow {cls.name!r}, the manifest says {r['flow']!r}"]
    return problems + _unresolved("reuse params", r["params"], resolved)


def _changed(f: Path, digest: str) -> list[str]:
    """A bundle file whose sha256 is not the manifest's, named (none: unchanged)."""
    now = file_sha256(f)
    return [] if now == digest else [f"{f.name} changed since export (sha256 {now[:12]}…, manifest {digest[:12]}…); export again"]


def _unresolved(what: str, given: dict[str, str], resolved: dict[str, str]) -> list[str]:
    """Params a manifest holds otherwise than the flow resolves them, named (none: as resolved)."""
    changed = {k: (v, given.get(k)) for k, v in resolved.items() if given.get(k) != v}
    return [f"{what} not as resolved: " + ", ".join(f"{k}={b!r} (resolves to {a!r})" for k, (a, b) in changed.items())] if changed else []


def _calibration_problems(path: Path, m: dict[str, Any]) -> list[str]:
    """A calibrated flow's bundle: its calibration file there, unchanged, named by the flow's param."""
    from sparsetune.models.artifacts import calibration_shape

    f = path / CALIBRATION
    if not f.is_file() or not isinstance(m.get("calibration_sha256"), str):
        return [f"flow {m['flow']!r} is calibrated but the bundle carries no {CALIBRATION}; export again with --model "
                "(the model it serves, calibrated: `sparsetune flows calibrate --model M`)"]
    if file_sha256(f) != m["calibration_sha256"]:
        return [f"{CALIBRATION} changed since export; export again"]
    if m["params"].get("calibration") != CALIBRATION:
        return [f"params: calibration={m['params'].get('calibration')!r}, but the bundle serves its own {CALIBRATION}; "
                "export again"]
    try:
        shape = list(calibration_shape(f))
    except SparsetuneError as e:
        return [f"{e}; export again"]
    return [] if shape == m.get("calibration_shape") else [
        f"{CALIBRATION} is for {shape}, the manifest says {m.get('calibration_shape')}; export again"]


def calibration_of(path: Path, manifest: dict[str, Any]) -> tuple[Path, tuple[int, int, int]] | None:
    """A checked bundle's calibration file and its (layers, KV heads, head_dim); None: the flow has none."""
    shape = manifest.get("calibration_shape")
    return None if shape is None else (path / CALIBRATION, tuple(shape))


def edited_since_measured(manifest: dict[str, Any]) -> dict[str, tuple[str | None, str | None]]:
    """Params that differ from those the bundle's figures were measured at: name → (measured, now)."""
    at = manifest.get("measured_params")
    if not isinstance(at, dict):
        return {}
    now = manifest.get("params") or {}
    return {k: (at.get(k), now.get(k)) for k in sorted(set(at) | set(now)) if at.get(k) != now.get(k)}


def check_model(model: str | Path, params: dict[str, str], calibration: tuple[int, int, int] | None = None) -> list[str]:
    """What keeps SGLang from serving a bundle's flow on a local model folder (a hub id is SGLang's to
    fetch: nothing to check here): no or an unreadable config.json, no `architectures` (SGLang picks
    the model class from it), an attention the backend does not serve, layer indices past the model's,
    a calibration (layers, KV heads, head_dim) of another shape."""
    path = Path(model)
    if not path.is_dir():
        return [] if not str(model).startswith((".", "/", "~")) else [f"model folder {model} does not exist"]
    try:
        cfg = json.loads((path / "config.json").read_text())
    except OSError:
        return [f"{path} has no config.json: SGLang loads Hugging Face-format model folders "
                "(`sparsetune models path NAME` prints one for a model sparsetune knows)"]
    except ValueError as e:
        return [f"{path}/config.json is not JSON ({e})"]
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    problems = []
    if not cfg.get("architectures"):
        problems.append(f"{path}/config.json names no architectures: SGLang picks the model class from it "
                        "(a copy converted by sparsetune before 0.1: `sparsetune models path NAME` completes it)")
    if cfg.get("kv_lora_rank") or cfg.get("attention_type") == "mla":
        problems.append(f"{path} is an MLA model: the {BACKEND} backend serves MHA/GQA attention only")
    layers = cfg.get("num_hidden_layers")
    if calibration is not None:
        heads = cfg.get("num_attention_heads")
        hidden = cfg.get("hidden_size")
        dim = cfg.get("head_dim") or (hidden // heads if isinstance(heads, int) and heads and isinstance(hidden, int) else None)
        have = (layers, cfg.get("num_key_value_heads", heads), dim)
        if None not in have and tuple(calibration) != have:  # a config without them: the launch checks
            problems.append(f"the bundle's {CALIBRATION} is for {calibration[0]} layers x {calibration[1]} KV heads x "
                            f"head_dim {calibration[2]}, {path} has {have[0]} x {have[1]} x {have[2]}; export again with "
                            "this model's calibration")
    for key in ("dense_layers", "select_layers"):
        bad = [i for i in params.get(key, "").split(",") if i.strip() and isinstance(layers, int) and int(i) >= layers]
        if bad:
            problems.append(f"{key}={params[key]} names layer {bad[0]} but {path} has {layers} layers; export again "
                            "with layers of this model")
    return problems


def version_tuple(version: str) -> tuple[int, ...]:
    """(0, 5, 16) of "0.5.16" or "0.5.16.post1"; non-numeric parts end it."""
    parts = []
    for p in version.split("."):
        if not p.isdigit():
            break
        parts.append(int(p))
    return tuple(parts)


def _v(t: tuple[int, ...]) -> str:
    return ".".join(map(str, t))


def supported_versions() -> str:
    """The SGLang versions the backend supports, in words ("0.5.13 to 0.5.16, or 0.5.23")."""
    return ", or ".join(_v(lo) if lo == hi else f"{_v(lo)} to {_v(hi)}" for lo, hi in SUPPORTED)


def supported_specs() -> list[str]:
    """The same as pip requirement specifiers, one per range (pip has no "or": pick one)."""
    return [f"sglang=={_v(lo)}" if lo == hi else f"sglang>={_v(lo)},<={_v(hi)}" for lo, hi in SUPPORTED]


def install_hint() -> str:
    """What to install: the newest supported SGLang (its torch), or the newest of the older range."""
    newest, older = SUPPORTED[-1][1], SUPPORTED[-2][1]
    return (f"pip install sglang=={_v(newest)} (or 'sparsetune[sglang]'; it pins torch 2.14.1), or sglang=={_v(older)} "
            "(torch 2.11) where the GPU host's torch is older")


def sglang_version() -> str | None:
    """The installed SGLang's version (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def sglang_problem(version: str | None = None) -> str | None:
    """Why an SGLang (by default the installed one) cannot host the backend (None: it can)."""
    version = sglang_version() if version is None else version
    if version is None:
        return f"SGLang is not installed: {install_hint()}"
    v = version_tuple(version)[:3]
    if not any(lo <= v <= hi for lo, hi in SUPPORTED):
        return f"SGLang {version} is not supported by sparsetune's backend (supported: {supported_versions()}): {install_hint()}"
    return None
