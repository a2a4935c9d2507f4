"""The engine's row attention in the Triton kernels (`kernels/rows_attention`, the CUDA path; on a
CPU-only machine forced there under the interpreter) against its torch path (gathered keys, SDPA
with masks), on the real model: scattered recomputed rows (CacheBlend), RedKnot's local heads (sinks and windows) and
LoopServe's lines, each over the keys gathered from the pool once per layer."""

from __future__ import annotations

import pytest
import torch

import sparsetune.engine.rows as rows_mod
from sparsetune.kernels import rows_attention as kernels

from helpers import reuse_logits, reuse_parts


# A fresh (not reused) tail of over 64 tokens: a consecutive run among the recomputed rows of every
# layer (the set stays mixed: the row kernel runs it whole).
TAIL = " Answer in one word, after thinking about both documents, the doors, their colours and codes," * 4
CASES = [
    ("cacheblend", {"ratio": "0.3"}, "rows_attention", ""),
    ("cacheblend", {"ratio": "0.3"}, "rows_attention", TAIL),
    ("redknot", {"window": "8", "sink": "2", "global_ratio": "0.3", "ffn_layer": "1000"}, "rows_attention", ""),
    ("loopserve", {"alpha": "0.6"}, "lines_attention", ""),
]


@pytest.mark.slow  # the interpreter runs every layer's attention
@pytest.mark.parametrize("flow,params,kernel,tail", CASES, ids=["cacheblend", "cacheblend-tail", "redknot", "loopserve"])
def test_kernel_path_equals_the_torch_path(smollm_dev, head_file, monkeypatch, flow, params, kernel, tail):
    llm = smollm_dev
    if flow == "redknot":
        params = {**params, "head_classes": head_file}
    parts = reuse_parts() + [tail] if tail else reuse_parts()
    monkeypatch.setattr(rows_mod, "use_kernels", lambda q: False)
    want, want_stats, _, _ = reuse_logits(llm, flow, parts, params)

    calls = {"rows_attention": 0, "lines_attention": 0, "gather": 0, "attend_causal": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(rows_mod, "use_kernels", lambda q: True)
    for name in ("rows_attention", "lines_attention"):
        monkeypatch.setattr(rows_mod, name, counted(name, getattr(kernels, name)))
    monkeypatch.setattr(rows_mod, "attend_causal", counted("attend_causal", rows_mod.attend_causal))
    masked = []  # the torch path's masked calls (what the kernels replace) must not run
    monkeypatch.setattr(rows_mod, "attend_pattern", lambda *a, **kw: masked.append(1))
    monkeypatch.setattr(llm.engine.kv, "gather", counted("gather", llm.engine.kv.gather))
    got, got_stats, _, _ = reuse_logits(llm, flow, parts, params, warm=False)  # the segments are stored

    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    assert got.argmax() == want.argmax()
    assert got_stats.to_dict() | {"seconds": 0} == want_stats.to_dict() | {"seconds": 0}
    layers = llm.model_config.num_hidden_layers
    assert not masked
    # Layers that recompute every row (CacheBlend's layer 0, RedKnot's 2 dense layers) are one
    # consecutive run: the flash causal call. The rest run in the kernel: CacheBlend's scattered rows
    # (with a long fresh tail's run among them the set is still mixed), RedKnot's windows, LoopServe's
    # lines. Every layer gathers the keys once, however many of its hooks read them (+ reuse_logits' own).
    full = {"cacheblend": 1, "redknot": 2, "loopserve": 0}[flow]
    assert calls[kernel] == layers - full and calls["attend_causal"] == full
    assert calls["gather"] == layers + 1


def test_pattern_pairs_count_their_masks():
    """The (row, key) pairs a structured pattern attends (what the FLOP count uses) against its own
    mask, AND-ed with the causal mask and OR-ed with the row's own key, counted entry by entry."""
    from sparsetune.engine.rows import HeadWindows, Lines

    g = torch.Generator().manual_seed(3)
    t, hkv, group = 97, 3, 2
    pos = torch.tensor(sorted(torch.randperm(t, generator=g)[:40].tolist()))
    keys = torch.arange(t)

    def brute(mask):
        seen = (mask & (keys[None, None, :] <= pos[None, :, None])) | (keys[None, None, :] == pos[None, :, None])
        return seen.sum().item() / mask.shape[0]

    windows = HeadWindows(torch.tensor([0, 5, 2]), torch.tensor([HeadWindows.UNBOUNDED, 7, 1]), group, t)
    assert windows.pairs(pos).item() == brute(windows(pos))
    lines = Lines(torch.rand(hkv * group, t, generator=g) < 0.1, torch.rand(hkv * group, t, generator=g) < 0.1)
    lines.slash[0, 0] = True  # a head whose own-key diagonal is a chosen line
    assert lines.pairs(pos).item() == brute(lines(pos))
