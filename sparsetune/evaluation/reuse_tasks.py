"""Reuse workloads: prompts whose bulk is reusable segments, then a question (issue #5).

Every sample is `count` segments of filler prose (the needle, "One of the special magic numbers
for {key} is: {value}.", hides in one of them at a random depth), each introduced by a plain
header line, after a plain instruction and before the plain question; the answer is the needle's
7-digit number. The three workloads differ in what the segments are and where they sit:

- `rag`: retrieved documents, shared by every request (namespace `rag`), in a shuffled order.
- `chat`: the earlier turns of one user's conversation (namespace per conversation), in order, as
  "User (turn i): ... / Assistant: ..." transcripts; the new user message comes after them.
- `agent`: tool outputs that agent A produced, reused by agent B (namespace `agents`) in another
  order, after B's own role prompt.

Two-stage protocol (SparseX §5, appendix): the evaluation first stores every segment on its own
(a cache-building request per segment, computed at position 0), then measures the request, where
the segments sit at other positions and come from the segment cache. (With a needle in every
segment, the 135M default model mostly answers a distractor's number even with full attention,
which would leave nothing for a reuse flow to keep; so there is one needle.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from sparsetune.evaluation.ruler import NEEDLE, Prose, fit, insert_at_depths, random_keys, random_numbers, sample_rng
from sparsetune.evaluation.samples import Sample, Turn
from sparsetune.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class SegmentedTask:
    count: int  # segments per prompt
    intro: str
    header: str  # plain text before segment i ("{i}": its 1-based place in the prompt)
    trailer: str  # the end of each segment's text
    namespace: str  # "{index}": the sample (one conversation per sample)
    question: str  # "{key}"
    prefix: str  # the answer prefix, "{key}"
    shuffle: bool  # segments in another order than they were produced


REUSE_TASKS: dict[str, SegmentedTask] = {
    "rag": SegmentedTask(
        6, "Answer the question using the documents below. A special magic number is hidden in one of them. "
        "Make sure to memorize it. I will quiz you about the number afterwards.\n\n",
        "Document {i}:\n", "\n\n", "rag",
        "Question: What is the special magic number for {key} mentioned in the documents?",
        "The special magic number for {key} mentioned in the documents is", shuffle=True),
    "chat": SegmentedTask(
        4, "This is our conversation so far. Somewhere in it I told you a special magic number.\n\n",
        "User (turn {i}): ", "\nAssistant: Noted, thank you.\n\n", "chat-{index}",
        "User (now): What is the special magic number for {key} that I told you earlier?",
        "The special magic number for {key} you told me is", shuffle=False),
    "agent": SegmentedTask(
        4, "You are agent B, the reviewer. Agent A called the tools below; their outputs are shared with you. "
        "One of them reports a special magic number.\n\n",
        "Tool output {i} (from agent A):\n", "\n\n", "agents",
        "Task for agent B: report the special magic number for {key} that the tools returned.",
        "The special magic number for {key} that the tools returned is", shuffle=True),
}


def segmented_sample(task: str, tokenizer: Tokenizer, context: int, seed: int, index: int) -> Sample:
    spec = REUSE_TASKS[task]
    n = spec.count
    rng = sample_rng(seed, task, index)
    key, value = random_keys(rng, 1)[0], random_numbers(rng, 1, 7)[0]
    depth = rng.randrange(0, 101)
    asked = rng.randrange(n)
    order = list(range(n))
    if spec.shuffle:
        rng.shuffle(order)  # the measured request's order; each segment was cached alone
    prose = [Prose(rng.getrandbits(64)) for _ in range(n)]
    namespace = spec.namespace.format(index=index)

    def build(units: int) -> Sample:
        # `units` filler sentences in all, dealt round the segments (fine steps for the sizing search).
        counts = [units // n + (j < units % n) for j in range(n)]
        texts = [" ".join(p.take(c)) for p, c in zip(prose, counts)]
        texts[asked] = " ".join(insert_at_depths(prose[asked].take(counts[asked]),
                                                 [NEEDLE.format(key=key, value=value)], [depth]))
        parts: list[dict] = [{"text": spec.intro}]
        for place, j in enumerate(order):
            parts.append({"text": spec.header.format(i=place + 1)})
            parts.append({"text": texts[j] + spec.trailer, "reuse": True, "namespace": namespace})
        parts.append({"text": spec.question.format(key=key)})
        user = "".join(p["text"] for p in parts)
        meta = {"units": units, "asked": asked, "depth": depth, "position": order.index(asked), "segments": n}
        return Sample(task, index, (Turn(user, (value,), spec.prefix.format(key=key)),), segments=tuple(parts), meta=meta)

    return fit(tokenizer, context, task, build, minimum=n)


rag_sample = partial(segmented_sample, "rag")
chat_sample = partial(segmented_sample, "chat")
agent_sample = partial(segmented_sample, "agent")
