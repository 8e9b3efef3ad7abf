"""The in-process handle: start the simulator on a loopback port, inspect it and steer it from tests."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from opennebula_sim import states as S
from opennebula_sim.cloud import Cloud
from opennebula_sim.config import HOST_STATES, SimConfig
from opennebula_sim.hooks import HookRunner
from opennebula_sim.hostapi import host_update
from opennebula_sim.model import Lock, Owned, Vm
from opennebula_sim.rpc import Api
from opennebula_sim.server import RpcServer
from opennebula_sim.templates import Template, to_plain

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VmSnapshot:
    """A VM as it was when the snapshot was taken."""

    id: int
    name: str
    uid: int
    gid: int
    state: int
    lcm_state: int
    state_name: str
    lcm_name: str
    state_str: str
    host: str | None
    ip: str | None
    ips: tuple[str, ...]
    user_template: dict[str, Any]
    template: dict[str, Any]
    pci: tuple[str, ...]
    stime: int
    etime: int
    locked: bool
    resched: int


@dataclass(frozen=True)
class HostSnapshot:
    """A host's share: totals, what is free, and which VM holds each PCI device (None = free)."""

    id: int
    name: str
    state: str
    gpus_total: int
    gpus_free: int
    devices: dict[str, int | None]
    gpu_holders: dict[str, int | None]
    cpu_total: int
    cpu_free: int
    memory_total_kb: int
    memory_free_kb: int
    vms: tuple[int, ...]


class Simulator:
    """A running simulator: its endpoint and the knobs tests turn."""

    def __init__(self, cfg: SimConfig | None = None, auth: str = "oneadmin:secret", host: str = "127.0.0.1",
                 port: int = 0, list_order: str = "DESC", log_requests: bool = False) -> None:
        if ":" not in auth:
            raise ValueError("auth must be user:password")
        self.cfg = cfg or SimConfig()
        self.auth = auth
        self.cloud = Cloud(self.cfg)
        self.api = Api(self.cloud, auth, list_order)
        self.server = RpcServer(self.cloud, self.api, host, port, log_requests)
        self.hooks = HookRunner(self.cfg.on_running, self.cfg.on_stopped)
        self._stop_ticking = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="sim-tick", daemon=True)
        self.server.set_hang(self.cfg.faults.hang)

    @property
    def endpoint(self) -> str:
        """`http://127.0.0.1:PORT/RPC2`."""
        host, port = self.server.address
        return f"http://{host}:{port}/RPC2"

    def start(self) -> Simulator:
        """Start ticking, hooks and serving; calls are accepted when this returns."""
        self.hooks.start()
        self._ticker.start()
        self.server.start()
        return self

    def stop(self) -> None:
        """Stop serving, ticking and hooks."""
        self.server.stop()
        self._stop_ticking.set()
        self._ticker.join(5)
        self.hooks.stop()

    def _tick_loop(self) -> None:
        while not self._stop_ticking.is_set():
            try:
                events = self.cloud.tick()
                if events and self.hooks.enabled:
                    self.hooks.submit(events)
            except Exception:  # a simulator bug must show, and time must keep going
                log.exception("simulator tick failed")
            self._stop_ticking.wait(self.cfg.tick_seconds)

    # ------------------------------------------------------------------ inspection
    def stats(self) -> dict[str, Any]:
        """The same dict as the sim.stats XML-RPC method."""
        return self.server.stats()

    def reset_stats(self) -> None:
        """Zero the call counters."""
        self.server.reset_stats()

    def vms(self) -> list[VmSnapshot]:
        """Every VM, DONE ones included, by id."""
        with self.cloud.lock:
            return [self._snap(vm) for _, vm in sorted(self.cloud.vms.items())]

    def vm(self, vm_id: int) -> VmSnapshot:
        """One VM; KeyError when it does not exist."""
        with self.cloud.lock:
            return self._snap(self.cloud.vms[vm_id])

    def _snap(self, vm: Vm) -> VmSnapshot:
        host = self.cloud.hosts[vm.host_id].name if vm.host_id is not None else None
        return VmSnapshot(
            id=vm.id, name=vm.name, uid=vm.uid, gid=vm.gid, state=vm.state, lcm_state=vm.lcm,
            state_name=S.STATE_NAMES.get(vm.state, str(vm.state)),
            lcm_name=S.LCM_NAMES.get(vm.lcm, str(vm.lcm)),
            state_str=S.state_str(vm.state, vm.lcm), host=host, ip=vm.ips[0] if vm.ips else None,
            ips=tuple(vm.ips), user_template=to_plain(vm.user_template), template=to_plain(vm.template),
            pci=tuple("0000:" + a.replace(".", ":") for a in vm.pci_held), stime=vm.stime, etime=vm.etime,
            locked=vm.lock is not None, resched=vm.resched,
        )

    def hosts(self) -> list[HostSnapshot]:
        """Every host with its free share and device holders."""
        with self.cloud.lock:
            out = []
            for h in self.cloud.hosts:
                devices = {s.address: (s.vmid if s.vmid >= 0 else None) for s in h.pci}
                # PCI class 03xx is a display controller: a GPU
                gpus = {s.address: devices[s.address] for s in h.pci if s.spec.klass.startswith("03")}
                out.append(HostSnapshot(
                    id=h.id, name=h.name, state=_host_state_name(h.state), gpus_total=len(gpus),
                    gpus_free=sum(v is None for v in gpus.values()),
                    devices=devices, gpu_holders=gpus, cpu_total=h.max_cpu, cpu_free=h.max_cpu - h.used_cpu,
                    memory_total_kb=h.max_mem, memory_free_kb=h.max_mem - h.used_mem,
                    vms=tuple(sorted(h.vms)),
                ))
            return out

    def wait_for(self, predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.01) -> T:
        """Poll `predicate()` until it returns something truthy; return it, or raise TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            result = predicate()
            if result:
                return result
            if time.monotonic() >= deadline:
                raise TimeoutError(f"simulator condition not met within {timeout} s")
            time.sleep(interval)

    # ------------------------------------------------------------------ steering
    def set_faults(self, **changes: Any) -> None:
        """Change any of latency_ms, latency_jitter_ms, transient_rate, transient_kinds, boot_failure_rate,
        stuck_pending_rate, hang, quota_exceeded, allocate_failure."""
        self.cloud.set_faults(**changes)
        self.server.set_hang(self.cloud.faults.hang)

    def set_durations(self, **changes: float) -> None:
        """Change any of prolog, boot, shutdown, epilog (seconds, 0 allowed)."""
        self.cloud.set_durations(**changes)

    def set_host_state(self, name: str, state: str) -> None:
        """`onehost disable` (DISABLED), `onehost offline` (OFFLINE), `onehost enable` (MONITORED), or ERROR
        or INIT: only a MONITORED host takes new VMs; the VMs a host has keep running."""
        if state not in HOST_STATES:
            raise ValueError(f"unknown host state {state!r}; one of {', '.join(HOST_STATES)}")
        with self.cloud.lock:
            host = next((h for h in self.cloud.hosts if h.name == name), None)
            if host is None:
                raise ValueError(f"no host named {name!r}")
            host.prev_state, host.state = host.state, HOST_STATES[state]
            host.version += 1
            self.cloud.locked_capacity_changed()

    def set_host_attributes(self, name: str, **attributes: str) -> None:
        """`onehost update NAME` merging these attributes into HOST/TEMPLATE (NVLINK_DOMAIN="a", ...)."""
        host = next((h for h in self.cloud.hosts if h.name == name), None)
        if host is None:
            raise ValueError(f"no host named {name!r}")
        text = "\n".join(f'{key} = "{value}"' for key, value in attributes.items())
        host_update(self.cloud, self.api.user, host.id, text, 1)

    def after_call(self, method: str, action: Callable[[], None]) -> None:
        """Run `action` once right after the next successful call of `method` (e.g. "one.hostpool.info"):
        another user acting between two of the client's calls, such as taking the GPU it just counted."""
        self.api.after_call(method, action)

    def set_user_template(self, **attrs: str) -> None:
        """Merge attributes into the session user's TEMPLATE, as oneadmin's `oneuser update --append` does:
        VM_MANAGE_OPERATIONS="deploy" lets a plain user deploy its VMs (opennebula_sim.deploy)."""
        with self.cloud.lock:
            self.cloud.user_templates.setdefault(self.api.user.uid, {}).update(attrs)

    def set_group_template(self, **attrs: str) -> None:
        """Merge attributes into the TEMPLATE of the session user's group (`onegroup update --append`)."""
        with self.cloud.lock:
            self.cloud.group_templates.setdefault(self.api.user.gid, {}).update(attrs)

    def add_network(self, name: str, uid: int = 0, other_use: bool = True) -> int:
        """A virtual network of user `uid` (0: oneadmin; its NICs lease from the one address range); its id."""
        return self._add(self.cloud.networks, name, uid, other_use)

    def add_image(self, name: str, uid: int = 0, other_use: bool = True) -> int:
        """A READY image of user `uid` (0: oneadmin); its id."""
        return self._add(self.cloud.images, name, uid, other_use)

    def _add(self, objects: dict[int, Owned], name: str, uid: int, other_use: bool) -> int:
        with self.cloud.lock:
            if any(o.name == name and o.uid == uid for o in objects.values()):
                raise ValueError(f"user {uid} already owns one named {name!r}")
            oid = max(objects, default=-1) + 1
            objects[oid] = Owned(oid, name, uid, other_use)
            return oid

    def set_use(self, kind: str, oid: int, other_use: bool | None = None, grant_gid: int | None = None,
                uid: int | None = None) -> None:
        """Who may use network or image `oid` (kind "network" or "image"): OTHER_U (`onevnet chmod`), an ACL rule
        for a group (`oneacl create "@GID NET/#ID USE"`), its owner (`onevnet chown`)."""
        with self.cloud.lock:
            obj = (self.cloud.networks if kind == "network" else self.cloud.images)[oid]
            if other_use is not None:
                obj.other_use = other_use
            if grant_gid is not None:
                obj.acl_gids.add(grant_gid)
            if uid is not None:
                obj.uid = uid

    def set_authorized(self, authorized: bool) -> None:
        """When False every authenticated call fails with AUTHORIZATION (0x200)."""
        self.cloud.authorized = authorized

    def lock_vm(self, vm_id: int, level: int = 1) -> None:
        """Lock a VM as `onevm lock` does: actions and recover then fail with LOCKED (0x8000)."""
        with self.cloud.lock:
            vm = self.cloud.vms[vm_id]
            vm.lock = Lock(level, int(self.cloud.clock()))
            vm.touch()

    def unlock_vm(self, vm_id: int) -> None:
        """Undo lock_vm."""
        with self.cloud.lock:
            vm = self.cloud.vms[vm_id]
            vm.lock = None
            vm.touch()

    def add_vm(self, name: str = "", user_template: dict[str, str] | None = None, state: str = "RUNNING",
               uid: int = 0, template_id: int = 0, host: str | None = None,
               context: dict[str, str] | None = None) -> int:
        """Inject a VM already in `state` (a STATE or an LCM name), holding host resources as such a VM would.

        Its user_template keys are given as an instantiate extra template would give them; a context
        replaces the template's CONTEXT, as an instantiate's CONTEXT does. No hook runs for it.
        """
        extra: Template = {k.upper(): [str(v)] for k, v in (user_template or {}).items()}
        if context is not None:
            extra["CONTEXT"] = [{k.upper(): str(v) for k, v in context.items()}]
        with self.cloud.lock:
            vm = self.cloud.locked_allocate(template_id, name, False, extra, self.cloud.user_for(uid),
                                            state=S.INIT)
            try:
                self._force(vm, state, host)
            except ValueError:  # no such state or no room: the VM never existed
                for ip in vm.ips:
                    self.cloud.ips.release(ip)
                del self.cloud.vms[vm.id]
                raise
            self.cloud.events = [e for e in self.cloud.events if e.vm_id != vm.id]
            return vm.id

    def fail_vm(self, vm_id: int, lcm: str = "BOOT_FAILURE") -> None:
        """Force an ACTIVE LCM state (default BOOT_FAILURE) on a VM, giving it a host first if it has none."""
        if lcm not in S.LCM_BY_NAME:
            raise ValueError(f"unknown LCM state {lcm!r}")
        with self.cloud.lock:
            vm = self.cloud.vms[vm_id]
            if vm.state == S.DONE:
                raise ValueError(f"VM {vm_id} is DONE")
            self._force(vm, lcm, None)

    def _force(self, vm: Vm, state: str, host: str | None) -> None:
        cloud = self.cloud
        if state in ("PENDING", "HOLD"):
            cloud.locked_set_state(vm, S.STATE_BY_NAME[state])
        elif state in ("STOPPED", "UNDEPLOYED"):
            cloud.locked_release_host(vm)
            vm.next_prolog = S.PROLOG_RESUME if state == "STOPPED" else S.PROLOG_UNDEPLOY
            cloud.locked_set_state(vm, S.STATE_BY_NAME[state])
        elif state == "DONE":
            cloud.locked_done(vm)
        elif state in ("POWEROFF", "SUSPENDED") or state in S.LCM_BY_NAME:
            if vm.host_id is None:
                cloud.locked_place(vm, host)
                vm.history[-1].rstime = vm.history[-1].pstime
            if state in ("POWEROFF", "SUSPENDED"):
                cloud.locked_set_state(vm, S.STATE_BY_NAME[state])
            else:
                cloud.locked_set_state(vm, S.ACTIVE, S.LCM_BY_NAME[state])
        else:
            raise ValueError(f"unknown VM state {state!r}")


def _host_state_name(state: int) -> str:
    return next(name for name, number in HOST_STATES.items() if number == state)


@contextlib.contextmanager
def running_simulator(cfg: SimConfig | None = None, auth: str = "oneadmin:secret", host: str = "127.0.0.1",
                      port: int = 0, list_order: str = "DESC") -> Iterator[Simulator]:
    """Run a simulator on a free loopback port for the duration of the `with` block."""
    sim = Simulator(cfg, auth, host, port, list_order).start()
    try:
        yield sim
    finally:
        sim.stop()
