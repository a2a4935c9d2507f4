"""The values a flow program handles: flow tensors (`FT`), the indexer's `Fields`, its
`Selection`, and `FlowError` for misuse. `flow.ops` re-exports them (`F.FT`, ...)."""

from __future__ import annotations

import keyword
from dataclasses import dataclass

import torch

from sparsetune.errors import SparsetuneError


class FlowError(Exception):
    """A misuse of the flow language; the message names the flow file and line."""


@dataclass
class FT:
    """Flow tensor: data `[R, S, a, b]`, optional block-validity mask `[R, S]`."""

    data: torch.Tensor
    mask: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.data.shape[1:])  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"FT{list(self.shape)}"


class Fields(dict):
    """The fields an indexer sees (name → `[S, r, c]`). Records which were read, and values
    saved with `F.save` (state carried to the next decode step, e.g. H2O's accumulated mass)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.read: set[str] = set()
        self.saved: dict[str, FT] = {}

    def __getitem__(self, key: str) -> FT:
        if key not in self:
            hint = " (raw keys need `uses_keys = True` on the flow)" if key == "k" else ""
            raise KeyError(f"field {key!r} is not written by cache(){hint}; it writes: {', '.join(self) or 'nothing'}")
        self.read.add(key)
        return super().__getitem__(key)


@dataclass
class Selection:
    """What an indexer returns: block scores to rank (None: only the always-kept blocks)."""

    score: FT | None


def check_name(name: object, what: str = "flow name") -> str:
    """A flow `name` is an identifier (it names files, kernels and log lines): else one error."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or len(name) > 64:
        raise SparsetuneError(f"{what} {str(name)[:80]!r} is not a Python identifier of at most 64 characters "
                              "(letters, digits, underscores); rename the flow")
    return name
