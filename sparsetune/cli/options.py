"""Options and feedback shared by the commands: the setup options (declared here once, turned into the
API's keyword options by `setup_options`), output options, CPU threads and progress.

A command declares an option by calling its function here (`model: str = model_option()`); where its
help says something of its own, it passes `help=`.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import typer

from sparsetune.cli.output import err, parse_size
from sparsetune.errors import SparsetuneError
from sparsetune.api import DEFAULT_RUNS_DIR

THREADS_HELP = ("CPU threads for torch (default: OMP_NUM_THREADS, else torch's choice: every core). On a busy "
                "machine fewer threads can be much faster.")
FLOW_HELP = "Decode flow: a built-in name (sparsetune flows list) or a .py file."


# ---- the engine options ---------------------------------------------------------------------------

def model_option():
    return typer.Option("smollm2-135m", "--model", "-m", help="Registered name or a local HF-format directory.")


def flow_option(default: str | None = None, help: str = FLOW_HELP):
    return typer.Option(default, "--flow", "-f", help=help)


def param_option(help: str = "Flow hyperparameter key=value (repeatable)."):
    return typer.Option(None, "--param", help=help)


def reuse_option(help: str):
    return typer.Option(None, "--reuse", help=help)


def reuse_param_option():
    return typer.Option(None, "--reuse-param", help="Reuse-flow hyperparameter key=value (repeatable).")


def device_option():
    return typer.Option("auto", help="auto, cpu, cuda or cuda:N.")


def dtype_option(help: str = "auto, float32, float16 or bfloat16."):
    return typer.Option("auto", help=help)


def random_weights_option(help: str = "Seeded random weights (speed-only)."):
    return typer.Option(False, "--random-weights", help=help)


def kv_memory_option(help: str):
    return typer.Option(None, "--kv-memory", help=help)


def flow_executor_option():
    return typer.Option(None, "--flow-executor", help="reference or compiled (default: compiled on GPU).")


def defaults_option():
    return typer.Option("tuned", "--defaults", help="tuned: the model's tuned flow defaults where it has them "
                        "(search --save-defaults, or shipped), under --param; published: the flow's own.")


def no_cuda_graph_option():
    return typer.Option(False, "--no-cuda-graph", help="Run decode eagerly on GPU.")


def prefix_caching_option():
    return typer.Option(False, "--prefix-caching", help="Share computed KV blocks of common prompt prefixes between "
                        "requests (stored segments of the default namespace are prefixes too).")


def seed_option(help: str):
    return typer.Option(0, help=help)


def engine_options(model: str, *, device: str = "auto", dtype: str = "auto", random_weights: bool = False,
                   kv_memory: str | None = None, no_cuda_graph: bool = False, seed: int = 0, **fields: Any) -> dict[str, Any]:
    """The engine options a command was given, as the API's keyword options (the size parsed, "auto"
    as None); `fields`: other `EngineConfig` fields the command sets. Alone for a command whose flows
    come another way (bench serve's --flow list)."""
    return dict(model=model, device=None if device == "auto" else device, dtype=None if dtype == "auto" else dtype,
                random_weights=random_weights, kv_memory=parse_size(kv_memory, "--kv-memory"),
                cuda_graph=not no_cuda_graph, seed=seed, **fields)


def setup_options(model: str, *, flow: str | None = None, param: list[str] | None = None, reuse: str | None = None,
                  reuse_param: list[str] | None = None, flow_executor: str | None = None, defaults: str = "tuned",
                  **engine: Any) -> dict[str, Any]:
    """The setup options a command was given: `engine_options` and the flows (key=value lists parsed),
    as the API's keyword options, which it resolves into one `Setup` (`setup.resolve_options`)."""
    from sparsetune.api import parse_params

    return dict(engine_options(model, **engine), flow=flow, params=parse_params(param), reuse=reuse,
                reuse_params=parse_params(reuse_param), executor=flow_executor, defaults=defaults)


# ---- output and CPU -------------------------------------------------------------------------------

def json_option(help: str):
    return typer.Option(False, "--json", help=help)


def out_option(help: str, *aliases: str):
    return typer.Option(DEFAULT_RUNS_DIR, "--out", *aliases, help=help)


def check_writable(path: Path, flag: str, *, folder: bool = True) -> None:
    """Refuse a `flag` path where nothing can be written, before any work: the folder a run folder is
    made in (`folder`; it and its parents are made when missing) or a file (made or overwritten).
    A file in the way, or a folder that takes no new entries (read-only, no permission), would
    otherwise fail only after the model ran."""
    target = Path(path).expanduser().absolute()
    if target.exists():
        if target.is_dir() != folder:
            raise SparsetuneError(f"{flag} {path}: {'a file' if folder else 'a folder'} is there; pick another {flag}")
        where, mode = target, os.W_OK | (os.X_OK if folder else 0)
    else:
        where, mode = target.parent, os.W_OK | os.X_OK
        while not where.exists():
            where = where.parent
        if not where.is_dir():
            raise SparsetuneError(f"{flag} {path}: {where} is a file, not a folder; pick another {flag}")
    if not os.access(where, mode):  # access(2) also answers for read-only file systems and immutable files
        raise SparsetuneError(f"{flag} {path}: {where} is not writable; pick another {flag}")


def threads_option():
    return typer.Option(None, "--threads", help=THREADS_HELP)


def apply_threads(threads: int | None) -> None:
    """Set torch's CPU thread count: `--threads`, else `OMP_NUM_THREADS` (which torch reads itself)."""
    if threads is None:
        return
    if threads < 1:
        raise SparsetuneError(f"--threads must be at least 1 (got {threads})")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # torch reads it when it is imported
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def _phase(what: str, unit: str) -> str:
    return f" ({what})" if what != unit else ""


@contextmanager
def progress(description: str, unit: str, plain_every: float = 30.0) -> Iterator[Callable[[float, int, str], None]]:
    """`update(done, total, what)`: a bar with an ETA on a terminal; otherwise (CI logs, nohup) a
    plain line at most every `plain_every` seconds and at the end. `done` may be fractional."""
    if err.is_terminal:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn(unit), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task(description, total=None)

            def update(done: float, total: int, what: str) -> None:
                bar.update(task, completed=done, total=total or None, description=description + _phase(what, unit))

            yield update
        return
    t0 = time.monotonic()
    state = {"last": -plain_every, "first": None}

    def update(done: float, total: int, what: str) -> None:
        now = time.monotonic() - t0
        if not total:  # nothing counted yet: say what is happening
            err.print(f"{description}: {what}", highlight=False)
            return
        if state["first"] is None:
            state["first"] = (now, done)  # resumed work is not counted in the rate
        if now - state["last"] < plain_every and done < total:
            return
        state["last"] = now
        t_first, d_first = state["first"]
        rate = (done - d_first) / (now - t_first) if now > t_first and done > d_first else None
        eta = f", ETA {_clock((total - done) / rate)}" if rate and done < total else ""
        err.print(f"{description}: {int(done)}/{total} {unit}{_phase(what, unit)}, {_clock(now)} elapsed{eta}",
                  highlight=False)

    yield update
