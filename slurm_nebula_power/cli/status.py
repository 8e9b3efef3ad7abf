"""`slurm-nebula-power status [HOSTLIST]`: one row per node, Slurm's view joined with OpenNebula's."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from ..config import Config
from ..errors import EXIT_NODES_FAILED, EXIT_OK, SlurmError
from ..hostlists import expand
from ..slurm import scontrol_for
from ..statustable import capacity, placement_line, prolog_line, render, render_capacity, table_rows
from ..stepout import outlook
from .common import interactive_cloud, make_parser, run_command


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """slurm-nebula-power status [HOSTLIST]: Slurm state, VM and what is wrong, per node."""
    prog = "slurm-nebula-power status"
    env = os.environ if environ is None else environ
    parser = make_parser(prog, "One row per node: Slurm state (scontrol), VM id, VM state in words, IP, host, "
                     "age, and what is wrong.")
    parser.epilog = ("exit: 0 nothing wrong, 1 some node has a problem, 2 usage, 3 configuration, "
                     "4 OpenNebula unreachable")
    parser.add_argument("hostlist", nargs="?", help="nodes to show (default: every configured node, and VMs "
                        "of this cluster whose node is in no node set)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows instead of the table")
    parser.add_argument("--capacity", action="store_true", help="also show each GPU node set's devices per host "
                        "(free, held by our VMs, by others); with --json print {\"nodes\": rows, \"capacity\": "
                        "[...]} instead of the list")
    parser.add_argument("--no-slurm", action="store_true", help="do not ask slurmctld (Slurm columns empty)")

    def work(args: argparse.Namespace, config: Config) -> Callable[[], int]:
        nodes = expand(args.hostlist) if args.hostlist else None
        states = None
        if not args.no_slurm:
            try:
                states = scontrol_for(config, env).show_all_nodes()
            except SlurmError as exc:
                print(f"{prog}: warning: Slurm state unavailable: {exc}", file=sys.stderr)
        cloud = interactive_cloud(config)
        rows = table_rows(config, cloud, states, nodes)
        gpus = capacity(config, cloud) if args.capacity else None

        def show() -> int:
            footer = None if args.json else prolog_line(config)
            if args.json:
                print(json.dumps(rows if gpus is None else {"nodes": rows, "capacity": gpus}, indent=2))
            else:
                print(render(rows, not args.no_slurm))
                if gpus is not None:
                    print(render_capacity(gpus))
                print(placement_line(config))
                for line in outlook(config, states, time.time()):
                    print(f"Out of service: {line}")
            if footer:
                print(footer)
            return EXIT_NODES_FAILED if any(r["problems"] for r in rows) else EXIT_OK

        return show

    return run_command(prog, parser, argv, env, work, quiet_below=logging.WARNING)
