"""Options and feedback shared by the commands: CPU threads and progress."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import typer

from sparsetune.cli.output import err
from sparsetune.errors import SparsetuneError

THREADS_HELP = ("CPU threads for torch (default: OMP_NUM_THREADS, else torch's choice: every core). On a busy "
                "machine fewer threads can be much faster.")


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
