"""The `deepinfer-eval` command. Its lm-eval suites arrive with the eval issue; until then it lists
no subcommands and says so."""

import click

from deepinfer.cli import run_cli


@click.group(help="deepinfer-eval: lm-eval accuracy suites (no subcommands yet).")
def cli() -> None:
    """Command group; the subcommands below do the work."""


def main() -> None:
    run_cli(cli)
