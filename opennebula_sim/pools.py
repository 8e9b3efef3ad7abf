"""Virtual networks and images with their owners, as oned keeps them: the pools a user sees (one.vnpool.info,
one.imagepool.info), one.vn.info and one.image.info, and how one.template.instantiate finds what a template's
NIC, PCI NIC (TYPE = "NIC") and DISK name, with oned's texts and codes:

- authorisation first (VirtualMachine::set_auth_request: the DISKs' images, then the NICs' networks): what a
  reference finds and the user may not USE is AUTHORIZATION, `User [2] : Not authorized to perform USE NET [0].`;
  a reference that finds nothing is not authorised at all here;
- then allocation (VirtualMachine::insert: the NICs' leases, then the DISKs' images): by id
  (`Virtual network with ID: N does not exist`, `Image with ID: N does not exist`), or by name among the objects
  of NETWORK_UID / NETWORK_UNAME (IMAGE_UID / IMAGE_UNAME), else of the instantiating user
  (VirtualNetworkPool::get_nic_by_name, ImagePool::acquire_disk, ImageManager::acquire_image), ALLOCATE with
  the template's object name, as Request::failure_message words it.
"""

from __future__ import annotations

import ipaddress
import re

from opennebula_sim import states as S
from opennebula_sim.cloud import Cloud, User
from opennebula_sim.model import IpPool, Owned, mac_for
from opennebula_sim.states import OneError
from opennebula_sim.templates import Template, vectors
from opennebula_sim.xmlrender import cdata, text

NET, IMAGE = "NET", "IMAGE"
_INT = re.compile(r"\s*[-+]?[0-9]+")  # what istringstream >> int takes from the front of a value


def _leading_int(value: str) -> int | None:
    found = _INT.match(value)
    return int(found.group()) if found else None


def _permissions(obj: Owned) -> str:
    other = int(obj.other_use)
    return ("<PERMISSIONS><OWNER_U>1</OWNER_U><OWNER_M>1</OWNER_M><OWNER_A>0</OWNER_A><GROUP_U>0</GROUP_U>"
            f"<GROUP_M>0</GROUP_M><GROUP_A>0</GROUP_A><OTHER_U>{other}</OTHER_U><OTHER_M>0</OTHER_M>"
            "<OTHER_A>0</OTHER_A></PERMISSIONS>")


def _owner(cloud: Cloud, obj: Owned) -> str:
    owner = cloud.user_for(obj.uid)
    return (f"<ID>{obj.id}</ID><UID>{owner.uid}</UID><GID>{owner.gid}</GID><UNAME>{text(owner.uname)}</UNAME>"
            f"<GNAME>{text(owner.gname)}</GNAME><NAME>{text(obj.name)}</NAME>{_permissions(obj)}")


def vnet_xml(cloud: Cloud, net: Owned, leases: bool) -> str:
    """One <VNET>: one.vn.info's with the leases of its address range (IP, MAC, VM; oned drops a lease at DONE),
    the pool's without them. Every network leases from the one range, shown under the configured network."""
    pool: IpPool = cloud.ips
    ours = net.id == pool.spec.id
    used = dict(pool.used) if ours else {}
    listed = "".join(f"<LEASE><IP>{cdata(ip)}</IP><MAC>{cdata(mac_for(ip))}</MAC><VM>{cdata(str(vm))}</VM></LEASE>"
                     for ip, vm in sorted(used.items(), key=lambda item: tuple(map(int, item[0].split(".")))))
    first = str(ipaddress.IPv4Address(pool.first))
    ar = (f"<AR><AR_ID>{cdata('0')}</AR_ID><IP>{cdata(first)}</IP><MAC>{cdata(mac_for(first))}</MAC>"
          f"<SIZE>{cdata(str(pool.size))}</SIZE><TYPE>{cdata('IP4')}</TYPE><USED_LEASES>{len(used)}</USED_LEASES>"
          + (f"<LEASES>{listed}</LEASES>" if leases else "") + "</AR>") if ours else ""
    return (f"<VNET>{_owner(cloud, net)}<CLUSTERS><ID>0</ID></CLUSTERS><BRIDGE>{cdata('br0')}</BRIDGE>"
            f"<VN_MAD>{cdata('dummy')}</VN_MAD><USED_LEASES>{len(used)}</USED_LEASES><TEMPLATE><BRIDGE>"
            f"{cdata('br0')}</BRIDGE><VN_MAD>{cdata('dummy')}</VN_MAD></TEMPLATE><AR_POOL>{ar}</AR_POOL></VNET>")


def image_xml(cloud: Cloud, image: Owned) -> str:
    """One <IMAGE> (Image::to_xml's order): a READY, non-persistent OS image of the default datastore."""
    when = cloud.regtime
    return (f"<IMAGE>{_owner(cloud, image)}<TYPE>0</TYPE><DISK_TYPE>0</DISK_TYPE><PERSISTENT>0</PERSISTENT>"
            f"<REGTIME>{when}</REGTIME><MODTIME>{when}</MODTIME><SOURCE>{cdata(f'/var/lib/one/datastores/1/{image.id}')}"
            f"</SOURCE><PATH>{cdata('/dev/null')}</PATH><FORMAT>{cdata('raw')}</FORMAT><FS>{cdata('')}</FS>"
            "<SIZE>1</SIZE><STATE>1</STATE><PREV_STATE>1</PREV_STATE><RUNNING_VMS>0</RUNNING_VMS>"
            "<CLONING_OPS>0</CLONING_OPS><CLONING_ID>-1</CLONING_ID><TARGET_SNAPSHOT>-1</TARGET_SNAPSHOT>"
            f"<DATASTORE_ID>1</DATASTORE_ID><DATASTORE>default</DATASTORE><VMS></VMS><CLONES></CLONES>"
            "<APP_CLONES></APP_CLONES><TEMPLATE></TEMPLATE><SNAPSHOTS><ALLOW_ORPHANS><![CDATA[YES]]></ALLOW_ORPHANS>"
            "<CURRENT_BASE><![CDATA[-1]]></CURRENT_BASE><NEXT_SNAPSHOT><![CDATA[0]]></NEXT_SNAPSHOT></SNAPSHOTS>"
            "</IMAGE>")


def _listed(cloud: Cloud, obj: Owned, who: int, user: User) -> bool:
    """PoolSQL::usr_filter: -2 what the user may use, -3 its own, -4 its group's that it may use, -1 its own and
    those, N user N's that it may use."""
    usable = obj.usable_by(user.uid, user.gid)
    if who == -3:
        return obj.uid == user.uid
    if who == -2:
        return usable
    in_group = cloud.user_for(obj.uid).gid == user.gid
    if who == -4:
        return in_group and usable
    if who == -1:
        return obj.uid == user.uid or (in_group and usable)
    return obj.uid == who and usable


def pool_info(cloud: Cloud, kind: str, order: str, user: User, who: int, start: int, end: int) -> str:
    """one.vnpool.info and one.imagepool.info: the objects a filter flag and an id range select."""
    if who < -4:
        raise OneError(S.XML_RPC_API, "Incorrect filter_flag")
    with cloud.lock:
        objects = cloud.networks if kind == NET else cloud.images
        chosen = [objects[i] for i in sorted(objects, reverse=order == "DESC")
                  if _listed(cloud, objects[i], who, user) and not (
                      end >= -1 and start != -1 and (i < start or (end != -1 and i > end)))]
        if kind == NET:
            return "<VNET_POOL>" + "".join(vnet_xml(cloud, n, False) for n in chosen) + "</VNET_POOL>"
        return "<IMAGE_POOL>" + "".join(image_xml(cloud, i) for i in chosen) + "</IMAGE_POOL>"


def object_info(cloud: Cloud, kind: str, user: User, oid: int, decrypt: bool = False) -> str:
    """one.vn.info and one.image.info: NO_EXISTS for no such object, AUTHORIZATION without USE of it."""
    name = "virtual network" if kind == NET else "image"
    with cloud.lock:
        obj = (cloud.networks if kind == NET else cloud.images).get(oid)
        if obj is None:
            raise OneError(S.NO_EXISTS, "", oid, obj=name)
        if not obj.usable_by(user.uid, user.gid):
            raise OneError(S.AUTHORIZATION, f"Not authorized to perform USE {kind} [{oid}]", obj=name)
        return vnet_xml(cloud, obj, True) if kind == NET else image_xml(cloud, obj)


def _nics(tmpl: Template) -> list[dict[str, str]]:
    """The NICs oned leases for (NIC, then PCI TYPE = "NIC"), without NETWORK_MODE = "auto" ones."""
    return [nic for nic in [*vectors(tmpl, "NIC"), *_pci_nics(tmpl)]
            if nic.get("NETWORK_MODE", "").upper() not in ("AUTO", "DUMMY")]


def _pci_nics(tmpl: Template) -> list[dict[str, str]]:
    return [pci for pci in vectors(tmpl, "PCI") if pci.get("TYPE", "").upper() == "NIC"]


def _find(cloud: Cloud, kind: str, vector: dict[str, str], user: User) -> tuple[Owned | None, str]:
    """What a NIC's (DISK's) reference finds, or None and oned's text for why not ("" when it names nothing)."""
    attr, objects = ("NETWORK", cloud.networks) if kind == NET else ("IMAGE", cloud.images)
    noun, vec = ("a network", "NIC") if kind == NET else ("an image", "DISK")
    if vector.get(f"{attr}_ID", "") != "":
        ref = vector[f"{attr}_ID"]
        number = _leading_int(ref)
        found = objects.get(-1 if number is None else number)
        missing = f"Virtual network with ID: {ref} does not exist" if kind == NET else \
            f"Image with ID: {number} does not exist"
        return found, "" if found else missing
    name = vector.get(attr, "")
    if not name:
        return None, ""
    owner: int | None = user.uid
    failed = ""
    if vector.get(f"{attr}_UID", "") != "":
        owner = _leading_int(vector[f"{attr}_UID"])
        failed = "Cannot get user in NETWORK_UID"
    elif vector.get(f"{attr}_UNAME", "") != "":
        owner = cloud.uid_of(vector[f"{attr}_UNAME"])
        failed = "User set in NETWORK_UNAME does not exist"
    if owner is None:  # an image's owner that cannot be read names the instantiating user (acquire_disk)
        return None, failed if kind == NET else \
            f"User {user.uid} does not own {noun} with name: {name} . Set IMAGE_UNAME or IMAGE_UID of owner in DISK."
    found = next((o for o in objects.values() if o.name == name and o.uid == owner), None)
    why = f"User {owner} does not own {noun} with name: {name} . Set {attr}_UNAME or {attr}_UID of owner in {vec}."
    return found, "" if found else why


def authorize(cloud: Cloud, user: User, tmpl: Template) -> None:
    """USE of each image and network the template finds (the DISKs first): AUTHORIZATION naming each refused."""
    refused = []
    for kind, vector in [*((IMAGE, d) for d in vectors(tmpl, "DISK")), *((NET, n) for n in _nics(tmpl))]:
        found, _ = _find(cloud, kind, vector, user)
        if found is not None and not found.usable_by(user.uid, user.gid):
            refused.append(f"Not authorized to perform USE {kind} [{found.id}]")
    if refused:
        raise OneError(S.AUTHORIZATION, "; ".join(refused), obj="virtual machine template")


def resolve(cloud: Cloud, user: User, tmpl: Template) -> list[tuple[int, str]]:
    """The NICs' networks, then the DISKs' images, as VirtualMachine::insert takes them: ALLOCATE with oned's
    text for the first that finds nothing (a DISK's prefixed `DISK <i>: `, VirtualMachineDisks::get_images);
    the network (id, name) of each NIC vector, in order."""
    networks = []
    for nic in vectors(tmpl, "NIC"):
        found, why = _find(cloud, NET, nic, user) if nic in _nics(tmpl) else (None, "")
        if why:
            raise OneError(S.ALLOCATE, why, obj="virtual machine template")
        networks.append((found.id, found.name) if found else (cloud.ips.spec.id, cloud.ips.spec.name))
    for pci in (p for p in _pci_nics(tmpl) if p in _nics(tmpl)):
        if why := _find(cloud, NET, pci, user)[1]:
            raise OneError(S.ALLOCATE, why, obj="virtual machine template")
    for index, disk in enumerate(vectors(tmpl, "DISK")):
        if why := _find(cloud, IMAGE, disk, user)[1]:
            raise OneError(S.ALLOCATE, f"DISK {index}: {why}", obj="virtual machine template")
    return networks
