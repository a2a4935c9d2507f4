"""Where output goes: results to stdout, humans' text to stderr (always, when --json is on)."""

from __future__ import annotations

import json
import re
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console

from sparsetune.errors import SparsetuneError

if TYPE_CHECKING:
    from rich.table import Table

err = Console(stderr=True, highlight=False, soft_wrap=True)  # log lines are not cut at 80 columns
out = Console(highlight=False, soft_wrap=True)  # a command's report, when stdout carries no JSON


def print_table(console: Console, table: Table) -> None:
    """In a terminal a table fits the window; in a log or a pipe, where rich would assume 80 columns
    and wrap the cells into slivers, it keeps its natural width: a row per line (nothing crops it)."""
    from rich.measure import Measurement

    if not console.is_terminal:
        table.width = Measurement.get(console, console.options.update_width(1 << 16), table).maximum
    console.print(table, crop=False, soft_wrap=False)  # soft wrap would not center the title


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str | None, flag: str) -> int | None:
    """'4GiB', '512MB', '1e9'-free plain byte counts → bytes."""
    if text is None:
        return None
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise SparsetuneError(f"{flag} {text!r} is not a size; write e.g. 4GiB, 512MB or a byte count")
    return int(float(m.group(1)) * _UNITS[unit])
