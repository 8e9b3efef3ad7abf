"""What every layer shares and nothing external: a VM, oned's states and their names, our tags, and the
parser of oned's pool documents. No pyone here: status, planning and the tests read VMs without it.
"""

from __future__ import annotations

import ipaddress
import re
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from xml.parsers import expat

# VM STATE numbers (include/VirtualMachine.h, VmState)
INIT, PENDING, HOLD, ACTIVE, STOPPED, SUSPENDED, DONE = 0, 1, 2, 3, 4, 5, 6
POWEROFF, UNDEPLOYED, CLONING, CLONING_FAILURE = 8, 9, 10, 11
STATE_NAMES = {INIT: "INIT", PENDING: "PENDING", HOLD: "HOLD", ACTIVE: "ACTIVE", STOPPED: "STOPPED",
               SUSPENDED: "SUSPENDED", DONE: "DONE", POWEROFF: "POWEROFF", UNDEPLOYED: "UNDEPLOYED",
               CLONING: "CLONING", CLONING_FAILURE: "CLONING_FAILURE"}
# The states a VM is switched off in (its disks kept): resume brings it back with one.vm.resume.
OFF_STATES = (POWEROFF, UNDEPLOYED, STOPPED, SUSPENDED)

# LCM_STATE numbers (include/VirtualMachine.h, LcmState), 0..71 in order.
LCM_NAMES = dict(enumerate("""LCM_INIT PROLOG BOOT RUNNING MIGRATE SAVE_STOP SAVE_SUSPEND SAVE_MIGRATE
PROLOG_MIGRATE PROLOG_RESUME EPILOG_STOP EPILOG SHUTDOWN CANCEL FAILURE CLEANUP_RESUBMIT UNKNOWN HOTPLUG
SHUTDOWN_POWEROFF BOOT_UNKNOWN BOOT_POWEROFF BOOT_SUSPENDED BOOT_STOPPED CLEANUP_DELETE HOTPLUG_SNAPSHOT
HOTPLUG_NIC HOTPLUG_SAVEAS HOTPLUG_SAVEAS_POWEROFF HOTPLUG_SAVEAS_SUSPENDED SHUTDOWN_UNDEPLOY EPILOG_UNDEPLOY
PROLOG_UNDEPLOY BOOT_UNDEPLOY HOTPLUG_PROLOG_POWEROFF HOTPLUG_EPILOG_POWEROFF BOOT_MIGRATE BOOT_FAILURE
BOOT_MIGRATE_FAILURE PROLOG_MIGRATE_FAILURE PROLOG_FAILURE EPILOG_FAILURE EPILOG_STOP_FAILURE
EPILOG_UNDEPLOY_FAILURE PROLOG_MIGRATE_POWEROFF PROLOG_MIGRATE_POWEROFF_FAILURE PROLOG_MIGRATE_SUSPEND
PROLOG_MIGRATE_SUSPEND_FAILURE BOOT_UNDEPLOY_FAILURE BOOT_STOPPED_FAILURE PROLOG_RESUME_FAILURE
PROLOG_UNDEPLOY_FAILURE DISK_SNAPSHOT_POWEROFF DISK_SNAPSHOT_REVERT_POWEROFF DISK_SNAPSHOT_DELETE_POWEROFF
DISK_SNAPSHOT_SUSPENDED DISK_SNAPSHOT_REVERT_SUSPENDED DISK_SNAPSHOT_DELETE_SUSPENDED DISK_SNAPSHOT
DISK_SNAPSHOT_REVERT DISK_SNAPSHOT_DELETE PROLOG_MIGRATE_UNKNOWN PROLOG_MIGRATE_UNKNOWN_FAILURE DISK_RESIZE
DISK_RESIZE_POWEROFF DISK_RESIZE_UNDEPLOYED HOTPLUG_NIC_POWEROFF HOTPLUG_RESIZE HOTPLUG_SAVEAS_UNDEPLOYED
HOTPLUG_SAVEAS_STOPPED BACKUP BACKUP_POWEROFF RESTORE""".split()))
LCM_INIT, PROLOG, BOOT, RUNNING_LCM, UNKNOWN_LCM = 0, 1, 2, 3, 16
# On its way to RUNNING (LCM_INIT, PROLOG, BOOT).
STARTING_LCM = (LCM_INIT, PROLOG, BOOT)
FAILURE_LCM = frozenset(number for number, name in LCM_NAMES.items() if name.endswith("FAILURE"))
# A deploy the scheduler dispatched, from dispatch to RUNNING (first boot, and the way back from UNDEPLOYED
# or STOPPED): oned's placement plan waits for its answer. Deleting the VM now (recover --delete) leaves
# the plan's action unanswered until ACTION_TIMEOUT (300 s stock) and no later plan is taken meanwhile.
DEPLOYING_LCM = frozenset(number for number, name in LCM_NAMES.items() if name in (
    "LCM_INIT", "PROLOG", "BOOT", "PROLOG_UNDEPLOY", "BOOT_UNDEPLOY", "PROLOG_RESUME", "BOOT_STOPPED"))

# Tags we put into every VM's USER_TEMPLATE: identity is NAME plus these.
TAG_CLUSTER = "SLURM_CLUSTER"
TAG_NODE = "SLURM_NODENAME"
TAG_JOBS = "SLURM_JOB_IDS"
TAG_MANAGER = "SLURM_NEBULA_POWER"
# SCHED_MESSAGEs of VMs a placement plan left for a later one, seen on free GPUs (bench/README.md, "Real
# oned"): 7.4.0's dispatch limits; 7.0.2's for the same (its text, cut short by oned, also names System DS
# capacity) and before the system datastore's first monitoring.  A real GPU shortage reads "Cannot
# allocate VM. Not enough capacity in hosts 0,1" (7.0.2) or "[HOST] Unavailable PCI devices" (7.4.0).
DISPATCH_WAITS = ("Dispatch limit reached on hosts",
                  "Possible reasons: Not enough capacity in Host or System DS, dispatch",
                  "No system datastores found to run VMs")


_CTIME = re.compile(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} ?: ")  # oned's prefix of SCHED_MESSAGE
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: str) -> str:
    """Text from outside (OpenNebula's answers, a guest's updates) made safe for one log line or one Slurm
    Reason: control characters, newlines included, become escapes, so no line or record can be forged."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


_JOB_ID = re.compile(r"[0-9]{1,10}")  # ASCII digits only: str.isdigit() takes '²', which int() refuses
MOST_JOB_IDS = 64  # job ids kept per VM (a node is resumed for a handful of jobs at once)


def parse_job_ids(text: str) -> tuple[int, ...]:
    """A comma-separated list of Slurm job ids (uint32), strictly: anything else in it is left out."""
    ids = []
    for part in text[:MOST_JOB_IDS * 12].split(",")[:MOST_JOB_IDS]:
        part = part.strip()
        if _JOB_ID.fullmatch(part) and int(part) < 1 << 32:
            ids.append(int(part))
    return tuple(ids)


_NUMBER = re.compile(r"-?[0-9]{1,18}")


def number(text: str | None, default: int, what: str) -> int:
    """An integer field of an oned document, strictly (ASCII digits, bounded); ValueError naming the field
    otherwise, never the value (a rewritten answer may carry anything)."""
    text = (text or "").strip()
    if not text:
        return default
    if not _NUMBER.fullmatch(text):
        raise ValueError(f"{what} is not a number")
    return int(text)


def cell(text: str, length: int = 64) -> str:
    """A table cell of text from outside (a host name, an address): printable, and cut past `length`, so
    no value can forge a row of `status` or `usage` or push its columns off the screen."""
    text = printable(text)
    return text if len(text) <= length else text[:length - 3] + "..."


_ADDRESS_CHARS = re.compile(r"[0-9A-Fa-f.:]{2,45}")


def valid_ip(text: str | None) -> bool:
    """An IPv4 or IPv6 address as slurmctld takes it for NodeAddr (nothing else: no list, no brackets)."""
    if not text or not _ADDRESS_CHARS.fullmatch(text):  # no IPv6 scope (%eth0): it may hold anything
        return False
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def lcm_name(lcm: int) -> str:
    """LCM_STATE number -> oned's name."""
    return LCM_NAMES.get(lcm, f"LCM_{lcm}")


def state_name(state: int) -> str:
    """STATE number -> oned's name."""
    return STATE_NAMES.get(state, f"STATE_{state}")


GPU_VENDORS = ("10de", "1002")  # NVIDIA, AMD: a PCI device of theirs without CLASS is taken as a GPU


_DECLARATION = re.compile(r"<!(?:DOCTYPE|ENTITY)", re.IGNORECASE)


def no_declaration(*_: object) -> None:
    """An expat handler for DOCTYPE and ENTITY declarations: ValueError, before any entity is defined."""
    raise ValueError("a DOCTYPE, which oned never sends")


def refuse_doctype(text: str) -> None:
    """ValueError when a document declares a DOCTYPE: oned's never do, and its entities would expand far past
    the answer's size bound (a 457 KB answer took a resume to 1.6 GB). The words inside a CDATA value a guest
    wrote are text, not a declaration: only a document holding them is scanned by expat, which stops at the
    first declaration, before any entity is defined."""
    if not _DECLARATION.search(text):
        return
    parser = expat.ParserCreate()
    parser.StartDoctypeDeclHandler = no_declaration
    parser.EntityDeclHandler = no_declaration
    try:
        parser.Parse(text, True)
    except expat.ExpatError:
        pass  # malformed without a declaration: the parse that follows says so

@dataclass(frozen=True)
class Pci:
    """One TEMPLATE/PCI device of a VM as oned assigned it (ADDRESS and SHORT_ADDRESS once deployed), or a
    template's PCI entry (what it asks for)."""

    address: str = ""
    short_address: str = ""
    vendor: str = ""
    device: str = ""
    klass: str = ""
    profile: str = ""  # vGPU / MIG profile
    type: str = ""  # "NIC" for an SR-IOV network function (not a GPU)

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> Pci:
        """A template's PCI entry (a dict of its attributes) as a Pci."""
        return cls(address=str(entry.get("ADDRESS", "")), short_address=str(entry.get("SHORT_ADDRESS") or ""),
                   vendor=str(entry.get("VENDOR", "")), device=str(entry.get("DEVICE", "")),
                   klass=str(entry.get("CLASS", "")), profile=str(entry.get("PROFILE") or ""),
                   type=str(entry.get("TYPE", "")))

    @property
    def is_gpu(self) -> bool:
        """A GPU: not TYPE=NIC, and CLASS 03xx, a vGPU PROFILE or a GPU vendor; one exact device by address."""
        if self.type.upper() == "NIC":
            return False
        vendor = self.vendor.lower()
        if self.klass.startswith("03") or self.profile or (not self.klass and vendor in GPU_VENDORS):
            return True
        # one exact device by address: what passthrough of a GPU looks like
        return not self.klass and not vendor and bool(self.short_address)

    @property
    def assigned(self) -> bool:
        """oned gave the VM a host device (the host's share holds it)."""
        return bool(self.address)


@dataclass(frozen=True)
class Vm:
    """What the programs need to know of one VM."""

    id: int
    name: str
    state: int
    lcm_state: int
    ip: str | None = None
    host: str | None = None
    stime: int = 0
    user_template: Mapping[str, str] = field(default_factory=dict)
    context: Mapping[str, str] = field(default_factory=dict)  # TEMPLATE/CONTEXT (not USER_TEMPLATE/CONTEXT)
    pci: tuple[Pci, ...] = ()

    @property
    def gpus(self) -> tuple[Pci, ...]:
        """The VM's GPUs (TEMPLATE/PCI entries that are GPUs: Pci.is_gpu)."""
        return tuple(p for p in self.pci if p.is_gpu)

    @property
    def job_ids(self) -> tuple[int, ...]:
        """The job ids resume started the VM for: TEMPLATE/CONTEXT's SLURM_JOB_IDS, set at instantiate.

        Never USER_TEMPLATE's copy: a guest rewrites that through OneGate (SLURM_JOB_IDS=² once made every
        suspend of its node set exit 4), and the usage records bill by these ids. A VM made by an earlier
        version has them only there: it has none."""
        return parse_job_ids(self.context.get(TAG_JOBS, ""))

    @property
    def state_name(self) -> str:
        """STATE in words, LCM_STATE too when ACTIVE (e.g. ACTIVE/BOOT_FAILURE)."""
        name = state_name(self.state)
        return f"{name}/{lcm_name(self.lcm_state)}" if self.state == ACTIVE else name

    @property
    def failed(self) -> bool:
        """In a failure state: it will not come up without help."""
        return self.state == CLONING_FAILURE or (self.state == ACTIVE and self.lcm_state in FAILURE_LCM)

    @property
    def running(self) -> bool:
        """ACTIVE and RUNNING."""
        return self.state == ACTIVE and self.lcm_state == RUNNING_LCM

    @property
    def starting(self) -> bool:
        """PENDING, HOLD, or ACTIVE on its way to RUNNING."""
        return self.state in (PENDING, HOLD) or (self.state == ACTIVE and self.lcm_state in STARTING_LCM)

    @property
    def transient(self) -> bool:
        """ACTIVE in a state a driver ends by itself (BOOT, PROLOG, SHUTDOWN...): oned refuses to terminate it."""
        return self.state == ACTIVE and self.lcm_state not in (RUNNING_LCM, UNKNOWN_LCM) and not self.failed

    @property
    def deploying(self) -> bool:
        """Being deployed by the scheduler (DEPLOYING_LCM): recover --delete now stalls oned's placements."""
        return self.state == ACTIVE and self.lcm_state in DEPLOYING_LCM

    @property
    def without_devices(self) -> bool:
        """Deployed (past LCM_INIT) with a PCI entry oned gave no host device: it accepted two deploys to the
        last free device at once (the capacity test and the accounting are apart; seen on 7.0.2), or a
        deploy without enforce to a full host, and this VM runs without its GPU."""
        deployed = self.state == ACTIVE and (self.lcm_state == RUNNING_LCM or (
            self.lcm_state in DEPLOYING_LCM and self.lcm_state != LCM_INIT))
        return deployed and any(not p.assigned for p in self.pci)

    @property
    def off(self) -> bool:
        """Switched off with its disks kept (POWEROFF, UNDEPLOYED, STOPPED, SUSPENDED)."""
        return self.state in OFF_STATES

    @property
    def ready(self) -> bool:
        """The guest reported READY=YES through OneGate."""
        return str(self.user_template.get("READY", "")).upper() == "YES"

    @property
    def sched_message(self) -> str:
        """oned's scheduler message (why a PENDING VM is not placed), if any."""
        return str(self.user_template.get("SCHED_MESSAGE", ""))

    @property
    def oned_message(self) -> str:
        """The SCHED_MESSAGE without oned's date prefix ("Mon Nov 30 10:00:00 2026: Cannot ..."), shortened."""
        lines = _CTIME.sub("", self.sched_message.strip()).splitlines()
        return printable(lines[0][:120]) if lines else "no message"

    @property
    def unplaceable(self) -> bool:
        """PENDING with a SCHED_MESSAGE saying oned could not place it (capacity, PCI, ...).

        oned's scheduler also marks the VMs a plan left out only for its dispatch limits (MAX_HOST in
        schedulers/rank.conf, MAX_ACTIONS_PER_CLUSTER in oned.conf), e.g. 7.4's "[HOST] Dispatch limit
        reached on hosts: 0,1,...": those wait for a later plan (DISPATCH_WAITS); no shortage."""
        message = self.sched_message
        return self.state == PENDING and bool(message) and not any(w in message for w in DISPATCH_WAITS)

    def is_ours(self, cluster: str, node: str) -> bool:
        """Identity, from what a guest cannot write: NAME is the node AND the CONTEXT set at instantiate names
        this cluster and node (TEMPLATE/CONTEXT; OneGate writes only USER_TEMPLATE).

        Never USER_TEMPLATE: a VM instantiated by hand from the printed template has the node in CONTEXT and
        no cluster there, and its guest could write the cluster into USER_TEMPLATE and make the VM the
        node's (the rule kept for 0.1.0's VMs, which is gone: docs/upgrading.md)."""
        return self.name == node and self.context.get(TAG_NODE) == node and self.context.get(TAG_CLUSTER) == cluster

    def is_impostor(self, cluster: str, nodes: Container[str]) -> bool:
        """Named like one of our nodes but failing identity, and not another cluster's by its CONTEXT: a VM
        made by hand, or one a guest detached. Reported by status and reconcile, never acted on."""
        if self.name not in nodes or self.state == DONE or self.is_ours(cluster, self.name):
            return False
        return self.context.get(TAG_CLUSTER) in (None, cluster)


def ours_by_node(vms: Iterable[Vm], cluster: str, nodes: Iterable[str]) -> dict[str, list[Vm]]:
    """Our live VMs for these nodes (identity: name and tags), by node."""
    wanted = set(nodes)
    found: dict[str, list[Vm]] = defaultdict(list)
    for vm in vms:
        if vm.name in wanted and vm.state != DONE and vm.is_ours(cluster, vm.name):
            found[vm.name].append(vm)
    return found


# ---- oned's pool documents --------------------------------------------------------------------------


def vms_from_xml(text: str) -> list[Vm]:
    """Parse a VM_POOL (or one VM) document with ElementTree.

    pyone's generated bindings cost about 0.4 ms per VM; a 1,000-VM pool (3 MB of full bodies) is
    read while resume watches its VMs boot, so pool documents are parsed here instead (same fields),
    walking each VM's children once rather than searching it path by path.
    """
    root = ET.fromstring(text)
    return [_vm_from_element(vm) for vm in ([root] if root.tag == "VM" else root.iterfind("VM"))]


_VM_FIELDS = frozenset(("ID", "NAME", "STATE", "LCM_STATE", "STIME"))
_PCI_FIELDS = {"ADDRESS": "address", "SHORT_ADDRESS": "short_address", "VENDOR": "vendor", "DEVICE": "device",
               "CLASS": "klass", "PROFILE": "profile", "TYPE": "type"}


def pci_from_element(element: ET.Element) -> Pci:
    """One TEMPLATE/PCI element of a VM document as a Pci."""
    values = {_PCI_FIELDS[item.tag]: (item.text or "").strip() for item in element if item.tag in _PCI_FIELDS}
    return Pci(**values)


def _vm_from_element(vm: ET.Element) -> Vm:
    fields: dict[str, str] = {}
    ip: str | None = None
    host: str | None = None
    tags: dict[str, str] | None = None
    context: dict[str, str] | None = None
    pci: list[Pci] = []
    for child in vm:
        tag = child.tag
        if tag in _VM_FIELDS:
            fields.setdefault(tag, child.text or "")
        elif tag == "TEMPLATE":
            # the first TEMPLATE/NIC/IP in document order, as findtext would give it
            for nic in child.iterfind("NIC"):
                ip = ip or nic.findtext("IP") or None
            # by its full path: a guest's OneGate update lands as USER_TEMPLATE/CONTEXT, never here
            found = child.find("CONTEXT")
            if found is not None and context is None:
                context = {item.tag: item.text or "" for item in found if len(item) == 0}
            # TEMPLATE/PCI by its full path: a guest can write USER_TEMPLATE (OneGate), never TEMPLATE
            pci.extend(pci_from_element(item) for item in child.iterfind("PCI"))
        elif tag == "USER_TEMPLATE" and tags is None:
            tags = {item.tag: item.text or "" for item in child if len(item) == 0}
        elif tag == "HISTORY_RECORDS":
            for name in child.iterfind("HISTORY/HOSTNAME"):
                host = name.text or None  # the last record is where the VM is (or was)
    return Vm(id=number(fields.get("ID"), -1, "VM/ID"), name=fields.get("NAME") or "",
              state=number(fields.get("STATE"), 0, "VM/STATE"),
              lcm_state=number(fields.get("LCM_STATE"), 0, "VM/LCM_STATE"),
              ip=ip, host=host, stime=number(fields.get("STIME"), 0, "VM/STIME"), user_template=tags or {},
              context=context or {}, pci=tuple(pci))
