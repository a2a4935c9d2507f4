"""Prompts made of parts: plain text, or reusable segments whose KV may come from the segment cache.

A request is a list of parts, each plain text or `{"text": ..., "reuse": true, "namespace": "kb1"}`.
Each part is tokenized on its own and the ids are concatenated, so a segment has the same ids
wherever it appears and its cache key (tokens + namespace) finds it at any position. With a chat
template, the template's text before and after the user message becomes two plain parts.

Segments are stored in whole KV blocks (the tail block padded) and moved into a request by a
token-granular copy-and-rotate, so a segment may start at any position of a prompt: no padding
tokens are inserted into the prompt (they would change what the model reads).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from typing import TYPE_CHECKING

from sparsetune.errors import SparsetuneError

if TYPE_CHECKING:
    import torch

PART_KEYS = {"text", "reuse", "namespace", "pin"}


DEFAULT_NAMESPACE = "default"


def prefix_salt(namespace: str) -> bytes:
    """The prefix-cache salt of a namespace (`Sequence.cache_salt`): a segment stored in it is found
    as a prefix by prompts of the same salt only. The default namespace is the unsalted one, that
    of plain prompts."""
    if namespace == DEFAULT_NAMESPACE:
        return b""
    return hashlib.blake2b(namespace.encode("utf-8"), digest_size=16, person=b"sparsetune-ns").digest()


@dataclass(frozen=True)
class Part:
    text: str
    reuse: bool = False
    namespace: str = DEFAULT_NAMESPACE
    pin: bool = False  # keep the segment through idle periods ("frozen")


@dataclass(frozen=True)
class Span:
    """Tokens `[start, end)` of the prompt that came from one part."""

    start: int
    end: int
    reuse: bool
    namespace: str
    pin: bool = False

    def __len__(self) -> int:
        return self.end - self.start


@dataclass
class ReuseLayout:
    """A prompt's token ids and which spans of them are reusable segments."""

    token_ids: list[int]
    spans: list[Span]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def segments(self) -> list[Span]:
        return [s for s in self.spans if s.reuse]

    def reused_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        import torch

        """`[T]` bool: True at tokens of reusable segments."""
        mask = torch.zeros(self.num_tokens, dtype=torch.bool, device=device)
        for s in self.segments:
            mask[s.start : s.end] = True
        return mask

    @property
    def num_reused(self) -> int:
        return sum(len(s) for s in self.segments)


def parse_parts(obj: Any, where: str = "prompt") -> list[Part]:
    """JSON-like parts (a list of strings or {"text", "reuse", "namespace", "pin"} objects) → `Part`s.

    Errors name the part and field (`where` prefixes them, e.g. "tasks.jsonl:3: segments").
    """
    if not isinstance(obj, list) or not obj:
        raise SparsetuneError(f"{where}: expected a non-empty list of parts (strings or {{\"text\": ..., \"reuse\": true}})")
    parts = []
    for i, p in enumerate(obj):
        at = f"{where}[{i}]"
        if isinstance(p, str):
            p = {"text": p}
        if not isinstance(p, dict):
            raise SparsetuneError(f"{at}: expected a string or an object with \"text\", got {type(p).__name__}")
        extra = set(p) - PART_KEYS
        if extra:
            raise SparsetuneError(f"{at}: unknown field(s) {sorted(extra)}; a part has {sorted(PART_KEYS)}")
        text = p.get("text")
        if not isinstance(text, str) or not text:
            raise SparsetuneError(f"{at}.text: expected a non-empty string")
        reuse, pin, ns = p.get("reuse", False), p.get("pin", False), p.get("namespace", DEFAULT_NAMESPACE)
        if not isinstance(reuse, bool) or not isinstance(pin, bool):
            raise SparsetuneError(f"{at}: \"reuse\" and \"pin\" must be true or false")
        if not isinstance(ns, str) or not ns:
            raise SparsetuneError(f"{at}.namespace: expected a non-empty string")
        if pin and not reuse:
            raise SparsetuneError(f"{at}: \"pin\" applies to reusable segments; add \"reuse\": true")
        parts.append(Part(text, reuse, ns, pin))
    return parts


def encode_parts(tokenizer, parts: list[Part], chat: bool = True, suffix: str = "") -> ReuseLayout:
    """Tokenize each part on its own (and the chat frame around them) into one `ReuseLayout`;
    `suffix` is plain text after the frame (the start of the reply, e.g. RULER's answer prefix)."""
    if tokenizer is None:
        raise SparsetuneError("prompts with segments need the model's tokenizer")
    if chat:
        before, after = tokenizer.chat_frame()
        parts = ([Part(before)] if before else []) + list(parts) + ([Part(after)] if after else [])
    if suffix:
        parts = list(parts) + [Part(suffix)]
    ids: list[int] = []
    spans: list[Span] = []
    for p in parts:
        toks = tokenizer.encode(p.text)
        if not toks:
            continue
        spans.append(Span(len(ids), len(ids) + len(toks), p.reuse, p.namespace, p.pin))
        ids.extend(toks)
    if not ids:
        raise SparsetuneError("the prompt is empty")
    return ReuseLayout(ids, spans)


def is_parts(prompt: Any) -> bool:
    """A prompt given as parts (a list of `Part`, dicts or strings), not text or token ids."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], (Part, dict, str))


def parse_parts_any(prompt: list) -> list[Part]:
    """`Part` objects as they are; JSON-like parts parsed and validated."""
    if all(isinstance(p, Part) for p in prompt):
        return list(prompt)
    return parse_parts([p if not isinstance(p, Part) else vars(p) for p in prompt])
