"""The nodes on their way up in one resume run, and what each poll makes of them: the calls' answers, the
addresses slurmctld is told, the verdict on each VM (resume.py acts on it), and whether a node whose guest
never reported READY is up anyway."""

from __future__ import annotations

import enum
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from .config import NodeSet
from .errors import CloudError, QuotaExceeded, SlurmError, SlurmUnreachable
from .gate import Gate
from .model import ACTIVE, Vm, printable, valid_ip
from .operation import REASON_LENGTH, Context, Outcome, cloud_reason

log = logging.getLogger(__name__)


@dataclass
class Boot:
    """One node on its way up."""

    node: str
    nodeset: NodeSet
    deadline: float
    vm_id: int | None = None
    future: Future[int] | None = None
    attempts: int = 0
    addr: str | None = None
    seen: str = ""
    running: int | None = None  # the VM recorded running
    pending_since: float | None = None  # since when this run sees its VM PENDING with a SCHED_MESSAGE


class Step(enum.Enum):
    """What resume does next with a node, after a look at its VM."""

    WAIT = enum.auto()  # keep waiting
    DONE = enum.auto()  # up
    RECREATE = enum.auto()  # the VM failed or vanished: a new one (recreate_attempts, within boot_timeout)
    MOVE = enum.auto()  # deployed by us to a host that left service meanwhile: made again elsewhere (direct.py)
    UNPLACED = enum.auto()  # PENDING with a SCHED_MESSAGE past pending_timeout: the shortage is judged
    NOT_READY = enum.auto()  # RUNNING, no READY by boot_timeout: up if its slurmd registered anyway
    FAIL = enum.auto()  # give up, for the verdict's reason


@dataclass(frozen=True)
class Verdict:
    """The judgement on one node's VM at one poll."""

    step: Step
    reason: str = ""  # a FAIL's: the node's Reason
    boot_failure: bool = False  # the VM failed, or was never RUNNING once placed: protected mode counts it


WAIT, DONE, RECREATE, MOVE = Verdict(Step.WAIT), Verdict(Step.DONE), Verdict(Step.RECREATE), Verdict(Step.MOVE)
UNPLACED, NOT_READY = Verdict(Step.UNPLACED), Verdict(Step.NOT_READY)


def judge(ctx: Context, jobs: Mapping[str, Sequence[int]], boot: Boot, vm: Vm | None, now: float,
          displaced: bool = False) -> Verdict:
    """Keep waiting, done, recreate, move (`displaced`: its host left service), unplaced, not ready, or fail
    with a reason."""
    if vm is not None:
        ctx.observe(boot.node, vm)
    if vm is None:
        return _retry_or(ctx, boot, now, "VM vanished while booting")
    if displaced and now < boot.deadline:
        log.warning("node=%s vm=%d: its host left service after we placed it there: placing it again",
                    boot.node, vm.id)
        return MOVE
    if vm.state_name != boot.seen:
        log.info("node=%s vm=%d state=%s ip=%s", boot.node, vm.id, vm.state_name, vm.ip)
        boot.seen = vm.state_name
    if vm.running and boot.running != vm.id:
        boot.running = vm.id
        ctx.recorder.record("running", boot.node, vm, jobs=jobs.get(boot.node, ()))
    if vm.failed:
        return _retry_or(ctx, boot, now, f"VM failed to boot ({vm.state_name})", boot_failure=True)
    if vm.without_devices:  # oned's race, not the node set's fault: not a boot failure for protected mode
        log.warning("node=%s vm=%d is %s without a host device for its PCI entries", boot.node, vm.id,
                    vm.state_name)
        return _retry_or(ctx, boot, now, "VM got no PCI device from oned (another VM was given it)")
    if vm.running and vm.ip and (boot.nodeset.wait_for == "running" or vm.ready):
        return DONE
    # pending_timeout counts while oned says it cannot place the VM: a VM PENDING without a message,
    # or left for the next plan by a dispatch limit, still waits for the scheduler (a burst), which
    # proves no shortage.
    if not vm.unplaceable:
        boot.pending_since = None
    elif boot.pending_since is None:
        boot.pending_since = now
    elif now - boot.pending_since >= boot.nodeset.pending_timeout:
        return UNPLACED
    if now < boot.deadline:
        return WAIT
    if vm.unplaceable:
        what = "no free GPU" if "PCI" in vm.sched_message else "no host can take the VM"
        return Verdict(Step.FAIL, f"{what} (PENDING past boot_timeout; oned: {vm.oned_message})")
    if vm.running and vm.ip and boot.nodeset.wait_for == "ready":
        return NOT_READY
    # Placed but never RUNNING (stuck in PROLOG or BOOT) is the image's or the host's doing, PENDING is not.
    return Verdict(Step.FAIL, f"not up after boot_timeout {boot.nodeset.boot_timeout:g}s ({vm.state_name})",
                   boot_failure=vm.state == ACTIVE)


def _retry_or(ctx: Context, boot: Boot, now: float, reason: str, boot_failure: bool = False) -> Verdict:
    if boot.attempts < ctx.config.power.recreate_attempts and now < boot.deadline:
        return Verdict(Step.RECREATE, reason, boot_failure)
    return Verdict(Step.FAIL, reason, boot_failure)


def collect_calls(ctx: Context, gate: Gate, active: Sequence[Boot], now: float) -> dict[str, list[Boot]]:
    """The answers of calls that finished: a VM id, or a failure (also for a call that never answers)."""
    failures: dict[str, list[Boot]] = defaultdict(list)
    for boot in active:
        future = boot.future
        if future is not None and future.done():
            boot.future = None
            try:
                boot.vm_id = future.result()
            except QuotaExceeded as exc:  # a refusal like a shortage, not a failure of oned
                failures[gate.quota(boot.nodeset, exc)[:REASON_LENGTH]].append(boot)
            except CloudError as exc:
                failures[cloud_reason(exc)].append(boot)
        elif future is not None and now >= boot.deadline + ctx.config.opennebula.timeout:
            failures["OpenNebula did not answer in time"].append(boot)
    return failures


def set_addresses(ctx: Context, known: list[Boot], snapshot: Mapping[int, Vm],
                  failures: dict[str, list[Boot]]) -> list[Boot]:
    """Tell slurmctld the new addresses; the boots still to judge (a bad address or a refused update
    fails its node: slurmctld rejects a whole batch for one bad value, and a node without its address
    cannot register)."""
    addresses: dict[str, str] = {}
    fresh: list[Boot] = []
    keep: list[Boot] = []
    for boot in known:
        vm = snapshot.get(boot.vm_id if boot.vm_id is not None else -1)
        if vm is not None and vm.ip and not valid_ip(vm.ip):
            log.error("node=%s vm=%d: OpenNebula's address %s is not an IP address", boot.node, vm.id,
                      printable(repr(vm.ip)[:80]))
            failures["OpenNebula gave the VM no valid IP address"].append(boot)
            continue
        if vm is not None and vm.ip and vm.ip != boot.addr:
            addresses[boot.node] = vm.ip
            fresh.append(boot)
        keep.append(boot)
    if not addresses:
        return keep
    instances = {b.node: b.vm_id for b in fresh if b.vm_id is not None}
    unreachable = False
    for attempt in (1, 2):
        try:
            ctx.slurm.set_addresses(addresses, instances)
        except SlurmError as exc:
            unreachable = isinstance(exc, SlurmUnreachable)
            log.error("could not set node addresses (attempt %d of 2): %s", attempt, exc)
            continue
        for boot in fresh:
            boot.addr = addresses[boot.node]
        return keep
    # Unreachable is not refused: the log and the records say which (the hand-back may not arrive either).
    reason = "slurmctld unreachable: node address update not delivered" if unreachable else \
        "slurmctld refused the node address update"
    failures[reason].extend(fresh)
    return [b for b in keep if b.node not in addresses]


Note = Callable[[NodeSet, int, Sequence[str]], None]  # protect.Guard.note: good boots, boot failures' reasons


def not_ready_up(ctx: Context, outcome: Outcome, late: Sequence[Boot], failures: dict[str, list[Boot]],
                 note: Note | None = None) -> None:
    """RUNNING VMs whose guests reported no READY by boot_timeout: a node whose slurmd registered anyway
    serves jobs (OneGate was slow or unreachable), so it is up; the others fail (one scontrol call), each a
    boot failure for protected mode (`note`)."""
    up = ctx.slurm.registered([b.node for b in late])
    for nodeset in {id(b.nodeset): b.nodeset for b in late}.values():
        mine = [b for b in late if b.nodeset is nodeset]
        if note is not None:
                note(nodeset, sum(b.node in up for b in mine), ["guest did not report READY=YES"] * sum(
                b.node not in up for b in mine))
    for boot in late:
        if boot.node in up:
            log.warning("node=%s vm=%s: slurmd registered but the guest reported no READY=YES within "
                        "boot_timeout %gs: counted as up; check the guest's OneGate access", boot.node,
                        boot.vm_id, boot.nodeset.boot_timeout)
            outcome.done.append(boot.node)
        else:
            failures[f"guest did not report READY=YES within boot_timeout {boot.nodeset.boot_timeout:g}s "
                     "(RUNNING)"].append(boot)
