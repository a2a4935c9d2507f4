"""`EvalResult`: the schema of `results.json`, written by `evaluate`, read back by `--resume` and tools.

Known keys are typed; keys a reader does not know (an older or newer file) are kept as they are.
A key is written only when it was given, so a file read and written again is unchanged (`reuse`
appears with a reuse flow, `samples_done`/`samples_total` with accuracy). Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sparsetune.errors import SparsetuneError
from sparsetune.records import write_json

SCHEMA = "sparsetune.eval/1"


class _Part(BaseModel):
    """A block of results.json."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    def dump(self) -> dict[str, Any]:
        """The JSON object: given keys only, in the schema's order (unknown ones last)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


class Fidelity(_Part):
    """Logit fidelity to dense, pooled over generated positions."""

    cosine: float
    top1: float
    top10: float
    positions: int


class TaskResult(_Part):
    accuracy: float | None
    n: int  # samples run
    total: int | None  # samples the task has (before --limit)
    dense_accuracy: float | None
    fidelity: Fidelity | None


class ReuseResult(_Part):
    """The reuse flow and its prefill stats (means over the reuse requests)."""

    flow: str
    params: dict[str, Any]
    requests: int
    reuse_ratio: float | None
    recompute_ratio: float | None
    compute_fraction: float | None
    mlp_fraction: float | None = None  # per-head and sparse-FFN flows (redknot) only
    fresh_kv_fraction: float | None = None
    head_paged_kv_fraction: float | None = None
    ttft_p50_s: float | None


class SpeedRun(_Part):
    """One engine configuration on synthetic prompts (as the speed measurement reports it)."""

    ttft_s: dict[str, float] | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    tpot_ms: dict[str, float] | None = None
    decode_steps: int | None = None
    total_s: float | None = None
    peak_memory_bytes: int | None = None
    peak_memory_kind: str | None = None
    kv_pool_bytes: int | None = None
    batch: int | None = None
    context: int | None = None
    gen_tokens: int | None = None
    preemptions: int | None = None


class Speed(_Part):
    flow: SpeedRun
    dense: SpeedRun | None  # None when the flow is dense itself
    decode_speedup: float | None


class EvalResult(_Part):
    """`results.json` of one run (complete or partial)."""

    schema_version: str = Field(alias="schema")
    run_dir: str
    flow: str
    model: str
    params: dict[str, Any]  # the decode flow's, resolved
    mode: str  # accuracy, speed or all
    context: int
    samples_per_task: int
    limit: int | None
    seed: int
    device: str
    dtype: str
    note: str | None
    defaults: dict[str, Any] | None = None  # the model's tuned flow defaults the run took (`setup.tuned_defaults`)
    reuse: ReuseResult | None = None
    accuracy: float | None
    dense_accuracy: float | None
    relative_accuracy: float | None
    tasks: dict[str, TaskResult]
    fidelity: Fidelity | None
    samples_done: int | None = None
    samples_total: int | None = None
    speed: Speed | None
    preemptions: int
    complete: bool
    started: str
    finished: str | None
    seconds: float

    def write(self, path: Path) -> None:
        write_json(path, self.dump())

    @classmethod
    def read(cls, path: str | Path) -> EvalResult:
        """A results.json file, or the one in a run directory."""
        path = Path(path)
        if path.is_dir():
            path = path / "results.json"
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except (OSError, ValueError) as e:  # ValidationError and JSONDecodeError are ValueErrors
            why = f"{e.error_count()} field(s) do not fit the schema: {e.errors()[0]['loc']}" if isinstance(
                e, ValidationError) else str(e)
            raise SparsetuneError(f"{path}: not a readable results.json of sparsetune eval ({why})") from None
