"""one.vm.deploy (VirtualMachineAPI::deploy on 7.4, VirtualMachineDeploy on 7.0) and who may call it: the
level an operation asks of the VM from the user's template, then its group's, then oned.conf's
VM_*_OPERATIONS (RequestAttributes::set_auth_op), and the user and group documents that show them.

Every function expects the caller to hold `cloud.lock`.
"""

from __future__ import annotations

from opennebula_sim import states as S
from opennebula_sim.cloud import Cloud, User
from opennebula_sim.model import Host, PciSlot, Vm
from opennebula_sim.states import OneError
from opennebula_sim.xmlrender import cdata, text

# oned.conf as shipped (7.0 and 7.4): deploy is an ADMIN operation
OPERATIONS = {
    "ADMIN": "migrate, delete, recover, retry, deploy, resched,\n    backup, restore",
    "MANAGE": "undeploy, hold, release, stop, suspend, resume, reboot,\n    poweroff, disk-attach, nic-attach, "
              "disk-snapshot, terminate, disk-resize,\n    snapshot, updateconf, rename, resize, update, "
              "disk-saveas, sched-action,\n    sg-attach, pci-attach, exec, vmgroup",
    "USE": "",
}
DEPLOYABLE = (S.PENDING, S.HOLD, S.STOPPED, S.UNDEPLOYED)
SYSTEM_DS, IMAGE_DATASTORES = 0, (1, 2)  # a stock install's datastores: system, default (images), files


def _names(value: str) -> set[str]:
    return {part.strip().lower() for part in value.split(",") if part.strip()}


def auth_level(cloud: Cloud, user: User, operation: str) -> str:
    """The level (ADMIN, MANAGE, USE) `operation` asks of a VM: user template > group template > oned.conf."""
    for source in (cloud.user_templates.get(user.uid, {}), cloud.group_templates.get(user.gid, {}),
                   {f"VM_{k}_OPERATIONS": v for k, v in OPERATIONS.items()}):
        for level in ("ADMIN", "MANAGE", "USE"):
            if operation in _names(source.get(f"VM_{level}_OPERATIONS", "")):
                return level
    return "ADMIN"


def vm_deploy(cloud: Cloud, user: User, vm_id: int, host_id: int, enforce: bool = False, ds_id: int = -1) -> int:
    """Deploy a VM to a host, as oned checks it: the host (exists, not OFFLINE; DISABLED is accepted), the VM,
    the datastore, the user's right, the VM's state, and with `enforce` the host's room (CPU, memory, PCI);
    without it the VM is deployed whatever the host has left, and gets no device where none is free."""
    if not 0 <= host_id < len(cloud.hosts):
        raise OneError(S.NO_EXISTS, "", host_id, obj="host")
    host = cloud.hosts[host_id]
    if host.state == 8:  # OFFLINE
        raise OneError(S.ACTION, "Host is offline, cannot use it to deploy VM")
    vm = cloud.vms.get(vm_id)
    if vm is None:
        raise OneError(S.NO_EXISTS, "", vm_id)
    if ds_id in IMAGE_DATASTORES:
        raise OneError(S.INTERNAL, f"Trying to use datastore [{ds_id}] to deploy the VM, but it is not of type "
                                   "system datastore.")
    if ds_id not in (-1, SYSTEM_DS):
        raise OneError(S.NO_EXISTS, "", ds_id, obj="datastore")
    level = auth_level(cloud, user, "deploy")
    if user.gid != 0 and (level == "ADMIN" or vm.uid != user.uid):  # owners have USE and MANAGE on their VMs
        raise OneError(S.AUTHORIZATION, f"Not authorized to perform {level} VM [{vm_id}]")
    if vm.state not in DEPLOYABLE:
        raise OneError(S.ACTION, f"Deploy action is not available for state {S.state_str(vm.state, vm.lcm)}")
    slots: list[PciSlot | None]
    if enforce:
        fitting = host.fit(vm)
        if fitting is None:
            raise OneError(S.ACTION, f"virtual machine [{vm_id}] does not fit in host [{host_id}]. "
                                     f"{_shortage(host, vm)}")
        slots = list(fitting)
    else:
        slots = _any_free(host, vm)
    cloud.locked_deploy(vm, host, slots)
    return vm_id


def _shortage(host: Host, vm: Vm) -> str:
    """HostShare::test's message: CPU first, then memory, then the PCI devices."""
    cpu_free, memory_free = host.max_cpu - host.used_cpu, host.max_mem - host.used_mem
    if vm.cpu_units > cpu_free:
        return f"Not enough CPU: {vm.cpu_units}/{cpu_free}"
    if vm.memory_kb > memory_free:
        return f"Not enough memory: {vm.memory_kb}/{memory_free}"
    return "Unavailable PCI device."


def _any_free(host: Host, vm: Vm) -> list[PciSlot | None]:
    """Without enforce: a free matching device for each PCI entry where there is one (HostSharePCI::add)."""
    chosen: list[PciSlot | None] = []
    for request in vm.pci_requests:
        slot = next((s for s in host.pci if s.vmid == -1 and s not in chosen and s.matches(request)), None)
        chosen.append(slot)
    return chosen


def user_xml(cloud: Cloud, user: User) -> str:
    """one.user.info of the session's user: its groups and TEMPLATE (VM_*_OPERATIONS among them)."""
    tmpl = "".join(f"<{k}>{cdata(v)}</{k}>" for k, v in sorted(cloud.user_templates.get(user.uid, {}).items()))
    return (f"<USER><ID>{user.uid}</ID><GID>{user.gid}</GID><GROUPS><ID>{user.gid}</ID></GROUPS>"
            f"<GNAME>{text(user.gname)}</GNAME><NAME>{text(user.uname)}</NAME><AUTH_DRIVER>{cdata('core')}"
            f"</AUTH_DRIVER><ENABLED>1</ENABLED><TEMPLATE>{tmpl}</TEMPLATE></USER>")


def group_xml(cloud: Cloud, user: User, gid: int) -> str:
    """one.group.info of the session user's group (another group: AUTHORIZATION, as for a user not in it)."""
    if gid != user.gid and user.gid != 0:
        raise OneError(S.AUTHORIZATION, "", obj="group")
    tmpl = "".join(f"<{k}>{cdata(v)}</{k}>" for k, v in sorted(cloud.group_templates.get(gid, {}).items()))
    name = user.gname if gid == user.gid else f"group{gid}"
    return f"<GROUP><ID>{gid}</ID><NAME>{text(name)}</NAME><TEMPLATE>{tmpl}</TEMPLATE></GROUP>"
