"""`sparsetune search`: multi-objective search over flows and their params; `search worker` joins
one; `search show` prints a search's frontier and trials."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from sparsetune.cli import options as opt
from sparsetune.cli.options import apply_threads
from sparsetune.cli.output import emit_json, err, out, print_table
from sparsetune.errors import SparsetuneError

app = typer.Typer(help="Search flows and their params for the accuracy/speed frontier (Optuna, multi-objective).",
                  invoke_without_command=True, no_args_is_help=False, rich_markup_mode=None)


_SHORT = {"block_size": "block", "budget_ratio": "ratio", "sink_blocks": "sink", "local_blocks": "local",
          "dense_layers": "dense", "select_layers": "select"}


def _short(params: dict[str, Any]) -> str:
    """Params as a compact line: short names, floats to 3 digits, layer runs as a-b."""
    def fmt(v: Any) -> str:
        text = str(v)
        if "," in text or text == "":
            layers = [int(x) for x in text.split(",") if x.strip()]
            if not layers:
                return "-"
            runs, start = [], layers[0]
            for a, b in zip(layers, layers[1:] + [None]):
                if b != a + 1:
                    runs.append(str(start) if start == a else f"{start}-{a}")
                    start = b
            return ",".join(runs)
        try:
            f = float(text)
        except ValueError:
            return text
        return text if "." not in text and "e" not in text else f"{f:.3g}"

    return " ".join(f"{_SHORT.get(k, k)}={fmt(v)}" for k, v in params.items())


class _Live:
    """What a running search shows on stderr: one line per trial, counted from the trials its study
    already had (a resumed one), the frontier as it moves; on Ctrl-C, how to continue it."""

    def __init__(self, trials: int | None, hours: float | None) -> None:
        self.trials, self.hours, self.t0, self.done = trials, hours, time.time(), 0
        self.before, self.begun = 0, None  # the study's trials when this process began; the "begin" event

    def _clock(self) -> str:
        el = time.time() - self.t0
        left = ""
        if self.hours is not None:
            left = f", {max(0.0, self.hours * 3600 - el) / 60:.0f} min left"
        elif self.trials and self.done:
            left = f", ETA {(self.trials - self.before - self.done) * el / self.done / 60:.1f} min"
        return f"{el / 60:.1f} min{left}"

    def interrupted(self) -> None:
        """Ctrl-C: the study stays (the running trial enqueued again); the command that continues it."""
        if self.begun is not None:
            b = self.begun
            err.print(f"[yellow]interrupted: study {escape(b['study'])} is kept ({escape(b['run_dir'])}/, the running "
                      f"trial enqueued again); continue it with: {escape(b['resume'])}[/]")

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "begin":
            self.begun, self.before = data, data["done"]
        elif kind == "start":
            role = " (defaults)" if data["role"] == "defaults" else ""
            err.print(f"[dim]trial {data['flow']}#{data['number']}{role}: {_short(data['params'])}[/]")
        elif kind == "done":
            self.done += 1
            rec = data["record"]
            acc = (rec.get("accuracy") or {}).get("relative_accuracy")
            speed = rec["speed"]
            what = f"accuracy {100 * acc:.0f}% of dense, " if acc is not None else ""
            stop = f" [yellow]stopped: {rec['reason']}[/]" if rec.get("reason") else ""
            err.print(f"  {what}speedup {speed['speedup']:.2f}× ({speed['kind']}), {rec['seconds']:.0f} s{stop}"
                      f"  [{self.before + self.done}{'/' + str(self.trials) if self.trials else ''} trials, {self._clock()}]")
        elif kind == "failed":
            self.done += 1
            err.print(f"  [red]failed:[/] {escape(data['reason'])}")
        elif kind == "waiting":
            err.print(f"[dim]--trials is spent; waiting for {', '.join(data['trials'])} (other workers'; one whose "
                      f"worker stopped is expired after {data['lease_s']:.0f} s without a heartbeat and run here)[/]")
        elif kind == "expired":
            err.print(f"[yellow]expired {data['trial']} (its worker stopped); its params are enqueued again[/]")
        elif kind == "trial":
            front = data["summary"]["frontier"]
            if front:
                err.print("  frontier: " + ", ".join(f"{r['trial']} {100 * r['relative_accuracy']:.0f}%/{r['speedup']:.2f}×"
                                                      for r in front))
        elif kind == "confirm":
            err.print(f"confirming {data['flow']}#{data['number']} on fresh prompts ({data['index'] + 1}/{data['total']})")
        elif kind == "confirm_failed":
            err.print(f"  [red]could not confirm {data['flow']}#{data['number']}:[/] {escape(data['reason'])}")
        elif kind == "turns":
            err.print(f"[yellow]the accuracy and speed engines do not fit on the device together ({escape(data['reason'])}):"
                      " from now on they take turns (each built when its step comes)[/]")
        elif kind == "candidate":
            err.print(f"[bold]candidate {data['id']}[/] {data['name']} ({data['proposer']}): {data['rationale']}")
        elif kind == "verdict":
            ok = data["verdict"] == "accepted"
            err.print(f"  {'[green]accepted[/]' if ok else '[yellow]' + data['verdict'] + '[/]: ' + str(data['reason'])[:300]}"
                      f" ({data['seconds']:.0f} s)")
        elif kind == "proposer" and "error" in data:
            err.print(f"[yellow]the proposer failed: {data['error']}[/] (asking again after {data['retry_after_trials']} trials)")
        elif kind == "proposer":
            err.print(f"[yellow]proposing stopped: {data['stopped']}[/] (the search goes on)")
        elif kind == "worker":
            ok = data["returncode"] == 0
            err.print(f"{'' if ok else '[yellow]'}worker {data['pid']} {'finished' if ok else 'exited with ' + str(data['returncode'])}"
                      f" (its log: {data['log']}){'' if ok else '[/]'}")


@app.callback()
def search(
    ctx: typer.Context,
    flow: str = typer.Option(None, "--flow", "-f", help="Decode flows to search, comma-separated (default: quest,block_topk)."),
    reuse: str = typer.Option(None, "--reuse", help="Reuse flows to search instead, comma-separated (e.g. sparsex,cacheblend): "
                              "accuracy on the reuse tasks, speed against full recompute."),
    model: str = opt.model_option(),
    task: list[str] = typer.Option(None, "--task", "-t", help="Task name or .jsonl file (repeatable; default: the standard "
                                   "suite, or with --reuse rag, chat and agent)."),
    context: int = typer.Option(1024, "--context", "-c", help="Prompt length of the accuracy tasks."),
    samples: int = typer.Option(None, "--samples", help="Samples per task in each trial, the search set (default 1; 4 with --reuse)."),
    confirm_samples: int = typer.Option(None, "--confirm-samples", help="Samples per task, on fresh prompts, to confirm each "
                                        "frontier point (default 2; 8 with --reuse)."),
    confirm_defaults: bool = typer.Option(True, "--confirm-defaults/--no-confirm-defaults", help="Confirm each flow's "
                                          "defaults on fresh prompts too, for the report's against-the-defaults lines "
                                          "(at a long context each takes minutes of --hours)."),
    batch: int = typer.Option(8, "--batch", "-b", help="Requests run together."),
    param: list[str] = opt.param_option("A param fixed, not searched: key=value for every flow, flow:key=value for "
                                        "one (repeatable)."),
    objectives: str = typer.Option("accuracy,speed", "--objectives", help="What is maximized (accuracy,speed)."),
    min_accuracy: float = typer.Option(None, "--min-accuracy", help="Constraint: at least this share of dense accuracy, e.g. 0.95."),
    hours: float = typer.Option(None, "--hours", help="Time budget; no trial starts that cannot finish in it."),
    trials: int = typer.Option(None, "--trials", help="Trial budget across every flow and worker (default: 6 without --hours)."),
    study: str = typer.Option(None, "--study", help="Study name: runs/<study>/ (rerun with the same name to continue it)."),
    storage: str = typer.Option(None, "--storage", help="postgresql://user:password@host/db for workers on several hosts, "
                                "sqlite:///file.db, or a journal file (default: study.journal in the run folder)."),
    resume: bool = typer.Option(False, "--resume", help="Continue --study (refused if it does not exist or its settings differ)."),
    save_defaults: bool = typer.Option(False, "--save-defaults", help="Make each flow's fastest confirmed point at "
                                       "--min-accuracy the model's default for it (eval and generate use it)."),
    seed: int = opt.seed_option("Seed for prompts and the samplers."),
    speed: str = typer.Option("auto", "--speed", help="measured (GPU), modeled (step time from per-operation costs measured on an H200) or auto (measured on a GPU)."),
    speed_model: str = typer.Option(None, "--speed-model", help="Take speed on this architecture with random weights. Default: the search's model; a modeled decode speed with no --speed-* option: qwen3-8b at 16 x 32768 tokens (where the H200 cost model is tested), unless a flow's budget is a fixed window."),
    speed_batch: int = typer.Option(None, "--speed-batch", help="Batch for speed (default: --batch, or 16 for a modeled decode speed; see --speed-model)."),
    speed_context: int = typer.Option(None, "--speed-context", help="Context for speed (default: --context, or 32768 for a modeled decode speed; see --speed-model)."),
    agent: str = typer.Option(None, "--agent", help="Also propose new decode flows: evolve (LLM-free program evolution), claude "
                              "(ANTHROPIC_API_KEY) or openai (--agent-endpoint); each is checked in a sandbox, gated, then "
                              "searched like the others (runs/<study>/candidates/)."),
    agent_budget_usd: float = typer.Option(None, "--agent-budget-usd", help="Stop proposing once the proposer's calls cost this much (USD)."),
    agent_model: str = typer.Option(None, "--agent-model", help="claude: the Anthropic model id (default claude-sonnet-4-6); "
                                    "openai: the name of the model the endpoint serves."),
    agent_endpoint: str = typer.Option(None, "--agent-endpoint", help="openai: an OpenAI-compatible server's base URL "
                                       "(e.g. http://localhost:30000/v1 for SGLang)."),
    workers: int = typer.Option(1, "--workers", help="Processes on this host, one engine each: one GPU each on a GPU host "
                                "(the CPU's cores split on CPU); their logs in runs/<study>/workers/."),
    device: str = opt.device_option(),
    dtype: str = opt.dtype_option(),
    out: Path = opt.out_option("Directory for search folders."),
    threads: int = opt.threads_option(),
    json_out: bool = opt.json_option("Print the final frontier (frontier.json) to stdout."),
) -> None:
    """Search flows and their params for the accuracy/speed frontier."""
    if ctx.invoked_subcommand is not None:
        return
    if reuse is not None and flow is not None:
        raise SparsetuneError("--flow and --reuse: a search is of decode flows or of reuse flows; run one search for each")
    if [o.strip() for o in objectives.split(",")] != ["accuracy", "speed"]:
        raise SparsetuneError(f"--objectives {objectives!r}: accuracy,speed is the one supported pair")
    if workers < 1:
        raise SparsetuneError(f"--workers must be at least 1 (got {workers})")
    if trials is None and hours is None:
        trials = 6
    from sparsetune import api

    options = dict(model=model, tasks=task, context=context, batch=batch, confirm_defaults=confirm_defaults,
                   **{k: v for k, v in (("samples", samples), ("confirm_samples", confirm_samples)) if v is not None}, params=api.parse_params(param), min_accuracy=min_accuracy, hours=hours, trials=trials,
                   study=study, storage=storage, out=str(out), seed=seed, speed=speed, speed_model=speed_model,
                   speed_batch=speed_batch, speed_context=speed_context, save_defaults=save_defaults,
                   agent=agent, agent_budget_usd=agent_budget_usd, agent_model=agent_model, agent_endpoint=agent_endpoint,
                   device=None if device == "auto" else device, dtype=None if dtype == "auto" else dtype)
    apply_threads(threads)
    live = _Live(trials, hours)
    try:
        result = api.search(flow, reuse=reuse, resume=resume, workers=workers, on_event=live, **options)
    except KeyboardInterrupt:
        live.interrupted()
        raise
    _report(result, json_out)


@app.command("worker")
def worker(
    study: str = typer.Option(..., "--study", help="The search to join."),
    storage: str = typer.Option(..., "--storage", help="Its storage (postgresql://..., or the journal file)."),
    out: Path = opt.out_option("Directory for this worker's copy of the search folder."),
    threads: int = opt.threads_option(),
    json_out: bool = opt.json_option("Print the frontier when the budget is spent."),
) -> None:
    """Join a search and run its trials (one per GPU or host)."""
    from sparsetune import api

    apply_threads(threads)
    live = _Live(None, None)
    try:
        result = api.search_worker(study, storage, out=str(out), on_event=live)
    except KeyboardInterrupt:
        live.interrupted()
        raise
    _report(result, json_out)


@app.command("show")
def show(
    run_dir: Path = typer.Argument(None, help="A search folder (runs/<study>)."),
    study: str = typer.Option(None, "--study", help="Or: the search's name ..."),
    storage: str = typer.Option(None, "--storage", help="... and its storage (also with a run folder whose search.json "
                                "keeps its postgresql:// URL without the password)."),
    json_out: bool = opt.json_option("Print frontier.json's object with every trial's record."),
) -> None:
    """A search's frontier and trials, as its studies hold them now (also while it runs)."""
    from sparsetune import api

    result = api.search_show(run_dir, study=study, storage=storage)
    if json_out:
        emit_json(result)
        return
    _report(result, False)


def _report(s: dict[str, Any], json_out: bool) -> None:
    """The confirmed frontier next to the defaults and dense (stderr when stdout carries JSON), and
    last, the command to run next."""
    from rich.table import Table

    from sparsetune.api import against_defaults_lines

    if json_out:
        emit_json({k: v for k, v in s.items() if k != "records"})
    console = err if json_out else out
    t = Table(title=f"search {s['study']}: {', '.join(s['flows'])} on {s['model']}, context {s['context']} "
                    f"(accuracy relative to dense; speed {s['speed']}{s.get('speed_on', '')})")
    for col in ("", "trial", "acc.", "top-1", "speedup", "confirmed [95%]", "params"):  # params last: the long one
        t.add_column(col, overflow="fold", min_width=14 if col == "params" else None,
                     no_wrap=col not in ("confirmed [95%]", "params"))  # in a narrow terminal these two wrap

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    def add(label: str, r: dict[str, Any]) -> None:
        lo, hi = r.get("interval") or (None, None)
        conf = "-" if r.get("confirmed_accuracy") is None else (
            f"{pct(r['confirmed_accuracy'])} [{pct(lo)}, {pct(hi)}]" + ("" if r.get("holds") else " ✗"))
        t.add_row(label, r["trial"], pct(r["relative_accuracy"]), pct(r["fidelity_top1"]), f"{r['speedup']:.2f}×",
                  conf, _short(r["params"] or {}))

    t.add_row("dense", "", "100%", "100%", "1.00×", f"(absolute accuracy {pct(s['dense']['accuracy'])})", "")
    for r in s["defaults"]:
        add("defaults", r)
    failed = {r["trial"] for r in s["not_confirmed"]}
    for r in s["confirmed_frontier"]:
        add("frontier", r)
    for r in s["frontier"]:  # search-set points not (yet) confirmed, e.g. after Ctrl-C
        if r["confirmed_accuracy"] is None and r["trial"] not in failed:
            add("unconfirmed", r)
    for r in s["not_confirmed"]:
        add("did not hold", r)
    print_table(console, t)
    if s["not_confirmed"] or any(not r.get("holds", True) for r in s["defaults"] if r.get("confirmed_accuracy") is not None):
        console.print("✗: below the bar on fresh prompts" if s.get("min_accuracy") else
                      "✗: the search-set figure is above the fresh prompts' 95% interval")
    for line in against_defaults_lines(s):
        console.print(f"against the defaults: {line}")
    tr = s["trials"]
    console.print(f"{tr['finished']} trials ({tr['stopped_by_cascade']} stopped by the cascade), {tr['failed']} failed"
                  f"{'; stopped: ' + s['stopped'] if s.get('stopped') else ''}")
    for d in s.get("saved_defaults", []):
        if d["saved"]:
            console.print(f"saved {d['flow']}'s default for {s['model']}: {_short(d['params'])} ({d['trial']}) in {d['file']}")
        else:
            console.print(f"[yellow]{d['flow']}: no default saved ({d['reason']})[/]")
    if s.get("candidates"):
        _candidates(console, s["candidates"])
    for r in s.get("running", []):  # search show, while the search runs
        beat = "" if r["heartbeat_age_s"] is None else f", last heartbeat {r['heartbeat_age_s']:.0f} s ago"
        err.print(f"running: {r['trial']} {_short(r['params'] or {})} on {r['worker'] or '?'} since {r['started']}{beat}")
    console.print(f"[dim]{s['run_dir']}/: frontier.md, frontier.json, frontier.png, hypervolume.png, trials.jsonl"
                  f"{', candidates.json, candidates/' if s.get('candidates') else ''}[/]")
    console.print(f"next: {s['next_step']}:", markup=False)
    console.print(f"  {s['next_command']}", markup=False)


def _candidates(console, c: dict[str, Any]) -> None:
    """The proposed flows: verdicts, where the accepted ones landed, their diversity and cost."""
    from rich.table import Table

    t = Table(title=f"{c['proposed']} candidates, {c['accepted']} accepted")
    for col in ("id", "flow", "proposer", "verdict", "trials", "best (acc. / speedup)", "confirmed frontier"):
        t.add_column(col, overflow="fold")
    for r in c["candidates"]:
        best = r["best"]
        verdict = r["verdict"] if r["verdict"] == "accepted" else f"{r['verdict']}: {(r['reason'] or '')[:120]}"
        t.add_row(r["id"], r["name"], r["proposer"], verdict, str(r["trials"]),
                  "-" if best is None else f"{100 * best['relative_accuracy']:.0f}% / {best['speedup']:.2f}×",
                  ", ".join(r["on_confirmed_frontier"]) or "-")
    print_table(console, t)
    d = c["diversity"]
    if d["mean_distance"] is not None:
        console.print(f"diversity of the accepted flows: mean pairwise distance {d['mean_distance']:.2f} "
                      f"(min {d['min_distance']:.2f}, max {d['max_distance']:.2f}; cache fields, ops, call patterns)")
    if c["cost_usd"]:
        console.print(f"proposer cost: ${c['cost_usd']:.4f}")
    if c.get("versus_builtins"):
        console.print(c["versus_builtins"]["line"], markup=False)
