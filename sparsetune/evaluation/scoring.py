"""Scoring of one reply against its answers, with RULER's rules (scripts/eval/evaluate.py, constants.py).

RULER normalizes nothing beyond `postprocess`: an answer counts when it occurs in the reply as a
case-insensitive substring. "all" is RULER's string_match_all (fraction of the answers found);
"any" is string_match_part (1 if any answer is found). Scores here are in [0, 1], not RULER's 0-100.
"""

from __future__ import annotations

import re
from typing import Sequence

from sparsetune.evaluation.samples import METRICS, Sample

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(pred: str) -> str:
    """RULER's postprocess_pred: strip, control characters to newlines, strip again."""
    return _CONTROL.sub("\n", pred.strip()).strip()


def score(pred: str, answers: Sequence[str], metric: str = "all") -> float:
    """The reply's score in [0, 1]: fraction of `answers` found ("all") or whether any is found ("any")."""
    if not answers:
        raise ValueError("score needs at least one answer")
    text = postprocess(pred).lower()
    found = [answer.lower() in text for answer in answers]
    if metric == "all":
        return sum(found) / len(found)
    if metric == "any":
        return 1.0 if any(found) else 0.0
    raise ValueError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")


def score_turns(sample: Sample, replies: Sequence[str]) -> list[float]:
    """Each turn's reply scored against that turn's answers, by the sample's metric."""
    return [score(postprocess(r), list(turn.answers), sample.metric) for turn, r in zip(sample.turns, replies)]
