"""The simulated cloud: allocation, the scheduler, phase timing and host resources, under one lock.

Every method whose name does not start with `locked_` takes the lock itself; the `locked_` ones expect the
caller (the RPC layer or the handle) to hold it.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from opennebula_sim import states as S
from opennebula_sim.config import Durations, Faults, SimConfig
from opennebula_sim.messages import NO_HOSTS_TEXT, STUCK_TEXT, ctime, sched_text, version_at_least
from opennebula_sim.model import History, Host, IpPool, Owned, PciSlot, Vm
from opennebula_sim.requirements import RequirementError, matches
from opennebula_sim.states import OneError
from opennebula_sim.templates import Template, merge, parse_template, vectors
from opennebula_sim.vmbuild import (
    BuildError,
    assign_pci,
    build_vm_templates,
    strip_pci_assignment,
)

_BOOT_FAILS_TO = {
    S.BOOT: (S.ACTIVE, S.BOOT_FAILURE), S.BOOT_STOPPED: (S.ACTIVE, S.BOOT_STOPPED_FAILURE),
    S.BOOT_UNDEPLOY: (S.ACTIVE, S.BOOT_UNDEPLOY_FAILURE), S.BOOT_POWEROFF: (S.POWEROFF, S.LCM_INIT),
    S.BOOT_SUSPENDED: (S.SUSPENDED, S.LCM_INIT), S.BOOT_UNKNOWN: (S.ACTIVE, S.UNKNOWN),
}
_NEXT = {
    S.PROLOG: S.BOOT, S.PROLOG_RESUME: S.BOOT_STOPPED, S.PROLOG_UNDEPLOY: S.BOOT_UNDEPLOY,
    S.SHUTDOWN: S.EPILOG, S.SHUTDOWN_UNDEPLOY: S.EPILOG_UNDEPLOY, S.SAVE_STOP: S.EPILOG_STOP,
}


@dataclass(frozen=True)
class HookEvent:
    """A VM reached RUNNING ("running") or left it ("stopped")."""

    kind: str
    vm_id: int
    name: str
    ip: str
    context: dict[str, str]
    token: str = ""  # the VM's OneGate token (CONTEXT TOKEN=YES), as the context packages' TOKENTXT


@dataclass(frozen=True)
class User:
    """Who a session belongs to."""

    uid: int
    gid: int
    uname: str
    gname: str


ONEADMIN = User(0, 0, "oneadmin", "oneadmin")


class Cloud:
    """VMs, hosts, leases and time; the single source of truth behind the XML-RPC API and the handle."""

    def __init__(self, cfg: SimConfig, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.monotonic = monotonic
        self.lock = threading.RLock()
        self.hosts = [Host.from_spec(i, spec) for i, spec in enumerate(cfg.hosts)]
        self.templates = {t.id: (t, parse_template(t.body)) for t in cfg.templates}
        self.regtime = int(clock())
        self.vms: dict[int, Vm] = {}
        self.ips = IpPool(cfg.network)
        self.durations: Durations = cfg.durations
        self.faults: Faults = cfg.faults
        self.authorized = True
        self.onegate_endpoint = ""  # set by the server once bound: where PUT /vm (OneGate) is served
        self.next_id = 0
        self.events: list[HookEvent] = []
        self._pending: set[int] = set()
        self._new_pending: list[int] = []  # joined PENDING since the last pass
        self._sched_dirty = True  # capacity was freed: every pending VM gets another look
        self._heap: list[tuple[float, int, int, int]] = []
        self._heap_count = 0
        self.stalled_until = 0.0  # monotonic: the scheduler places nothing before (locked_stall_placement)
        self.user_templates: dict[int, dict[str, str]] = {}  # uid -> USER/TEMPLATE (VM_*_OPERATIONS...)
        self.session_user: User | None = None  # the RPC layer's user, beside oneadmin and the userN of add_vm
        net = cfg.network
        self.networks = {net.id: Owned(net.id, net.name, net.uid, net.other_use)}  # all lease from self.ips
        self.images = {i.id: Owned(i.id, i.name, i.uid, i.other_use) for i in cfg.images}
        self.group_templates: dict[int, dict[str, str]] = {}  # gid -> GROUP/TEMPLATE

    # ------------------------------------------------------------------ allocation
    def locked_allocate(self, template_id: int, name: str, hold: bool, extra: Template, user: User,
                        state: int = S.PENDING, networks: list[tuple[int, str]] | None = None) -> Vm:
        """Create a VM from a template merged with `extra`; its IPs are leased now, as oned does. `networks`: the
        (id, name) each NIC resolved to (opennebula_sim.pools), else the one network."""
        if template_id not in self.templates:
            raise OneError(S.NO_EXISTS, "", template_id, obj="virtual machine template")
        spec, base = self.templates[template_id]
        vm_id = self.next_id
        vm_name = name or f"{spec.name}-{vm_id}"
        try:
            built = build_vm_templates(base, extra, vm_id, vm_name, template_id, user.uid, user.uname,
                                       self.ips, self.onegate_endpoint if self.cfg.onegate else None,
                                       routes=version_at_least(self.cfg.version, 7, 4), networks=networks)
        except BuildError as exc:
            raise OneError(S.ALLOCATE, str(exc), obj="virtual machine") from None
        self.next_id += 1
        vm = Vm(id=vm_id, name=vm_name, uid=user.uid, gid=user.gid, uname=user.uname, gname=user.gname,
                template=built.template, user_template=built.user_template, stime=int(self.clock()),
                state=S.INIT, cpu_units=built.cpu_units, memory_kb=built.memory_kb,
                pci_requests=built.pci_requests, ips=built.ips)
        vm.stuck = self._draw("stuck", vm.id, 0) < self.faults.stuck_pending_rate
        if any(c.get("TOKEN", "").upper() == "YES" for c in vectors(vm.template, "CONTEXT")):
            vm.onegate_token = secrets.token_hex(16)
        self.vms[vm_id] = vm
        self.locked_set_state(vm, S.HOLD if hold else state)
        return vm

    def _draw(self, what: str, vm_id: int, attempt: int) -> float:
        # One generator per decision: repeatable for a given seed whatever order threads ask in.
        return random.Random(f"{self.cfg.seed}:{what}:{vm_id}:{attempt}").random()  # noqa: S311 - a simulation

    # ------------------------------------------------------------------ state changes
    def locked_set_state(self, vm: Vm, state: int, lcm: int = S.LCM_INIT, at: float | None = None) -> None:
        """Move `vm` to (state, lcm): records PREV_*, queues hook events, phase deadlines and scheduling."""
        was_running = vm.state == S.ACTIVE and vm.lcm == S.RUNNING
        vm.prev_state, vm.prev_lcm = vm.state, vm.lcm
        vm.state, vm.lcm = state, lcm
        vm.phase_seq += 1
        vm.touch()
        now = self.clock()
        running = state == S.ACTIVE and lcm == S.RUNNING
        if running and not was_running:
            if vm.history:
                vm.history[-1].rstime = int(now)
            self.events.append(self._event("running", vm))
        elif was_running and not running:
            if vm.history:
                vm.history[-1].retime = int(now)
            self.events.append(self._event("stopped", vm))
        if state == S.ACTIVE and lcm in S.PHASE_KIND:
            start = self.monotonic() if at is None else at
            vm.deadline = start + getattr(self.durations, S.PHASE_KIND[lcm])
            self._heap_count += 1
            heapq.heappush(self._heap, (vm.deadline, self._heap_count, vm.id, vm.phase_seq))
        if state == S.PENDING and not vm.stuck:
            self._pending.add(vm.id)
            self._new_pending.append(vm.id)
        else:
            self._pending.discard(vm.id)
        if state == S.PENDING and vm.stuck:
            self._sched_message(vm, now, STUCK_TEXT)

    def _event(self, kind: str, vm: Vm) -> HookEvent:
        context = next((v for v in vm.template.get("CONTEXT", ()) if isinstance(v, dict)), {})
        return HookEvent(kind, vm.id, vm.name, vm.ips[0] if vm.ips else "", dict(context), vm.onegate_token)

    def locked_update_user_template(self, vm: Vm, tmpl: Template, merge_it: bool) -> None:
        """one.vm.update: replace USER_TEMPLATE (type 0) or merge into it (type 1, as OneGate's PUT /vm)."""
        replaced = {key: list(values) for key, values in tmpl.items()}
        vm.user_template = merge(vm.user_template, tmpl) if merge_it else replaced
        vm.touch()

    def locked_release_host(self, vm: Vm) -> None:
        """Free the host share `vm` holds (end of terminate, undeploy, stop; delete-recreate; delete)."""
        if vm.host_id is not None:
            self.hosts[vm.host_id].give_back(vm)
            strip_pci_assignment(vm.template, vm.pci_requests)
            vm.pci_held = []
            if vm.history and not vm.history[-1].etime:
                vm.history[-1].etime = int(self.clock())
            self._sched_dirty = True

    def locked_capacity_changed(self) -> None:
        """Something may fit now that did not (a host enabled): the scheduler looks at every pending VM."""
        self._sched_dirty = True

    def locked_done(self, vm: Vm) -> None:
        """DispatchManager::free_vm_resources: host share and leases go back, the VM is DONE."""
        self.locked_release_host(vm)
        for ip in vm.ips:
            self.ips.release(ip)
        vm.etime = int(self.clock())
        if vm.history and vm.history[-1].estime and not vm.history[-1].eetime:
            vm.history[-1].eetime = vm.etime
        self.locked_set_state(vm, S.DONE)

    def locked_record_action(self, vm: Vm, action: str) -> None:
        """Note the action that ends the VM's current stay (HISTORY/ACTION)."""
        if vm.history:
            vm.history[-1].action = S.HISTORY_ACTION.get(action, 0)

    # ------------------------------------------------------------------ time
    def tick(self) -> list[HookEvent]:
        """Schedule pending VMs and end every phase whose time is up; return the hook events to run."""
        with self.lock:
            now = self.monotonic()
            self._schedule(now)
            while self._heap and self._heap[0][0] <= now:
                deadline, _, vm_id, seq = heapq.heappop(self._heap)
                vm = self.vms[vm_id]
                if vm.phase_seq == seq and vm.state == S.ACTIVE:
                    self._finish_phase(vm, deadline)
                self._schedule(now)
            events, self.events = self.events, []
        return events

    def _finish_phase(self, vm: Vm, at: float) -> None:
        if vm.lcm == S.LCM_INIT:  # dispatched: the prolog of its kind starts
            prolog, vm.next_prolog = vm.next_prolog or S.PROLOG, 0
            self.locked_set_state(vm, S.ACTIVE, prolog, at=at)
            return
        self.locked_complete(vm, vm.lcm, at, can_fail=True)

    def locked_complete(self, vm: Vm, lcm: int, at: float | None = None, can_fail: bool = False) -> None:
        """End phase `lcm` of `vm` successfully (or, for boots with `can_fail`, maybe as a boot failure)."""
        at = self.monotonic() if at is None else at
        wall = int(self.clock())
        stay = vm.history[-1] if vm.history else None
        if lcm in (S.PROLOG, S.PROLOG_RESUME, S.PROLOG_UNDEPLOY) and stay:
            stay.petime = wall
        if lcm in _BOOT_FAILS_TO:
            vm.boot_attempts += 1
            if can_fail and self._draw("boot", vm.id, vm.boot_attempts) < self.faults.boot_failure_rate:
                vm.user_template["ERROR"] = [f"{ctime(self.clock())}: DEPLOY: Error deploying virtual machine"]
                self.locked_set_state(vm, *_BOOT_FAILS_TO[lcm], at=at)
            else:
                self.locked_set_state(vm, S.ACTIVE, S.RUNNING, at=at)
        elif lcm in _NEXT:
            if _NEXT[lcm] in (S.EPILOG, S.EPILOG_UNDEPLOY, S.EPILOG_STOP) and stay:
                stay.estime = wall
            self.locked_set_state(vm, S.ACTIVE, _NEXT[lcm], at=at)
        elif lcm == S.SHUTDOWN_POWEROFF:
            self.locked_set_state(vm, S.POWEROFF, at=at)
        elif lcm == S.SAVE_SUSPEND:
            self.locked_set_state(vm, S.SUSPENDED, at=at)
        elif lcm in (S.EPILOG, S.CLEANUP_DELETE):
            self.locked_done(vm)
        elif lcm in (S.EPILOG_UNDEPLOY, S.EPILOG_STOP):
            if stay:
                stay.eetime = wall
            self.locked_release_host(vm)
            vm.next_prolog = S.PROLOG_UNDEPLOY if lcm == S.EPILOG_UNDEPLOY else S.PROLOG_RESUME
            self.locked_set_state(vm, S.UNDEPLOYED if lcm == S.EPILOG_UNDEPLOY else S.STOPPED, at=at)
        elif lcm == S.CLEANUP_RESUBMIT:
            self.locked_release_host(vm)
            vm.next_prolog = S.PROLOG
            self.locked_set_state(vm, S.PENDING, at=at)

    # ------------------------------------------------------------------ scheduler
    def locked_stall_placement(self) -> None:
        """A VM the scheduler was deploying was deleted: nothing is placed for cfg.action_timeout seconds."""
        if self.cfg.action_timeout > 0:
            self.stalled_until = max(self.stalled_until, self.monotonic() + self.cfg.action_timeout)

    def _schedule(self, now: float) -> None:
        if now < self.stalled_until:
            return  # the placement plan is "already in progress"; pending VMs keep their SCHED_MESSAGE
        # VMs already pending failed to fit before and capacity only shrank since, unless something was freed:
        # then everything pending is looked at again, oldest first, as oned's scheduler orders by id.
        if self._sched_dirty:
            candidates = sorted(self._pending)
        elif self._new_pending:
            candidates = sorted(i for i in set(self._new_pending) if i in self._pending)
        else:
            return
        self._sched_dirty = False
        self._new_pending = []
        failed: dict[tuple[object, ...], str] = {}
        for vm_id in candidates:
            vm = self.vms[vm_id]
            wanted = vm.user_template.get("SCHED_REQUIREMENTS") or [""]
            requirements = wanted[0] if isinstance(wanted[0], str) else ""
            need = (vm.cpu_units, vm.memory_kb, tuple(tuple(sorted(r.items())) for r in vm.pci_requests),
                    requirements)
            if need not in failed:
                hosts, problem = self._matching(requirements)
                shortages: dict[int, str] = {}
                for host in hosts:
                    slots = host.fit(vm) if host.takes_vms else None
                    if slots is not None:
                        self._deploy(vm, host, slots, now)
                        break
                    shortages[host.id] = host.shortage(vm)
                else:
                    failed[need] = problem or sched_text(self.cfg.version, shortages)
            if vm.state == S.PENDING:
                self._sched_message(vm, self.clock(), failed[need])

    def _matching(self, requirements: str) -> tuple[list[Host], str]:
        """The hosts SCHED_REQUIREMENTS let the scheduler try, or why none (oned's SchedulerManagerDriver:
        a host that takes VMs must meet them, else `No host meets SCHED_REQUIREMENTS`)."""
        if not requirements.strip():
            return self.hosts, ""
        try:
            hosts = [h for h in self.hosts if matches(requirements, h.requirement_view())]
        except RequirementError as exc:
            return [], f"Cannot dispatch VM: Error in SCHED_REQUIREMENTS: '{requirements}', error: {exc}"
        if not any(h.takes_vms for h in hosts) and any(h.takes_vms for h in self.hosts):
            return [], "Cannot dispatch VM: No host meets SCHED_REQUIREMENTS"
        return hosts, ""

    def _sched_message(self, vm: Vm, now: float, text: str) -> None:
        if not any(h.takes_vms for h in self.hosts):  # every host disabled, offline or in error
            text = NO_HOSTS_TEXT
        message = f"{ctime(now)}: {text}"
        if vm.user_template.get("SCHED_MESSAGE") != [message]:  # oned refreshes it at every pass
            vm.user_template["SCHED_MESSAGE"] = [message]
            vm.touch()

    def locked_deploy(self, vm: Vm, host: Host, slots: list[PciSlot | None]) -> None:
        """one.vm.deploy: the VM leaves PENDING, HOLD, STOPPED or UNDEPLOYED for `host`, holding the given
        devices (None: an entry no free device served, deployed without enforce)."""
        self._deploy(vm, host, slots, self.monotonic())

    def _deploy(self, vm: Vm, host: Host, slots: list[PciSlot] | list[PciSlot | None], now: float) -> None:
        host.take(vm, [slot for slot in slots if slot is not None])
        assign_pci(vm.template, slots)
        vm.user_template.pop("SCHED_MESSAGE", None)
        wall = int(self.clock())
        vm.history.append(History(seq=len(vm.history), host_id=host.id, hostname=host.name, stime=wall,
                                  pstime=wall))
        # oned's dispatch makes the VM ACTIVE/LCM_INIT; its prolog starts when the LCM takes the deploy (the
        # next tick here)
        vm.next_prolog = vm.next_prolog or S.PROLOG
        self.locked_set_state(vm, S.ACTIVE, S.LCM_INIT, at=now)
        self._heap_count += 1
        heapq.heappush(self._heap, (now + 1e-9, self._heap_count, vm.id, vm.phase_seq))

    def locked_place(self, vm: Vm, host_name: str | None) -> Host:
        """Give `vm` a host share directly (the handle's add_vm of a VM that already runs somewhere)."""
        candidates = [h for h in self.hosts if host_name in (None, h.name)]
        if not candidates:
            raise ValueError(f"no host named {host_name!r}")
        for host in candidates:
            slots = host.fit(vm)
            if slots is not None:
                self._deploy(vm, host, slots, self.monotonic())
                return host
        raise ValueError(f"no capacity for VM {vm.id} on {host_name or 'any host'}")

    # ------------------------------------------------------------------ runtime knobs
    def set_faults(self, **changes: object) -> None:
        """Change any subset of the fault settings."""
        with self.lock:
            if "transient_kinds" in changes:
                changes["transient_kinds"] = tuple(changes["transient_kinds"])  # type: ignore[arg-type]
            faults = dataclasses.replace(self.faults, **changes)  # type: ignore[arg-type]
            SimConfig(faults=faults)  # validates ranges and kinds before anything changes
            self.faults = faults

    def set_durations(self, **changes: float) -> None:
        """Change phase durations; phases already running keep their deadline."""
        with self.lock:
            durations = dataclasses.replace(self.durations, **changes)
            SimConfig(durations=durations)
            self.durations = durations

    def vm_counts(self) -> dict[str, int]:
        """VMs per state_str (LCM name when ACTIVE), as sim.stats reports them."""
        counts: dict[str, int] = {}
        with self.lock:
            for vm in self.vms.values():
                key = S.state_str(vm.state, vm.lcm)
                counts[key] = counts.get(key, 0) + 1
        return counts

    def user_for(self, uid: int) -> User:
        """The user a uid names (oneadmin is 0, the session's user its own; others are userN of group `users`)."""
        if uid == 0:
            return ONEADMIN
        if self.session_user is not None and uid == self.session_user.uid:
            return self.session_user
        return User(uid, 1, f"user{uid}", "users")

    def uid_of(self, uname: str) -> int | None:
        """The uid of a user name (oneadmin, the session's user, userN), None for a user that does not exist."""
        if uname == "oneadmin":
            return 0
        if self.session_user is not None and uname == self.session_user.uname:
            return self.session_user.uid
        digits = uname.removeprefix("user")
        return int(digits) if uname.startswith("user") and digits.isascii() and digits.isdigit() else None
