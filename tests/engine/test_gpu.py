"""GPU path of the engine (Triton kernels + CUDA graphs) against HF transformers. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from sparsetune.llm import LLM
from sparsetune.models.artifacts import synthetic_calibration, write_calibration
from sparsetune.engine.sequence import SamplingParams
from helpers import hf_logits, assert_logits_match, tiny_hf

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind,extra", [("qwen3", {"head_dim": 64}), ("qwen2", {})])
def test_gpu_engine_matches_hf(kind, extra, tmp_path):
    hf = tiny_hf(kind, tmp_path, **extra).cuda()
    llm = LLM(model=str(tmp_path), device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=4,
              max_num_batched_tokens=64, cuda_graph_batch_sizes=(1, 2, 4))
    assert llm.engine.runner.graphs, "decode CUDA graphs were not captured"
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (150, 37, 90)]
    assert_logits_match(llm.engine.prompt_logits(prompts[0]).cpu(), hf_logits(hf, prompts[0]))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params)  # batch of 3 replays the size-4 graph with one padded row
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert o.token_ids == ref[0, len(p):].tolist()


def test_gpu_preemption_under_graphs_keeps_outputs(tmp_path):
    """A tiny pool forces preemption; re-admitted sequences get new blocks in reused graph rows."""
    tiny_hf("qwen3", tmp_path, head_dim=64)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (40, 55, 23, 61)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    opts = dict(model=str(tmp_path), device="cuda", dtype="float32", max_num_seqs=4, cuda_graph_batch_sizes=(1, 2, 4))
    reference = [o.token_ids for o in LLM(num_kv_blocks=256, **opts).generate(prompts, params)]
    small = LLM(num_kv_blocks=14, **opts)
    outs = small.generate(prompts, params)
    assert small.stats.preemptions > 0
    assert [o.token_ids for o in outs] == reference


def test_gpu_overlapped_steps_keep_outputs(tmp_path):
    """Decode steps launched one ahead on the device's tokens (the default where graphs replay) give
    what steps one at a time give: the same tokens and stops, with requests that stop on a token
    mid-batch and others of other lengths (replays of the size-4 graph with padded rows)."""
    tiny_hf("qwen3", tmp_path, head_dim=64)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (70, 33, 120)]
    opts = dict(model=str(tmp_path), device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=4,
                cuda_graph_batch_sizes=(1, 2, 4))
    one = LLM(overlap=False, **opts)
    long = [o.token_ids for o in one.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))]
    params = [SamplingParams(max_tokens=30, stop_token_ids=(long[0][12],)), SamplingParams(max_tokens=17),
              SamplingParams(max_tokens=30, stop_token_ids=(long[2][20],))]
    ref = one.generate(prompts, params)
    overlapped = LLM(**opts)
    assert overlapped.engine.overlap and not one.engine.overlap
    got = overlapped.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in ref] == ["stop", "length", "stop"]


def _flow_case(tmp_path, seed: int):
    """A tiny qwen3 on disk, engine options with graphs for batches 1, 2 and 4, three prompts."""
    tiny_hf("qwen3", tmp_path, head_dim=64)
    opts = dict(model=str(tmp_path), device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=4,
                cuda_graph_batch_sizes=(1, 2, 4), block_size=8)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (150, 37, 90)]
    return opts, prompts, SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("flow", ["quest", "block_topk", "h2o", "tidal", "double_sparse", "streaming", "loopserve_decode"])
def test_gpu_flow_graphs(flow, tmp_path):
    """Flows on GPU (Triton sparse kernel, indexer inside the CUDA graph): full budget = dense;
    at a small budget, the compiled executor in CUDA graphs = the reference executor run eagerly."""
    opts, prompts, params = _flow_case(tmp_path, seed=11)
    dense = [o.token_ids for o in LLM(**opts).generate(prompts, params)]
    sel = {"select_layers": "1"} if flow == "tidal" else {}
    if flow == "double_sparse":  # a seeded channel order for the tiny model
        order = synthetic_calibration(3, 2, 64)  # tiny_hf: 3 layers, 2 KV heads; head_dim 64 here
        sel = {"calibration": str(write_calibration(tmp_path / "calib.json", "tiny", order, None, 0, "synthetic"))}
    whole, few = ({"local_blocks": "64"}, {"local_blocks": "3"}) if flow == "streaming" else ({"budget_ratio": "1.0"}, {"budget": "32"})
    full = LLM(flow=flow, params={**whole, "dense_layers": "0", **sel}, **opts)
    assert [o.token_ids for o in full.generate(prompts, params)] == dense
    small = {**few, "dense_layers": "0", **sel}
    graphed = LLM(flow=flow, params=small, **opts)
    assert graphed.engine.runner.graphs
    eager = LLM(flow=flow, params=small, cuda_graph=False, executor="reference", **opts)
    assert graphed.engine.backends[1].executor == "compiled" and eager.engine.backends[1].executor == "reference"
    assert [o.token_ids for o in graphed.generate(prompts, params)] == [o.token_ids for o in eager.generate(prompts, params)]


@pytest.mark.parametrize("flow", ["quest", "block_topk"])
def test_gpu_retune_keeps_graphs_and_decodes_like_a_fresh_engine(flow, tmp_path):
    """A switch that changes no shape (sink/local blocks; a budget of the same number of blocks)
    keeps the captured graphs, which then read the new budget rule: same tokens as an engine built
    with that flow. A new selection width recaptures them."""
    opts, prompts, params = _flow_case(tmp_path, seed=12)
    first, second = {"budget": "48", "dense_layers": ""}, {"budget": "41", "sink_blocks": "0", "local_blocks": "1",
                                                           "dense_layers": ""}
    llm = LLM(flow=flow, params=first, **opts)
    before = [o.token_ids for o in llm.generate(prompts, params)]
    graph = llm.engine.decode_graph(4)
    llm.apply(llm.setup.with_flow(flow, second))
    assert llm.engine.decode_graph(4) is graph  # 6 blocks either way: the graphs stay
    retuned = [o.token_ids for o in llm.generate(prompts, params)]
    assert retuned != before  # the graphs read the new rule (3 scored blocks of 6, then 5)
    assert retuned == [o.token_ids for o in LLM(flow=flow, params=second, **opts).generate(prompts, params)]
    llm.apply(llm.setup.with_flow(flow, {"budget": "96", "dense_layers": ""}))
    assert llm.engine.decode_graph(4) is not graph


def test_gpu_eval_with_a_dense_reference_equals_one_without(tmp_path):
    """A search's trials on the GPU (compiled stages, CUDA graphs): starting from the stored prompt
    KV gives the outputs an evaluation without the reference gives (embedded model, float32)."""
    from pathlib import Path

    from sparsetune.evaluation.config import EvalConfig
    from sparsetune.evaluation.reference import DenseReference
    from sparsetune.evaluation.runner import evaluate, read_records

    llm = LLM(model="smollm2-135m", dtype="float32", max_num_seqs=8)
    opts = dict(model="smollm2-135m", tasks=("niah_single", "niah_multikey", "multiturn"), context=2048, samples=2,
                batch=8, mode="accuracy", dtype="float32")
    cfg = EvalConfig.of(flow="block_topk", params={"budget_ratio": "0.25"}, **opts)
    plain = evaluate(cfg, out=tmp_path / "plain", llm=llm)
    ref = DenseReference()
    evaluate(EvalConfig.of(flow="quest", params={"budget_ratio": "0.125"}, **opts), out=tmp_path / "fill", llm=llm,
             reference=ref)
    again = evaluate(cfg, out=tmp_path / "again", llm=llm, reference=ref)
    keys = ("task", "index", "output", "dense")
    got = [{k: r[k] for k in keys} for r in read_records(Path(again.run_dir))]
    want = [{k: r[k] for k in keys} for r in read_records(Path(plain.run_dir))]
    print("plain", plain.relative_accuracy, "again", again.relative_accuracy)
    assert got == want
    assert again.relative_accuracy == plain.relative_accuracy and again.relative_accuracy > 0




def test_gpu_search_relayouts_between_evaluations_fit(tmp_path):
    """The sequence that failed in a search on an H200 before the KV pool got a CUDA memory pool of
    its own: the speed engine (Qwen3-8B shapes at 16 x 32K, a 72 GiB pool) measured tidal at block 8,
    the accuracy engine evaluated it, and the relayout to quest at block 4 found 45.7 GiB free with
    21 GiB allocated and 93 GiB reserved (the freed pool's segment pinned by later tensors)."""
    if torch.cuda.get_device_properties(0).total_memory < 120 * 2**30:
        pytest.skip("needs a GPU of at least 120 GiB (the speed engine's pool at 16 x 32K)")
    from pathlib import Path

    from sparsetune.tuning.config import SearchConfig
    from sparsetune.tuning.trial import EngineEvaluator

    cfg = SearchConfig(study="t", out=str(tmp_path), context=2048, samples=4, flows=["quest", "tidal"],
                       speed_model="qwen3-8b", speed_batch=16, speed_context=32768)
    ev = EngineEvaluator(cfg)
    tidal = {"block_size": "8", "budget_ratio": "0.27", "dense_layers": "", "select_layers": "0,7,15,22",
             "sink_blocks": "1", "local_blocks": "7"}
    quest = {"block_size": "4", "budget_ratio": "0.3", "dense_layers": "0,1,2,3", "sink_blocks": "4", "local_blocks": "4"}
    for i, (flow, params) in enumerate([("tidal", tidal), ("tidal", tidal), ("quest", quest), ("quest", {"block_size": "32"})]):
        speed, info = ev.speedup(flow, params)
        acc = ev.accuracy(flow, params, samples=4, seed=0, out=Path(tmp_path) / str(i))
        assert speed > 0 and info["kind"] == "measured" and acc.complete


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ctx,n,hq,hkv", [(1000, 3096, 32, 8), (4096, 4096, 32, 8), (77, 1, 9, 3), (8191, 513, 8, 8)])
def test_gpu_chunk_attention_behind_cached_keys_matches_float64(dtype, ctx, n, hq, hkv):
    """A prefill chunk after `ctx` cached tokens (cuDNN over the cached keys and over the chunk's own,
    merged by log-sum-exp) against float64 attention with the bottom-right causal mask."""
    from sparsetune.engine.attention import causal_sdpa

    g = torch.Generator(device="cuda").manual_seed(ctx + n)
    d, t = 128 if hq == 32 else 64, ctx + n
    q = torch.randn(n, hq, d, device="cuda", generator=g).to(dtype).transpose(0, 1)  # the engine's strided views
    k, v = (torch.randn(hkv, t, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    out = causal_sdpa(q, k, v, ctx, d**-0.5)
    rep = hq // hkv
    kr, vr = (x.double().repeat_interleave(rep, 0) for x in (k, v))
    s = (q.double() @ kr.transpose(1, 2)) * d**-0.5
    allowed = torch.arange(t, device="cuda")[None, :] <= torch.arange(ctx, t, device="cuda")[:, None]
    ref = s.masked_fill(~allowed, float("-inf")).softmax(-1) @ vr
    assert out.dtype == dtype and out.shape == (hq, n, d)
    err = (out.double() - ref).abs().max().item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 4e-3), err
