"""`slurm-nebula-power unprotect NODES|--all`: take node sets out of protected mode (resume creates their VMs
again), once their template is fixed."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from ..config import Config, NodeSet
from ..errors import EXIT_NODES_FAILED, EXIT_OK, UsageError
from ..hostlists import expand, fold
from ..protectlog import ProtectLog
from .common import make_parser, run_command, service_owner

PROG = "slurm-nebula-power unprotect"
log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """slurm-nebula-power unprotect NODES|--all: clear the protected mode of node sets."""
    env = os.environ if environ is None else environ
    parser = make_parser(PROG, "Take node sets out of protected mode: after [power] protect_after boot failures "
                         "in a row, resume creates none of a node set's VMs and hands its nodes back at once. Fix "
                         "the template first (onevm show of a failed VM says why it failed); the next boot that "
                         "works, or [power] protect_for, clears it too. Run as SlurmUser or root.")
    parser.add_argument("nodes", nargs="?", help="the node sets: a node set's nodes expression, or any of its nodes")
    parser.add_argument("--all", action="store_true", help="every node set")
    parser.epilog = ("exit: 0 cleared (or nothing was protected), 1 a state file could not be removed, 2 usage "
                     "(a node in no node set), 3 configuration")

    def work(args: argparse.Namespace, config: Config) -> Callable[[], int]:
        chosen = _chosen(config, args.nodes, args.all)
        store = ProtectLog.of(config, service_owner(config))
        now = time.time()
        lines, failed = [], False
        for nodeset in chosen:
            old = store.clear(nodeset.nodes_expr)
            if store.path(nodeset.nodes_expr).exists():
                failed = True
                lines.append(f"{nodeset.nodes_expr}: could not remove {store.path(nodeset.nodes_expr)}: run as "
                             "SlurmUser or root")
            elif old is not None and old.active(now, config.power.protect_for):
                lines.append(f"{nodeset.nodes_expr}: protected mode cleared (it followed {old.failures} boot "
                             f"failures, the last: {old.reason}); resume creates its VMs again")
            elif old is not None:
                lines.append(f"{nodeset.nodes_expr}: not protected; its {old.failures} boot failure(s) since the "
                             "last good boot forgotten")
            else:
                lines.append(f"{nodeset.nodes_expr}: not protected")

        def show() -> int:
            for line in lines:
                print(line, file=sys.stderr if line.endswith("root") else sys.stdout)
            return EXIT_NODES_FAILED if failed else EXIT_OK

        return show

    return run_command(PROG, parser, argv, env, work, quiet_below=logging.WARNING)


def _chosen(config: Config, wanted: str | None, every: bool) -> list[NodeSet]:
    """The node sets named: --all, a node set's expression, or the node sets of the nodes given."""
    if every == (wanted is not None):
        raise UsageError("give the node sets' nodes (e.g. gpu01 or gpu[01-16]) or --all, not both")
    if every:
        return list(config.nodesets)
    exact = [ns for ns in config.nodesets if ns.nodes_expr == wanted]
    if exact:
        return exact
    assert wanted is not None
    names = expand(wanted)
    outside = [node for node in names if config.nodeset_for(node) is None]
    if outside:
        raise UsageError(f"{fold(outside)}: in no [[nodeset]] of {config.path} (node sets: "
                         + ", ".join(ns.nodes_expr for ns in config.nodesets) + ")")
    found = {id(ns): ns for node in names if (ns := config.nodeset_for(node)) is not None}
    return list(found.values())
