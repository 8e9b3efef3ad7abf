"""What oned does to a template when it allocates a VM: merge, split, NIC leases, CONTEXT, PCI at deploy."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from opennebula_sim.model import IpPool, PciSlot, mac_for
from opennebula_sim.templates import Template, Value, first, merge, split_vm_template, vectors

_VAR = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)(?:\[([A-Za-z0-9_]+)(?:,[^\]]*)?\])?")
_CONTEXT_KEYS = ("IP", "MAC", "MASK", "NETWORK", "GATEWAY", "DNS", "SEARCH_DOMAIN", "MTU", "METRIC", "METHOD",
                 "VLAN_ID", "VROUTER_IP", "VROUTER_MANAGEMENT", "EXTERNAL", "ROUTES", "IP6", "IP6_ULA", "IP6_GATEWAY",
                 "IP6_METRIC", "IP6_METHOD", "IP6_PREFIX_LENGTH", "VROUTER_IP6")
_PCI_ASSIGNED = ("ADDRESS", "BUS", "DOMAIN", "FUNCTION", "NUMA_NODE", "PCI_ID", "SHORT_ADDRESS", "SLOT")


class BuildError(Exception):
    """The VM cannot be allocated (oned answers ALLOCATE with this text)."""


@dataclass
class Built:
    """A VM's TEMPLATE and USER_TEMPLATE plus what the scheduler needs from them."""

    template: Template
    user_template: Template
    cpu_units: int
    memory_kb: int
    pci_requests: list[dict[str, str]]
    ips: list[str]


def build_vm_templates(base: Template, extra: Template, vm_id: int, name: str, template_id: int,
                       uid: int, uname: str, ips: IpPool, onegate_endpoint: str | None = "",
                       routes: bool = False, networks: Sequence[tuple[int, str]] | None = None) -> Built:
    """Merge, split into TEMPLATE/USER_TEMPLATE, lease NIC addresses and fill CONTEXT as oned does.

    With CONTEXT TOKEN=YES and an `onegate_endpoint`, CONTEXT gets ONEGATE_ENDPOINT and VMID, as oned's
    generate_token_context adds them (oned.conf's ONEGATE_ENDPOINT); None: oned.conf has none, and TOKEN=YES is
    refused as oned refuses it. `routes`: the ETH<i>_ROUTES key of 7.4+. `networks`: the network (id, name) each
    NIC resolved to; every NIC leases from `ips` whichever it is.
    """
    merged = merge(base, extra)
    merged.pop("NAME", None)  # VMTemplateInstantiate erases NAME; the VM name is the call's argument
    vm_tmpl, user_tmpl = split_vm_template(merged)
    vm_tmpl["TEMPLATE_ID"] = [str(template_id)]
    vm_tmpl["VMID"] = [str(vm_id)]
    vm_tmpl["AUTOMATIC_REQUIREMENTS"] = ["(CLUSTER_ID = 0) & !(PUBLIC_CLOUD = YES) & !(PIN_POLICY = PINNED)"]
    vm_tmpl["AUTOMATIC_DS_REQUIREMENTS"] = ['("CLUSTERS/ID" @> 0)']
    leased: list[str] = []
    nics: list[Value] = []
    for index, nic in enumerate(vectors(vm_tmpl, "NIC")):
        ip = ips.lease(vm_id)
        if ip is None:
            for taken in leased:
                ips.release(taken)
            raise BuildError(f"Cannot get IP/MAC lease from virtual network {ips.spec.id}.")
        leased.append(ip)
        net = networks[index] if networks and index < len(networks) else (ips.spec.id, ips.spec.name)
        nics.append(_nic(nic, index, vm_id, ip, net))
    if nics:
        vm_tmpl["NIC"] = nics
    contexts = vectors(vm_tmpl, "CONTEXT")
    if contexts:
        names = {"NAME": name, "VMID": str(vm_id), "UID": str(uid), "UNAME": uname,
                 "TEMPLATE_ID": str(template_id)}
        context = _context(contexts[0], nics, ips, vm_tmpl, user_tmpl, names, routes)
        if onegate_endpoint is None and context.get("TOKEN", "").upper() == "YES":
            for taken in leased:
                ips.release(taken)
            raise BuildError("TOKEN set, but onegate endpoint was not defined in oned.conf.")
        if onegate_endpoint and context.get("TOKEN", "").upper() == "YES":
            context.update(ONEGATE_ENDPOINT=onegate_endpoint, VMID=str(vm_id))
        vm_tmpl["CONTEXT"] = [context]
    try:
        cpu_units = round(float(first(vm_tmpl, "CPU", "0")) * 100)
        memory_kb = int(first(vm_tmpl, "MEMORY", "0")) * 1024
    except ValueError as exc:
        for taken in leased:
            ips.release(taken)
        raise BuildError(f"Wrong CPU or MEMORY value: {exc}") from None
    pci = [dict(p) for p in vectors(vm_tmpl, "PCI")]
    for index, request in enumerate(pci):
        request["PCI_ID"] = str(index)
    if pci:
        vm_tmpl["PCI"] = list(pci)
    wanted = ("VENDOR", "DEVICE", "CLASS", "SHORT_ADDRESS")
    requests = [{k: v for k, v in p.items() if k in wanted} for p in pci]
    return Built(vm_tmpl, user_tmpl, cpu_units, memory_kb, requests, leased)


def _nic(nic: dict[str, str], index: int, vm_id: int, ip: str, net: tuple[int, str]) -> dict[str, str]:
    out = dict(nic)
    out.update(
        AR_ID="0", BRIDGE="br0", IP=ip, MAC=mac_for(ip), NETWORK=net[1], NETWORK_ID=str(net[0]),
        NIC_ID=str(index), SECURITY_GROUPS="0", TARGET=f"one-{vm_id}-{index}", VN_MAD="dummy",
    )
    return out  # NETWORK_UNAME stays as given: VirtualNetwork::nic_attribute sets NETWORK and NETWORK_ID only


def _context(context: dict[str, str], nics: list[Value], ips: IpPool, vm_tmpl: Template, user_tmpl: Template,
             names: dict[str, str], routes: bool) -> dict[str, str]:
    out = {key: _substitute(value, vm_tmpl, user_tmpl, names) for key, value in context.items()}
    out.setdefault("DISK_ID", str(len(vectors(vm_tmpl, "DISK"))))  # the context CD comes after the disks
    out.setdefault("TARGET", "hda")
    if out.get("NETWORK", "").upper() == "YES":
        net = ips.network
        for nic in nics:
            assert isinstance(nic, dict)
            eth = f"ETH{nic['NIC_ID']}_"
            # VirtualMachineContext.cc's NETWORK_CONTEXT and NETWORK6_CONTEXT: every key is set, empty when
            # neither the NIC nor the network has the value (ROUTES from 7.4 on)
            out.update(dict.fromkeys((eth + key for key in _CONTEXT_KEYS if key != "ROUTES" or routes), ""))
            out.update({
                eth + "IP": nic["IP"], eth + "MAC": nic["MAC"], eth + "MASK": str(net.netmask),
                eth + "NETWORK": str(net.network_address), eth + "GATEWAY": ips.spec.gateway,
                eth + "DNS": ips.spec.dns,
            })
    return out


def _substitute(value: str, vm_tmpl: Template, user_tmpl: Template, names: dict[str, str]) -> str:
    """oned's CONTEXT variables: $NAME, $VMID, $UID, $UNAME, $TEMPLATE_ID, $ATTR and $VECTOR[KEY]."""

    def one(match: re.Match[str]) -> str:
        var, sub = match.group(1).upper(), match.group(2)
        if sub is None:
            if var in names:
                return names[var]
            return first(vm_tmpl, var) or first(user_tmpl, var)
        for source in (vm_tmpl, user_tmpl):
            for vector in vectors(source, var):
                return vector.get(sub.upper(), "")
        return ""

    return _VAR.sub(one, value)


def assign_pci(vm_tmpl: Template, slots: Sequence[PciSlot | None]) -> None:
    """At deploy oned copies the chosen devices' address fields into TEMPLATE/PCI (None: no device was free
    for that entry, a deploy without enforce: it keeps no address)."""
    pci = vectors(vm_tmpl, "PCI")
    for request, slot in zip(pci, slots, strict=True):
        if slot is None:
            continue
        bus, rest = slot.spec.short_address.split(":")
        dev, function = rest.split(".")
        request.update(ADDRESS=slot.address, BUS=bus, DOMAIN="0000", FUNCTION=function,
                       NUMA_NODE=str(slot.spec.numa_node), SHORT_ADDRESS=slot.spec.short_address, SLOT=dev)


def strip_pci_assignment(vm_tmpl: Template, requests: list[dict[str, str]]) -> None:
    """When the host share is freed the device assignment goes too (the next deploy picks again)."""
    for pci, request in zip(vectors(vm_tmpl, "PCI"), requests, strict=False):
        for key in _PCI_ASSIGNED:
            if key != "PCI_ID" and key not in request:
                pci.pop(key, None)
