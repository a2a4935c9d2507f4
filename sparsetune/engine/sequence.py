"""A request as the engine tracks it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparsetune.engine.rows import PlannedPrefill

_ids = itertools.count()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 → greedy
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Teacher forcing (fidelity): append these tokens instead of sampling, one per step.
    forced_tokens: tuple[int, ...] = ()
    keep_logits: bool = False  # keep each sampled position's float32 logits on the host (Sequence.logits)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.forced_tokens and self.max_tokens > len(self.forced_tokens):
            raise ValueError("max_tokens must not exceed the number of forced tokens")


@dataclass
class RequestEvents:
    """When things happened to a request, in `time.perf_counter` seconds (None: not yet)."""

    arrival: float | None = None  # added to the engine (or the time the caller gave)
    scheduled: float | None = None  # first in a batch (or admitted prefilled)
    first_token: float | None = None
    tokens: list[float] = field(default_factory=list)  # each generated token, the first included
    finished: float | None = None  # stopped, reached its length, or aborted

    def to_dict(self) -> dict[str, object]:
        return {"arrival": self.arrival, "scheduled": self.scheduled, "first_token": self.first_token,
                "tokens": list(self.tokens), "finished": self.finished}


class Status(Enum):
    WAITING = "waiting"  # needs (more) prefill: new, chunked, or preempted
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass
class Sequence:
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = 0
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    finish_reason: str | None = None
    num_preemptions: int = 0
    logits: list = field(default_factory=list)  # per generated position, when params.keep_logits
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of computed full blocks (prefix caching)
    cacheable: bool = True  # False: its KV must not be found by other prompts (reuse-flow prefill)
    num_cached_tokens: int = 0  # prompt tokens its last admission took from the prefix cache
    cache_salt: bytes = b""  # seeds its prefix-cache hashes: prompts find only blocks of the same salt
    plan: PlannedPrefill | None = None  # prefilled by a plan of rows (a reuse request); None once it ran
    admitted: bool = False  # its plan has taken what it reuses (`PlannedPrefill.admit`)
    events: RequestEvents = field(default_factory=RequestEvents)

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens
