"""GPU capacity from the host pool, pure: which free PCI devices a node set's template can use, and how
many of its VMs fit. A hint, not a promise: another user may take a device between the count and the
instantiate (resume's pending_timeout catches that).

oned's rule (src/host/HostSharePCI.cc, test_by_name): a template PCI entry matches a free host device when
every VENDOR, DEVICE and CLASS it gives equals the device's (hex); SHORT_ADDRESS alone names one device.
oned does not check a vGPU/MIG PROFILE when placing; we count a device for a PROFILE only when the
device lists it among its PROFILES, or lists none (the monitor may not report them).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .hosts import Host, PciDevice
from .model import Pci


def _hex(value: Any) -> int | None:
    text = str(value or "").strip()
    try:
        return int(text, 16) if text else None
    except ValueError:
        return None


@dataclass(frozen=True)
class PciRequest:
    """One GPU a template asks for (a PCI entry): what a host device must be to serve it."""

    vendor: str = ""
    device: str = ""
    klass: str = ""
    profile: str = ""
    short_address: str = ""

    def matches(self, dev: PciDevice) -> bool:
        """oned's matching rule, plus the PROFILE where both sides name one."""
        if self.short_address and not (self.vendor or self.device or self.klass):
            return dev.short_address.lower() == self.short_address.lower()
        for wanted, have in ((self.vendor, dev.vendor), (self.device, dev.device), (self.klass, dev.klass)):
            if wanted and _hex(wanted) != _hex(have):
                return False
        return not (self.profile and dev.profiles and not any(self.profile in _names(p) for p in dev.profiles))

    @property
    def label(self) -> str:
        """10de:0302, 10de:2330:0302, 10de:0302 profile nvidia-558, or the short address."""
        text = ":".join(v.lower() for v in (self.vendor, self.device, self.klass) if v) or self.short_address
        return f"{text} profile {self.profile}" if self.profile else text


Requests = tuple[PciRequest, ...]  # the GPUs one VM needs


def _names(profile: str) -> set[str]:
    """A listed profile's names: "1145 (NVIDIA L40S-1B)" is "1145", "NVIDIA L40S-1B" or the whole entry."""
    head, _, rest = profile.partition(" (")
    return {profile, head.strip(), rest.rstrip(")").strip()} - {""}


def pci_request(entry: Pci) -> PciRequest:
    """A template's (or a VM's) PCI entry as what a host device must be to serve it."""
    return PciRequest(vendor=entry.vendor, device=entry.device, klass=entry.klass, profile=entry.profile,
                      short_address=entry.short_address)


def gpu_requests(template: Mapping[str, Any]) -> Requests:
    """The GPUs one VM of this template asks for (its PCI entries that are GPUs, not TYPE=NIC)."""
    pci = template.get("PCI")
    entries = pci if isinstance(pci, list) else [pci] if isinstance(pci, dict) else []
    return tuple(
        PciRequest(vendor=str(e.get("VENDOR", "")), device=str(e.get("DEVICE", "")), klass=str(e.get("CLASS", "")),
                   profile=str(e.get("PROFILE", "")), short_address=str(e.get("SHORT_ADDRESS", "")))
        for e in entries if isinstance(e, dict) and Pci.from_entry(e).is_gpu)


def gpus(count: int) -> str:
    """1 GPU, 4 GPUs."""
    return f"{count} GPU" + ("" if count == 1 else "s")


def label(requests: Requests) -> str:
    """What a VM needs, in words: '10de:0302' (one kind of GPU), else the kinds joined with '+'."""
    return "+".join(dict.fromkeys(r.label for r in requests))


def held_by(hosts: Iterable[Host], vm_id: int) -> int:
    """How many host devices a VM holds (a POWEROFF VM keeps its GPU; an UNDEPLOYED one does not)."""
    return sum(1 for host in hosts for dev in host.devices if dev.vmid == vm_id)


class Pool:
    """The free devices of the placeable hosts, taken VM by VM as oned's scheduler would (first fit).

    Devices held by VMs in `released` (ours, about to be terminated) count as free. `where` (host ids): only
    those hosts, as a VM restricted to a domain's hosts sees the pool; None: every host.
    """

    def __init__(self, hosts: Sequence[Host], released: Iterable[int] = ()) -> None:
        gone = set(released)
        self._free: list[tuple[int, list[PciDevice]]] = [
            (host.id, [d for d in host.devices if d.free or d.vmid in gone]) for host in hosts if host.placeable]

    def _hosts(self, where: Container[int] | None) -> list[list[PciDevice]]:
        return [devices for host, devices in self._free if where is None or host in where]

    def free(self, requests: Requests, where: Container[int] | None = None) -> int:
        """Free devices that could serve any of these requests."""
        return sum(1 for devices in self._hosts(where) for d in devices if any(r.matches(d) for r in requests))

    def take(self, requests: Requests, where: Container[int] | None = None) -> bool:
        """Reserve the devices of one VM on the first host that has them all; False when none has."""
        for devices in self._hosts(where):
            chosen = fit(devices, requests)
            if chosen is not None:
                for dev in chosen:
                    devices.remove(dev)
                return True
        return False

    def take_all(self, needs: Sequence[Requests], wheres: Sequence[Container[int] | None] = ()) -> bool:
        """Reserve several VMs' devices, all or none (each on the hosts of its `wheres` entry, if given)."""
        saved = [(host, list(devices)) for host, devices in self._free]
        if all(self.take(requests, wheres[i] if i < len(wheres) else None) for i, requests in enumerate(needs)):
            return True
        self._free = saved
        return False


def fit(devices: Sequence[PciDevice], requests: Requests) -> list[PciDevice] | None:
    """The devices one VM would get among these (one per request, oned's matching rule), or None."""
    chosen: list[PciDevice] = []
    for request in requests:
        dev = next((d for d in devices if d not in chosen and request.matches(d)), None)
        if dev is None:
            return None
        chosen.append(dev)
    return chosen


@dataclass(frozen=True)
class HostUsage:
    """A host's devices that can serve a node set: free, held by our VMs, held by others."""

    host: str
    state: str
    placeable: bool
    free: int
    ours: int
    others: int


def usage(hosts: Sequence[Host], requests: Requests, ours: Iterable[int]) -> list[HostUsage]:
    """Per host with a matching device: how many are free, ours, others' (free ones on a host that takes
    no VMs are shown but not placeable)."""
    mine = set(ours)
    out = []
    for host in hosts:
        matching = [d for d in host.devices if any(r.matches(d) for r in requests)]
        if matching:
            out.append(HostUsage(host.name, host.state_name, host.placeable, sum(d.free for d in matching),
                                 sum(d.vmid in mine for d in matching),
                                 sum(not d.free and d.vmid not in mine for d in matching)))
    return out
