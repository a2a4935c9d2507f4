"""SGLang's `bench_one_batch` with plugins loaded and the prefill split, for sparsetune's backend.

    SPARSETUNE_BUNDLE=DIR python benchmarks/sglang_one_batch.py --model-path M --load-format dummy \
        --attention-backend sparsetune --page-size 16 --batch-size 8 16 --input-len 32768 --output-len 16 ...

Same arguments and output as `python -m sglang.bench_one_batch` (SGLang 0.5.16: the module
`sglang.benchmark.one_batch`), with two changes:
- SGLang's plugins are loaded first: `bench_one_batch` builds its argument parser and model runner
  without `load_plugins()` (research note on SGLang, section 2.5), so `--attention-backend sparsetune`
  would be an invalid choice.
- The batch's prefill runs in groups of requests of at most `--extend-tokens` tokens (default 65536),
  merged into one batch before the decode steps, as SGLang's scheduler merges finished prefills into
  its running batch. One 16 x 32K extend holds 0.5M tokens of activations at once (its MLP alone
  needs ~40 GB) and does not fit beside a KV pool for that batch on one 141 GB GPU. Decode steps, the
  measured figure, are unchanged: one forward of the whole batch per step, CUDA graphs as configured.
- `--kernel-profile B` prints the GPU kernels of one decode step at batch size B (the 10th step of
  each run at that size; CUDA graphs replay as usual), heaviest first.
- `--warmup-input-len N` (default: the first `--input-len`) shortens the warm-up run's prompts: it
  compiles the same kernels (the CUDA graphs are captured before it) in less time.
Under `--tp-size N` SGLang spawns one process per rank, fresh interpreters: each rank loads the
plugins and applies the changes above itself (settings passed in the environment).
"""

from __future__ import annotations

import json
import os
import sys

import torch


def _split_extend(one_batch, max_tokens: int):
    whole = one_batch.extend

    def extend(reqs, model_runner):
        groups, group, tokens = [], [], 0
        for r in reqs:
            n = len(r.origin_input_ids)
            if group and tokens + n > max_tokens:
                groups.append(group)
                group, tokens = [], 0
            group.append(r)
            tokens += n
        groups.append(group)
        ids, logits, batch = whole(groups[0], model_runner)
        ids, logits = [ids], [logits]
        for g in groups[1:]:
            i, lg, b = whole(g, model_runner)
            batch.merge_batch(b)
            ids.append(i)
            logits.append(lg)
        return torch.cat(ids), torch.cat(logits), batch

    return extend


def _profiled_decode(one_batch, batch_size: int, step: int = 10):
    whole = one_batch.decode
    calls = {"n": 0, "batch": None}

    def decode(input_token_ids, batch, model_runner):
        if len(batch.reqs) != batch_size:
            return whole(input_token_ids, batch, model_runner)
        if calls["batch"] is not batch:  # a new run
            calls.update(n=0, batch=batch)
        calls["n"] += 1
        if calls["n"] != step:
            return whole(input_token_ids, batch, model_runner)
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = whole(input_token_ids, batch, model_runner)
            torch.cuda.synchronize()
        kernels: dict[str, list[float]] = {}
        for ev in prof.events():
            if ev.device_type.name == "CUDA":
                k = kernels.setdefault(ev.name[:90], [0.0, 0])
                k[0] += ev.device_time_total / 1e3
                k[1] += 1
        total = sum(v[0] for v in kernels.values())
        print(f"kernel profile, batch {batch_size}, context {int(batch.seq_lens.max())}, one decode step: {total:.2f} ms of GPU kernels")
        for name, (ms, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:14]:
            print(f"  {ms:7.3f} ms {100 * ms / total:5.1f}%  x{n:<4d} {name}")
        return out

    return decode


def _first_call_input_len(fn, arg: int, input_len: int):
    """`fn` with its positional argument `arg` (an input length) replaced by `input_len` on its first call."""
    calls = []

    def wrapped(*a, **kw):
        if not calls:
            a = (*a[:arg], input_len, *a[arg + 1:])
        calls.append(1)
        return fn(*a, **kw)

    return wrapped


def _pop(argv: list[str], flag: str) -> int | None:
    if flag not in argv:
        return None
    i = argv.index(flag)
    value = int(argv[i + 1])
    del argv[i:i + 2]
    return value


_SETTINGS = "SPARSETUNE_ONE_BATCH"


def _patched():
    """SGLang's one_batch module with the plugins loaded and the changes above applied, once per process."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.benchmark import one_batch

    if getattr(one_batch, "_sparsetune_latency_test", None):
        return one_batch
    max_tokens, warmup_len, profile_bs = json.loads(os.environ[_SETTINGS])
    one_batch.extend = _split_extend(one_batch, max_tokens)
    if profile_bs:
        one_batch.decode = _profiled_decode(one_batch, profile_bs)
    if warmup_len:  # latency_test: prepare_synthetic_inputs(batch, input_len), then run_once(.., batch, input_len, ..)
        one_batch.prepare_synthetic_inputs_for_latency_test = _first_call_input_len(
            one_batch.prepare_synthetic_inputs_for_latency_test, 1, warmup_len)
        one_batch.latency_test_run_once = _first_call_input_len(one_batch.latency_test_run_once, 5, warmup_len)
    one_batch._sparsetune_latency_test = one_batch.latency_test
    one_batch.latency_test = _latency_test  # main() picks it by name; under TP it pickles it for each rank
    return one_batch


def _latency_test(*args):
    return _patched()._sparsetune_latency_test(*args)


def main() -> None:
    argv = sys.argv[1:]
    max_tokens = _pop(argv, "--extend-tokens") or 65536
    settings = [max_tokens, _pop(argv, "--warmup-input-len"), _pop(argv, "--kernel-profile")]
    sys.argv = [sys.argv[0], *argv]
    os.environ[_SETTINGS] = json.dumps(settings)
    _patched().cli_main()


if __name__ == "__main__":
    main()
