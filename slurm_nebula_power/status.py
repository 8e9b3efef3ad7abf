"""`status`: one row per node, Slurm's view joined with OpenNebula's, and what is wrong (reconcile too)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .cloud import ACTIVE, HOLD, PENDING, STATE_NAMES, Vm, lcm_name
from .errors import EXIT_NODES_FAILED, EXIT_OK, PowerError, SlurmError
from .power import OFF_STATES, SATISFIED, plan_resume
from .slurm import NodeState, parse_show_node

if TYPE_CHECKING:
    from .config import Config, NodeSet
    from .power import Cloud

log = logging.getLogger(__name__)

# Where a node is in Slurm's power cycle, from its state flags.
OFF, STOPPING, STARTING, UP, OTHER = "off", "stopping", "starting", "up", "other"
UP_STATES = ("IDLE", "ALLOCATED", "MIXED", "COMPLETING")
# LCM states of a VM on its way up (LCM_INIT 0, PROLOG 1, BOOT 2).
STARTING_LCM = (0, 1, 2)


def phase(state: NodeState) -> str:
    """off | stopping | starting | up | other (DOWN, FUTURE, ...)."""
    flags = state.flags
    base = state.state.split("+", 1)[0].rstrip("*~#%!$@^-").upper()
    if "POWERING_UP" in flags:
        return STARTING
    if "POWERED_DOWN" in flags:
        return OFF
    if flags & {"POWERING_DOWN", "POWER_DOWN"}:
        return STOPPING
    return UP if base in UP_STATES else OTHER


def slurm_states(scontrol: Any) -> dict[str, NodeState]:
    """Every node slurmctld shows (one `scontrol show node -o`); SlurmError when it cannot be asked."""
    return parse_show_node(scontrol.run("show", "node", "-o"))


@dataclass
class NodeView:
    """One node as both sides see it."""

    node: str
    nodeset: NodeSet | None
    slurm: NodeState | None  # None: unknown to slurmctld (or Slurm not asked)
    vms: list[Vm] = field(default_factory=list)  # ours, live

    @property
    def vm(self) -> Vm | None:
        """The VM that counts (running before booting before off before failed)."""
        return plan_resume(self.vms).vm if self.vms else None


def survey(config: Config, cloud: Cloud, states: Mapping[str, NodeState] | None,
           nodes: Sequence[str] | None = None) -> list[NodeView]:
    """One pool query joined with Slurm's states; nodes=None adds our VMs of nodes in no node set."""
    cluster = config.slurm.cluster
    wanted = list(nodes) if nodes is not None else config.all_nodes
    views = {node: NodeView(node, config.nodeset_for(node), (states or {}).get(node)) for node in wanted}
    for vm in cloud.cluster_vms(cluster):
        if not vm.is_ours(cluster, vm.name):
            continue  # foreign: never listed, never touched
        if vm.name not in views and nodes is None:
            views[vm.name] = NodeView(vm.name, None, (states or {}).get(vm.name))
        if vm.name in views:
            views[vm.name].vms.append(vm)
    return list(views.values())


@dataclass(frozen=True)
class Repair:
    """What reconcile does for a node: terminate these VMs, then maybe hand the node back."""

    terminate: tuple[Vm, ...]
    hand_back: bool
    reason: str


@dataclass(frozen=True)
class Diagnosis:
    """What is wrong with a node, and the repair when reconcile may make one."""

    problems: tuple[str, ...] = ()
    repair: Repair | None = None


def words(vm: Vm) -> str:
    """A VM's STATE, with LCM_STATE when ACTIVE: ACTIVE/BOOT, PENDING, POWEROFF."""
    return vm.state_name


def starting(vm: Vm) -> bool:
    """PENDING, HOLD, or ACTIVE on its way to RUNNING."""
    return vm.state in (PENDING, HOLD) or (vm.state == ACTIVE and vm.lcm_state in STARTING_LCM)


def _pending_why(vm: Vm) -> str:
    return ": no host with a free GPU" if vm.state == PENDING and vm.sched_message else ""


def diagnose(view: NodeView, now: float, grace: float, slurm_asked: bool = True) -> Diagnosis:
    """What is wrong with one node; the repair follows the reconcile rules (see docs/OPERATOR.md)."""
    nodeset, vm, st = view.nodeset, view.vm, view.slurm
    if nodeset is None:
        if vm is None:
            return Diagnosis(("in no [[nodeset]] of the configuration",))
        return Diagnosis((f"VM {vm.id} tagged for this cluster but the node is in no [[nodeset]]: "
                          "left alone",))
    problems: list[str] = []
    if len(view.vms) > 1:
        ids = ", ".join(str(i) for i in sorted(v.id for v in view.vms))
        problems.append(f"{len(view.vms)} VMs for one node: {ids}")
    if st is None:
        if slurm_asked:
            problems.append("unknown to slurmctld (not in slurm.conf, or hidden: 22.05 needs "
                            "PrivateData=cloud)")
        if vm is not None and vm.failed:
            problems.append(f"VM failed ({words(vm)})")
        elif vm is not None and _pending_why(vm):
            problems.append(f"VM PENDING{_pending_why(vm)}")
        return Diagnosis(tuple(problems))
    where = phase(st)
    base = st.state.split("+", 1)[0].upper()
    if base == "DOWN" or "DRAIN" in st.flags:
        problems.append(f"Slurm {'DOWN' if base == 'DOWN' else 'DRAIN'}: {st.reason or 'no reason given'}")
    if vm is not None and vm.ip and where in (UP, STARTING) and st.addr not in ("", view.node, vm.ip):
        problems.append(f"Slurm NodeAddr {st.addr} but VM IP {vm.ip}")
    repair = None
    if where == OFF:
        alive = [v for v in view.vms if v.state not in SATISFIED[nodeset.suspend_action]]
        if alive:
            old = tuple(v for v in alive if now - v.stime >= grace)
            problems.append(f"VM {words(alive[0])} but node powered down"
                            + ("" if old else f" (within reconcile_grace {grace:g}s)"))
            repair = Repair(old, False, "VM alive while its node is powered down") if old else None
    elif vm is not None and starting(vm) and where in (UP, STARTING):
        late = now - vm.stime >= nodeset.boot_timeout
        if where == STARTING and _pending_why(vm):
            problems.append(f"node powering up, VM PENDING{_pending_why(vm)}")
        elif where == UP:
            problems.append(f"node up but VM {words(vm)}")
        if late:
            reason = f"VM {words(vm)} past boot_timeout {nodeset.boot_timeout:g}s{_pending_why(vm)}"
            problems.append(f"{words(vm)} for longer than boot_timeout {nodeset.boot_timeout:g}s")
            repair = Repair(tuple(view.vms), True, reason)
    elif where == UP:
        if vm is None:
            problems.append("node up in Slurm but it has no VM")
            repair = Repair((), True, "its VM is gone")
        elif vm.failed:
            problems.append(f"node up but VM failed ({words(vm)})")
            repair = Repair(tuple(view.vms), True, f"VM failed ({words(vm)})")
        elif vm.state in OFF_STATES:
            problems.append(f"node up but VM {words(vm)}")
            repair = Repair((), True, f"VM {words(vm)}")
    elif vm is not None and vm.failed:
        problems.append(f"VM failed ({words(vm)})")
    return Diagnosis(tuple(problems), repair)


# ---- the table ----------------------------------------------------------------------------------------


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
        cells.append((r["node"], slurm, "-" if r["vm_id"] is None else str(r["vm_id"]), state, r["ip"] or "-",
                      r["host"] or "-", age(r["age_seconds"]), "; ".join(r["problems"])))
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(COLUMNS)]
    out = []
    for line in [COLUMNS, *cells]:
        out.append("  ".join(v.ljust(widths[i]) for i, v in enumerate(line[:-1])) + "  " + line[-1])
    return "\n".join(text.rstrip() for text in out)


def table_rows(config: Config, cloud: Cloud, states: Mapping[str, NodeState] | None,
               nodes: Sequence[str] | None = None,
               now: Callable[[], float] = time.time) -> list[dict[str, Any]]:
    """Survey and diagnose: the rows of the status table."""
    views = survey(config, cloud, states, nodes)
    when = now()
    return [row(v, diagnose(v, when, config.power.reconcile_grace, states is not None), when) for v in views]


def prolog_line(config: Config) -> str | None:
    """The footer: whether slurm.conf's PrologSlurmctld is ours (None when slurm.conf cannot be read)."""
    from .slurmconf import PROLOG, read_slurm_conf

    if config.slurm.slurm_conf is None:
        return None
    try:
        conf = read_slurm_conf(config.slurm.slurm_conf)
    except PowerError:
        return None
    prolog = conf.params.get("prologslurmctld", "")
    if os.path.basename(prolog) == PROLOG:
        chain = f", then {config.slurm.prolog_chain}" if config.slurm.prolog_chain else ""
        return f"PrologSlurmctld: {PROLOG}{chain} (a job starts as soon as its cloud nodes are up)"
    return (f"PrologSlurmctld: {prolog or 'not set'}, not {PROLOG}: a job starts only at slurmctld's next "
            "30 s check after its cloud nodes are up (see check)")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """slurm-nebula-power status [HOSTLIST]: Slurm state, VM and what is wrong, per node."""
    from .cli import build_context, load, make_parser, parse, setup_logging
    from .hostlists import expand

    prog = "slurm-nebula-power status"
    env = os.environ if environ is None else environ
    parser = make_parser(prog, "One row per node: Slurm state (scontrol), VM id, VM state in words, IP, host, "
                     "age, and what is wrong.")
    parser.epilog = ("exit: 0 nothing wrong, 1 some node has a problem, 2 usage, 3 configuration, "
                     "4 OpenNebula unreachable")
    parser.add_argument("hostlist", nargs="?", help="nodes to show (default: every configured node, and VMs "
                        "of this cluster whose node is in no node set)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows instead of the table")
    parser.add_argument("--no-slurm", action="store_true", help="do not ask slurmctld (Slurm columns empty)")
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        config = load(args, env)
        setup_logging(prog, None)
        logging.getLogger("slurm_nebula_power").setLevel(logging.WARNING)
        nodes = expand(args.hostlist) if args.hostlist else None
        states = None
        context = None
        if not args.no_slurm:
            try:
                context = build_context(config, env)
                states = slurm_states(context.slurm)
            except SlurmError as exc:
                print(f"{prog}: warning: Slurm state unavailable: {exc}", file=sys.stderr)
        if context is None:
            from .cloud import OneCloud

            cloud: Cloud = OneCloud(config.opennebula)
        else:
            cloud = context.cloud
        rows = table_rows(config, cloud, states, nodes)
    except PowerError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    footer = None if args.json else prolog_line(config)
    print(json.dumps(rows, indent=2) if args.json else render(rows, not args.no_slurm))
    if footer:
        print(footer)
    return EXIT_NODES_FAILED if any(r["problems"] for r in rows) else EXIT_OK
