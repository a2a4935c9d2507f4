"""A model's tuned defaults under the user's params: the one rule for which params a run takes.

A flow's own defaults (its `Param`s) are one set for every model; a model can have its own per
flow (`models.artifacts.read_tuned_defaults`: shipped from measured tables, or saved by
`sparsetune search --save-defaults`). A run of a built-in flow on that model takes them unless the
user set the param (`--param`, or the engine's `--block-size` for block_size); `budget` and
`budget_ratio` are one setting, so the user's either one replaces both. `EngineConfig.defaults`
"published" turns them off (the search does: it measures exactly the points it picks).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparsetune.engine.config import EngineConfig

BUDGET = ("budget", "budget_ratio")  # one setting: a user's either one replaces the tuned pair


def with_tuned_defaults(model: str, random_weights: bool, flow: str | None, params: dict[str, str], *,
                        block_size_set: bool = False) -> tuple[dict[str, str], dict[str, Any] | None]:
    """`params` over the model's tuned defaults for `flow` (a built-in flow's name; a flow file keeps
    its own), and what was taken from them ({"flow", "params", "file", "source"}; None: nothing)."""
    from sparsetune.flow.params import is_flow_file

    if flow is None or flow == "dense" or is_flow_file(flow):
        return dict(params), None
    from sparsetune.models.artifacts import read_tuned_defaults

    entry = read_tuned_defaults(model, random_weights).get(flow)
    if entry is None:
        return dict(params), None
    user = set(params) | ({"block_size"} if block_size_set else set())
    if user & set(BUDGET):
        user |= set(BUDGET)
    taken = {k: v for k, v in entry["params"].items() if k not in user}
    if not taken:
        return dict(params), None
    return {**taken, **params}, {"flow": flow, "params": taken, "file": entry["file"], "source": entry["source"]}


def tuned_config(cfg: EngineConfig, flow: str | None, params: dict[str, str], *,
                 users_block_size: bool) -> tuple[dict[str, str], EngineConfig]:
    """`params` with the model's tuned defaults under them when `cfg.defaults` is "tuned", and `cfg`
    recording what was taken (`tuned`; a config that records it already, a resumed run's, keeps it).
    `users_block_size`: the config's block size is the user's `--block-size` (not an engine's own)."""
    if cfg.defaults != "tuned":
        return dict(params), replace(cfg, tuned=None)
    from sparsetune.engine.config import EngineConfig

    merged, taken = with_tuned_defaults(cfg.check()[0], cfg.random_weights, flow, params,
                                        block_size_set=users_block_size and cfg.block_size != EngineConfig.block_size)
    return merged, replace(cfg, tuned=taken or cfg.tuned)


def describe(flow: str | None, model: str, tuned: dict[str, Any] | None) -> str | None:
    """One line on which defaults a run of `flow` used and where they came from (None: no flow)."""
    if flow is None or flow == "dense":
        return None
    if tuned is None:
        return f"{flow}: its published defaults (no tuned defaults for {model} under your --param)"
    src = tuned.get("source", {})
    origin = src.get("study") and f"study {src['study']} ({src.get('trial', '?')})" or src.get("from", "")
    kept = ", ".join(f"{k}={v}" for k, v in tuned["params"].items())
    return f"{flow}: tuned defaults for {model}: {kept} (from {tuned['file']}{'; ' + origin if origin else ''}); " \
           f"--param overrides them, --defaults published ignores them"
