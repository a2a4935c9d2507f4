"""`sparsetune generate`: one prompt through the embedded engine."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from sparsetune.cli import options as opt
from sparsetune.cli.options import apply_threads
from sparsetune.cli.output import emit_json, err


def _read_parts(path: Path) -> list:
    """The --parts file: a JSON list of parts (validated when the prompt is encoded)."""
    import json

    from sparsetune.errors import SparsetuneError

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SparsetuneError(f"--parts {path}: no such file") from None
    except OSError as e:
        raise SparsetuneError(f"--parts {path}: cannot read it ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SparsetuneError(f"--parts {path}: not a JSON list of parts ({e})") from None
    if not isinstance(data, list) or not data:
        raise SparsetuneError(f'--parts {path}: expected a non-empty JSON list of strings and {{"text": ..., "reuse": true}} objects')
    return data


def generate(
    prompt: str = typer.Option(None, "--prompt", "-p", help="The user message (the chat template is applied)."),
    parts: Path = typer.Option(None, "--parts", help="A JSON file: the user message as a list of parts, strings and "
                               '{"text": ..., "reuse": true, "namespace": ...} segments (needs --reuse). Segments '
                               "are cached for this process only: each run computes them once, then reuses them; "
                               "keep them across prompts with the Python API's LLM."),
    reuse: str = opt.reuse_option("KV-reuse flow for the segments of --parts: sparsex, cacheblend, ..."),
    reuse_param: list[str] = opt.reuse_param_option(),
    model: str = opt.model_option(),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    seed: int = opt.seed_option("Seed for sampling and random weights."),
    no_chat: bool = typer.Option(False, "--no-chat", help="Feed the prompt raw, without the chat template."),
    device: str = opt.device_option(),
    dtype: str = opt.dtype_option(),
    random_weights: bool = opt.random_weights_option(),
    kv_memory: str = opt.kv_memory_option("KV pool size, e.g. 4GiB (default: 90% of free GPU memory, 2GiB on CPU)."),
    block_size: int = typer.Option(None, "--block-size", help="Tokens per KV block (default: the flow's selection block, else 16)."),
    max_model_len: int = typer.Option(None, "--max-model-len", help="Cap the context length."),
    no_cuda_graph: bool = opt.no_cuda_graph_option(),
    prefix_caching: bool = opt.prefix_caching_option(),
    flow: str = opt.flow_option(),
    param: list[str] = opt.param_option(),
    flow_executor: str = opt.flow_executor_option(),
    defaults: str = opt.defaults_option(),
    threads: int = opt.threads_option(),
    json_out: bool = opt.json_option("Print a JSON object to stdout."),
) -> None:
    """Generate a completion for one prompt."""
    from sparsetune.api import describe_defaults, generate as run
    from sparsetune.errors import SparsetuneError

    if (prompt is None) == (parts is None):
        raise SparsetuneError("pass exactly one of --prompt TEXT and --parts FILE")
    if parts is not None and reuse is None:
        raise SparsetuneError("--parts needs a reuse flow for its segments: add --reuse NAME (e.g. sparsex)")
    if parts is None and (reuse is not None or reuse_param):
        raise SparsetuneError("--reuse applies to the segments of a --parts FILE prompt; a --prompt has none")
    user = prompt if parts is None else _read_parts(parts)
    options = opt.setup_options(model, flow=flow, param=param, reuse=reuse, reuse_param=reuse_param, device=device,
                               dtype=dtype, random_weights=random_weights, kv_memory=kv_memory,
                               flow_executor=flow_executor, defaults=defaults, no_cuda_graph=no_cuda_graph, seed=seed,
                               block_size=block_size, max_model_len=max_model_len, prefix_caching=prefix_caching,
                               max_num_seqs=8)
    apply_threads(threads)
    with err.status(f"loading {model} and generating ..."):
        result = run(user, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, chat=not no_chat,
                     **options)
    if json_out:
        emit_json(result.to_dict())
    else:
        sys.stdout.write(result.text + "\n")
    rate = f", {result.decode_tokens_per_second:.1f} tok/s decode" if result.decode_tokens_per_second else ""
    err.print(
        f"[dim]{result.model} on {result.device} ({result.dtype}): {result.prompt_tokens} prompt + "
        f"{result.completion_tokens} new tokens in {result.seconds:.2f}s{rate}; finish: {result.finish_reason}[/]"
    )
    said = describe_defaults(result.flow, result.model, result.defaults)
    if said:
        err.print(f"[dim]{said}[/]")
    if result.attended_tokens is not None:
        err.print(f"[dim]{result.flow} attends {result.attended_tokens} of the prompt's {result.prompt_tokens} tokens "
                  "per sparse layer[/]")
    if result.reuse:
        r = result.reuse
        err.print(f"[dim]reuse ({r['flow']}): {r['reuse_ratio']:.0%} of the prompt reused, {r['recompute_ratio']:.0%} of "
                  f"it recomputed; {r['segment_hits']} segment hits, {r['segment_misses']} computed and stored first "
                  "(the segment cache lives in this process: a later run computes them again)[/]")
    if result.random_weights:
        err.print("[yellow]random weights: the text is meaningless (speed-only run)[/]")
