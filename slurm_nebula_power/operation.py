"""What resume, suspend and drift share: the Cloud they act on, the Context they run in, the Outcome they
return, and the few steps every one of them takes (remove a VM, hand nodes back, log by kind)."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .backoff import Backoff
from .config import Config
from .errors import ActionRefused, CloudError, SlurmError, VmNotFound, first_line
from .grants import Rights
from .hostlists import fold
from .hosts import Host, VmNeeds
from .model import ACTIVE, DONE, RUNNING_LCM, Vm, printable
from .owned import Owned
from .plan import removal_action
from .slurm import SlurmControl

log = logging.getLogger(__name__)
REASON_LENGTH = 150  # characters of an OpenNebula error kept in a node's Reason


class Cloud(Protocol):
    """What the operations need of OpenNebula (cloud.OneCloud, or a fake in tests)."""

    def cluster_vms(self, cluster: str, first_id: int = -1) -> list[Vm]: ...
    def hosts(self) -> list[Host]: ...
    def host(self, host_id: int) -> Host: ...
    def template_id(self, ref: str | int) -> int: ...
    def template(self, template_id: int) -> dict[str, Any]: ...
    def networks(self) -> list[Owned]: ...
    def images(self) -> list[Owned]: ...
    def instantiate(self, template_id: int, name: str, extra: str, retry: bool = True,
                    hold: bool = False) -> int: ...
    def action(self, action: str, vm_id: int) -> None: ...
    def deploy(self, vm_id: int, host_id: int) -> None: ...
    def vm_needs(self, vm_id: int) -> VmNeeds: ...
    def rights(self) -> Rights: ...
    def clear_stale(self, vm_id: int, ready: bool, sched_message: bool) -> None: ...
    def recover_delete(self, vm_id: int) -> None: ...
    def vm(self, vm_id: int) -> Vm: ...
    def version(self) -> str: ...
    def onegate_endpoint(self) -> str: ...


class Recorder(Protocol):
    """Where the operations report VM events (audit.AuditLog writes them as usage records)."""

    def record(self, event: str, node: str, vm: Vm | None = None, vm_id: int | None = None,
               jobs: Sequence[int] = (), reason: str | None = None, action: str | None = None) -> None: ...


class NoRecorder:
    """Records nothing (tests, the operator commands that change nothing)."""

    def record(self, event: str, node: str, vm: Vm | None = None, vm_id: int | None = None,
               jobs: Sequence[int] = (), reason: str | None = None, action: str | None = None) -> None:
        """Do nothing."""


@dataclass
class Outcome:
    """Partial success as a value: nodes done, nodes failed grouped by reason."""

    done: list[str] = field(default_factory=list)
    failed: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def fail(self, node: str, reason: str) -> None:
        """Record a failed node with its reason."""
        self.failed[reason].append(node)

    @property
    def failed_nodes(self) -> list[str]:
        """Every failed node."""
        return sorted(node for nodes in self.failed.values() for node in nodes)

    def describe(self) -> str:
        """One line: counts and the failures by reason."""
        text = f"{len(self.done)} done, {len(self.failed_nodes)} failed"
        if self.failed:
            text += " (" + "; ".join(f"{reason}: {fold(nodes)}" for reason, nodes in self.failed.items()) + ")"
        return text


@dataclass(frozen=True)
class Context:
    """Everything an operation needs, handed in (tests pass fakes and fake clocks)."""

    config: Config
    cloud: Cloud
    slurm: SlurmControl
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    on_vm: Callable[[str, Vm], None] | None = None  # progress observer (the demo)
    poll_first: float = 0.25
    recorder: Recorder = field(default_factory=NoRecorder)  # usage records (the audit file)
    owner: tuple[int, int] | None = None  # who gets the files a root run creates (SlurmUser): cli.service_owner

    @property
    def cluster(self) -> str:
        """Our cluster name, the first half of every VM's identity."""
        return self.config.slurm.cluster

    def observe(self, node: str, vm: Vm) -> None:
        """Tell the progress observer, if any, what a node's VM looks like now."""
        if self.on_vm is not None:
            self.on_vm(node, vm)


@dataclass(frozen=True)
class Patience:
    """How long a removal waits for a VM in a transient state to leave it, and how it polls meanwhile."""

    seconds: float
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    poll_first: float = 0.25
    poll_max: float = 2.0

    @classmethod
    def of(cls, ctx: Context) -> Patience:
        """The operation's own bound: [power] suspend_timeout, the time a VM is given to go down."""
        power = ctx.config.power
        return cls(power.suspend_timeout, ctx.sleep, ctx.clock, ctx.poll_first, power.poll_max)


def remove_vm(cloud: Cloud, vm: Vm, patience: Patience) -> str:
    """Terminate a VM of ours, whatever its state; returns the action used.

    oned refuses terminate(-hard) in a transient state (BOOT, PROLOG, SHUTDOWN...: DispatchManager::
    terminate). recover --delete drops the VM there and frees its host share, GPU included, but not while
    the scheduler is deploying it (LCM_INIT, PROLOG, BOOT...: model.DEPLOYING_LCM): the placement plan
    then waits for the deploy's answer until ACTION_TIMEOUT (300 s stock) and oned places no VM
    meanwhile (seen on 7.0.2 and 7.4.0). Such a VM is waited for, within `patience`, until it leaves that
    state (a deploy ends by itself), then terminated; it is dropped only if it is still deploying then.
    """
    action = removal_action(vm)
    try:
        cloud.action(action, vm.id)
        return action
    except ActionRefused:
        pass
    deadline = patience.clock() + patience.seconds
    interval = Backoff(patience.poll_first, patience.poll_max)
    while True:
        try:
            vm = cloud.vm(vm.id)
        except VmNotFound:
            return action  # gone meanwhile
        if vm.state == DONE:
            return action
        if not vm.deploying:
            if not vm.transient:
                action = removal_action(vm)
                try:
                    cloud.action(action, vm.id)
                    return action
                except ActionRefused:
                    pass  # its state moved on again: look again
            else:
                break  # transient but not deploying: recover --delete is safe and frees the host share now
        if patience.clock() >= deadline:
            log.warning("vm=%d still %s after %gs: dropping it with recover --delete%s", vm.id, vm.state_name,
                        patience.seconds, " (oned places no VM until its ACTION_TIMEOUT)" if vm.deploying else "")
            break
        patience.sleep(interval.next())
    cloud.recover_delete(vm.id)
    return "recover-delete"


# oned's refusals of an instantiate whose template names a network or image the user cannot have
# (VirtualNetworkPool.cc, ImageManagerActions.cc, AuthManager.cc): their text runs past REASON_LENGTH, so the
# Reason says it in a short sentence of its own instead of a cut one.
_NOT_OWNED = re.compile(r"User (\d+) does not own an? (network|image) with name: (.*?) \. Set")
_NO_ID = re.compile(r"(Virtual network|Image) with ID: (\S{1,20}) does not exist")
_NO_USE = re.compile(r"Not authorized to perform USE (NET|IMAGE) \[(\d+)\]")
_VECTOR = {"network": ("NIC", "NETWORK"), "image": ("DISK", "IMAGE")}


def _reference_reason(text: str) -> str | None:
    """The short sentence for a NIC's network or a DISK's image oned could not resolve or authorise, or None."""
    if found := _NOT_OWNED.search(text):
        uid, noun, name = found.groups()
        vector, attr = _VECTOR[noun]
        name = printable(name) if len(name) <= 40 else printable(name[:37]) + "..."
        return (f"template {vector}: {noun} {name} not owned by user {uid}; set {attr}_UNAME or use {attr}_ID "
                "(check says how)")
    if found := _NO_ID.search(text):
        noun = "network" if found.group(1) == "Virtual network" else "image"
        vector, attr = _VECTOR[noun]
        return f"template {vector}: no {noun} {printable(found.group(2))}; fix {attr}_ID (check says how)"
    if found := _NO_USE.search(text):
        noun = "network" if found.group(1) == "NET" else "image"
        return (f"template {_VECTOR[noun][0]}: {noun} {found.group(2)} not usable by the user; oneadmin grants "
                "USE (check says how)")
    return None


def cloud_reason(exc: BaseException) -> str:
    """A node's failure reason from an OpenNebula error: its first line, short enough for a Slurm Reason; a
    template's network or image oned refused is a short sentence of its own (never one cut in the middle)."""
    return f"OpenNebula: {_reference_reason(first_line(exc, 1000)) or first_line(exc, REASON_LENGTH)}"


def timed(what: str, node: str, vm_id: int | None, fn: Callable[[], Any]) -> Any:
    """Run one action for a node, logging its result and how long it took."""
    start = time.monotonic()
    try:
        result = fn()
    except Exception as exc:
        log.info("node=%s vm=%s action=%s result=error seconds=%.2f error=%s", node, vm_id, what,
                 time.monotonic() - start, exc)
        raise
    log.info("node=%s vm=%s action=%s result=ok seconds=%.2f", node, result if vm_id is None else vm_id,
             what, time.monotonic() - start)
    return result


class Removals:
    """The VMs one run is removing: each is removed once, whichever part of the run finds it first."""

    def __init__(self, cloud: Cloud, patience: Patience, recorder: Recorder | None = None) -> None:
        self.cloud = cloud
        self.patience = patience
        self.recorder = recorder or NoRecorder()
        self.ids: set[int] = set()
        self._lock = threading.Lock()

    def claim(self, vm_id: int) -> bool:
        """True the first time: the caller removes it. Claimed before a pool runs it, so the next poll does
        not submit it again."""
        with self._lock:
            if vm_id in self.ids:
                return False
            self.ids.add(vm_id)
            return True

    def release(self, vm_id: int) -> None:
        """Not removed after all: it is still ours to remove (the sweep or reconcile will)."""
        with self._lock:
            self.ids.discard(vm_id)

    def __contains__(self, vm_id: object) -> bool:
        return vm_id in self.ids

    def remove(self, node: str, vm: Vm) -> None:
        """Remove one claimed VM of ours, logging the action; errors are logged, reconcile retries."""
        self.claim(vm.id)
        try:
            action = timed("remove", node, vm.id, lambda: remove_vm(self.cloud, vm, self.patience))
        except CloudError as exc:
            log.error("node=%s vm=%d could not be removed, reconcile will: %s", node, vm.id, exc)
            return
        # Not awaited: the action is accepted and frees the host's share (GPU included) as oned ends it.
        self.recorder.record("removed", node, vm, action=action)


def unseen_vm(vm_id: int, node: str) -> Vm:
    """A VM whose state we did not see: treated as running, so removal tries terminate-hard, then delete."""
    return Vm(id=vm_id, name=node, state=ACTIVE, lcm_state=RUNNING_LCM)


def hand_back(ctx: Context, outcome: Outcome, nodes: Sequence[str], reason: str) -> None:
    """Record nodes as failed and give them back to Slurm now, so their jobs requeue."""
    for node in nodes:
        outcome.fail(node, reason)
        ctx.recorder.record("handed_back", node, reason=reason)
    try:
        ctx.slurm.hand_back(list(nodes), reason)
        log.warning("handed %s back to Slurm: %s", fold(nodes), reason)
    except SlurmError as exc:
        log.error("could not hand %s back to Slurm (%s): %s", fold(nodes), reason, exc)


def log_by_kind(items: Iterable[tuple[str, str, Vm | None]], level: int = logging.INFO) -> None:
    """One log line per kind (a plan, a state) naming its nodes and VMs, not one line per node.

    A 1,000-node run otherwise writes thousands of lines that say the same thing, and each costs
    the interpreter lock while the calls' threads wait for it.
    """
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for kind, node, vm in items:
        nodes, vms = groups.setdefault(kind, ([], []))
        nodes.append(node)
        if vm is not None:
            vms.append(str(vm.id))
    for kind, (nodes, vms) in groups.items():
        log.log(level, "%s nodes=%s vms=%s", kind, fold(nodes), ",".join(vms) or "none")
