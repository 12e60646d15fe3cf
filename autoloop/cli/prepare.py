"""`autoloop prepare`: parses its options and calls autoloop.prepare, nothing more.

The main CLI registers it with `app.command("prepare")(prepare)`. Errors a user can
cause are printed as one line on stderr, and the command exits with status 1.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from autoloop.errors import AutoloopError


class TokenizerKind(str, Enum):
    bpe = "bpe"
    byte = "byte"


def prepare(
    dataset: Annotated[
        Optional[str],
        typer.Option(
            help="What to prepare: climbmix (autoresearch's data), fineweb-edu, tinystories (small machines), "
            "or a path to your own .txt, .jsonl (a \"text\" field) or .parquet (a \"text\" column) files or a folder of them."
        ),
    ] = None,
    shards: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help="How many training shards of a named dataset to download (the pinned val and heldout shards come on top); "
            "the dataset's default (10 for climbmix and fineweb-edu) if not given.",
        ),
    ] = None,
    tokenizer: Annotated[
        TokenizerKind,
        typer.Option(
            case_sensitive=False,
            help="The tokenizer: bpe learns a subword vocabulary from the training split; byte uses the 256 byte values. "
            "val_bpb is comparable between them.",
        ),
    ] = TokenizerKind.bpe,
    vocab_size: Annotated[
        Optional[int],
        typer.Option(help="The BPE vocabulary size, BOS included; 8192 if not given."),
    ] = None,
    name: Annotated[
        Optional[str],
        typer.Option(help="The prepared dataset's name; by default the dataset and tokenizer, e.g. climbmix-bpe8192."),
    ] = None,
    force: Annotated[
        bool,
        typer.Option("--force", help="Prepare again even if the same files were already prepared with the same options."),
    ] = False,
    list_: Annotated[
        bool,
        typer.Option("--list", help="Show the prepared datasets (sizes, token counts, fingerprints) and the downloaded files, then exit."),
    ] = False,
) -> None:
    """Download or read a text corpus, train its tokenizer, and write the train, val and heldout splits."""
    try:
        if list_:
            _show_list()
            return
        if dataset is None:
            raise AutoloopError("nothing to prepare: give --dataset NAME_OR_PATH, or --list to see what is prepared")
        from autoloop.prepare import ConsoleReporter, prepare_dataset

        reporter = ConsoleReporter()
        result = prepare_dataset(
            dataset, shards=shards, tokenizer=tokenizer.value, vocab_size=vocab_size, name=name, force=force, reporter=reporter
        )
    except AutoloopError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("interrupted: nothing was written; files already downloaded are kept", err=True)
        raise typer.Exit(130) from None
    ds = result.dataset
    typer.echo(f"{'already prepared' if result.reused else 'prepared'}: {ds.name} in {result.seconds:.1f} s")
    typer.echo(f"  path:        {ds.path}")
    typer.echo(f"  tokenizer:   {ds.meta['tokenizer']['type']}, vocab {ds.vocab_size}")
    for split in ("train", "val", "heldout"):
        info = ds.meta["splits"][split]
        typer.echo(f"  {split + ':':<12} {info['tokens']:,} tokens, {info['bytes']:,} bytes of text")
    typer.echo(f"  fingerprint: {ds.fingerprint}")
    typer.echo(f"use it with [tool.autoloop] dataset = \"{ds.name}\" in pyproject.toml, or AUTOLOOP_DATA_DIR={ds.path}")


def _show_list() -> None:
    from rich.console import Console
    from rich.table import Table

    from autoloop.prepare import format_count, format_size, hub_dir, list_downloads, list_prepared, prepared_root

    console = Console()
    if not console.is_terminal:
        console = Console(width=240)  # piped or captured: do not wrap rows at 80 columns
    prepared = list_prepared()
    if not prepared:
        console.print(f"no prepared datasets in {prepared_root()}: run `autoloop prepare --dataset NAME_OR_PATH`", highlight=False)
    else:
        table = Table(title=f"prepared datasets in {prepared_root()}", title_justify="left")
        for column in ("name", "tokenizer", "train tokens", "val tokens", "heldout tokens", "on disk", "fingerprint", "source"):
            table.add_column(column, justify="right" if "tokens" in column or column == "on disk" else "left")
        for info in prepared:
            if info.problem:
                table.add_row(info.name, "-", "-", "-", "-", format_size(info.disk_bytes), "-", f"[red]{info.problem}[/red]")
                continue
            table.add_row(
                info.name,
                f"{info.tokenizer} {info.vocab_size}",
                *(format_count(info.tokens[s]) for s in ("train", "val", "heldout")),
                format_size(info.disk_bytes),
                (info.fingerprint or "")[:12],
                info.source,
            )
        console.print(table)
    downloads = list_downloads()
    if downloads:
        table = Table(title=f"downloaded files in {hub_dir()}", title_justify="left")
        for column in ("repository", "files", "on disk", "revision"):
            table.add_column(column, justify="right" if column in ("files", "on disk") else "left")
        for info in downloads:
            table.add_row(info.repo_id, str(info.files), format_size(info.disk_bytes), (info.revision or "-")[:12])
        console.print(table)
