"""Reuse workloads of `sparsetune bench serve --reuse`: prompts made of reusable segments, drawn once
from a seed as token ids (a speed benchmark: the text is meaningless), so every cell serves the same
prompts.

- `rag`: a corpus of `docs` documents of `doc_len` tokens; each prompt holds `per_prompt` of them,
  drawn without replacement by Zipf popularity (`zipf`: document i has weight 1 / (i + 1)^zipf), in
  the order drawn, then a question of `question_len` fresh tokens. The corpus is stored before each
  cell (a warm corpus) unless `warm` is off.
- `chat`: sessions of `per_prompt` turns. Turn t re-sends the session's earlier turns (each a
  `doc_len`-token message and its reply, one segment per turn, in a namespace per session) after a
  fresh note of 1 to `question_len` tokens, so the history moves to other positions every turn
  (LoopServe's and SparseX's multi-round setting), then the new message. Sessions are interleaved:
  every session's turn t arrives before any turn t + 1. Nothing is stored before a cell, and a
  finished request's KV is not kept as a segment (the engine does not do that yet): a turn is
  stored by the first later turn that re-sends it (a fill, a miss), and found by the ones after.
- `agent`: `agents` agents, each with a role prompt of `doc_len` tokens, share a pool of `docs` tool
  outputs of `doc_len` tokens; a prompt is an agent's role prompt, `per_prompt` tool outputs (Zipf
  popularity) and a task of `question_len` tokens. Role prompts and tool outputs are stored before
  each cell.

Segments outside chat live in the default namespace, whose stored segments are prefix-cache
entries too: a prompt that starts with one is a prefix hit where prefix caching is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsetune.errors import SparsetuneError
from sparsetune.reuse.parts import DEFAULT_NAMESPACE, ReuseLayout, Span

WORKLOADS = ("rag", "chat", "agent")


@dataclass(frozen=True)
class ReuseWorkload:
    name: str = "rag"
    docs: int = 64
    per_prompt: int = 8
    doc_len: int = 4096
    question_len: int = 64
    zipf: float = 1.0
    agents: int = 4
    warm: bool = True

    def check(self) -> None:
        if self.name not in WORKLOADS:
            raise SparsetuneError(f"--workload {self.name!r}: use one of {', '.join(WORKLOADS)}")
        for option, value, low in (("--docs", self.docs, 1), ("--per-prompt", self.per_prompt, 1),
                                   ("--doc-len", self.doc_len, 1), ("--question-len", self.question_len, 1),
                                   ("--agents", self.agents, 1)):
            if value < low:
                raise SparsetuneError(f"{option} {value}: it must be at least {low}")
        if not (self.zipf >= 0 and np.isfinite(self.zipf)):
            raise SparsetuneError(f"--zipf {self.zipf}: the Zipf exponent is a number >= 0 (0: uniform popularity)")
        if self.name in ("rag", "agent") and self.per_prompt > self.docs:
            what = "documents" if self.name == "rag" else "tool outputs"
            raise SparsetuneError(f"--per-prompt {self.per_prompt} exceeds --docs {self.docs}: a prompt draws distinct "
                                  f"{what} from the {self.docs}; lower --per-prompt or raise --docs")

    def max_prompt_len(self, max_output: int) -> int:
        """The longest prompt the workload can draw (tokens), for the admission check (`max_output`:
        the longest reply, which a chat history re-sends)."""
        if self.name == "rag":
            return self.per_prompt * self.doc_len + self.question_len
        if self.name == "agent":
            return (self.per_prompt + 1) * self.doc_len + self.question_len
        return self.question_len + (self.per_prompt - 1) * (self.doc_len + max_output) + self.doc_len


@dataclass
class Drawn:
    """A workload's prompts, and the segments stored before each cell (`corpus`: layouts of one segment)."""

    layouts: list[ReuseLayout]
    corpus: list[ReuseLayout]


def _zipf(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


def _layout(pieces: list[tuple[list[int], bool, str]]) -> ReuseLayout:
    ids: list[int] = []
    spans = []
    for toks, reuse, ns in pieces:
        spans.append(Span(len(ids), len(ids) + len(toks), reuse, ns))
        ids.extend(toks)
    return ReuseLayout(ids, spans)


def draw(w: ReuseWorkload, n: int, vocab: int, seed: int, reply_len: list[int]) -> Drawn:
    """`n` prompts of workload `w` from `seed` (`reply_len[i]`: request i's output length, the length
    of its synthetic reply in a chat history)."""
    rng = np.random.default_rng(seed)
    toks = lambda k: rng.integers(0, vocab, k).tolist()  # noqa: E731
    ns = DEFAULT_NAMESPACE
    if w.name == "chat":
        sessions = -(-n // w.per_prompt)
        history: list[list[list[int]]] = [[] for _ in range(sessions)]
        layouts = []
        for j in range(n):
            s = j % sessions
            msg = toks(w.doc_len)
            pieces = [(toks(int(rng.integers(1, w.question_len + 1))), False, ns)]
            pieces += [(turn, True, f"session-{s}") for turn in history[s]]
            pieces.append((msg, False, ns))
            layouts.append(_layout(pieces))
            history[s].append(msg + toks(reply_len[j]))  # the turn as the next one re-sends it
        return Drawn(layouts, [])
    pool = [toks(w.doc_len) for _ in range(w.docs)]
    roles = [toks(w.doc_len) for _ in range(w.agents)] if w.name == "agent" else []
    p = _zipf(w.docs, w.zipf)
    layouts = []
    for _ in range(n):
        picked = rng.choice(w.docs, size=w.per_prompt, replace=False, p=p)
        pieces = [(roles[int(rng.integers(w.agents))], True, ns)] if roles else []
        pieces += [(pool[int(i)], True, ns) for i in picked]
        pieces.append((toks(w.question_len), False, ns))
        layouts.append(_layout(pieces))
    corpus = [_layout([(d, True, ns)]) for d in roles + pool] if w.warm else []
    return Drawn(layouts, corpus)
