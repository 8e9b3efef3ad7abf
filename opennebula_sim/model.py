"""The simulated objects: VMs, hosts with their PCI devices, and the IP lease pool."""

from __future__ import annotations

import heapq
import ipaddress
from dataclasses import dataclass, field

from opennebula_sim.config import HOST_STATES, HostSpec, NetworkSpec, PciDevice
from opennebula_sim.templates import Template


@dataclass
class History:
    """One HISTORY record: a stay on one host."""

    seq: int
    host_id: int
    hostname: str
    stime: int
    etime: int = 0
    pstime: int = 0
    petime: int = 0
    rstime: int = 0
    retime: int = 0
    estime: int = 0
    eetime: int = 0
    action: int = 0


@dataclass
class Lock:
    """A VM lock (one.vm.lock): level 1 USE, 2 MANAGE, 3 ADMIN, 4 ALL."""

    level: int
    time: int


@dataclass
class Vm:
    """A virtual machine as oned stores it, plus the simulator's bookkeeping."""

    id: int
    name: str
    uid: int
    gid: int
    uname: str
    gname: str
    template: Template
    user_template: Template
    stime: int
    state: int
    lcm: int = 0
    prev_state: int = 0
    prev_lcm: int = 0
    etime: int = 0
    resched: int = 0
    cpu_units: int = 0  # CPU * 100, oned's host share unit
    memory_kb: int = 0
    pci_requests: list[dict[str, str]] = field(default_factory=list)
    pci_held: list[str] = field(default_factory=list)  # host device short addresses
    ips: list[str] = field(default_factory=list)
    host_id: int | None = None  # the host whose CPU/memory/devices this VM holds
    history: list[History] = field(default_factory=list)
    lock: Lock | None = None
    stuck: bool = False  # fault injection: never leaves PENDING
    next_prolog: int = 0  # PROLOG, PROLOG_RESUME or PROLOG_UNDEPLOY at the next dispatch
    phase_seq: int = 0  # invalidates queued phase deadlines
    deadline: float = 0.0
    boot_attempts: int = 0
    onegate_token: str = ""  # with CONTEXT TOKEN=YES: what the guest's token.txt holds
    version: int = 0

    def touch(self) -> None:
        """Mark the VM changed so cached XML is rendered again."""
        self.version += 1


@dataclass
class Owned:
    """A virtual network or an image: its owner and who else may USE it (OTHER_U, or an ACL rule for a group,
    `oneacl create "@GID NET/#ID USE"`); oneadmin and the oneadmin group may use everything."""

    id: int
    name: str
    uid: int
    other_use: bool = True
    acl_gids: set[int] = field(default_factory=set)

    def usable_by(self, uid: int, gid: int) -> bool:
        """What PoolSQL's filter -2 lists for this user, and what USE authorises."""
        return uid == 0 or gid == 0 or uid == self.uid or self.other_use or gid in self.acl_gids


@dataclass
class PciSlot:
    """A host PCI device and the VM holding it (-1 = free), as HOST_SHARE/PCI_DEVICES shows it."""

    spec: PciDevice
    vmid: int = -1

    @property
    def address(self) -> str:
        """The full PCI address as oned's host probes report it: `0000:41:00:0` (domain:bus:slot:function, a
        colon before the function where SHORT_ADDRESS has a dot)."""
        return "0000:" + self.spec.short_address.replace(".", ":")

    def matches(self, request: dict[str, str]) -> bool:
        """HostSharePCI's rule: every given VENDOR/DEVICE/CLASS (hex) or SHORT_ADDRESS must match."""
        if request.get("SHORT_ADDRESS"):
            return request["SHORT_ADDRESS"].lower() == self.spec.short_address.lower()
        mine = {"VENDOR": self.spec.vendor, "DEVICE": self.spec.device, "CLASS": self.spec.klass}
        for key, have in mine.items():
            wanted = request.get(key, "")
            if wanted and int(wanted, 16) != int(have, 16):
                return False
        return True


@dataclass
class Host:
    """A hypervisor and its allocated share."""

    id: int
    name: str
    max_cpu: int
    max_mem: int
    pci: list[PciSlot]
    used_cpu: int = 0
    used_mem: int = 0
    vms: set[int] = field(default_factory=set)
    version: int = 0
    state: int = HOST_STATES["MONITORED"]
    prev_state: int = HOST_STATES["MONITORED"]
    attributes: dict[str, str] = field(default_factory=dict)  # HOST/TEMPLATE beyond the monitor's

    @classmethod
    def from_spec(cls, host_id: int, spec: HostSpec) -> Host:
        """A host with all its devices free."""
        state = HOST_STATES[spec.state]
        return cls(host_id, spec.name, spec.cpu, spec.memory_kb, [PciSlot(p) for p in spec.pci], state=state,
                   prev_state=state, attributes=dict(spec.attributes))

    def template(self) -> dict[str, str]:
        """HOST/TEMPLATE: what the monitor reports, and the attributes `onehost update` set."""
        return {"ARCH": "x86_64", "HOSTNAME": self.name, "HYPERVISOR": "kvm", "IM_MAD": "kvm", "VM_MAD": "kvm",
                **self.attributes}

    def requirement_view(self) -> dict[str, str]:
        """What SCHED_REQUIREMENTS see of this host: its top-level elements and its TEMPLATE."""
        return {**self.template(), "ID": str(self.id), "NAME": self.name, "STATE": str(self.state),
                "CLUSTER_ID": "0", "CLUSTER": "default"}

    @property
    def takes_vms(self) -> bool:
        """oned 7.x's scheduler places VMs only on MONITORED hosts (SchedulerManagerDriver: "state = 2");
        DISABLED, OFFLINE, ERROR and INIT hosts keep the VMs they have."""
        return self.state == HOST_STATES["MONITORED"]

    def fit(self, vm: Vm) -> list[PciSlot] | None:
        """The devices `vm` would get here, or None when CPU, memory or a matching free device is missing."""
        if self.used_cpu + vm.cpu_units > self.max_cpu or self.used_mem + vm.memory_kb > self.max_mem:
            return None
        chosen: list[PciSlot] = []
        for request in vm.pci_requests:
            free = (s for s in self.pci if s.vmid == -1 and s not in chosen and s.matches(request))
            slot = next(free, None)
            if slot is None:
                return None
            chosen.append(slot)
        return chosen

    def shortage(self, vm: Vm) -> str:
        """What `vm` lacks here (the scheduler's first failed test): CPU, MEMORY or PCI."""
        if self.used_cpu + vm.cpu_units > self.max_cpu:
            return "CPU"
        if self.used_mem + vm.memory_kb > self.max_mem:
            return "MEMORY"
        return "PCI"

    def take(self, vm: Vm, slots: list[PciSlot]) -> None:
        """Reserve CPU, memory and devices for `vm`."""
        self.used_cpu += vm.cpu_units
        self.used_mem += vm.memory_kb
        for slot in slots:
            slot.vmid = vm.id
        self.vms.add(vm.id)
        vm.host_id = self.id
        vm.pci_held = [s.spec.short_address for s in slots]
        self.version += 1

    def give_back(self, vm: Vm) -> None:
        """Free what `vm` holds here (end of terminate, undeploy, stop)."""
        self.used_cpu -= vm.cpu_units
        self.used_mem -= vm.memory_kb
        for slot in self.pci:
            if slot.vmid == vm.id:
                slot.vmid = -1
        self.vms.discard(vm.id)
        vm.host_id = None
        self.version += 1


class IpPool:
    """Leases from one address range, lowest free address first, as an oned address range does."""

    def __init__(self, spec: NetworkSpec) -> None:
        net = ipaddress.ip_network(spec.cidr, strict=False)
        edge = 1 if net.num_addresses > 2 else 0  # as net.hosts(): no network or broadcast address
        self.first = int(net.network_address) + edge
        self.size = net.num_addresses - 2 * edge
        self.spec = spec
        self.network = net
        # Offsets from _next on were never leased; _released (a heap) holds those given back, all below
        # _next, so its top is the lowest free one.  Nothing is built per address: a /10 starts at once.
        self._next = 0
        self._released: list[int] = []
        self.used: dict[str, int] = {}

    def lease(self, vm_id: int) -> str | None:
        """The lowest free address, or None when the range is exhausted."""
        if self._released:
            offset = heapq.heappop(self._released)
        elif self._next < self.size:
            offset, self._next = self._next, self._next + 1
        else:
            return None
        ip = str(ipaddress.IPv4Address(self.first + offset))
        self.used[ip] = vm_id
        return ip

    def release(self, ip: str) -> None:
        """Give `ip` back to the range."""
        if self.used.pop(ip, None) is not None:
            heapq.heappush(self._released, int(ipaddress.IPv4Address(ip)) - self.first)

    @property
    def free(self) -> int:
        """How many addresses are left."""
        return len(self._released) + self.size - self._next


def mac_for(ip: str) -> str:
    """oned's default MAC: the 02:00 prefix followed by the IPv4 address in hex."""
    return "02:00:" + ":".join(f"{int(octet):02x}" for octet in ip.split("."))
