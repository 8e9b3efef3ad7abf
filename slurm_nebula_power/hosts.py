"""Hosts and their PCI devices as the host pool document shows them, and what a VM asks of a host (its own
document): what capacity counts and resume places on. No pyone here, as in model.py (whose strict number
parser the host pool's fields go through)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field

from .model import Pci, number, pci_from_element

# ---- hosts and their PCI devices --------------------------------------------------------------------

# HOST STATE numbers (include/Host.h, HostState; 7.x keeps 1, 5, 6 and 7 only as comments).
HOST_STATE_NAMES = {0: "INIT", 1: "MONITORING_MONITORED", 2: "MONITORED", 3: "ERROR", 4: "DISABLED",
                    5: "MONITORING_ERROR", 6: "MONITORING_INIT", 7: "MONITORING_DISABLED", 8: "OFFLINE"}
# The states a host takes new VMs in: oned 7.x's scheduler asks for "state = 2"
# (src/schedm/SchedulerManagerDriver.cc); 6.x's also took MONITORING_MONITORED (HostPoolXML.h: STATE=1 or 2).
PLACEABLE_HOST_STATES = (1, 2)
MOST_ATTRIBUTES = 256  # HOST/TEMPLATE attributes kept per host (a monitored host has a few dozen)
ATTRIBUTE_LENGTH = 256  # characters kept of one (KVM_CPU_MODELS runs to a few hundred; ours are short)


@dataclass(frozen=True)
class PciDevice:
    """One PCI device of a host (HOST_SHARE/PCI_DEVICES/PCI) and the VM holding it (-1: free)."""

    short_address: str
    vendor: str = ""
    device: str = ""
    klass: str = ""
    profiles: tuple[str, ...] = ()  # as the monitor lists them: "1145 (NVIDIA L40S-1B)", or just a name
    vmid: int = -1

    @property
    def free(self) -> bool:
        """No VM holds it."""
        return self.vmid < 0


@dataclass(frozen=True)
class Host:
    """What capacity and placement need of one host: its state, cluster, free CPU and memory, PCI devices, and
    the attributes a requirement expression names (placement.py)."""

    id: int
    name: str
    state: int
    devices: tuple[PciDevice, ...] = ()
    # HOST/TEMPLATE's single-valued attributes: what `onehost update` set (NVLINK_DOMAIN, RACK) and the
    # monitor's (HYPERVISOR, ...); vectors are left out
    attributes: Mapping[str, str] = field(default_factory=dict)
    cluster_id: int = -1
    cpu_free: int | None = None  # HOST_SHARE MAX_CPU - CPU_USAGE, oned's units (100 a core); None: not shown
    memory_free_kb: int | None = None  # HOST_SHARE MAX_MEM - MEM_USAGE
    searched: tuple[tuple[str, str], ...] = ()  # (name, value) where oned's scheduler looks them up, in order

    def attribute(self, name: str) -> list[str]:
        """Every value of an attribute a requirement names, in the scheduler's order (the first one counts)."""
        return [value for key, value in self.searched if key == name]

    @property
    def placeable(self) -> bool:
        """oned's scheduler may place new VMs here (not INIT, ERROR, DISABLED or OFFLINE)."""
        return self.state in PLACEABLE_HOST_STATES

    @property
    def state_name(self) -> str:
        """STATE in words."""
        return HOST_STATE_NAMES.get(self.state, f"STATE_{self.state}")


# Where the scheduler looks up an attribute a requirement names (7.x rank scheduler, HostXML.cc: these
# paths joined with "|", so the first match in document order counts); leaves only.
_SEARCHED = ("TEMPLATE", "HOST_SHARE", "HOST_SHARE/DATASTORES", "MONITORING/CAPACITY", "MONITORING/SYSTEM",
             "CLUSTER_TEMPLATE")
MOST_SEARCHED = 2000  # per host: a requirement never needs more, and a hostile answer is bounded


def _searched(host: ET.Element) -> tuple[tuple[str, str], ...]:
    """The leaves below the searched paths and HOST itself, in document order."""
    out: list[tuple[str, str]] = []

    def leaves(element: ET.Element, path: str) -> None:
        for child in element:
            if len(out) >= MOST_SEARCHED:
                return
            sub = f"{path}/{child.tag}" if path else child.tag
            if len(child) == 0:
                out.append((child.tag, (child.text or "").strip()))
            elif sub in _SEARCHED or any(s.startswith(sub + "/") for s in _SEARCHED):
                leaves(child, sub)

    leaves(host, "")
    return tuple(out)


def _free(host: ET.Element, most: str, used: str) -> int | None:
    total = host.findtext(f"HOST_SHARE/{most}")
    if total is None:
        return None
    return number(total, 0, f"HOST/HOST_SHARE/{most}") - number(host.findtext(f"HOST_SHARE/{used}"), 0,
                                                                  f"HOST/HOST_SHARE/{used}")


def hosts_from_xml(text: str) -> list[Host]:
    """Parse a HOST_POOL (or one HOST) document; PCI devices by their full path HOST/HOST_SHARE/PCI_DEVICES/PCI."""
    root = ET.fromstring(text)
    hosts = []
    for host in [root] if root.tag == "HOST" else root.iterfind("HOST"):
        devices = tuple(
            PciDevice(short_address=pci.findtext("SHORT_ADDRESS") or "", vendor=pci.findtext("VENDOR") or "",
                      device=pci.findtext("DEVICE") or "", klass=pci.findtext("CLASS") or "",
                      profiles=tuple(p.strip() for p in (pci.findtext("PROFILES") or "").split(",") if p.strip()),
                      vmid=number(pci.findtext("VMID"), -1, "HOST/HOST_SHARE/PCI_DEVICES/PCI/VMID"))
            for pci in host.iterfind("HOST_SHARE/PCI_DEVICES/PCI"))
        hosts.append(Host(id=number(host.findtext("ID"), -1, "HOST/ID"), name=host.findtext("NAME") or "",
                          state=number(host.findtext("STATE"), 0, "HOST/STATE"), devices=devices,
                          attributes=_attributes(host.find("TEMPLATE")),
                          cluster_id=number(host.findtext("CLUSTER_ID"), -1, "HOST/CLUSTER_ID"),
                          cpu_free=_free(host, "MAX_CPU", "CPU_USAGE"),
                          memory_free_kb=_free(host, "MAX_MEM", "MEM_USAGE"), searched=_searched(host)))
    return hosts


def _attributes(template: ET.Element | None) -> dict[str, str]:
    """HOST/TEMPLATE's single-valued attributes, bounded: oned's answer may carry anything."""
    if template is None:
        return {}
    found: dict[str, str] = {}
    for item in template:
        if len(found) >= MOST_ATTRIBUTES:
            break
        if len(item) == 0 and item.tag not in found:  # a vector has children: not one value
            found[item.tag] = (item.text or "").strip()[:ATTRIBUTE_LENGTH]
    return found


def host_gpus(text: str) -> tuple[int, int]:
    """(GPUs, free GPUs) over a HOST_POOL document: PCI devices of class 03xx, free when no VM holds them."""
    gpus = [device for host in hosts_from_xml(text) for device in host.devices if device.klass.startswith("03")]
    return len(gpus), sum(device.free for device in gpus)


# ---- what a VM asks of a host ------------------------------------------------------------------------


@dataclass(frozen=True)
class VmNeeds:
    """What one VM asks of the host it is deployed to, from its own document (one.vm.info): oned sets the
    AUTOMATIC_* requirements at instantiate, from the clusters of its networks and images; the template's
    SCHED_* requirements land in USER_TEMPLATE."""

    cpu: int  # oned's units: int(CPU * 100), HostShareCapacity
    memory_kb: int  # MEMORY (MiB) * 1024
    pci: tuple[Pci, ...] = ()  # every TEMPLATE/PCI entry: enforce tests them all, GPUs or not
    requirements: str = ""  # TEMPLATE/AUTOMATIC_REQUIREMENTS
    sched_requirements: str = ""  # USER_TEMPLATE/SCHED_REQUIREMENTS
    ds_requirements: str = ""  # TEMPLATE/AUTOMATIC_DS_REQUIREMENTS
    sched_ds_requirements: str = ""  # USER_TEMPLATE/SCHED_DS_REQUIREMENTS
    vm_group: bool = False  # TEMPLATE/VMGROUP: affinity rules only oned's scheduler applies
    auto_nics: bool = False  # a NIC with NETWORK_MODE = "auto": the scheduler picks its network
    pinned: bool = False  # TEMPLATE/TOPOLOGY with a PIN_POLICY other than NONE (NUMA pinning)


_CPU = re.compile(r"([0-9]{0,7})(?:\.([0-9]{0,9}))?")  # oned's CPU: a decimal number of physical CPUs


def _cpu_units(text: str | None) -> int:
    """VM/TEMPLATE/CPU in hundredths of a CPU (oned's host CPU units), strictly: ASCII digits with at most
    one decimal point, no sign, exponent, underscore, nan or other digit scripts (float() takes them all)."""
    found = _CPU.fullmatch((text or "").strip() or "0")
    if found is None or not (found.group(1) or found.group(2)):
        raise ValueError("VM/TEMPLATE/CPU is not a number")
    whole, fraction = found.group(1), (found.group(2) or "")
    return int(whole or "0") * 100 + round(int((fraction + "000")[:3]) / 10)


def vm_needs_from_xml(text: str) -> VmNeeds:
    """Parse one VM document (or the first VM of a pool) for what placing it needs."""
    root = ET.fromstring(text)
    vm = root if root.tag == "VM" else root.find("VM")
    if vm is None:
        raise ValueError("no VM in the document")
    template = vm.find("TEMPLATE")
    user = vm.find("USER_TEMPLATE")
    tmpl = template if template is not None else ET.Element("TEMPLATE")
    usr = user if user is not None else ET.Element("USER_TEMPLATE")
    topology = tmpl.find("TOPOLOGY")
    pin = (topology.findtext("PIN_POLICY") or "NONE").strip().upper() if topology is not None else "NONE"
    return VmNeeds(
        cpu=_cpu_units(tmpl.findtext("CPU")),
        memory_kb=number(tmpl.findtext("MEMORY"), 0, "VM/TEMPLATE/MEMORY") * 1024,
        pci=tuple(pci_from_element(item) for item in tmpl.iterfind("PCI")),
        requirements=(tmpl.findtext("AUTOMATIC_REQUIREMENTS") or "").strip(),
        sched_requirements=(usr.findtext("SCHED_REQUIREMENTS") or tmpl.findtext("SCHED_REQUIREMENTS") or "").strip(),
        ds_requirements=(tmpl.findtext("AUTOMATIC_DS_REQUIREMENTS") or "").strip(),
        sched_ds_requirements=(usr.findtext("SCHED_DS_REQUIREMENTS") or tmpl.findtext("SCHED_DS_REQUIREMENTS")
                               or "").strip(),
        vm_group=tmpl.find("VMGROUP") is not None,
        auto_nics=any((nic.findtext("NETWORK_MODE") or "").strip().lower() == "auto"
                      for nic in tmpl.iterfind("NIC")),
        pinned=pin not in ("", "NONE"),
    )
