"""Rotary position embedding tables (default and llama3-scaled frequencies).

Keys are cached post-RoPE, so one table serves prefill, decode, and (later) the
realignment of reused segments, which rotates cached keys by a position delta.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair inverse frequencies in float32, as HF transformers computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # llama3: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between is interpolated smoothly (Llama 3.1 paper / HF `_compute_llama3_parameters`).
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_table(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """`[max_positions, head_dim]` float32: cos in the first half of the columns, sin in the second."""
    dev = torch.device(device) if device is not None else torch.get_default_device()
    inv_freq = inv_frequencies(head_dim, theta, scaling).to(dev)
    pos = torch.arange(max_positions, dtype=torch.float32, device=dev)
    freqs = torch.outer(pos, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
