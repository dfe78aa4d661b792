"""The `deepinfer-bench` command. Its sweeps and checks arrive with the harness issue; until then it
lists no subcommands and says so."""

import click

from deepinfer.cli import run_cli


@click.group(help="deepinfer-bench: benchmark sweeps and determinism checks (no subcommands yet).")
def cli() -> None:
    """Command group; the subcommands below do the work."""


def main() -> None:
    run_cli(cli)
