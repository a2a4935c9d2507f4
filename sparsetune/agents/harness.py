"""The harness every candidate flow goes through, and its record.

1. **static**: the file parses and keeps to the flow-file rules (`flow.source_check`: module level
   holds the flow class and flow-API imports only; stages use only the op set; no other names,
   attributes, builtins, I/O, dunders). Read as a syntax tree here: nothing of it runs.
2. **check**: `flows check` semantics in an isolated child (`sparsetune.sandbox`: its own namespaces,
   no network, read-only but for its scratch folder) with a wall-clock, memory and CPU limit and a
   hard kill: shapes, field bytes per block, indexer work, the compiled paths, equality with dense
   attention at full budget.
3. **gate** and 4. **study** run in the search (`agents.loop`): a quick accuracy check on prompts
   drawn for this candidate with a fresh seed, then a short Optuna study of its params.

A candidate that fails a stage is recorded with the stage and the reason, never dropped. Its
record lives in `runs/<study>/candidates/<id>/`: `<name>.py` (the source), `candidate.json` (the
proposer, parents, prompt hash, rationale, tokens and cost, each stage's verdict and timing),
`check.log` (the check child's output) and `check/` (the check child's scratch folder, the only
one it can write: its check.json). Every reason and detail is scrubbed of credentials
(`sandbox.scrub`) before it is recorded.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sparsetune.agents.sandbox import Limits, python_cmd, run_limited
from sparsetune.sandbox import scrub

CHECK_LIMITS = Limits(wall_s=120.0, memory_mb=3072, cpu_s=240)


@dataclass
class Stage:
    """One harness stage's verdict. Its reason and detail (text a sandboxed child produced, among
    others) are scrubbed of credentials when it is made (`sandbox.scrub`), so neither the record
    nor a prompt built from it ever holds one; a record read back is scrubbed again."""

    name: str
    ok: bool
    reason: str | None
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.reason, self.detail = scrub(self.reason), scrub(self.detail)


@dataclass
class Candidate:
    """One proposed flow and what became of it."""

    id: str
    name: str  # the flow's `name` (unique in the search)
    proposer: str
    source: str
    parents: list[str] = field(default_factory=list)
    rationale: str = ""
    prompt_hash: str | None = None  # LLM proposers: sha256 of the request that produced it
    usage: dict[str, int] = field(default_factory=dict)  # LLM proposers: tokens by kind
    cost_usd: float = 0.0
    stages: list[Stage] = field(default_factory=list)
    created: float = field(default_factory=time.time)

    @property
    def verdict(self) -> str:
        """"accepted" when every stage run so far passed, else "rejected at <stage>"."""
        bad = next((s for s in self.stages if not s.ok), None)
        return "accepted" if bad is None else f"rejected at {bad.name}"

    @property
    def reason(self) -> str | None:
        return next((s.reason for s in self.stages if not s.ok), None)

    def source_hash(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """The record (candidate.json): everything but the source scrubbed of credentials."""
        record = scrub({**asdict(self), "verdict": self.verdict, "reason": self.reason})
        return {**record, "source": self.source, "source_sha256": self.source_hash()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        keep = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "stages"}
        return cls(**keep, stages=[Stage(**s) for s in data.get("stages", [])])

    def folder(self, root: Path) -> Path:
        return root / self.id

    def path(self, root: Path) -> Path:
        """Its flow file, named after the flow (a search knows a flow file by its stem)."""
        return self.folder(root) / f"{self.name}.py"

    def save(self, root: Path) -> Path:
        d = self.folder(root)
        d.mkdir(parents=True, exist_ok=True)
        self.path(root).write_text(self.source)
        (d / "candidate.json").write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return d


def declared_name(source: str) -> str | None:
    """The `name` a flow file's class declares (`FlowSource.declared_name`, from the syntax tree), if it
    is a plain lowercase identifier; None otherwise (the static stage says what is wrong with the file)."""
    from sparsetune.flow.source_check import FlowSource

    parsed = FlowSource.of_text(source)
    return parsed.declared_name() if parsed is not None else None


def load_candidates(root: Path) -> list[Candidate]:
    """Every candidate recorded under `root` (a search's `candidates/` folder), in id order."""
    if not root.is_dir():
        return []
    return [Candidate.from_dict(json.loads(p.read_text())) for p in sorted(root.glob("*/candidate.json"))]


def static_stage(path: Path) -> Stage:
    """Harness step 1, on the syntax tree (the file is not imported)."""
    from sparsetune.flow.source_check import file_problems

    t0 = time.perf_counter()
    problems = file_problems(path, path.read_bytes())
    if not problems and declared_name(path.read_text()) is None:  # e.g. an empty file: an LLM reply without its tool call
        problems = [f"{path.name}: no flow class with a `name = \"...\"` (a lowercase identifier); write one "
                    "DecodeFlow subclass as in the examples"]
    return Stage("static", not problems, " | ".join(problems) if problems else None, round(time.perf_counter() - t0, 3),
                 {"problems": problems} if problems else {})


def check_stage(path: Path, folder: Path, limits: Limits = CHECK_LIMITS) -> Stage:
    """Harness step 2, in a sandboxed subprocess (`agents.sandbox`) whose one writable folder is
    `<folder>/check/` (where it writes check.json): never the candidate's folder, whose record and
    source this process writes. Its log is `<folder>/check.log`."""
    scratch = folder / "check"
    result = scratch / "check.json"
    out = run_limited(python_cmd("check", str(path.resolve()), str(result.resolve())), limits,
                      folder / "check.log", result, scratch=scratch)
    detail = {"seconds": out.seconds, "peak_mb": out.peak_mb, "log": out.log}
    why = out.reason()
    if why is not None:
        return Stage("check", False, why, out.seconds, detail)
    res = out.result or {}
    if not res.get("ok"):
        return Stage("check", False, str(res.get("reason")), out.seconds, detail)
    return Stage("check", True, None, out.seconds, {**detail, "report": res["report"], "spec": res["spec"]})


def validate(cand: Candidate, root: Path, limits: Limits = CHECK_LIMITS) -> Candidate:
    """Steps 1 and 2 on a candidate (those not recorded yet: a resumed search finishes what it
    started); its record saved under `root` after each."""
    folder = cand.save(root)
    path = cand.path(root)
    done = {s.name for s in cand.stages}
    steps = {"static": lambda: static_stage(path), "check": lambda: check_stage(path, folder, limits)}
    for name, step in steps.items():
        if name in done or cand.reason is not None:
            continue
        stage = step()
        cand.stages.append(stage)
        cand.save(root)
        if not stage.ok:
            break
    return cand
