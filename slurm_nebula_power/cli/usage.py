"""`slurm-nebula-power usage`: GPU-hours and VM-hours from the usage records ([log] audit_file)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ..config import Config
from ..errors import EXIT_NODES_FAILED, EXIT_OK, UsageError
from ..model import printable
from ..usage import (
    GROUPS,
    audit_files,
    disagreements,
    intervals,
    iso,
    parse_when,
    read_audit,
    render,
    summarize,
    table_lines,
)
from .common import interactive_cloud, make_parser, run_command, service_owner

PROG = "slurm-nebula-power usage"


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """slurm-nebula-power usage: GPU-hours and VM-hours by job, node set, host, day or VM."""
    env = os.environ if environ is None else environ
    parser = make_parser(PROG, "GPU-hours and VM-hours from the usage records the programs append to "
                         "[log] audit_file (and its rotated copies), grouped by job, node set, host, day or VM, "
                         "over a time window; a job's line names its VMs and GPUs. Then one pool query: where "
                         "the records and OpenNebula disagree (a VM live that the records say was removed, a "
                         "live VM no record names), it says so.")
    parser.epilog = ("A VM counts from its first RUNNING to its removal (or power-off); one started for several "
                     "jobs counts in full for each. exit: 0 printed and the records agree with OpenNebula, "
                     "1 some disagreement (listed), 2 usage, 3 configuration, 4 OpenNebula unreachable")
    parser.add_argument("--by", choices=GROUPS, default="job", help="group by (default: job)")
    parser.add_argument("--since", metavar="WHEN", help="from (ISO date/time, UTC unless an offset is given, "
                        "or an age: 7d, 12h, 30m); default: the first record")
    parser.add_argument("--until", metavar="WHEN", help="to (same forms); default: now")
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="print JSON: rows, disagreements, unreadable lines")
    form.add_argument("--csv", action="store_true", help="print the table as CSV")
    parser.add_argument("--no-cloud", action="store_true", help="do not ask OpenNebula (an offline audit)")
    parser.add_argument("--file", metavar="PATH", action="append", type=Path,
                        help="read these record files instead of audit_file and its rotated copies (repeat; "
                        ".gz read too)")
    now = time.time()

    def work(args: argparse.Namespace, config: Config) -> Callable[[], int]:
        since = parse_when(args.since, now) if args.since else None
        until = parse_when(args.until, now) if args.until else now
        if since is not None and since >= until:
            raise UsageError(f"--since {args.since} is not before --until {args.until or 'now'}")
        if not args.file and config.log.audit_file is None:
            raise UsageError(f"{config.path}: log.audit_file is not set, so there are no usage records; set it "
                             "(see `slurm-nebula-power example-config`) or pass --file PATH")
        ours = [] if args.file or config.log.audit_file is None else audit_files(config.log.audit_file)
        records, unreadable = read_audit(args.file or [], ours, service_owner(config))
        records = [r for r in records if r.cluster in ("", config.slurm.cluster)]
        found = intervals(records)

        def nodeset_of(node: str) -> str:
            nodeset = config.nodeset_for(node)
            return nodeset.nodes_expr if nodeset is not None else "(in no node set)"

        rows = summarize(found, args.by, since, until, nodeset_of)
        disagree: list[str] | None = None
        if not args.no_cloud:
            live = interactive_cloud(config).cluster_vms(
                config.slurm.cluster)
            disagree = disagreements(records, live, config.slurm.cluster, until)

        def show() -> int:
            if args.json:
                print(json.dumps({"by": args.by, "since": iso(since), "until": iso(until),
                                  "rows": [r.as_dict(args.by) for r in rows], "disagreements": disagree,
                                  "unreadable_lines": unreadable,
                                  "files": [str(p) for p in args.file or ours]}, indent=2))
            elif args.csv:
                out = io.StringIO()
                csv.writer(out, lineterminator="\n").writerows(table_lines(rows, args.by))
                sys.stdout.write(out.getvalue())
            else:
                print(render(rows, args.by) if rows else "no usage in this window")
                if disagree:
                    print("\ndisagreements with OpenNebula:")
                    print("\n".join(f"  {printable(line)}" for line in disagree))  # names from records
                elif disagree is not None:
                    print("\nthe records agree with OpenNebula's live VMs")
            for line in unreadable[:5]:
                print(f"{PROG}: warning: not a usage record: {printable(line)}", file=sys.stderr)
            if len(unreadable) > 5:
                print(f"{PROG}: warning: {len(unreadable) - 5} more lines are not usage records", file=sys.stderr)
            return EXIT_NODES_FAILED if disagree else EXIT_OK

        return show

    return run_command(PROG, parser, argv, env, work, quiet_below=logging.ERROR)  # retries are not news here
