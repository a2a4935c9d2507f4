from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture()
def head_file(tmp_path, smollm):
    """A RedKnot head profile of random scores for the embedded model (what `flows profile-heads` writes)."""
    cfg = smollm.model_config
    scores = torch.rand(cfg.num_hidden_layers, cfg.num_key_value_heads, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "heads.json"
    path.write_text(json.dumps({"scores": scores.tolist()}))
    return str(path)


@pytest.fixture(scope="session")
def smollm_dev(smollm):
    """The embedded model where the row kernels run for real: on the GPU if there is one (float32),
    else the CPU one (its kernels then run under the Triton interpreter)."""
    if not torch.cuda.is_available():
        return smollm
    from sparsetune.llm import LLM

    return LLM(model="smollm2-135m", device="cuda", dtype="float32", max_num_seqs=8, cuda_graph=False)
