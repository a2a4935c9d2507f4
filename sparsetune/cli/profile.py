"""`sparsetune profile`: where one decode step's time goes, by kernel category and flow stage."""

from __future__ import annotations

from pathlib import Path

import typer

from sparsetune.cli import options as opt
from sparsetune.cli.options import apply_threads
from sparsetune.cli.output import emit_json, err


def profile(
    flow: str = opt.flow_option("dense"),
    param: list[str] = opt.param_option(),
    model: str = opt.model_option(),
    batch: int = typer.Option(1, "--batch", "-b", help="Sequences decoding together."),
    context: int = typer.Option(2048, "--context", "-c", help="Prompt tokens per sequence (random ids, prefilled for real)."),
    steps: int = typer.Option(5, "--steps", help="Decode steps timed for the wall time (median)."),
    device: str = opt.device_option(),
    dtype: str = opt.dtype_option(),
    random_weights: bool = opt.random_weights_option(),
    kv_memory: str = opt.kv_memory_option(
        "KV pool size, e.g. 4GiB (default: 90% of free GPU memory; on CPU what the case needs, at most 2GiB)."),
    flow_executor: str = opt.flow_executor_option(),
    defaults: str = opt.defaults_option(),
    seed: int = opt.seed_option("Seed for the prompts and random weights."),
    trace: Path = typer.Option(None, "--trace", help="Also write the profiled step's Chrome trace (JSON) here."),
    out: Path = opt.out_option("Parent directory of the run directory."),
    threads: int = opt.threads_option(),
    json_out: bool = opt.json_option("Print results.json to stdout (the table goes to stderr)."),
) -> None:
    """Break one decode step into attention, flow stages, GEMMs, norms, sampling, ... (GPU kernel
    time; CPU time on CPU, attributed by stage)."""
    from sparsetune import api

    options = opt.setup_options(model, flow=flow, param=param, device=device, dtype=dtype, random_weights=random_weights,
                                kv_memory=kv_memory, flow_executor=flow_executor, defaults=defaults, seed=seed)
    opt.check_writable(out, "--out")
    if trace is not None:
        opt.check_writable(trace, "--trace", folder=False)
    setup = api.resolve_options(**options)  # every check before the model loads
    apply_threads(threads)
    with err.status(f"profiling {flow} on {model}: batch {batch}, context {context} ..."):
        result = api.profile(setup=setup, batch=batch, context=context, steps=steps, out=out, trace=trace)
    run_dir = result["run_dir"]
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

    from sparsetune.api import profile_labels

    r, labels = result, profile_labels()
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
        label = labels.get(cat, cat)
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
