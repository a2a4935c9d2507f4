"""`sparsetune flows list | show | check | new | promote | calibrate | profile-heads`: each parses its
options, calls its `sparsetune.api` function and prints."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.table import Table

from sparsetune import api
from sparsetune.cli.options import apply_threads, threads_option
from sparsetune.cli.output import emit_json, err
from sparsetune.errors import SparsetuneError

app = typer.Typer(help="List, show, check, create and calibrate flows.", no_args_is_help=True, add_completion=False,
                  rich_markup_mode=None)

@app.command("list")
def list_(json_out: bool = typer.Option(False, "--json")) -> None:
    """Built-in flows."""
    rows = api.flows_list()
    if json_out:
        emit_json(rows)
        return
    from rich.console import Console

    table = Table(title="built-in flows")
    for c in ("name", "kind", "source", "parameters"):
        table.add_column(c)
    for r in rows:
        table.add_row(r["name"], r["kind"], r["source"], ", ".join(r["params"]))
    Console().print(table)


@app.command()
def show(name: str, json_out: bool = typer.Option(False, "--json")) -> None:
    """A flow's parameters (type, default, search space) and source."""
    shown = api.flow_show(name)
    params, source = shown["params"], shown["code"]
    if json_out:
        emit_json(shown)
        return
    from rich.console import Console
    from rich.syntax import Syntax

    out = Console()
    table = Table(title=f"{shown['name']} — {shown['source']}")
    table.add_column("parameter")
    table.add_column("type = default [space]")
    table.add_column("meaning")
    for k, v in params.items():
        table.add_row(k, v["describe"], v["doc"])
    if not out.is_terminal:  # a pipe or a file gets the source as it is, uncut; the table goes to stderr
        err.print(table)
        sys.stdout.write(source)
        return
    out.print(table)
    out.print(Syntax(source, "python", word_wrap=True))


@app.command()
def check(
    file: str = typer.Argument(..., help="A flow file (or a built-in name)."),
    param: list[str] = typer.Option(None, "--param", help="key=value (repeatable)."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Validate a flow: op set, declared params, shapes, cost, and equality with dense at full budget."""
    report = api.flow_check(file, api.parse_params(param))
    if json_out:
        emit_json(report)
        return
    if report["kind"] == "reuse":  # plain Python over the executor's inputs: its params are what can be checked
        err.print(f"[green]ok[/] {report['name']}: reuse flow, parameters {report['params']}; run it with "
                  f"sparsetune eval --task rag --reuse {file}")
        return
    rel = report["full_budget_rel_err"]
    err.print(f"[green]ok[/] {report['name']}: fields {report['fields'] or '-'}; "
              f"{report['field_bytes_per_block']} B cached per selection unit per KV head (beside a bf16 pool); indexer "
              f"{report['indexer_flops_per_block']} FLOPs per unit per KV head per step; "
              f"full budget vs dense rel. err {rel if rel is not None else '-'}")
    page = report.get("page_level")
    if page:
        err.print(f"first level (whole blocks, {page['units_per_block']} units each; keeps coarse {page['coarse']} x the "
                  f"budget): fields {page['fields'] or '-'}; {page['field_bytes_per_block']} B cached per block per KV "
                  f"head (beside a bf16 pool); indexer {page['indexer_flops_per_block']} FLOPs per block per KV head per step")
    if report["compiled"]:
        err.print("compiled executor (GPU): " + "; ".join(f"{s}: {p}" for s, p in report["compiled"].items()))


@app.command()
def new(
    name: str,
    out: Path = typer.Option(None, "--out", help="Where to write (default ./NAME.py)."),
) -> None:
    """Write a commented starting file for a new flow."""
    path = api.flow_new(name, out)
    err.print(f"wrote {path}; next: sparsetune flows check {path}")
    sys.stdout.write(str(path) + "\n")


@app.command()
def promote(
    candidate: Path = typer.Argument(..., help="A candidate of a search: runs/<study>/candidates/<id>."),
    out: Path = typer.Option(None, "--out", help="Where to write (default ./<its name>.py)."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Copy a flow an agent wrote (one that passed the harness) into your flows, with its origin and figures."""
    res = api.promote_flow(candidate, out)
    if json_out:
        emit_json(res)
    err.print(f"wrote {res['file']} ({res['flow']}, candidate {res['candidate']}); run it with --flow {res['file']}")
    if not json_out:
        sys.stdout.write(res["file"] + "\n")


@app.command()
def calibrate(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Registered name or a local HF-format directory."),
    text: Path = typer.Option(None, "--text", help="A UTF-8 text file to calibrate on (default: the built-in English text)."),
    tokens: int = typer.Option(2048, "--tokens", help="Tokens of the text to run at most."),
    out: Path = typer.Option(None, "--out", help="Where to write (default: the model's file, which --param calibration=auto reads)."),
    random_weights: bool = typer.Option(False, "--random-weights", help="Seeded random weights (speed-only runs)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    threads: int = threads_option(),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Rank each layer's KV-head channels by mean|q*k| for calibrated flows (double_sparse)."""
    apply_threads(threads)
    content = _read_text(text)
    with err.status(f"loading {model} and calibrating ..."):
        data = api.calibrate_channels(model, text=content, tokens=tokens, random_weights=random_weights, device=device,
                                      out=out)
    if json_out:
        emit_json({k: data[k] for k in ("path", "model", "tokens", "num_layers")})
        return
    use = "--flow double_sparse reads it" if out is None else f"use it with --param calibration={data['path']}"
    err.print(f"[dim]{data['model']}: {data['tokens']} tokens, {data['num_layers']} layers x "
              f"{data['num_kv_heads']} KV heads; {use}[/]")
    sys.stdout.write(data["path"] + "\n")


def _read_text(text: Path | None) -> str | None:
    """A --text file's content (None: the built-in text)."""
    if text is None:
        return None
    if not text.is_file():
        raise SparsetuneError(f"--text {text}: no such file")
    try:
        return text.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SparsetuneError(f"--text {text}: not UTF-8 text") from None


@app.command("profile-heads")
def profile_heads(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Registered name or a local HF-format directory."),
    text: Path = typer.Option(None, "--text", help="A UTF-8 text file to profile on (default: the built-in English text)."),
    chunks: int = typer.Option(4, "--chunks", help="Calibration chunks (each runs alone and behind two prefixes)."),
    chunk_tokens: int = typer.Option(512, "--chunk-tokens", help="Tokens per chunk."),
    sink: int = typer.Option(4, "--sink", help="Sink tokens of the local pattern the edge mass is measured against."),
    window: int = typer.Option(512, "--window", help="Local window of that pattern."),
    out: Path = typer.Option(None, "--out", help="Where to write (default: the model's file, which --reuse redknot reads)."),
    random_weights: bool = typer.Option(False, "--random-weights", help="Seeded random weights (speed-only runs)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    threads: int = threads_option(),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Score each (layer, KV head) for RedKnot's head classes: prefix shift and mass outside sinks + window."""
    apply_threads(threads)
    content = _read_text(text)
    with err.status(f"loading {model} and profiling heads ..."):
        summary = api.profile_heads(model, text=content, chunks=chunks, chunk_tokens=chunk_tokens, sink=sink,
                                    window=window, random_weights=random_weights, device=device, out=out)
    if json_out:
        emit_json(summary)
        return
    use = "--reuse redknot reads it" if out is None else f"use it with --reuse-param head_classes={summary['path']}"
    err.print(f"[dim]{summary['model']}: {summary['chunks']} chunks of {summary['chunk_tokens']} tokens, "
              f"{summary['num_layers']} layers x {summary['num_kv_heads']} KV heads; at 15% global, the global heads "
              f"sit in layers {summary['global_layers_at_15pct']}; {use}[/]")
    sys.stdout.write(summary["path"] + "\n")
