"""`reconcile`: repair drift between Slurm's cloud nodes and their VMs, the job that keeps GPUs from leaking.

Rules (status.diagnose decides, this module acts):
  - our VM alive while its node is POWERED_DOWN, older than [power] reconcile_grace -> terminate it;
  - node believed up (no power flag, not DOWN) whose VM is gone, failed or off -> (terminate a failed VM,)
    hand the node back to Slurm;
  - VM still starting (PENDING, PROLOG, BOOT) past its node set's boot_timeout while the node is up or
    powering up -> terminate it and hand the node back.
Foreign VMs (without our tags) are never looked at. A node whose lock is held by a running resume or
suspend is skipped; the others are planned again after their locks are taken, from a fresh Slurm then
OpenNebula read, so a suspend or resume that ran in between is never undone.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from .errors import EXIT_NODES_FAILED, EXIT_OK, PowerError, SlurmError
from .hostlists import fold
from .locks import NodeLocks
from .power import Context, Outcome, power_down
from .slurm import NodeState
from .status import Diagnosis, NodeView, Repair, diagnose, slurm_states, survey

log = logging.getLogger(__name__)
LOCK_WAIT = 2.0  # seconds: a busy node is skipped, the next run gets it


def describe(repair: Repair) -> str:
    """terminate VM 3, 4 and hand back to Slurm."""
    parts = []
    if repair.terminate:
        parts.append("terminate VM " + ", ".join(str(vm.id) for vm in repair.terminate))
    if repair.hand_back:
        parts.append("hand back to Slurm")
    return " and ".join(parts)


def _plan(ctx: Context, read_states: Callable[[], Mapping[str, NodeState]], nodes: Sequence[str] | None,
          now: float) -> list[tuple[NodeView, Diagnosis]]:
    # Slurm first, then OpenNebula: a suspend that starts after the Slurm read still waits for our lock.
    states = read_states()
    views = survey(ctx.config, ctx.cloud, states, nodes)
    found = [(view, diagnose(view, now, ctx.config.power.reconcile_grace)) for view in views]
    return [(view, diagnosis) for view, diagnosis in found if diagnosis.repair is not None]


def reconcile(ctx: Context, read_states: Callable[[], Mapping[str, NodeState]],
              nodes: Sequence[str] | None = None, dry_run: bool = False, emit: Callable[[str], None] = print,
              now: Callable[[], float] = time.time, lock_wait: float = LOCK_WAIT) -> Outcome:
    """Find drift and repair it (or, with dry_run, say what would be done); one line per node to emit."""
    outcome = Outcome()
    todo = _plan(ctx, read_states, nodes, now())
    if not todo:
        emit("nothing to repair")
        return outcome
    if dry_run:
        for view, diagnosis in todo:
            assert diagnosis.repair is not None
            emit(f"{view.node}: {'; '.join(diagnosis.problems)} -> would {describe(diagnosis.repair)}")
        return outcome
    with NodeLocks(ctx.config.power.lock_dir, [view.node for view, _ in todo], lock_wait) as locks:
        for node in locks.busy:
            emit(f"{node}: skipped, a resume or suspend holds its lock (next run)")
            log.info("node=%s reconcile skipped: busy", node)
        if not locks.held:
            return outcome
        todo = _plan(ctx, read_states, locks.held, now())  # the world may have moved while we waited
        _repair(ctx, todo, outcome, emit)
    return outcome


def _repair(ctx: Context, todo: list[tuple[NodeView, Diagnosis]], outcome: Outcome,
            emit: Callable[[str], None]) -> None:
    repairs = {view.node: diagnosis.repair for view, diagnosis in todo if diagnosis.repair is not None}
    problems = {view.node: "; ".join(diagnosis.problems) for view, diagnosis in todo}
    for node, repair in repairs.items():
        log.warning("node=%s reconcile: %s -> %s", node, problems[node], describe(repair))
    doomed = [node for node, repair in repairs.items() if repair.terminate]
    failed: dict[str, str] = {}
    if doomed:
        down = power_down(ctx, doomed, "reconcile", force=True)
        failed.update({node: reason for reason, nodes in down.failed.items() for node in nodes})
    by_reason: dict[str, list[str]] = defaultdict(list)
    for node, repair in repairs.items():
        if repair.hand_back:
            by_reason[repair.reason].append(node)
    for reason, nodes in by_reason.items():
        try:
            ctx.slurm.hand_back(nodes, f"reconcile: {reason}")
        except SlurmError as exc:
            for node in nodes:
                failed[node] = f"hand back failed: {exc}"
    for node, repair in repairs.items():
        if node in failed:
            outcome.fail(node, failed[node])
            emit(f"{node}: {problems[node]} -> {describe(repair)}: FAILED ({failed[node]})")
        else:
            outcome.done.append(node)
            emit(f"{node}: {problems[node]} -> {describe(repair)}: done")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """slurm-nebula-power reconcile [--dry-run] [HOSTLIST]: repair drift between Slurm and OpenNebula."""
    from .cli import build_context, load, make_parser, parse, report_error, setup_logging
    from .hostlists import expand

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
        ctx = build_context(config, env)
        outcome = reconcile(ctx, lambda: slurm_states(ctx.slurm), nodes, args.dry_run)
    except PowerError as exc:
        report_error(prog, str(exc))  # one line on stderr (and the log once it is set up)
        return exc.exit_code
    log.info("summary: %s%s: %s in %.1fs", prog, " --dry-run" if args.dry_run else "", outcome.describe(),
             time.monotonic() - start)
    if outcome.failed:
        print(f"failed: {fold(outcome.failed_nodes)}", file=sys.stderr)
    return EXIT_NODES_FAILED if outcome.failed else EXIT_OK
