"""DoubleSparse: the selection equals the rule implemented directly in torch; channel calibration
records mean|q*k| as an independent HF computation does; files are validated; CLI end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from sparsetune.errors import SparsetuneError
from sparsetune.calibration.channels import builtin_text, calibrate
from sparsetune.models.artifacts import artifact_path, load_calibration, resolve_calibration, synthetic_calibration
from sparsetune.loader import build_flow, get_flow_class
from sparsetune.flow.attention import FlowAttention
from helpers import HEAD_DIM, HKV, GROUP, paged_case, prefill_cache, selected_sets, reference_selection, block_keys

CAL_TOKENS = 256
# Not the text's start, so the `text=` argument really is what runs.
CAL_TEXT = builtin_text().split("A Short History of Maps", 1)[1]


@pytest.mark.parametrize("block_size", [1, 16])  # 1: token-level DoubleSparse
def test_selection_matches_rule(block_size):
    lens = [23 * block_size + 5, 9 * block_size, 40 * block_size - 1]
    kv, bt, meta, q = paged_case(block_size, lens, seed=block_size)
    flow = build_flow("double_sparse", {"budget": str(6 * block_size), "block_size": str(block_size), "channels": "8",
                                        "sink_blocks": "1", "local_blocks": "2"})
    order = synthetic_calibration(1, HKV, HEAD_DIM, seed=block_size)
    attn = FlowAttention(flow, HEAD_DIM**-0.5, calibration=order)
    prefill_cache(attn, kv, bt, lens)
    assert attn.fields[0]["label"].shape[1:] == (HKV, block_size, 8)  # the label cache: r channels per key
    got = selected_sets(attn, kv, bt, meta, q)
    for b, n in enumerate(lens):
        nblocks, nfull = -(-n // block_size), n // block_size
        for h in range(HKV):
            chans = torch.tensor(order[0][h][:8])
            keys = block_keys(kv, bt, b, h, nfull)[:, :, chans]  # [nfull, bs, r]: only full blocks are cached
            qg = q[b, h * GROUP : (h + 1) * GROUP][:, chans]  # [G, r]
            s = torch.einsum("gc,ntc->ngt", qg, keys).amax((1, 2))  # max over the block's tokens and the group
            score = torch.cat([s, torch.zeros(nblocks - nfull, dtype=s.dtype)])  # partial block is forced anyway
            want = reference_selection(score, nblocks, 6, 1, 2)
            assert got[b][h] == want, (b, h)
            assert len(want) < nblocks


def test_channels_must_fit_head_dim():
    flow = build_flow("double_sparse", {"channels": "64"})
    with pytest.raises(SparsetuneError, match="channels=64: the model's heads have 32 channels"):
        FlowAttention(flow, HEAD_DIM**-0.5, calibration=synthetic_calibration(1, HKV, HEAD_DIM))


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    return calibrate(model="smollm2-135m", text=CAL_TEXT, tokens=CAL_TOKENS, device="cpu",
                     out=tmp_path_factory.mktemp("calibration") / "smollm.json")


def test_calibration_file(calibration, smollm, smollm_hf):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    data = json.loads(calibration.read_text())
    cfg = smollm.model_config
    L, H, D, G = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    assert (data["model"], data["num_layers"], data["num_kv_heads"], data["head_dim"], data["tokens"]) == (
        "smollm2-135m", L, H, D, CAL_TOKENS)
    scores = torch.tensor(data["scores"], dtype=torch.float64)
    assert scores.shape == (L, H, D)
    for layer in range(L):
        for h in range(H):
            order = data["channels"][layer][h]
            assert sorted(order) == list(range(D))
            ranked = scores[layer, h, order]
            assert bool((ranked[:-1] >= ranked[1:]).all())  # most important first
    # Independent: HF's attention inputs, projected and rotated in float64 by HF's own RoPE.
    ids = smollm.tokenizer.encode(CAL_TEXT)[:CAL_TOKENS]
    seen = {}

    def grab(module, args, kwargs):
        seen[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    hooks = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in smollm_hf.model.layers]
    try:
        with torch.no_grad():
            smollm_hf(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    n = len(ids)
    for layer in range(L):
        hidden, (cos, sin) = seen[layer]
        attn = smollm_hf.model.layers[layer].self_attn
        q = (hidden.double() @ attn.q_proj.weight.double().T).view(1, n, H * G, D).transpose(1, 2)
        k = (hidden.double() @ attn.k_proj.weight.double().T).view(1, n, H, D).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
        want = (q[0].view(H, G, n, D) * k[0][:, None]).abs().sum(1).mean(1)  # [H, D]: Σ group, mean tokens
        # Agrees to ~3e-8 (the models' float32 differences); the pre-RoPE statistic is 5-30% off.
        assert torch.allclose(scores[layer], want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), layer


def test_load_calibration_rejects_wrong_shapes(calibration, tmp_path):
    data = json.loads(calibration.read_text())
    assert load_calibration(calibration, 30, 3, 64) == data["channels"]
    for key, value, needle in [("num_layers", 28, "num_layers 28 (the model has 30)"),
                               ("head_dim", 128, "head_dim 128 (the model has 64)")]:
        bad = tmp_path / f"{key}.json"
        bad.write_text(json.dumps({**data, key: value}))
        with pytest.raises(SparsetuneError) as e:
            load_calibration(bad, 30, 3, 64, model="smollm2-135m")
        assert needle in str(e.value) and "sparsetune flows calibrate --model smollm2-135m" in str(e.value)
    broken = json.loads(calibration.read_text())
    broken["channels"][4][1][0] = broken["channels"][4][1][1]  # not a permutation any more
    (tmp_path / "dup.json").write_text(json.dumps(broken))
    with pytest.raises(SparsetuneError, match="a permutation of the 64 channel indices"):
        load_calibration(tmp_path / "dup.json", 30, 3, 64)


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_auto_calibration_is_the_models_default_file(calibration, smollm, tmp_path, monkeypatch):
    from sparsetune.llm import LLM
    from sparsetune.engine.sequence import SamplingParams

    monkeypatch.setattr("sparsetune.models.artifacts.models_dir", lambda: tmp_path / "models")
    assert artifact_path("smollm2-135m") == tmp_path / "calibration" / "smollm2-135m.json"
    assert artifact_path("smollm2-135m", random_weights=True).name == "smollm2-135m-random-weights.json"
    flow = build_flow("double_sparse")
    with pytest.raises(SparsetuneError) as e:
        resolve_calibration(flow.calibration, flow.name, "smollm2-135m", False, 30, 3, 64)
    assert str(e.value) == ("double_sparse needs channel calibration for smollm2-135m: run "
                            "`sparsetune flows calibrate --model smollm2-135m` (or pass --param calibration=FILE)")
    artifact_path("smollm2-135m").parent.mkdir(parents=True)
    artifact_path("smollm2-135m").write_text(calibration.read_text())
    # The engine finds it for its model; at a generous budget the flow decodes exactly as dense.
    prompts = ["What is the capital of France?", "Name three primary colours and say which one you like most."]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    dense = [o.token_ids for o in smollm.generate(prompts, params)]
    llm = LLM(model="smollm2-135m", device="cpu", num_kv_blocks=64, flow="double_sparse", params={"budget": "4096"})
    assert [o.token_ids for o in llm.generate(prompts, params)] == dense
    assert llm.engine.backends[5].fields[5]["label"].shape[-2:] == (16, 16)  # block 16 x 16 channels, the default


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparsetune.cli.main", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_cli_calibrate_then_generate(tmp_path):
    out = tmp_path / "cal.json"
    proc = _cli("flows", "calibrate", "--model", "smollm2-135m", "--tokens", "128", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"path": str(out), "model": "smollm2-135m", "tokens": 128, "num_layers": 30}
    load_calibration(out, 30, 3, 64)
    proc = _cli("generate", "--flow", "double_sparse", "--param", f"calibration={out}", "--prompt", "hi",
                "--max-new-tokens", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["flow"] == "double_sparse" and result["completion_tokens"] > 0


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_cli_calibration_errors_are_one_line(tmp_path):
    for args in (["flows", "calibrate", "--text", str(tmp_path / "missing.txt")],
                 ["generate", "--flow", "double_sparse", "--param", f"calibration={tmp_path / 'none.json'}",
                  "--prompt", "hi"]):
        proc = _cli(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().startswith("error:") and ("no such file" in proc.stderr or "does not exist" in proc.stderr)


def test_check_wants_const_by_name(tmp_path):
    """A stage's third parameter must be `const`: the runtime passes it by that meaning."""
    path = tmp_path / "consts.py"
    path.write_text(
        "from sparsetune.flow import DecodeFlow\n"
        "from sparsetune.flow import ops as F\n\n\n"
        "class Consts(DecodeFlow):\n"
        '    name = "consts"\n\n'
        "    def cache(self, k, v):\n"
        '        return {"c": F.mean(k, dim=1)}\n\n'
        "    def index(self, q, fields, consts):\n"
        '        return F.topk(F.max(F.gemm(fields["c"], q), dim=2))\n'
    )
    from sparsetune.flow.check import check_flow

    with pytest.raises(SparsetuneError, match=r"consts.py:11: index\(\) takes \(self, q, fields\) plus, optionally, `const`"):
        check_flow(get_flow_class(str(path), all_problems=True))
