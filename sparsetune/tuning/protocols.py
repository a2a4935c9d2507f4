"""What plugs into the search, as types: the evaluator, the agent's hooks, the event callback.

The search calls objects it does not define: an evaluator (`trial.EngineEvaluator`, the sandbox's
`agents.sandbox.SandboxEvaluator`, a test's synthetic one) and an agent (`agents.loop.Agent`).
They are declared here, where they are called, so that the search says what it needs of them
and `tuning` imports nothing above it (agents sits above tuning). `runtime_checkable`: an
`isinstance` check sees that the members are there (not their signatures).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from sparsetune.tuning.config import SearchConfig
    from sparsetune.tuning.policy import Budget
    from sparsetune.tuning.studies import Studies
    from sparsetune.tuning.trial import Accuracy

# on_event(kind, data): what a search reports as it goes ("begin", "start", "done", "failed", "trial", ...)
EventFn = Callable[[str, dict[str, Any]], None]

# on_chunk(partial): an accuracy run's figures so far (results.json's object), handed over in process
# after each chunk of samples but the last; raising `Hopeless` stops the run there.
ChunkFn = Callable[[dict[str, Any]], None]


class Hopeless(Exception):
    """The cascade stopped a trial: its figures so far cannot reach the frontier's bar."""


@runtime_checkable
class Evaluator(Protocol):
    """What confirmation (and an agent's gate) asks of an evaluator: a point's accuracy."""

    def accuracy(self, flow: str | None, params: dict[str, str], *, samples: int, seed: int, out: Path,
                 on_chunk: ChunkFn | None = None) -> Accuracy:
        """The point on `samples` prompts per task drawn with `seed`, relative to dense on the same
        prompts; its run folder under `out`. `on_chunk` raising `Hopeless` ends the run: the figures
        so far come back, `complete` False."""
        ...


@runtime_checkable
class TrialEvaluator(Evaluator, Protocol):
    """What the cascade (`cascade.run_trial`) asks of an evaluator besides accuracy: speed."""

    def speed_after_accuracy(self) -> bool:
        """Speed comes from the accuracy run (a reuse flow's modeled speed): `speedup` after `accuracy`."""
        ...

    def speedup(self, flow: str, params: dict[str, str], accuracy: Accuracy | None = None) -> tuple[float, dict[str, Any]]:
        """Speedup over dense (or full recompute) and how it was taken (`kind`: measured or modeled)."""
        ...


class TrialFn(Protocol):
    """What runs one trial and returns its record (`cascade.run_trial`, or an agent's through its sandbox)."""

    def __call__(self, cfg: SearchConfig, evaluator: Any, flow: str, params: dict[str, str], out: Path) -> dict[str, Any]:
        ...


@runtime_checkable
class AgentHooks(Protocol):
    """What `run.run_search` calls on its `agent`: `attach` once the studies are open; `evaluator`
    for confirmation and `run_trial` for every trial in place of the cascade here; `step` before
    each trial (where it adds flows to the studies); `close` with frontier.json's object at the end."""

    evaluator: Evaluator

    def attach(self, flows: Studies, budget: Budget, emit: EventFn) -> None: ...

    def step(self) -> None: ...

    def run_trial(self, cfg: SearchConfig, evaluator: Any, flow: str, params: dict[str, str],
                  out: Path) -> dict[str, Any]: ...

    def close(self, result: dict[str, Any]) -> None: ...
