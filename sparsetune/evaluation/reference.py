"""The dense reference of an evaluation, kept across evaluations on one engine (a search's trials).

Every trial of a search evaluates a flow on the same prompts. Two things are then the same each
time: the dense pass over those prompts (the answers accuracy is relative to, and the logits
fidelity compares against), and each prompt's KV, since a decode flow prefills with full
attention. `DenseReference` keeps both: the dense pass runs once, and a decode flow's turns start
from the stored prompt KV when their prompt is one the dense pass prefilled (every first turn; a
later turn when the history is the dense one: the forced pass, or a flow that answered as dense did) (`LLM.add_prefilled`: written into the flow's blocks, its fields
rebuilt by its cache stage, the first token from the stored logits), so a trial pays for decoding
only. An evaluation with a reference gives the figures it gives without one (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_KV_BYTES = 4 << 30


@dataclass
class PromptKV:
    """A prompt's KV after a dense prefill: `k`, `v` `[layers, kv_heads, n, head_dim]`, and the
    logits of its last position (its first token comes from them)."""

    k: torch.Tensor
    v: torch.Tensor
    logits: torch.Tensor

    def to_host(self) -> "PromptKV":
        return PromptKV(self.k.cpu(), self.v.cpu(), self.logits.cpu())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.logits))


class DenseReference:
    """Per-sample dense passes and prompt KV of one prompt set (`key`: what determines the prompts
    and the dense answers; a different key starts it afresh). `kv_bytes`: how much prompt KV it
    may hold; prompts past it are prefilled as usual."""

    def __init__(self, kv_bytes: int = DEFAULT_KV_BYTES) -> None:
        self.kv_bytes = kv_bytes
        self.key: Any = None
        self.samples: dict[tuple[str, int], dict[str, Any]] = {}  # (task, index) -> the dense pass's slice
        self.prompts: dict[tuple[int, ...], PromptKV] = {}
        self.held = 0
        self.host = False  # prompt KV in host memory (`to_host`)

    def bind(self, key: Any) -> None:
        """Use this reference for the prompt set `key` (everything is dropped when it changes)."""
        if key != self.key:
            self.key, self.samples, self.prompts, self.held = key, {}, {}, 0

    def to_host(self) -> None:
        """Keep the prompt KV in host memory from now on, what is held too (a GPU too short for it
        beside the engines: a search's engines taking turns); a prompt's KV goes to the device as
        it is written into a request's blocks."""
        if not self.host:
            self.host = True
            self.prompts = {ids: kv.to_host() for ids, kv in self.prompts.items()}

    def prompt(self, ids: list[int]) -> PromptKV | None:
        return self.prompts.get(tuple(ids))

    def wants(self, ids: list[int]) -> bool:
        return tuple(ids) not in self.prompts and self.held < self.kv_bytes

    def keep_prompt(self, ids: list[int], kv: PromptKV) -> None:
        if self.wants(ids):
            self.prompts[tuple(ids)] = kv.to_host() if self.host else kv
            self.held += kv.nbytes
