"""`slurm-nebula-power example-config`: the example files installed with the package (etc/ in the source)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from ..errors import EXIT_OK, UsageError
from .common import make_parser, parse, report_error

PROG = "slurm-nebula-power example-config"
# name -> (where it is in the package, what it is for)
EXAMPLES = {
    "nebula-power.toml": ("examples/nebula-power.toml", "the configuration, every key commented "
                          "(/etc/slurm/nebula-power.toml)"),
    "slurm.conf.snippet": ("examples/slurm.conf.snippet", "the slurm.conf lines for the programs and cloud nodes"),
    "systemd/slurm-nebula-power-reconcile.service": ("examples/systemd/slurm-nebula-power-reconcile.service",
                                                     "reconcile as SlurmUser (/etc/systemd/system/)"),
    "systemd/slurm-nebula-power-reconcile.timer": ("examples/systemd/slurm-nebula-power-reconcile.timer",
                                                   "its timer: every minute"),
    "logrotate.d/slurm-nebula-power": ("examples/logrotate.d/slurm-nebula-power",
                                       "rotation of the log and the usage records (/etc/logrotate.d/)"),
    "grafana/slurm-nebula-power-dashboard.json": ("examples/grafana/slurm-nebula-power-dashboard.json",
                                                  "a Grafana dashboard of the metrics"),
    "prometheus/slurm-nebula-power-alerts.yml": ("examples/prometheus/slurm-nebula-power-alerts.yml",
                                                 "Prometheus alert rules"),
    "worker/slurm-nebula-worker.sh": ("worker/slurm-nebula-worker.sh",
                                      "the worker bootstrap (`template` puts it into the VM template)"),
}


def example(name: str) -> Traversable:
    """An installed example file by its name."""
    return resources.files("slurm_nebula_power").joinpath(EXAMPLES[name][0])


def main(argv: Sequence[str] | None = None) -> int:
    """slurm-nebula-power example-config: print one example file, list them, or write them all to a directory."""
    parser = make_parser(PROG, "Print an example file installed with the package (the configuration by "
                         "default), list them, or write them all into a directory.")
    parser.add_argument("name", nargs="?", default="nebula-power.toml", metavar="NAME",
                        help="the file to print (see --list); default nebula-power.toml")
    parser.add_argument("--list", action="store_true", help="list the example files and what each is for")
    parser.add_argument("--out", metavar="DIR", type=Path,
                        help="write every example file below DIR (its subdirectories made); an existing file "
                             "is never overwritten")
    parser.epilog = "exit: 0 done, 2 unknown name or a file that exists already"
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        if args.list:
            width = max(len(name) for name in EXAMPLES)
            print("\n".join(f"{name:<{width}}  {why}" for name, (_, why) in EXAMPLES.items()))
        elif args.out is not None:
            write_all(args.out)
        elif args.name not in EXAMPLES:
            raise UsageError(f"no example file {args.name!r}; one of: {', '.join(EXAMPLES)}")
        else:
            sys.stdout.write(example(args.name).read_text(encoding="utf-8"))
    except UsageError as exc:
        report_error(PROG, str(exc), quiet=True)
        return exc.exit_code
    return EXIT_OK


def write_all(directory: Path) -> None:
    """Every example below directory; refused whole, before anything is written, if one file exists."""
    existing = [name for name in EXAMPLES if os.path.lexists(directory / name)]
    if existing:
        raise UsageError(f"{directory / existing[0]} exists already: nothing written; choose an empty --out "
                         "directory (existing files are never overwritten)")
    for name in EXAMPLES:
        target = directory / name
        target.parent.mkdir(parents=True, exist_ok=True)
        mode = 0o755 if name.endswith(".sh") else 0o644
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(example(name).read_bytes())
        print(target)
