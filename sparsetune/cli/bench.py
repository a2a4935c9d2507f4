"""`sparsetune bench serve`: latency under serving load (open-loop Poisson arrivals) for dense and
each flow, at each request rate, on the embedded engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from sparsetune.cli import options as opt
from sparsetune.cli.options import apply_threads, progress
from sparsetune.cli.output import emit_json, err
from sparsetune.errors import SparsetuneError

app = typer.Typer(help="Benchmarks of the engine under load.", no_args_is_help=True, rich_markup_mode=None)


def _floats(text: str, option: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SparsetuneError(f"{option} {text!r}: write comma-separated numbers, e.g. {option} 1,2,4,8") from None


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(f.strip() for f in (text or "").split(",") if f.strip())


def _slo(text: str | None) -> dict[str, float]:
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise SparsetuneError(f"--slo {text!r}: write metric=milliseconds pairs, e.g. --slo ttft=2000,tpot=50")
    return out


@app.command("serve")
def serve(
    flow: str = typer.Option(None, "--flow", "-f", help="Comma-separated decode flows (names or .py files; default "
                             "dense,block_topk,quest); dense always runs, first. With --reuse: one decode flow, in every "
                             "cell (default dense)."),
    param: list[str] = typer.Option(None, "--param", help="key=value for every flow but dense, or flow:key=value "
                                    "for one (repeatable), e.g. --param budget=2048 --param quest:block_size=16."),
    reuse: str = typer.Option(None, "--reuse", help="Comma-separated reuse flows: a reuse run, whose cells are plain "
                              "prompts, prefix caching and each reuse flow, on --workload."),
    reuse_param: list[str] = typer.Option(None, "--reuse-param", help="key=value for every reuse flow, or "
                                          "flow:key=value for one (repeatable)."),
    workload: str = typer.Option(None, "--workload", help="With --reuse: rag (documents of a corpus, Zipf "
                                 "popularity), chat (sessions re-sending their history) or agent (tool outputs "
                                 "shared across agents). Default rag."),
    docs: int = typer.Option(None, "--docs", help="rag: documents in the corpus; agent: tool outputs in the pool (default 64)."),
    per_prompt: int = typer.Option(None, "--per-prompt", help="rag: documents per prompt; agent: tool outputs per "
                                   "prompt; chat: turns per session (default 8)."),
    doc_len: int = typer.Option(None, "--doc-len", help="Tokens per document, tool output, role prompt or chat "
                                "message (default 4096)."),
    question_len: int = typer.Option(None, "--question-len", help="Fresh tokens after the segments (rag's question, "
                                     "agent's task); chat: the longest note before the history (default 64)."),
    zipf: float = typer.Option(None, "--zipf", help="Zipf exponent of document popularity (0: uniform; default 1.0)."),
    agents: int = typer.Option(None, "--agents", help="agent: agents, each with its role prompt (default 4)."),
    cold_corpus: bool = typer.Option(False, "--cold-corpus", help="Do not store the corpus before each cell (its "
                                     "first uses are misses)."),
    prefix_caching: bool = typer.Option(False, "--prefix-caching", help="Share cached prompt prefixes in every cell "
                                        "(with --reuse: every cell but plain; under each reuse flow a prompt takes "
                                        "the cached prefix it starts with, then its segments)."),
    segment_cap: float = typer.Option(1.0, "--segment-cap", help="Share of the KV pool stored segments may hold; "
                                      "idle ones beyond it are evicted, least recently used first."),
    rate: str = typer.Option("1,2,4,8", "--rate", help="Comma-separated request rates (requests/s, Poisson arrivals)."),
    requests: int = typer.Option(32, "--requests", "-n", help="Requests per (flow, rate) cell, the same in every cell; "
                                 "whether the engine keeps up is judged when their arrivals span two E2E latencies."),
    input_len: str = typer.Option(None, "--input-len", help="Prompt tokens: N, A-B (uniform) or N:w,M:w (a mix); "
                                  "default 1024 (a reuse run's prompts come from its workload)."),
    output_len: str = typer.Option("128", "--output-len", help="Output tokens (EOS ignored): N, A-B or N:w,M:w."),
    prefill: str = typer.Option("engine", "--prefill", help="engine: prompts are prefilled between decode steps (one "
                                "node); disaggregated: requests arrive with their KV (the decode node of a P1D1 "
                                "split, Vortex's setting; speed only)."),
    slo: str = typer.Option(None, "--slo", help="SLO targets in ms for goodput, e.g. ttft=2000,tpot=50 (ttft, tpot, e2e)."),
    warmup: int = typer.Option(2, "--warmup", help="Requests run before each flow's cells, not measured."),
    model: str = opt.model_option(),
    random_weights: bool = opt.random_weights_option("Seeded random weights: another architecture's speed "
                                                     "(e.g. --model qwen3-8b); the text is meaningless."),
    device: str = opt.device_option(),
    dtype: str = opt.dtype_option(),
    kv_memory: str = opt.kv_memory_option("KV pool size, e.g. 40GiB (default: 90% of free GPU memory; 2GiB on CPU)."),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", help="Requests decoding together at most."),
    max_batched_tokens: int = typer.Option(8192, "--max-batched-tokens", help="Prefill tokens per step (chunked prefill)."),
    schedule: str = typer.Option("interleave", "--schedule", help="With --prefill engine: interleave (a decode step "
                                 "between prefill chunks: an arriving prompt stalls the running requests by one "
                                 "chunk) or prefill_first (every waiting prompt's prefill before the next decode step)."),
    flow_executor: str = opt.flow_executor_option(),
    defaults: str = opt.defaults_option(),
    no_cuda_graph: bool = opt.no_cuda_graph_option(),
    seed: int = opt.seed_option("Seed of the workload (lengths, arrivals, token ids) and random weights."),
    out: Path = opt.out_option("Parent directory of the run directory.", "-o"),
    resume: Path = typer.Option(None, "--resume", help="Finish an interrupted run directory (its config wins)."),
    threads: int = opt.threads_option(),
    json_out: bool = opt.json_option("Print results.json to stdout (the tables go to stderr)."),
) -> None:
    """Latency under load: TTFT, TPOT, ITL and end-to-end latency at p50/p95/p99, throughput and
    goodput, for dense and each flow at each request rate; the P95 TPOT reduction of each flow at
    the highest rate dense keeps up with; a plot of P95 TPOT and TTFT against the rate."""
    from sparsetune import api

    options = {} if resume is not None else dict(  # a resumed run's config wins
        opt.engine_options(model, device=device, dtype=dtype, random_weights=random_weights, kv_memory=kv_memory,
                           no_cuda_graph=no_cuda_graph, seed=seed, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_batched_tokens, schedule=schedule, segment_cap=segment_cap,
                           prefix_caching=prefix_caching),
        executor=flow_executor, defaults=defaults, params=tuple(param or ()), rates=_floats(rate, "--rate"),
        requests=requests, output_len=output_len, prefill=prefill, slo=_slo(slo), warmup=warmup, seed=seed,
        reuse=_names(reuse), reuse_params=tuple(reuse_param or ()),
        **{k: v for k, v in dict(flows=_names(flow) if flow is not None else None, input_len=input_len,
                                 workload=workload, docs=docs, per_prompt=per_prompt, doc_len=doc_len,
                                 question_len=question_len, zipf=zipf, agents=agents,
                                 warm_corpus=False if cold_corpus else None).items() if v is not None})
    opt.check_writable(resume or out, "--resume" if resume is not None else "--out")  # where the run is written
    config = api.serve_config(resume=resume, **options)  # every check before the model loads
    apply_threads(threads)
    live = _Live()
    with progress("bench serve", "requests") as update:
        live.update = update
        update(0, 0, f"loading {config.engine.model}")
        try:
            result = api.bench_serve(None if resume is not None else config, out=out, resume=resume, on_event=live)
        except KeyboardInterrupt:
            if live.run_dir:
                err.print(f"[yellow]interrupted: the finished cells are on disk; continue with: "
                          f"sparsetune bench serve --resume {live.run_dir}[/]")
            raise
    if json_out:
        emit_json(result)
    from rich.console import Console

    # The table is wider than 80 columns: off a terminal (logs, pipes) it is not cut to 80.
    console = Console(stderr=json_out, highlight=False)
    if not console.is_terminal:
        console.width = 150
    console.print(table(result))
    for line in reduction_lines(result):
        console.print(line)
    err.print(f"[dim]{result['run_dir']}/: results.json, requests.jsonl, latency.png, config.json, env.json[/]")


class _Live:
    """Progress over the requests of every cell still to run."""

    def __init__(self) -> None:
        self.update: Any = None
        self.run_dir: str | None = None
        self.total = 0  # requests in the cells still to run
        self.base = 0  # of them, those in finished cells
        self.label = ""

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "start":
            self.run_dir, self.total = data["run_dir"], data["requests"]
            err.print(f"[dim]run directory: {data['run_dir']}" + (f" ({data['done']} cells done)" if data["done"] else "") + "[/]")
        elif kind == "warmup":
            self.update(self.base, self.total, f"warming up {data['flow']}")
        elif kind == "cell":
            self.label = f"{data['flow']} at {data['rate']:g} req/s"
        elif kind == "finish":
            self.update(self.base + data["finished"], self.total, self.label)
        elif kind == "cell_done":
            c = data["cell"]
            self.base += c["requests"]
            err.print(f"{c['flow']} at {c['rate']:g} req/s: P95 TPOT {_ms(c['tpot_ms'], 'p95')}, P95 TTFT "
                      f"{_ms(c['ttft_ms'], 'p95')}, {_rate(c['output_throughput'])} tok/s"
                      + ("" if c["kept_up"] is not False else " [yellow](did not keep up)[/]"))


def _ms(stats: dict | None, q: str) -> str:
    return "-" if not stats else f"{stats[q]:.1f} ms"


def _rate(x: float) -> str:
    """Tokens/s: whole numbers from 100 up, three significant digits below (a CPU run makes < 1)."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def table(result: dict[str, Any]):
    from rich.table import Table

    t = Table(title=f"{result['model']} on {result['device']} ({result['dtype']}), prefill {result['prefill']}"
                    + (", random weights" if result["random_weights"] else ""), title_justify="left")
    cols = ["flow", "rate", "kept up", "TTFT p50", "TTFT p95", "TPOT p50", "TPOT p95", "TPOT p99", "ITL p95",
            "E2E p95", "out tok/s"]
    has_slo = any("slo" in c for c in result["cells"])
    cols += ["goodput", "SLO %"] if has_slo else []
    has_cache = any("cache" in c for c in result["cells"])
    cols += ["prefix %", "seg %", "recomp %", "blocks"] if has_cache else []
    for col in cols:
        t.add_column(col, justify="left" if col == "flow" else "right")
    for c in result["cells"]:
        kept = {True: "yes", False: "no", None: "-"}[c["kept_up"]]
        row = [c["flow"], f"{c['rate']:g}", kept] + [
            "-" if not c[f"{m}_ms"] else f"{c[f'{m}_ms'][q]:.1f}"
            for m, q in (("ttft", "p50"), ("ttft", "p95"), ("tpot", "p50"), ("tpot", "p95"), ("tpot", "p99"),
                         ("itl", "p95"), ("e2e", "p95"))] + [_rate(c["output_throughput"])]
        if has_slo:
            s = c.get("slo") or {}
            row += [f"{s['goodput']:.2f}" if s else "-", f"{100 * s['attainment']:.0f}" if s else "-"]
        if has_cache:
            k = c["cache"]
            row += [f"{100 * k['prefix_hit_rate']:.0f}", f"{100 * k['segment_hit_rate']:.0f}",
                    f"{100 * k['recompute_rate']:.0f}", str(k["blocks"])]
        t.add_row(*row)
    t.caption = ("latencies in ms; rate and goodput in requests/s; kept up: requests finished at >= 90% of the rate "
                 "they arrived (-: the run is too short to tell, its arrivals span less than two E2E latencies; raise --requests)"
                 + ("; prefix % / seg %: prompt tokens from the prefix cache / from stored segments; recomp %: "
                    "share of the reused tokens recomputed; blocks: KV blocks the cache held at the cell's end"
                    if has_cache else ""))
    t.caption_justify = "left"
    return t


def reduction_lines(result: dict[str, Any]) -> list[str]:
    if "slo_rates" in result:  # a reuse run
        rates = result["slo_rates"]
        if rates is None:
            return ["the highest rate meeting a P95 TTFT target needs one: add --slo ttft=MS"]
        best = ", ".join(f"{name} {'-' if r is None else f'{r:g} req/s'}" for name, r in rates["max_rate"].items())
        lines = [f"highest rate whose P95 TTFT meets {rates['ttft_p95_slo_ms']:g} ms: {best}"]
        for base, over in rates["over"].items():
            parts = [f"{name} {x:.2f}x" for name, x in over.items() if x is not None]
            if parts:
                lines.append(f"over {base}: " + ", ".join(parts))
        return lines
    red = result["reductions"]
    lines = []
    if red["dense_max_kept_up_rate"] is None and result["cells"]:
        lines.append("dense kept up at no rate measured (or the runs were too short to tell): add lower --rate "
                     "values or raise --requests for the comparison at the highest rate it sustains")
    for label, what in (("max_kept_up_rate", "the highest rate dense kept up with"), ("max_rate", "the highest rate")):
        at = red["at"].get(label)
        if not at or not at["flows"]:
            continue
        parts = [f"{flow} {v['tpot_p95']:.2f}x" for flow, v in at["flows"].items() if v["tpot_p95"] is not None]
        lines.append(f"P95 TPOT reduction over dense at {what} ({at['rate']:g} req/s): " + ", ".join(parts))
    return lines
