"""The Python API (`generate`, `eval`, `list_models`); the CLI is a thin layer over these functions.

Arguments are checked before torch and the engine are imported, so a mistake fails at once.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from sparsetune.engine.config import EngineConfig
from sparsetune.errors import SparsetuneError
from sparsetune.models.registry import REGISTRY, find_local_weights
from sparsetune.reuse.parts import encode_parts, parse_parts_any

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
    defaults: dict[str, Any] | None = None  # the model's tuned flow defaults the run took (`flow.defaults`)
    attended_tokens: int | None = None  # of the prompt's tokens, what a sparse layer attends (None: dense)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.random_weights:
            d["note"] = "random weights: the text is meaningless (speed-only run)"
        return d


def generate(
    prompt: str | list,
    config: EngineConfig | None = None,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    chat: bool = True,
    llm: LLM | None = None,
    on_token: Callable[[int], None] | None = None,
) -> GenerateResult:
    """Generate a completion for one prompt on an engine built from `config` (default: the default
    model on CPU or one GPU), or on `llm`. `prompt`: text, or a list of parts (strings and
    `{"text", "reuse", "namespace", "pin"}` segments) that the engine's reuse flow (`config.reuse`)
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
    if llm is None:
        config = config or EngineConfig()
        config.check()  # before torch loads
    from sparsetune.llm import LLM
    from sparsetune.engine.sequence import SamplingParams
    from sparsetune.perf.cost import attended_tokens
    from sparsetune.perf.fit import GENERATE, check_fits

    t0 = time.perf_counter()
    if llm is None:
        llm = LLM(config)
    load_s = time.perf_counter() - t0
    ids = (encode_parts(llm.tokenizer, parse_parts_any(list(prompt)), chat).token_ids
           if isinstance(prompt, (list, tuple)) else llm.encode_prompt(prompt, chat))
    check_fits(llm, 1, len(ids), 1, GENERATE)  # the prompt and one new token: refused with the limit's own fix
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
        defaults=llm.config.tuned,
        attended_tokens=None if llm.flow is None else attended_tokens(llm.model_config, llm.flow, out.prompt_tokens),
    )


def eval(flow: str | None = None, *, out: str | Path | None = None, resume: str | Path | None = None,
         llm: LLM | None = None, on_progress: Callable[[float, int, str], None] | None = None,
         on_start: Callable[[Path, dict[str, Any]], None] | None = None, **options: Any) -> dict[str, Any]:
    """`sparsetune.eval`: `evaluation.runner.evaluate` with the config as keyword arguments (`EvalConfig.of`:
    `model`, `tasks`, `context`, `params`, ... any `EvalConfig` or `EngineConfig` field); returns the
    results.json object. `resume`: a run directory to finish (its config wins)."""
    from sparsetune.evaluation.config import EvalConfig, load_resume_config
    from sparsetune.evaluation.runner import evaluate

    config = load_resume_config(Path(resume)) if resume is not None else EvalConfig.of(flow=flow, **options)
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
    and their params (any `search.config.SearchConfig` field as a keyword: `trials`, `hours`,
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
           params: dict[str, str] | None = None, trial: str | None = None, pick: str | None = None,
           model: str | None = None, force: bool = False, defaults: str = "tuned") -> dict[str, Any]:
    """Write a bundle of a tuned decode flow to `out` (`export.bundle`): a search's confirmed point
    (`run_dir`, by `trial` or a `pick` rule; by default the fastest above the search's bar), or a
    flow with `params` and no search: with `model`, over the model's tuned defaults (as `eval` runs
    it) unless `defaults` is "published". Returns the manifest, with the bundle's folder as `bundle`
    and, for `flow`, what was taken from the tuned defaults as `tuned` (None: nothing)."""
    out = Path(out)
    if (run_dir is None) == (flow is None):
        raise SparsetuneError("export a search's run folder (runs/<study>) or a --flow with --param, not both and not neither")
    if run_dir is not None and (params or model):
        raise SparsetuneError("--param and --model come from the search when exporting its run folder; drop them")
    if flow is not None and (trial or pick):
        raise SparsetuneError("--trial and --pick choose a point of a search: pass its run folder, not --flow")
    if defaults not in ("tuned", "published"):
        raise SparsetuneError(f"--defaults {defaults!r}: use tuned or published")
    if defaults != "tuned" and (run_dir is not None or model is None):
        raise SparsetuneError("--defaults applies to --flow with --model (a search's point has its own params)")
    from sparsetune.export.bundle import export_run, write_bundle
    from sparsetune.loader import flow_path

    if run_dir is not None:
        manifest = export_run(Path(run_dir), out, trial=trial, pick=pick, overwrite=force)
        return {**manifest, "bundle": str(out)}
    params, tuned = dict(params or {}), None
    if model is not None:
        from sparsetune.flow.defaults import with_tuned_defaults
        from sparsetune.models.resolve import model_name

        model = model_name(model)
        if defaults == "tuned":
            params, tuned = with_tuned_defaults(model, False, flow, params)
    # what the manifest keeps of where they came from: no storage URL (it may hold a password), no local path
    origin = {"from": "params"} if tuned is None else {"from": "params", "tuned": {
        "params": tuned["params"], "file": Path(tuned["file"]).name,
        "source": {k: v for k, v in tuned["source"].items() if k != "storage"}}}
    manifest = write_bundle(out, flow_path(flow), params, model=model, origin=origin, overwrite=force)
    return {**manifest, "bundle": str(out), "tuned": tuned}


def check_export(bundle: str | Path, *, require_sglang: bool = False, model: str | Path | None = None) -> dict[str, Any]:
    """A bundle's problems (`export.bundle.check_bundle`; with `model`, the model folder's for serving
    it, `check_model`) and whether this environment's SGLang can serve it; `ok` is False when the
    bundle or the model has a problem, or, with `require_sglang`, SGLang does."""
    from sparsetune.export.bundle import (MANIFEST, check_bundle, check_model, edited_since_measured, sglang_problem,
                                          sglang_version)

    problems, sglang = check_bundle(Path(bundle)), sglang_problem()
    if model is not None and not problems:  # the manifest reads: it just checked
        problems = check_model(model, json.loads((Path(bundle) / MANIFEST).read_text())["params"])
    edited = {} if problems else edited_since_measured(json.loads((Path(bundle) / MANIFEST).read_text()))
    return {"bundle": str(bundle), "problems": problems, "sglang": sglang_version(), "sglang_problem": sglang,
            "edited_since_measured": edited, "ok": not problems and not (require_sglang and sglang)}


def bench_serve(config: Any = None, *, out: str | Path | None = None, resume: str | Path | None = None,
                llm: LLM | None = None, on_event: Callable[[str, dict[str, Any]], None] | None = None,
                **options: Any) -> dict[str, Any]:
    """`sparsetune bench serve`: latency under load, open-loop Poisson arrivals on the engine
    (`perf.serve.serve_benchmark`), with a `ServeConfig` or its fields and `EngineConfig`'s as
    keyword arguments (`flows`, `rates`, `requests`, `input_len`, `output_len`, `prefill`, `slo`, ...;
    `model`, `random_weights`, `kv_memory`, ...). Returns results.json's object. `resume`: a run
    directory to finish (its config wins)."""
    from sparsetune.perf.serve import ServeConfig, serve_benchmark

    if resume is None and config is None:
        config = ServeConfig.of(**options)
    elif options:
        raise TypeError("pass a ServeConfig or keyword options, not both (and none with resume)")
    return serve_benchmark(config, out=out, resume=resume, llm=llm, on_event=on_event)
