"""The task registry of `sparsetune eval`: names, descriptions, generation lengths, generators.

A task is either a built-in generator (RULER-style tasks in `ruler.py`, the multi-turn task in
`multiturn.py`), sized to `--context` tokens, or a custom JSONL file (`custom.py`), used as is.
Generation lengths are below RULER's where its answers are short (niah 128 -> 32 or 48 for four
numbers, cwe 120 -> 64): small models answer early, and CPU runs pay for every token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

from sparsetune.errors import SparsetuneError
from sparsetune.evaluation.custom import load_jsonl
from sparsetune.evaluation.multiturn import multiturn_sample
from sparsetune.evaluation.ruler import cwe_sample, fwe_sample, niah_sample, vt_sample
from sparsetune.evaluation.reuse_tasks import agent_sample, chat_sample, rag_sample
from sparsetune.evaluation.samples import Sample
from sparsetune.models.tokenizer import Tokenizer

Generator = Callable[[Tokenizer, int, int, int], list[Sample]]  # (tokenizer, context_tokens, n_samples, seed)
SampleFn = Callable[[Tokenizer, int, int, int], Sample]  # (tokenizer, context_tokens, seed, index)


@dataclass(frozen=True)
class TaskSpec:
    name: str
    family: str  # "ruler" | "multiturn" | "reuse"
    description: str  # for `sparsetune eval --list-tasks`
    max_new_tokens: int  # default generation length
    generate: Generator
    metric: str = "all"  # RULER's string_match_all for every generated task


def _each(make: SampleFn, max_new_tokens: int) -> Generator:
    """A generator drawing sample i from `make(..., i)` alone, so sample i does not depend on n."""

    def generate(tokenizer: Tokenizer, context: int, n: int, seed: int) -> list[Sample]:
        return [replace(make(tokenizer, context, seed, i), max_new_tokens=max_new_tokens) for i in range(n)]

    return generate


def _spec(name: str, family: str, description: str, max_new_tokens: int, make: SampleFn) -> TaskSpec:
    return TaskSpec(name, family, description, max_new_tokens, _each(make, max_new_tokens))


_SPECS = (
    _spec(
        name="niah_single",
        family="ruler",
        description="Repeated noise sentences hide one needle 'One of the special magic numbers for {key} is: "
        "{value}.'; asks for the key's 7-digit number. Answer: that number.",
        max_new_tokens=32,
        make=partial(niah_sample, "niah_single"),
    ),
    _spec(
        name="niah_multikey",
        family="ruler",
        description="Filler prose hides 4 needles with different keys; asks for one key's 7-digit number (the "
        "other 3 are distractors). Answer: that number.",
        max_new_tokens=32,
        make=partial(niah_sample, "niah_multikey"),
    ),
    _spec(
        name="niah_multivalue",
        family="ruler",
        description="Filler prose hides 4 needles giving one key 4 different 7-digit numbers; asks for all of "
        "them. Answers: the 4 numbers, scored by the fraction found.",
        max_new_tokens=48,
        make=partial(niah_sample, "niah_multivalue"),
    ),
    _spec(
        name="niah_multiquery",
        family="ruler",
        description="Filler prose hides 4 needles with different keys; asks for the numbers of all 4 keys. "
        "Answers: the 4 numbers, scored by the fraction found.",
        max_new_tokens=48,
        make=partial(niah_sample, "niah_multiquery"),
    ),
    _spec(
        name="vt",
        family="ruler",
        description="Variable tracking: a 4-hop chain 'VAR A = 12345', 'VAR B = VAR A', ... hidden in noise "
        "sentences, after one solved example; asks which variables hold the value. Answers: the 5 names, "
        "scored by the fraction found.",
        max_new_tokens=30,
        make=vt_sample,
    ),
    _spec(
        name="cwe",
        family="ruler",
        description="Common words: a numbered list where 10 words appear 30 times and the others 3 (6 and 1 "
        "below 4K), after one solved example; asks for the 10 most common. Answers: the 10 words, scored by "
        "the fraction found.",
        max_new_tokens=64,
        make=cwe_sample,
    ),
    _spec(
        name="fwe",
        family="ruler",
        description="Frequent words: coded 6-letter words with Zipf (alpha 2) counts, the most frequent shown "
        "as '...'; asks for the 3 most frequent. Answers: the 3 words, scored by the fraction found.",
        max_new_tokens=50,
        make=fwe_sample,
    ),
    _spec(
        name="multiturn",
        family="multiturn",
        description="3 turns of filler prose with needles, each turn's question at its beginning, middle or "
        "end; the last turn also asks for a number from turn 1. Answers: each turn's numbers, scored by the "
        "fraction found.",
        max_new_tokens=48,
        make=multiturn_sample,
    ),
    _spec(
        name="rag",
        family="reuse",
        description="6 documents of filler prose, one hiding a needle, as reusable segments (namespace 'rag') in "
        "shuffled order after 'Document i:' lines, then the question. With --reuse each document is stored "
        "alone first, then reused. Answer: the needle's number.",
        max_new_tokens=32,
        make=rag_sample,
    ),
    _spec(
        name="chat",
        family="reuse",
        description="One user's 4 earlier turns (filler prose, one telling a needle) as reusable segments (a "
        "namespace per conversation), in order after 'User (turn i):' lines, then the new user message "
        "asking for the number. Answer: the needle's number.",
        max_new_tokens=32,
        make=chat_sample,
    ),
    _spec(
        name="agent",
        family="reuse",
        description="4 tool outputs of agent A (filler prose, one reporting a needle) reused by agent B "
        "(namespace 'agents') in another order after B's role prompt, then B's task. Answer: the needle's number.",
        max_new_tokens=32,
        make=agent_sample,
    ),
)

TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in _SPECS}
DEFAULT_SUITE: tuple[str, ...] = tuple(n for n, s in TASKS.items() if s.family != "reuse")
REUSE_SUITE: tuple[str, ...] = tuple(n for n, s in TASKS.items() if s.family == "reuse")


def is_custom(task: str) -> bool:
    """A task argument naming a file rather than a built-in task."""
    return task.endswith(".jsonl") or Path(task).is_file()


def _spec_of(task: str) -> TaskSpec:
    spec = TASKS.get(task)
    if spec is None:
        raise SparsetuneError(
            f"unknown task {task!r}; use one of {', '.join(TASKS)}, or a path to a .jsonl file of custom tasks"
        )
    return spec


def task_lengths(tasks: list[str] | None, context: int) -> list[tuple[str, int, int]]:
    """Check task names and files without a tokenizer; (what, prompt tokens, generated tokens) for
    each generated task (its prompts are sized to `context`). Custom files are validated here and
    their prompts measured once tokenized."""
    out = []
    for task in tasks or DEFAULT_SUITE:
        if is_custom(task):
            load_jsonl(task)
        else:
            out.append((f"task {task}", context, _spec_of(task).max_new_tokens))
    return out


def build_samples(task: str, tokenizer: Tokenizer, context: int, samples: int, seed: int,
                  limit: int | None = None) -> list[Sample]:
    """The samples of `task` (a built-in name or a .jsonl path) at `context` prompt tokens:
    `samples` of a generated task, every line of a custom file (used as written: `context` and
    `seed` do not apply); `limit` caps either (`task_size` is how many the task has)."""
    if samples < 1:
        raise SparsetuneError(f"--samples {samples} must be at least 1")
    if is_custom(task):
        return load_jsonl(task)[:limit]
    spec = _spec_of(task)
    if context < 1:
        raise SparsetuneError(f"--context {context} must be a positive number of tokens")
    return spec.generate(tokenizer, context, min(samples, limit or samples), seed)


def task_size(task: str, samples: int) -> int:
    """How many samples `task` has before `--limit`: `samples` (generated) or the file's lines."""
    return len(load_jsonl(task)) if is_custom(task) else samples


def list_tasks() -> list[dict]:
    """One row per built-in task, for `sparsetune eval --list-tasks`."""
    return [
        {
            "name": s.name,
            "family": s.family,
            "description": s.description,
            "max_new_tokens": s.max_new_tokens,
            "metric": s.metric,
        }
        for s in TASKS.values()
    ]
