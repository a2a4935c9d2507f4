"""The `sparsetune` backend on SGLang's own objects (0.5.16 and 0.5.23, CPU): its real `ReqToTokenPool`,
`MHATokenToKVPool`, `RadixAttention` layers and `ForwardBatch`es, through an extend and decodes.

- At a budget that covers the context, the backend's output equals SGLang's `torch_native` backend.
- At a partial budget, the pages it selects (per request and KV head) and its output equal what
  this package's own engine selects and computes for the same keys and queries on its own pool.
- Under tensor parallelism (a rank holds some KV heads), each rank selects and attends as TP 1
  does for its heads.
- A calibrated flow serves the channel order its bundle carries (one and two levels, as this
  engine with the same order); under TP, or with another model's order, it is refused at launch.
- The plugin registers the backend, SGLang's argument parser accepts `--attention-backend
  sparsetune`, and a launch that cannot work says why in one line.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from sparsetune.engine.attention import AttentionMetadata, DenseAttention
from sparsetune.engine.kv_cache import KVCache
from sparsetune.errors import SparsetuneError
from sparsetune.export.bundle import write_bundle
from sparsetune.export.sglang import plugin
from sparsetune.export.bundle import BUNDLE_ENV
from sparsetune.export.sglang.backend import SparsetuneBackend
from sparsetune.flow.attention import FlowAttention
from sparsetune.loader import build_flow, flow_path
from sparsetune.models.artifacts import synthetic_calibration, write_calibration

P, HKV, HQ, D, LAYERS = 4, 2, 6, 32, 3
SCALE = D**-0.5
LENS = [23 * P + 3, 9 * P, 17 * P + 1]  # prompt lengths; decodes complete a page of the 2nd, then the 1st
ROWS = [3, 1, 2]  # each request's row of req_to_token (row 0 is SGLang's padding row)
STEPS = 2
MAX_LEN = 160


class World:
    """SGLang's pools holding three requests, pages handed out in a scrambled order (page 0 is the
    padding page), and this engine's pool holding the same tokens in other blocks."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        pages_per = [-(-(n + STEPS) // P) for n in LENS]
        total = sum(pages_per) + 5
        self.req_to_token = ReqToTokenPool(size=4, max_context_len=MAX_LEN, device="cpu", enable_memory_saver=False)
        self.kv_pool = MHATokenToKVPool(size=total * P, page_size=P, dtype=torch.float32, head_num=HKV, head_dim=D,
                                        layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        order = (torch.randperm(total, generator=g) + 1).tolist()  # pages 1..total, scrambled
        self.pages = []
        for row, n in zip(ROWS, pages_per):
            mine, order = order[:n], order[n:]
            self.pages.append(mine)
            pos = torch.arange(n * P)
            self.req_to_token.req_to_token[row, : n * P] = (torch.tensor(mine)[pos // P] * P + pos % P).to(torch.int32)
        self.runner = SimpleNamespace(device="cpu", req_to_token_pool=self.req_to_token, token_to_kv_pool=self.kv_pool,
                                      page_size=P)
        # this engine's pool: the same requests in blocks of another order
        self.kv = KVCache(LAYERS, total + 1, HKV, P, D, torch.float32, "cpu")
        blocks = torch.randperm(total + 1, generator=g).tolist()
        self.tables = torch.full((len(LENS), MAX_LEN // P), self.kv.null_block, dtype=torch.int32)
        for i, n in enumerate(pages_per):
            self.tables[i, :n] = torch.tensor(blocks[:n], dtype=torch.int32)
            blocks = blocks[n:]
        self.layers = [RadixAttention(HQ, D, SCALE, HKV, layer_id=i) for i in range(LAYERS)]
        self.g = g

    def slots(self, i: int, positions: torch.Tensor) -> torch.Tensor:
        return self.req_to_token.req_to_token[ROWS[i], positions].long()

    def qkv(self, n: int):
        return tuple(torch.randn(n, h, D, generator=self.g) for h in (HQ, HKV, HKV))

    def extend_batch(self) -> tuple[ForwardBatch, AttentionMetadata]:
        pos = [torch.arange(n) for n in LENS]
        loc = torch.cat([self.slots(i, p) for i, p in enumerate(pos)])
        lens = torch.tensor(LENS, dtype=torch.int32)
        fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=len(LENS), input_ids=torch.zeros(int(lens.sum()), dtype=torch.long),
                          req_pool_indices=torch.tensor(ROWS), seq_lens=lens, out_cache_loc=loc, seq_lens_sum=int(lens.sum()),
                          seq_lens_cpu=lens.clone(), positions=torch.cat(pos), extend_seq_lens=lens.clone(),
                          extend_prefix_lens=torch.zeros_like(lens), extend_prefix_lens_cpu=[0] * len(LENS),
                          extend_seq_lens_cpu=list(LENS), extend_num_tokens=int(lens.sum()))
        qsl = [0]
        for n in LENS:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(True, torch.cat(pos), self._engine_slots(pos), self.tables, lens.clone(), list(LENS), qsl,
                                 list(range(len(LENS))))
        return fb, meta

    def decode_batch(self, step: int) -> tuple[ForwardBatch, AttentionMetadata]:
        pos = torch.tensor([n + step for n in LENS])
        loc = torch.cat([self.slots(i, pos[i : i + 1]) for i in range(len(LENS))])
        lens = (pos + 1).to(torch.int32)
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(LENS), input_ids=torch.zeros(len(LENS), dtype=torch.long),
                          req_pool_indices=torch.tensor(ROWS), seq_lens=lens, out_cache_loc=loc, seq_lens_sum=int(lens.sum()),
                          seq_lens_cpu=lens.clone(), positions=pos)
        meta = AttentionMetadata(False, pos, self._engine_slots([p.view(1) for p in pos]), self.tables, lens.clone(),
                                 lens.tolist(), list(range(len(LENS) + 1)), list(range(len(LENS))))
        return fb, meta

    def _engine_slots(self, pos: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([self.kv.slots(self.tables[i], p) for i, p in enumerate(pos)])


def bundle(tmp_path, flow: str, **params) -> str:
    out = tmp_path / f"{flow}-bundle"
    write_bundle(out, flow_path(flow), {k: str(v) for k, v in params.items()})
    return str(out)


def run_steps(world: World, backends, engine: FlowAttention | None = None):
    """The extend, then STEPS decodes, every layer: each backend's outputs (and the engine's: the
    flow on its sparse layers, dense attention on the others, as the engine assigns them)."""
    dense = DenseAttention(SCALE)
    outs = {name: [] for name in list(backends) + (["engine"] if engine else [])}
    for step in range(-1, STEPS):
        fb, meta = world.extend_batch() if step < 0 else world.decode_batch(step)
        for b in backends.values():
            b.init_forward_metadata(fb)
        for layer in world.layers:
            q, k, v = world.qkv(int(fb.out_cache_loc.numel()))
            for name, b in backends.items():
                outs[name].append(b.forward(q.reshape(len(q), -1), k, v, layer, fb).view(len(q), HQ, D))
            if engine is not None:
                per_layer = dense if layer.layer_id in engine.flow.dense_layers else engine
                outs["engine"].append(per_layer.forward(layer.layer_id, q, k, v, world.kv, meta))
    return outs


def test_at_a_budget_covering_the_context_the_backend_equals_torch_native(tmp_path):
    world = World(seed=1)
    path = bundle(tmp_path, "block_topk", block_size=P, budget=4096, dense_layers="")
    ours = SparsetuneBackend(world.runner, bundle=path, dense="torch_native")
    outs = run_steps(world, {"ours": ours, "torch_native": TorchNativeAttnBackend(world.runner)})
    assert len(outs["ours"]) == (STEPS + 1) * LAYERS
    for got, want in zip(outs["ours"], outs["torch_native"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(ours.attn.last_selection) == set(range(LAYERS))  # every layer decoded through the flow


# (flow, params beside the budget): one level over pages; two levels (pages, then 2- or 1-token
# units inside the best of them: units of SGLang's own pages, which stay P tokens).
PARTIAL = [("quest", {}), ("block_topk", {}), ("quest_2l", {"select_block": 2, "coarse": 2}),
           ("block_topk", {"select_block": 1, "coarse": 1.5}),
           # calibrated: the channel order comes with the bundle (one level; two levels on the channels)
           ("double_sparse", {"channels": 8}), ("double_sparse_2l", {"channels": 8, "select_block": 2, "coarse": 2}),
           # fields in 8 bits beside SGLang's pool, one level and two
           ("block_topk", {"field_dtype": "fp8"}), ("quest_2l", {"select_block": 2, "coarse": 2, "field_dtype": "fp8"})]


def calibration(tmp_path, head_dim: int = D):
    """A channel order for the world's layers and KV heads (`head_dim`: another model's), as a file."""
    order = synthetic_calibration(LAYERS, HKV, head_dim, seed=head_dim)
    return write_calibration(tmp_path / f"calibration-{head_dim}.json", "world", order, None, 8, "test"), order


@pytest.mark.parametrize("flow,extra", PARTIAL)
def test_at_a_partial_budget_it_selects_and_attends_as_this_engine_does(flow, extra, tmp_path):
    world = World(seed=2)
    unit = extra.get("select_block", P)
    params = dict(block_size=P, budget=6 * unit, sink_blocks=1, local_blocks=2, dense_layers="0", **extra)
    file, order = calibration(tmp_path) if "channels" in extra else (None, None)
    if file is not None:
        params["calibration"] = str(file)
    ours = SparsetuneBackend(world.runner, bundle=bundle(tmp_path, flow, **params), dense="torch_native")
    engine = FlowAttention(build_flow(flow, {k: str(v) for k, v in params.items()}), SCALE, calibration=order)
    assert (ours.flow.coarse is None) == (engine.pages is None) == ("coarse" not in extra)
    outs = run_steps(world, {"ours": ours}, engine)
    for got, want in zip(outs["ours"], outs["engine"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(ours.attn.last_selection) == {1, 2}  # layer 0 is dense
    if extra.get("field_dtype") == "fp8":
        assert {t.dtype for t in ours.attn.fields[1].values()} == {torch.float8_e4m3fn}
    for layer in (1, 2):
        blocks, counts = ours.attn.last_selection[layer]
        want_blocks, want_counts = engine.last_selection[layer]
        assert torch.equal(counts, want_counts) and int(counts.min()) == 6  # the budget, not the whole context
        if "coarse" in extra:  # every unit inside one of the pages the first level kept
            pages, kept = ours.attn.pages.last_selection[layer]
            for row, n, prow, pn in zip(blocks.flatten(0, 1), counts.flatten(), pages.flatten(0, 1), kept.flatten()):
                assert {x * unit // P for x in row[:n].tolist()} <= set(prow[:pn].tolist())
        for got_row, want_row, n in zip(blocks.flatten(0, 1), want_blocks.flatten(0, 1), counts.flatten()):
            assert sorted(got_row[:n].tolist()) == sorted(want_row[:n].tolist())


def test_shared_selection_and_dense_layers_run_as_in_this_engine(tmp_path):
    world = World(seed=4)
    params = dict(block_size=P, budget=5 * P, sink_blocks=1, local_blocks=1, dense_layers="0", select_layers="1")
    ours = SparsetuneBackend(world.runner, bundle=bundle(tmp_path, "tidal", **params), dense="torch_native")
    engine = FlowAttention(build_flow("tidal", {k: str(v) for k, v in params.items()}), SCALE)
    outs = run_steps(world, {"ours": ours}, engine)
    for got, want in zip(outs["ours"], outs["engine"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # layer 1 selects (5 pages of each request and KV head), layer 2 reuses exactly its pages
    blocks, counts = ours.attn.last_selection[1]
    assert int(counts.min()) == 5 and set(ours.attn.last_selection) == {1, 2}
    assert torch.equal(ours.attn.last_selection[2][0], blocks) and torch.equal(ours.attn.last_selection[2][1], counts)


@pytest.mark.parametrize("flow", ["quest", "block_topk"])
def test_under_tensor_parallelism_each_rank_selects_and_attends_as_tp1_does_for_its_kv_heads(flow, tmp_path):
    """SGLang's TP splits the KV heads over ranks (each rank's pool and layers hold its own): a rank's
    backend picks, for each of its KV heads, the pages the TP 1 backend picks for that head, and
    its output is TP 1's for its query heads."""
    world = World(seed=5)
    params = dict(block_size=P, budget=6 * P, sink_blocks=1, local_blocks=2, dense_layers="0")
    path = bundle(tmp_path, flow, **params)
    tp1 = SparsetuneBackend(world.runner, bundle=path, dense="torch_native")
    group = HQ // HKV
    ranks = []  # TP = HKV: one KV head and its query heads per rank
    for _ in range(HKV):
        pool = MHATokenToKVPool(size=world.kv_pool.size, page_size=P, dtype=torch.float32, head_num=1, head_dim=D,
                                layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        runner = SimpleNamespace(device="cpu", req_to_token_pool=world.req_to_token, token_to_kv_pool=pool, page_size=P)
        ranks.append((SparsetuneBackend(runner, bundle=path, dense="torch_native"),
                      [RadixAttention(group, D, SCALE, 1, layer_id=i) for i in range(LAYERS)]))
    for step in range(-1, STEPS):
        fb, _meta = world.extend_batch() if step < 0 else world.decode_batch(step)
        for b in [tp1] + [b for b, _ in ranks]:
            b.init_forward_metadata(fb)
        for layer in world.layers:
            q, k, v = world.qkv(int(fb.out_cache_loc.numel()))
            n = len(q)
            want = tp1.forward(q.reshape(n, -1), k, v, layer, fb).view(n, HQ, D)
            for r, (b, layers) in enumerate(ranks):
                qs = q[:, r * group : (r + 1) * group]
                got = b.forward(qs.reshape(n, -1), k[:, r : r + 1], v[:, r : r + 1], layers[layer.layer_id], fb)
                torch.testing.assert_close(got.view(n, group, D), want[:, r * group : (r + 1) * group], rtol=1e-5, atol=1e-5)
    for layer in (1, 2):
        blocks, counts = tp1.attn.last_selection[layer]
        assert int(counts.min()) == 6  # the budget, not the whole context
        for r, (b, _) in enumerate(ranks):
            rb, rc = b.attn.last_selection[layer]
            assert rc.shape[1] == 1 and torch.equal(rc[:, 0], counts[:, r])
            for got_row, want_row, c in zip(rb[:, 0], blocks[:, r], counts[:, r]):
                assert sorted(got_row[:c].tolist()) == sorted(want_row[:c].tolist())


def test_a_calibrated_bundle_refuses_tensor_parallelism_and_another_models_channels(tmp_path):
    """A channel order is per KV head: a rank holding some of them is refused in one line, and so is
    a calibration of another model's shapes, at launch."""
    world = World(seed=7)
    path = bundle(tmp_path, "double_sparse", block_size=P, channels=8, calibration=calibration(tmp_path)[0])
    pool = MHATokenToKVPool(size=world.kv_pool.size, page_size=P, dtype=torch.float32, head_num=1, head_dim=D,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    rank = SimpleNamespace(device="cpu", req_to_token_pool=world.req_to_token, token_to_kv_pool=pool, page_size=P,
                           model_config=SimpleNamespace(get_total_num_kv_heads=lambda: HKV))
    with pytest.raises(SparsetuneError, match=f"serves at --tp-size 1, and this rank holds 1 of the model's {HKV} KV heads"):
        SparsetuneBackend(rank, bundle=path, dense="torch_native")
    assert SparsetuneBackend(world.runner, bundle=path, dense="torch_native").channels is not None
    other = tmp_path / "other"
    other.mkdir()
    wide = bundle(other, "double_sparse", block_size=P, channels=8, calibration=calibration(tmp_path, 2 * D)[0])
    with pytest.raises(SparsetuneError, match=f"head_dim {2 * D} .the model has {D}.; export again with the served"):
        SparsetuneBackend(world.runner, bundle=wide, dense="torch_native")


def test_the_bundle_may_come_as_a_server_argument(tmp_path, monkeypatch):
    world = World(seed=5)
    monkeypatch.delenv(BUNDLE_ENV, raising=False)
    path = bundle(tmp_path, "quest", block_size=P)
    # `--json-model-override-args '{"sparsetune_bundle": DIR}'`: SGLang merges it into the HF config
    world.runner.model_config = SimpleNamespace(hf_config=SimpleNamespace(sparsetune_bundle=path))
    assert SparsetuneBackend(world.runner, dense="torch_native").flow.name == "quest"
    monkeypatch.setenv(BUNDLE_ENV, bundle(tmp_path, "block_topk", block_size=P))
    assert SparsetuneBackend(world.runner, dense="torch_native").flow.name == "quest"  # the server argument wins


def test_the_plugin_registers_the_backend_and_the_parser_accepts_it():
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, ServerArgs

    load_plugins()  # through the entry point sparsetune's metadata declares
    plugin.register()  # idempotent
    assert ATTENTION_BACKEND_CHOICES.count("sparsetune") == 1 and "sparsetune" in ATTENTION_BACKENDS
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--attention-backend", "sparsetune", "--page-size", str(P)])
    assert args.attention_backend == "sparsetune" and args.page_size == P
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--attention-backend", "nosuch"])


def test_a_reuse_bundle_adds_the_request_hooks_and_sglang_takes_its_launch_args(tmp_path, monkeypatch):
    import json
    import shlex

    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    from sparsetune.export.sglang.segments import HOOKS

    reuse = tmp_path / "reuse"
    write_bundle(reuse, flow_path("quest"), {"block_size": str(P)}, reuse=(flow_path("cacheblend"), {}))
    monkeypatch.setenv(BUNDLE_ENV, str(tmp_path / "nosuch"))
    plugin.register()
    assert not any(h is hook for target, hook, _ in HOOKS for _, h, _ in HookRegistry._hooks.get(target, []))
    monkeypatch.setenv(BUNDLE_ENV, str(reuse))
    plugin.register()
    plugin.register()  # once per process
    for target, hook, _ in HOOKS:
        assert sum(h is hook for _, h, _ in HookRegistry._hooks.get(target, [])) == 1, target
    # the launch script's arguments are SGLang's: the backend, the page, no prefill graph, no chunking
    args = json.loads((reuse / "sglang.json").read_text())["server_args"]
    flags = shlex.split(" ".join(f"--{k.replace('_', '-')} {v}" for k, v in args.items()))
    assert " ".join(flags) in (reuse / "launch_sglang.sh").read_text()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(["--model-path", "m", *flags])
    assert (parsed.attention_backend, parsed.page_size, parsed.chunked_prefill_size) == ("sparsetune", P, -1)
    assert parsed.cuda_graph_backend_prefill == "disabled"


def test_a_bundle_checks_against_this_sglang(tmp_path):
    from sparsetune.api import check_export

    result = check_export(bundle(tmp_path, "quest", block_size=P), require_sglang=True)
    expected = os.environ.get("SPARSETUNE_SGLANG_EXPECT")  # the version tests/export/test_sglang.py installed
    assert result["ok"] and result["sglang"] == expected and result["sglang_problem"] is None
    # ... beside the torch that version pins (its environment's, not the test command's)
    assert torch.__version__.split("+")[0] == os.environ.get("SPARSETUNE_TORCH_EXPECT")


def test_a_launch_that_cannot_work_says_why(tmp_path, monkeypatch):
    world = World(seed=3)
    monkeypatch.delenv(BUNDLE_ENV, raising=False)
    with pytest.raises(SparsetuneError, match="SPARSETUNE_BUNDLE"):
        SparsetuneBackend(world.runner)
    path = bundle(tmp_path, "quest", block_size=2 * P)
    with pytest.raises(SparsetuneError, match=f"launch with --page-size {2 * P}"):
        SparsetuneBackend(world.runner, bundle=path)
    with pytest.raises(SparsetuneError, match="does not check"):
        SparsetuneBackend(world.runner, bundle=str(tmp_path))
    with pytest.raises(SparsetuneError, match="not one of SGLang's attention backends"):
        SparsetuneBackend(world.runner, bundle=bundle(tmp_path, "block_topk", block_size=P), dense="nosuch")
    # a reuse bundle checks against this SGLang (the backend's side is test_reuse_forward's); a reuse flow
    # SGLang's forward cannot run is named at once, and its launch refused
    from sparsetune.api import check_export

    reuse = tmp_path / "reuse"
    write_bundle(reuse, flow_path("quest"), {"block_size": str(P)}, reuse=(flow_path("cacheblend"), {}))
    result = check_export(reuse, require_sglang=True)
    assert result["ok"] and result["sglang_problem"] is None and result["serving_problem"] is None
    redknot = tmp_path / "redknot"
    write_bundle(redknot, flow_path("quest"), {"block_size": str(P)}, reuse=(flow_path("redknot"), {}))
    result = check_export(redknot, require_sglang=True)
    assert not result["ok"] and "narrows the MLP per row" in result["serving_problem"]
