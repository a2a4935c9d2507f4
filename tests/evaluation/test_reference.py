"""A dense reference kept across evaluations (a search's trials) gives the figures an evaluation
without it gives: the dense pass is reused, and a decode flow's first turns start from the stored
prompt KV (its fields rebuilt, on another block size too), decoding exactly as after its own prefill."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparsetune.evaluation.config import EvalConfig
from sparsetune.evaluation.reference import DenseReference
from sparsetune.evaluation.runner import evaluate, read_records
from sparsetune.llm import LLM

KEYS = ("task", "index", "output", "turn_scores", "dense", "fidelity", "prompt_sha256")


def _records(res) -> list[dict]:
    return [{k: r[k] for k in KEYS} for r in read_records(Path(res.run_dir))]


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_an_eval_with_a_dense_reference_equals_one_without(tmp_path):
    llm = LLM(model="smollm2-135m", device="cpu", max_num_seqs=4)
    opts = dict(model="smollm2-135m", tasks=("niah_single", "multiturn"), context=512, samples=1, batch=4,
                max_new_tokens=6)
    quest = EvalConfig.of(flow="quest", params={"block_size": "4", "budget": "64"}, **opts)
    plain = evaluate(quest, out=tmp_path / "plain", llm=llm)
    ref = DenseReference()
    evaluate(EvalConfig.of(flow="block_topk", params={"budget": "64"}, **opts), out=tmp_path / "fill", llm=llm,
             reference=ref)  # fills it, at block size 16
    assert len(ref.samples) == 2 and len(ref.prompts) == 4  # every turn's prompt: 1 + 3 (multiturn)
    prefilled = llm.stats.prefill_tokens
    again = evaluate(quest, out=tmp_path / "again", llm=llm, reference=ref)
    recs = read_records(Path(again.run_dir))
    # Only a later turn after a reply that differs from dense is prefilled (the forced pass never is)
    differing = sum(n for r in recs for t, n in enumerate(r["prompt_tokens"])
                    if t > 0 and r["output"][:t] != r["dense"]["output"][:t])
    assert llm.stats.prefill_tokens - prefilled == differing
    assert _records(again) == _records(plain)
    assert (again.relative_accuracy, again.fidelity) == (plain.relative_accuracy, plain.fidelity)
    ref.bind("another prompt set")
    assert not ref.samples and not ref.prompts and ref.held == 0
