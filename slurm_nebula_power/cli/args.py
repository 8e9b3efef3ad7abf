"""Argument parsing every program shares, and nothing else: `--help` and `--version` load only this."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from .. import __version__
from ..errors import EXIT_USAGE


class _Once(argparse.Action):
    """An option given at most once (`slurm-nebula-power --config A status --config B` names two files: which
    one was meant cannot be guessed), never empty; a breach is one line and exit 2, not argparse's usage."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        before = getattr(namespace, self.dest, None)
        if before is not None:
            parser.exit(EXIT_USAGE, f"{parser.prog}: error: {self.option_strings[0]} given twice ({before} and "
                                    f"{values}): give it once\n")
        if not values:
            parser.exit(EXIT_USAGE, f"{parser.prog}: error: {self.option_strings[0]} needs a PATH, not ''\n")
        setattr(namespace, self.dest, values)


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every program shares (--version, --config)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--config", metavar="PATH", action=_Once, help="configuration file (default: "
                        "$SLURM_NEBULA_POWER_CONFIG, nebula-power.toml beside $SLURM_CONF, "
                        "/etc/slurm/nebula-power.toml)")
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    """Parse argv; on --help/--version/usage errors return the exit code instead of exiting."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
