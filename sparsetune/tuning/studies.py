"""The search's studies: one Optuna study per flow, opened or made in the search's storage.

A flow's study starts with its seeds (enqueued, `seed_trials`: the defaults, then each
categorical's other levels at the defaults), then TPE after `STARTUP_TRIALS` random trials.
`Studies` is what the rest of the search passes around: each flow's study, its class (what
`suggest` reads), the flow as a trial runs it, and which flows a proposer added at runtime
(`add_flow(foreign=True)`). `trial_records` reads every finished trial back as the records the
run folder, the allocation and confirmation work from.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import TrialState

from sparsetune.errors import SparsetuneError
from sparsetune.tuning.config import SearchConfig, check_speed_context, flow_key, masked_url
from sparsetune.tuning.space import dimensions
from sparsetune.tuning.storage import open_storage, record_of, stored_config, study_name

STARTUP_TRIALS = 2  # random trials per flow's study, after the seeded ones (`seed_trials`)
DEFAULT_BUDGET_RATIO = 0.125  # the defaults' budget, as a share of the context (the search's budget coordinate)


@dataclass
class Studies:
    """The search's flows by key: each one's study, its class (what `suggest` reads), the flow as
    a trial runs it (a built-in name or a file), the model's number of layers. `foreign`: flows
    added at runtime by a proposer (`agents.loop`): their failures are theirs, not the engine's."""

    studies: dict[str, optuna.Study]
    classes: dict[str, type]
    num_layers: int
    args: dict[str, str] = field(default_factory=dict)
    foreign: set[str] = field(default_factory=set)


def _num_layers(model: str) -> int:
    from sparsetune.models.resolve import model_config

    return model_config(model, False)[1].num_hidden_layers


def default_trial_params(cls: type, num_layers: int, fixed: dict[str, str]) -> dict[str, Any]:
    """A flow's defaults as values of its search dimensions (layer sets as their size; a fixed
    token budget as `DEFAULT_BUDGET_RATIO` of the context)."""
    from optuna.distributions import CategoricalDistribution

    specs, out = cls.param_specs(), {}
    for dim in dimensions(cls, num_layers):
        if dim.name in fixed:
            continue
        default = specs[dim.name].default
        if default is None and dim.default is not None:  # a layer its flow derives from the model
            default = dim.default
        if dim.layers is not None:
            value: Any = len(default or ())
        elif dim.name == "budget_ratio" and default is None:
            value = DEFAULT_BUDGET_RATIO
        else:
            value = default
        d = dim.distribution
        ok = value in d.choices if isinstance(d, CategoricalDistribution) else (
            value is not None and d.low <= value <= d.high)
        if ok:
            out[dim.name] = value
    return out


def seed_trials(cls: type, num_layers: int, fixed: dict[str, str]) -> list[tuple[dict[str, Any], str]]:
    """What a flow's study runs before sampling: its defaults, then every other choice of each
    categorical dimension with the rest at the defaults (one factor at a time). Random startup
    trials rarely cover a categorical's every level, and a level can change everything (blocks of
    2 tokens against 16 on a head-dimension-64 model), so each is measured once."""
    from optuna.distributions import CategoricalDistribution

    base = default_trial_params(cls, num_layers, fixed)
    out: list[tuple[dict[str, Any], str]] = [(base, "defaults")]
    for dim in dimensions(cls, num_layers):
        if dim.name in fixed or dim.name not in base or not isinstance(dim.distribution, CategoricalDistribution):
            continue
        out += [({**base, dim.name: c}, "sweep") for c in dim.distribution.choices if c != base[dim.name]]
    return out


def open_flows(cfg: SearchConfig, *, create: bool) -> Studies:
    """Every flow's study in the search's storage; `create`: make missing ones (the coordinator),
    each seeded with its defaults, and refuse a stored search whose figures depend on other settings."""
    from sparsetune.setup import lookup_flow_class
    from sparsetune.reuse.base import ReuseFlow

    storage = open_storage(cfg.storage_url(), create=create)
    stored = stored_config(storage, cfg.study)
    if stored is not None and stored.fingerprint() != cfg.fingerprint():
        diff = [k for k, v in cfg.fingerprint().items() if stored.fingerprint().get(k) != v]
        raise SparsetuneError(f"study {cfg.study!r} was run with other settings ({', '.join(diff)} differ); "
                              f"rerun with the same ones, or pass a new --study name")
    flows = Studies({}, {}, _num_layers(cfg.model))
    for flow in cfg.flows:
        cls = lookup_flow_class(flow, ReuseFlow if cfg.kind == "reuse" else None)
        add_flow(cfg, flows, flow, cls, storage=storage, create=create)
    return flows


def fixed_params(cfg: SearchConfig, flow: str, cls: type) -> dict[str, str]:
    """The `--param`s a flow takes (a given flow takes all of its own, `check_search`; a proposed one
    those it declares)."""
    specs = cls.param_specs()
    return {k: v for k, v in cfg.params_of(flow).items() if k in specs}


def add_flow(cfg: SearchConfig, flows: Studies, flow: str, cls: type, *, storage=None, create: bool,
             foreign: bool = False) -> str:
    """Open (`create`: or make, seeded with `seed_trials`) the study of `flow` (a name or a file)
    and add it to `flows`; returns its key."""
    from optuna.samplers import TPESampler

    key, name = flow_key(flow), study_name(cfg.study, flow)
    if foreign:  # a proposed flow meets the check the given ones met
        check_speed_context(cfg, flow, cls)
    storage = storage if storage is not None else next(iter(flows.studies.values()))._storage
    seeds = seed_trials(cls, flows.num_layers, fixed_params(cfg, flow, cls))
    if foreign:  # a proposed flow starts at its defaults; its short study samples the rest
        seeds = seeds[:1]
    # TPE (Optuna 5's multi-objective default) after the seeded trials and STARTUP_TRIALS random
    # ones, not its 10: a search of tens of trials over several flows would otherwise be mostly random.
    sampler = TPESampler(seed=cfg.seed + len(flows.studies) + (os.getpid() if not create else 0),
                         n_startup_trials=len(seeds) + STARTUP_TRIALS)
    if create:
        study = optuna.create_study(study_name=name, storage=storage, directions=["maximize", "maximize"],
                                    sampler=sampler, load_if_exists=True)
        if "search" not in study.user_attrs:
            with warnings.catch_warnings():  # experimental in Optuna 5, and only labels
                warnings.simplefilter("ignore")
                study.set_metric_names(["relative_accuracy", "speedup"])
            study.set_user_attr("search", cfg.public_dump())
            for params, role in seeds:  # a proposed flow's defaults are where its study starts, not a baseline
                study.enqueue_trial(params, user_attrs={"role": "start" if foreign and role == "defaults" else role})
        elif study.user_attrs["search"] != cfg.public_dump():
            # a resume's own budget and switches (its figures' settings are the stored ones: `open_flows`
            # checked): what its workers, and `search show`, read from now on
            study.set_user_attr("search", cfg.public_dump())
    else:
        try:
            study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
        except KeyError:
            raise SparsetuneError(f"study {name!r} is not in {masked_url(cfg.storage_url())}; start the search first") from None
    flows.studies[key], flows.classes[key], flows.args[key] = study, cls, flow
    if foreign:
        flows.foreign.add(key)
    return key


def trial_records(flows: Studies) -> list[dict[str, Any]]:
    """Every finished trial's record, in start order."""
    out = []
    for key, study in flows.studies.items():
        confirmed = study.user_attrs
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
            rec = dict(record_of(t) or {})
            rec.update(flow=key, number=t.number, state=t.state.name, role=t.user_attrs.get("role", "search"),
                       failure=t.user_attrs.get("failure"), confirm=confirmed.get(f"confirm:{t.number}"),
                       started=t.datetime_start.isoformat() if t.datetime_start else None,
                       finished=t.datetime_complete.isoformat() if t.datetime_complete else None)
            out.append(rec)
    return sorted(out, key=lambda r: (r["started"] or "", r["flow"], r["number"]))
