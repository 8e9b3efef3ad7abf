"""The XML oned sends: compact, no namespace, oned's element order, template values in CDATA.

VM bodies are cached per VM version, so a pool query over 10,000 VMs joins ready strings.
"""

from __future__ import annotations

from xml.sax.saxutils import escape

from opennebula_sim.config import TemplateSpec
from opennebula_sim.model import History, Host, Vm
from opennebula_sim.templates import Template

_VM_PERMISSIONS = (
    "<PERMISSIONS><OWNER_U>1</OWNER_U><OWNER_M>1</OWNER_M><OWNER_A>0</OWNER_A><GROUP_U>0</GROUP_U>"
    "<GROUP_M>0</GROUP_M><GROUP_A>0</GROUP_A><OTHER_U>0</OTHER_U><OTHER_M>0</OTHER_M><OTHER_A>0</OTHER_A>"
    "</PERMISSIONS>"
)
_SHORT_TEMPLATE_KEYS = ("CPU", "MEMORY", "VCPU")
_SHORT_NIC_KEYS = ("IP", "IP6", "IP6_GLOBAL", "IP6_LINK", "IP6_ULA", "MAC", "NETWORK", "NETWORK_ID", "NIC_ID",
                   "SECURITY_GROUPS")


def cdata(value: str) -> str:
    """A CDATA section holding `value` exactly (a `]]>` inside is split across two sections)."""
    return "<![CDATA[" + value.replace("]]>", "]]]]><![CDATA[>") + "]]>"


def text(value: object) -> str:
    """Escaped element text."""
    return escape(str(value))


def template_xml(tmpl: Template, root: str) -> str:
    """<ROOT> with attributes in name order (oned's multimap), vector members too, values in CDATA."""
    parts = [f"<{root}>"]
    for key in sorted(tmpl):
        for value in tmpl[key]:
            if isinstance(value, dict):
                parts.append(f"<{key}>")
                parts.extend(f"<{sub}>{cdata(value[sub])}</{sub}>" for sub in sorted(value))
                parts.append(f"</{key}>")
            else:
                parts.append(f"<{key}>{cdata(value)}</{key}>")
    parts.append(f"</{root}>")
    return "".join(parts)


def _lock_xml(vm: Vm) -> str:
    if vm.lock is None:
        return ""
    return (f"<LOCK><LOCKED>{vm.lock.level}</LOCKED><OWNER>0</OWNER><TIME>{vm.lock.time}</TIME>"
            "<REQ_ID>-1</REQ_ID></LOCK>")


def _deploy_id(vm: Vm) -> str:
    return f"one-{vm.id}" if any(h.rstime for h in vm.history) else ""


def _history_full(vm: Vm, h: History) -> str:
    return (
        f"<HISTORY><OID>{vm.id}</OID><SEQ>{h.seq}</SEQ><HOSTNAME>{text(h.hostname)}</HOSTNAME>"
        f"<HID>{h.host_id}</HID><CID>0</CID><STIME>{h.stime}</STIME><ETIME>{h.etime}</ETIME>"
        f"<VM_MAD>{cdata('kvm')}</VM_MAD><TM_MAD>{cdata('ssh')}</TM_MAD><DS_ID>0</DS_ID>"
        f"<PSTIME>{h.pstime}</PSTIME><PETIME>{h.petime}</PETIME><RSTIME>{h.rstime}</RSTIME>"
        f"<RETIME>{h.retime}</RETIME><ESTIME>{h.estime}</ESTIME><EETIME>{h.eetime}</EETIME>"
        f"<ACTION>{h.action}</ACTION><UID>{vm.uid}</UID><GID>{vm.gid}</GID><REQUEST_ID>-1</REQUEST_ID>"
        "</HISTORY>"
    )


def vm_full(vm: Vm) -> str:
    """The body one.vm.info and one.vmpool.infoextended send for one VM."""
    history = "".join(_history_full(vm, h) for h in vm.history)
    return (
        f"<VM><ID>{vm.id}</ID><UID>{vm.uid}</UID><GID>{vm.gid}</GID><UNAME>{text(vm.uname)}</UNAME>"
        f"<GNAME>{text(vm.gname)}</GNAME><NAME>{text(vm.name)}</NAME>{_VM_PERMISSIONS}"
        f"<LAST_POLL>{vm.stime}</LAST_POLL><STATE>{vm.state}</STATE><LCM_STATE>{vm.lcm}</LCM_STATE>"
        f"<PREV_STATE>{vm.prev_state}</PREV_STATE><PREV_LCM_STATE>{vm.prev_lcm}</PREV_LCM_STATE>"
        f"<RESCHED>{vm.resched}</RESCHED><STIME>{vm.stime}</STIME><ETIME>{vm.etime}</ETIME>"
        f"<DEPLOY_ID>{_deploy_id(vm)}</DEPLOY_ID>{_lock_xml(vm)}<MONITORING></MONITORING>"
        f"<SCHED_ACTIONS></SCHED_ACTIONS>{template_xml(vm.template, 'TEMPLATE')}"
        f"{template_xml(vm.user_template, 'USER_TEMPLATE')}<HISTORY_RECORDS>{history}</HISTORY_RECORDS>"
        "<BACKUPS><BACKUP_CONFIG></BACKUP_CONFIG><BACKUP_IDS></BACKUP_IDS></BACKUPS></VM>"
    )


def _short_template(vm: Vm) -> str:
    parts = ["<TEMPLATE>"]
    for key in _SHORT_TEMPLATE_KEYS:
        for value in vm.template.get(key, ()):
            if isinstance(value, str):
                parts.append(f"<{key}>{cdata(value)}</{key}>")
    for key in ("DISK", "NIC", "NIC_ALIAS"):
        for value in vm.template.get(key, ()):
            if isinstance(value, dict):
                inner = "".join(f"<{k}>{cdata(value[k])}</{k}>" for k in _SHORT_NIC_KEYS if k in value)
                parts.append(f"<{key}>{inner}</{key}>")
    for value in vm.template.get("GRAPHICS", ()):
        if isinstance(value, dict):
            inner = "".join(f"<{k}>{cdata(value[k])}</{k}>" for k in sorted(value))
            parts.append(f"<GRAPHICS>{inner}</GRAPHICS>")
    parts.append("</TEMPLATE>")
    return "".join(parts)


def vm_short(vm: Vm) -> str:
    """The short body one.vmpool.info sends (oned 5.8+): no CONTEXT, PCI or custom USER_TEMPLATE keys."""
    user = {k: v for k, v in vm.user_template.items() if k in ("LABELS", "ERROR") or k.startswith("SCHED_")}
    history = ""
    if vm.history:
        h = vm.history[-1]
        history = (
            f"<HISTORY><OID>{vm.id}</OID><SEQ>{h.seq}</SEQ><HOSTNAME>{text(h.hostname)}</HOSTNAME>"
            f"<HID>{h.host_id}</HID><CID>0</CID><DS_ID>0</DS_ID><VM_MAD>{cdata('kvm')}</VM_MAD>"
            f"<TM_MAD>{cdata('ssh')}</TM_MAD><ACTION>{h.action}</ACTION></HISTORY>"
        )
    return (
        f"<VM><ID>{vm.id}</ID><UID>{vm.uid}</UID><GID>{vm.gid}</GID><UNAME>{text(vm.uname)}</UNAME>"
        f"<GNAME>{text(vm.gname)}</GNAME><NAME>{text(vm.name)}</NAME><LAST_POLL>{vm.stime}</LAST_POLL>"
        f"<STATE>{vm.state}</STATE><LCM_STATE>{vm.lcm}</LCM_STATE><RESCHED>{vm.resched}</RESCHED>"
        f"<STIME>{vm.stime}</STIME><ETIME>{vm.etime}</ETIME><DEPLOY_ID>{_deploy_id(vm)}</DEPLOY_ID>"
        f"{_lock_xml(vm)}{_short_template(vm)}<MONITORING></MONITORING>"
        f"{template_xml(user, 'USER_TEMPLATE')}<HISTORY_RECORDS>{history}</HISTORY_RECORDS></VM>"
    )


class VmXmlCache:
    """Rendered bodies per VM, reused until the VM's version changes."""

    def __init__(self) -> None:
        self._full: dict[int, tuple[int, str]] = {}
        self._short: dict[int, tuple[int, str]] = {}

    def full(self, vm: Vm) -> str:
        """vm_full(vm), cached."""
        hit = self._full.get(vm.id)
        if hit is None or hit[0] != vm.version:
            hit = (vm.version, vm_full(vm))
            self._full[vm.id] = hit
        return hit[1]

    def short(self, vm: Vm) -> str:
        """vm_short(vm), cached."""
        hit = self._short.get(vm.id)
        if hit is None or hit[0] != vm.version:
            hit = (vm.version, vm_short(vm))
            self._short[vm.id] = hit
        return hit[1]


def _pci_xml(host: Host) -> str:
    parts = []
    for slot in host.pci:
        spec = slot.spec
        bus, rest = spec.short_address.split(":")
        dev, function = rest.split(".")
        fields = {
            "ADDRESS": slot.address, "BUS": bus, "CLASS": spec.klass, "CLASS_NAME": spec.class_name,
            "DEVICE": spec.device, "DEVICE_NAME": spec.device_name, "DOMAIN": "0000", "FUNCTION": function,
            "NUMA_NODE": str(spec.numa_node), "PROFILES": ",".join(spec.profiles),
            "SHORT_ADDRESS": spec.short_address,
            "SLOT": dev, "TYPE": f"{spec.vendor}:{spec.device}:{spec.klass}", "VENDOR": spec.vendor,
            "VENDOR_NAME": spec.vendor_name, "VMID": str(slot.vmid),
        }
        parts.append("<PCI>" + "".join(f"<{k}>{cdata(v)}</{k}>" for k, v in fields.items()) + "</PCI>")
    return "".join(parts)


def host_xml(host: Host, now: int) -> str:
    """One <HOST> as one.hostpool.info and one.host.info send it."""
    vms = "".join(f"<ID>{i}</ID>" for i in sorted(host.vms))
    free_cpu, free_mem = host.max_cpu - host.used_cpu, host.max_mem - host.used_mem
    # oned keeps a template's attributes in name order
    template = "".join(f"<{k}>{cdata(v)}</{k}>" for k, v in sorted(host.template().items()))
    return (
        f"<HOST><ID>{host.id}</ID><NAME>{text(host.name)}</NAME><STATE>{host.state}</STATE>"
        f"<PREV_STATE>{host.prev_state}</PREV_STATE>"
        f"<IM_MAD>{cdata('kvm')}</IM_MAD><VM_MAD>{cdata('kvm')}</VM_MAD><CLUSTER_ID>0</CLUSTER_ID>"
        f"<CLUSTER>default</CLUSTER><HOST_SHARE><MEM_USAGE>{host.used_mem}</MEM_USAGE>"
        f"<CPU_USAGE>{host.used_cpu}</CPU_USAGE><TOTAL_MEM>{host.max_mem}</TOTAL_MEM>"
        f"<TOTAL_CPU>{host.max_cpu}</TOTAL_CPU><MAX_MEM>{host.max_mem}</MAX_MEM><MAX_CPU>{host.max_cpu}</MAX_CPU>"
        f"<RUNNING_VMS>{len(host.vms)}</RUNNING_VMS><VMS_THREAD>1</VMS_THREAD><DATASTORES><DISK_USAGE>0"
        "</DISK_USAGE><FREE_DISK>0</FREE_DISK><MAX_DISK>0</MAX_DISK><USED_DISK>0</USED_DISK></DATASTORES>"
        f"<PCI_DEVICES>{_pci_xml(host)}</PCI_DEVICES><NUMA_NODES></NUMA_NODES></HOST_SHARE>"
        f"<VMS>{vms}</VMS><TEMPLATE>{template}</TEMPLATE><MONITORING><TIMESTAMP>{now}</TIMESTAMP>"
        f"<ID>{host.id}</ID><CAPACITY><FREE_CPU>{free_cpu}</FREE_CPU><FREE_MEMORY>{free_mem}</FREE_MEMORY>"
        f"<USED_CPU>{host.used_cpu}</USED_CPU><USED_MEMORY>{host.used_mem}</USED_MEMORY></CAPACITY>"
        "</MONITORING></HOST>"
    )


def vmtemplate_xml(spec: TemplateSpec, tmpl: Template, regtime: int) -> str:
    """One <VMTEMPLATE> as one.template.info and one.templatepool.info send it (NAME is not in TEMPLATE)."""
    body = {k: v for k, v in tmpl.items() if k != "NAME"}
    return (
        f"<VMTEMPLATE><ID>{spec.id}</ID><UID>0</UID><GID>0</GID><UNAME>oneadmin</UNAME><GNAME>oneadmin</GNAME>"
        f"<NAME>{text(spec.name)}</NAME>"
        + _VM_PERMISSIONS.replace("<GROUP_U>0</GROUP_U>", "<GROUP_U>1</GROUP_U>")
        + f"<REGTIME>{regtime}</REGTIME>{template_xml(body, 'TEMPLATE')}</VMTEMPLATE>"
    )
