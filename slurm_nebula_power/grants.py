"""What oned shows a user of its own rights: its groups, and the VM_*_OPERATIONS (which operation asks which
level of a VM) of its user template, its primary group's template and oned.conf. No pyone here."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field

from .model import number

LEVELS = ("ADMIN", "MANAGE", "USE")


@dataclass(frozen=True)
class Rights:
    """One user's groups and the operation levels set for it (level -> operations text, as oned.conf writes them)."""

    uid: int
    name: str
    gid: int
    groups: tuple[int, ...]
    user: Mapping[str, str] = field(default_factory=dict)
    group: Mapping[str, str] = field(default_factory=dict)
    system: Mapping[str, str] = field(default_factory=dict)

    @property
    def administrator(self) -> bool:
        """In group oneadmin (0): ADMIN on every object (RequestAttributes::is_admin)."""
        return 0 in self.groups or self.uid == 0


def _levels(template: ET.Element | None) -> dict[str, str]:
    if template is None:
        return {}
    return {level: (template.findtext(f"VM_{level}_OPERATIONS") or "") for level in LEVELS
            if template.find(f"VM_{level}_OPERATIONS") is not None}


def user_from_xml(text: str) -> tuple[int, str, int, tuple[int, ...], dict[str, str]]:
    """one.user.info: (id, name, primary group, groups, operation levels of its TEMPLATE)."""
    root = ET.fromstring(text)
    groups = tuple(number(g.text, -1, "USER/GROUPS/ID") for g in root.iterfind("GROUPS/ID"))
    return (number(root.findtext("ID"), -1, "USER/ID"), root.findtext("NAME") or "",
            number(root.findtext("GID"), -1, "USER/GID"), groups, _levels(root.find("TEMPLATE")))


def group_levels(text: str) -> dict[str, str]:
    """one.group.info: the operation levels of its TEMPLATE."""
    return _levels(ET.fromstring(text).find("TEMPLATE"))


def config_levels(text: str) -> dict[str, str]:
    """one.system.config (oned.conf, open to every user): its VM_*_OPERATIONS, at the top level only."""
    root = ET.fromstring(text)
    return {level: (root.findtext(f"VM_{level}_OPERATIONS") or "") for level in LEVELS
            if root.find(f"VM_{level}_OPERATIONS") is not None}
