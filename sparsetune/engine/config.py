"""Engine settings, with defaults that fit a CPU laptop and scale to one GPU."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparsetune.models.registry import DEFAULT_MODEL


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    device: str | None = None  # None: CUDA if present, else CPU
    dtype: str | None = None  # None: float32 on CPU, the model's preferred dtype on GPU
    block_size: int = 16
    kv_memory: int | None = None  # bytes for the KV pool; None: fraction of free GPU memory / 2 GiB on CPU
    gpu_memory_utilization: float = 0.90
    num_kv_blocks: int | None = None  # exact pool size (tests); overrides kv_memory
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's context length
    cuda_graph: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    flow: str | None = None  # decode flow name or path to a flow file; None = dense
    flow_params: dict[str, str] = field(default_factory=dict)  # raw `--param key=value` strings
    flow_executor: str | None = None  # "reference" | "compiled"; None: compiled on CUDA, reference on CPU
    reuse: str | None = None  # KV-reuse flow for prompts with segments; None: segments are plain text
    reuse_params: dict[str, str] = field(default_factory=dict)
    segment_watermark: float = 0.9  # pool use above which pinned segments may be evicted
    prefix_caching: bool = False  # share computed full blocks between prompts with the same prefix
    random_weights: bool = False
    seed: int = 0
    extra: dict = field(default_factory=dict)
