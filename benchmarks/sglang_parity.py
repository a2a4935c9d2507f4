"""Accuracy parity: the same RULER-style prompts through a live SGLang server and through sparsetune's engine.

    python benchmarks/sglang_parity.py --bundle DIR [--url http://127.0.0.1:30000] [--engine] \
        --context 2048 --samples 10 --label sglang-quest --json-out parity.jsonl

The prompts are `sparsetune eval`'s (`build_samples`, the chat template, the answer prefix), built
with the tokenizer of the model folder the server loads (`sparsetune models path smollm2-135m`).
Each turn's prompt token ids go to SGLang's `/generate` as `input_ids` (one request holding every
sample's prompt of that turn; greedy, the task's generation length), so both sides decode the very
same tokens; multi-turn samples feed back each side's own replies, as `sparsetune eval` does.
`--engine` runs the same loop on sparsetune's engine instead of a server, with the bundle's flow and
parameters (no bundle: dense), float16 as SGLang serves it. Replies are scored by `sparsetune eval`'s
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
    from sparsetune.evaluation.scoring import score_turns
    from sparsetune.evaluation.tasks import DEFAULT_SUITE, build_samples
    from sparsetune.models.config import ModelConfig
    from sparsetune.models.tokenizer import HFTokenizer

    model = Path(args.model)
    tok = HFTokenizer(model, ModelConfig.from_json_file(model / "config.json").eos_token_ids)
    tasks = [t for t in args.tasks.split(",") if t] or list(DEFAULT_SUITE)
    samples = [s for t in tasks for s in build_samples(t, tok, args.context, args.samples, args.seed)]

    if args.engine:
        from sparsetune.engine.sequence import SamplingParams
        from sparsetune.llm import LLM

        flow, params = None, {}
        if args.bundle:
            manifest = json.loads((Path(args.bundle) / "bundle.json").read_text())
            flow, params = str(Path(args.bundle) / manifest["source"]), dict(manifest["params"])
            if "calibration" in params:  # a calibrated flow: the bundle's own file (a name inside it)
                params["calibration"] = str(Path(args.bundle) / params["calibration"])
        llm = LLM(model=str(model), flow=flow, params=params, dtype="float16", max_num_seqs=len(samples))

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
    seconds = time.perf_counter() - t0

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
