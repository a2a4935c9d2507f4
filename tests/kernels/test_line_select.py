"""LoopServe's line-selection kernels (interpreted on CPU) against float64 loops over the map's
entries, and against their torch twins, on ragged maps: scattered row positions, a key count that
is not a multiple of the tile, zeros past each row's diagonal."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from sparsetune.kernels.line_select import cover_histogram, cover_histogram_ref, slash_masses, slash_masses_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def causal_map(h: int, rows: list[int], t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(h, len(rows), t, generator=g) * 2
    logits.masked_fill_(torch.arange(t)[None, None, :] > torch.tensor(rows)[None, :, None], float("-inf"))
    return torch.softmax(logits, -1)


@pytest.mark.parametrize("rows,t", [([9, 10, 12, 40], 41), ([0, 3, 77, 78, 79, 100], 130)])
def test_slash_masses_and_the_cover_histogram_match_float64_loops(rows, t):
    h = 3
    probs = causal_map(h, rows, t, seed=t)
    pos = torch.tensor(rows)
    g = torch.Generator().manual_seed(1)
    rank = torch.stack([torch.randperm(2 * t, generator=g) for _ in range(h)])  # any ranking of the 2T lines
    slash = torch.zeros(h, t, dtype=torch.float64)
    hist = torch.zeros(h, 2 * t + 1, dtype=torch.float64)
    for a in range(h):  # the definitions, entry by entry
        for r, p in enumerate(rows):
            for j in range(p + 1):
                x = float(probs[a, r, j])
                slash[a, p - j] += x
                hist[a, min(int(rank[a, j]), int(rank[a, t + p - j])) + 1] += x
    pd, posd, rankd = probs.to(DEV), pos.to(DEV), rank.to(DEV)
    for got in (slash_masses(pd, posd, block=16), slash_masses(pd, posd), slash_masses_ref(pd, posd)):
        torch.testing.assert_close(got.double().cpu(), slash, rtol=1e-6, atol=1e-6)
    for got in (cover_histogram(pd, posd, rankd, block=16), cover_histogram(pd, posd, rankd), cover_histogram_ref(pd, posd, rankd)):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got.cpu(), hist, rtol=1e-6, atol=1e-6)


def test_inputs_the_kernels_cannot_read_are_refused():
    probs = causal_map(2, [3, 4], 5, seed=0)
    with pytest.raises(ValueError, match="float32"):
        slash_masses(probs.double(), torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="pos"):
        cover_histogram(probs, torch.tensor([3]), torch.zeros(2, 10, dtype=torch.long))
