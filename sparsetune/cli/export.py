"""`sparsetune export`: a tuned flow as a bundle that runs inside SGLang, and `--check` of one."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from sparsetune import api
from sparsetune.cli import options as opt
from sparsetune.cli.output import emit_json, err
from sparsetune.errors import SparsetuneError


def export(
    run_dir: Path = typer.Argument(None, help="A search's run folder (runs/<study>): export one of its confirmed points."),
    out: Path = typer.Option(None, "--out", help="The bundle's folder (new; --force replaces a bundle there)."),
    trial: str = typer.Option(None, "--trial", help="The confirmed point to export, e.g. quest#12 (default: --pick's)."),
    pick: str = typer.Option(None, "--pick", help='Which confirmed point, e.g. "max speedup where accuracy >= 0.95" '
                             "(the default, with the search's own bar)."),
    flow: str = typer.Option(None, "--flow", help="Export this flow (name or .py path) with --param values, no search."),
    param: list[str] = opt.param_option(),
    reuse: str = opt.reuse_option("Export a reuse flow (name or .py path) with --reuse-param values: a reuse bundle, "
                                  "its decode flow --flow, else the reuse flow's own, else dense."),
    reuse_param: list[str] = opt.reuse_param_option(),
    model: str = typer.Option(None, "--model", help="With --flow: the model the params were tuned for (recorded). "
                              "With --check: the model folder SGLang will serve the bundle on (checked too)."),
    force: bool = typer.Option(False, "--force", help="Replace the bundle at --out."),
    defaults: str = opt.defaults_option(),
    check: Path = typer.Option(None, "--check", help="Check a bundle instead: files, hashes, params, SGLang version."),
    require_sglang: bool = typer.Option(False, "--require-sglang", help="With --check: fail unless this environment's "
                                        "SGLang can serve the bundle (launch_sglang.sh passes it)."),
    json_out: bool = opt.json_option("Print the manifest (or the check's result) as JSON to stdout."),
) -> None:
    """Export a tuned flow as a bundle that runs inside SGLang (sglang.json, launch_sglang.sh)."""
    from sparsetune.api import check_export
    from sparsetune.api import export as export_bundle

    if check is not None:
        if any(x is not None for x in (run_dir, out, trial, pick, flow, reuse)) or param or reuse_param:
            raise SparsetuneError("--check takes only the bundle's folder (and --model, --require-sglang, --json)")
        result = check_export(check, require_sglang=require_sglang, model=model)
        if json_out:
            emit_json(result)
        if result["edited_since_measured"]:
            changes = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in result["edited_since_measured"].items())
            err.print(f"[yellow]note:[/] params edited since the search measured this bundle ({escape(changes)}): "
                      "its recorded accuracy and speedup no longer apply; measure it again (sparsetune eval)")
        if result["ok"]:
            if result["serving_problem"]:
                err.print(f"[yellow]not served by SGLang:[/] {escape(result['serving_problem'])}")
            if result["sglang_problem"]:
                err.print(f"[yellow]sglang:[/] {escape(result['sglang_problem'])}")
            serves = not result["sglang_problem"] and not result["serving_problem"]
            err.print(f"{check}: the bundle checks" + (f"; SGLang {result['sglang']} can serve it" if serves else ""))
            return
        causes = result["problems"] + ([p for p in (result["serving_problem"], result["sglang_problem"]) if p]
                                       if require_sglang else [])
        raise SparsetuneError(f"{check} does not check: " + "; ".join(causes))
    if out is None:
        raise SparsetuneError("--out DIR: where to write the bundle")
    m = export_bundle(run_dir, out=out, flow=flow, params=api.parse_params(param), reuse=reuse,
                      reuse_params=api.parse_params(reuse_param), trial=trial, pick=pick, model=model, force=force,
                      defaults=defaults)
    if json_out:
        emit_json(m)
    if flow is not None and model is not None and defaults == "tuned":
        from sparsetune.api import describe_defaults

        said = describe_defaults(m["flow"], m["model"], m["tuned"])
        if said:
            err.print(f"[dim]{escape(said)}[/]")
    measured = m.get("measured") or {}
    figures = ""
    if measured:
        acc = measured["accuracy"]
        figures = (f": {acc['confirmed']:.0%} of dense on fresh prompts, {measured['speedup']:.2f}x "
                   f"{measured.get('speedup_of', 'decode step')} ({measured.get('speed_kind')})")
    if m.get("reuse"):
        r = m["reuse"]
        err.print(f"reuse bundle {out}: {r['flow']} ({', '.join(f'{k}={v}' for k, v in r['params'].items())}){figures}; "
                  f"decode: {m['flow']} ({', '.join(f'{k}={v}' for k, v in m['params'].items())})")
        if m["serving_problem"]:
            err.print(f"[yellow]not served by SGLang:[/] {escape(m['serving_problem'])}")
            return
    else:
        err.print(f"bundle {out}: {m['flow']} ({', '.join(f'{k}={v}' for k, v in m['params'].items())}){figures}")
    err.print(f"serve it: {out}/launch_sglang.sh MODEL_PATH   (needs SGLang {api.sglang_versions()} with sparsetune "
              "installed beside it)" + ("; clients mark segments in custom_params.sparsetune_parts (README, 'Reuse flows in "
                                        "SGLang')" if m.get("reuse") else ""))
