"""The Python API: every command of the CLI is one function here (`generate`, `eval`, `profile`,
`bench_serve`, `search`, `export`, `flows_*`, ...), and the CLI only parses options, calls it and
prints (an import contract keeps `sparsetune.cli` to this module, `errors` and its own modules).

Arguments are checked before torch and the engine are imported, so a mistake fails at once. A run's
flows are resolved here, once, into a `Setup` (`setup.resolve_options`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from sparsetune.errors import SparsetuneError
from sparsetune.flow.params import parse_param_args as parse_params  # noqa: F401 - the CLI's key=value lists
from sparsetune.models.registry import REGISTRY, find_local_weights
from sparsetune.records import DEFAULT_RUNS_DIR  # noqa: F401 - the CLI's default --out
from sparsetune.reuse.parts import encode_parts, parse_parts_any
from sparsetune.sandbox import TRUST_ENV  # noqa: F401 - the CLI's --trust-flow-code sets it
from sparsetune.setup import Setup, describe_defaults, resolve, resolve_options  # noqa: F401 - describe_defaults: the CLI's

if TYPE_CHECKING:
    from sparsetune.llm import LLM


@dataclass
class GenerateResult:
    model: str
    flow: str
    flow_params: dict[str, Any]
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    token_ids: list[int]
    device: str
    dtype: str
    random_weights: bool
    load_seconds: float
    seconds: float
    ttft_seconds: float | None
    decode_tokens_per_second: float | None
    reuse: dict[str, Any] | None = None  # the reuse flow's name, params and prefill stats (prompts as parts)
    defaults: dict[str, Any] | None = None  # the model's tuned flow defaults the run took (`setup.tuned_defaults`)
    attended_tokens: int | None = None  # of the prompt's tokens, what a sparse layer attends (None: dense)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.random_weights:
            d["note"] = "random weights: the text is meaningless (speed-only run)"
        return d


def generate(
    prompt: str | list,
    setup: Setup | None = None,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    chat: bool = True,
    llm: LLM | None = None,
    on_token: Callable[[int], None] | None = None,
    **options: Any,
) -> GenerateResult:
    """Generate a completion for one prompt on an engine built from `setup` or keyword `options`
    (`setup.resolve_options`: `model`, `flow`, `params`, `reuse`, ..., any `EngineConfig` field;
    default: the default model, dense, on CPU or one GPU), or on `llm`. `prompt`: text, or a list of
    parts (strings and `{"text", "reuse", "namespace", "pin"}` segments) that the setup's reuse flow
    prefills; segments missing from its cache are computed and stored first."""
    if max_new_tokens < 1:
        raise SparsetuneError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    if temperature < 0:
        raise SparsetuneError(f"--temperature must be >= 0 (got {temperature})")
    if not 0 < top_p <= 1:
        raise SparsetuneError(f"--top-p must be in (0, 1] (got {top_p})")
    if isinstance(prompt, (list, tuple)):
        parse_parts_any(list(prompt))  # a bad part is an error before the model loads
    elif not isinstance(prompt, str) or not prompt.strip():
        raise SparsetuneError("the prompt is empty; pass some text with --prompt")
    if llm is None and setup is None:
        setup = resolve_options(**options)  # every check before the model loads
    elif options:
        raise TypeError("pass a setup or options, not both (and neither with llm)")
    from sparsetune.llm import LLM
    from sparsetune.engine.sequence import SamplingParams
    from sparsetune.perf.cost import attended_tokens
    from sparsetune.perf.admission import GENERATE, check_fits

    t0 = time.perf_counter()
    if llm is None:
        llm = LLM(setup)
    load_s = time.perf_counter() - t0
    ids = (encode_parts(llm.tokenizer, parse_parts_any(list(prompt)), chat).token_ids
           if isinstance(prompt, (list, tuple)) else llm.encode_prompt(prompt, chat))
    check_fits(llm.engine, 1, len(ids), 1, GENERATE)  # the prompt and one new token: refused with the limit's own fix
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    t1 = time.perf_counter()
    [out] = llm.generate([prompt], params, chat=chat, on_token=on_token)
    seconds = time.perf_counter() - t1
    st = llm.stats
    ttft = st.first_token_seconds[0] if st.first_token_seconds else None
    tps = st.decode_tokens / st.decode_seconds if st.decode_seconds > 0 else None
    return GenerateResult(
        model=llm.resolved.name,
        flow=llm.flow_name,
        flow_params=llm.flow.params() if llm.flow else {},
        text=out.text or "",
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        finish_reason=out.finish_reason,
        token_ids=out.token_ids,
        device=str(llm.device),
        dtype=str(llm.dtype).removeprefix("torch."),
        random_weights=llm.resolved.random_weights,
        load_seconds=round(load_s, 3),
        seconds=round(seconds, 3),
        ttft_seconds=None if ttft is None else round(ttft, 4),
        decode_tokens_per_second=None if tps is None else round(tps, 2),
        reuse=None if out.reuse is None else {"flow": llm.reuse_flow.name, "params": llm.reuse_flow.params(), **out.reuse},
        defaults=None if llm.setup.flow is None else llm.setup.flow.tuned,
        attended_tokens=None if llm.flow is None else attended_tokens(llm.model_config, llm.flow, out.prompt_tokens),
    )


def eval_config(flow: str | None = None, *, resume: str | Path | None = None, **options: Any):
    """The `EvalConfig` of an eval (`EvalConfig.of`: its setup resolved from the options), or of the
    run folder `resume` (its config.json wins), checked as far as it can be without torch or weights
    (`evaluation.config.check_config`: task files, the model and its context length)."""
    from sparsetune.evaluation.config import EvalConfig, check_config, load_resume_config

    if resume is not None and (flow is not None or options):
        raise SparsetuneError("--resume continues a run with its own config; drop the other options")
    config = load_resume_config(Path(resume)) if resume is not None else EvalConfig.of(flow=flow, **options)
    check_config(config)
    return config


def eval(flow: str | None = None, *, config: Any = None, out: str | Path | None = None, resume: str | Path | None = None,
         llm: LLM | None = None, on_progress: Callable[[float, int, str], None] | None = None,
         on_start: Callable[[Path, dict[str, Any]], None] | None = None, **options: Any) -> dict[str, Any]:
    """`sparsetune.eval`: `evaluation.runner.evaluate` of `config`, or of the config the keyword options
    make (`eval_config`: `model`, `tasks`, `context`, `params`, ... any `EvalConfig` field or setup
    option); returns the results.json object. `resume`: a run directory to finish (its config wins)."""
    from sparsetune.evaluation.runner import evaluate

    if config is None:
        config = eval_config(flow, resume=resume, **options)
    elif flow is not None or options:
        raise TypeError("pass a config or options, not both")
    started = None if on_start is None else lambda run_dir, res: on_start(run_dir, res.dump())
    result = evaluate(config, out=out, resume=resume, llm=llm, on_progress=on_progress, on_start=started)
    return result.dump()


def model_dir(model: str, *, random_weights: bool = False) -> Path:
    """The model as an HF-format folder for other engines (`models.resolve.hf_dir`): what
    `launch_sglang.sh` of an exported bundle takes as MODEL_PATH."""
    from sparsetune.models.resolve import hf_dir

    return hf_dir(model, random_weights)


def list_models() -> list[dict[str, Any]]:
    rows = []
    for spec in REGISTRY.values():
        cfg = spec.config
        if spec.gguf_package:
            weights = "embedded"
        else:
            found, _ = find_local_weights(spec)
            weights = str(found) if found else "missing"
        rows.append(
            {
                "name": spec.name,
                "architecture": cfg.model_type,
                "parameters": cfg.num_parameters(),
                "layers": cfg.num_hidden_layers,
                "heads": cfg.num_attention_heads,
                "kv_heads": cfg.num_key_value_heads,
                "head_dim": cfg.head_dim,
                "context": cfg.max_position_embeddings,
                "hf_repo": spec.hf_repo,
                "weights": weights,
                "description": spec.description,
            }
        )
    return rows


def search(flows: str | list[str] | tuple[str, ...] | None = None, *, reuse: str | list[str] | tuple[str, ...] | None = None,
           resume: bool = False, workers: int = 1, evaluator: Any = None, proposer: Any = None,
           on_event: Callable[[str, dict[str, Any]], None] | None = None, **options: Any) -> dict[str, Any]:
    """`sparsetune.search`: a multi-objective search over decode `flows`, or over `reuse` flows,
    and their params (any `tuning.config.SearchConfig` field as a keyword: `trials`, `hours`,
    `context`, `min_accuracy`, `study`, `storage`, ...); returns frontier.json's object (the
    confirmed frontier, the defaults, dense). Rerunning with the same `study` continues it;
    `resume=True` requires that it exists. `workers`: processes on this host on the one study
    (this one and `workers - 1` `search worker` processes, one GPU each on a GPU host). `agent=`
    "evolve" (`agents.loop`): a proposer also writes new flows, each validated in a sandbox and
    searched like the others; every trial then runs in the sandbox (`proposer`: one of your own,
    `agents.proposer.Proposer`, in place of the one `agent` names)."""
    from sparsetune.tuning.config import DEFAULT_FLOWS, SearchConfig, check_prompts, check_search

    def names(value):
        return [f.strip() for f in value.split(",") if f.strip()] if isinstance(value, str) else list(value or ())

    if flows and reuse:
        raise SparsetuneError("a search is of decode flows or of reuse flows: pass flows or reuse, not both")
    study = options.pop("study", None) or time.strftime("search-%Y%m%d-%H%M%S")
    if reuse:
        options["kind"] = "reuse"
    cfg = SearchConfig(flows=tuple(names(reuse) or names(flows) or DEFAULT_FLOWS), study=study, **options)
    check_search(cfg)  # before torch loads
    cfg = cfg.pinned()  # the speed shape in the study's fingerprint
    from sparsetune.tuning.storage import is_rdb, open_storage, stored_config

    url = cfg.storage_url()
    if resume and ((not is_rdb(url) and not Path(url).is_file()) or stored_config(open_storage(url), study) is None):
        from sparsetune.tuning.config import masked_url

        raise SparsetuneError(f"--resume: no search {study!r} in {masked_url(url)}; drop --resume to start it")
    agent = None
    if cfg.agent is not None:
        if workers > 1:
            raise SparsetuneError("--agent with --workers: proposing runs in one process for now; use --workers 1")
        if evaluator is not None:
            raise SparsetuneError("--agent runs every trial in its sandbox; it takes no evaluator")
        from sparsetune.agents.loop import Agent, make_proposer

        agent = Agent(cfg, proposer or make_proposer(cfg))
    if evaluator is None:  # the engine's tasks (a custom evaluator measures its own way)
        check_prompts(cfg)
    from sparsetune.tuning.run import run_search

    return run_search(cfg, evaluator, on_event, workers=workers, agent=agent)


def search_worker(study: str, storage: str, *, out: str | None = None, evaluator: Any = None,
                  on_event: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Join a running search (its config is in `storage`) and run trials until its budget is spent."""
    from sparsetune.tuning.run import run_worker

    return run_worker(study, storage, out, evaluator, on_event)


def search_show(run_dir: str | Path | None = None, *, study: str | None = None, storage: str | None = None) -> dict[str, Any]:
    """A search's frontier and trials as its studies hold them now."""
    from sparsetune.agents.loop import show_candidates
    from sparsetune.tuning.run import show

    result = show(run_dir, study=study, storage=storage)
    cands = show_candidates(result["run_dir"], result["records"], result["confirmed_frontier"], result["min_accuracy"])
    if cands is not None:
        result["candidates"] = cands
    return result


def promote_flow(candidate_dir: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Copy a search's candidate flow that passed the harness into your flows, with a header naming
    its origin and figures (`agents.loop.promote`)."""
    from sparsetune.agents.loop import promote

    return promote(candidate_dir, out)


def export(run_dir: str | Path | None = None, *, out: str | Path, flow: str | None = None,
           params: dict[str, str] | None = None, reuse: str | None = None, reuse_params: dict[str, str] | None = None,
           trial: str | None = None, pick: str | None = None, model: str | None = None, force: bool = False,
           defaults: str = "tuned") -> dict[str, Any]:
    """Write a bundle to `out` (`export.bundle`): a search's confirmed point (`run_dir`, a decode or
    a reuse search, by `trial` or a `pick` rule; by default the fastest above the search's bar), or
    a flow with `params` and no search: with `model`, over the model's tuned defaults (as `eval`
    runs it) unless `defaults` is "published"; with `reuse` (and `reuse_params`) a reuse bundle,
    whose decode flow is `flow`, else the reuse flow's own, else dense. Returns the manifest, with
    the bundle's folder as `bundle` and, for `flow`, what was taken from the tuned defaults as
    `tuned` (None: nothing), and why SGLang cannot serve it yet as `serving_problem` (None: it can)."""
    out = Path(out)
    if (run_dir is None) == (flow is None and reuse is None):
        raise SparsetuneError("export a search's run folder (runs/<study>), or a --flow with --param (or a --reuse with "
                              "--reuse-param), not both and not neither")
    if run_dir is not None and (params or model or reuse_params):
        raise SparsetuneError("--param, --reuse-param and --model come from the search when exporting its run folder; drop them")
    if reuse is None and reuse_params:
        raise SparsetuneError("--reuse-param needs a reuse flow: add --reuse NAME")
    if run_dir is None and (trial or pick):
        raise SparsetuneError("--trial and --pick choose a point of a search: pass its run folder, not --flow or --reuse")
    if defaults not in ("tuned", "published"):
        raise SparsetuneError(f"--defaults {defaults!r}: use tuned or published")
    if defaults != "tuned" and (run_dir is not None or model is None):
        raise SparsetuneError("--defaults applies to --flow with --model (a search's point has its own params)")
    from sparsetune.export.bundle import export_run, serving_problem, write_bundle
    from sparsetune.loader import flow_path

    if run_dir is not None:
        manifest = export_run(Path(run_dir), out, trial=trial, pick=pick, overwrite=force)
        return {**manifest, "bundle": str(out), "serving_problem": serving_problem(manifest)}
    params, tuned = dict(params or {}), None
    if model is not None and flow is not None:  # the flow as `eval --model` runs it: the model's tuned defaults under the params
        from sparsetune.engine.config import EngineConfig

        chosen = resolve(EngineConfig(model=model), flow=flow, params=params, defaults=defaults).flow
        if chosen is not None:
            tuned = chosen.tuned
            params = {k: v for k, v in chosen.params.items() if chosen.origin[k] != "published"}
    if model is not None:
        from sparsetune.models.resolve import model_name

        model = model_name(model)
    # what the manifest keeps of where they came from: no storage URL (it may hold a password), no local path
    origin = {"from": "params"} if tuned is None else {"from": "params", "tuned": {
        "params": tuned["params"], "file": Path(tuned["file"]).name,
        "source": {k: v for k, v in tuned["source"].items() if k != "storage"}}}
    manifest = write_bundle(out, None if flow is None else flow_path(flow), params, model=model, origin=origin,
                            overwrite=force, reuse=None if reuse is None else (flow_path(reuse), dict(reuse_params or {})))
    return {**manifest, "bundle": str(out), "tuned": tuned, "serving_problem": serving_problem(manifest)}


def check_export(bundle: str | Path, *, require_sglang: bool = False, model: str | Path | None = None) -> dict[str, Any]:
    """A bundle's problems (`export.bundle.check_bundle`; with `model`, the model folder's for serving
    it, `check_model`), whether this environment's SGLang can serve it (`sglang_problem`) and whether
    this sparsetune's plugin serves its flows (`serving_problem`: a reuse flow that narrows the MLP); `ok` is False
    when the bundle or the model has a problem, or, with `require_sglang`, either of the others."""
    from sparsetune.export.bundle import (MANIFEST, calibration_of, check_bundle, check_model, edited_since_measured,
                                          serving_problem, sglang_problem, sglang_version)

    problems, sglang = check_bundle(Path(bundle)), sglang_problem()
    manifest = None if problems else json.loads((Path(bundle) / MANIFEST).read_text())  # it reads: it just checked
    serving = None if manifest is None else serving_problem(manifest)
    if manifest is not None and model is not None:
        calibration = calibration_of(Path(bundle), manifest)
        problems = check_model(model, manifest["params"], None if calibration is None else calibration[1])
    edited = {} if problems else edited_since_measured(manifest)
    return {"bundle": str(bundle), "problems": problems, "sglang": sglang_version(), "sglang_problem": sglang,
            "serving_problem": serving, "edited_since_measured": edited,
            "ok": not problems and not (require_sglang and (sglang or serving))}


def serve_config(*, resume: str | Path | None = None, **options: Any):
    """The `ServeConfig` of a serve benchmark (`ServeConfig.of`: its own fields and `EngineConfig`'s,
    with `executor` and `defaults` for its flows), or of the run folder `resume` (its config wins),
    checked without weights (`perf.serve.check_serve`)."""
    from sparsetune.perf.serve import ServeConfig, check_serve, load_resume

    if resume is not None and options:
        raise SparsetuneError("--resume continues a run with its own config; drop the other options")
    config = load_resume(Path(resume))[0] if resume is not None else ServeConfig.of(**options).with_dense()
    check_serve(config)
    return config


def bench_serve(config: Any = None, *, out: str | Path | None = None, resume: str | Path | None = None,
                llm: LLM | None = None, on_event: Callable[[str, dict[str, Any]], None] | None = None,
                **options: Any) -> dict[str, Any]:
    """`sparsetune bench serve`: latency under load, open-loop Poisson arrivals on the engine
    (`perf.serve.serve_benchmark`), with a `ServeConfig` or its fields and `EngineConfig`'s as
    keyword arguments (`flows`, `rates`, `requests`, `input_len`, `output_len`, `prefill`, `slo`,
    `defaults`, `executor`, ...; `model`, `random_weights`, `kv_memory`, ...). Returns results.json's
    object. `resume`: a run directory to finish (its config wins)."""
    from sparsetune.perf.serve import ServeConfig, serve_benchmark

    if resume is None and config is None:
        config = ServeConfig.of(**options)
    elif options:
        raise TypeError("pass a ServeConfig or keyword options, not both (and none with resume)")
    return serve_benchmark(config, out=out, resume=resume, llm=llm, on_event=on_event)


def list_tasks() -> dict[str, Any]:
    """The built-in eval tasks and the default suite."""
    from sparsetune.evaluation.tasks import DEFAULT_SUITE, list_tasks as rows

    return {"tasks": rows(), "default_suite": list(DEFAULT_SUITE)}


def profile(flow: str = "dense", *, batch: int = 1, context: int = 2048, steps: int = 5, out: str | Path = DEFAULT_RUNS_DIR,
            trace: str | Path | None = None, setup: Setup | None = None, **options: Any) -> dict[str, Any]:
    """`sparsetune profile`: one decode step of `setup` (or `flow` and keyword options) broken into
    categories (`perf.step_profile.profile`), written as a run folder under `out` (results.json,
    env.json, profile.png); returns results.json's object (with `run_dir`)."""
    from sparsetune import records

    if setup is None:
        setup = resolve_options(flow=flow, **options)  # before torch loads
    elif options:
        raise TypeError("pass a setup or options, not both")
    from sparsetune.perf.step_profile import plot, profile as run

    result = run(setup, batch=batch, context=context, steps=steps, trace_path=trace)
    run_dir = records.new_run_dir(out, "profile", result["flow"], setup.model)
    result["run_dir"] = str(run_dir)
    records.write_json(run_dir / "results.json", result)
    records.write_json(run_dir / "env.json", records.env_info(result["device"]))
    plot(result, run_dir / "profile.png")
    return result


def profile_labels() -> dict[str, str]:
    """How `profile`'s categories read in a table."""
    from sparsetune.perf.step_profile import LABELS

    return dict(LABELS)


def against_defaults_lines(summary: dict[str, Any]) -> list[str]:
    """How a search's confirmed points compare with each flow's defaults (`tuning.report`)."""
    from sparsetune.tuning.report import against_defaults_lines as lines

    return lines(summary)


def sglang_versions() -> str:
    """The SGLang versions a bundle runs in, in words (`export.bundle.supported_versions`)."""
    from sparsetune.export.bundle import supported_versions

    return supported_versions()


# ---- flows ----------------------------------------------------------------------------------------

def flows_list() -> list[dict[str, Any]]:
    """The built-in flows: name, kind, the rule's source, file and params (type, default, space)."""
    from sparsetune.loader import builtin_flows, flow_kind, load_file

    rows = []
    for path in builtin_flows().values():
        cls = load_file(path)
        rows.append({"name": cls.name, "kind": flow_kind(cls), "source": cls.source, "path": str(path),
                     "params": {k: v.describe() for k, v in cls.param_specs().items() if k not in cls.inapplicable}})
    return rows


def flow_show(name: str) -> dict[str, Any]:
    """A flow's params (type, default, space, meaning) and its file as it is (an untrusted one was only traced)."""
    from sparsetune.flow.params import Flow
    from sparsetune.loader import flow_kind
    from sparsetune.setup import lookup_flow_class

    cls = lookup_flow_class(name, Flow)
    params = {k: {"describe": v.describe(), "doc": v.doc} for k, v in cls.param_specs().items()}
    return {"name": cls.name, "kind": flow_kind(cls), "source": cls.source, "params": params,
            "code": Path(cls.path).read_text(errors="replace")}


def flow_check(file: str, params: dict[str, str] | None = None) -> dict[str, Any]:
    """`sparsetune flows check`: a decode flow's op set, params, shapes, cost and equality with dense
    at full budget (`flow.check.check_flow`); a reuse flow's params (plain Python: what can be checked)."""
    from sparsetune.flow.check import check_flow
    from sparsetune.flow.params import Flow
    from sparsetune.loader import flow_kind
    from sparsetune.setup import lookup_flow_class

    cls = lookup_flow_class(file, Flow, all_problems=True)
    if flow_kind(cls) == "reuse":
        return {"name": cls.name, "kind": "reuse", "ok": True, "params": cls.from_strings(params or {}).params()}
    return {"kind": "decode", **check_flow(cls, params or {}).to_dict()}


def flow_new(name: str, out: str | Path | None = None) -> Path:
    """Write a commented starting file for a new decode flow (`flow.template`); returns its path."""
    from sparsetune.flow.template import write_template

    return write_template(name, Path(out) if out is not None else None)


def calibrate_channels(model: str = "smollm2-135m", *, text: str | None = None, tokens: int = 2048,
                       out: str | Path | None = None, random_weights: bool = False, device: str = "auto") -> dict[str, Any]:
    """`sparsetune flows calibrate`: each layer's KV-head channels ranked by mean |q*k| (for calibrated
    flows: double_sparse), written to the model's file (or `out`); returns where and what."""
    from sparsetune.calibration.channels import calibrate

    path = calibrate(model=model, text=text, tokens=tokens, random_weights=random_weights, device=device, out=out)
    data = json.loads(path.read_text())
    return {"path": str(path), **{k: data[k] for k in ("model", "tokens", "num_layers", "num_kv_heads")}}


def profile_heads(model: str = "smollm2-135m", *, text: str | None = None, chunks: int = 4, chunk_tokens: int = 512,
                  sink: int = 4, window: int = 512, out: str | Path | None = None, random_weights: bool = False,
                  device: str = "auto") -> dict[str, Any]:
    """`sparsetune flows profile-heads`: each (layer, KV head) scored for RedKnot's head classes,
    written to the model's file (or `out`); returns where, and the layers of the global heads at 15%."""
    import torch

    from sparsetune.calibration.heads import profile_heads as run
    from sparsetune.reuse.head_classes import global_heads

    path = run(model=model, text=text, chunks=chunks, chunk_tokens=chunk_tokens, sink=sink, window=window,
               random_weights=random_weights, device=device, out=out)
    data = json.loads(path.read_text())
    glob = global_heads(torch.tensor(data["scores"]), 0.15)
    return {"path": str(path), **{k: data[k] for k in ("model", "num_layers", "num_kv_heads", "chunks", "chunk_tokens")},
            "global_layers_at_15pct": sorted({int(i) for i in glob.nonzero()[:, 0]})}
