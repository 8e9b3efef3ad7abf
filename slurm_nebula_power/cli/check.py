"""`slurm-nebula-power check`: what would make a deployment fail later, found now; one line per problem."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict

from ..checks import run_checks
from ..errors import EXIT_NODES_FAILED, EXIT_OK
from ..findings import CUT, OK, WARNING
from .common import make_parser, open_cloud, parse, quiet_logging


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """slurm-nebula-power check: find now what would fail later."""
    prog = "slurm-nebula-power check"
    env = os.environ if environ is None else environ
    parser = make_parser(prog, "Check the configuration, the auth file (readable by SlurmUser, not others), "
                     "the OpenNebula endpoint, every node set's template against slurm.conf and its networks and "
                     "images as the configured user resolves them, the node sets "
                     "against slurm.conf's CLOUD nodes, and the power-saving timeouts and programs.")
    parser.epilog = ("check only reads: it creates nothing in OpenNebula unless --instantiate is given. "
                     "exit: 0 nothing wrong (warnings allowed), 1 some problem found, 2 usage")
    parser.add_argument("--json", action="store_true", help="print the findings as a JSON list")
    parser.add_argument("--quiet", "-q", action="store_true", help="print warnings and problems only")
    parser.add_argument("--instantiate", action="store_true", help="also let oned prove each node set's template: "
                        "instantiate it on hold as the configured user and remove that VM at once (terminate); without "
                        "this flag check creates nothing")
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    quiet_logging(prog, logging.ERROR)
    report = run_checks(args.config, env, lambda config: open_cloud(config, retry_seconds=0),
                        instantiate=args.instantiate)
    shown = [f for f in report.findings if not (args.quiet and f.level == OK)]
    if args.json:
        print(json.dumps([asdict(f) for f in shown], indent=2))
    else:
        cut = False
        for finding in shown:  # no line longer than LINE_LENGTH: an ok line cut, the others continued
            lines = finding.lines()
            print("\n".join(lines))
            cut = cut or (finding.level == OK and lines[0].endswith(CUT))
        warnings = sum(f.level == WARNING for f in report.findings)
        print(f"{len(report.problems)} problem(s), {warnings} warning(s)" +
              ("; ok lines ending in ... are cut: --json gives them whole" if cut else ""), file=sys.stderr)
    return EXIT_NODES_FAILED if report.problems else EXIT_OK
