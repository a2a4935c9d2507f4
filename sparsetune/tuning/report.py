"""A search's run folder, rewritten after every trial from what the studies hold.

- `trials.jsonl`: one line per finished trial (flow, params, stage, accuracy and fidelity, speed
  and how it was taken, seconds, worker, failure reason, confirmation);
- `frontier.json` / `frontier.md`: dense, each flow's defaults, the search-set frontier, and the
  confirmed frontier (fresh prompts, 95% intervals, whether each point held up);
- `frontier.png` (every trial, the frontier, dense and the defaults marked) and `hypervolume.png`
  (the search-set frontier's hypervolume over finished trials).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from sparsetune.errors import SparsetuneError
from sparsetune.records import write_json
from sparsetune.tuning.config import SearchConfig, flow_key, resume_command
from sparsetune.tuning.frontier import (Point, confirmed_frontier, confirmed_records, default_pick, eligible, hypervolume,
                                       pick_point, point_of, search_frontier, trial_name)

SCHEMA = "sparsetune.search/1"
SPEED_NOTES = {
    ("decode", "modeled"): "modeled: dense decode step time / the flow's, from per-operation costs measured on a GPU "
                           "(perf/costs: bytes, attention units, indexer, top-k, launches)",
    ("decode", "measured"): "measured: dense decode step time / the flow's, on the GPU",
    ("reuse", "modeled"): "modeled: a full prefill's token-layers / the flow's (the reuse prefills of the evaluation)",
    ("reuse", "measured"): "measured: full recompute's time to first token / the flow's, on the GPU "
                           "(a prompt 90% reused, in 9 segments)",
}


SHARE_OF = {"decode": "K/V read", "reuse": "token-layers computed"}


def _shape_note(shape: dict[str, Any] | None) -> str:
    if not shape or not shape.get("batch"):
        return ""
    weights = " (random weights)" if shape.get("random_weights") and shape.get("kind") == "measured" else ""
    return f", on {shape['model']}{weights} at {shape['batch']} x {shape['context']} tokens"


def budget_shares(cfg: SearchConfig, records: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each trial's budget, the share of the work it does on the search's model and context: a
    decode flow's share of the context's K/V a step reads (`perf.cost.kv_share`, whatever the
    speed model; the trial records it, else it is computed here), a reuse flow's share of a full
    prefill's token-layers its evaluation computed."""
    from sparsetune.models.resolve import model_config
    from sparsetune.perf.cost import kv_share
    from sparsetune.setup import lookup_flow_class

    if cfg.kind == "reuse":
        return {trial_name(r): ((r.get("accuracy") or {}).get("reuse") or {}).get("compute_fraction") for r in records}
    _name, mcfg = model_config(cfg.model, True)  # the architecture only
    seen: dict[tuple, float | None] = {}
    out = {}
    for r in records:
        key = (r["flow"], tuple(sorted((r.get("params") or {}).items())))
        recorded = (r.get("speed") or {}).get("kv_share")
        if recorded is not None:
            seen[key] = recorded
        elif key not in seen and r["flow"] not in map(flow_key, cfg.flows):  # a proposed flow's: only as recorded
            seen[key] = None
        elif key not in seen:
            try:
                point = lookup_flow_class(cfg.flow_arg(r["flow"])).from_strings(dict(key[1]))
                seen[key] = round(kv_share(mcfg, point, cfg.context), 4)
            except Exception:  # a flow file gone since the trial ran: no figure, not a broken report
                seen[key] = None
        out[trial_name(r)] = seen[key]
    return out


def _row(rec: dict[str, Any], shares: dict[str, float | None]) -> dict[str, Any]:
    acc = rec.get("accuracy") or {}
    conf = rec.get("confirm") or {}
    name = trial_name(rec)
    return {
        "trial": name, "flow": rec["flow"], "role": rec["role"], "params": rec.get("params"), "share": shares.get(name),
        "relative_accuracy": acc.get("relative_accuracy"), "fidelity_top1": (acc.get("fidelity") or {}).get("top1"),
        "speedup": (rec.get("speed") or {}).get("speedup"), "speed_kind": (rec.get("speed") or {}).get("kind"),
        "confirmed_accuracy": conf.get("relative_accuracy"), "interval": conf.get("interval"), "holds": conf.get("holds"),
        "confirm_error": conf.get("error"),
    }


def summary(cfg: SearchConfig, records: list[dict[str, Any]], *, complete: bool, stopped: str | None) -> dict[str, Any]:
    """frontier.json: what a user reads first."""
    finished = [r for r in records if r["state"] == "COMPLETE"]
    dense_acc = next((r["accuracy"].get("dense_accuracy") for r in finished if r.get("accuracy")), None)
    front = search_frontier(records, cfg.min_accuracy)
    by_name = {trial_name(r): r for r in records}
    confirmed = confirmed_records(records)
    held = [r for r in confirmed if r["confirm"]["holds"]]
    confirmed_front = confirmed_frontier(records)
    speed_kind = next((r["speed"]["kind"] for r in records if r.get("speed")), None)
    speed_on = next((r["speed"] for r in records if r.get("speed") and r["speed"].get("batch")), None)
    shares = budget_shares(cfg, records)
    defaults = [_row(r, shares) for r in records if r["role"] == "defaults" and r["state"] == "COMPLETE"]
    s = {
        "schema": SCHEMA, "kind": cfg.kind, "study": cfg.study, "run_dir": str(cfg.run_dir), "model": cfg.model, "flows": list(cfg.flows), "context": cfg.context,
        "samples_per_task": cfg.samples, "confirm_samples_per_task": cfg.confirm_samples, "min_accuracy": cfg.min_accuracy,
        "defaults_confirmed": cfg.confirm_defaults,
        "share_of": SHARE_OF[cfg.kind], "speed": speed_kind, "speed_note": SPEED_NOTES[cfg.kind, speed_kind or "modeled"],
        "speed_shape": None if speed_on is None else {k: speed_on.get(k) for k in ("kind", "model", "random_weights", "batch", "context")},
        "speed_on": _shape_note(speed_on),
        "complete": complete, "stopped": stopped,
        "trials": {"finished": len(finished), "failed": sum(r["state"] == "FAIL" for r in records),
                   "stopped_by_cascade": sum(r.get("stage") in ("speed", "quick") for r in finished)},
        "dense": {"relative_accuracy": 1.0, "speedup": 1.0, "accuracy": dense_acc},
        "defaults": defaults,
        "frontier": [_row(by_name[p.name], shares) for p in front],
        "confirmed_frontier": [_row(by_name[p.name], shares) for p in confirmed_front],
        "not_confirmed": [_row(r, shares) for r in confirmed if not r["confirm"]["holds"] and r["role"] != "defaults"],
        "confirm_failed": [_row(r, shares) for r in records if (r.get("confirm") or {}).get("error")],
        "against_defaults": against_defaults(defaults, [_row(r, shares) for r in held]),
        "hypervolume": round(hypervolume(front), 6),
    }
    s["next_step"], s["next_command"] = next_step(cfg, s)
    return s


def next_step(cfg: SearchConfig, s: dict[str, Any]) -> tuple[str, str]:
    """What to do after a search, and the command that does it (the run's last line): a decode
    search exports the point `sparsetune export` picks by default, its rule spelled out so that the
    log says which; a reuse search measures that point with `sparsetune eval` (reuse flows do not
    export yet); a search with no confirmed point there continues, with as many trials again once
    its budget is spent."""
    rule = default_pick(cfg.min_accuracy)
    bar = "" if cfg.min_accuracy is None else f" at --min-accuracy {cfg.min_accuracy:g}"
    try:
        r = pick_point(s["confirmed_frontier"], rule)
    except SparsetuneError:  # no confirmed point (that held)
        spent = cfg.trials is not None and s["trials"]["finished"] + s["trials"]["failed"] >= cfg.trials
        more = cfg.model_copy(update={"trials": 2 * cfg.trials}) if spent else cfg
        return (f"no confirmed point{bar or ' held on fresh prompts'} yet; run more trials" +
                (" (or a new --study with a lower --min-accuracy)" if bar else ""), resume_command(more))
    what = (f"{r['trial']} ({100 * r['confirmed_accuracy']:.0f}% of dense on fresh prompts, {r['speedup']:.2f}× "
            f"{'decode' if cfg.kind == 'decode' else 'prefill'} speed, {r['speed_kind']}), the fastest confirmed point{bar}")
    export = shlex.join(["sparsetune", "export", str(cfg.run_dir), "--pick", rule, "--out", f"bundles/{cfg.study}"])
    if cfg.kind == "decode":
        return f"export {what}, as a bundle that runs in SGLang", export
    return (f"measure {what}, with sparsetune eval; then `{export}` writes a reuse bundle SGLang serves",
            shlex.join(["sparsetune", "eval", "--reuse", cfg.flow_arg(r["flow"]), "--model", cfg.model,
                        *[a for k, v in (r["params"] or {}).items() for a in ("--reuse-param", f"{k}={v}")],
                        *[a for task in cfg.tasks or () for a in ("--task", task)],
                        "--context", str(cfg.context), "--samples", str(cfg.confirm_samples),
                        "--defaults", "published"]))  # as its trial ran it


def against_defaults(defaults: list[dict[str, Any]], held: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the search gained over each flow's defaults: the fastest confirmed point (any flow)
    that held the bar on fresh prompts, has no more budget than the defaults (`share`: the K/V a
    decode step reads, the token-layers a reuse prefill computes) and beat their confirmed
    accuracy; with its speed next to theirs and whether it dominates them in both objectives (a
    smaller block's fields cost bytes, so at equal K/V it can be slower)."""
    out = []
    for d in defaults:
        if d["confirmed_accuracy"] is None or d["share"] is None:
            continue
        better = [p for p in held if p["share"] is not None and p["share"] <= d["share"] + 1e-9
                  and p["confirmed_accuracy"] > d["confirmed_accuracy"]]
        best = max(better, key=lambda p: (p["speedup"], p["confirmed_accuracy"]), default=None)
        out.append({"defaults": d["trial"], "point": best and best["trial"],
                    "share": best and best["share"], "defaults_share": d["share"],
                    "accuracy_gain": best and round(best["confirmed_accuracy"] - d["confirmed_accuracy"], 4),
                    "speed_ratio": best and round(best["speedup"] / d["speedup"], 4),
                    "dominates": bool(best and best["speedup"] >= d["speedup"])})
    return out


def against_defaults_lines(s: dict[str, Any]) -> list[str]:
    """One line per flow's defaults: what the search gained over them (frontier.md and the CLI); under
    `--no-confirm-defaults`, one line for those left unconfirmed (a defaults point on the frontier is
    confirmed there)."""
    what = s.get("share_of", SHARE_OF["decode"])
    left = [d["trial"] for d in s.get("defaults", []) if d.get("confirmed_accuracy") is None]
    unconfirmed = [f"{', '.join(left)}: not compared (not confirmed on fresh prompts: --no-confirm-defaults)"] \
        if left and not s.get("defaults_confirmed", True) else []
    return [f"{a['defaults']}: " + (f"no confirmed point with no more {what} beats them" if a["point"] is None else
            f"{a['point']} beats them with no more {what} ({100 * a['share']:.0f}% against "
            f"{100 * a['defaults_share']:.0f}%): {100 * a['accuracy_gain']:+.0f} points of confirmed accuracy, at "
            f"{a['speed_ratio']:.2f}× their speed ({'faster too: it dominates them' if a['dominates'] else 'slower: it trades speed for the accuracy'})")
            for a in s.get("against_defaults", [])] + unconfirmed


def markdown(s: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "—" if x is None else f"{100 * x:.0f}%"

    def table(rows: list[dict[str, Any]], confirmed: bool) -> list[str]:
        head = f"| trial | params | {s['share_of']} | accuracy (search) | top-1 | speedup |" + (" confirmed | 95% interval | holds |" if confirmed else "")
        out = [head, "|" + "---|" * (head.count("|") - 1)]
        for r in rows:
            params = ", ".join(f"{k}={v}" for k, v in (r["params"] or {}).items())
            line = f"| {r['trial']} | {params} | {pct(r['share'])} | {pct(r['relative_accuracy'])} | {pct(r['fidelity_top1'])} | {r['speedup']}× |"
            if confirmed:
                lo, hi = r["interval"] or (None, None)
                line += f" {pct(r['confirmed_accuracy'])} | {pct(lo)}–{pct(hi)} | {'yes' if r['holds'] else 'no'} |"
            out.append(line)
        return out

    lines = [f"# Search `{s['study']}`: {', '.join(s['flows'])} on {s['model']} at {s['context']} tokens", "",
             f"Accuracy is relative to dense on the same prompts (dense: {pct(s['dense']['accuracy'])} absolute). "
             f"Speed is {s['speed_note']}{s['speed_on']}.", ""]
    if s["min_accuracy"] is not None:
        lines += [f"Constraint: at least {pct(s['min_accuracy'])} of dense accuracy.", ""]
    lines += ["## Confirmed frontier (fresh prompts)", ""]
    lines += table(s["confirmed_frontier"], True) if s["confirmed_frontier"] else ["(none confirmed yet)"]
    if s["not_confirmed"]:
        lines += ["", "Did not hold up on fresh prompts:", ""] + table(s["not_confirmed"], True)
    if s["confirm_failed"]:
        lines += ["", "Could not be confirmed (the evaluation failed; `--resume` tries again):", ""] + [
            f"- {r['trial']}: {r['confirm_error']}" for r in s["confirm_failed"]]
    lines += ["", "## Each flow's defaults", ""] + table(s["defaults"], True)
    if against := against_defaults_lines(s):
        lines += ["", f"Against the defaults (a confirmed point that held, with no more {s['share_of']}, and beat "
                  "their confirmed accuracy):", ""] + [f"- {line}" for line in against]
    lines += ["", "## Search-set frontier", ""] + table(s["frontier"], False)
    t = s["trials"]
    lines += ["", f"{t['finished']} trials finished ({t['stopped_by_cascade']} stopped by the cascade), {t['failed']} failed; "
              f"hypervolume {s['hypervolume']}; {'complete' if s['complete'] else 'stopped: ' + str(s['stopped'])}.", ""]
    lines += ["## Next", "", f"{s['next_step'][0].upper()}{s['next_step'][1:]}:", "", f"    {s['next_command']}", ""]
    return "\n".join(lines)


def plot_groups(done: list[dict[str, Any]], shown: list[Point]) -> tuple[list[str], list[str]]:
    """Which flows the frontier plot names one by one (the searched flows, which have a defaults
    trial, and the flows of the frontier points in `shown`) and which it draws as one grey series
    (the agent's other proposals: a search with an agent has dozens, and a legend entry each
    would bury the plot)."""
    flows = sorted({r["flow"] for r in done})
    keep = {r["flow"] for r in done if r["role"] == "defaults"} | {p.name.rsplit("#", 1)[0] for p in shown}
    return [f for f in flows if f in keep], [f for f in flows if f not in keep]


def plots(run_dir: Path, records: list[dict[str, Any]], min_accuracy: float | None, kind: str = "decode") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in records if r["state"] == "COMPLETE" and (r.get("accuracy") or {}).get("relative_accuracy") is not None]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    front = search_frontier(records, min_accuracy)
    held = confirmed_frontier(done)
    named, others = plot_groups(done, front + held)

    def xy(pts: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
        return [r["speed"]["speedup"] for r in pts], [r["accuracy"]["relative_accuracy"] for r in pts]

    if others:
        ax.scatter(*xy([r for r in done if r["flow"] in others]), s=12, alpha=0.3, color="0.6",
                   label=f"{len(others)} other proposed flows")
    for i, flow in enumerate(named):
        pts = [r for r in done if r["flow"] == flow]
        ax.scatter(*xy(pts), s=18, alpha=0.45, color=f"C{i % 10}", label=f"{flow} trials")
        for r in pts:
            if r["role"] == "defaults":
                ax.scatter(*xy([r]), marker="s", s=70, facecolors="none", edgecolors=f"C{i % 10}", linewidths=2,
                           label=f"{flow} defaults")
    if front:
        ax.step([p.speedup for p in front], [p.accuracy for p in front], where="post", color="grey", lw=0.8)
        ax.scatter([p.speedup for p in front], [p.accuracy for p in front], color="grey", s=22, label="search-set frontier")
    failed = [r for r in confirmed_records(done) if not r["confirm"]["holds"] and r["role"] != "defaults"]
    if failed:
        ax.scatter([r["speed"]["speedup"] for r in failed], [r["accuracy"]["relative_accuracy"] for r in failed],
                   marker="x", color="red", s=30, lw=1, label="did not hold on fresh prompts")
    if held:
        ax.step([p.speedup for p in held], [p.accuracy for p in held], where="post", color="k", lw=1.2)
        ax.scatter([p.speedup for p in held], [p.accuracy for p in held], color="k", s=34,
                   label="confirmed frontier (fresh prompts)")
    ax.scatter([1.0], [1.0], marker="*", s=160, color="gold", edgecolors="k", label="dense", zorder=5)
    if min_accuracy is not None:
        ax.axhline(min_accuracy, color="grey", ls="--", lw=0.8)
    speed = next((r["speed"]["kind"] for r in records if r.get("speed")), "")
    ax.set_xlabel(f"decode speedup over dense ({speed})" if kind == "decode" else
                  f"prefill speedup over full recompute ({speed})")
    ax.set_ylabel("accuracy relative to dense")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the points, never over them
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "frontier.png", dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs, ys, seen = [], [], []
    for i, r in enumerate(sorted(records, key=lambda r: r["finished"] or "")):
        if eligible(r, min_accuracy):
            seen.append(point_of(r))
        xs.append(i + 1)
        ys.append(hypervolume(seen))
    ax.plot(xs, ys, drawstyle="steps-post")
    ax.set_xlabel("finished trials")
    ax.set_ylabel("hypervolume (accuracy × (speedup − 1))")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "hypervolume.png", dpi=120)
    plt.close(fig)


def write_outputs(cfg: SearchConfig, records: list[dict[str, Any]], *, complete: bool = False,
                  stopped: str | None = None) -> dict[str, Any]:
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "trials.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in records))
    tmp.replace(run_dir / "trials.jsonl")
    s = summary(cfg, records, complete=complete, stopped=stopped)
    write_json(run_dir / "frontier.json", s)
    (run_dir / "frontier.md").write_text(markdown(s))
    plots(run_dir, records, cfg.min_accuracy, cfg.kind)
    return s

