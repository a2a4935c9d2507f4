"""Entry point: `sparsetune <command>`."""

from __future__ import annotations

import os
import sys

import typer
from rich.markup import escape

try:  # typer >= 0.22 vendors click
    from typer._click import exceptions as cx
except ImportError:  # older typer runs on click itself
    from click import exceptions as cx

from sparsetune import __version__
from sparsetune.cli.output import err
from sparsetune.errors import SparsetuneError

# Plain click help (rich_markup_mode=None): typer's rich help labels flags `--json <bool>`.
app = typer.Typer(
    name="sparsetune",
    help="Try, tune and ship sparse-attention and KV-reuse flows for LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"sparsetune {__version__}\n")
        raise typer.Exit()


TRUST_FLAG = "--trust-flow-code"


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
    trust: bool = typer.Option(False, TRUST_FLAG, help="Run flow files' Python in this process (reuse flows, decode flows "
                               "that do not trace); without it a user's decode flow is traced in a sandbox. Any command, "
                               "anywhere on the line; or SPARSETUNE_TRUST_FLOW_CODE=1. Never applies to agent candidates."),
) -> None:
    """Try, tune and ship sparse-attention and KV-reuse flows for LLM serving."""


def _register() -> None:
    from sparsetune.cli import bench
    from sparsetune.cli import eval as eval_cli
    from sparsetune.cli import export as export_cli
    from sparsetune.cli import flows, generate, models, profile
    from sparsetune.cli import search as search_cli

    app.command(name="generate")(generate.generate)
    app.command(name="eval")(eval_cli.eval_command)
    app.command(name="profile")(profile.profile)
    app.command(name="export")(export_cli.export)
    app.add_typer(models.app, name="models")
    app.add_typer(flows.app, name="flows")
    app.add_typer(search_cli.app, name="search")
    app.add_typer(bench.app, name="bench")


_register()


def one_line(text: str) -> str:
    """An error message as the one line the rule promises (a wrapped library message can hold line breaks)."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _lift_trust(argv: list[str]) -> list[str]:
    """`--trust-flow-code` anywhere on the line: the opt-in of `loader` (its variable, so worker and
    evaluator processes this one starts inherit it), taken out of the command's own arguments."""
    if TRUST_FLAG in argv:
        from sparsetune.api import TRUST_ENV

        os.environ[TRUST_ENV] = "1"
    return [a for a in argv if a != TRUST_FLAG]


def main() -> None:
    command = typer.main.get_command(app)
    sys.argv[1:] = _lift_trust(sys.argv[1:])
    try:
        code = command.main(prog_name="sparsetune", standalone_mode=False)
    except SparsetuneError as e:
        err.print(f"[bold red]error:[/] {escape(one_line(str(e)))}", soft_wrap=True)
        sys.exit(e.exit_code)
    except cx.UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # a command group on its own: its help
            e.show()
            sys.exit(2)
        # Bad or missing options: one line, and where to read about them.
        path = e.ctx.command_path if e.ctx is not None else "sparsetune"
        err.print(f"[bold red]error:[/] {escape(one_line(e.format_message()))} (see {path} --help)", soft_wrap=True)
        sys.exit(2)
    except cx.ClickException as e:
        err.print(f"[bold red]error:[/] {escape(one_line(e.format_message()))}", soft_wrap=True)
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        err.print("interrupted")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
