"""`sparsetune profile`: where one decode step's time goes, by kernel category and flow stage."""

from __future__ import annotations

from pathlib import Path

import typer

from sparsetune.cli.options import apply_threads, threads_option
from sparsetune.cli.output import emit_json, err, parse_size


def profile(
    flow: str = typer.Option("dense", "--flow", "-f", help="Decode flow: a built-in name (sparsetune flows list) or a .py file."),
    param: list[str] = typer.Option(None, "--param", help="Flow hyperparameter key=value (repeatable)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Registered name or a local HF-format directory."),
    batch: int = typer.Option(1, "--batch", "-b", help="Sequences decoding together."),
    context: int = typer.Option(2048, "--context", "-c", help="Prompt tokens per sequence (random ids, prefilled for real)."),
    steps: int = typer.Option(5, "--steps", help="Decode steps timed for the wall time (median)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    dtype: str = typer.Option("auto", help="auto, float32, float16 or bfloat16."),
    random_weights: bool = typer.Option(False, "--random-weights", help="Seeded random weights (speed-only)."),
    kv_memory: str = typer.Option(
        None, "--kv-memory", help="KV pool size, e.g. 4GiB (default: 90% of free GPU memory; on CPU what the case needs, at most 2GiB)."
    ),
    flow_executor: str = typer.Option(None, "--flow-executor", help="reference or compiled (default: compiled on GPU)."),
    seed: int = typer.Option(0, help="Seed for the prompts and random weights."),
    trace: Path = typer.Option(None, "--trace", help="Also write the profiled step's Chrome trace (JSON) here."),
    out: Path = typer.Option(Path("runs"), "--out", help="Parent directory of the run directory."),
    threads: int = threads_option(),
    json_out: bool = typer.Option(False, "--json", help="Print results.json to stdout (the table goes to stderr)."),
) -> None:
    """Break one decode step into attention, flow stages, GEMMs, norms, sampling, ... (GPU kernel
    time; CPU time on CPU, attributed by stage)."""
    from sparsetune.flow.params import parse_param_args

    options = dict(device=device, dtype=dtype, random_weights=random_weights, flow_executor=flow_executor, seed=seed,
                   kv_memory=parse_size(kv_memory, "--kv-memory"))
    flow_params = parse_param_args(param)
    from sparsetune.engine.config import EngineConfig

    EngineConfig(model=model, **{**options, "device": None if device == "auto" else device,
                                 "dtype": None if dtype == "auto" else dtype}).check()  # before torch loads
    apply_threads(threads)
    from sparsetune import records
    from sparsetune.perf.step_profile import plot, profile as run

    with err.status(f"profiling {flow} on {model}: batch {batch}, context {context} ..."):
        result = run(model=model, flow=flow, flow_params=flow_params, batch=batch, context=context,
                     steps=steps, trace_path=trace, **options)
    run_dir = records.new_run_dir(out, "profile", flow, model)
    result["run_dir"] = str(run_dir)
    records.write_json(run_dir / "results.json", result)
    records.write_json(run_dir / "env.json", records.env_info(result["device"]))
    plot(result, run_dir / "profile.png")
    if json_out:
        emit_json(result)
        err.print(table(result))
    else:
        from rich.console import Console

        Console(highlight=False).print(table(result))
    err.print(f"[dim]{run_dir}/: results.json, env.json, profile.png" + (f"; trace: {trace}" if trace else "") + "[/]")


def table(result: dict):
    """The rich table: category, ms, % of the summed time, the largest ops/kernels in it."""
    from rich.table import Table

    from sparsetune.perf.step_profile import LABELS

    r = result
    params = ", ".join(f"{k}={v}" for k, v in r["flow_params"].items())
    t = Table(
        title=f"{r['model']} / {r['flow']}: one decode step, batch {r['batch']}, context {r['context']}, "
              f"{r['device']} {r['dtype']} ({r['timing']})",
        caption=_caption(r) + (f"\nflow params: {params}" if params else ""),
        title_justify="left", caption_justify="left",
    )
    t.add_column("category")
    t.add_column("ms", justify="right")
    t.add_column("% of step", justify="right")
    t.add_column("largest ops / kernels")
    for cat, v in r["categories"].items():
        label = LABELS.get(cat, cat)
        if len(v.get("parts", {})) > 1:
            label += " (" + ", ".join(f"{p} {ms:.3g}" for p, ms in v["parts"].items()) + ")"
        top = ", ".join(_short(name) for name in list(v["top"])[:2])
        t.add_row(label, f"{v['ms']:.3f}", f"{v['percent']:.1f}", top)
    t.add_section()
    t.add_row("sum", f"{r['sum_ms']:.3f}", "100.0", "")
    return t


def _caption(r: dict) -> str:
    graphs = " (CUDA graphs)" if r["cuda_graphs"] else ""
    lines = [f"step wall time {r['step_ms']:.3f} ms{graphs}, median of {r['steps']}"]
    if r["cuda_graphs"]:
        lines.append(f"eager step {r['eager_step_ms']:.3f} ms; the categories sum kernel time of one eager step")
    lines.append(f"profiled step {r['profiled_step_ms']:.3f} ms wall (profiler overhead included)")
    if r["paths"]:
        lines.append("flow stages: " + "; ".join(f"{k}: {v}" for k, v in r["paths"].items()))
    return "\n".join(lines)


def _short(name: str, width: int = 36) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"
