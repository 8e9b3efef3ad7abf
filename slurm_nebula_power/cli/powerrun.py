"""The run of resume, suspend and resume-fail once their command line is parsed (cli/power.py): load the
configuration, lock the nodes, run the operation, hand back what could not be done, write the summary."""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable, Mapping

from ..config import Config
from ..errors import EXIT_INTERNAL, EXIT_NODES_FAILED, EXIT_OK, ConfigError, PowerError, UsageError, first_line
from ..hostlists import expand, fold
from ..locks import NodeLocks
from ..operation import Context, Outcome
from ..operation import hand_back as _hand_back
from ..resume import resume
from ..slurm import jobs_from_resume_file, scontrol_for
from ..suspend import power_down
from .common import (
    audit_log,
    build_context,
    load,
    publish_metrics,
    report_error,
    run_figures,
    service_owner,
    setup_logging,
)

log = logging.getLogger(__name__)

Operation = Callable[[Context, list[str], dict[str, list[int]]], Outcome]


def run(prog: str, operation: str, args: argparse.Namespace, environ: Mapping[str, str] | None) -> int:
    """Run `operation` (resume, suspend, resume-fail) on the parsed command line; the exit code."""
    env = os.environ if environ is None else environ
    detachable = operation == "resume"
    jobs = jobs_from_resume_file(env) if detachable else {}  # the memfd vanishes when we exit: read it first
    try:
        config = load(args, env)
        setup_logging(prog, config)
        nodes = expand(args.hostlist)
        if detachable:
            _refuse_strays(config, env, nodes)
    except PowerError as exc:
        report_error(prog, str(exc))
        return exc.exit_code
    if detachable and config.power.detach and _detach():
        log.info("detached: %s continues in the background", args.hostlist)
        return EXIT_OK
    return _run_locked(prog, config, env, nodes, jobs, OPERATIONS[operation], args.hostlist,
                       hands_back=detachable)


def _refuse_strays(config: Config, environ: Mapping[str, str], nodes: list[str]) -> None:
    """Nodes in no node set are handed back only while slurmctld is powering them up (it asked for them);
    any other is a mistyped name or a node that is not ours (a login node, a static node): the call is
    refused whole, with nothing done, and no node of someone else's is ever forced down."""
    strays = [node for node in nodes if config.nodeset_for(node) is None]
    if not strays:
        return
    sets = ", ".join(ns.nodes_expr for ns in config.nodesets)
    try:
        states = scontrol_for(config, environ).show_nodes(strays)
    except PowerError as exc:
        raise UsageError(f"{fold(strays)}: in no [[nodeset]] of {config.path} (node sets: {sets}), and slurmctld "
                         f"cannot say whether it is powering them up ({first_line(exc, 120)}): nothing done") \
            from None
    foreign = [node for node in strays if node not in states or not states[node].is_powering_up]
    if foreign:
        raise UsageError(f"{fold(foreign)}: in no [[nodeset]] of {config.path} (node sets: {sets}) and not being "
                         "powered up by slurmctld: nothing done; check the node name, or add a [[nodeset]] "
                         "for it")


def _detach() -> bool:
    """Fork; True in the parent (which returns to slurmctld), False in the detached child."""
    if os.fork() > 0:
        return True
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    return False


def _run_locked(prog: str, config: Config, environ: Mapping[str, str], nodes: list[str],
                jobs: dict[str, list[int]], operation: Operation, expression: str, hands_back: bool) -> int:
    start = time.monotonic()
    wait = max(ns.boot_timeout for ns in config.nodesets) + config.power.suspend_timeout
    program = prog.removeprefix("slurm-nebula-")
    recorder = audit_log(config, program)
    context: Context | None = None
    outcome: Outcome | None = None
    result = "error"
    try:
        context = build_context(config, environ, recorder=recorder)
        with NodeLocks(config.power.lock_dir, nodes, wait, owner=service_owner(config)) as locks:
            if locks.busy:
                log.error("%s: still locked by another run after %.0fs, left to it", fold(locks.busy), wait)
            for node, why in locks.unavailable.items():
                log.error("node=%s: lock unavailable: %s", node, why)
            outcome = operation(context, locks.held, jobs)
            _unlocked(context, outcome, locks, hands_back)
        result = "failed" if outcome.failed else "ok"
    except PowerError as exc:
        report_error(prog, str(exc))
        if hands_back and context is not None and isinstance(exc, ConfigError):  # the lock directory
            _hand_back(context, Outcome(), nodes, "cannot lock: see the nebula-power log")
        return exc.exit_code
    except Exception:
        log.exception("%s %s: internal error", prog, expression)
        return EXIT_INTERNAL
    finally:
        recorder.close()
        publish_metrics(config, run_figures(config, program, outcome, recorder,
                                            context.cloud if context else None, time.monotonic() - start, result))
    assert outcome is not None and context is not None
    stats = context.cloud.stats  # type: ignore[attr-defined]
    log.info("summary: %s %s: %s in %.1fs, %d API calls, %d retries", prog, expression, outcome.describe(),
             time.monotonic() - start, stats.calls, stats.retries)
    return EXIT_NODES_FAILED if outcome.failed else EXIT_OK


def _unlocked(context: Context, outcome: Outcome, locks: NodeLocks, hands_back: bool) -> None:
    """Nodes this run could not lock fail; resume hands them back, so no job waits for ResumeTimeout."""
    groups = [(locks.busy, "busy: another run holds its lock"),
              (list(locks.unavailable), "lock unavailable: see the nebula-power log")]
    for nodes, reason in groups:
        if not nodes:
            continue
        if hands_back:
            _hand_back(context, outcome, nodes, reason)
        else:
            for node in nodes:
                outcome.fail(node, reason)


def _resume_op(ctx: Context, nodes: list[str], jobs: dict[str, list[int]]) -> Outcome:
    return resume(ctx, nodes, jobs)


def _suspend_op(ctx: Context, nodes: list[str], jobs: dict[str, list[int]]) -> Outcome:
    return power_down(ctx, nodes, "suspend", force=False)


def _resume_fail_op(ctx: Context, nodes: list[str], jobs: dict[str, list[int]]) -> Outcome:
    return power_down(ctx, nodes, "resume failed: node never registered with slurmctld", force=True)


OPERATIONS: dict[str, Operation] = {"resume": _resume_op, "suspend": _suspend_op, "resume-fail": _resume_fail_op}
