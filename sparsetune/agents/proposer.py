"""What a proposer is given and what it hands back.

Each round the loop (`agents.loop`) builds a `Context`: the goal, the search's frontier so far
(params and figures), and every candidate with its verdict and where it landed. A proposer
returns a `Proposal`: one flow file and where it came from. Proposers: `evolve` (LLM-free
program evolution, `agents.evolve`); `agents.loop.make_proposer` picks one by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


PROPOSERS = ("evolve", "claude", "openai")


class NoMoreProposals(Exception):
    """A proposer has nothing left to propose (or may not spend more): the search goes on without it."""


@dataclass
class Proposal:
    """One flow file and where it came from."""

    source: str
    proposer: str
    parents: list[str]
    rationale: str = ""
    prompt_hash: str | None = None  # LLM proposers: sha256 of the request
    usage: dict[str, int] | None = None  # LLM proposers: tokens by kind
    cost_usd: float = 0.0


@dataclass
class Context:
    """What a proposer sees in round `round`: `frontier`, the search-set frontier's rows (flow,
    params, relative accuracy, speedup, K/V share), fastest first; `candidates`, every candidate
    so far, oldest first (`harness.Candidate`: source, verdict and reason, `landed`: its best point)."""

    round: int
    goal: str
    frontier: list[dict[str, Any]] = field(default_factory=list)
    candidates: list[Any] = field(default_factory=list)

    @property
    def accepted(self) -> set[str]:
        return {c.name for c in self.candidates if c.verdict == "accepted"}


class Proposer(Protocol):
    name: str

    def propose(self, ctx: Context) -> Proposal: ...
