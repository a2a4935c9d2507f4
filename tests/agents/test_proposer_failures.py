"""A proposer that fails (an API error after its SDK's retries) is asked again after a round of
trials, and proposing stops after FAILURES_IN_A_ROW failures; the search's trials go on meanwhile."""

from __future__ import annotations

import json
import time

import optuna

from sparsetune.agents.loop import FAILURES_IN_A_ROW, Agent
from sparsetune.errors import SparsetuneError
from sparsetune.tuning.config import SearchConfig
from sparsetune.tuning.policy import Budget
from sparsetune.tuning.studies import Studies


class Down:
    def __init__(self) -> None:
        self.calls = 0

    def propose(self, ctx):
        self.calls += 1
        raise SparsetuneError(f"the API answered 529 (overloaded), call {self.calls}")


def test_a_failing_proposer_is_asked_again_after_a_round_then_stopped(tmp_path):
    cfg = SearchConfig(study="s", out=str(tmp_path), trials=1000, context=256, agent="evolve")
    proposer, events = Down(), []
    agent = Agent(cfg, proposer, propose_every=3)
    study = optuna.create_study(directions=["maximize", "maximize"])
    flows = Studies(studies={"quest": study}, classes={}, num_layers=30)
    agent.attach(flows, Budget(cfg, time.time()), lambda kind, data: events.append((kind, data)))

    def trials(n):  # the search runs n trials between two of the agent's steps
        for _ in range(n):
            study.add_trial(optuna.trial.create_trial(values=[0.5, 1.5]))

    agent.step()
    assert proposer.calls == 1 and agent.stopped is None
    assert events == [("proposer", {"error": "the API answered 529 (overloaded), call 1", "retry_after_trials": 3})]
    agent.step()
    trials(2)
    agent.step()
    assert proposer.calls == 1  # not before a round of trials
    for failure in range(2, FAILURES_IN_A_ROW + 1):
        trials(1 if failure == 2 else 3)
        agent.step()
        assert proposer.calls == failure
    assert agent.stopped == f"the API answered 529 (overloaded), call {FAILURES_IN_A_ROW} ({FAILURES_IN_A_ROW} failures in a row)"
    assert events[-1] == ("proposer", {"stopped": agent.stopped})
    trials(10)
    agent.step()
    assert proposer.calls == FAILURES_IN_A_ROW
    (tmp_path / "s").mkdir()
    agent.close({})  # the record says why proposing stopped
    assert json.loads((tmp_path / "s" / "candidates.json").read_text())["stopped"] == agent.stopped
