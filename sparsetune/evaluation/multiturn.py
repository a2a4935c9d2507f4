"""The multi-turn task: three turns, each with its own context, questions at varying positions.

After LoopServe's multi-turn long-context benchmark (arXiv 2507.13681, §4): every turn brings a
new context, its question may sit at the beginning, in the middle or at the end of that context,
and a later question can depend on an earlier turn. LoopServe builds its turns from LongBench QA
data; this task builds them offline from RULER-style needles in filler prose, so the answers are
exact and scorable by substring match.
"""

from __future__ import annotations

from sparsetune.evaluation.ruler import (
    NEEDLE,
    Prose,
    fit,
    insert_at_depths,
    random_depths,
    random_keys,
    random_numbers,
    sample_rng,
)
from sparsetune.evaluation.samples import Sample, Turn
from sparsetune.models.tokenizer import Tokenizer

TASK = "multiturn"
TURNS = 3
POSITIONS = ("begin", "middle", "end")
# "context": the last turn asks for turn 1's distractor, a value that only turn 1's context holds.
# "reply": it asks for the value the model gave in its first answer (found in that reply and in turn 1's context).
DEPENDENCIES = ("context", "reply")
INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about them now and later. Answer with the numbers only."
)


def question(key: str) -> str:
    return f"What is the special magic number for {key} mentioned in the provided text?"


def dependent_question(key: str, dependency: str) -> str:
    if dependency == "context":
        return f"What is the special magic number for {key} mentioned in the first text I gave you?"
    return f"What was the special magic number for {key} that you gave in your first answer?"


def user_message(sentences: list[str], ask: str, position: str) -> str:
    """The turn's text with its question at the beginning, in the middle (at a sentence boundary) or at the end."""
    ask = f"Question: {ask}"
    if position == "begin":
        parts = [INTRO, ask, " ".join(sentences)]
    elif position == "middle":
        half = len(sentences) // 2
        parts = [INTRO, " ".join(sentences[:half]), ask, " ".join(sentences[half:])]
    else:
        parts = [INTRO, " ".join(sentences), ask]
    return "\n\n".join(parts)


def multiturn_sample(tokenizer: Tokenizer, context: int, seed: int, index: int) -> Sample:
    """Three turns of filler prose with needles; the last question depends on the first turn.

    Turn 1 holds two needles (one asked for, one distractor), turns 2 and 3 one each; each turn
    asks for its own needle's value. Turn 3 also asks, by `DEPENDENCIES[index % 2]`, either for
    turn 1's distractor (only in turn 1's context) or for the value the model gave in its first
    answer, so its answers are (turn 3's value, the earlier value). Question positions rotate:
    turn t of sample i puts its question at `POSITIONS[(i + t) % 3]`, so every sample has all three
    and each turn sees each position across samples. The turns share the context evenly (their
    numbers of filler sentences differ by at most one); the last turn's prompt, with the gold
    answers as earlier replies, fills `context`. `meta` records the positions, the dependency and
    every needle's depth.
    """
    rng = sample_rng(seed, TASK, index)
    keys = random_keys(rng, 4)
    values = random_numbers(rng, 4, 7)
    # keys[0]: turn 1's question, keys[1]: turn 1's distractor, keys[2] / keys[3]: turns 2 / 3.
    needles = [[(keys[0], values[0]), (keys[1], values[1])], [(keys[2], values[2])], [(keys[3], values[3])]]
    rng.shuffle(needles[0])
    depths = [random_depths(rng, len(n)) for n in needles]
    streams = [Prose(rng.getrandbits(64)) for _ in range(TURNS)]
    positions = [POSITIONS[(index + t) % len(POSITIONS)] for t in range(TURNS)]
    dependency = DEPENDENCIES[index % len(DEPENDENCIES)]
    dependent_key, dependent_value = (keys[1], values[1]) if dependency == "context" else (keys[0], values[0])
    asks = [
        (question(keys[0]), (values[0],)),
        (question(keys[2]), (values[2],)),
        (f"{question(keys[3])} {dependent_question(dependent_key, dependency)}", (values[3], dependent_value)),
    ]
    meta_needles = [[{"key": k, "value": v, "depth": d} for (k, v), d in zip(n, ds)] for n, ds in zip(needles, depths)]

    def build(units: int) -> Sample:
        turns = []
        for t in range(TURNS):
            share = (units + TURNS - 1 - t) // TURNS  # the earlier turns take the remainder's sentences
            sentences = insert_at_depths(
                streams[t].take(share), [NEEDLE.format(key=k, value=v) for k, v in needles[t]], depths[t]
            )
            ask, answers = asks[t]
            turns.append(Turn(user_message(sentences, ask, positions[t]), answers))
        meta = {
            "units": units,  # filler sentences, all turns together
            "positions": positions,
            "dependency": dependency,
            "depends_on": 0,
            "needles": meta_needles,
        }
        return Sample(TASK, index, tuple(turns), meta=meta)

    return fit(tokenizer, context, TASK, build, minimum=2 * TURNS)
