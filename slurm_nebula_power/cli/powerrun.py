"""The run of resume, suspend and resume-fail once their command line is parsed (cli/power.py): load the
configuration, lock the nodes, run the operation, hand back what could not be done, write the summary."""

from __future__ import annotations

import argparse
import logging
import os
import time
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path

from ..config import Config, find_config
from ..errors import EXIT_INTERNAL, EXIT_NODES_FAILED, EXIT_OK, ConfigError, PowerError, UsageError, first_line
from ..hostlists import expand, fold
from ..locks import NodeLocks
from ..operation import Context, Outcome
from ..operation import hand_back as _hand_back
from ..resume import resume
from ..slurm import Scontrol, find_scontrol, jobs_from_resume_file, scontrol_for
from ..stepout import after_suspend
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
            nodes = _admit(config, env, nodes, force=getattr(args, "force", False))
    except PowerError as exc:
        report_error(prog, str(exc))
        if detachable and isinstance(exc, ConfigError):
            _hand_back_unconfigured(args.hostlist, args.config, env)
        return exc.exit_code
    if detachable and config.power.detach and _detach():
        log.info("detached: %s continues in the background", args.hostlist)
        return EXIT_OK
    return _run_locked(prog, config, env, nodes, jobs, OPERATIONS[operation], args.hostlist,
                       hands_back=detachable)


def _admit(config: Config, environ: Mapping[str, str], nodes: list[str], force: bool) -> list[str]:
    """Resume acts only on what slurmctld asked for: the call is refused whole (exit 2, nothing done, no VM,
    no address changed) when any node is

    - in no node set and not being powered up by slurmctld (a mistyped name, a login node): a node in no
      node set that slurmctld does power up is handed back, so its job does not wait for ResumeTimeout;
    - unknown to slurmctld (no NodeName line), or a static node (no CLOUD flag): never a VM, --force or not;
    - a cloud node slurmctld is not powering up (resume run by hand on a powered-down node would make a VM
      Slurm never learns of, whose GPU stays taken until reconcile's grace ends): unless --force.

    When slurmctld cannot be asked, a run slurmctld started (it sets SLURM_RESUME_FILE) goes on with a
    warning, since it asked for these nodes; a run by hand is refused. In a run slurmctld started, a cloud
    node it is no longer powering up (powered down by hand meanwhile) is left out and the others go on, so
    that they do not wait for ResumeTimeout. The nodes to act on."""
    strays = [node for node in nodes if config.nodeset_for(node) is None]
    sets = ", ".join(ns.nodes_expr for ns in config.nodesets)
    try:
        states = scontrol_for(config, environ).show_nodes(nodes)
    except PowerError as exc:
        said = first_line(exc, 120)
        if strays:
            raise UsageError(f"{fold(strays)}: in no [[nodeset]] of {config.path} (node sets: {sets}), and "
                             f"slurmctld cannot say whether it is powering them up ({said}): nothing done") from None
        if environ.get("SLURM_RESUME_FILE"):
            log.warning("slurmctld cannot say how %s stand (%s): resuming them as it asked", fold(nodes), said)
            return nodes
        raise UsageError(f"{fold(nodes)}: slurmctld cannot say whether it is powering them up ({said}): nothing "
                         "done; resume runs for slurmctld (scontrol update NodeName=... State=POWER_UP)") from None
    foreign = [node for node in strays if node not in states or not states[node].is_powering_up]
    if foreign:
        raise UsageError(f"{fold(foreign)}: in no [[nodeset]] of {config.path} (node sets: {sets}) and not being "
                         "powered up by slurmctld: nothing done; check the node name, or add a [[nodeset]] "
                         "for it")
    ours = [node for node in nodes if node not in strays]
    unknown = [node for node in ours if node not in states]
    if unknown:
        raise UsageError(f"{fold(unknown)}: unknown to slurmctld (no NodeName line in slurm.conf): nothing done; "
                         "add the lines `slurm-nebula-power slurm-conf` prints and restart slurmctld")
    static = [node for node in ours if "CLOUD" not in states[node].flags]
    if static:
        raise UsageError(f"{fold(static)}: static nodes (no State=CLOUD in slurm.conf): nothing done, never a VM "
                         "for them; take them out of the node set's nodes")
    idle = [node for node in ours if not states[node].is_powering_up]
    if idle and environ.get("SLURM_RESUME_FILE") and not force:
        log.warning("%s: no longer being powered up by slurmctld (%s): left out", fold(idle), states[idle[0]].state)
        return [node for node in nodes if node not in idle]
    if idle and not force:
        raise UsageError(f"{fold(idle)}: not being powered up by slurmctld ({states[idle[0]].state}): nothing "
                         f"done, a VM made by hand is one Slurm never learns of; ask slurmctld: scontrol update "
                         f"NodeName={fold(idle)} State=POWER_UP (or --force)")
    if idle:
        log.warning("--force: resuming %s, which slurmctld is not powering up: their VMs run until suspended or "
                    "reconciled", fold(idle))
    return nodes


def _hand_back_unconfigured(expression: str, config_arg: str | None, environ: Mapping[str, str]) -> None:
    """A configuration that cannot be loaded leaves resume nothing to act with; the nodes slurmctld is
    powering up (cloud nodes it asked us for) are handed back at once rather than at ResumeTimeout. A
    hostlist that cannot be read, or a slurmctld that cannot be asked, leaves them to ResumeTimeout."""
    try:
        nodes = expand(expression)
        env = {"SLURM_CONF": environ["SLURM_CONF"]} if environ.get("SLURM_CONF") else {}
        slurm = Scontrol(_scontrol_named(config_arg, environ) or find_scontrol(None, environ), env=env)
        states = slurm.show_nodes(nodes)
        asked = [n for n in nodes if n in states and states[n].is_powering_up and "CLOUD" in states[n].flags]
        if asked:
            slurm.hand_back(asked, "configuration unusable: run slurm-nebula-power check")
    except PowerError:
        return


def _scontrol_named(config_arg: str | None, environ: Mapping[str, str]) -> Path | None:
    """[slurm] scontrol of a configuration that is valid TOML but not a valid configuration, if it names one."""
    try:
        with find_config(config_arg, environ).open("rb") as handle:
            named = tomllib.load(handle).get("slurm", {}).get("scontrol")
    except (OSError, PowerError, tomllib.TOMLDecodeError, AttributeError):
        return None
    usable = isinstance(named, str) and "\x00" not in named and Path(named).is_absolute()
    return Path(named) if usable else None


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
    outcome = power_down(ctx, nodes, "suspend", force=False)
    # a node set still short: its nodes now powering down step out (stepout.py); suspend alone: resume-fail's
    # nodes never registered, which is no shortage
    after_suspend(ctx, nodes)
    return outcome


def _resume_fail_op(ctx: Context, nodes: list[str], jobs: dict[str, list[int]]) -> Outcome:
    return power_down(ctx, nodes, "resume failed: node never registered with slurmctld", force=True)


OPERATIONS: dict[str, Operation] = {"resume": _resume_op, "suspend": _suspend_op, "resume-fail": _resume_fail_op}
