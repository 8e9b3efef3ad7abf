"""`slurm-nebula-power reconcile [--dry-run] [HOSTLIST]`: repair drift between Slurm and OpenNebula."""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence

from ..audit import AuditLog
from ..drift import Diagnosis, NodeView, read_hosts, reconcile
from ..errors import EXIT_NODES_FAILED, EXIT_OK, CloudError, PowerError
from ..hostlists import expand, fold
from ..metrics import RunFigures
from ..nodestate import OFF, STARTING, STOPPING, UP, NodeState
from ..operation import Context
from ..records import reason_category
from ..slurm import scontrol_for
from ..stepout import Step, out_now, settle_all, surveyed
from .common import (
    build_context,
    cloud_error_line,
    load,
    make_parser,
    parse,
    publish_metrics,
    report_error,
    run_figures,
    service_owner,
    setup_logging,
)

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """slurm-nebula-power reconcile [--dry-run] [HOSTLIST]: repair drift between Slurm and OpenNebula."""
    prog = "slurm-nebula-power reconcile"
    env = os.environ if environ is None else environ
    parser = make_parser(prog, "Repair drift: terminate our VMs whose node is powered down (after "
                     "[power] reconcile_grace), hand back to Slurm nodes believed up whose VM is gone, "
                     "failed or off, and terminate VMs stuck starting past boot_timeout. Run it every minute "
                     "as SlurmUser (`slurm-nebula-power example-config --list`: its systemd units).")
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
        # A dry run changes nothing: it logs to stderr only (and never creates the log file as root),
        # and writes neither usage records nor metrics.
        setup_logging(prog, None if args.dry_run else config)
        nodes = expand(args.hostlist) if args.hostlist is not None else None  # "" is an error, not "all"
        scontrol = scontrol_for(config, env)
    except PowerError as exc:
        report_error(prog, str(exc))  # one line on stderr (and the log once it is set up)
        return exc.exit_code
    recorder = AuditLog(None if args.dry_run else config.log.audit_file, "reconcile", config.slurm.cluster,
                        owner=service_owner(config))
    ctx = build_context(config, env, slurm=scontrol, recorder=recorder, interactive=True)
    seen = Survey()
    outcome = None
    steps: list[Step] = []
    try:
        outcome = reconcile(ctx, scontrol.show_all_nodes, nodes, args.dry_run, observe=seen)
        if not args.dry_run:  # the node sets short of GPUs: out of Slurm's way, or back in (stepout.py)
            steps = step_node_sets(ctx, seen, nodes)
    except PowerError as exc:
        report_error(prog, cloud_error_line(config, exc) if isinstance(exc, CloudError) else str(exc))
        return exc.exit_code
    finally:
        recorder.close()
        if not args.dry_run and config.log.metrics_file is not None:
            result = "error" if outcome is None else "failed" if outcome.failed else "ok"
            figures = run_figures(config, "reconcile", outcome, recorder, ctx.cloud, time.monotonic() - start,
                                  result)
            if outcome is not None:
                seen.fill(figures, ctx.cloud)
                figures.gauges["nodesets_out"] = out_now(steps, seen.states(), ctx.config.nodesets)
            publish_metrics(config, figures)
    log.info("summary: %s%s: %s in %.1fs", prog, " --dry-run" if args.dry_run else "", outcome.describe(),
             time.monotonic() - start)
    if outcome.failed:
        print(f"failed: {fold(outcome.failed_nodes)}", file=sys.stderr)
    return EXIT_NODES_FAILED if outcome.failed else EXIT_OK


def step_node_sets(ctx: Context, seen: Survey, nodes: Sequence[str] | None) -> list[Step]:
    """Step out the node sets still short, back in those whose GPUs returned (one host pool read, made only
    when a node set has a shortage or a node of ours out); a line each."""
    wanted = ctx.config.nodesets if nodes is None else [
        ns for ns in ctx.config.nodesets if any(n in nodes for n in ns.nodes)]
    steps = settle_all(surveyed(ctx, seen.states()), wanted, functools.cache(lambda: read_hosts(ctx.cloud)))
    for step in steps:
        print(step.describe())
    return steps


class Survey:
    """What reconcile's first survey saw, for the gauges: GPUs held by node state, drift found."""

    def __init__(self) -> None:
        self.found: Sequence[tuple[NodeView, Diagnosis]] = ()

    def states(self) -> dict[str, NodeState]:
        """Slurm's view of each node the survey saw."""
        return {view.node: view.slurm for view, _ in self.found if view.slurm is not None}

    def __call__(self, found: Sequence[tuple[NodeView, Diagnosis]]) -> None:
        self.found = found

    def fill(self, figures: RunFigures, cloud: object) -> None:
        """Add the gauges and the drift counts; the free GPUs from one host pool query (when it answers)."""
        held: dict[str, float] = dict.fromkeys(("idle", "busy", "powered_down", "starting", "stopping", "other",
                                                "unknown"), 0.0)
        drifting = 0
        for view, diagnosis in self.found:
            held[_slurm_state(view)] += sum(1 for vm in view.vms for gpu in vm.gpus if gpu.assigned)
            if diagnosis.repair is not None:
                drifting += 1
                figures.drift[reason_category(diagnosis.repair.reason)] += 1
        for state, gpus in held.items():
            figures.labelled[("gpus_held_by_slurm_state", state)] = gpus
        figures.gauges["drift_nodes"] = drifting
        host_gpus = getattr(cloud, "host_gpus", None)
        if host_gpus is not None:
            try:
                total, free = host_gpus()
            except PowerError as exc:
                log.warning("host pool unreadable, gpus_free not updated: %s", exc)
            else:
                figures.gauges.update(gpus_total=total, gpus_free=free)


def _slurm_state(view: NodeView) -> str:
    state = view.slurm
    if state is None:
        return "unknown"
    phase = state.phase
    if phase == UP:
        return "idle" if state.base == "IDLE" else "busy"
    return {OFF: "powered_down", STARTING: "starting", STOPPING: "stopping"}.get(phase, "other")
