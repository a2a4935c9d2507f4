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


# Commands whose issue has not landed: each says so in one line and exits non-zero.
_NOT_BUILT = {
    "search": ("Optuna + LLM-agent search over flows and hyperparameters (not built yet).", "planned after issue #5"),
    "export": ("Turn a winning flow into a production config (not built yet).", "planned after issue #5"),
}


def _not_built_command(name: str, issue: str):
    def command() -> None:
        raise SparsetuneError(f"`sparsetune {name}` is not built yet ({issue}); `sparsetune generate` works today")

    return command


for _name, (_help, _issue) in _NOT_BUILT.items():
    app.command(name=_name, help=_help, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
        _not_built_command(_name, _issue)
    )


def _register() -> None:
    from sparsetune.cli import eval as eval_cli
    from sparsetune.cli import flows, generate, models, profile

    app.command(name="generate")(generate.generate)
    app.command(name="eval")(eval_cli.eval_command)
    app.command(name="profile")(profile.profile)
    app.add_typer(models.app, name="models")
    app.add_typer(flows.app, name="flows")


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
