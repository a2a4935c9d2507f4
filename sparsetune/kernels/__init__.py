"""GPU kernels (Triton) for sparsetune, each with a plain-torch reference twin.

Modules (import them explicitly; this package does not import triton eagerly so
that CPU-only code paths never pay for, or depend on, a triton import):

- ``sparsetune.kernels.paged_decode``: flash-decoding (split-K) attention over a
  paged KV cache for single-token decode, ``paged_decode_attention`` (Triton) and
  ``paged_decode_attention_ref`` (torch, also the engine's CPU path), plus the
  shape-only split heuristic ``choose_num_splits``.
- ``sparsetune.kernels.fused_ops``: small fused per-layer kernels and their
  ``*_ref`` twins: ``rms_norm`` (optionally fused with the residual add),
  ``silu_and_mul``, ``apply_rope`` and ``qk_norm_rope`` (Qwen3 per-head q/k
  RMSNorm fused with RoPE).

Kernels run on CPU through the Triton interpreter when ``TRITON_INTERPRET=1`` is
set before triton is imported (that is how the test-suite exercises them).
"""
