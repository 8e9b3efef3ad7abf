"""The simulator's OneGate: `PUT /vm`, what a guest writes into its VM's USER_TEMPLATE, as onegate-server
does it (served beside /RPC2 at CONTEXT's ONEGATE_ENDPOINT)."""

from __future__ import annotations

import re
import secrets
import urllib.parse

from opennebula_sim.cloud import Cloud
from opennebula_sim.templates import TemplateSyntaxError, parse_template


def put_vm(cloud: Cloud, vm_id: str, token: str, body: str, content_type: str = "",
           query: str = "") -> tuple[int, str]:
    """OneGate's `PUT /vm`: the guest merges `body` into its USER_TEMPLATE (e.g. READY=YES).

    Authenticated by the X-ONEGATE-VMID and X-ONEGATE-TOKEN headers: the token is the one the VM's
    CONTEXT TOKEN=YES gave it. The body goes through onegate-server's escape_attr first (bare values get
    quotes, so `KEY=two words` works and `KEY = "x"` breaks), and its restricted attributes are refused.
    Answers (HTTP status, text) as onegate-server does: 200 and an empty body, 401 `Not authorized`,
    403 `Attribute (KEY) cannot be modified`, 500 with the update's error.
    The onegate client sends a form (`data=READY%3DYES&type=1`; `--erase` sends type=2): like
    onegate-server (Sinatra's params[:data] and params[:type]) the data is taken from the query or a
    form body, and only without a `data` parameter is the raw body the attributes (curl's `-d READY=YES`).
    """
    attr, kind = onegate_params(body, content_type, query)
    with cloud.lock:
        vm = cloud.vms.get(int(vm_id)) if vm_id.strip().isdigit() else None
        if vm is None or not vm.onegate_token or not secrets.compare_digest(token, vm.onegate_token):
            return 401, "Not authorized"
        text = onegate_escape(attr)
        for line in text.split("\n"):
            key = line.split("=")[0]
            if key.upper() in ONEGATE_RESTRICTED:
                return 403, f"Attribute ({key}) cannot be {'modified' if kind == 1 else 'deleted'}"
        if kind != 1:  # delete_element("USER_TEMPLATE/<attr>"), then one.vm.update of what is left
            if attr not in vm.user_template:
                return 500, "attribute not found"
            rest = {k: list(v) for k, v in vm.user_template.items() if k != attr}
            cloud.locked_update_user_template(vm, rest, False)
            return 200, ""
        try:
            tmpl = parse_template(text)
        except TemplateSyntaxError as exc:
            return 500, f"[one.vm.update] Cannot update template. {exc}"
        cloud.locked_update_user_template(vm, tmpl, True)
        return 200, ""


# onegate-server.conf's :restricted_attrs: (the stock list): a guest may not set these.
ONEGATE_RESTRICTED = frozenset({"SCHED_REQUIREMENTS", "SERVICE_ID", "ROLE_NAME"})


def onegate_params(body: str, content_type: str, query: str) -> tuple[str, int]:
    """(attributes, type) of a PUT /vm as Sinatra's params give them to onegate-server's update."""
    params = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
    # Rack parses a body into params only for a form content type (a PUT without one stays raw).
    if content_type.split(";")[0].strip().lower() == "application/x-www-form-urlencoded":
        params.update(urllib.parse.parse_qsl(body, keep_blank_values=True))
    kind = params.get("type")
    digits = re.match(r"\s*[-+]?\d+", kind or "")  # Ruby's String#to_i: leading digits, else 0
    number = 1 if kind is None else int(digits.group()) if digits else 0
    data = params.get("data")
    return (body if data is None else data), number


def onegate_escape(attr: str) -> str:
    """onegate-server.rb's escape_attr, character by character: `KEY=value with spaces` -> `KEY="value with
    spaces"`, inside vectors too. (Ruby's attr[-1] at index 0 is the last character; Python's is too.)"""

    def at(index: int) -> str:
        return attr[index] if index < len(attr) else ""

    out: list[str] = []
    escape = False
    for idx, char in enumerate(attr):
        if char == "=" and escape:
            out.append(char)
        elif char == "=" and at(idx + 1) not in ("[", '"'):
            out.append('="')
            escape = True
        elif char == "," and at(idx - 1) != '"':
            out.append('",')
        elif char == "[" and at(idx - 1) not in ("=", '"'):
            out.append('"[')
        elif char == "]" and at(idx - 1) not in ("=", '"'):
            out.append('"]')
            escape = False
        elif char == "\\" and at(idx - 1) != '"':
            out.append('"\\')
            escape = False
        elif char == "\n" and at(idx - 1) != '"':
            out.append('"\n')
            escape = False
        else:
            out.append(char)
    text = "".join(out).replace("\\n", "\n")
    if escape and text[-1:] not in ("]", '"'):
        text += '"'
    return text
