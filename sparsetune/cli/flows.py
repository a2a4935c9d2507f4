"""`sparsetune flows list | show | check | new | promote | calibrate`."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.table import Table

from sparsetune.cli.options import apply_threads, threads_option
from sparsetune.cli.output import emit_json, err

app = typer.Typer(help="List, show, check, create and calibrate flows.", no_args_is_help=True, add_completion=False,
                  rich_markup_mode=None)

TEMPLATE = '''"""{title}: one line on the rule this flow implements, and where it comes from.

Cache stage: what is kept per KV block. Indexer: how blocks are scored each decode step.
Check it with `sparsetune flows check {file}`; run it with `--flow {file}`.
"""

from sparsetune.flow import DecodeFlow, Param
from sparsetune.flow import ops as F


class {cls}(DecodeFlow):
    name = "{name}"
    source = "cite the paper or code"
    # Hyperparameters are typed, with defaults and search ranges. Inherited: block_size, budget,
    # budget_ratio, sink_blocks, local_blocks, dense_layers.
    temperature = Param(1.0, low=0.01, high=10.0, log=True, doc="softmax temperature over blocks")

    def cache(self, k, v):
        # k, v: one block of one KV head, [1, block_size, head_dim]. Each field: [1, r, c].
        return {{"centroid": F.mean(k, dim=1)}}

    def index(self, q, fields):
        # q: the KV head's query group, [1, group, head_dim]; fields: [S, r, c] over the S blocks.
        s = F.gemm(fields["centroid"], q)  # [S, 1, group]
        s = F.softmax(s, dim=0, scale=1.0 / self.temperature)  # over blocks
        return F.topk(F.max(s, dim=2))  # score [S, 1, 1]; the budget decides k
'''


@app.command("list")
def list_(json_out: bool = typer.Option(False, "--json")) -> None:
    """Built-in flows."""
    from sparsetune.loader import builtin_flows, flow_kind, load_file

    rows = []
    for name, path in builtin_flows().items():
        cls = load_file(path)
        rows.append({"name": cls.name, "kind": flow_kind(cls), "source": cls.source, "path": str(path),
                     "params": {k: v.describe() for k, v in cls.param_specs().items() if k not in cls.inapplicable}})
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
    from sparsetune.flow.params import Flow
    from sparsetune.loader import flow_kind, get_flow_class

    cls = get_flow_class(name, Flow)
    params = {k: {"describe": v.describe(), "doc": v.doc} for k, v in cls.param_specs().items()}
    source = Path(cls.path).read_text(errors="replace")  # the file as it is; an untrusted one was only traced
    if json_out:
        emit_json({"name": cls.name, "kind": flow_kind(cls), "source": cls.source, "params": params, "code": source})
        return
    from rich.console import Console
    from rich.syntax import Syntax

    out = Console()
    table = Table(title=f"{cls.name} — {cls.source}")
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
    from sparsetune.flow.check import check_flow
    from sparsetune.flow.params import Flow, parse_param_args
    from sparsetune.loader import flow_kind, get_flow_class

    cls = get_flow_class(file, Flow, all_problems=True)
    if flow_kind(cls) == "reuse":  # plain Python over the executor's inputs: its params are what can be checked
        flow = cls.from_strings(parse_param_args(param))
        if json_out:
            emit_json({"name": cls.name, "kind": "reuse", "ok": True, "params": flow.params()})
            return
        err.print(f"[green]ok[/] {cls.name}: reuse flow, parameters {flow.params()}; run it with "
                  f"sparsetune eval --task rag --reuse {file}")
        return
    report = check_flow(cls, parse_param_args(param))
    if json_out:
        emit_json(report.to_dict())
        return
    err.print(f"[green]ok[/] {report.name}: fields {report.fields or '-'}; "
              f"{report.field_bytes_per_block} B cached per block per KV head (bf16); indexer "
              f"{report.indexer_flops_per_block} FLOPs per block per KV head per step; "
              f"full budget vs dense rel. err {report.full_budget_rel_err if report.full_budget_rel_err is not None else '-'}")
    if report.compiled:
        err.print("compiled executor (GPU): " + "; ".join(f"{s}: {p}" for s, p in report.compiled.items()))


@app.command()
def new(
    name: str,
    out: Path = typer.Option(None, "--out", help="Where to write (default ./NAME.py)."),
) -> None:
    """Write a commented starting file for a new flow."""
    from sparsetune.errors import SparsetuneError
    from sparsetune.records import new_file

    if not name.isidentifier():
        raise SparsetuneError(f"flow name {name!r} must be a Python identifier (letters, digits, _)")
    path = new_file(out or Path(f"{name}.py"))
    cls = "".join(p.capitalize() for p in name.split("_")) or "MyFlow"
    try:
        path.write_text(TEMPLATE.format(title=name.replace("_", " ").capitalize(), name=name, cls=cls, file=path))
    except OSError as e:
        raise SparsetuneError(f"cannot write {path}: {e.strerror}; pass --out in a writable folder") from None
    err.print(f"wrote {path}; next: sparsetune flows check {path}")
    sys.stdout.write(str(path) + "\n")


@app.command()
def promote(
    candidate: Path = typer.Argument(..., help="A candidate of a search: runs/<study>/candidates/<id>."),
    out: Path = typer.Option(None, "--out", help="Where to write (default ./<its name>.py)."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Copy a flow an agent wrote (one that passed the harness) into your flows, with its origin and figures."""
    from sparsetune import api

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
    import json

    apply_threads(threads)
    from sparsetune.calibration.channels import calibrate as run

    content = _read_text(text)
    with err.status(f"loading {model} and calibrating ..."):
        path = run(model=model, text=content, tokens=tokens, random_weights=random_weights, device=device, out=out)
    data = json.loads(path.read_text())
    if json_out:
        emit_json({"path": str(path), "model": data["model"], "tokens": data["tokens"], "num_layers": data["num_layers"]})
        return
    use = "--flow double_sparse reads it" if out is None else f"use it with --param calibration={path}"
    err.print(f"[dim]{data['model']}: {data['tokens']} tokens, {data['num_layers']} layers x "
              f"{data['num_kv_heads']} KV heads; {use}[/]")
    sys.stdout.write(str(path) + "\n")


def _read_text(text: Path | None) -> str | None:
    """A --text file's content (None: the built-in text)."""
    from sparsetune.errors import SparsetuneError

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
    import json

    apply_threads(threads)
    from sparsetune.calibration.heads import profile_heads as run
    from sparsetune.reuse.head_classes import global_heads

    content = _read_text(text)
    with err.status(f"loading {model} and profiling heads ..."):
        path = run(model=model, text=content, chunks=chunks, chunk_tokens=chunk_tokens, sink=sink, window=window,
                   random_weights=random_weights, device=device, out=out)
    data = json.loads(path.read_text())
    import torch

    glob = global_heads(torch.tensor(data["scores"]), 0.15)
    summary = {"path": str(path), "model": data["model"], "num_layers": data["num_layers"],
               "num_kv_heads": data["num_kv_heads"], "chunks": data["chunks"], "chunk_tokens": data["chunk_tokens"],
               "global_layers_at_15pct": sorted({int(i) for i in glob.nonzero()[:, 0]})}
    if json_out:
        emit_json(summary)
        return
    use = "--reuse redknot reads it" if out is None else f"use it with --reuse-param head_classes={path}"
    err.print(f"[dim]{data['model']}: {data['chunks']} chunks of {data['chunk_tokens']} tokens, {data['num_layers']} layers x "
              f"{data['num_kv_heads']} KV heads; at 15% global, the global heads sit in layers "
              f"{summary['global_layers_at_15pct']}; {use}[/]")
    sys.stdout.write(str(path) + "\n")
