"""Argument parsing every program shares, and nothing else: `--help` and `--version` load only this."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .. import __version__
from ..errors import EXIT_USAGE


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every program shares (--version, --config)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--config", metavar="PATH", help="configuration file (default: $SLURM_NEBULA_POWER_CONFIG, "
                        "nebula-power.toml beside $SLURM_CONF, /etc/slurm/nebula-power.toml)")
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    """Parse argv; on --help/--version/usage errors return the exit code instead of exiting."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
