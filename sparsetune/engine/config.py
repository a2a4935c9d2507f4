"""Engine settings, with defaults that fit a CPU laptop and scale to one GPU.

Frozen: nothing writes onto a caller's config. Derive a changed one with `dataclasses.replace`;
what the engine derives from it (device, dtype, pool size, context length) lives on the `Engine`.
Only what the engine reads is here: a run's flows are in its `sparsetune.setup.Setup`, which holds
one of these."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from sparsetune.errors import SparsetuneError
from sparsetune.models.registry import DEFAULT_MODEL

if TYPE_CHECKING:
    from sparsetune.models.config import ModelConfig


DEFAULT_BLOCK_SIZE = 16  # tokens per KV block when neither the user nor a flow sets it
SCHEDULES = ("prefill_first", "interleave")  # how prefill chunks and decode steps share the engine


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    device: str | None = None  # None: CUDA if present, else CPU
    dtype: str | None = None  # None: float32 on CPU, the model's preferred dtype on GPU
    block_size: int | None = None  # tokens per KV block; None: DEFAULT_BLOCK_SIZE, or a flow's selection block (`setup.resolve`)
    kv_memory: int | None = None  # bytes for the KV pool; None: fraction of free GPU memory / 2 GiB on CPU
    gpu_memory_utilization: float = 0.90
    num_kv_blocks: int | None = None  # exact pool size (tests); overrides kv_memory
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    schedule: str = "prefill_first"  # "interleave": a decode step between prefill chunks (engine/scheduler.py)
    max_model_len: int | None = None  # None: the model's context length
    cuda_graph: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    # Greedy decode steps launch the next step before reading this one's tokens (the host's work
    # overlaps the GPU's; `Engine.step`). None: on where decode replays CUDA graphs.
    overlap: bool | None = None
    segment_watermark: float = 0.9  # pool use above which pinned segments may be evicted
    segment_cap: float = 1.0  # share of the pool stored segments may hold (idle ones beyond it go, LRU first)
    prefix_caching: bool = False  # share computed full blocks between prompts with the same prefix
    random_weights: bool = False
    seed: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        """From its JSON object (`asdict`); keys it does not have are dropped (older records)."""
        d = {k: v for k, v in d.items() if k in ENGINE_FIELDS}
        if d.get("cuda_graph_batch_sizes") is not None:
            d["cuda_graph_batch_sizes"] = tuple(d["cuda_graph_batch_sizes"])
        return cls(**d)

    def check(self) -> tuple[str, ModelConfig]:
        """The option rules that need neither torch nor weights, and that the model exists (`LLM`, the
        Python API and the CLI run them first, so a mistake fails before torch loads). Returns the
        model's name and architecture (`models.resolve.model_config`)."""
        from sparsetune.device import check_device_name, check_dtype_name
        from sparsetune.models.resolve import model_config

        bs = self.block_size
        if bs is not None and (not isinstance(bs, int) or bs < 1 or bs & (bs - 1)):
            raise SparsetuneError(f"--block-size must be a power of two (got {bs})")
        for flag, value, low in (("--max-model-len", self.max_model_len, 1), ("max_num_seqs", self.max_num_seqs, 1),
                                 ("max_num_batched_tokens", self.max_num_batched_tokens, 1),
                                 ("--kv-memory", self.kv_memory, 1), ("num_kv_blocks", self.num_kv_blocks, 1)):
            if value is not None and value < low:
                raise SparsetuneError(f"{flag} must be at least {low} (got {value})")
        for name, share in (("gpu_memory_utilization", self.gpu_memory_utilization),
                            ("segment_watermark", self.segment_watermark), ("--segment-cap", self.segment_cap)):
            if not 0 < share <= 1:
                raise SparsetuneError(f"{name} must be in (0, 1] (got {share})")
        check_device_name(self.device)
        check_dtype_name(self.dtype)
        if self.schedule not in SCHEDULES:
            raise SparsetuneError(f"--schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        return model_config(self.model, self.random_weights)


ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig))


def split_engine_options(options: dict[str, Any], own: set[str] | frozenset[str], what: str) -> tuple[EngineConfig, dict[str, Any]]:
    """Flat keyword options (as the Python API takes them) → an `EngineConfig` of the engine's
    fields and the rest, which must be among `own` (a config's own fields); `what` names the config
    in the error for an unknown one."""
    unknown = [k for k in options if k not in ENGINE_FIELDS and k not in own]
    if unknown:
        raise TypeError(f"unknown {what} option {unknown[0]!r}")
    engine = EngineConfig(**{k: v for k, v in options.items() if k in ENGINE_FIELDS})
    return engine, {k: v for k, v in options.items() if k not in ENGINE_FIELDS}
