"""Accuracy parity: the same RULER-style prompts through a live SGLang server and through sparsetune's engine.

    python benchmarks/sglang_parity.py --bundle DIR [--url http://127.0.0.1:30000] [--engine] \
        --context 2048 --samples 10 --label sglang-quest --json-out parity.jsonl

The prompts are `sparsetune eval`'s (`build_samples`, the chat template, the answer prefix), built
with the tokenizer of the model folder the server loads (`sparsetune models path smollm2-135m`).
Each turn's prompt token ids go to SGLang's `/generate` as `input_ids` (one request holding every
sample's prompt of that turn; greedy, the task's generation length), so both sides decode the very
same tokens; multi-turn samples feed back each side's own replies, as `sparsetune eval` does.
`--engine` runs the same loop on sparsetune's engine instead of a server, with the bundle's flow and
parameters (no bundle: dense), float16 as SGLang serves it.

A reuse bundle (issue #44) is checked on the samples with segments (`rag`): each prompt goes as its
parts (the chat frame's text and the answer prefix as plain parts around the sample's, which encode
to `sparsetune eval`'s very ids, `prompt_layout`), a request of its own with the parts in
`custom_params.sparsetune_parts` (the server stores each segment first); `--engine` generates the
same parts with the bundle's reuse flow and decode flow (its fills first, as the server's). Replies are scored by `sparsetune eval`'s
scorer; each row written holds the per-task accuracy and every reply, so two runs compare reply by reply.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path


def post(url: str, body: dict, timeout: float = 600.0) -> list[dict]:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
    return out if isinstance(out, list) else [out]


def joined(parts: list) -> str:
    """The prompt a list of parts (text, or {"text": ...}) makes: what the server is sent beside them."""
    return "".join(p if isinstance(p, str) else p["text"] for p in parts)


def wait_ready(url: str, seconds: float, pid: int | None) -> None:
    end = time.time() + seconds
    while time.time() < end:
        if pid is not None and not Path(f"/proc/{pid}").exists():
            raise SystemExit(f"the SGLang server (pid {pid}) exited before answering at {url}: see its log")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"no SGLang server answered at {url}/health within {seconds:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the HF-format folder the server loads")
    ap.add_argument("--bundle", help="the exported bundle (for --engine: its flow and params; none: dense)")
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--server-pid", type=int, help="the server's process: stop waiting if it exits")
    ap.add_argument("--engine", action="store_true", help="run sparsetune's engine instead of querying a server")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", default="", help="comma-separated (default: eval's default suite)")
    ap.add_argument("--label", required=True)
    ap.add_argument("--json-out", required=True)
    args = ap.parse_args()

    from sparsetune.evaluation.samples import prompt_ids
    from sparsetune.evaluation.tasks import DEFAULT_SUITE, build_samples
    from sparsetune.models.config import ModelConfig
    from sparsetune.models.tokenizer import HFTokenizer

    model = Path(args.model)
    tok = HFTokenizer(model, ModelConfig.from_json_file(model / "config.json").eos_token_ids)
    manifest = json.loads((Path(args.bundle) / "bundle.json").read_text()) if args.bundle else {}
    reuse = manifest.get("reuse")
    tasks = [t for t in args.tasks.split(",") if t] or (["rag"] if reuse else list(DEFAULT_SUITE))
    samples = [s for t in tasks for s in build_samples(t, tok, args.context, args.samples, args.seed)]
    if reuse:
        if args.engine:  # the engine serves the bundle's reuse flow over dense decode
            reuse_engine(args, model, tok, samples, manifest)
        else:
            reuse_server(args, tok, samples)
        return

    if args.engine:
        from sparsetune.engine.sequence import SamplingParams

        llm = engine(args, model, manifest, len(samples))

        def run(prompts: list[list[int]], lengths: list[int]) -> list[str]:
            outs = llm.generate(prompts, [SamplingParams(max_tokens=n) for n in lengths], chat=False)
            return [tok.decode(o.token_ids) for o in outs]
    else:
        wait_ready(args.url, 300, args.server_pid)

        def run(prompts: list[list[int]], lengths: list[int]) -> list[str]:
            outs = post(args.url, {"input_ids": prompts, "sampling_params": [
                {"temperature": 0, "max_new_tokens": n} for n in lengths]})
            return [o["text"] for o in outs]

    t0 = time.perf_counter()
    replies: list[list[str]] = [[] for _ in samples]
    for turn in range(max(len(s.turns) for s in samples)):
        rows = [i for i, s in enumerate(samples) if turn < len(s.turns)]
        prompts = [prompt_ids(tok, samples[i], turn, replies[i]) for i in rows]
        texts = run(prompts, [samples[i].max_new_tokens for i in rows])
        for i, t in zip(rows, texts):
            replies[i].append(t)
    write_row(args, samples, replies, time.perf_counter() - t0)


def sample_parts(tok, sample) -> list:
    """A first turn with segments as parts whose own encoding (`encode_parts`, no chat frame) is
    `prompt_layout`'s: the frame and the answer prefix as plain parts around the sample's."""
    from sparsetune.evaluation.samples import prompt_layout
    from sparsetune.reuse.parts import encode_parts, parse_parts

    if len(sample.turns) != 1 or not sample.segments:
        raise SystemExit(f"{sample.task}[{sample.index}]: the reuse parity takes single-turn samples with segments (rag)")
    before, after = tok.chat_frame()  # encode_parts(chat=True, suffix=...) encodes each of these on its own too
    parts = [p for p in (before, *[dict(p) for p in sample.segments], after, sample.turns[0].answer_prefix) if p]
    assert encode_parts(tok, parse_parts(parts), chat=False).token_ids == prompt_layout(tok, sample).token_ids
    return parts


def reuse_server(args, tok, samples) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from sparsetune.export.sglang.segments import FIELD

    wait_ready(args.url, 300, args.server_pid)

    def one(sample) -> str:
        parts = sample_parts(tok, sample)
        (out,) = post(args.url, {"text": joined(parts), "sampling_params": {
            "temperature": 0, "max_new_tokens": sample.max_new_tokens, "custom_params": {FIELD: json.dumps(parts)}}})
        return out["text"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        replies = [[t] for t in pool.map(one, samples)]
    write_row(args, samples, replies, time.perf_counter() - t0)


def reuse_engine(args, model: Path, tok, samples, manifest: dict) -> None:
    from sparsetune.engine.sequence import SamplingParams

    llm = engine(args, model, manifest, len(samples))
    llm.use_reuse(manifest["reuse"]["flow"], dict(manifest["reuse"]["params"]))
    t0 = time.perf_counter()
    outs = llm.generate([sample_parts(tok, s) for s in samples],
                        [SamplingParams(max_tokens=s.max_new_tokens) for s in samples], chat=False)
    write_row(args, samples, [[tok.decode(o.token_ids)] for o in outs], time.perf_counter() - t0)


def engine(args, model: Path, manifest: dict, seqs: int):
    """sparsetune's engine, float16 as SGLang serves it, with a bundle's decode flow and params (none: dense)."""
    from sparsetune.llm import LLM

    flow, params = None, {}
    if args.bundle:
        flow, params = str(Path(args.bundle) / manifest["source"]), dict(manifest["params"])
        if "calibration" in params:  # a calibrated flow: the bundle's own file (a name inside it)
            params["calibration"] = str(Path(args.bundle) / params["calibration"])
    return LLM(model=str(model), flow=flow, params=params, dtype="float16", max_num_seqs=seqs)


def write_row(args, samples, replies: list[list[str]], seconds: float) -> None:
    from sparsetune.evaluation.scoring import score_turns

    per_task: dict[str, list[float]] = {}
    records = []
    for s, rs in zip(samples, replies):
        scores = score_turns(s, rs)
        acc = sum(scores) / len(scores)
        per_task.setdefault(s.task, []).append(acc)
        records.append({"task": s.task, "index": s.index, "accuracy": acc, "replies": rs})
    task_acc = {t: sum(v) / len(v) for t, v in per_task.items()}
    row = {"label": args.label, "bundle": args.bundle, "engine": bool(args.engine), "context": args.context,
           "samples": args.samples, "seed": args.seed, "accuracy": sum(task_acc.values()) / len(task_acc),
           "tasks": task_acc, "seconds": round(seconds, 2), "records": records}
    with open(args.json_out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"{args.label}: accuracy {row['accuracy']:.3f} over {len(samples)} samples "
          f"({', '.join(f'{t} {a:.2f}' for t, a in task_acc.items())}) in {seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main()
