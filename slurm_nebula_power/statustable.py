"""The `status` table: one row per node, Slurm's view joined with OpenNebula's, and what is wrong."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .capacity import Pool, gpu_requests, label, usage
from .config import Config
from .drift import Diagnosis, NodeView, diagnose, survey
from .errors import CloudError, first_line
from .model import ACTIVE, STATE_NAMES, cell, lcm_name, printable
from .nodestate import NodeState
from .operation import Cloud
from .protectlog import ProtectLog
from .shapes import PROLOG
from .slurmconf import read_if_any


def age(seconds: float | None) -> str:
    """3s, 4m05s, 2h07m, 3d04h."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def row(view: NodeView, diagnosis: Diagnosis, now: float) -> dict[str, Any]:
    """One node as a JSON-ready dict."""
    vm, st = view.vm, view.slurm
    return {
        "node": view.node,
        "nodeset": view.nodeset.nodes_expr if view.nodeset else None,
        "placement": view.nodeset.placement if view.nodeset else None,
        "slurm_state": st.state if st else None,
        "slurm_reason": st.reason if st else None,
        "vm_id": vm.id if vm else None,
        "vm_ids": sorted(v.id for v in view.vms),
        "vm_state": STATE_NAMES.get(vm.state, str(vm.state)) if vm else None,
        "lcm_state": lcm_name(vm.lcm_state) if vm and vm.state == ACTIVE else None,
        "ip": vm.ip if vm else None,
        "host": vm.host if vm else None,
        "age_seconds": int(now - vm.stime) if vm and vm.stime else None,
        "problems": list(diagnosis.problems),
    }


COLUMNS = ("NODE", "SLURM", "VM", "STATE", "IP", "HOST", "AGE", "PROBLEM")


def render(rows: Sequence[Mapping[str, Any]], slurm_asked: bool = True) -> str:
    """The readable table."""
    cells = []
    for r in rows:
        state = r["vm_state"] + (f"/{r['lcm_state']}" if r["lcm_state"] else "") if r["vm_state"] else "-"
        slurm = r["slurm_state"] or ("?" if slurm_asked else "n/a")
        cells.append((r["node"], cell(slurm), "-" if r["vm_id"] is None else str(r["vm_id"]), state,
                      cell(r["ip"] or "-"), cell(r["host"] or "-"), age(r["age_seconds"]),
                      printable("; ".join(r["problems"]))))
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(COLUMNS)]
    out = []
    for line in [COLUMNS, *cells]:
        out.append("  ".join(v.ljust(widths[i]) for i, v in enumerate(line[:-1])) + "  " + line[-1])
    return "\n".join(text.rstrip() for text in out)


def table_rows(config: Config, cloud: Cloud, states: Mapping[str, NodeState] | None,
               nodes: Sequence[str] | None = None,
               now: Callable[[], float] = time.time) -> list[dict[str, Any]]:
    """Survey and diagnose: the rows of the status table."""
    views = survey(config, cloud, states, nodes, hosts=True)
    when = now()
    rows = [row(v, diagnose(v, when, config.power.reconcile_grace, states is not None), when) for v in views]
    protected = protected_sets(config, when)
    for entry in rows:
        if entry["nodeset"] in protected:
            entry["problems"].append(protected[entry["nodeset"]])
    return rows


def protected_sets(config: Config, now: float) -> dict[str, str]:
    """Node set -> what status says of it while it is in protected mode (protectlog.py)."""
    store, period = ProtectLog.of(config), config.power.protect_for
    found = {ns.nodes_expr: store.read(ns.nodes_expr) for ns in config.nodesets}
    return {nodes: f"{state.summary(now, period)}: {state.fix}" for nodes, state in found.items()
            if state is not None and state.active(now, period)}


def placement_line(config: Config) -> str:
    """Who places each node set's VMs: oned's scheduler, or resume itself (placement = "direct")."""
    return "Placement: " + ", ".join(f"{ns.nodes_expr} {ns.placement}" for ns in config.nodesets) + (
        " (direct: resume deploys each VM to a host it chose)" if any(ns.placement == "direct"
                                                                       for ns in config.nodesets) else "")


def prolog_line(config: Config) -> str | None:
    """The footer: whether slurm.conf's PrologSlurmctld is ours (None when slurm.conf cannot be read)."""
    conf = read_if_any(config.slurm.slurm_conf)
    if conf is None:
        return None
    prolog = conf.params.get("prologslurmctld", "")
    if os.path.basename(prolog) == PROLOG:
        chain = f", then {config.slurm.prolog_chain}" if config.slurm.prolog_chain else ""
        return f"PrologSlurmctld: {PROLOG}{chain} (a job starts as soon as its cloud nodes are up)"
    return (f"PrologSlurmctld: {prolog or 'not set'}, not {PROLOG}: a job starts only at slurmctld's next "
            "30 s check after its cloud nodes are up (see check)")


# ---- capacity (`status --capacity`) ------------------------------------------------------------------


def capacity(config: Config, cloud: Cloud) -> list[dict[str, Any]]:
    """Per GPU node set: what one VM needs, and per host the matching devices free, ours and others'.

    One host pool query, one VM pool query (our VMs: tagged for this cluster and node), plus the templates
    (a node set whose template has no GPU is left out). `free` totals only hosts that take new VMs
    (MONITORED); a disabled or offline host's free devices are shown per host but not counted.
    """
    cluster = config.slurm.cluster
    mine = {vm.id for vm in cloud.cluster_vms(cluster) if vm.is_ours(cluster, vm.name)}
    hosts = cloud.hosts()
    out: list[dict[str, Any]] = []
    for nodeset in config.nodesets:
        entry: dict[str, Any] = {"nodeset": nodeset.nodes_expr}
        try:
            requests = gpu_requests(cloud.template(cloud.template_id(nodeset.template)))
        except CloudError as exc:
            out.append({**entry, "error": f"template {nodeset.template}: {first_line(exc)}"})
            continue
        if not requests:
            continue
        per_host = usage(hosts, requests, mine)
        out.append({**entry, "gpu": label(requests), "gpus_per_vm": len(requests),
                    "free": Pool(hosts).free(requests), "ours": sum(u.ours for u in per_host),
                    "others": sum(u.others for u in per_host),
                    "hosts": [{"host": u.host, "state": u.state, "placeable": u.placeable, "free": u.free,
                               "ours": u.ours, "others": u.others} for u in per_host]})
    return out


def render_capacity(items: Sequence[Mapping[str, Any]]) -> str:
    """The capacity section below the node table."""
    lines: list[str] = []
    for item in items:
        if "error" in item:
            lines.append(f"CAPACITY {item['nodeset']}: {item['error']}")
            continue
        lines.append(f"CAPACITY {item['nodeset']}: GPU {item['gpu']} x{item['gpus_per_vm']} per VM: "
                     f"{item['free']} free, {item['ours']} held by our VMs, {item['others']} by others")
        cells = [(cell(h["host"]), h["state"] + ("" if h["placeable"] else " (takes no VM)"), str(h["free"]),
                  str(h["ours"]), str(h["others"])) for h in item["hosts"]]
        head = ("  HOST", "STATE", "FREE", "OURS", "OTHERS")
        cells = [(f"  {c[0]}", *c[1:]) for c in cells]
        widths = [max(len(line[i]) for line in [head, *cells]) for i in range(len(head))]
        lines += ["  ".join(v.ljust(widths[i]) for i, v in enumerate(line)).rstrip() for line in [head, *cells]]
    return "\n".join(lines)
