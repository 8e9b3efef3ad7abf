"""The contract suite's back ends: the simulator and a real oned (7.0.2, 7.4.0) behind one small interface.

A `Backend` gives the endpoint, the session, a pyone client and the few things a test needs that each side
offers differently: making boots fail or phases slow (the real dummy driver reads DIR/dummy_actions/<action>,
the simulator has faults and durations), the VM's OneGate token (oned keeps var/vms/<id>/token.txt, the
simulator keeps it in memory), a second user (one.user.allocate on oned, add_vm(uid=...) in the simulator), an
image (one.image.allocate in the dummy datastore, the handle's add_image). On a real oned the tests act as the
unprivileged user the docs make (`auth`) and oneadmin (`admin`) does what only an administrator may.
`clean()` puts the cloud back as the test found it: every VM made since `mark()` DONE, every GPU free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
import xmlrpc.client
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyone
from onedfix import RealOned

from opennebula_sim import Durations, SimConfig, TemplateSpec, default_hosts, running_simulator
from opennebula_sim.handle import Simulator
from slurm_nebula_power.model import ACTIVE, DONE, FAILURE_LCM, lcm_name, state_name

# The real instance's templates (tests/oned/onedctl.py), so both sides instantiate the same thing.
GPU_TEMPLATE = '''NAME = "slurm-gpu-worker"
CPU = "0.1"
VCPU = "1"
MEMORY = "128"
PCI = [ VENDOR = "10de", CLASS = "0302" ]
NIC = [ NETWORK = "slurm-net", NETWORK_UNAME = "oneadmin" ]
OS = [ ARCH = "x86_64" ]
CONTEXT = [ NETWORK = "YES", TOKEN = "YES", REPORT_READY = "YES", SET_HOSTNAME = "$NAME" ]
'''
CPU_TEMPLATE = GPU_TEMPLATE.replace("slurm-gpu-worker", "slurm-cpu-worker").replace(
    'PCI = [ VENDOR = "10de", CLASS = "0302" ]\n', "").replace('CPU = "0.1"', 'CPU = "0.05"').replace(
    'MEMORY = "128"', 'MEMORY = "64"')
GPUS = 4  # 4 hosts x 1 GPU on both sides

SIM_CONFIG = SimConfig(
    hosts=default_hosts(GPUS, 1), durations=Durations(0, 0, 0, 0),
    templates=(TemplateSpec(0, "slurm-gpu-worker", GPU_TEMPLATE), TemplateSpec(1, "slurm-cpu-worker", CPU_TEMPLATE)),
)

# The dummy VMM action each slowed phase waits for, and the simulator duration that stands for it.
SIM_DURATION = {"deploy": "boot", "restore": "boot", "shutdown": "shutdown", "cancel": "shutdown",
                "save": "shutdown"}
WAIT = 60.0  # bound of every wait (the real scheduler retries every 5 s; a GPU VM is placed within ~9 s)


def state_str(vm: Any) -> str:
    """oned's state_str: the LCM name when ACTIVE, else the STATE name."""
    return lcm_name(vm.LCM_STATE) if vm.STATE == ACTIVE else state_name(vm.STATE)


@dataclass
class Backend:
    """One cloud the contract runs against."""

    name: str  # "sim", "oned-7.0.2", "oned-7.4.0"
    endpoint: str
    auth: str  # the session the tests act as
    onegate: str  # OneGate's base URL (PUT {onegate}/vm)
    gpu_template: int
    cpu_template: int
    sim: Simulator | None = None
    oned: RealOned | None = None
    _mark: int = -1
    _users: list[int] = field(default_factory=list)
    _undo: list[Callable[[], object]] = field(default_factory=list)
    _quota_user: tuple[int, str] | None = None
    admin: str = ""  # oneadmin's session (users, quotas, hosts, chmod), "" for `auth`

    @property
    def one(self) -> pyone.OneServer:
        """A pyone client with the session."""
        return pyone.OneServer(self.endpoint, session=self.auth)

    @property
    def is_sim(self) -> bool:
        """The simulator rather than a real oned."""
        return self.sim is not None

    def raw(self, method: str, *args: Any, session: str | None = None) -> list[Any]:
        """The raw XML-RPC answer `[ok, value-or-message, code, ...]` of `method` (session prepended)."""
        proxy = xmlrpc.client.ServerProxy(self.endpoint)
        answer: list[Any] = getattr(proxy, method)(session or self.auth, *args)
        return answer

    def as_admin(self, method: str, *args: Any) -> list[Any]:
        """The raw answer of `method` called as oneadmin."""
        return self.raw(method, *args, session=self.admin or self.auth)

    def uid(self) -> int:
        """The id of the user the tests act as (one.user.info -1)."""
        ok, body, *_ = self.raw("one.user.info", -1)
        assert ok, body
        return int(ET.fromstring(body).findtext("ID") or -1)

    def administrator(self) -> bool:
        """The tests' user is oneadmin or of its group (RequestAttributes::is_admin: every object is its)."""
        ok, body, *_ = self.raw("one.user.info", -1)
        assert ok, body
        user = ET.fromstring(body)
        return user.findtext("ID") == "0" or "0" in [g.text for g in user.iterfind("GROUPS/ID")]

    def pool_text(self, who: int = -3, state: int = -1, extended: bool = True, session: str | None = None) -> str:
        """one.vmpool.infoextended (or .info) text, as the product reads it."""
        method = "one.vmpool.infoextended" if extended else "one.vmpool.info"
        ok, body, *_ = self.raw(method, who, -1, -1, state, session=session)
        assert ok, body
        return str(body)

    # ---- VMs ---------------------------------------------------------------------------------------
    def instantiate(self, template: int | None = None, name: str = "", hold: bool = False,
                    extra: str = "") -> int:
        """one.template.instantiate through pyone; the new VM's id."""
        tid = self.gpu_template if template is None else template
        return int(self.one.template.instantiate(tid, name, hold, extra, False))

    def vm(self, vm_id: int) -> Any:
        """one.vm.info through pyone."""
        return self.one.vm.info(vm_id)

    def wait(self, vm_id: int, until: str | Callable[[Any], bool], timeout: float = WAIT,
             interval: float = 0.02) -> tuple[Any, list[str]]:
        """Poll one.vm.info until `until` (a state_str, or a predicate on the pyone VM) holds: the VM and
        every state_str seen on the way, in order (each once per stay); AssertionError after `timeout` s."""
        check = until if callable(until) else (lambda vm: state_str(vm) == until)
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            vm = self.vm(vm_id)
            now = state_str(vm)
            if not seen or seen[-1] != now:
                seen.append(now)
            if check(vm):
                return vm, seen
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: VM {vm_id} not there within {timeout} s; seen {seen}")
            time.sleep(interval)

    def action(self, action: str, vm_id: int) -> list[Any]:
        """one.vm.action, raw answer (so refusals can be checked for code and text)."""
        return self.raw("one.vm.action", action, vm_id)

    def running(self, template: int | None = None, **kw: Any) -> int:
        """Instantiate and wait until RUNNING."""
        vm_id = self.instantiate(template, **kw)
        self.wait(vm_id, "RUNNING")
        return vm_id

    # ---- hosts -------------------------------------------------------------------------------------
    def gpus(self) -> dict[tuple[str, str], int]:
        """Every GPU (PCI class 03xx) of the host pool: (host name, SHORT_ADDRESS) -> VMID (-1 free)."""
        ok, body, *_ = self.as_admin("one.hostpool.info")
        assert ok, body
        out = {}
        for host in ET.fromstring(body).iterfind("HOST"):
            for pci in host.iterfind("HOST_SHARE/PCI_DEVICES/PCI"):
                if (pci.findtext("CLASS") or "").startswith("03"):
                    out[(host.findtext("NAME") or "", pci.findtext("SHORT_ADDRESS") or "")] = int(
                        pci.findtext("VMID") or "-1")
        return out

    def wait_gpus_free(self, timeout: float = WAIT) -> None:
        """Until no GPU is held."""
        deadline = time.monotonic() + timeout
        while True:
            held = self.gpus()
            if all(v == -1 for v in held.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: GPUs still held after {timeout} s: {held}")
            time.sleep(0.1)

    # ---- the guest ---------------------------------------------------------------------------------
    def token(self, vm_id: int) -> str:
        """The VM's OneGate token, as the context packages give it to the guest."""
        if self.sim is not None:
            with self.sim.cloud.lock:
                return self.sim.cloud.vms[vm_id].onegate_token
        assert self.oned is not None
        return (self.oned.root / "var" / "vms" / str(vm_id) / "token.txt").read_text().strip()

    def put_vm(self, vm_id: int, token: str, body: str, attempts: int = 3) -> int:
        """A guest's OneGate `PUT /vm`: the HTTP status.

        A PUT with no answer in 20 s is sent again, as a guest does (the worker's curl: --retry 3): in a full
        run the real OneGate 7.4.0 left a PUT unanswered for more than 15 s while the machine was starved
        (load 40-45, before tests/oned/start.sh stretched EXEC_VM).  Each such attempt is printed with what
        OneGate logged (its access log gives each request's own duration)."""
        request = urllib.request.Request(f"{self.onegate}/vm", data=body.encode(), method="PUT",
                                         headers={"X-ONEGATE-TOKEN": token, "X-ONEGATE-VMID": str(vm_id)})
        for attempt in range(1, attempts + 1):
            try:
                with urllib.request.urlopen(request, timeout=20) as answer:
                    return int(answer.status)
            except urllib.error.HTTPError as exc:
                return exc.code
            except (TimeoutError, urllib.error.URLError) as exc:
                if not isinstance(getattr(exc, "reason", exc), TimeoutError):
                    raise
                print(f"\nONEGATE-SLOW {self.name}: PUT /vm of VM {vm_id}, attempt {attempt} of {attempts}: no "
                      f"answer in 20 s; OneGate's log ends: {self.onegate_log(6)}")
        raise AssertionError(f"{self.name}: OneGate answered none of {attempts} PUTs in 20 s: {self.onegate_log(12)}")

    def onegate_log(self, lines: int) -> str:
        """The last `lines` of the real OneGate's log, one string (the simulator keeps none)."""
        if self.oned is None:
            return "(simulator)"
        try:
            text = (self.oned.root / "var" / "onegate.log").read_text(errors="replace")
        except OSError as exc:
            return f"(unreadable: {exc})"
        return " | ".join(text.strip().splitlines()[-lines:])

    # ---- faults ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def failing_boots(self) -> Iterator[None]:
        """Every deploy fails while inside (the VM lands in BOOT_FAILURE)."""
        if self.sim is not None:
            self.sim.set_faults(boot_failure_rate=1.0)
            try:
                yield
            finally:
                self.sim.set_faults(boot_failure_rate=0.0)
            return
        assert self.oned is not None
        switch = self.oned.dummy_actions / "deploy"
        switch.write_text("failure\n")
        try:
            yield
        finally:
            switch.unlink(missing_ok=True)

    @contextlib.contextmanager
    def slow(self, seconds: float, *actions: str) -> Iterator[None]:
        """The driver actions (deploy, shutdown, cancel, save, restore) take `seconds` while inside, so the
        states they belong to (BOOT*, SHUTDOWN*, SAVE_STOP) can be seen by polling."""
        if self.sim is not None:
            kinds = {SIM_DURATION[a] for a in actions}
            self.sim.set_durations(**dict.fromkeys(kinds, seconds))
            try:
                yield
            finally:
                self.sim.set_durations(**dict.fromkeys(kinds, 0.0))
            return
        assert self.oned is not None
        switches = [self.oned.dummy_actions / a for a in actions]
        for switch in switches:
            switch.write_text(f"success {seconds}\n")
        try:
            yield
        finally:
            for switch in switches:
                switch.unlink(missing_ok=True)

    # ---- users -------------------------------------------------------------------------------------
    def other_user(self, name: str, quota: str = "", groups: list[int] | None = None) -> tuple[int, str]:
        """A second user (by default of group oneadmin, so it may use the templates and the network), with a VM quota
        template such as `VM = [ RUNNING_VMS = "0" ]`: (uid, session). Real oned only; clean() deletes it."""
        password = "Contract-Pass-1"
        ok, uid, *rest = self.as_admin("one.user.allocate", name, password, "core", groups or [0])
        assert ok, (uid, rest)
        self._users.append(int(uid))
        if quota:
            ok, msg, *_ = self.as_admin("one.user.quota", int(uid), quota)
            assert ok, msg
        return int(uid), f"{name}:{password}"

    @contextlib.contextmanager
    def plain_user(self) -> Iterator[tuple[Backend, Callable[[str], None], Callable[[str], None]]]:
        """A user of group users, no administrator, as a back end of its own that may instantiate the
        templates, with grant(text) and grant_group(text) merging `text` into its user's or its group's
        TEMPLATE as oneadmin does (`oneuser update --append`, `onegroup update --append`)."""
        session = "contract-plain:Contract-Pass-2"
        if self.sim is None:
            assert self.oned is not None
            uid, session = self.other_user("contract-plain", groups=[1])
            for method, oid in (("one.template.chmod", self.gpu_template), ("one.template.chmod", self.cpu_template),
                                ("one.vn.chmod", 0)):
                assert self.as_admin(method, oid, -1, -1, -1, -1, -1, -1, 1, -1, -1)[0]  # others may use it
                self.cleanup(lambda m=method, o=oid: self.as_admin(m, o, -1, -1, -1, -1, -1, -1, 0, -1, -1))
            ok, body, *_ = self.as_admin("one.group.info", 1)
            assert ok, body
            found = ET.fromstring(body).find("TEMPLATE")
            before = ET.tostring(found if found is not None else ET.Element("TEMPLATE"), encoding="unicode")
            self.cleanup(lambda: self.as_admin("one.group.update", 1, before, 0))
            yield (dataclasses.replace(self, name=f"{self.name} (user {uid})", auth=session),
                   lambda text: self._ok("one.user.update", uid, text, 1),
                   lambda text: self._ok("one.group.update", 1, text, 1))
            return
        with running_simulator(SIM_CONFIG, auth=session) as sim:
            plain = sim_backend(sim)

            def attrs(text: str) -> dict[str, str]:
                key, _, value = text.partition("=")
                return {key.strip(): value.strip().strip('"')}

            yield (plain, lambda text: sim.set_user_template(**attrs(text)),
                   lambda text: sim.set_group_template(**attrs(text)))

    def enable_host(self, host: int) -> None:
        """onehost enable, then wait until it takes VMs again (an OFFLINE host is monitored anew first)."""
        self._ok("one.host.status", host, 0)
        deadline = time.monotonic() + WAIT
        while True:
            found = ET.fromstring(self.as_admin("one.host.info", host)[1])
            if found.findtext("STATE") == "2" and int(found.findtext("HOST_SHARE/MAX_CPU") or 0) > 0:
                return
            assert time.monotonic() < deadline, f"{self.name}: host {host} not MONITORED again after {WAIT} s"
            time.sleep(0.2)

    def _ok(self, method: str, *args: Any) -> None:
        ok, answer, *_ = self.as_admin(method, *args)
        assert ok, answer

    def quota_session(self, limit: str | None = 'VM = [ VMS = "0", RUNNING_VMS = "0" ]') -> str:
        """A session over its VM quota `limit` (None: no limit yet; called again, it sets the limit of the same
        user). On oned a second user (oneadmin is exempt from quotas); in the simulator its quota_exceeded
        fault (it has one user and no quotas)."""
        if self.sim is not None:
            self.sim.set_faults(quota_exceeded=limit is not None)
            return self.auth
        if self._quota_user is None:
            self._quota_user = self.other_user("contract-quota")
        uid, session = self._quota_user
        if limit is not None:
            ok, msg, *_ = self.as_admin("one.user.quota", uid, limit)
            assert ok, msg
        return session

    def image(self, name: str, admin: bool = False, shared: bool = False) -> int:
        """A READY image `name` of the tests' user (`admin`: of oneadmin, `shared`: others may USE it, `oneimage
        chmod`), in the dummy image datastore (1) on oned, from the handle in the simulator; its id."""
        if self.sim is not None:
            uid = 0 if admin else self.sim.api.user.uid
            return self.sim.add_image(name, uid=uid, other_use=shared)
        session = self.admin if admin and self.admin else self.auth
        ok, image_id, *rest = self.raw("one.image.allocate", f'NAME = "{name}"\nPATH = "/dev/null"\nSIZE = "1"', 1,
                                       False, session=session)
        assert ok, (image_id, rest)
        self.cleanup(lambda: self.raw("one.image.delete", image_id, False, session=session))
        deadline = time.monotonic() + WAIT
        while (state := ET.fromstring(self.raw("one.image.info", image_id, session=session)[1]).findtext(
                "STATE")) != "1":
            assert time.monotonic() < deadline, f"image {image_id} not READY: STATE {state}"
            time.sleep(0.2)
        if shared:
            self.share_image(int(image_id))
        return int(image_id)

    def share_image(self, image_id: int) -> None:
        """Others may USE the image (`oneimage chmod`, OTHER_U), as oneadmin does it."""
        if self.sim is not None:
            self.sim.set_use("image", image_id, other_use=True)
            return
        assert self.as_admin("one.image.chmod", image_id, -1, -1, -1, -1, -1, -1, 1, -1, -1)[0]

    def cleanup(self, undo: Callable[[], object]) -> None:
        """Run `undo` in clean(), after the VMs are gone (templates, images)."""
        self._undo.append(undo)

    def foreign_vm(self) -> int:
        """A running VM (no GPU) owned by another user of another group (uid N, group `users`)."""
        if self.sim is not None:
            return self.sim.add_vm(name="foreign", state="RUNNING", uid=7, template_id=self.cpu_template)
        uid, _ = self.other_user("contract-foreign", groups=[1])
        vm_id = self.running(self.cpu_template, name="foreign")
        ok, msg, *_ = self.as_admin("one.vm.chown", vm_id, uid, 1)
        assert ok, msg
        return vm_id

    # ---- cleanliness -------------------------------------------------------------------------------
    def mark(self) -> None:
        """Remember the newest VM id: clean() removes every VM newer than this."""
        ids = [int(e.findtext("ID") or -1) for e in ET.fromstring(self.pool_text(-2, -2, False, self.admin or None))]
        self._mark = max(ids, default=-1)

    def clean(self) -> None:
        """Every VM made since mark() DONE (terminate-hard, or recover --delete where that is refused), the
        GPUs free, the users deleted, the faults and slow phases off."""
        if self.oned is not None:
            for switch in self.oned.dummy_actions.glob("*"):
                switch.unlink(missing_ok=True)
        if self.sim is not None:
            self.sim.set_faults(boot_failure_rate=0.0, quota_exceeded=False)
            self.sim.set_durations(prolog=0, boot=0, shutdown=0, epilog=0)
        deadline = time.monotonic() + WAIT
        while True:
            text = self.pool_text(-2, -1, False, self.admin or None)  # every user's, the tests' others too
            live = [int(e.findtext("ID") or -1) for e in ET.fromstring(text)]
            live = [i for i in live if i > self._mark]
            if not live:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: VMs {live} not DONE after {WAIT} s")
            for vm_id in live:
                vm = pyone.OneServer(self.endpoint, session=self.admin or self.auth).vm.info(vm_id)
                if vm.STATE == ACTIVE and vm.LCM_STATE in FAILURE_LCM:
                    self.as_admin("one.vm.recover", vm_id, 3)
                elif vm.STATE != DONE:
                    self.as_admin("one.vm.action", "terminate-hard", vm_id)  # refused in BOOT and the like: again
            time.sleep(0.2)
        self.wait_gpus_free()
        while self._undo:
            self._undo.pop()()
        for uid in self._users:
            self.as_admin("one.user.delete", uid)
        self._users.clear()
        self._quota_user = None


def sim_backend(sim: Simulator) -> Backend:
    """The simulator as a back end."""
    return Backend("sim", sim.endpoint, sim.auth, sim.endpoint.removesuffix("/RPC2"), 0, 1, sim=sim, admin=sim.auth)


def oned_backend(oned: RealOned) -> Backend:
    """A real oned as a back end, acting as its unprivileged user (its templates looked up by name)."""
    proxy = xmlrpc.client.ServerProxy(oned.endpoint)
    ok, body, *_ = proxy.one.templatepool.info(oned.auth, -2, -1, -1)
    assert ok, body
    ids = {t.findtext("NAME"): int(t.findtext("ID") or -1) for t in ET.fromstring(body).iterfind("VMTEMPLATE")}
    return Backend(f"oned-{oned.version}", oned.endpoint, oned.auth, oned.onegate,
                   ids["slurm-gpu-worker"], ids["slurm-cpu-worker"], oned=oned, admin=getattr(oned, "admin", ""))
