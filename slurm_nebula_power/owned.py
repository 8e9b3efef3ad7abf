"""Networks and images as oned's pools show them to a user, and how oned finds the one a template names.

A NIC's network and a DISK's image are named by id (NETWORK_ID, IMAGE_ID), or by name among the objects of
ONE owner: NETWORK_UID / NETWORK_UNAME (IMAGE_UID / IMAGE_UNAME) if given, else the user who instantiates
(VirtualMachineNic::get_uid, VirtualMachineDisk::get_uid; VirtualNetworkPool::get_nic_by_name,
ImageManager::acquire_image). USE of what was found is authorised after that. A pool query with filter -2
lists exactly what the user may USE (its own, its groups' and others' shared objects, what ACLs grant:
PoolSQL::usr_filter), so a name resolves for the user when an object of that name and owner is in it.
No pyone here.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .grants import Rights
from .model import number

NAME_LENGTH = 128  # oned refuses longer names (PoolObjectSQL::name_is_valid): a longer one is a forged answer
_ID = re.compile(r"[0-9]{1,9}")  # ASCII digits: str.isdigit() takes '²', which oned's istringstream refuses


@dataclass(frozen=True)
class Kind:
    """A network or an image, and the words oned and its CLI use for it."""

    attribute: str  # NETWORK or IMAGE: the name's attribute; _ID, _UID, _UNAME follow it
    vector: str  # NIC or DISK
    noun: str  # network or image
    acl: str  # NET or IMAGE: the resource in `oneacl create`
    element: str  # VNET or IMAGE: one object of the pool document
    lister: str  # onevnet or oneimage

    def missing_id(self, ref: str) -> str:
        """oned's text for an id that names nothing (VirtualNetworkPool::get_nic_by_id, acquire_image)."""
        return (f"Virtual network with ID: {ref} does not exist" if self.noun == "network" else
                f"Image with ID: {ref} does not exist")


NETWORK = Kind("NETWORK", "NIC", "network", "NET", "VNET", "onevnet")
IMAGE = Kind("IMAGE", "DISK", "image", "IMAGE", "IMAGE", "oneimage")


@dataclass(frozen=True)
class Owned:
    """A network or image of a pool: its id, name and owner."""

    id: int
    name: str
    uid: int
    uname: str

    def described(self, kind: Kind) -> str:
        """`network slurm-net (id 0, oneadmin's)`."""
        return f"{kind.noun} {self.name} (id {self.id}, {self.uname}'s)"


@dataclass(frozen=True)
class Unresolved:
    """Why oned will not find what a template (or a node set) names for this user, and what to do."""

    text: str
    fix: str


def owned_from_xml(text: str, kind: Kind) -> list[Owned]:
    """One.vnpool.info's VNET_POOL (one.imagepool.info's IMAGE_POOL): id, name and owner of each, strictly (an
    id that is no number, a name beyond oned's 128 characters: ValueError naming the field, never its value)."""
    root = ET.fromstring(text)
    found = []
    for element in [root] if root.tag == kind.element else root.iterfind(kind.element):
        name, uname = element.findtext("NAME") or "", element.findtext("UNAME") or ""
        if len(name) > NAME_LENGTH or len(uname) > NAME_LENGTH:
            raise ValueError(f"{kind.element}/NAME or UNAME is longer than oned allows")
        if not (name + uname).isprintable():  # a newline would be a line of its own in what `template` prints
            raise ValueError(f"{kind.element}/NAME or UNAME holds a control character")
        found.append(Owned(number(element.findtext("ID"), -1, f"{kind.element}/ID"), name,
                           number(element.findtext("UID"), -1, f"{kind.element}/UID"), uname))
    return found


def numeric(text: str) -> bool:
    """A reference by id: ASCII digits only."""
    return bool(_ID.fullmatch(text))


def grant(kind: Kind, user: Rights, ref: str = "<id>") -> str:
    """What oneadmin runs so that the user may use one network or image (its primary group's ACL rule)."""
    where = "" if ref != "<id>" else f" ({kind.lister} list shows the id)"
    return f'as oneadmin grant USE of it: oneacl create "@{user.gid} {kind.acl}/#{ref} USE"{where}'


def by_name(kind: Kind, key: str, name: str, visible: Sequence[Owned], user: Rights) -> Owned | Unresolved:
    """The one object a node set's option names (whoever owns it), for `template` to write by id."""
    found = [o for o in visible if o.name == name]
    if len(found) == 1:
        return found[0]
    if found:
        listed = ", ".join(f"{o.id} ({o.uname}'s)" for o in sorted(found, key=lambda o: o.id))
        return Unresolved(f'user {user.name} sees several {kind.noun}s named "{name}": ids {listed}',
                          f"set {key} to the numeric id of the one to use")
    return Unresolved(f'user {user.name} sees no {kind.noun} named "{name}" ({kind.lister} list, as that user)',
                      f"{grant(kind, user)}, or set {key} to its numeric id")


def resolve(kind: Kind, vector: Mapping[str, object], visible: Sequence[Owned], user: Rights
            ) -> Owned | Unresolved | None:
    """What a template's NIC (or PCI NIC) or DISK names, found as oned finds it when `user` instantiates; None
    when it names no network or image (NETWORK_MODE = "auto", a volatile disk)."""
    attr = kind.attribute
    value = {str(k).upper(): str(v).strip() for k, v in vector.items() if not isinstance(v, (dict, list))}
    if value.get(f"{attr}_ID"):
        ref = value[f"{attr}_ID"]
        hit = [o for o in visible if numeric(ref) and o.id == int(ref)]
        if hit:
            return hit[0]
        return Unresolved(f'{attr}_ID = "{ref}": user {user.name} may use no {kind.noun} {ref} '
                          f'("{kind.missing_id(ref)}" or not authorized to USE it)',
                          f"{grant(kind, user, ref if numeric(ref) else '<id>')}, or set {attr}_ID to one it may use")
    name = value.get(attr, "")
    if not name or value.get("NETWORK_MODE", "").upper() in ("AUTO", "DUMMY"):
        return None
    if value.get(f"{attr}_UID"):
        owner, whose = value[f"{attr}_UID"], f"user {value[f'{attr}_UID']} ({attr}_UID)"
        mine = [o for o in visible if o.name == name and str(o.uid) == owner]
    elif value.get(f"{attr}_UNAME"):
        owner, whose = value[f"{attr}_UNAME"], f"{value[f'{attr}_UNAME']} ({attr}_UNAME)"
        mine = [o for o in visible if o.name == name and o.uname == owner]
    else:
        whose = f"user {user.name} itself (no {attr}_UNAME or {attr}_UID)"
        mine = [o for o in visible if o.name == name and o.uid == user.uid]
    if mine:
        return mine[0]
    said = f'{attr} = "{name}" is looked up among the {kind.noun}s of {whose}'
    others = sorted((o for o in visible if o.name == name), key=lambda o: o.id)
    if others:
        owners = ", ".join(f"{o.uname}'s (id {o.id})" for o in others)
        fix = " or ".join(f'{attr}_UNAME = "{o.uname}"' for o in others)
        ids = " or ".join(f"{attr}_ID = {o.id}" for o in others)
        return Unresolved(f"{said}, but the {kind.noun} {name} user {user.name} may use is {owners}: oned refuses "
                          f'every instantiate ("does not own a{"n" if kind is IMAGE else ""} {kind.noun} with name")',
                          f"add {fix} to the {kind.vector}, or use {ids}")
    return Unresolved(f"{said}, and user {user.name} may use no {kind.noun} of that name: oned refuses every "
                      "instantiate", f"{grant(kind, user)}, or name one the user may use")


def references(template: Mapping[str, object]) -> list[tuple[str, Kind, Mapping[str, object]]]:
    """A template's NICs (aliases too), PCI NICs (TYPE = "NIC") and DISKs: (label such as `NIC 0`, kind, the
    vector), each of which oned resolves at instantiate (VirtualMachineNics::get_network_leases, get_disk_images)."""
    def each(key: str) -> list[Mapping[str, object]]:
        found = template.get(key)
        items = found if isinstance(found, list) else [found]
        return [item for item in items if isinstance(item, Mapping)]

    out: list[tuple[str, Kind, Mapping[str, object]]] = []
    out += [(f"NIC {i}", NETWORK, nic) for i, nic in enumerate(each("NIC"))]
    out += [(f"NIC_ALIAS {i}", NETWORK, nic) for i, nic in enumerate(each("NIC_ALIAS"))]
    out += [(f"PCI {i} (TYPE NIC)", NETWORK, pci) for i, pci in enumerate(each("PCI"))
            if str(pci.get("TYPE", "")).upper() == "NIC"]
    out += [(f"DISK {i}", IMAGE, disk) for i, disk in enumerate(each("DISK"))]
    return out
