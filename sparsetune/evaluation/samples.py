"""What a task sample is, and how a turn of it becomes prompt tokens.

A sample is one conversation: fixed `history` (chat messages given by a custom task), then one or
more `turns`. Each turn is a user message the model answers; in multi-turn samples the model's own
earlier replies are fed back as assistant messages. A turn may start the assistant's reply with an
`answer_prefix` (RULER's answer prefix), which is part of the prompt, not of the scored output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from sparsetune.models.tokenizer import Tokenizer
from sparsetune.reuse.parts import ReuseLayout, encode_parts, parse_parts

METRICS = ("all", "any")


@dataclass(frozen=True)
class Turn:
    user: str
    answers: tuple[str, ...]
    answer_prefix: str = ""


@dataclass(frozen=True)
class Sample:
    task: str
    index: int
    turns: tuple[Turn, ...]
    metric: str = "all"  # "all": fraction of answers found; "any": 1 if any is found (RULER)
    max_new_tokens: int = 64  # the task's generation length (RULER's tokens_to_generate)
    history: tuple[dict[str, str], ...] = ()  # chat messages before the first turn
    # The first user message as parts (plain text and reusable segments, see reuse/parts.py); the
    # turn's `user` is their text joined. Reuse flows take the segments from the segment cache.
    segments: tuple[dict[str, Any], ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False)  # generator details (depth, position, ...)


def turn_messages(sample: Sample, turn: int, replies: Sequence[str]) -> list[dict[str, str]]:
    """The chat messages for `turn`: history, earlier turns with the model's `replies`, this user message."""
    messages = [dict(m) for m in sample.history]
    for j in range(turn):
        t = sample.turns[j]
        messages.append({"role": "user", "content": t.user})
        messages.append({"role": "assistant", "content": t.answer_prefix + replies[j]})
    messages.append({"role": "user", "content": sample.turns[turn].user})
    return messages


def prompt_layout(tokenizer: Tokenizer, sample: Sample) -> ReuseLayout:
    """The first turn of a sample with `segments` (the user message's parts), tokenized part by
    part inside the chat frame, then the answer prefix: the same ids with or without a reuse flow."""
    parts = parse_parts(list(sample.segments), where=f"{sample.task}[{sample.index}].segments")
    return encode_parts(tokenizer, parts, chat=True, suffix=sample.turns[0].answer_prefix)


def prompt_ids(tokenizer: Tokenizer, sample: Sample, turn: int = 0, replies: Sequence[str] = ()) -> list[int]:
    """Prompt tokens of `turn`: the chat template over `turn_messages`, then the answer prefix."""
    if turn == 0 and sample.segments:
        return prompt_layout(tokenizer, sample).token_ids
    ids = tokenizer.chat_messages(turn_messages(sample, turn, replies))
    prefix = sample.turns[turn].answer_prefix
    return ids + (tokenizer.encode(prefix) if prefix else [])


def gold_replies(sample: Sample) -> list[str]:
    """Stand-ins for the model's replies when sizing a multi-turn prompt: the gold answers."""
    return [", ".join(t.answers) for t in sample.turns]


def final_prompt_tokens(tokenizer: Tokenizer, sample: Sample) -> int:
    """Length of the last turn's prompt, with gold answers as earlier replies: what `--context` sizes."""
    last = len(sample.turns) - 1
    return len(prompt_ids(tokenizer, sample, last, gold_replies(sample)[:last]))
