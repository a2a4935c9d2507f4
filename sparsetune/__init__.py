"""sparsetune: try, tune and ship sparse-attention and KV-reuse flows for LLM serving."""

from __future__ import annotations

__version__ = "0.1.0"

# Lazy: `import sparsetune` stays cheap (no torch import) for the CLI's --help.
# sparsetune.eval(flow=..., model=..., tasks=...) → results.json as a dict; EvalResult.read(run_dir) reads one back.
_LAZY = {
    "generate": "sparsetune.api",
    "eval": "sparsetune.api",
    "list_models": "sparsetune.api",
    "bench_serve": "sparsetune.api",
    "search": "sparsetune.api",
    "LLM": "sparsetune.llm",
    "EngineConfig": "sparsetune.engine.config",
    "SamplingParams": "sparsetune.engine.sequence",
    "EvalConfig": "sparsetune.evaluation.config",
    "EvalResult": "sparsetune.evaluation.results",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    from importlib import import_module

    if name not in _LAZY:
        raise AttributeError(name)
    return getattr(import_module(_LAZY[name]), name)
