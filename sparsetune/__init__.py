"""sparsetune: try, tune and ship sparse-attention and KV-reuse flows for LLM serving."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "generate", "eval", "list_models", "LLM", "EngineConfig", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: `import sparsetune` stays cheap (no torch import) for the CLI's --help.
    if name in ("generate", "list_models"):
        from sparsetune import api

        return getattr(api, name)
    if name == "eval":  # sparsetune.eval(flow=..., model=..., tasks=...) → results.json as a dict
        from sparsetune.evaluation.runner import evaluate

        return evaluate
    if name == "LLM":
        from sparsetune.llm import LLM

        return LLM
    if name == "EngineConfig":
        from sparsetune.engine.config import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from sparsetune.engine.sequence import SamplingParams

        return SamplingParams
    raise AttributeError(name)
