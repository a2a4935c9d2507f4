"""`sparsetune models ...`"""

from __future__ import annotations

import typer
from rich.table import Table

from sparsetune.cli.output import emit_json, err

app = typer.Typer(help="Models the engine knows.", no_args_is_help=True, add_completion=False,
                  rich_markup_mode=None)


@app.command("list")
def list_(json_out: bool = typer.Option(False, "--json", help="Print JSON to stdout.")) -> None:
    """List registered models and where their weights are."""
    from sparsetune.api import list_models

    rows = list_models()
    if json_out:
        emit_json(rows)
        return
    from rich.console import Console

    table = Table(title="sparsetune models")
    for col in ("name", "arch", "params", "layers", "heads (q/kv)", "context", "weights"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["name"], r["architecture"], f"{r['parameters'] / 1e9:.2f}B", str(r["layers"]),
            f"{r['heads']}/{r['kv_heads']}", str(r["context"]), r["weights"],
        )
    Console().print(table)
    err.print(
        "embedded: ships with the install. missing: no local weights (copy an HF-format directory to "
        "~/.cache/sparsetune/models/NAME, or use --random-weights for speed runs). "
        "Any local HF-format Llama/Qwen2/Qwen3 directory also works: --model PATH"
    )


@app.command("path")
def path(
    model: str = typer.Argument(..., help="a registered name (sparsetune models list) or an HF-format directory"),
    random_weights: bool = typer.Option(False, "--random-weights",
                                        help="no weights needed: a folder with config.json only (SGLang's --load-format dummy)"),
    json_out: bool = typer.Option(False, "--json", help="Print JSON to stdout."),
) -> None:
    """Print the model's HF-format folder, for SGLang and transformers (the embedded default is
    converted from its GGUF once, to float32 safetensors with its tokenizer)."""
    from sparsetune.api import model_dir

    folder = model_dir(model, random_weights=random_weights)
    if json_out:
        emit_json({"model": model, "path": str(folder), "weights": not random_weights or any(folder.glob("*.safetensors"))})
    else:
        print(folder)
