"""vmpool.info's filters: whose VMs a filter flag selects, and the KEY=VALUE terms of its 5th argument."""

from __future__ import annotations

from opennebula_sim.cloud import User
from opennebula_sim.model import Vm


def owner_matches(vm: Vm, who: int, user: User) -> bool:
    """Filter flag -2 every VM, -3 the user's, -4 its group's, -1 both, N user N's."""
    if who == -2:
        return True
    if who == -3:
        return vm.uid == user.uid
    if who == -4:
        return vm.gid == user.gid
    if who == -1:
        return vm.uid == user.uid or vm.gid == user.gid
    return vm.uid == who


def term_matches(vm: Vm, term: str) -> bool:
    """One `KEY=VALUE` term of vmpool.info's 5th argument; see docs/SIMULATOR.md for what KEY may be.

    KEY is NAME, ID, UNAME, a top-level USER_TEMPLATE or TEMPLATE attribute, or a path in the CLI's
    `--search` style: VM.NAME, VM.USER_TEMPLATE.KEY, VM.TEMPLATE.KEY, VM.TEMPLATE.NIC[*].IP (or NIC.IP).
    A term without `=` matches VMs whose name contains it.
    """
    key, sep, value = term.partition("=")
    if not sep:
        return term in vm.name
    path = key.strip().upper().replace("[*]", "").split(".")
    if path[0] == "VM":
        path = path[1:]
    if path in (["NAME"], ["ID"], ["UNAME"]):
        return {"NAME": vm.name, "ID": str(vm.id), "UNAME": vm.uname}[path[0]] == value
    sources = [vm.user_template, vm.template]
    if path[0] in ("USER_TEMPLATE", "TEMPLATE"):
        sources = [vm.user_template if path[0] == "USER_TEMPLATE" else vm.template]
        path = path[1:]
    values = [v for src in sources for v in src.get(path[0], ())]
    if len(path) == 1:
        return any(isinstance(v, str) and v == value for v in values)
    if len(path) == 2:
        return any(isinstance(v, dict) and v.get(path[1]) == value for v in values)
    return False
