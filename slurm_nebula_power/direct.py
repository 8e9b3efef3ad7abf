"""Direct placement (a node set's `placement = "direct"`): resume instantiates each VM on hold and deploys it
with enforce to a host it chose from the host pool it read (placement.py), instead of waiting for oned's
scheduler, its window and its placement plans of one VM per host.

The first VM of a node set in a run is awaited before the others are sent: its document says what the
template asks of a host (CPU, memory, PCI devices, the requirements oned derived from its networks'
clusters and the template's SCHED_REQUIREMENTS), and its deploy whether the user may deploy at all. oned
refuses a deploy with enforce to a host without room ("does not fit in host [3]. Unavailable PCI device.",
ACTION) or offline, and refuses a user without the right (AUTHORIZATION); the VM then goes to another host,
or is released to oned's scheduler: never left on hold, and a node never fails here while oned may
still place it. A template we cannot honour (VM groups, networks the scheduler picks, NUMA pinning, a
requirement we cannot evaluate), no host pool, or no right: the node set's VMs go to oned's scheduler as
with `placement = "scheduler"`, paced, and the log says why.

oned accepts a deploy to a DISABLED host (only OFFLINE is refused), and two deploys to the last free device
at once (its capacity test and its accounting are apart: the loser runs without the device, seen on 7.0.2):
the watch (resume.py) has a VM deployed to a host that left service meanwhile, or one without its device,
made again (displaced, booting.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass, field
from functools import partial

from .booting import Boot
from .config import NodeSet
from .errors import ActionRefused, CloudAuthError, CloudError, QuotaExceeded, VmNotFound, first_line
from .gate import Gate
from .hosts import Host, PciDevice, VmNeeds
from .operation import REASON_LENGTH, Context, timed
from .placement import Rooms, Unsupported, candidates, choose
from .plan import Plan, nodes_by_job

log = logging.getLogger(__name__)
STARTS = ("instantiate", "recreate", "release")  # plans whose VM direct placement deploys


@dataclass
class _Set:
    """One node set's direct placement in this run."""

    needs: VmNeeds | None = None  # from its first VM
    hosts: list[Host] = field(default_factory=list)  # the candidates
    fallback: str | None = None  # why its VMs go to oned's scheduler instead


class Direct:
    """One resume run's direct placements: the rooms of the hosts it read, and where each VM went."""

    def __init__(self, ctx: Context, gate: Gate, jobs: Mapping[str, Sequence[int]]) -> None:
        self.ctx = ctx
        self.gate = gate
        self.jobs = jobs
        self.rooms: Rooms | None = None
        self.placed: dict[int, int] = {}  # vm id -> host id, for the deploys oned accepted
        self._confirmed: set[int] = set()  # placed VMs whose host a later read saw still in service
        self._sets: dict[int, _Set] = {}  # id(nodeset) -> its state
        self._denied: str | None = None  # why no VM of this run is deployed by us: the user may not deploy
        self._reserved: dict[str, tuple[Host, list[PciDevice]]] = {}  # node -> host chosen before its call
        self._by_job: dict[int, Counter[int]] = {}  # job -> host id -> its VMs there
        self._left: Counter[tuple[int, int]] = Counter()  # (job, id(nodeset)) -> its nodes not placed yet
        for job, nodes in nodes_by_job(jobs).items():
            self._left.update((job, id(ns)) for n in nodes if (ns := ctx.config.nodeset_for(n)) is not None)
        self._chosen: set[str] = set()  # nodes placed once (a recreate is not counted again)
        self._diverted: set[str] = set()  # nodes no host of the read had room for: oned's scheduler's
        self._read = False
        self._lock = threading.RLock()

    # -- which nodes (main thread, and the pool for recreates) --

    def takes(self, boot: Boot, plan: Plan) -> bool:
        """This node's VM is deployed by us: its node set says direct, its plan makes or releases a VM, the
        host pool was read, and the node set has not been left to oned's scheduler in this run."""
        if boot.nodeset.placement != "direct" or plan.action not in STARTS:
            return False
        with self._lock:
            if not self._read:
                self._read = True
                hosts = self.gate.hosts()
                self.rooms = Rooms(hosts) if hosts else None
                if hosts is None:
                    log.warning("direct placement needs the host pool (see check): oned's scheduler places")
            return (self.rooms is not None and self._state(boot.nodeset).fallback is None
                    and boot.node not in self._diverted)

    def send(self, boot: Boot, plan: Plan, pool: Executor, start: Callable[[Boot, Plan], int]) -> bool:
        """Send one node (called in jobs-first order): its host is chosen now, then its call submitted; False
        when no host of the read has room for it (oned's scheduler gets it, paced, never a burst of releases).
        The calls of a node set wait for its first VM, which tells what they ask of a host and whether the
        user may deploy."""
        with self._lock:
            state = self._state(boot.nodeset)
            learning = state.needs is None
            if not learning and state.fallback is None:
                chosen = self._choose(boot, state)
                if chosen is None:
                    self._diverted.add(boot.node)
                    return False
                self._reserved[boot.node] = chosen
        boot.future = pool.submit(start, boot, plan)
        if learning:
            wait([boot.future])
        return True

    def _state(self, nodeset: NodeSet) -> _Set:
        return self._sets.setdefault(id(nodeset), _Set(fallback=self._denied))

    # -- one node (in the pool) --

    def start(self, boot: Boot, plan: Plan, template_id: int, extra: str) -> int:
        """Instantiate the node's VM on hold (or take its VM on hold), deploy it; the VM id."""
        ctx = self.ctx
        if plan.action == "release" and plan.vm is not None:
            vm_id = plan.vm.id
        else:
            vm_id = timed("instantiate", boot.node, None,
                          lambda: ctx.cloud.instantiate(template_id, boot.node, extra, hold=True))
            ctx.recorder.record("created", boot.node, vm_id=vm_id, jobs=self.jobs.get(boot.node, ()),
                                action="instantiate")
        try:
            self._place(boot, vm_id)
        except QuotaExceeded:
            timed("remove", boot.node, vm_id, lambda: ctx.cloud.action("terminate", vm_id))  # HOLD: DONE at once
            raise
        except CloudError as exc:
            self._release(boot, vm_id, f"deploy failed: {first_line(exc, REASON_LENGTH)}")
        except Exception:  # a bug: the run reports it (exit 4), but no VM of ours stays on hold
            with contextlib.suppress(CloudError):
                self._release(boot, vm_id, "an internal error while placing it")
            raise
        return vm_id

    def _place(self, boot: Boot, vm_id: int) -> None:
        state = self._learn(boot.nodeset, vm_id)
        if state.fallback is not None:
            self._release(boot, vm_id, state.fallback)
            return
        with self._lock:
            chosen = self._reserved.pop(boot.node, None) or self._choose(boot, state)
        while chosen is not None:
            host = chosen[0]
            try:
                timed(f"deploy host={host.name}", boot.node, vm_id, partial(self.ctx.cloud.deploy, vm_id, host.id))
                with self._lock:
                    self.placed[vm_id] = host.id
                return
            except QuotaExceeded:
                raise
            except CloudAuthError as exc:
                self._release(boot, vm_id, self._no_right(exc))
                return
            except ActionRefused as exc:
                if "not available for state" in str(exc):
                    return  # no longer on hold: a retried call placed it, or someone released it; the watch judges
                log.warning("node=%s vm=%d: host %s refused (%s); trying another", boot.node, vm_id, host.name,
                            first_line(exc, REASON_LENGTH))
            except VmNotFound as exc:
                if "virtual machine" in str(exc):  # oned: "Error getting virtual machine [N]."
                    return  # the VM is gone: the watch recreates it
                log.warning("node=%s vm=%d: host %s refused (%s); trying another", boot.node, vm_id, host.name,
                            first_line(exc, REASON_LENGTH))  # its host or its datastore is gone
            with self._lock:
                if self.rooms is not None:
                    self.rooms.drop(host.id)
                chosen = self._choose(boot, state)
        self._release(boot, vm_id, "no host in the host pool read has room for it")

    def _learn(self, nodeset: NodeSet, vm_id: int) -> _Set:
        """The node set's needs, from this VM's document if no VM of it told them yet."""
        with self._lock:
            state = self._state(nodeset)
            if state.needs is not None or state.fallback is not None:
                return state
        try:
            needs = self.ctx.cloud.vm_needs(vm_id)
        except CloudError as exc:
            with self._lock:
                state.fallback = f"its VM {vm_id} unreadable ({first_line(exc, REASON_LENGTH)})"
            return state
        with self._lock:
            if state.needs is None:
                state.needs = needs
                # a node set's domain is in the VM's SCHED_REQUIREMENTS (gate.placing), which candidates honours
                hosts = list(self.rooms.hosts.values()) if self.rooms is not None else []
                try:
                    state.hosts = candidates(hosts, needs)
                except (Unsupported, ValueError, RecursionError) as exc:  # bounded, but from OpenNebula
                    state.fallback = f"the template asks for {exc}, which only oned's scheduler honours"
                if not state.hosts and state.fallback is None:
                    state.fallback = f"no host of the {len(hosts)} the user sees takes VMs and meets its requirements"
                if state.fallback is None:
                    log.info("node set %s: direct placement on %d of %d hosts (requirements %r, %r)",
                             nodeset.nodes_expr, len(state.hosts), len(hosts), needs.requirements,
                             needs.sched_requirements)
                else:
                    log.warning("node set %s: %s: oned's scheduler places its VMs", nodeset.nodes_expr,
                                state.fallback)
            return state

    def _choose(self, boot: Boot, state: _Set) -> tuple[Host, list[PciDevice]] | None:
        """A host for the node (under the lock), reserved in the rooms; near its jobs' other VMs."""
        if self.rooms is None or state.needs is None:
            return None
        jobs = self.jobs.get(boot.node, ())
        near: Counter[int] = Counter()
        for job in jobs:
            near.update(self._by_job.get(job, {}))
        # the job's nodes of this node set still to place (its earliest job's), so that they go together
        want = self._left[(jobs[0], id(boot.nodeset))] if jobs else 1
        hosts = [h for h in state.hosts if h.id in self.rooms.hosts]
        chosen = choose(self.rooms, hosts, state.needs, near, max(want, 1))
        if chosen is not None:
            self.rooms.take(chosen[0].id, state.needs, chosen[1])
            for job in jobs:
                self._by_job.setdefault(job, Counter())[chosen[0].id] += 1
                if boot.node not in self._chosen:
                    self._left[(job, id(boot.nodeset))] -= 1
            self._chosen.add(boot.node)
        return chosen

    def displaced(self, boots: Sequence[Boot]) -> set[str]:
        """The nodes whose VM we deployed to a host that left service (DISABLED, OFFLINE, ERROR, gone) after we
        read the host pool: oned accepts a deploy to a DISABLED host, so each host a deploy went to is read
        once more after the deploy was answered (one.host.info: a burst packs its VMs on a host or two at a
        time; the host pool's document is 1.5 MB on 20 hosts of 60 GPUs); such a host takes nothing more."""
        with self._lock:
            mine = [b for b in boots if b.vm_id is not None and b.vm_id in self.placed
                    and b.vm_id not in self._confirmed]
            hosts = {self.placed[b.vm_id] for b in mine if b.vm_id is not None}
        gone: set[int] = set()
        for host_id in sorted(hosts):
            try:
                if not self.ctx.cloud.host(host_id).placeable:
                    gone.add(host_id)
            except VmNotFound:
                gone.add(host_id)  # deleted meanwhile
            except CloudError as exc:
                log.warning("host %d unreadable, its VMs' placement not confirmed yet: %s", host_id, exc)
                hosts.discard(host_id)
        with self._lock:
            confirmed = [b for b in mine if b.vm_id is not None and self.placed[b.vm_id] in hosts]
            self._confirmed.update(b.vm_id for b in confirmed if b.vm_id is not None)
            for host_id in gone:
                if self.rooms is not None:
                    self.rooms.drop(host_id)
            return {b.node for b in confirmed if b.vm_id is not None and self.placed[b.vm_id] in gone}

    def _no_right(self, exc: CloudError) -> str:
        """The user may not deploy: every node set of this run goes to oned's scheduler, those not met yet
        too (_state); the reason."""
        reason = f"user {self.ctx.config.opennebula.user} may not deploy ({first_line(exc, REASON_LENGTH)})"
        with self._lock:
            self._denied = self._denied or reason
            for state in self._sets.values():
                state.fallback = state.fallback or reason
        log.error("%s: oned's scheduler places the VMs of this run; `slurm-nebula-power check` says what to grant",
                  reason)
        return reason

    def _release(self, boot: Boot, vm_id: int, why: str) -> None:
        """Hand the VM on hold to oned's scheduler (never left on hold)."""
        log.info("node=%s vm=%d released to oned's scheduler: %s", boot.node, vm_id, why)
        try:
            timed("release", boot.node, vm_id, lambda: self.ctx.cloud.action("release", vm_id))
        except ActionRefused:
            pass  # no longer on hold (a deploy whose answer was lost took effect): the watch judges it
