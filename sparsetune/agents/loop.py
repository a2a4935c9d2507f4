"""`sparsetune search --agent NAME`: the search with a proposer writing new flows into it.

`Agent` plugs into `tuning.run.run_search` (its `agent` hooks, `tuning.protocols.AgentHooks`). Every trial and confirmation,
of built-in and proposed flows alike, runs in one sandboxed evaluator (`sandbox.SandboxEvaluator`),
so the figures of every flow come from the same engine and no candidate code runs in this
process: it runs isolated (`sparsetune.sandbox`: its own PID, user, mount and network namespaces,
read-only but for its scratch folder, no network), and on a host where that cannot be set up
(not Linux, user namespaces disabled) the search is refused before it starts (`Agent` checks).
Everything recorded of a candidate, and every prompt, is scrubbed of credentials (`scrub`).
Before each trial, `step` decides whether a proposal is due and, if so, takes one candidate
through the harness:

1. **static** and 2. **check** (`harness.validate`: the syntax tree, then `flows check` in a
   sandboxed subprocess, which also reports the flow's params: `tuning.space.spec_dicts`);
3. **gate**: the candidate at its defaults on prompts drawn for it alone (seed `seed +
   GATE_SEED_OFFSET + its number`), in the sandbox; it passes at `quick_floor` x the weakest
   search-set accuracy of the searched flows' defaults (relative to dense; before one is measured,
   `quick_floor` x the bar);
4. **study**: its Optuna study joins the search (`tuning.studies.add_flow`, seeded with its
   defaults alone), and it competes for trials and the frontier like any flow (the round-robin
   warm-up gives it `WARM_TRIALS` first).

**When a proposal is due**: no flow's defaults are waiting (the built-in flows' defaults set the
gate's bar; a candidate's defaults run before the next candidate; the other seeded points may
interleave with proposals, so a short `--trials` budget still proposes), the budget has room
for a candidate and a trial, the proposer's cost is under `--agent-budget-usd`, and either
`PROPOSE_EVERY` trials have run since the last proposal or the last one was rejected (at most
`REJECTS_IN_A_ROW` in a row). Half the trials go to the candidates' warm-up and half to the
allocation by hypervolume share, so good candidates and the built-in flows keep being tuned.

Everything is in `runs/<study>/candidates/<id>/` (`harness.Candidate`) and `candidates.json`
(each candidate's verdict, where it landed, and the accepted flows' diversity); a resumed search
reads them back and finishes a candidate it left half-way.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparsetune.agents.diversity import diversity
from sparsetune.agents.harness import CHECK_LIMITS, Candidate, Stage, declared_name, load_candidates, validate
from sparsetune.agents.proposer import PROPOSERS, Context, NoMoreProposals, Proposer
from sparsetune.agents.sandbox import Limits, SandboxError, SandboxEvaluator, check_isolation, printable_line, scrub
from sparsetune.errors import SparsetuneError
from sparsetune.records import new_file
from sparsetune.tuning.config import SearchConfig, flow_key
from sparsetune.tuning.frontier import eligible, search_frontier, trial_name
from sparsetune.tuning.space import spec_class
from sparsetune.tuning.storage import trial_count

if TYPE_CHECKING:
    from sparsetune.tuning.policy import Budget
    from sparsetune.tuning.protocols import EventFn
    from sparsetune.tuning.studies import Studies

PROPOSE_EVERY = 8  # trials between two proposals
REJECTS_IN_A_ROW = 3  # proposals one after another while each is rejected
FAILURES_IN_A_ROW = 3  # proposer errors (the API down, after its SDK's retries) before proposing stops
GATE_SEED_OFFSET = 5000
GOAL = ("Write a decode flow (a DecodeFlow: a cache stage of per-block fields and an index stage that scores blocks) "
        "that keeps accuracy relative to dense attention at or above the bar while reading fewer bytes per decode "
        "step than the flows on the frontier: a field's bytes are read every step, so it must be much smaller "
        "than the block's keys.")


def sandbox_limits(cfg: SearchConfig) -> Limits:
    """The evaluator child's limits: the first request loads the engines and runs the dense pass;
    memory is the engines' and the candidates' (CUDA cannot run under an address-space limit); its
    files are the evaluations' (each prompt's dense KV is kept on disk: gigabytes at long contexts)."""
    from sparsetune.device import resolve_device

    cpu_only = resolve_device(cfg.device).type != "cuda"
    return Limits(wall_s=1800.0, memory_mb=12288 if cpu_only else 65536, file_mb=65536, cpu_only=cpu_only)


def make_proposer(cfg: SearchConfig) -> Proposer:
    """The proposer `--agent NAME` runs (checked before the search starts: a missing key or
    endpoint is refused here, not in the middle of a search)."""
    name = cfg.agent
    if name == "evolve":
        from sparsetune.agents.evolve import Evolve

        return Evolve(cfg.seed)
    if name == "claude":
        from sparsetune.agents.llm import DEFAULT_CLAUDE_MODEL, ClaudeProposer

        return ClaudeProposer(cfg.agent_model or DEFAULT_CLAUDE_MODEL)
    if name == "openai":
        from sparsetune.agents.llm import OpenAIProposer

        if not cfg.agent_endpoint or not cfg.agent_model:
            raise SparsetuneError("--agent openai needs --agent-endpoint URL (the server's base URL, e.g. "
                                  "http://localhost:30000/v1) and --agent-model NAME (the model it serves)")
        return OpenAIProposer(cfg.agent_endpoint, cfg.agent_model)
    raise SparsetuneError(f"--agent {name!r}: use one of {', '.join(PROPOSERS)}")


STAGES = ("static", "check", "gate")  # the harness stages a candidate passes before its study joins


def _through(cand: Candidate) -> bool:
    """Every stage run and passed (a resumed search's candidate left half-way is not)."""
    return cand.verdict == "accepted" and tuple(s.name for s in cand.stages) == STAGES


class Agent:
    """The `agent` of `run_search` (module docstring; its hooks: `tuning.protocols.AgentHooks`)."""

    def __init__(self, cfg: SearchConfig, proposer: Proposer, limits: Limits | None = None,
                 check_limits: Limits = CHECK_LIMITS, propose_every: int = PROPOSE_EVERY,
                 rejects_in_a_row: int = REJECTS_IN_A_ROW) -> None:
        check_isolation()  # a host where candidates cannot run isolated refuses the search before it starts
        self.cfg, self.proposer, self.check_limits = cfg, proposer, check_limits
        self.propose_every, self.rejects_in_a_row = propose_every, rejects_in_a_row
        self.root = cfg.run_dir / "candidates"
        self.evaluator = SandboxEvaluator(cfg, cfg.run_dir / "sandbox", limits or sandbox_limits(cfg))
        self.candidates: list[Candidate] = load_candidates(self.root)
        self.step_s: list[float] = []
        self.flows = self.budget = None
        self.emit = lambda kind, data: None
        self._last = 0  # trial count at the last proposal
        self.stopped: str | None = None  # why proposing stopped (the search goes on)
        self.failures = 0  # proposer errors in a row

    # ---- run_search's hooks ----------------------------------------------------------------------

    def run_trial(self, cfg, evaluator, flow: str, params: dict[str, str], out: Path) -> dict[str, Any]:
        return self.evaluator.run_trial(cfg, evaluator, flow, params, out)

    def attach(self, flows: Studies, budget: Budget, emit: EventFn) -> None:
        """The search's studies are open: add the accepted candidates' (a resumed search)."""
        self.flows, self.budget, self.emit = flows, budget, emit
        self.evaluator.emit = emit  # the sandboxed evaluator's own events (the engines taking turns)
        for cand in self.candidates:
            if _through(cand):
                self._join(cand)
        self._last = trial_count(flows.studies)

    def step(self) -> None:
        """Before each trial: take candidates through the harness while one is due (a rejected one
        is followed by the next at once, up to `rejects_in_a_row`)."""
        while self._due():
            t0 = time.time()
            try:
                cand = self._next()
            except NoMoreProposals as e:  # out of ideas, or may not spend more: the search goes on
                self._stop(scrub(str(e)))
                return
            except SparsetuneError as e:  # the proposer failed (an API error): ask again after a round of trials
                self.failures += 1
                self._last = trial_count(self.flows.studies)
                if self.failures >= FAILURES_IN_A_ROW:
                    self._stop(scrub(f"{e} ({self.failures} failures in a row)"))
                else:
                    self.emit("proposer", {"error": scrub(str(e)), "retry_after_trials": self.propose_every})
                return
            self.failures = 0
            self.emit("candidate", {"id": cand.id, "name": cand.name, "proposer": cand.proposer,
                                    "parents": cand.parents, "rationale": cand.rationale})
            self._harness(cand)
            self.step_s.append(time.time() - t0)
            self._last = trial_count(self.flows.studies)
            self.emit("verdict", {"id": cand.id, "name": cand.name, "verdict": cand.verdict, "reason": cand.reason,
                                  "seconds": round(self.step_s[-1], 1)})
            self.write()

    def close(self, result: dict[str, Any]) -> None:
        self.evaluator.close()
        result["candidates"] = self.write(result)

    # ---- the proposal ----------------------------------------------------------------------------

    def _stop(self, why: str) -> None:
        self.stopped = why
        self.emit("proposer", {"stopped": why})

    def spent_usd(self) -> float:
        return sum(c.cost_usd for c in self.candidates)

    def _due(self) -> bool:
        from optuna.trial import TrialState

        from sparsetune.tuning.confirm import confirm_reserve

        flows, budget, cfg = self.flows, self.budget, self.cfg
        if self.stopped is None and cfg.agent_budget_usd is not None and self.spent_usd() >= cfg.agent_budget_usd:
            self._stop(f"--agent-budget-usd {cfg.agent_budget_usd:g} spent (${self.spent_usd():.4f})")
        if self.stopped is not None:
            return False
        waiting = [t for s in flows.studies.values() for t in s.get_trials(deepcopy=False, states=(TrialState.WAITING,))]
        if any(t.user_attrs.get("role") in ("defaults", "start") for t in waiting):
            return False  # the flows' defaults first (the gate's bar), and each candidate's start before the next
        if budget.reason_to_stop(flows, confirm_reserve(cfg, flows, budget)) is not None:
            return False
        left = budget.left_s()
        need = budget.trial_s + (max(self.step_s) if self.step_s else 2 * budget.trial_s)
        if left is not None and left < need:
            return False
        if self.failures:  # the last ask failed: a round of trials before the next
            return trial_count(flows.studies) - self._last >= self.propose_every
        rejected = 0
        for c in reversed(self.candidates):
            if c.verdict == "accepted":
                break
            rejected += 1
        if 0 < rejected < self.rejects_in_a_row:
            return True
        return not self.candidates or trial_count(flows.studies) - self._last >= self.propose_every

    def context(self) -> Context:
        from sparsetune.tuning.studies import trial_records

        records = trial_records(self.flows)
        by_name = {trial_name(r): r for r in records}
        front = sorted(search_frontier(records, self.cfg.min_accuracy), key=lambda p: -p.speedup)
        rows = [{"flow": by_name[p.name]["flow"], "trial": p.name, "params": p.params, "relative_accuracy": p.accuracy,
                 "speedup": p.speedup, "kv_share": (by_name[p.name].get("speed") or {}).get("kv_share")} for p in front]
        return Context(len(self.candidates), GOAL, rows, list(self.candidates))

    def _next(self) -> Candidate:
        """The next candidate: one the last run left half-way, else a new proposal."""
        for cand in self.candidates:
            if cand.verdict == "accepted" and not _through(cand):
                return cand
        p = self.proposer.propose(self.context())
        number = len(self.candidates)
        name = declared_name(p.source) or f"candidate_{number:04d}"
        cand = Candidate(f"{number:04d}", name, p.proposer, p.source, p.parents, p.rationale, p.prompt_hash,
                         dict(p.usage or {}), p.cost_usd)
        taken = set(self.flows.studies) | {c.name for c in self.candidates}
        if name in taken:  # its file would stand for another flow in the search
            cand.stages.append(Stage("static", False, f"the flow name {name!r} is taken in this search; give the "
                                     f"flow a new `name`", 0.0))
        self.candidates.append(cand)
        cand.save(self.root)
        return cand

    def _harness(self, cand: Candidate) -> None:
        validate(cand, self.root, self.check_limits)
        if cand.verdict != "accepted":
            return
        cand.stages.append(self._gate(cand))
        cand.save(self.root)
        if cand.verdict == "accepted":
            self._join(cand)

    def gate_bar(self) -> float:
        from sparsetune.tuning.studies import trial_records

        builtin = {flow_key(f) for f in self.cfg.flows}
        accs = [r["accuracy"]["relative_accuracy"] for r in trial_records(self.flows)
                if r["flow"] in builtin and r["role"] == "defaults" and eligible(r, None)]
        return self.cfg.quick_floor * (min(accs) if accs else (self.cfg.min_accuracy or 1.0))

    def _gate(self, cand: Candidate) -> Stage:
        """Harness step 3 (module docstring)."""
        t0 = time.perf_counter()
        bar = round(self.gate_bar(), 4)
        seed = self.cfg.seed + GATE_SEED_OFFSET + int(cand.id)
        try:
            acc = self.evaluator.accuracy(str(cand.path(self.root)), {}, samples=self.cfg.samples, seed=seed,
                                          out=cand.folder(self.root) / "gate")
        except SandboxError as e:
            return Stage("gate", False, str(e), round(time.perf_counter() - t0, 3), {"bar": bar, "seed": seed})
        rel = acc.relative
        detail = {"bar": bar, "seed": seed, "relative_accuracy": rel, "samples": acc.samples, "run_dir": acc.run_dir}
        ok = rel is not None and rel >= bar
        why = None if ok else f"relative accuracy {rel} at its defaults on its own prompts < the gate's {bar}"
        return Stage("gate", ok, why, round(time.perf_counter() - t0, 3), detail)

    def _join(self, cand: Candidate) -> None:
        """Harness step 4: its study joins the search."""
        from sparsetune.tuning.studies import add_flow

        spec = next(s for s in cand.stages if s.name == "check").detail["spec"]
        add_flow(self.cfg, self.flows, str(cand.path(self.root)), spec_class(spec), create=True, foreign=True)

    # ---- records ---------------------------------------------------------------------------------

    def write(self, result: dict[str, Any] | None = None) -> dict[str, Any]:
        """candidates.json: each candidate's verdict and where it landed; the accepted ones' diversity."""
        from sparsetune.records import write_json
        from sparsetune.tuning.studies import trial_records

        records = trial_records(self.flows) if self.flows is not None else []
        rows = (result or {}).get("confirmed_frontier") or []
        out = {**candidates_summary(self.candidates, records, rows, self.cfg.min_accuracy), "stopped": self.stopped}
        write_json(self.cfg.run_dir / "candidates.json", out)
        return out


def candidates_summary(candidates: list[Candidate], records: list[dict[str, Any]], confirmed: list[dict[str, Any]],
                       min_accuracy: float | None) -> dict[str, Any]:
    """What `candidates.json` and `search show` say about a search's candidates."""
    rows = []
    for c in candidates:
        mine = [r for r in records if r["flow"] == c.name]
        # its best point: the fastest at the bar, else (none reached it) the most accurate faster than dense
        held = [r for r in mine if eligible(r, min_accuracy)]
        best = (max(held, key=lambda r: (r["speed"]["speedup"], r["accuracy"]["relative_accuracy"])) if held else
                max((r for r in mine if eligible(r, None) and r["speed"]["speedup"] > 1), default=None,
                    key=lambda r: (r["accuracy"]["relative_accuracy"], r["speed"]["speedup"])))
        rows.append({"id": c.id, "name": c.name, "proposer": c.proposer, "parents": c.parents, "rationale": c.rationale,
                     "verdict": c.verdict, "reason": c.reason, "cost_usd": c.cost_usd, "usage": c.usage,
                     "stages": {s.name: round(s.seconds, 3) for s in c.stages}, "trials": len(mine),
                     "best": best and {"trial": trial_name(best), "params": best["params"],
                                       "relative_accuracy": best["accuracy"]["relative_accuracy"],
                                       "speedup": best["speed"]["speedup"], "kv_share": best["speed"].get("kv_share"),
                                       "meets_bar": bool(held)},
                     "on_confirmed_frontier": [r["trial"] for r in confirmed if r["flow"] == c.name]})
    accepted = [c.source for c in candidates if c.verdict == "accepted"]
    by_stage: dict[str, int] = {}
    for c in candidates:
        by_stage[c.verdict] = by_stage.get(c.verdict, 0) + 1
    return {"proposed": len(candidates), "accepted": len(accepted),
            "share_valid": round(len(accepted) / len(candidates), 4) if candidates else None,
            "verdicts": by_stage, "cost_usd": round(sum(c.cost_usd for c in candidates), 6),
            "diversity": diversity(accepted), "candidates": rows,
            "versus_builtins": versus_builtins(records, {c.name for c in candidates}, min_accuracy)}


def versus_builtins(records: list[dict[str, Any]], proposed: set[str], min_accuracy: float | None) -> dict[str, Any] | None:
    """Whether any proposal beats the best tuned built-in on fresh prompts: the fastest point of a
    flow the search was given (`--flow`: the built-ins, or a user's own file) that held
    `min_accuracy` on its confirmation prompts, and every proposed flow's point that held it too
    and is faster; with how many of the given flows' points could not be confirmed (their
    evaluation failed), which the verdict cannot count. None without a bar."""
    if min_accuracy is None:
        return None

    def held(r: dict[str, Any]) -> bool:
        conf = r.get("confirm") or {}
        return bool(conf.get("holds")) and (conf.get("relative_accuracy") or 0.0) >= min_accuracy and bool(r.get("speed"))

    def fig(r: dict[str, Any]) -> dict[str, Any]:
        return {"trial": trial_name(r), "flow": r["flow"], "params": r["params"],
                "confirmed_accuracy": r["confirm"]["relative_accuracy"], "speedup": r["speed"]["speedup"]}

    points = [r for r in records if held(r)]
    builtin = max((r for r in points if r["flow"] not in proposed), default=None,
                  key=lambda r: (r["speed"]["speedup"], r["confirm"]["relative_accuracy"]))
    floor = 0.0 if builtin is None else builtin["speed"]["speedup"]
    beaten_by = sorted((fig(r) for r in points if r["flow"] in proposed and r["speed"]["speedup"] > floor),
                       key=lambda f: -f["speedup"])
    failed = sum(1 for r in records if r["flow"] not in proposed and (r.get("confirm") or {}).get("error"))
    v = {"min_accuracy": min_accuracy, "best_builtin": builtin and fig(builtin), "beaten_by": beaten_by,
         "builtin_confirm_failed": failed}
    return {**v, "line": _versus_line(v)}


def _versus_line(v: dict[str, Any]) -> str:
    """`versus_builtins` in one sentence (the CLI prints it)."""
    bar = f"{100 * v['min_accuracy']:.0f}% of dense on fresh prompts"
    best = v["best_builtin"]
    what = "no built-in point held it" if best is None else (
        f"the best tuned built-in, {best['trial']}: {100 * best['confirmed_accuracy']:.0f}% at {best['speedup']:.2f}×")
    if v["builtin_confirm_failed"]:
        what += f"; {v['builtin_confirm_failed']} of their points could not be confirmed"
    if not v["beaten_by"]:
        return f"no proposal beats the built-ins at {bar} ({what})"
    top = v["beaten_by"][0]
    return (f"{len(v['beaten_by'])} proposed point(s) beat the built-ins at {bar}: the fastest, {top['trial']}, "
            f"{100 * top['confirmed_accuracy']:.0f}% at {top['speedup']:.2f}× ({what})")


def show_candidates(run_dir: Path, records: list[dict[str, Any]], confirmed: list[dict[str, Any]],
                    min_accuracy: float | None) -> dict[str, Any] | None:
    """`search show`'s candidates (None: the search had no agent)."""
    root = Path(run_dir) / "candidates"
    if not root.is_dir():
        return None
    return candidates_summary(load_candidates(root), records, confirmed, min_accuracy)


def promote(candidate_dir: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """`sparsetune flows promote runs/<study>/candidates/<id>`: copy a candidate that passed the
    harness into the user's flows (`out`, default `./<name>.py`) under a header naming its origin
    (search, candidate, proposer, parents, rationale, prompt hash) and its figures (its best point
    on the search set, its confirmed points). Returns what it wrote."""
    import json

    folder = Path(candidate_dir)
    record = folder / "candidate.json"
    if not record.is_file():
        raise SparsetuneError(f"{folder}: not a candidate folder (no candidate.json); pass runs/<study>/candidates/<id>")
    data = json.loads(record.read_text())
    cand = Candidate.from_dict(data)
    if cand.verdict != "accepted":
        raise SparsetuneError(f"candidate {cand.id} ({cand.name}) was {cand.verdict}: {cand.reason}; promote one that passed")
    from sparsetune.flow.values import check_name

    check_name(cand.name)
    # The file the harness validated, byte for byte, and only if it is still what was recorded.
    source = (folder / f"{cand.name}.py").read_bytes() if (folder / f"{cand.name}.py").is_file() else b""
    if hashlib.sha256(source).hexdigest()[:16] != data.get("source_sha256") or source != cand.source.encode():
        raise SparsetuneError(f"{folder}: {cand.name}.py is not the source the harness validated (its sha256 differs "
                              "from candidate.json's); promote an untouched candidate folder")
    path = new_file(Path(out) if out is not None else Path(f"{cand.name}.py"))
    run_dir = folder.parent.parent
    trials, front = run_dir / "trials.jsonl", run_dir / "frontier.json"
    records = [json.loads(line) for line in trials.read_text().splitlines() if line.strip()] if trials.is_file() else []
    conf = json.loads(front.read_text()).get("confirmed_frontier", []) if front.is_file() else []
    search = json.loads((run_dir / "search.json").read_text())["search"] if (run_dir / "search.json").is_file() else {}
    row = next(r for r in candidates_summary([cand], records, conf, search.get("min_accuracy"))["candidates"])
    lines = [f"promoted by `sparsetune flows promote` from {folder} (search {search.get('study')!r}, "
             f"model {search.get('model')}, context {search.get('context')})",
             f"candidate {cand.id} by {cand.proposer}; parents: {', '.join(cand.parents) or '-'}; "
             f"prompt sha256: {cand.prompt_hash or '-'}; source sha256: {cand.source_hash()}",
             f"rationale: {cand.rationale or '-'}",
             "harness: " + "; ".join(f"{s.name} passed in {s.seconds:.1f} s" for s in cand.stages),
             f"trials: {row['trials']}"]
    best = row["best"]
    if best is not None:
        lines.append(f"best point on the search set: {best['params']}: {100 * best['relative_accuracy']:.1f}% of dense, "
                     f"speedup {best['speedup']:.2f}x, K/V read {best.get('kv_share')}"
                     + ("" if best["meets_bar"] else " (below the search's --min-accuracy)"))
    for r in conf:
        if r["flow"] == cand.name:
            lo, hi = r.get("interval") or (None, None)
            lines.append(f"confirmed frontier: {r['trial']} {r['params']}: {100 * r['confirmed_accuracy']:.1f}% of dense "
                         f"on fresh prompts [{lo}, {hi}], speedup {r['speedup']:.2f}x ({r.get('speed_kind')})")
    lines = [printable_line(line) for line in lines]
    path.write_bytes("".join(f"# {line}\n" for line in lines).encode() + b"\n" + source)
    return {"file": str(path), "candidate": cand.id, "flow": cand.name, "header": lines}
