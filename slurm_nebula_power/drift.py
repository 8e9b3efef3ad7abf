"""Drift between Slurm's cloud nodes and their VMs: survey, diagnose, repair (`status` and `reconcile` are
views over it), the job that keeps GPUs from leaking.

Repairs (diagnose decides, reconcile acts):
  - our VM alive while its node is POWERED_DOWN, older than [power] reconcile_grace -> terminate it;
  - node believed up (no power flag, not DOWN) whose VM is gone, failed or off -> (terminate a failed VM,)
    hand the node back to Slurm;
  - VM still starting (PENDING, PROLOG, BOOT) past its node set's boot_timeout while the node is up or
    powering up -> terminate it and hand the node back;
  - VM UNKNOWN or POWEROFF under a node that is up (its host failed, its hypervisor process was killed),
    or under a node slurmctld marked DOWN for not responding -> terminate it and hand the node back
    (POWER_DOWN_FORCE requeues the node's job and returns the node to the cloud pool);
  - VM running on a host OpenNebula marks DISABLED or OFFLINE (maintenance) while its node is up -> drain
    the node (its jobs finish, no new one starts, the Reason names the host); once idle, Slurm powers it
    down as usual and its next VM goes to another host;
  - node drained by that rule whose VM is gone or whose host takes VMs again -> undrain it;
  - node left down~ (DOWN and powered down: ResumeTimeout reached, or a hand-back on a release that leaves
    it down) with no VM of ours, its Reason ours or slurmctld's "ResumeTimeout reached" ([power]
    return_any_down: any Reason) -> return it to service (State=RESUME), logging the Reason it replaces.
Foreign VMs (without our tags) are never looked at. A node whose lock is held by a running resume or
suspend is skipped; the others are planned again after their locks are taken, from a fresh Slurm then
OpenNebula read, so a suspend or resume that ran in between is never undone.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .config import Config, NodeSet
from .errors import CloudError, SlurmError
from .hosts import Host
from .locks import NodeLocks
from .model import ACTIVE, DONE, PENDING, POWEROFF, UNKNOWN_LCM, Vm, cell
from .nodestate import OFF, STARTING, UP, NodeState
from .operation import Cloud, Context, Outcome
from .plan import SATISFIED, counting_vm
from .slurm import REASON_PREFIX
from .suspend import power_down

log = logging.getLogger(__name__)
LOCK_WAIT = 2.0  # seconds: a busy node is skipped, the next run gets it
MAINTENANCE = ("DISABLED", "OFFLINE")  # host states that drain the nodes whose VMs run there
DRAINED_FOR = "host "  # how a drain reason of ours begins after slurm.REASON_PREFIX ("nebula: host h1 ...")


@dataclass
class NodeView:
    """One node as both sides see it."""

    node: str
    nodeset: NodeSet | None
    slurm: NodeState | None  # None: unknown to slurmctld (or Slurm not asked)
    vms: list[Vm] = field(default_factory=list)  # ours, live
    impostors: list[Vm] = field(default_factory=list)  # named like the node, failing identity: never touched
    host: Host | None = None  # the host its VM runs on, as the host pool shows it (None: unknown)

    @property
    def vm(self) -> Vm | None:
        """The VM that counts (running before booting before off before failed)."""
        return counting_vm(self.vms)


def read_hosts(cloud: Cloud) -> list[Host] | None:
    """The host pool (one call), or None when it cannot be read: host maintenance is then not looked at."""
    try:
        return cloud.hosts()
    except CloudError as exc:
        log.warning("host pool unreadable, hosts in maintenance not looked at: %s", exc)
        return None


def survey(config: Config, cloud: Cloud, states: Mapping[str, NodeState] | None,
           nodes: Sequence[str] | None = None, hosts: bool = False) -> list[NodeView]:
    """One pool query joined with Slurm's states (and, with hosts, the host pool read after it: a failing
    endpoint fails the first call); nodes=None adds our VMs of nodes in no node set."""
    cluster = config.slurm.cluster
    wanted = list(nodes) if nodes is not None else config.all_nodes
    views = {node: NodeView(node, config.nodeset_for(node), (states or {}).get(node)) for node in wanted}
    for vm in cloud.cluster_vms(cluster):
        if vm.is_impostor(cluster, views):
            views[vm.name].impostors.append(vm)
        if vm.state == DONE or not vm.is_ours(cluster, vm.name):
            continue  # foreign: never touched
        if vm.name not in views and nodes is None:
            views[vm.name] = NodeView(vm.name, None, (states or {}).get(vm.name))
        if vm.name in views:
            views[vm.name].vms.append(vm)
    by_name = {host.name: host for host in (read_hosts(cloud) if hosts else None) or ()}
    for view in views.values():
        counted = view.vm
        view.host = by_name.get(counted.host) if counted is not None and counted.host else None
    return list(views.values())


@dataclass(frozen=True)
class Repair:
    """What reconcile does for a node: terminate these VMs, then maybe hand the node back."""

    terminate: tuple[Vm, ...]
    hand_back: bool
    reason: str
    drain: bool = False  # State=DRAIN with the reason: jobs finish, no new one starts
    down: bool = False  # State=DOWN before the hand-back: its guest is gone, its job must not wait for it
    undrain: bool = False  # State=UNDRAIN: our drain is over
    back: bool = False  # State=RESUME: a down~ node with no VM returns to service


@dataclass(frozen=True)
class Diagnosis:
    """What is wrong with a node, and the repair when reconcile may make one."""

    problems: tuple[str, ...] = ()
    repair: Repair | None = None


def _pending_why(vm: Vm) -> str:
    """Why a VM is PENDING, in oned's words.  oned also marks VMs a placement plan left for the next one
    (a dispatch limit, a burst): that is no shortage, and only a message naming the PCI devices is
    called "no free GPU" (7.0's "Not enough capacity in hosts" does not say which resource)."""
    if vm.state != PENDING or not vm.sched_message:
        return ""
    if not vm.unplaceable:
        return f", waiting for oned's scheduler (oned: {vm.oned_message})"
    what = "no free GPU" if "PCI" in vm.sched_message else "no host can take the VM"
    return f": {what} (oned: {vm.oned_message})"


def impostor_problem(vm: Vm) -> str:
    """What status and reconcile say of a VM named like the node that fails identity."""
    return (f"VM {vm.id} ({vm.state_name}) is named {vm.name} but its CONTEXT does not make it ours "
            "(made by hand, or not by this cluster): left alone, remove it with onevm terminate if it is a leak")


RESUME_TIMEOUT = "ResumeTimeout reached"  # slurmctld's Reason for a node that never registered


def returnable(reason: str, any_reason: bool = False) -> bool:
    """Whether reconcile may return a down~ node with this Reason: ours, slurmctld's ResumeTimeout alone, or
    (any_reason) whatever it says. scontrol appends " [user@time]"; slurmctld appends " : ResumeTimeout
    reached" to a Reason already there, so an administrator's Reason keeps its node down."""
    text = reason.rsplit(" [", 1)[0].strip() if reason.endswith("]") else reason.strip()
    return any_reason or text.startswith(REASON_PREFIX) or text == RESUME_TIMEOUT


def _left_down(view: NodeView, st: NodeState, any_reason: bool, problems: list[str]) -> Repair | None:
    """The return of a down~ node no VM of ours serves (the module docstring), or None."""
    if not (st.is_down and st.is_powered_down and not st.is_drained and not view.vms):
        return None
    if not returnable(st.reason, any_reason):
        problems.append("left down: its Reason is not ours (an administrator's; [power] return_any_down "
                        "returns it)")
        return None
    return Repair((), False, f"returned to service (was: {st.reason or 'no reason'})", back=True)


def diagnose(view: NodeView, now: float, grace: float, slurm_asked: bool = True, any_reason: bool = False,
             ) -> Diagnosis:
    """What is wrong with one node; the repair follows the reconcile rules (the module docstring)."""
    nodeset, vm, st = view.nodeset, view.vm, view.slurm
    if nodeset is None:
        if vm is None:
            return Diagnosis(("in no [[nodeset]] of the configuration",))
        return Diagnosis((f"VM {vm.id} tagged for this cluster but the node is in no [[nodeset]]: "
                          "left alone",))
    problems: list[str] = [impostor_problem(vm) for vm in view.impostors]
    if len(view.vms) > 1:
        ids = ", ".join(str(i) for i in sorted(v.id for v in view.vms))
        problems.append(f"{len(view.vms)} VMs for one node: {ids}")
    if st is None:
        if slurm_asked:
            problems.append("unknown to slurmctld (not in slurm.conf, or hidden: 22.05 needs "
                            "PrivateData=cloud)")
        if vm is not None and vm.failed:
            problems.append(f"VM failed ({vm.state_name})")
        elif vm is not None and vm.unplaceable:
            problems.append(f"VM PENDING{_pending_why(vm)}")
        return Diagnosis(tuple(problems))
    where = st.phase
    if st.is_down or st.is_drained:
        problems.append(f"Slurm {'DOWN' if st.is_down else 'DRAIN'}: {st.reason or 'no reason given'}")
    found = _host_trouble(view, st, where, problems) or _left_down(view, st, any_reason, problems)
    if found is not None and not (found.undrain and where == OFF):
        return Diagnosis(tuple(problems), found)
    if vm is not None and vm.ip and where in (UP, STARTING) and st.addr not in ("", view.node, vm.ip):
        problems.append(f"Slurm NodeAddr {st.addr} but VM IP {vm.ip}")
    repair = None
    if where == OFF:
        alive = [v for v in view.vms if v.state not in SATISFIED[nodeset.suspend_action]]
        if alive:
            old = tuple(v for v in alive if now - v.stime >= grace)
            problems.append(f"VM {alive[0].state_name} but node powered down"
                            + ("" if old else f" (within reconcile_grace {grace:g}s)"))
            repair = Repair(old, False, "VM alive while its node is powered down") if old else None
    elif vm is not None and vm.starting and where in (UP, STARTING):
        late = now - vm.stime >= nodeset.boot_timeout
        if where == STARTING and vm.unplaceable:
            problems.append(f"node powering up, VM PENDING{_pending_why(vm)}")
        elif where == UP:
            problems.append(f"node up but VM {vm.state_name}")
        if late:
            reason = f"VM {vm.state_name} past boot_timeout {nodeset.boot_timeout:g}s{_pending_why(vm)}"
            problems.append(f"{vm.state_name} for longer than boot_timeout {nodeset.boot_timeout:g}s")
            repair = Repair(tuple(view.vms), True, reason)
    elif where == UP:
        if vm is None:
            problems.append("node up in Slurm but it has no VM")
            repair = Repair((), True, "its VM is gone")
        elif vm.failed:
            problems.append(f"node up but VM failed ({vm.state_name})")
            repair = Repair(tuple(view.vms), True, f"VM failed ({vm.state_name})")
        elif vm.off:
            problems.append(f"node up but VM {vm.state_name}")
            repair = Repair((), True, f"VM {vm.state_name}")
    elif vm is not None and vm.failed:
        problems.append(f"VM failed ({vm.state_name})")
    if found is not None:  # the undrain of a powered-down node, with what else it needs
        repair = found if repair is None else replace(repair, undrain=True)
    return Diagnosis(tuple(problems), repair)


def _lost(vm: Vm) -> bool:
    """UNKNOWN (oned lost it: its host failed) or POWEROFF (the hypervisor process died, or the guest
    halted): no job runs on it any more."""
    return vm.state == POWEROFF or (vm.state == ACTIVE and vm.lcm_state == UNKNOWN_LCM)


def _drained_by_us(st: NodeState) -> bool:
    return st.is_drained and st.reason.startswith(REASON_PREFIX + DRAINED_FOR)


def _host_trouble(view: NodeView, st: NodeState, where: str, problems: list[str]) -> Repair | None:
    """The repairs a host's failure or maintenance calls for (the module docstring), or None."""
    vm, host = view.vm, view.host
    where_vm = f"host {cell(vm.host or '?', 40)}" if vm is not None else ""
    not_responding = st.is_down and ("*" in st.state or "NOT_RESPONDING" in st.flags)
    if vm is not None and _lost(vm) and (where == UP or not_responding):
        problems.append(f"node {'up' if where == UP else 'not responding'} but VM {vm.state_name}")
        return Repair(tuple(view.vms), True, f"VM {vm.state_name} under the node ({where_vm} failed, or its "
                      "hypervisor process was killed)", down=True)
    if _drained_by_us(st):
        if vm is None or where == OFF or (host is not None and host.placeable):
            back = "the node is powered down" if where == OFF else "its VM is gone" if vm is None else \
                f"{where_vm} takes VMs again"
            problems.append(f"drained for host maintenance, and {back}")
            return Repair((), False, f"{where_vm or 'its host'} back in service", undrain=True)
        problems.append(f"draining: {where_vm} is {host.state_name if host else 'not seen'} in OpenNebula")
        return None
    if vm is not None and vm.running and host is not None and host.state_name in MAINTENANCE and where == UP \
            and not st.is_drained:
        problems.append(f"VM runs on {where_vm}, {host.state_name} in OpenNebula")
        return Repair((), False, f"{DRAINED_FOR}{cell(host.name, 40)} {host.state_name} in OpenNebula: drained for "
                      "maintenance, powered down once idle", drain=True)
    return None


# ---- repair ------------------------------------------------------------------------------------------


def describe(repair: Repair) -> str:
    """terminate VM 3, 4 and hand back to Slurm."""
    parts = []
    if repair.terminate:
        parts.append("terminate VM " + ", ".join(str(vm.id) for vm in repair.terminate))
    if repair.hand_back:
        parts.append("hand back to Slurm")
    if repair.drain:
        parts.append("drain in Slurm")
    if repair.undrain:
        parts.append("undrain in Slurm")
    if repair.back:
        parts.append("return to service in Slurm")
    return " and ".join(parts)


def _plan(ctx: Context, read_states: Callable[[], Mapping[str, NodeState]], nodes: Sequence[str] | None,
          now: float, emit: Callable[[str], None] | None = None) -> list[tuple[NodeView, Diagnosis]]:
    # Slurm first, then OpenNebula: a suspend that starts after the Slurm read still waits for our lock.
    states = read_states()
    views = survey(ctx.config, ctx.cloud, states, nodes, hosts=True)
    if emit is not None:
        for view in views:
            for vm in view.impostors:  # reported every run, never acted on
                log.warning("node=%s vm=%d: %s", view.node, vm.id, impostor_problem(vm))
                emit(f"{view.node}: {impostor_problem(vm)}")
    power = ctx.config.power
    return [(view, diagnose(view, now, power.reconcile_grace, any_reason=power.return_any_down)) for view in views]


def _repairs(found: list[tuple[NodeView, Diagnosis]]) -> list[tuple[NodeView, Diagnosis]]:
    return [(view, diagnosis) for view, diagnosis in found if diagnosis.repair is not None]


Observer = Callable[[Sequence[tuple[NodeView, Diagnosis]]], None]


def reconcile(ctx: Context, read_states: Callable[[], Mapping[str, NodeState]],
              nodes: Sequence[str] | None = None, dry_run: bool = False, emit: Callable[[str], None] = print,
              now: Callable[[], float] = time.time, lock_wait: float = LOCK_WAIT,
              observe: Observer | None = None) -> Outcome:
    """Find drift and repair it (or, with dry_run, say what would be done); one line per node to emit.

    observe, if given, sees the first survey whole (every node and its diagnosis: the metrics' gauges).
    """
    outcome = Outcome()
    found = _plan(ctx, read_states, nodes, now(), emit)
    if observe is not None:
        observe(found)
    todo = _repairs(found)
    if not todo:
        emit("nothing to repair")
        return outcome
    if dry_run:
        for view, diagnosis in todo:
            assert diagnosis.repair is not None
            emit(f"{view.node}: {'; '.join(diagnosis.problems)} -> would {describe(diagnosis.repair)}")
        return outcome
    with NodeLocks(ctx.config.power.lock_dir, [view.node for view, _ in todo], lock_wait, owner=ctx.owner) as locks:
        for node in locks.busy:
            emit(f"{node}: skipped, a resume or suspend holds its lock (next run)")
            log.info("node=%s reconcile skipped: busy", node)
        if not locks.held:
            return outcome
        todo = _repairs(_plan(ctx, read_states, locks.held, now()))  # the world may have moved meanwhile
        _repair(ctx, todo, outcome, emit)
    return outcome


def _repair(ctx: Context, todo: list[tuple[NodeView, Diagnosis]], outcome: Outcome,
            emit: Callable[[str], None]) -> None:
    repairs = {view.node: diagnosis.repair for view, diagnosis in todo if diagnosis.repair is not None}
    problems = {view.node: "; ".join(p for p in diagnosis.problems
                                     if p not in {impostor_problem(vm) for vm in view.impostors})
                for view, diagnosis in todo}  # impostors were reported on their own lines
    for node, repair in repairs.items():
        log.warning("node=%s reconcile: %s -> %s", node, problems[node], describe(repair))
    doomed = [node for node, repair in repairs.items() if repair.terminate]
    failed: dict[str, str] = {}
    if doomed:
        down = power_down(ctx, doomed, "reconcile", force=True)
        failed.update({node: reason for reason, nodes in down.failed.items() for node in nodes})
    by_reason: dict[tuple[str, str], list[str]] = defaultdict(list)
    for node, repair in repairs.items():
        kind = "hand back" if repair.hand_back else "drain" if repair.drain else "undrain" if repair.undrain else \
            "return" if repair.back else ""
        if kind:
            by_reason[(kind, "" if kind in ("undrain", "return") else repair.reason)].append(node)
    for (kind, reason), nodes in by_reason.items():
        try:
            if kind == "hand back":
                if any(repairs[node].down for node in nodes):
                    ctx.slurm.set_down(nodes, f"reconcile: {reason}")
                ctx.slurm.hand_back(nodes, f"reconcile: {reason}")
            elif kind == "return":
                ctx.slurm.set_resume(nodes)
            else:
                ctx.slurm.set_drain(nodes, reason if kind == "drain" else None)
        except SlurmError as exc:
            for node in nodes:
                failed[node] = f"{kind} failed: {exc}"
            continue
        for node in nodes if kind == "hand back" else ():
            ctx.recorder.record("handed_back", node, reason=f"reconcile: {reason}")
        for node in nodes if kind == "return" else ():
            log.warning("node=%s %s", node, repairs[node].reason)
            ctx.recorder.record("returned", node, reason=repairs[node].reason)
    for node, repair in repairs.items():
        if node in failed:
            outcome.fail(node, failed[node])
            emit(f"{node}: {problems[node]} -> {describe(repair)}: FAILED ({failed[node]})")
        else:
            outcome.done.append(node)
            emit(f"{node}: {problems[node]} -> {describe(repair)}: done")
