"""oned's host methods that change a host: one.host.update (`onehost update`: HOST/TEMPLATE attributes such
as NVLINK_DOMAIN, which SCHED_REQUIREMENTS read) and one.host.status (`onehost enable|disable|offline`)."""

from __future__ import annotations

from opennebula_sim import states as S
from opennebula_sim.cloud import Cloud, User
from opennebula_sim.config import HOST_STATES
from opennebula_sim.model import Host
from opennebula_sim.states import OneError
from opennebula_sim.templates import Template, TemplateSyntaxError, parse_template

STATUS = {0: "MONITORED", 1: "DISABLED", 2: "OFFLINE"}  # HostAPI::status: ENABLED, DISABLED, OFFLINE


def _host(cloud: Cloud, host_id: int) -> Host:
    if not 0 <= host_id < len(cloud.hosts):
        raise OneError(S.NO_EXISTS, "", host_id, obj="host")
    return cloud.hosts[host_id]


def update_text(text: str, update_type: int) -> Template:
    """The template of an update call (one.vm.update, one.host.update), or oned's errors: `Wrong update type`
    for a type but 0 (replace) and 1 (merge), `Cannot update template. <parse error>`."""
    if update_type not in (0, 1):
        raise OneError(S.XML_RPC_API, "Wrong update type")
    try:
        return parse_template(text)
    except TemplateSyntaxError as exc:
        raise OneError(S.INTERNAL, f"Cannot update template. {exc}") from None


def host_update(cloud: Cloud, user: User, host_id: int, text: str, update_type: int = 0) -> int:
    """one.host.update: replace (0) or merge into (1) the host's TEMPLATE; single values only (a vector is
    not kept); the host's id."""
    tmpl = update_text(text, update_type)
    values = {key: str(vals[-1]) for key, vals in tmpl.items() if vals and isinstance(vals[-1], str)}
    with cloud.lock:
        host = _host(cloud, host_id)
        host.attributes = {**host.attributes, **values} if update_type == 1 else values
        host.version += 1
        cloud.locked_capacity_changed()
        return host_id


def host_status(cloud: Cloud, user: User, host_id: int, status: int) -> int:
    """one.host.status: 0 enable (MONITORED), 1 disable, 2 offline; a host keeps the VMs it has."""
    if status not in STATUS:
        raise OneError(S.INTERNAL, "Wrong status code")  # RequestManagerHost.cc: failure_response(INTERNAL)
    with cloud.lock:
        host = _host(cloud, host_id)
        host.prev_state, host.state = host.state, HOST_STATES[STATUS[status]]
        host.version += 1
        cloud.locked_capacity_changed()
        return host_id
