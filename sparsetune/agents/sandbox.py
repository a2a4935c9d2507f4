"""Run code an agent wrote in a subprocess with limits, never in this process.

`run_limited` starts a command in its own session (process group) with a clean environment (no
API keys or tokens), OS limits set in the child before it runs anything (address space on CPU-only
children, CPU seconds, file size, no core files), and a watchdog in this process that kills the
whole group (SIGKILL) when the wall clock or the group's resident memory passes its limit. What
the child printed goes to a log file; what it returns is one JSON file it writes.

`python -m sparsetune.agents.sandbox check FILE OUT` is the child of harness step 2: it loads a
candidate flow file (the static source check runs again, in the child, before any of it executes)
and runs `flows check` semantics on it (`flow.check.check_flow`: shapes, field bytes, indexer
work, the compiled paths, equality with dense at full budget), then writes the report or the
reason it failed to OUT.

This is a fence against honest mistakes and runaway programs (hangs, unbounded allocation), not
against a determined attacker: there is no network or file-system isolation beyond what the
static check refuses (no imports but the flow API, no I/O names, no dunders).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Environment variables a child never sees: credentials of any kind.
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL|AUTH", re.IGNORECASE)
POLL_S = 0.05


@dataclass(frozen=True)
class Limits:
    """What a sandboxed child may use. `memory_mb`: resident memory of its process group (the
    watchdog), and on a CPU-only child also its address space (`RLIMIT_AS`, which CUDA cannot run
    under). `cpu_s`: CPU seconds (`RLIMIT_CPU`); None: only the wall clock bounds it."""

    wall_s: float = 120.0
    memory_mb: int = 4096
    cpu_s: int | None = None
    file_mb: int = 256
    cpu_only: bool = True


@dataclass
class Outcome:
    """How a sandboxed child ended: its exit code, why the watchdog killed it (None: it was not),
    its wall time and peak resident memory, and the JSON it returned (None: it wrote none)."""

    returncode: int | None
    killed: str | None
    seconds: float
    peak_mb: float
    result: dict[str, Any] | None
    log: str

    def reason(self) -> str | None:
        """One line on why the child gave no result: killed, crashed, or silent; None if it returned."""
        if self.killed:
            return f"killed by the harness: {self.killed}"
        if self.result is not None:
            return None
        tail = [line for line in _tail(self.log).splitlines() if line.strip()]
        return f"the sandbox exited with code {self.returncode}" + (f": {tail[-1][:300]}" if tail else "")


def clean_env(cpu_only: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _SECRET.search(k)}
    env["PYTHONUNBUFFERED"] = "1"
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _set_limits(limits: Limits):
    def apply() -> None:  # in the child, between fork and exec
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb << 20,) * 2)
        if limits.cpu_s is not None:
            resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 5))
        if limits.cpu_only:  # torch on CPU maps ~0.7 GB at import; CUDA maps far more and cannot run under it
            resource.setrlimit(resource.RLIMIT_AS, ((limits.memory_mb + 1024) << 20,) * 2)

    return apply


def group_rss_mb(pgid: int) -> float:
    """Resident memory of every process in a process group (from /proc), MB."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:  # field 5: process group
                continue
            with open(f"/proc/{entry.name}/statm") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_limited(cmd: list[str], limits: Limits, log: Path, result: Path, cwd: Path | None = None) -> Outcome:
    """Run `cmd` under `limits` (module docstring); it returns by writing JSON to `result`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    t0 = time.monotonic()
    killed, peak = None, 0.0
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                env=clean_env(limits.cpu_only), start_new_session=True,
                                preexec_fn=_set_limits(limits))
        try:
            while proc.poll() is None:
                elapsed = time.monotonic() - t0
                rss = group_rss_mb(proc.pid)
                peak = max(peak, rss)
                if elapsed > limits.wall_s:
                    killed = f"over its wall-clock limit of {limits.wall_s:g} s"
                elif rss > limits.memory_mb:
                    killed = f"over its memory limit of {limits.memory_mb} MB ({rss:.0f} MB resident)"
                if killed:
                    break
                time.sleep(POLL_S)
        finally:  # killed, or this process interrupted: nothing of the group outlives it
            if proc.poll() is None or killed:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
    data = None
    if not killed and result.is_file():
        try:
            data = json.loads(result.read_text())
        except (OSError, ValueError):
            data = None
    return Outcome(proc.returncode, killed, round(time.monotonic() - t0, 3), round(peak, 1), data, str(log))


def _tail(path: str, size: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def python_cmd(*args: str) -> list[str]:
    """This interpreter running this module (`python -m sparsetune.agents.sandbox ARGS`)."""
    return [sys.executable, "-m", "sparsetune.agents.sandbox", *args]


# ---- the child --------------------------------------------------------------------------------------

def _check(path: str) -> dict[str, Any]:
    from sparsetune.errors import SparsetuneError
    from sparsetune.flow.check import check_flow
    from sparsetune.registry import flow_kind, load_file

    try:
        cls = load_file(Path(path), all_problems=True)
        if flow_kind(cls) != "decode":
            return {"ok": False, "reason": "a reuse flow: the agent writes decode flows"}
        report = check_flow(cls)
    except SparsetuneError as e:
        return {"ok": False, "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - anything a candidate raises is its verdict
        return {"ok": False, "reason": f"{type(e).__name__}: {e}"[:1000]}
    return {"ok": True, "report": report.to_dict()}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "check":
        print("usage: python -m sparsetune.agents.sandbox check FLOW_FILE OUT_JSON", file=sys.stderr)
        return 2
    out = _check(argv[1])
    Path(argv[2]).write_text(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
