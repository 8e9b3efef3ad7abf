"""oned's XML-RPC methods over the simulated cloud: argument checks, sessions, replies and error texts."""

from __future__ import annotations

import secrets
import threading
import xmlrpc.client
from collections.abc import Callable
from functools import partial
from typing import Any

from opennebula_sim import states as S
from opennebula_sim.actions import quota_message, vm_action, vm_recover
from opennebula_sim.cloud import ONEADMIN, Cloud, User
from opennebula_sim.config import TemplateSpec
from opennebula_sim.deploy import OPERATIONS, group_xml, user_xml, vm_deploy
from opennebula_sim.filters import owner_matches, term_matches
from opennebula_sim.hostapi import host_status, host_update, update_text
from opennebula_sim.model import Vm
from opennebula_sim.onegate import put_vm
from opennebula_sim.pools import IMAGE, NET, authorize, object_info, pool_info, resolve
from opennebula_sim.states import OneError
from opennebula_sim.templates import TemplateSyntaxError, first, merge, parse_template
from opennebula_sim.xmlrender import VmXmlCache, host_xml, vmtemplate_xml

# xmlrpc-c's fault codes: no such method, and parameters of the wrong type or number.
FAULT_NO_METHOD, FAULT_TYPE = -506, -501

_OBJECT = {  # the object name oned's messages use for each method family
    "one.template": "virtual machine template", "one.templatepool": "virtual machine template",
    "one.host": "host", "one.hostpool": "host", "one.vn": "virtual network", "one.vnpool": "virtual network",
    "one.image": "image", "one.imagepool": "image", "one.user": "user", "one.system": "system",
}


def failure_text(method: str, err: OneError, uid: int) -> str:
    """Request::failure_message: `[method] ` followed by the code's sentence."""
    if err.code == S.AUTHORIZATION:
        body = f"User [{uid}] : {err.message}." if err.message else (
            f"User [{uid}] not authorized to perform action on {err.obj}.")
    elif err.code == S.AUTHENTICATION:
        body = "User couldn't be authenticated, aborting call."
    elif err.code == S.NO_EXISTS:
        body = f"Error getting {err.obj}" + (f" [{err.resp_id}]." if err.resp_id != -1 else " Pool.")
    elif err.code == S.ALLOCATE:
        body = f"Error allocating a new {err.obj}." + (f" {err.message}" if err.message else "")
    elif err.code == S.LOCKED:
        body = f"The resource {err.obj} is locked." + (f" [{err.resp_id}]." if err.resp_id != -1 else "")
    else:
        body = err.message
    return f"[{method}] {body}"


class Api:
    """Dispatches one decoded XML-RPC call to its handler and builds oned's reply array."""

    def __init__(self, cloud: Cloud, auth: str, list_order: str = "DESC") -> None:
        self.cloud = cloud
        self.auth = auth
        self.username = auth.split(":", 1)[0]
        self.user = ONEADMIN if self.username == "oneadmin" else User(2, 1, self.username, "users")
        cloud.session_user = self.user
        self.list_order = list_order
        self.tokens: dict[str, float | None] = {}  # login token -> expiry (None = never)
        self.xml = VmXmlCache()
        self.calls: dict[str, int] = {}
        self._after: dict[str, list[Callable[[], None]]] = {}
        self._calls_lock = threading.Lock()
        # method -> (handler, required parameter types after the session, optional ones)
        self.methods: dict[str, tuple[Callable[..., Any], str, str]] = {
            "one.template.instantiate": (self.template_instantiate, "is", "bsb"),
            "one.vm.action": (self.vm_action, "si", ""),
            "one.vm.deploy": (self.vm_deploy, "ii", "bis"),
            "one.vm.info": (self.vm_info, "i", "b"),
            "one.vm.recover": (self.vm_recover, "ii", ""),
            "one.vm.update": (self.vm_update, "isi", ""),
            "one.vmpool.info": (self.vmpool_info, "iiii", "s"),
            "one.vmpool.infoextended": (self.vmpool_infoextended, "iiii", "s"),
            "one.templatepool.info": (self.templatepool_info, "iii", ""),
            "one.template.info": (self.template_info, "i", "bb"),
            "one.template.allocate": (self.template_allocate, "s", ""),
            "one.template.delete": (self.template_delete, "i", "b"),
            "one.hostpool.info": (self.hostpool_info, "", ""),
            "one.host.info": (self.host_info, "i", "b"),
            "one.host.update": (partial(host_update, cloud), "is", "i"),
            "one.host.status": (partial(host_status, cloud), "ii", ""),
            "one.vn.info": (partial(object_info, cloud, NET), "i", "b"),
            "one.vnpool.info": (partial(pool_info, cloud, NET, list_order), "iii", ""),
            "one.image.info": (partial(object_info, cloud, IMAGE), "i", "b"),
            "one.imagepool.info": (partial(pool_info, cloud, IMAGE, list_order), "iii", ""),
            "one.system.version": (self.system_version, "", ""),
            "one.system.config": (self.system_config, "", ""),
            "one.user.login": (self.user_login, "ssi", "i"),
            "one.user.info": (self.user_info, "i", "b"),
            "one.group.info": (self.group_info, "i", "b"),
        }

    # ------------------------------------------------------------------ dispatch
    def count(self, method: str) -> None:
        """Count one received call of `method`."""
        with self._calls_lock:
            self.calls[method] = self.calls.get(method, 0) + 1

    def dispatch(self, method: str, params: tuple[Any, ...]) -> Any:
        """Run `method`; return the reply value or raise xmlrpc.client.Fault as xmlrpc-c would."""
        if method == "sim.stats":
            return self.stats()
        entry = self.methods.get(method)
        if entry is None:
            raise xmlrpc.client.Fault(FAULT_NO_METHOD, f"Method '{method}' not defined")
        handler, required, optional = entry
        _check_params(method, params, "s" + required, optional)
        user = self._authenticate(params[0])
        try:
            if user is None:
                raise OneError(S.AUTHENTICATION, "")
            if not self.cloud.authorized:
                raise OneError(S.AUTHORIZATION, "", obj=_object_of(method))
            reply = [True, handler(user, *params[1:]), 0]
        except OneError as err:
            # Request::failure_response: the 5th is the replication index (an i8 in oned, -1 off a HA cluster)
            return [False, failure_text(method, err, user.uid if user else -1), err.code, err.resp_id, -1]
        self._run_after(method)
        return reply

    def after_call(self, method: str, action: Callable[[], None]) -> None:
        """Run `action` once, right after the next successful `method` is answered (before the reply is
        sent): what another user does between two of a client's calls, at a known moment."""
        with self._calls_lock:
            self._after.setdefault(method, []).append(action)

    def _run_after(self, method: str) -> None:
        with self._calls_lock:
            actions = self._after.pop(method, [])
        for action in actions:
            action()

    def internal_error(self, method: str) -> list[Any]:
        """The reply of a call that failed inside oned (used for injected transient faults)."""
        return [False, f"[{method}] Internal error", S.INTERNAL, -1, -1]

    def stats(self) -> dict[str, Any]:
        """sim.stats: calls per method and VMs per state."""
        with self._calls_lock:
            calls = dict(self.calls)
        return {"calls": calls, "vms": self.cloud.vm_counts()}

    def reset_stats(self) -> None:
        """Forget the call counts."""
        with self._calls_lock:
            self.calls.clear()

    def _authenticate(self, session: str) -> User | None:
        name, _, secret = session.partition(":")
        if name != self.username:
            return None
        if session == self.auth:
            return self.user
        expiry = self.tokens.get(secret, 0.0)
        if secret in self.tokens and (expiry is None or expiry > self.cloud.clock()):
            return self.user
        return None

    # ------------------------------------------------------------------ VMs
    def template_instantiate(self, user: User, template_id: int, name: str, hold: bool = False,
                             extra: str = "", persistent: bool = False) -> int:
        """one.template.instantiate: the new VM's id."""
        if template_id not in self.cloud.templates:
            raise OneError(S.NO_EXISTS, "", template_id, obj="virtual machine template")
        try:
            extra_tmpl = parse_template(extra)
        except TemplateSyntaxError as exc:
            raise OneError(S.INTERNAL, str(exc)) from None
        with self.cloud.lock:
            merged = merge(self.cloud.templates[template_id][1], extra_tmpl)
            authorize(self.cloud, user, merged)  # USE of its networks and images, then quotas, then allocation
            if self.cloud.faults.quota_exceeded:
                raise OneError(S.AUTHORIZATION, quota_message(self.cloud, user))
            if self.cloud.faults.allocate_failure:
                raise OneError(S.ALLOCATE, "Cannot allocate the VM in the database")
            networks = resolve(self.cloud, user, merged)
            return self.cloud.locked_allocate(template_id, name, hold, extra_tmpl, user, networks=networks).id

    def vm_action(self, user: User, action: str, vm_id: int) -> int:
        """one.vm.action: the VM's id."""
        with self.cloud.lock:
            return vm_action(self.cloud, action, vm_id, user)

    def vm_deploy(self, user: User, vm_id: int, host_id: int, enforce: bool = False, ds_id: int = -1,
                  extra: str = "") -> int:
        """one.vm.deploy: the VM's id (opennebula_sim.deploy)."""
        with self.cloud.lock:
            return vm_deploy(self.cloud, user, vm_id, host_id, enforce, ds_id)

    def vm_recover(self, user: User, vm_id: int, op: int) -> int:
        """one.vm.recover: the VM's id."""
        with self.cloud.lock:
            return vm_recover(self.cloud, vm_id, op)

    def vm_update(self, user: User, vm_id: int, text: str, update_type: int) -> int:
        """one.vm.update: replace (0) or merge into (1) the VM's USER_TEMPLATE; the VM's id."""
        tmpl = update_text(text, update_type)
        with self.cloud.lock:
            vm = self.cloud.vms.get(vm_id)
            if vm is None:
                raise OneError(S.NO_EXISTS, "", vm_id)
            self.cloud.locked_update_user_template(vm, tmpl, update_type == 1)
            return vm_id

    def onegate_put_vm(self, vm_id: str, token: str, body: str, content_type: str = "",
                       query: str = "") -> tuple[int, str]:
        """OneGate's `PUT /vm` (opennebula_sim.onegate.put_vm): (HTTP status, text)."""
        self.count("onegate.vm.update")
        return put_vm(self.cloud, vm_id, token, body, content_type, query)

    def vm_info(self, user: User, vm_id: int, decrypt: bool = False) -> str:
        """one.vm.info: the full <VM> body (DONE VMs included, as oned keeps them)."""
        with self.cloud.lock:
            vm = self.cloud.vms.get(vm_id)
            if vm is None:
                raise OneError(S.NO_EXISTS, "", vm_id)
            return self.xml.full(vm)

    def vmpool_info(self, user: User, who: int, start: int, end: int, state: int, query: str = "") -> str:
        """one.vmpool.info: short bodies."""
        with self.cloud.lock:
            chosen = self._select(user, who, start, end, state, query)
            return "<VM_POOL>" + "".join(map(self.xml.short, chosen)) + "</VM_POOL>"

    def vmpool_infoextended(self, user: User, who: int, start: int, end: int, state: int,
                            query: str = "") -> str:
        """one.vmpool.infoextended: full bodies."""
        with self.cloud.lock:
            chosen = self._select(user, who, start, end, state, query)
            return "<VM_POOL>" + "".join(map(self.xml.full, chosen)) + "</VM_POOL>"

    def _select(self, user: User, who: int, start: int, end: int, state: int, query: str) -> list[Vm]:
        if who < -4:
            raise OneError(S.XML_RPC_API, "Incorrect filter_flag")
        if state < -2 or state > S.CLONING_FAILURE:
            raise OneError(S.XML_RPC_API, "Incorrect filter_flag, state")
        terms = [t for t in query.split("&") if t]
        ids = sorted(self.cloud.vms, reverse=self.list_order == "DESC")
        chosen = []
        for vm_id in ids:
            vm = self.cloud.vms[vm_id]
            if not owner_matches(vm, who, user):
                continue
            if end >= -1 and start != -1 and (vm_id < start or (end != -1 and vm_id > end)):
                continue
            if (state == -1 and vm.state == S.DONE) or (state >= 0 and vm.state != state):
                continue
            if terms and not all(term_matches(vm, t) for t in terms):
                continue
            chosen.append(vm)
        if end < -1:  # pagination: `start` is an offset and -end the page size
            offset = max(start, 0)
            chosen = chosen[offset:offset - end]
        return chosen

    # ------------------------------------------------------------------ templates, hosts, system
    def templatepool_info(self, user: User, who: int, start: int, end: int) -> str:
        """one.templatepool.info: every template (all owned by oneadmin)."""
        if who < -4:
            raise OneError(S.XML_RPC_API, "Incorrect filter_flag")
        with self.cloud.lock:
            out = []
            for tid in sorted(self.cloud.templates, reverse=self.list_order == "DESC"):
                owner_ok = who in (-2, -4) or (who in (-3, -1) and user.uid == 0) or who == 0
                in_range = not (end >= -1 and start != -1 and (tid < start or (end != -1 and tid > end)))
                if owner_ok and in_range:
                    spec, tmpl = self.cloud.templates[tid]
                    out.append(vmtemplate_xml(spec, tmpl, self.cloud.regtime))
            return "<VMTEMPLATE_POOL>" + "".join(out) + "</VMTEMPLATE_POOL>"

    def template_info(self, user: User, template_id: int, extended: bool = False,
                      decrypt: bool = False) -> str:
        """one.template.info: one <VMTEMPLATE>."""
        with self.cloud.lock:
            if template_id not in self.cloud.templates:
                raise OneError(S.NO_EXISTS, "", template_id, obj="virtual machine template")
            spec, tmpl = self.cloud.templates[template_id]
            return vmtemplate_xml(spec, tmpl, self.cloud.regtime)

    def template_allocate(self, user: User, body: str) -> int:
        """one.template.allocate (`onetemplate create`): the new template's id. Names must be unique."""
        try:
            tmpl = parse_template(body)
        except TemplateSyntaxError as exc:
            raise OneError(S.INTERNAL, f"Parse error: {exc}") from None
        name = first(tmpl, "NAME")
        with self.cloud.lock:
            if any(spec.name == name for spec, _ in self.cloud.templates.values()):
                raise OneError(S.ALLOCATE, f"NAME is already taken by TEMPLATE {name}.",
                               obj="virtual machine template")
            template_id = max(self.cloud.templates, default=-1) + 1
            self.cloud.templates[template_id] = (TemplateSpec(template_id, name or f"template-{template_id}", body),
                                                 tmpl)
            return template_id

    def template_delete(self, user: User, template_id: int, recursive: bool = False) -> int:
        """one.template.delete: the template's id (its VMs are not touched)."""
        with self.cloud.lock:
            if self.cloud.templates.pop(template_id, None) is None:
                raise OneError(S.NO_EXISTS, "", template_id, obj="virtual machine template")
            return template_id

    def hostpool_info(self, user: User) -> str:
        """one.hostpool.info: every host with its PCI devices and allocated share."""
        with self.cloud.lock:
            now = int(self.cloud.clock())
            return "<HOST_POOL>" + "".join(host_xml(h, now) for h in self.cloud.hosts) + "</HOST_POOL>"

    def host_info(self, user: User, host_id: int, decrypt: bool = False) -> str:
        """one.host.info: one <HOST>."""
        with self.cloud.lock:
            if not 0 <= host_id < len(self.cloud.hosts):
                raise OneError(S.NO_EXISTS, "", host_id, obj="host")
            return host_xml(self.cloud.hosts[host_id], int(self.cloud.clock()))

    def system_version(self, user: User) -> str:
        """one.system.version: the configured oned version string."""
        return self.cloud.cfg.version

    def system_config(self, user: User) -> str:
        """one.system.config: oned.conf as <OPENNEBULA_CONFIGURATION> (a few of its attributes), DB hidden but
        for the oneadmin group (Nebula::get_configuration_xml)."""
        attrs = [("PORT", "2633"), ("DEFAULT_DEVICE_PREFIX", "hd"), ("VM_SUBMIT_ON_HOLD", "NO"),
                 *((f"VM_{level}_OPERATIONS", ops) for level, ops in OPERATIONS.items())]
        if self.cloud.cfg.onegate and self.cloud.onegate_endpoint:
            attrs.append(("ONEGATE_ENDPOINT", self.cloud.onegate_endpoint))
        body = "".join(f"<{k}><![CDATA[{v}]]></{k}>" for k, v in sorted(attrs))
        db = ("<BACKEND><![CDATA[sqlite]]></BACKEND><TIMEOUT><![CDATA[2500]]></TIMEOUT>" if user.gid == 0 else
              "<BACKEND><![CDATA[***]]></BACKEND><TIMEOUT><![CDATA[2500]]></TIMEOUT>")
        return f"<OPENNEBULA_CONFIGURATION><DB>{db}</DB>{body}</OPENNEBULA_CONFIGURATION>"

    def user_info(self, user: User, uid: int, decrypt: bool = False) -> str:
        """one.user.info of the session's own user (-1 or its id)."""
        if uid not in (-1, user.uid):
            raise OneError(S.AUTHORIZATION, "", obj="user")
        with self.cloud.lock:
            return user_xml(self.cloud, user)

    def group_info(self, user: User, gid: int, decrypt: bool = False) -> str:
        """one.group.info of the session user's group."""
        with self.cloud.lock:
            return group_xml(self.cloud, user, user.gid if gid == -1 else gid)

    def user_login(self, user: User, username: str, token: str, valid: int, group: int = -1) -> str:
        """one.user.login: a token usable as `username:token`; valid 0 revokes it, -1 never expires."""
        if username != user.uname:
            raise OneError(S.AUTHORIZATION, "", obj="user")
        token = token or secrets.token_hex(20)
        if valid == 0:
            self.tokens.pop(token, None)
        else:
            self.tokens[token] = None if valid < 0 else self.cloud.clock() + valid
        return token


def _object_of(method: str) -> str:
    family = method.rsplit(".", 1)[0]
    return _OBJECT.get(family, "virtual machine")


def _check_params(method: str, params: tuple[Any, ...], required: str, optional: str) -> None:
    if len(params) < len(required) or len(params) > len(required) + len(optional):
        most = len(required) + len(optional)
        raise xmlrpc.client.Fault(FAULT_TYPE, f"Type mismatch: {method} takes {len(required)} to {most} "
                                              f"parameters, got {len(params)}")
    for index, (value, kind) in enumerate(zip(params, required + optional, strict=False)):
        ok = {"s": isinstance(value, str), "b": isinstance(value, bool),
              "i": isinstance(value, int) and not isinstance(value, bool)}[kind]
        if not ok:
            wanted = {"s": "string", "b": "boolean", "i": "integer"}[kind]
            raise xmlrpc.client.Fault(FAULT_TYPE,
                                      f"Type mismatch: parameter {index} of {method} must be {wanted}")
