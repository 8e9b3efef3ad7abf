"""Hosts and their PCI devices as the host pool document shows them: what capacity counts and resume places
on. No pyone here, as in model.py (whose strict number parser the host pool's fields go through)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field

from .model import number

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
    """What capacity needs of one host: its state and its PCI devices."""

    id: int
    name: str
    state: int
    devices: tuple[PciDevice, ...] = ()
    # HOST/TEMPLATE's single-valued attributes: what `onehost update` set (NVLINK_DOMAIN, RACK) and the
    # monitor's (HYPERVISOR, ...); vectors are left out
    attributes: Mapping[str, str] = field(default_factory=dict)

    @property
    def placeable(self) -> bool:
        """oned's scheduler may place new VMs here (not INIT, ERROR, DISABLED or OFFLINE)."""
        return self.state in PLACEABLE_HOST_STATES

    @property
    def state_name(self) -> str:
        """STATE in words."""
        return HOST_STATE_NAMES.get(self.state, f"STATE_{self.state}")


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
                          attributes=_attributes(host.find("TEMPLATE"))))
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
