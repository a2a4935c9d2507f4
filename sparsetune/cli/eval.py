"""`sparsetune eval`: a flow's accuracy, fidelity to dense and speed, recorded under runs/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from sparsetune.cli import options as opt
from sparsetune.cli.options import apply_threads, progress
from sparsetune.cli.output import emit_json, err


def eval_command(
    flow: str = opt.flow_option(help="Decode flow: a built-in name (sparsetune flows list) or a .py file (default: dense, or the reuse flow's own)."),
    model: str = opt.model_option(),
    task: list[str] = typer.Option(None, "--task", "-t", help="Task name or a .jsonl file (repeatable; default: the standard suite)."),
    context: int = typer.Option(1024, "--context", "-c", help="Target prompt length in tokens (generated tasks; speed prompts)."),
    samples: int = typer.Option(4, "--samples", help="Samples per generated task (a .jsonl file runs every line)."),
    limit: int = typer.Option(None, "--limit", help="At most N samples per task, generated or from a file."),
    seed: int = opt.seed_option("Seed for task generation, speed prompts and random weights."),
    param: list[str] = opt.param_option(),
    reuse: str = opt.reuse_option("KV-reuse flow for tasks with segments (e.g. --task rag): sparsex, cacheblend, ..."),
    reuse_param: list[str] = opt.reuse_param_option(),
    batch: int = typer.Option(8, "--batch", "-b", help="Requests run together (accuracy) / the speed batch."),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", help="Generation length (default: each task's own; speed: 128)."),
    mode: str = typer.Option("auto", "--mode", help="accuracy, speed, all, or auto (all on GPU, accuracy on CPU, speed with --random-weights)."),
    no_fidelity: bool = typer.Option(False, "--no-fidelity", help="Skip the dense pass (no fidelity, no dense accuracy)."),
    device: str = opt.device_option(),
    dtype: str = opt.dtype_option("auto, float32, float16 or bfloat16 (the small model needs float32/float16 for accuracy)."),
    random_weights: bool = opt.random_weights_option("Seeded random weights (speed only)."),
    kv_memory: str = opt.kv_memory_option("KV pool size, e.g. 8GiB."),
    flow_executor: str = opt.flow_executor_option(),
    defaults: str = opt.defaults_option(),
    no_cuda_graph: bool = opt.no_cuda_graph_option(),
    prefix_caching: bool = opt.prefix_caching_option(),
    out: Path = opt.out_option("Directory for run records.", "-o"),
    resume: Path = typer.Option(None, "--resume", help="Continue an interrupted run directory (its config wins)."),
    list_tasks: bool = typer.Option(False, "--list-tasks", help="Describe the built-in tasks and exit."),
    threads: int = opt.threads_option(),
    json_out: bool = opt.json_option("Print results.json to stdout."),
) -> None:
    """Measure a flow's accuracy, fidelity to dense and speed."""
    if list_tasks:
        _list_tasks(json_out)
        return
    from sparsetune import api

    options = {} if resume is not None else dict(  # a resumed run's config wins
        opt.setup_options(model, flow=flow, param=param, reuse=reuse, reuse_param=reuse_param, device=device, dtype=dtype,
                          random_weights=random_weights, kv_memory=kv_memory, flow_executor=flow_executor,
                          defaults=defaults, no_cuda_graph=no_cuda_graph, seed=seed, prefix_caching=prefix_caching),
        tasks=task, context=context, samples=samples, batch=batch, max_new_tokens=max_new_tokens, mode=mode,
        fidelity=not no_fidelity, limit=limit)
    config = api.eval_config(resume=resume, **options)  # every check before the model loads
    opt.check_writable(resume or out, "--resume" if resume is not None else "--out")  # where the run is written
    apply_threads(threads)
    where: dict[str, Path] = {}
    with progress("eval", "samples") as update:
        update(0, 0, f"loading {model if resume is None else 'the run' + chr(39) + 's model'} and building tasks")

        def on_start(run_dir: Path, res: dict[str, Any]) -> None:
            where["run_dir"] = run_dir
            err.print(f"[dim]run directory: {run_dir}[/]")
            said = api.describe_defaults(res["flow"], res["model"], res.get("defaults"))
            if said:
                err.print(f"[dim]{said}[/]")
            if res.get("note"):
                err.print(f"[yellow]note: {res['note']}[/]")

        try:
            results = api.eval(config=config, out=out, resume=resume, on_progress=update, on_start=on_start)
        except KeyboardInterrupt:
            if "run_dir" in where:
                err.print(f"[yellow]interrupted: the partial run is on disk (results.json: complete=false); "
                          f"continue it with: sparsetune eval --resume {where['run_dir']}[/]")
            raise
    if json_out:
        emit_json(results)
    from rich.console import Console

    _summary(results, err if json_out else Console(highlight=False))


def _fmt(x: float | None, pct: bool = True) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}" if pct else f"{x:.4f}"


def _summary(res: dict[str, Any], out) -> None:
    """The results as tables: on stdout, or on stderr when stdout carries --json."""
    from rich.table import Table

    if res["tasks"]:
        t = Table(title=f"{res['flow']} on {res['model']}, context {res['context']} ({res['device']}, {res['dtype']})")
        has_dense = res.get("dense_accuracy") is not None
        has_fid = res.get("fidelity") is not None
        cols = ["task", "n", "accuracy %"] + (["dense %"] if has_dense else []) + (
            ["cosine", "top-1 %", "top-10 %"] if has_fid else [])
        for col in cols:
            t.add_column(col, justify="left" if col == "task" else "right")

        def cells(acc, dense, fid):
            row = [_fmt(acc)] + ([_fmt(dense)] if has_dense else [])
            if has_fid:
                fid = fid or {}
                row += [_fmt(fid.get("cosine"), pct=False), _fmt(fid.get("top1")), _fmt(fid.get("top10"))]
            return row

        for name, row in res["tasks"].items():
            n = str(row["n"]) if not row.get("total") or row["total"] == row["n"] else f"{row['n']} of {row['total']}"
            t.add_row(name, n, *cells(row["accuracy"], row["dense_accuracy"], row.get("fidelity")))
        t.add_row("[bold]mean[/]", "", *cells(res["accuracy"], res["dense_accuracy"], res.get("fidelity")))
        out.print(t)
        who = res["flow"] if not res.get("reuse") else f"{res['flow']} + {res['reuse']['flow']}"
        if res.get("relative_accuracy") is not None:
            out.print(f"{who} keeps {100 * res['relative_accuracy']:.1f}% of the reference accuracy "
                      "(dense attention, every prompt token computed)")
    reuse = res.get("reuse")
    if reuse and reuse.get("requests"):
        out.print(f"reuse ({reuse['flow']}): {reuse['requests']} requests, reused {_fmt(reuse['reuse_ratio'])}% of "
                  f"prompt tokens, recomputed {_fmt(reuse['recompute_ratio'])}% of them, "
                  f"{_fmt(reuse['compute_fraction'])}% of a full prefill's token-layers, TTFT p50 {reuse['ttft_p50_s']:.3f} s")
        if reuse.get("head_paged_kv_fraction") is not None:  # per-head flows (redknot): what the rows' work kept
            out.print(f"  per head: {_fmt(reuse['fresh_kv_fraction'])}% of the reused tokens' KV recomputed, MLP on "
                      f"{_fmt(reuse['mlp_fraction'])}% of the token-layers, a head-paged store would keep "
                      f"{_fmt(reuse['head_paged_kv_fraction'])}% of the KV")
    speed = res.get("speed")
    if speed:
        t = Table(title=f"speed: batch {speed['flow']['batch']} × {speed['flow']['context']} tokens, "
                        f"{speed['flow']['gen_tokens']} new")
        for col in ("", "TTFT p50 s", "decode tok/s", "TPOT p50 ms", "TPOT p95 ms", "peak GiB"):
            t.add_column(col, justify="right")
        for label, s in (("flow", speed["flow"]), ("dense", speed.get("dense"))):
            if s:
                t.add_row(label, f"{s['ttft_s']['p50']:.3f}", str(s["decode_tokens_per_s"]),
                          str((s["tpot_ms"] or {}).get("p50")), str((s["tpot_ms"] or {}).get("p95")),
                          f"{s['peak_memory_bytes'] / 2**30:.2f}")
        out.print(t)
        if speed.get("decode_speedup"):
            out.print(f"decode speedup over dense: {speed['decode_speedup']:.2f}×")
    if res.get("note"):
        out.print(f"[yellow]note: {res['note']}[/]")
    out.print(f"[dim]record: {res['run_dir']}/results.json ({res['seconds']:.0f}s)[/]")


def _list_tasks(json_out: bool) -> None:
    from rich.table import Table

    from sparsetune.api import list_tasks

    listed = list_tasks()
    rows, suite = listed["tasks"], listed["default_suite"]
    if json_out:
        emit_json(listed)
        return
    from rich.console import Console

    out = Console(highlight=False)
    t = Table(title="sparsetune eval tasks (--task NAME or --task FILE.jsonl)", show_lines=True)
    for col in ("name", "family", "new tokens", "description"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["name"], r["family"], str(r["max_new_tokens"]), r["description"])
    out.print(t)
    out.print(
        "Custom tasks: a .jsonl file, one object per line with `prompt` (or chat `messages`), `answers` (list), "
        "optional `metric` (all | any), `segments`, `max_new_tokens`, `id`.\n"
        f"Default suite: {', '.join(suite)}"
    )
