"""Fit the cost model's per-operation costs on measured decode steps and write them as data (#43, item 3).

    python benchmarks/fit_costs.py benchmarks/records/costs/h200_2026-11-27/costs_*.json \
        --gpu "NVIDIA H200" --num-sms 132 --out sparsetune/perf/costs/h200.json

Each measured step (`bench_costs.py`: flows and dense at several shapes) is a row of
`perf.cost.decode_step_work` counts; the costs are the non-negative seconds per count that fit the
step times best in relative error (non-negative least squares, Lawson-Hanson, on rows scaled by
1 / measured time). The data keeps the GPU, the date, the command, the files and the fit's own
error; the model's test (`tests/perf/test_cost_model.py`) uses other points (the search's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import numpy as np

from sparsetune.models.resolve import model_config
from sparsetune.perf.cost import WORK, decode_step_work
from sparsetune.setup import lookup_flow_class


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 500) -> np.ndarray:
    """min ||a x - b|| with x >= 0 (Lawson-Hanson active set)."""
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, bool)
    for _ in range(iters):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max() <= 1e-12 * np.abs(w).max():
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-18
    return x


def points(files: list[str], num_sms: int) -> list[tuple[list[float], float, str]]:
    """(work vector, measured seconds, label) of every flow and dense step in the files."""
    out, seen = [], set()
    for f in files:
        for r in json.loads(Path(f).read_text())["rows"]:
            if "error" in r:
                continue
            cfg = model_config(r["model"], True)[1]
            flow = lookup_flow_class(r["flow"]).from_strings(r["params"])
            b, n = r["batch"], r["context"]
            out.append((decode_step_work(cfg, flow, b, n, num_sms).vector(), r["step_ms"] / 1e3,
                        f"{r['flow']} {r['params']} {b}x{n}"))
            key = (r["model"], b, n, r["page"])
            if key not in seen:  # each dense step once
                seen.add(key)
                out.append((decode_step_work(cfg, None, b, n, num_sms, page=r["page"]).vector(), r["dense_ms"] / 1e3,
                            f"dense page {r['page']} {b}x{n}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--num-sms", type=int, required=True)
    ap.add_argument("--date", default=None, help="when the steps were measured (default: the files' date)")
    ap.add_argument("--shape", default="qwen3-8b:16x32768",
                    help="model:BATCHxCONTEXT the model is tested at (not fitted on): a modeled search's default speed shape")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model, shape = args.shape.split(":")
    batch, context = shape.split("x")
    pts = points(args.files, args.num_sms)
    a = np.array([p[0] for p in pts], dtype=np.float64)
    t = np.array([p[1] for p in pts])
    scale = a.max(axis=0)
    scale[scale == 0] = 1
    x = nnls(a / scale / t[:, None], np.ones(len(t))) / scale
    pred = a @ x
    rel = pred / t - 1
    for (_, m, label), p in sorted(zip(pts, pred), key=lambda z: -abs(z[1] / z[0][1] - 1))[:8]:
        print(f"  worst: {label}: measured {m * 1e3:.3f} ms, fitted {p * 1e3:.3f} ms ({p / m - 1:+.1%})")
    print(f"{len(pts)} points; relative error: mean |e| {np.abs(rel).mean():.2%}, max {np.abs(rel).max():.2%}")
    for k, v in zip(WORK, x):
        print(f"  {k}: {v:.4g} s")
    date = args.date or datetime.date.fromtimestamp(Path(args.files[0]).stat().st_mtime).isoformat()
    data = {
        "gpu": args.gpu, "date": date, "num_sms": args.num_sms,
        "seconds": {k: float(f"{v:.6g}") for k, v in zip(WORK, x)},
        "shape": {"model": model, "batch": int(batch), "context": int(context),
                  "why": "the shape the model is tested at (tests/perf/test_cost_model.py; no cost is fitted on it), "
                         "inside the fitted shapes' range; a modeled decode search's default speed shape"},
        "source": {
            "measured": "benchmarks/bench_costs.py (decode steps as the search times them, CUDA graphs, bf16, "
                        "Qwen3-8B random weights)",
            "files": args.files, "points": len(pts),
            "fit": "benchmarks/fit_costs.py: non-negative least squares in relative error",
            "command": shlex.join(["python", *sys.argv]),
            "fit_error": {"mean_abs": round(float(np.abs(rel).mean()), 4), "max_abs": round(float(np.abs(rel).max()), 4)},
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
