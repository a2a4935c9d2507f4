"""Code an agent wrote runs only here: in an isolated child process (`sparsetune.sandbox`), never in this one.

The mechanism (the jail, limits, the watchdog, the clean environment, `scrub`) is
`sparsetune.sandbox`; its guarantees hold on Linux with user namespaces, and anywhere else (or where
user namespaces are disabled) nothing runs: `IsolationRefused` says why. This module has the
agent's children and the evaluator that talks to one:

`python -m sparsetune.agents.sandbox check FILE OUT` is the child of harness step 2: it loads a
candidate flow file (the static source check runs again, in the child, before any of it executes)
and runs `flows check` semantics on it (`flow.check.check_flow`: shapes, field bytes, indexer
work, the compiled paths, equality with dense at full budget), then writes the report and the
flow's params (`tuning.space.spec_dicts`: what the search needs of it) or the reason it failed to
OUT (in its scratch folder, `candidates/<id>/check/`).

`SandboxEvaluator` is the search's evaluator in a long-lived child (`... serve CONFIG`): its
engines, and every trial and accuracy run of any flow, live there. Its scratch folder is
`<folder>/scratch` (`runs/<study>/sandbox/scratch`): each request's outputs are written under it
(`scratch/out/<n>`) and copied here, after the answer, to the request's `out` (`collect`: folders
and regular files only, nothing followed), with the paths in the answer and in the copied JSON
rewritten to their new place. Its config and logs are in `<folder>`, which it cannot write.
What its evaluator reports along the way (the engines starting to take turns) comes back with the
answer and is passed on as the search's own event (`relay`: only the kinds in `RELAYED`, each
field a string of bounded length: the child runs candidates' code).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparsetune.sandbox import (  # noqa: F401 - the names this module has always had
    IsolationRefused,
    Jailed,
    Limits,
    Outcome,
    SandboxError,
    cap_address_space,
    check_isolation,
    clean_env,
    collect,
    launch,
    relocate,
    run_limited,
    scrub,
    scrub_file,
)

if TYPE_CHECKING:
    from sparsetune.tuning.protocols import ChunkFn
    from sparsetune.tuning.trial import Accuracy


def python_cmd(*args: str) -> list[str]:
    """This interpreter running this module (`python -m sparsetune.agents.sandbox ARGS`)."""
    return [sys.executable, "-m", "sparsetune.agents.sandbox", *args]


# ---- a long-lived sandboxed evaluator ---------------------------------------------------------------

def model_env() -> dict[str, str]:
    """Where the child reads models from: this process's models folder and Hugging Face cache (the
    child's HOME is in its scratch folder, so the defaults under ~ would point there)."""
    from sparsetune.models.registry import hf_cache_dirs, models_dir

    env = {"SPARSETUNE_MODELS": str(models_dir().absolute())}
    if "HF_HUB_CACHE" not in os.environ:
        hub = next((d for d in hf_cache_dirs() if d.is_dir()), None)
        if hub is not None:
            env["HF_HUB_CACHE"] = str(hub.absolute())
    return env


def prepare_models(cfg) -> None:
    """The search's models as the child loads them, converted here if they are not yet (the embedded
    model's GGUF → its HF-format copy, once): the child cannot write the models folder."""
    from sparsetune.errors import SparsetuneError
    from sparsetune.models.resolve import resolve_model

    wanted = [(cfg.model, False)] + ([(cfg.speed_model, True)] if cfg.speed_model and cfg.speed_model != cfg.model else [])
    for model, random_weights in wanted:
        try:
            resolve_model(model, random_weights)
        except SparsetuneError:
            pass  # the child says so, with the request that needed it


# Events of the child's evaluator passed on to the search (`relay`): kind -> its fields
RELAYED = {"turns": ("reason",)}


def printable_line(text: str) -> str:
    """Text that stays on one line (a `#` comment's, a console line's): every line break Python knows
    (\\r, \\n, \\f, \\v, \\x1c-\\x1e, \\x85, \\u2028, \\u2029) and other control characters (a
    terminal escape's ESC among them) become spaces."""
    return "".join(" " if (c.isspace() and c != " ") or not c.isprintable() else c for c in " ".join(text.splitlines()))


def relay(events: Any, emit) -> None:
    """Pass on the child's evaluator events: the first of each `RELAYED` kind in an answer, its
    fields scrubbed, made `printable_line` and cut to 500 characters; anything else in the list is dropped."""
    seen = set()
    for ev in events if isinstance(events, list) else []:
        kind = ev.get("kind") if isinstance(ev, dict) else None
        data = ev.get("data") if isinstance(ev, dict) else None
        if kind in RELAYED and kind not in seen and isinstance(data, dict):
            seen.add(kind)
            emit(kind, {k: printable_line(scrub(str(data.get(k, ""))))[:500] for k in RELAYED[kind]})


class SandboxEvaluator:
    """The search's evaluator in a sandboxed child (`python -m sparsetune.agents.sandbox serve`, in the
    jail; module docstring): its engines, and every trial and accuracy run of any flow, live there,
    so a candidate's stages never run in this process. Requests go over the child's stdin, answers
    come back on a pipe of their own (one JSON line each, scrubbed here). A request past its time
    limit (`limits.wall_s` for the first, which loads the engines; then `REQUEST_FACTOR` times the
    slowest so far, at least `MIN_REQUEST_S`), or a child past its memory limit, is killed with
    every process of its namespace; the request raises `SandboxError` and the next one starts a
    fresh child."""

    REQUEST_FACTOR, MIN_REQUEST_S = 5.0, 300.0

    def __init__(self, cfg, folder: Path, limits: Limits) -> None:
        self.cfg, self.folder, self.limits = cfg, Path(folder), limits
        self.scratch = self.folder / "scratch"
        self._box: Jailed | None = None
        self._log: Path | None = None
        self._answers = None
        self._killed: str | None = None
        self.slowest: float | None = None
        self.starts = 0
        self.requests = 0
        self.emit = lambda kind, data: None  # the search's events (`Agent.attach`): the child's are relayed

    @property
    def _proc(self) -> subprocess.Popen | None:
        return self._box.proc if self._box is not None else None

    # the search's evaluator interface (`tuning.protocols.Evaluator`, and a trial as `tuning.cascade.run_trial`), through the child
    def run_trial(self, cfg, _evaluator, flow: str, params: dict[str, str], out: Path) -> dict[str, Any]:
        return self.request({"op": "trial", "flow": flow, "params": params, "out": str(out)})["record"]

    def accuracy(self, flow: str | None, params: dict[str, str], *, samples: int, seed: int, out: Path,
                 on_chunk: ChunkFn | None = None) -> Accuracy:
        """The point's accuracy from the child (`on_chunk` is not called: a trial's cascade runs there)."""
        from sparsetune.tuning.trial import accuracy_from_dict

        ans = self.request({"op": "accuracy", "flow": flow, "params": params, "samples": samples, "seed": seed,
                            "out": str(out)})
        return accuracy_from_dict(ans["accuracy"])

    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send `msg` to the child; its `out` (a folder here) becomes one in the child's scratch folder,
        whose contents are copied to `out` once the request ends (answered or not)."""
        if self._box is None or self._box.proc.poll() is not None:
            self._start()
        self.requests += 1
        out = msg.get("out")
        inside = (self.scratch / "out" / str(self.requests)).absolute()
        if out is not None:
            msg = {**msg, "out": str(inside.absolute())}
        try:
            ans = self._ask(msg)
        finally:
            moved = collect(inside, Path(out)) if out is not None else {}
        return scrub(relocate(ans, moved))

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        import queue

        limit = self.limits.wall_s if self.slowest is None else max(self.MIN_REQUEST_S, self.REQUEST_FACTOR * self.slowest)
        t0 = time.monotonic()
        proc = self._box.proc
        try:
            proc.stdin.write((json.dumps(msg) + "\n").encode())
            proc.stdin.flush()
            ans = self._answers.get(timeout=limit)
        except queue.Empty:
            self.close(f"over its time limit of {limit:.0f} s for one request")
            raise SandboxError(f"killed by the harness: {msg['op']} of {msg.get('flow')} took over {limit:.0f} s") from None
        except (BrokenPipeError, OSError):
            ans = None
        if ans is None:  # the child is gone: killed by the watchdog, or died
            killed = self._killed
            why = killed or f"the sandbox exited with code {proc.wait()}"
            self.close()
            raise SandboxError(f"killed by the harness: {why}" if killed else why)
        self.slowest = max(self.slowest or 0.0, time.monotonic() - t0)
        relay(ans.pop("events", None), self.emit)  # a failed request's too
        if not ans.get("ok"):
            raise SandboxError(str(ans.get("error", "the sandbox failed")))
        return ans

    def _start(self) -> None:
        import queue
        import threading

        self.close()
        self.folder.mkdir(parents=True, exist_ok=True)
        prepare_models(self.cfg)
        # what the child needs of the search: not where its storage is (a password) nor the agent's endpoint
        child_cfg = self.cfg.model_copy(update={"storage": None, "agent_endpoint": None})
        config = self.folder / "sandbox-config.json"
        config.write_text(child_cfg.model_dump_json())
        read_fd, write_fd = os.pipe()
        serving = replace(self.limits, cpu_s=None)  # CPU seconds add up over a child's requests: time them one by one
        env = clean_env(serving, {**model_env(), "SPARSETUNE_SANDBOX_FD": str(write_fd)})
        self.starts += 1
        self._log = self.folder / f"sandbox-{self.starts}.log"
        try:
            with open(self._log, "wb") as log:
                box = launch(python_cmd("serve", str(config.absolute())), serving, self.scratch, log,
                             stdin=subprocess.PIPE, env=env, pass_fds=(write_fd,), log=self._log)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._box, self._killed = box, None
        answers: queue.Queue = queue.Queue()
        self._answers = answers

        def read() -> None:
            with os.fdopen(read_fd, "rb") as f:
                for line in f:
                    try:
                        ans = json.loads(line)
                    except ValueError:
                        ans = None
                    answers.put(ans if isinstance(ans, dict) else {"ok": False, "error": "the sandbox answered garbage"})
            answers.put(None)  # the child closed its end: gone

        def watch() -> None:
            while box.proc.poll() is None:
                _rss, over = box.memory_breach(self.limits.memory_mb)
                if over:
                    self._killed = over
                    box.kill()
                    return
                time.sleep(0.2)

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=watch, daemon=True).start()

    def close(self, why: str | None = None) -> None:
        """Kill the child and every process of its namespace (if it runs); its log is scrubbed."""
        if self._box is not None:
            self._killed = self._killed or why
            self._box.kill()
            self._box = None
        if self._log is not None:
            scrub_file(self._log)


# ---- the child --------------------------------------------------------------------------------------

def _check(path: str) -> dict[str, Any]:
    from sparsetune.errors import SparsetuneError
    from sparsetune.flow.check import check_flow
    from sparsetune.loader import flow_kind, load_file
    from sparsetune.tuning.space import spec_dicts

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
    from sparsetune.tuning.config import SearchConfig
    from sparsetune.tuning.cascade import run_trial
    from sparsetune.tuning.trial import EngineEvaluator

    cfg = SearchConfig.model_validate_json(Path(config).read_text())
    events: list[dict[str, Any]] = []  # sent with the next answer (`relay`)
    evaluator = EngineEvaluator(cfg, on_event=lambda kind, data: events.append({"kind": kind, "data": data}))
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
            ans["events"], events[:] = list(events), []
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
