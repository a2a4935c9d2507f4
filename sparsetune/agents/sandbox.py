"""Run code an agent wrote in a subprocess with limits, never in this process.

`run_limited` starts a command in its own session (process group) with a clean environment (no
API keys or tokens), OS limits set in the child before it runs anything (CPU seconds, file size, no
core files), an address-space cap a CPU-only child sets on itself once its imports are done and
before any candidate code runs (`cap_address_space`), and a watchdog in this process that kills the
whole group (SIGKILL) when the wall clock or the group's resident memory passes its limit. What
the child printed goes to a log file; what it returns is one JSON file it writes.

`python -m sparsetune.agents.sandbox check FILE OUT` is the child of harness step 2: it loads a
candidate flow file (the static source check runs again, in the child, before any of it executes)
and runs `flows check` semantics on it (`flow.check.check_flow`: shapes, field bytes, indexer
work, the compiled paths, equality with dense at full budget), then writes the report and the
flow's params (`search.space.spec_dicts`: what the search needs of it) or the reason it failed to OUT.

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# Environment variables a child never sees: credentials of any kind.
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL|AUTH", re.IGNORECASE)
POLL_S = 0.05
_AS_ENV = "SPARSETUNE_SANDBOX_AS_MB"  # set for a CPU-only child: the address space it may add after its imports


@dataclass(frozen=True)
class Limits:
    """What a sandboxed child may use. `memory_mb`: resident memory of its process group (the
    watchdog), and on a CPU-only child also the address space it may add after its imports
    (`cap_address_space`; CUDA cannot run under `RLIMIT_AS`). `cpu_s`: CPU seconds (`RLIMIT_CPU`); None: only the wall clock bounds it."""

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


def clean_env(limits: Limits) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _SECRET.search(k)}
    env["PYTHONUNBUFFERED"] = "1"
    if limits.cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env[_AS_ENV] = str(limits.memory_mb)
        # glibc reserves 64 MB of address space per malloc arena, up to 8 per core: on a many-core host
        # the threads of torch alone would pass RLIMIT_AS ("cannot allocate memory for thread-local data")
        env["MALLOC_ARENA_MAX"] = "2"
    return env


def cap_address_space() -> None:
    """In a CPU-only child, once its imports are done: cap its address space (`RLIMIT_AS`, soft and
    hard, so it cannot be raised again) at what it maps now plus its `memory_mb`. Set before the
    imports instead, the cap would have to guess what torch maps: a CUDA build of torch maps
    several GB of libraries even with no GPU visible, and a fixed cap set from a CPU build failed
    one check in 38 on a GPU host ("cannot allocate memory for thread-local data")."""
    extra_mb = os.environ.get(_AS_ENV)
    if not extra_mb:
        return
    import resource

    with open("/proc/self/status") as f:
        mapped_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    cap = (mapped_kb << 10) + (int(extra_mb) << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _set_limits(limits: Limits):
    def apply() -> None:  # in the child, between fork and exec
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb << 20,) * 2)
        if limits.cpu_s is not None:
            resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 5))

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


def memory_breach(pgid: int, limit_mb: float) -> tuple[float, str | None]:
    """A process group's resident memory, and why it is over `limit_mb` (None: it is not)."""
    rss = group_rss_mb(pgid)
    return rss, f"over its memory limit of {limit_mb} MB ({rss:.0f} MB resident)" if rss > limit_mb else None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_limited(cmd: list[str], limits: Limits, log: Path, result: Path, cwd: Path | None = None) -> Outcome:
    """Run `cmd` under `limits` (module docstring); it returns by writing JSON to `result`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    t0 = time.monotonic()
    killed, peak = None, 0.0
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                env=clean_env(limits), start_new_session=True,
                                preexec_fn=_set_limits(limits))
        try:
            while proc.poll() is None:
                elapsed = time.monotonic() - t0
                rss, over = memory_breach(proc.pid, limits.memory_mb)
                peak = max(peak, rss)
                killed = f"over its wall-clock limit of {limits.wall_s:g} s" if elapsed > limits.wall_s else over
                if killed:
                    break
                time.sleep(POLL_S)
        finally:  # killed, or this process interrupted: nothing of the group outlives it
            if proc.poll() is None or killed:
                _kill_group(proc)
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


# ---- a long-lived sandboxed evaluator ---------------------------------------------------------------

class SandboxError(RuntimeError):
    """The sandboxed evaluator was killed (a limit) or died; the request it was serving failed."""


class SandboxEvaluator:
    """The search's evaluator in a sandboxed child (`python -m sparsetune.agents.sandbox serve`):
    its engines, and every trial and accuracy run of any flow, live there, so a candidate's stages
    never run in this process. Requests go over the child's stdin, answers come back on a pipe of
    their own (one JSON line each). A request past its time limit (`limits.wall_s` for the first,
    which loads the engines; then `REQUEST_FACTOR` times the slowest so far, at least
    `MIN_REQUEST_S`), or a child past its memory limit, is killed with its whole process group;
    the request raises `SandboxError` and the next one starts a fresh child."""

    REQUEST_FACTOR, MIN_REQUEST_S = 5.0, 300.0

    def __init__(self, cfg, folder: Path, limits: Limits) -> None:
        self.cfg, self.folder, self.limits = cfg, Path(folder), limits
        self._proc: subprocess.Popen | None = None
        self._answers = None
        self._killed: str | None = None
        self.slowest: float | None = None
        self.starts = 0

    # the search's evaluator interface (`search.trial.EngineEvaluator`), through the child
    def run_trial(self, cfg, _evaluator, flow: str, params: dict[str, str], out: Path) -> dict[str, Any]:
        return self.request({"op": "trial", "flow": flow, "params": params, "out": str(out)})["record"]

    def accuracy(self, flow: str | None, params: dict[str, str], *, samples: int, seed: int, out: Path, on_chunk=None):
        from sparsetune.search.trial import accuracy_from_dict

        ans = self.request({"op": "accuracy", "flow": flow, "params": params, "samples": samples, "seed": seed,
                            "out": str(out)})
        return accuracy_from_dict(ans["accuracy"])

    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        import queue

        if self._proc is None or self._proc.poll() is not None:
            self._start()
        limit = self.limits.wall_s if self.slowest is None else max(self.MIN_REQUEST_S, self.REQUEST_FACTOR * self.slowest)
        t0 = time.monotonic()
        try:
            self._proc.stdin.write((json.dumps(msg) + "\n").encode())
            self._proc.stdin.flush()
            ans = self._answers.get(timeout=limit)
        except queue.Empty:
            self.close(f"over its time limit of {limit:.0f} s for one request")
            raise SandboxError(f"killed by the harness: {msg['op']} of {msg.get('flow')} took over {limit:.0f} s") from None
        except (BrokenPipeError, OSError):
            ans = None
        if ans is None:  # the child is gone: killed by the watchdog, or died
            why = self._killed or f"the sandbox exited with code {self._proc.wait()}"
            self.close()
            raise SandboxError(f"killed by the harness: {why}" if self._killed else why)
        self.slowest = max(self.slowest or 0.0, time.monotonic() - t0)
        if not ans.get("ok"):
            raise SandboxError(ans.get("error", "the sandbox failed"))
        return ans

    def _start(self) -> None:
        import queue
        import threading

        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "sandbox-config.json"
        config.write_text(self.cfg.model_dump_json())
        read_fd, write_fd = os.pipe()
        serving = replace(self.limits, cpu_s=None)  # CPU seconds add up over a child's requests: time them one by one
        env = {**clean_env(serving), "SPARSETUNE_SANDBOX_FD": str(write_fd)}
        self.starts += 1
        log = open(self.folder / f"sandbox-{self.starts}.log", "wb")
        self._proc = subprocess.Popen(python_cmd("serve", str(config)), stdin=subprocess.PIPE, stdout=log,
                                      stderr=subprocess.STDOUT, env=env, pass_fds=(write_fd,), start_new_session=True,
                                      preexec_fn=_set_limits(serving))
        log.close()
        os.close(write_fd)
        self._killed = None
        answers: queue.Queue = queue.Queue()
        self._answers = answers
        proc = self._proc

        def read() -> None:
            with os.fdopen(read_fd, "rb") as f:
                for line in f:
                    try:
                        answers.put(json.loads(line))
                    except ValueError:
                        answers.put({"ok": False, "error": "the sandbox answered garbage"})
            answers.put(None)  # the child closed its end: gone

        def watch() -> None:
            while proc.poll() is None:
                _rss, over = memory_breach(proc.pid, self.limits.memory_mb)
                if over:
                    self._killed = over
                    _kill_group(proc)
                    return
                time.sleep(0.2)

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=watch, daemon=True).start()

    def close(self, why: str | None = None) -> None:
        if self._proc is not None:
            self._killed = self._killed or why
            _kill_group(self._proc)
            self._proc.wait()
            self._proc = None


# ---- the child --------------------------------------------------------------------------------------

def _check(path: str) -> dict[str, Any]:
    from sparsetune.errors import SparsetuneError
    from sparsetune.flow.check import check_flow
    from sparsetune.registry import flow_kind, load_file
    from sparsetune.search.space import spec_dicts

    cap_address_space()
    try:
        cls = load_file(Path(path), all_problems=True)
        if flow_kind(cls) != "decode":
            return {"ok": False, "reason": "a reuse flow: the agent writes decode flows"}
        report = check_flow(cls)
        spec = spec_dicts(cls)
    except SparsetuneError as e:
        return {"ok": False, "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - anything a candidate raises is its verdict
        return {"ok": False, "reason": f"{type(e).__name__}: {e}"[:1000]}
    return {"ok": True, "report": report.to_dict(), "spec": spec}


def _serve(config: str) -> int:
    """Answer the parent's requests (`SandboxEvaluator`) until its end of stdin closes."""
    from sparsetune.search.config import SearchConfig
    from sparsetune.search.study import run_trial
    from sparsetune.search.trial import EngineEvaluator

    cfg = SearchConfig.model_validate_json(Path(config).read_text())
    evaluator = EngineEvaluator(cfg)
    cap_address_space()
    with os.fdopen(int(os.environ["SPARSETUNE_SANDBOX_FD"]), "w") as answers:
        for line in sys.stdin:
            msg = json.loads(line)
            try:
                if msg["op"] == "trial":
                    ans = {"record": run_trial(cfg, evaluator, msg["flow"], msg["params"], Path(msg["out"]))}
                elif msg["op"] == "accuracy":
                    acc = evaluator.accuracy(msg["flow"], msg["params"], samples=msg["samples"], seed=msg["seed"],
                                             out=Path(msg["out"]))
                    ans = {"accuracy": acc.to_dict()}
                else:
                    raise ValueError(f"unknown request {msg['op']!r}")
                ans["ok"] = True
            except Exception as e:  # noqa: BLE001 - the request failed; the parent records why
                ans = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1000]}
            answers.write(json.dumps(ans, default=str) + "\n")
            answers.flush()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "check":
        Path(argv[2]).write_text(json.dumps(_check(argv[1]), default=str))
        return 0
    if len(argv) == 2 and argv[0] == "serve":
        return _serve(argv[1])
    print("usage: python -m sparsetune.agents.sandbox check FLOW_FILE OUT_JSON | serve CONFIG_JSON", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
