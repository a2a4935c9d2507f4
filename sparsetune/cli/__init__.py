"""The `sparsetune` command line: a thin typer layer over `sparsetune.api`."""
