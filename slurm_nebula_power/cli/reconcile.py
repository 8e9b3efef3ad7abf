"""`slurm-nebula-power reconcile [--dry-run] [HOSTLIST]`: repair drift between Slurm and OpenNebula."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence

from ..drift import reconcile
from ..errors import EXIT_NODES_FAILED, EXIT_OK, PowerError
from ..hostlists import expand, fold
from ..slurm import scontrol_for
from .common import build_context, load, make_parser, parse, report_error, setup_logging

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """slurm-nebula-power reconcile [--dry-run] [HOSTLIST]: repair drift between Slurm and OpenNebula."""
    prog = "slurm-nebula-power reconcile"
    env = os.environ if environ is None else environ
    parser = make_parser(prog, "Repair drift: terminate our VMs whose node is powered down (after "
                     "[power] reconcile_grace), hand back to Slurm nodes believed up whose VM is gone, "
                     "failed or off, and terminate VMs stuck starting past boot_timeout. Run it every minute "
                     "as SlurmUser (etc/systemd).")
    parser.epilog = ("exit: 0 nothing to do or all repaired, 1 some repair failed, 2 usage, 3 configuration, "
                     "4 OpenNebula or Slurm unreachable")
    parser.add_argument("hostlist", nargs="?", help="only these nodes (default: every configured node)")
    parser.add_argument("--dry-run", action="store_true", help="say what would be done, change nothing")
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    start = time.monotonic()
    try:
        config = load(args, env)
        # A dry run changes nothing: it logs to stderr only (and never creates the log file as root).
        setup_logging(prog, None if args.dry_run else config)
        nodes = expand(args.hostlist) if args.hostlist is not None else None  # "" is an error, not "all"
        scontrol = scontrol_for(config, env)
        ctx = build_context(config, env, slurm=scontrol)
        outcome = reconcile(ctx, scontrol.show_all_nodes, nodes, args.dry_run)
    except PowerError as exc:
        report_error(prog, str(exc))  # one line on stderr (and the log once it is set up)
        return exc.exit_code
    log.info("summary: %s%s: %s in %.1fs", prog, " --dry-run" if args.dry_run else "", outcome.describe(),
             time.monotonic() - start)
    if outcome.failed:
        print(f"failed: {fold(outcome.failed_nodes)}", file=sys.stderr)
    return EXIT_NODES_FAILED if outcome.failed else EXIT_OK
