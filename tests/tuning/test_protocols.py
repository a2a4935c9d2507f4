"""The objects that plug into the search have what it calls on them (`tuning.protocols`): the
engine's evaluator, the sandbox's, the tests' synthetic one, and the agent; each call the search
makes binds to their methods."""

from __future__ import annotations

import inspect
from typing import Protocol

import pytest

from sparsetune.tuning.config import SearchConfig
from sparsetune.tuning.protocols import AgentHooks, Evaluator, TrialEvaluator
from helpers import SyntheticEvaluator


def _binds(obj: object, proto: type[Protocol]) -> None:
    """Every method of `proto` on `obj` takes the protocol's arguments as the search passes them
    (positional ones by position, keyword-only ones by name)."""
    for name, member in vars(proto).items():
        if name.startswith("_") or not callable(member):
            continue
        wanted = list(inspect.signature(member).parameters.values())[1:]  # without self
        args = [object() for p in wanted if p.kind is p.POSITIONAL_OR_KEYWORD]
        kwargs = {p.name: object() for p in wanted if p.kind is p.KEYWORD_ONLY}
        inspect.signature(getattr(obj, name)).bind(*args, **kwargs)  # raises TypeError if a call would


def _cfg(tmp_path, **kw) -> SearchConfig:
    return SearchConfig(study="s", out=str(tmp_path), trials=2, context=2048, **kw)


def test_the_evaluators_are_what_the_cascade_and_confirmation_call(tmp_path):
    from sparsetune.agents.sandbox import Limits, SandboxEvaluator
    from sparsetune.tuning.trial import EngineEvaluator

    cfg = _cfg(tmp_path)
    for ev in (EngineEvaluator(cfg), SyntheticEvaluator(cfg)):  # engines load on first use: nothing here
        assert isinstance(ev, TrialEvaluator)
        _binds(ev, Evaluator)
        _binds(ev, TrialEvaluator)
    box = SandboxEvaluator(cfg, tmp_path / "sandbox", Limits(wall_s=1, cpu_only=True))  # its child starts on a request
    assert isinstance(box, Evaluator) and not isinstance(box, TrialEvaluator)  # a trial runs whole in its child
    _binds(box, Evaluator)


def test_the_agent_has_the_hooks_run_search_calls(tmp_path, monkeypatch):
    import sparsetune.agents.loop as loop

    monkeypatch.setattr(loop, "check_isolation", lambda: None)  # the hooks, not the host
    agent = loop.Agent(_cfg(tmp_path, agent="evolve"), loop.make_proposer(_cfg(tmp_path, agent="evolve")))
    assert isinstance(agent, AgentHooks) and isinstance(agent.evaluator, Evaluator)
    _binds(agent, AgentHooks)


def test_a_duck_without_speed_is_no_trial_evaluator():
    class AccuracyOnly:
        def accuracy(self, flow, params, *, samples, seed, out, on_chunk=None):
            return None

    assert isinstance(AccuracyOnly(), Evaluator) and not isinstance(AccuracyOnly(), TrialEvaluator)
    with pytest.raises(TypeError):
        _binds(type("Positional", (), {"accuracy": lambda self, flow, params, samples, seed, out: None})(), Evaluator)
