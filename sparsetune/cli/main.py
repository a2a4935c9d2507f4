"""Entry point: `sparsetune <command>`."""

from __future__ import annotations

import sys

import typer

from sparsetune.cli.output import err
from sparsetune.errors import SparsetuneError

app = typer.Typer(
    name="sparsetune",
    help="Try, tune and ship sparse-attention and KV-reuse flows for LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _not_built(command: str, issue: str) -> None:
    raise SparsetuneError(f"`sparsetune {command}` is not built yet ({issue}); `sparsetune generate` works today")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def eval() -> None:  # noqa: A001 - the command is called eval
    """Measure a flow's accuracy, fidelity and speed (not built yet)."""
    _not_built("eval", "issue #4, Evaluation")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def search() -> None:
    """Optuna + LLM-agent search over flows and hyperparameters (not built yet)."""
    _not_built("search", "planned after issue #5")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def profile() -> None:
    """Break a decode step into kernels and stages (not built yet)."""
    _not_built("profile", "issue #4, Evaluation")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def export() -> None:
    """Turn a winning flow into a production config (not built yet)."""
    _not_built("export", "planned after issue #5")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def flows() -> None:
    """List, show, check and create flows (not built yet)."""
    _not_built("flows", "issue #3, Flow language")


def _register() -> None:
    from sparsetune.cli import generate, models

    app.command(name="generate")(generate.generate)
    app.add_typer(models.app, name="models")


_register()


def main() -> None:
    try:
        app()
    except SparsetuneError as e:
        err.print(f"[bold red]error:[/] {e}", soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
