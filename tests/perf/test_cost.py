"""The decode-step byte model against hand counts and against what the engine really holds: its
weights (the module's parameters) and a flow's field stores."""

from __future__ import annotations

import torch

from sparsetune.engine.sequence import SamplingParams
from sparsetune.flow.attention import FlowAttention
from sparsetune.models.registry import REGISTRY
from sparsetune.perf.cost import attended_tokens, decode_step_bytes, field_bytes_per_unit, kv_share, byte_floor_speedup, weight_bytes
from sparsetune.loader import build_flow

CFG = REGISTRY["smollm2-135m"].config  # 30 layers, 3 KV heads, head dim 64, tied embeddings
KV_TOKEN_LAYER = 2 * 3 * 64 * 4  # K and V, float32


def test_weights_are_the_modules_parameters(smollm):
    held = sum(p.numel() * p.element_size() for p in smollm.engine.model.parameters())
    assert weight_bytes(smollm.model_config, batch=4, dtype_bytes=4) == held  # tied: the embedding is the lm_head
    qwen = REGISTRY["qwen3-8b"].config  # untied: of the embedding only the batch's rows
    emb = qwen.vocab_size * qwen.hidden_size
    assert weight_bytes(qwen, 16, 2) == 2 * (qwen.num_parameters() - emb + 16 * qwen.hidden_size)


def test_field_bytes_are_what_the_engine_stores(smollm):
    try:
        smollm.apply(smollm.setup.with_flow("quest", {"budget": "64"}))
        smollm.generate(["The capital of France is"], SamplingParams(max_tokens=2))
        backend = smollm.engine.backends[5]
        assert isinstance(backend, FlowAttention)
        stored = sum(t[0].numel() * t.element_size() for t in backend.fields[5].values())  # one block, all heads
        assert field_bytes_per_unit(smollm.flow, smollm.model_config, 4) == stored == 3 * 2 * 64 * 4
    finally:
        smollm.apply(smollm.setup.with_flow(None))


def test_fp8_field_bytes_are_what_the_engine_stores_and_reserves(smollm):
    """8-bit fields (`field_dtype=fp8`) are stored in one byte an element beside the float32 pool,
    counted so by the cost model and reserved so by the engine (a quarter of the fields' float32 bytes)."""
    from sparsetune.flow.shapes import field_bytes_per_block

    try:
        smollm.apply(smollm.setup.with_flow("quest", {"budget": "64", "field_dtype": "fp8"}))
        smollm.generate(["The capital of France is"], SamplingParams(max_tokens=2))
        backend = smollm.engine.backends[5]
        assert all(t.dtype == torch.float8_e4m3fn for t in backend.fields[5].values())
        stored = sum(t[0].numel() * t.element_size() for t in backend.fields[5].values())
        assert field_bytes_per_unit(smollm.flow, smollm.model_config, 4) == stored == 3 * 2 * 64
        per_block = field_bytes_per_block(smollm.flow, smollm.model_config, 4)
        assert per_block == 28 * 3 * 2 * 64  # 28 sparse layers (quest keeps 0 and 1 dense), one unit a block
        assert smollm.engine.extra_bytes_per_block >= per_block  # the pool was sized for at least these
    finally:
        smollm.apply(smollm.setup.with_flow(None))


def test_dense_and_quest_by_hand():
    dense = decode_step_bytes(CFG, None, batch=2, context=4096, dtype_bytes=4)
    assert (dense.kv, dense.fields) == (2 * 4096 * KV_TOKEN_LAYER * 30, 0)
    quest = build_flow("quest", {"budget": "512"})  # dense layers 0 and 1; 32 blocks of 16 on the other 28
    got = decode_step_bytes(CFG, quest, batch=2, context=4096, dtype_bytes=4)
    assert got.kv == 2 * KV_TOKEN_LAYER * (2 * 4096 + 28 * 512)
    assert got.fields == 2 * 256 * (3 * 2 * 64 * 4) * 28  # kmax + kmin of 256 blocks on 28 layers
    assert got.weights == dense.weights
    assert byte_floor_speedup(CFG, quest, 2, 4096, 4) == dense.total / got.total > 1


def test_fp8_fields_halve_a_16_bit_pool_s_field_bytes():
    qwen = REGISTRY["qwen3-8b"].config
    auto = build_flow("block_topk", {"block_size": "4", "budget_ratio": "0.125"})
    fp8 = build_flow("block_topk", {"block_size": "4", "budget_ratio": "0.125", "field_dtype": "fp8"})
    a, b = (decode_step_bytes(qwen, f, batch=16, context=32768, dtype_bytes=2) for f in (auto, fp8))
    assert (b.weights, b.kv) == (a.weights, a.kv) and a.fields == 2 * b.fields
    assert a.fields == 16 * (32768 // 4) * 8 * 128 * 2 * 35  # a mean key a unit, 8 KV heads, 35 selecting layers


def test_window_flows_and_shared_selection():
    streaming = build_flow("streaming", {"local_blocks": "8", "dense_layers": ""})  # sink block + 8: no scoring
    assert decode_step_bytes(CFG, streaming, 1, 4096, 4).kv == KV_TOKEN_LAYER * 30 * 9 * 16
    every = build_flow("block_topk", {"budget": "512", "dense_layers": "0"})
    shared = build_flow("block_topk", {"budget": "512", "dense_layers": "0", "select_layers": "1,15"})
    a, b = decode_step_bytes(CFG, every, 1, 4096, 4), decode_step_bytes(CFG, shared, 1, 4096, 4)
    assert a.kv == b.kv and b.fields * 29 == a.fields * 2  # fields read on the 2 selecting layers of 29


def test_attended_tokens_by_hand():
    """What `generate` reports: a short prompt at a budget ratio attends its forced blocks at least."""
    quest = build_flow("quest", {"budget_ratio": "0.125", "block_size": "2"})  # sink 1 + local 2 blocks
    assert attended_tokens(CFG, quest, 37) == 5  # 19 blocks: ceil(2.375) = 3 = the forced 3; the last holds 1 token
    assert attended_tokens(CFG, quest, 400) == 50  # 200 blocks: 25
    assert attended_tokens(CFG, build_flow("quest", {"budget": "2048"}), 37) == 37  # the budget covers it
    streaming = build_flow("streaming", {"local_blocks": "8"})  # no scoring: sink block + 8, whatever the budget
    assert attended_tokens(CFG, streaming, 4096) == 9 * 16


def test_kv_share_is_the_context_a_step_reads_dense_layers_included():
    assert kv_share(CFG, None, 2048) == 1.0
    quest = build_flow("quest", {"budget": "512"})  # dense layers 0 and 1, 512 of 4096 on the other 28
    assert kv_share(CFG, quest, 4096) == (2 * 4096 + 28 * 512) / (30 * 4096)
    ratio = build_flow("block_topk", {"block_size": "2", "budget_ratio": "0.125", "dense_layers": ""})
    assert kv_share(CFG, ratio, 2048) == 0.125  # 128 blocks of 2 on every layer; its fields are not K/V


def test_prefill_flops_count_the_model_s_linear_weights_and_attention_pairs(smollm):
    from sparsetune.perf.cost import full_prefill_flops, prefill_flops

    linear = sum(m.weight.numel() for name, m in smollm.engine.model.named_modules()
                 if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}")  # per token, all layers
    cfg, t = smollm.model_config, 300
    per_layer = linear // cfg.num_hidden_layers
    pairs = cfg.num_hidden_layers * t * (t + 1) / 2  # every row, keys 0..i
    want = 2 * linear * t + 4 * cfg.head_dim * cfg.num_attention_heads * pairs
    assert full_prefill_flops(cfg, t) == want
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size  # a sparse FFN skips these rows' MLP only
    assert prefill_flops(cfg, 10, 4, 0) == 2 * (10 * per_layer - 6 * mlp)
    qwen = REGISTRY["qwen3-8b"].config  # BENCHMARKS' hand figure at 32K: 455 + 317 TFLOP
    assert abs(full_prefill_flops(qwen, 32768) / 1e12 - 772) < 4
