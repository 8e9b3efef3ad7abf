"""Hosts and their PCI devices as the host pool document shows them: what capacity counts and resume places
on. No pyone here, as in model.py (whose strict number parser the host pool's fields go through)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass

from .model import number

# ---- hosts and their PCI devices --------------------------------------------------------------------

# HOST STATE numbers (include/Host.h, HostState; 7.x keeps 1, 5, 6 and 7 only as comments).
HOST_STATE_NAMES = {0: "INIT", 1: "MONITORING_MONITORED", 2: "MONITORED", 3: "ERROR", 4: "DISABLED",
                    5: "MONITORING_ERROR", 6: "MONITORING_INIT", 7: "MONITORING_DISABLED", 8: "OFFLINE"}
# The states a host takes new VMs in: oned 7.x's scheduler asks for "state = 2"
# (src/schedm/SchedulerManagerDriver.cc); 6.x's also took MONITORING_MONITORED (HostPoolXML.h: STATE=1 or 2).
PLACEABLE_HOST_STATES = (1, 2)


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
                          state=number(host.findtext("STATE"), 0, "HOST/STATE"), devices=devices))
    return hosts


def host_gpus(text: str) -> tuple[int, int]:
    """(GPUs, free GPUs) over a HOST_POOL document: PCI devices of class 03xx, free when no VM holds them."""
    gpus = [device for host in hosts_from_xml(text) for device in host.devices if device.klass.startswith("03")]
    return len(gpus), sum(device.free for device in gpus)
