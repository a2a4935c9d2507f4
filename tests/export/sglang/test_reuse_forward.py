"""A reuse flow's prefill in SGLang's own model forward (0.5.16 and 0.5.23, CPU; issue #44): a small
Llama built by SGLang (`LlamaForCausalLM`, random weights), its pools and prefix tree, the engine's
plan run by `export.sglang.reuse`, against SGLang's own full prefill of the same prompt.

- A segment is stored as SGLang computes it alone (a prefill at positions 0.., kept in its tree under
  the segment key), then reused at another position: with every reused token recomputed (ratio 1)
  the logits equal SGLang's full prefill (float32, 1e-5); so do they with the prompt's start a
  plain prefix hit beside the segment hit, and with a plain prompt in the same batch.
- At a partial ratio, the reused tokens recomputed after the selection layer are CacheBlend's rule in
  plain torch on SGLang's own tensors (the full prefill's V at the check layer against the stored,
  realigned V); the others keep the realigned stored KV in every later layer, the recomputed ones
  the full prefill's.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import socket
from array import array
from types import SimpleNamespace

import pytest
import sglang
import torch
from trees import default_tree

from sparsetune.engine.rope import inv_frequencies
from sparsetune.errors import SparsetuneError
from sparsetune.export.bundle import write_bundle
from sparsetune.export.sglang.backend import SparsetuneBackend
from sparsetune.export.sglang import schedule
from sparsetune.export.sglang.reuse import ReuseRequest, ReuseStep, wrap_model
from sparsetune.export.sglang.segments import LAYOUT
from sparsetune.export.sglang.store import SegmentStore, segment_key
from sparsetune.loader import build_flow, flow_path
from sparsetune.reuse.base import ReuseFlow
from sparsetune.reuse.parts import ReuseLayout, Span

P, LAYERS, HQ, HKV, D, VOCAB, THETA = 4, 4, 4, 2, 16, 128, 10000.0


@pytest.fixture(scope="module")
def sgl(tmp_path_factory):
    """SGLang's process state for one model on CPU (TP 1 over gloo), the model, and a backend."""
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.runtime_context import get_context

    args = ServerArgs(model_path="dummy", device="cpu", attention_backend="torch_native")
    getattr(args, "resolve_once", lambda: None)()  # 0.5.23 resolves explicitly
    get_context().set_server_args(args)
    if not sglang.__version__.startswith("0.5.16"):
        from sglang.srt.runtime_context import _parallel_fields, get_parallel

        get_parallel().override_permanently(**{f: 0 for f in _parallel_fields() if f.endswith("_rank")})
    from sglang.srt.distributed import parallel_state as ps

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    if sglang.__version__.startswith("0.5.16"):
        ps.initialize_model_parallel(1, 1)
    else:
        ps.initialize_model_parallel(backend="gloo")
    rope = importlib.import_module("sglang.srt.layers.rotary_embedding.base")
    rope._is_cpu = True  # SGLang's CPU RoPE path (no platform kernel to import)
    from sglang.srt.models.llama import LlamaForCausalLM
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HQ * D, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=512,
                      rope_theta=THETA)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)  # norms' weights near 1
    wrap_model(model)
    bundle = tmp_path_factory.mktemp("b") / "dense"
    write_bundle(bundle, flow_path("dense"), {"block_size": str(P)})
    return SimpleNamespace(model=model, bundle=str(bundle), config=cfg)


class World:
    """SGLang's pools and prefix tree on CPU, and forward passes of the model over them."""

    def __init__(self, sgl, slots: int = 512, bundle: str | None = None) -> None:
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        self.sgl = sgl
        self.kv = MHATokenToKVPool(size=slots, page_size=P, dtype=torch.float32, head_num=HKV, head_dim=D,
                                   layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        self.rows = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
        self.alloc = PagedTokenToKVPoolAllocator(slots, P, torch.float32, "cpu", self.kv, need_sort=False)
        self.tree = default_tree(disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.alloc, page_size=P)
        self.store = SegmentStore(self.tree)
        runner = SimpleNamespace(device="cpu", req_to_token_pool=self.rows, token_to_kv_pool=self.kv, page_size=P, model=sgl.model,
                                 model_config=SimpleNamespace(num_hidden_layers=LAYERS, hf_config=sgl.config))
        self.runner = runner
        self.backend = SparsetuneBackend(runner, bundle=bundle or sgl.bundle, dense="torch_native")
        self.next_row = 1

    def admit(self, n: int) -> int:
        """A request row with fresh slots for `n` tokens (page-aligned allocation, as SGLang's)."""
        row, self.next_row = self.next_row, self.next_row + 1
        slots = self.alloc.alloc(-(-n // P) * P)
        self.rows.req_to_token[row, : slots.numel()] = slots.to(torch.int32)
        return row

    def forward(self, prompts: list[list[int]], rows: list[int], prefix: list[int] | None = None, step=None, batch=None):
        """One extend of SGLang's model over the requests (their tokens past `prefix[i]`) → next-token logits."""
        from sglang.srt.model_executor import forward_context as fc
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

        prefix = prefix or [0] * len(prompts)
        ext = [len(p) - c for p, c in zip(prompts, prefix)]
        ids = torch.tensor([t for p, c in zip(prompts, prefix) for t in p[c:]])
        pos = torch.cat([torch.arange(c, len(p)) for p, c in zip(prompts, prefix)])
        loc = torch.cat([self.rows.req_to_token[r, c:len(p)].long() for r, p, c in zip(rows, prompts, prefix)])
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
        fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=len(prompts), input_ids=ids,
                          req_pool_indices=torch.tensor(rows), seq_lens=lens, out_cache_loc=loc, seq_lens_sum=int(lens.sum()),
                          seq_lens_cpu=lens.clone(), positions=pos, extend_seq_lens=torch.tensor(ext, dtype=torch.int32),
                          extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32), extend_prefix_lens_cpu=list(prefix),
                          extend_seq_lens_cpu=list(ext), extend_num_tokens=int(sum(ext)))
        fb.capture_hidden_mode = CaptureHiddenMode.NULL
        fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = self.rows, self.kv, self.backend
        fb.rids = [r.rid for r in batch.reqs] if batch is not None else [f"plain-{r}" for r in rows]
        fb = dataclasses.replace(fb)  # what SGLang's eager runner runs: a copy, its fields only (load_batch)
        self.backend.init_forward_metadata(fb)  # takes the scheduler's plans by the requests' ids
        if step is not None:
            fb.sparsetune_reuse = step(fb)
        with torch.no_grad(), fc.forward_context(fc.ForwardContext(attn_backend=self.backend)):
            out = self.sgl.model(ids, pos, fb)
        return out.next_token_logits, fb

    def store_segment(self, ids: list[int], namespace: str = "kb") -> None:
        """The segment as SGLang computes it alone (positions 0..), kept in the tree under its key."""
        row = self.admit(len(ids))
        self.forward([ids], [row])
        kept = len(ids) // P * P
        self.tree.insert(_insert(RadixKey_of(ids[:kept], segment_key(namespace)), self.rows.req_to_token[row, :kept].long()))

    def keys(self, layer: int, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.rows.req_to_token[row, :n].long()
        return self.kv.get_key_buffer(layer)[slots].clone(), self.kv.get_value_buffer(layer)[slots].clone()


def RadixKey_of(ids, extra_key):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", ids), extra_key=extra_key)


def _insert(key, value):
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    return InsertParams(key=key, value=value)


def reuse_request(world: World, prompt: list[int], spans: list[tuple[int, int]], num_cached: int = 0) -> ReuseRequest:
    """The scheduler side's findings for a prompt with segments at `spans` (each looked up in the store)."""
    layout, segments, last = [], [], 0
    for a, b in spans:
        if a > last:
            layout.append(Span(last, a, False, "default"))
        layout.append(Span(a, b, True, "kb"))
        hit = world.store.find(prompt[a:b], "kb")
        if hit.length:
            segments.append((a, hit.slots))
        last = b
    if last < len(prompt):
        layout.append(Span(last, len(prompt), False, "default"))
    prefix = None
    if num_cached:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        m = world.tree.match_prefix(MatchPrefixParams(key=RadixKey_of(prompt[:num_cached], None)))
        prefix = m.device_indices if hasattr(m, "device_indices") else world.tree.path_device_indices(m.last_device_node)
        assert prefix.numel() == num_cached
    return ReuseRequest(ReuseLayout(list(prompt), layout), num_cached, prefix, segments)


def step_for(world: World, flow: ReuseFlow, requests):
    return lambda fb: ReuseStep(flow, world.kv, world.rows.req_to_token, fb, requests, LAYERS, D**-0.5,
                                inv_frequencies(D, THETA, None), P)


g = torch.Generator().manual_seed(1)
SEG = torch.randint(0, VOCAB, (12,), generator=g).tolist()  # 3 pages: stored whole
HEAD = torch.randint(0, VOCAB, (8,), generator=g).tolist()  # 2 pages: a plain prefix
PROMPT = HEAD + [5, 9, 17] + SEG + torch.randint(0, VOCAB, (6,), generator=g).tolist()
AT = len(HEAD) + 3  # the segment's position in the prompt: 11, not page-aligned


def test_with_every_reused_token_recomputed_the_output_is_sglangs_full_prefill(sgl):
    w = World(sgl)
    w.store_segment(SEG)
    full, _ = w.forward([PROMPT], [w.admit(len(PROMPT))])
    flow = build_flow("cacheblend", {"ratio": "1.0", "check_layer": "1"}, ReuseFlow)
    req = reuse_request(w, PROMPT, [(AT, AT + len(SEG))])
    assert req.layout.num_reused == len(SEG)
    got, fb = w.forward([PROMPT], [w.admit(len(PROMPT))], step=step_for(w, flow, [req]))
    torch.testing.assert_close(got, full, atol=1e-5, rtol=0)
    assert fb.extend_seq_lens_cpu == [len(PROMPT)]  # the batch's fields restored after the forward
    # a plain prefix hit (the prompt's start, exact KV in the tree) beside the segment hit, and a
    # plain prompt in the same batch
    row = w.admit(len(HEAD))
    w.forward([HEAD], [row])
    w.tree.insert(_insert(RadixKey_of(HEAD, None), w.rows.req_to_token[row, : len(HEAD)].long()))
    other = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    alone, _ = w.forward([other], [w.admit(len(other))])
    req = reuse_request(w, PROMPT, [(AT, AT + len(SEG))], num_cached=len(HEAD))
    got, _ = w.forward([PROMPT, other], [w.admit(len(PROMPT)), w.admit(len(other))], step=step_for(w, flow, [req, None]))
    # a batch of two runs other GEMM shapes than each prompt alone, so float32 rounds otherwise: up to
    # 1.1e-5 on logits near 1 on an AMD EPYC's BLAS kernels (a wrong KV row moves them by ~1e-1)
    torch.testing.assert_close(got, torch.cat([full, alone]), atol=5e-5, rtol=0)


def test_at_a_partial_ratio_cacheblends_rule_picks_the_rows_and_the_rest_keep_the_stored_kv(sgl):
    w = World(sgl)
    w.store_segment(SEG)
    ref_row = w.admit(len(PROMPT))
    w.forward([PROMPT], [ref_row])  # SGLang's full prefill: its KV is the fresh KV of every layer
    flow = build_flow("cacheblend", {"ratio": "0.25", "check_layer": "2"}, ReuseFlow)
    req = reuse_request(w, PROMPT, [(AT, AT + len(SEG))])
    row = w.admit(len(PROMPT))
    _, fb = w.forward([PROMPT], [row], step=step_for(w, flow, [req]))
    plan = fb.sparsetune_reuse.batch.members[0]
    seg = torch.arange(AT, AT + len(SEG))
    # plain torch: CacheBlend's deviation of V at the check layer, fresh (the full prefill's) against
    # the stored segment's (V carries no position: the stored one as computed alone)
    _, v_fresh = w.keys(2, ref_row, len(PROMPT))
    stored = w.store.find(SEG, "kb").slots
    v_stored = w.kv.get_value_buffer(2)[stored]
    dev = (v_fresh[seg] - v_stored).square().sum(dim=(1, 2))
    want = set((AT + dev.topk(round(0.25 * len(SEG))).indices).tolist())
    got = set(torch.nonzero(plan.recomputed & plan.from_segments).squeeze(1).tolist())
    assert got == want and len(got) == 3
    # the check layer stores every row's fresh KV (as the engine's plan does); after it the recomputed
    # rows hold the full prefill's KV, the others the stored KV: V as stored, K realigned, not fresh
    kept, idx = torch.tensor(sorted(set(seg.tolist()) - want)), torch.tensor(sorted(want))
    k_new, v_new = w.keys(2, row, len(PROMPT))
    k_ref, v_ref = w.keys(2, ref_row, len(PROMPT))
    torch.testing.assert_close(k_new, k_ref, atol=1e-4, rtol=0)
    k_new, v_new = w.keys(3, row, len(PROMPT))
    k_ref, v_ref = w.keys(3, ref_row, len(PROMPT))
    torch.testing.assert_close(k_new[idx], k_ref[idx], atol=1e-4, rtol=0)
    torch.testing.assert_close(v_new[idx], v_ref[idx], atol=1e-4, rtol=0)
    assert torch.equal(v_new[kept], w.kv.get_value_buffer(3)[stored][kept - AT])
    assert not torch.allclose(k_new[kept], k_ref[kept], atol=1e-3)
    # their K is the stored K rotated on by the segment's position: SGLang's own RoPE at AT applied to
    # keys already rotated to 0.. gives its RoPE at AT.. (rotations compose)
    rope = sgl.model.model.layers[3].self_attn.rotary_emb
    k_stored = w.kv.get_key_buffer(3)[stored][kept - AT]
    n = len(kept)
    _, want_k = rope.forward_native(torch.full((n,), AT), torch.zeros(n, HQ * D), k_stored.reshape(n, -1).clone())
    torch.testing.assert_close(k_new[kept], want_k.view(n, HKV, D), atol=1e-5, rtol=0)


def test_a_reuse_bundle_on_the_backend_plans_runs_and_lets_its_segments_go(sgl, tmp_path):
    """The pieces as SGLang runs them: the backend serving a reuse bundle (its flow from the bundle, the
    model wrapped, the scheduler hooks registered), a real `Req` with a layout planned by the
    scheduler hook before allocation, the plan attached to the forward batch, the step made by the
    backend: SGLang's full prefill at ratio 1; the segment's pin let go after the forward."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    bundle = tmp_path / "cacheblend"
    write_bundle(bundle, flow_path("dense"), {"block_size": str(P)},
                 reuse=(flow_path("cacheblend"), {"ratio": "1.0", "check_layer": "1"}))
    w = World(sgl, bundle=str(bundle))
    assert w.backend.reuse.name == "cacheblend" and w.backend.reuse.ratio == 1.0
    split = SimpleNamespace(**{**vars(w.runner), "tp_size": 2})  # a rank of two: its selection would differ
    with pytest.raises(SparsetuneError, match="selects tokens from all KV heads' keys .*serves at --tp-size 1"):
        SparsetuneBackend(split, bundle=str(bundle), dense="torch_native")
    # the launch args its launch_sglang.sh sets, checked (the script's "$@" may undo them)
    good = dict(chunked_prefill_size=-1, cuda_graph_backend_prefill="disabled", prefill_attention_backend=None,
                cuda_graph_config=SimpleNamespace(prefill={"backend": "disabled"}), enable_pdmux=False,
                enable_two_batch_overlap=False, disaggregation_mode="null", pp_size=1)
    for bad, needle in (({"chunked_prefill_size": 8192}, "--chunked-prefill-size -1"),
                        ({"cuda_graph_config": SimpleNamespace(prefill={"backend": "breakable"})}, "prefill disabled"),
                        ({"prefill_attention_backend": "triton"}, "drop the flag"),
                        ({"enable_pdmux": True}, "--enable-pdmux True: .*without split prefill"),
                        ({"enable_two_batch_overlap": True}, "--enable-two-batch-overlap True"),
                        ({"disaggregation_mode": "prefill"}, "--disaggregation-mode prefill"), ({"pp_size": 2}, "--pp-size 2")):
        runner = SimpleNamespace(**{**vars(w.runner), "server_args": SimpleNamespace(**{**good, **bad})})
        with pytest.raises(SparsetuneError, match=needle):
            SparsetuneBackend(runner, bundle=str(bundle), dense="torch_native")
    SparsetuneBackend(SimpleNamespace(**{**vars(w.runner), "server_args": SimpleNamespace(**good)}), bundle=str(bundle),
                      dense="torch_native")
    if not sglang.__version__.startswith("0.5.16"):  # 0.5.23: a chunk size SGLang picked itself, the flag left unset
        from sglang.srt.arg_groups.overrides import declare_resolution
        from sglang.srt.server_args import ServerArgs

        args = ServerArgs(model_path=str(bundle), cuda_graph_backend_prefill="disabled")
        declare_resolution(args, "sglang's default", chunked_prefill_size=8192)
        assert args.chunked_prefill_size is None  # the operator's input
        with pytest.raises(SparsetuneError, match="--chunked-prefill-size 8192"):
            SparsetuneBackend(SimpleNamespace(**{**vars(w.runner), "server_args": args}), bundle=str(bundle), dense="torch_native")
    w.store_segment(SEG)
    full, _ = w.forward([PROMPT], [w.admit(len(PROMPT))])
    layout = json.dumps([[0, AT, False, "default", False], [AT, AT + len(SEG), True, "kb", False],
                         [AT + len(SEG), len(PROMPT), False, "default", False]])
    req = Req("r", "", array("q", PROMPT), SamplingParams(max_new_tokens=1, custom_params={LAYOUT: layout}))
    req.get_fill_ids = lambda: array("q", PROMPT)  # as SGLang's admission leaves it: the whole prompt to extend
    batch = SimpleNamespace(reqs=[req], tree_cache=w.tree)
    schedule.plan_batch(lambda b: None, batch)
    assert w.tree.protected_size() == len(SEG) and req.skip_radix_cache_insert
    got, fb = w.forward([PROMPT], [w.admit(len(PROMPT))], batch=batch)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=0)
    assert w.tree.protected_size() == 0 and not schedule.PLANNED  # taken, and let go after the forward
    (stats,) = fb.sparsetune_reuse.finish()
    assert stats.recomputed_reused == len(SEG) and stats.prompt_tokens == len(PROMPT)


def test_a_prefix_hit_is_taken_as_it_is_by_a_flow_that_reads_no_segment_and_a_segments_tail_is_computed(sgl):
    """Full recompute (no cached KV read) with a plain prefix hit: the prefix's exact KV is still taken
    (the plan does not compute it), so the output is SGLang's full prefill. A segment whose last page
    SGLang did not keep (14 tokens, pages of 4): its 12 stored tokens are reused, the 2 past them
    computed; at ratio 1, SGLang's full prefill again."""
    w = World(sgl)
    row = w.admit(len(HEAD))
    w.forward([HEAD], [row])
    w.tree.insert(_insert(RadixKey_of(HEAD, None), w.rows.req_to_token[row, : len(HEAD)].long()))
    full, _ = w.forward([PROMPT], [w.admit(len(PROMPT))])
    flow = build_flow("full_recompute", {}, ReuseFlow)
    req = reuse_request(w, PROMPT, [(AT, AT + len(SEG))], num_cached=len(HEAD))
    got, fb = w.forward([PROMPT], [w.admit(len(PROMPT))], step=step_for(w, flow, [req]))
    torch.testing.assert_close(got, full, atol=1e-5, rtol=0)
    long_seg = SEG + [3, 4]
    prompt = PROMPT[:AT] + long_seg + PROMPT[AT + len(SEG):]
    w.store_segment(long_seg)
    assert w.store.find(long_seg, "kb").length == 12
    full, _ = w.forward([prompt], [w.admit(len(prompt))])
    req = reuse_request(w, prompt, [(AT, AT + len(long_seg))])
    got, fb = w.forward([prompt], [w.admit(len(prompt))],
                        step=step_for(w, build_flow("cacheblend", {"ratio": "1.0", "check_layer": "1"}, ReuseFlow), [req]))
    torch.testing.assert_close(got, full, atol=1e-5, rtol=0)
    plan = fb.sparsetune_reuse.batch.members[0]
    assert plan.from_segments.nonzero().squeeze(1).tolist() == list(range(AT, AT + 12))
