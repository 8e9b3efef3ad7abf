"""`check`: what would make a deployment fail later, found now; one line per problem with its fix."""

from __future__ import annotations

import math
import os
import pwd
import re
import shlex
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from .capacity import Pool, gpu_requests, label
from .config import Config, NodeSet, find_config, load_config
from .errors import CloudAuthError, CloudError, ConfigError, HostlistError, PowerError, first_line
from .findings import Report, X, check_files, check_ownership, check_transport
from .hostlists import expand, fold, split_top_level
from .operation import Cloud
from .prolog import MARGIN
from .shapes import (
    MEMORY_RATIO,
    PROGRAMS,
    PROLOG,
    RESUME_MARGIN,
    SUSPEND_MARGIN,
    Shape,
    program_path,
    read_shapes,
    real_memory,
)
from .slurm import find_scontrol, slurm_version
from .slurmconf import SlurmConf, gres_gpus, node_cpus, read_slurm_conf

STOCK_ACTIONS_PER_CLUSTER = 30  # oned.conf MAX_ACTIONS_PER_CLUSTER as shipped (7.0, 7.4)
STOCK_MAX_CONN = 15  # oned.conf MAX_CONN (XML-RPC connections served at once) as shipped
# Seconds from one placement plan to the next with the stock scheduler settings, as measured on the dummy
# drivers with waves of one VM per host (bench/README.md, "Real oned": 10.3 s on 7.0.2, 13.4 s on 7.4.0).
PLAN_SECONDS = 14
MEMORY_TIGHT = 0.97  # RealMemory above this share of MEMORY is likely above what the guest reports


# ---- OpenNebula ---------------------------------------------------------------------------------------


def check_cloud(report: Report, config: Config, cloud: Cloud) -> Cloud | None:
    """Endpoint reachable, credentials accepted, VMs listable, oned version; the cloud when usable."""
    one = config.opennebula
    subject = f"OpenNebula {one.endpoint}"
    try:
        version = cloud.version()
        cloud.cluster_vms(config.slurm.cluster)
    except CloudAuthError as exc:
        report.problem(subject, f"user {one.user} refused: {first_line(exc)}",
                       f"put valid credentials (user:password or user:token) in {one.auth_file}")
        return None
    except CloudError as exc:
        report.problem(subject, f"unreachable: {first_line(exc)}",
                       "check [opennebula] endpoint, that oned runs, and the firewall")
        return None
    major = re.match(r"(\d+)", version)
    if major and int(major.group(1)) < 6:
        report.warn(subject, f"oned {version} is older than 6.0, which this tool was not tested with",
                    "upgrade OpenNebula")
    else:
        report.ok(subject, f"oned {version}, user {one.user}, VM pool readable")
    return cloud


def check_templates(report: Report, config: Config, cloud: Cloud, conf: SlurmConf | None) -> None:
    """Each node set's template exists, has its GPUs, and matches slurm.conf's CPUs, memory and Gres."""
    for nodeset, shape, error in read_shapes(config, cloud):
        subject = f"node set {nodeset.nodes_expr} template {nodeset.template!r}"
        if shape is None:
            report.problem(subject, error, "create the template in OpenNebula or fix the node set's template "
                           "(a name visible to the user, or the numeric id)")
            continue
        want = nodeset.options.get("gpus")
        if shape.gpus == 0 and want != 0:
            report.problem(subject, "has no PCI GPU", 'add PCI = [ VENDOR = "10de", CLASS = "0302" ] to the '
                           "template, or set gpus = 0 in the node set when these nodes have no GPU")
        elif want is not None and want != shape.gpus:
            report.problem(subject, f"gives {shape.gpus} GPU(s) but the node set says gpus = {want}",
                           "make the template's PCI entries and the node set's gpus agree")
        else:
            report.ok(subject, f"{shape.source}: {shape.vcpus} vCPU, {shape.memory_mb} MiB, {shape.gpus} GPU")
        if conf is not None:
            _against_slurm_conf(report, nodeset, shape, conf)


def _wants_token(template: Mapping[str, Any]) -> bool:
    context = template.get("CONTEXT")
    contexts = context if isinstance(context, list) else [context]
    return any(isinstance(c, Mapping) and str(c.get("TOKEN", "")).upper() == "YES" for c in contexts)


def check_onegate(report: Report, config: Config, cloud: Cloud) -> None:
    """Templates with CONTEXT TOKEN = "YES" need oned.conf's ONEGATE_ENDPOINT: oned refuses them without it."""
    tokened: list[str] = []
    for nodeset in config.nodesets:
        try:
            if _wants_token(cloud.template(cloud.template_id(nodeset.template))):
                tokened.append(nodeset.nodes_expr)
        except CloudError:
            continue  # check_templates has said why
    if not tokened:
        return
    subject = "oned.conf ONEGATE_ENDPOINT"
    whose = f"the templates of {', '.join(tokened)} have CONTEXT TOKEN = \"YES\""
    try:
        endpoint = cloud.onegate_endpoint()
    except CloudError as exc:
        report.warn(subject, f"unreadable (one.system.config: {first_line(exc)}); {whose}, which oned refuses "
                    "to instantiate without it", "make sure oned.conf on the front end sets ONEGATE_ENDPOINT")
        return
    if endpoint:
        report.ok(subject, f"{endpoint} ({whose})")
    else:
        report.problem(subject, f"not set, and {whose}: oned refuses every instantiate (\"TOKEN set, but onegate "
                       "endpoint was not defined in oned.conf.\"), whatever wait_for says",
                       "set ONEGATE_ENDPOINT in oned.conf to OneGate's URL as the VMs reach it (e.g. "
                       "http://<front end>:5030), restart oned and run onegate-server")


def check_capacity(report: Report, config: Config, cloud: Cloud) -> None:
    """The host pool is readable, so resume can count free GPUs before it instantiates; what it sees now."""
    subject = "OpenNebula host pool"
    fix = (f'let user {config.opennebula.user} see the GPU hosts (an ACL rule such as oneacl create '
           '"#<uid> HOST/* USE")')
    try:
        hosts = cloud.hosts()
    except CloudError as exc:
        report.warn(subject, f"unreadable ({first_line(exc)}): resume cannot count free GPUs before it "
                    "instantiates and relies on pending_timeout alone", fix)
        check_bursts(report, config, None)
        return
    if not hosts:
        report.warn(subject, "no host visible: resume cannot count free GPUs before it instantiates", fix)
        check_bursts(report, config, None)
        return
    placeable = [h for h in hosts if h.placeable]
    parts = []
    for nodeset in config.nodesets:
        try:
            requests = gpu_requests(cloud.template(cloud.template_id(nodeset.template)))
        except CloudError:
            continue  # check_templates reports it
        if requests:
            parts.append(f"{nodeset.nodes_expr}: {Pool(hosts).free(requests)} GPU {label(requests)} free")
    report.ok(subject, f"{len(hosts)} hosts, {len(placeable)} take VMs" + "".join(f"; {p}" for p in parts))
    check_bursts(report, config, len(placeable))


def check_bursts(report: Report, config: Config, placeable: int | None) -> None:
    """How a burst reaches oned's scheduler: max_pending against the oned.conf settings that place it.

    oned.conf cannot be read over XML-RPC, so the settings are named with their stock values; the warning
    is for a max_pending above the stock MAX_ACTIONS_PER_CLUSTER, the range where bursts were not measured
    to run (300 at once stalled 7.0.2 and 7.4.0 for good, bench/README.md "Real oned")."""
    subject = "[opennebula] max_pending"
    pending = config.opennebula.max_pending
    per_plan = min(pending, STOCK_ACTIONS_PER_CLUSTER, placeable) if placeable else None
    rate = f"; {placeable} hosts take VMs: at most {per_plan} VMs a plan with the stock settings" if per_plan else ""
    settings = ("oned places at most MAX_HOST (schedulers/rank.conf on 7.x, stock 1) VMs per host and "
                f"MAX_ACTIONS_PER_CLUSTER (oned.conf, stock {STOCK_ACTIONS_PER_CLUSTER}) per plan, a plan "
                "after SCHED_MAX_WND_TIME (stock 10 s) or SCHED_MAX_WND_LENGTH (stock 7) new VMs")
    if pending > STOCK_ACTIONS_PER_CLUSTER:
        report.warn(subject, f"up to {pending} VMs at once for oned to place, above its stock MAX_ACTIONS_PER_CLUSTER "
                    f"{STOCK_ACTIONS_PER_CLUSTER}: a burst beyond what a plan dispatches can stall oned's "
                    f"scheduler ({settings}{rate})",
                    f"set max_pending = {STOCK_ACTIONS_PER_CLUSTER} or below, unless oned.conf's "
                    "MAX_ACTIONS_PER_CLUSTER is at least max_pending")
    else:
        report.ok(subject, f"at most {pending} VMs at once for oned to place (PENDING without a shortage "
                  "message, or being sent), and at most one per host that takes VMs (what a plan places with "
                  f"MAX_HOST 1), the next wave once oned placed the last; {settings}{rate}")
    if per_plan:
        check_burst_time(report, config, per_plan)
    parallel = config.opennebula.max_parallel
    if parallel >= STOCK_MAX_CONN:
        # Each thread keeps its connection alive; oned serves MAX_CONN of them and lets the others wait in
        # the backlog until one idles out (KEEPALIVE_TIMEOUT 15 s): seen as instantiates that got no answer
        # within 30 s from oned 7.0.2 with 32 threads (bench/README.md, "Real oned").
        report.warn("[opennebula] max_parallel", f"{parallel} connections at once (and one more that polls), "
                    f"oned's stock MAX_CONN is {STOCK_MAX_CONN}: the calls beyond it wait for a kept-alive "
                    "connection to idle out (KEEPALIVE_TIMEOUT, stock 15 s) and can time out",
                    f"set max_parallel = {STOCK_MAX_CONN - 3} or lower (other clients need connections too), or "
                    "raise MAX_CONN in oned.conf above max_parallel")


def check_burst_time(report: Report, config: Config, per_plan: int) -> None:
    """How long a resume of every node at once takes to send them all, against each node set's boot_timeout.

    Resume sends a wave of at most per_plan VMs per placement plan; a node still unsent boot_timeout after
    the run began is handed back (resume.py), so a node set whose boot_timeout is shorter than the time to
    send the last wave loses its last nodes in a burst of the whole cluster."""
    total = len(config.all_nodes)
    waves = math.ceil(total / per_plan)
    if waves < 2:
        return
    last = (waves - 1) * PLAN_SECONDS
    how = (f"a resume of all {total} nodes at once goes out in {waves} waves of at most {per_plan} VMs (one a "
           f"placement plan), the last about {last} s after the first at {PLAN_SECONDS} s a plan with oned's "
           "stock scheduler settings")
    short = [ns for ns in config.nodesets if ns.boot_timeout <= last]
    if not short:
        report.ok("[opennebula] bursts", f"{how}: within every node set's boot_timeout")
    for nodeset in short:
        boot = math.ceil(last + nodeset.boot_timeout)
        report.warn(f"node set {nodeset.nodes_expr} boot_timeout",
                    f"{how}: above its boot_timeout {nodeset.boot_timeout:g} s, so its nodes still unsent by "
                    "then are handed back to Slurm as failed",
                    f"set boot_timeout = {boot} (the time to send them all plus the boot time allowed now) and "
                    f"ResumeTimeout={boot + RESUME_MARGIN}, or let more hosts take VMs")


def _against_slurm_conf(report: Report, nodeset: NodeSet, shape: Shape, conf: SlurmConf) -> None:
    groups: dict[tuple[int, int, int], list[str]] = defaultdict(list)
    for node in nodeset.nodes:
        keys = conf.nodes.get(node)
        if keys is not None:
            memory = int(keys["realmemory"]) if keys.get("realmemory", "").isdigit() else 1
            groups[(node_cpus(keys), memory, gres_gpus(keys.get("gres", "")))].append(node)
    for (cpus, memory, gpus), nodes in groups.items():
        subject, fitting = f"slurm.conf NodeName={fold(nodes)}", real_memory(shape.memory_mb)
        if cpus > shape.vcpus:
            report.problem(subject, f"CPUs={cpus} but {shape.source} gives {shape.vcpus} vCPUs: slurmd "
                           "registers fewer and the node is drained", f"set CPUs={shape.vcpus}")
        elif cpus < shape.vcpus:
            report.warn(subject, f"CPUs={cpus} uses only {cpus} of the VM's {shape.vcpus} vCPUs",
                        f"set CPUs={shape.vcpus}")
        if memory > shape.memory_mb:
            report.problem(subject, f"RealMemory={memory} is above the VM's MEMORY {shape.memory_mb} MiB: "
                           "the node is drained (Low RealMemory)", f"set RealMemory={fitting}")
        elif memory > shape.memory_mb * MEMORY_TIGHT:
            report.warn(subject, f"RealMemory={memory} is above {MEMORY_TIGHT:.0%} of MEMORY "
                        f"{shape.memory_mb} MiB; the guest kernel keeps some, the node may be drained",
                        f"set RealMemory={fitting} ({MEMORY_RATIO:.0%})")
        if gpus != shape.gpus:
            report.problem(subject, f"Gres has {gpus} GPU(s) but {shape.source} gives {shape.gpus}",
                           f"set Gres=gpu:{shape.gpus}" if shape.gpus else "remove gpu from Gres")


# ---- slurm.conf ---------------------------------------------------------------------------------------


def check_coverage(report: Report, config: Config, conf: SlurmConf) -> None:
    """Every State=CLOUD node in a node set; every node-set node a CLOUD node of slurm.conf."""
    cloud, known, configured = set(conf.cloud_nodes), set(conf.nodes), set(config.all_nodes)
    before = len(report.problems)
    if cloud - configured:
        report.problem(f"slurm.conf {fold(sorted(cloud - configured))}", "State=CLOUD but in no [[nodeset]]: "
                       "resume refuses them", "add them to a node set's nodes, or drop State=CLOUD")
    for nodeset in config.nodesets:
        missing = [n for n in nodeset.nodes if n not in known]
        static = [n for n in nodeset.nodes if n in known and n not in cloud]
        if missing:
            report.problem(f"node set {nodeset.nodes_expr}", f"{fold(missing)} not in slurm.conf",
                           "add NodeName lines with State=CLOUD (slurm-nebula-power slurm-conf prints them)")
        if static:
            report.problem(f"node set {nodeset.nodes_expr}", f"{fold(static)} not State=CLOUD in slurm.conf: "
                           "slurmctld never powers them up or down", "add State=CLOUD to their NodeName line")
    if len(report.problems) == before:
        report.ok(f"slurm.conf {conf.path}", f"{len(cloud)} State=CLOUD nodes, all in node sets")


def check_suspend_exclusions(report: Report, config: Config, conf: SlurmConf) -> None:
    """SuspendExcNodes and SuspendExcParts that keep node-set nodes powered up while idle: their VMs, and their
    GPUs, stay. A count (gpu[01-16]:2: two of them kept up) is a warm pool, and said as such."""
    ours = set(config.all_nodes)
    kept, pools = [], []
    for item in _top_level(conf.get("SuspendExcNodes")):
        expression, count = (item.rsplit(":", 1) if re.search(r":\d+\Z", item) else (item, ""))
        names = [n for n in _names(conf, expression) if n in ours]
        if names and count:
            pools.append(f"{count} of {fold(names)}")
        else:
            kept += names
    if kept:
        report.warn("slurm.conf SuspendExcNodes", f"{fold(kept)} never powered down: their VMs, and GPUs, stay "
                    "up while the nodes are idle", "remove them from SuspendExcNodes, or keep only a few up with "
                    f"a count ({fold(kept)}:1)")
    if pools:
        report.ok("slurm.conf SuspendExcNodes", f"keeps {', '.join(pools)} powered up when idle")
    for part in _top_level(conf.get("SuspendExcParts")):
        names = [n for n in _names(conf, conf.partitions.get(part, "")) if n in ours]
        if names:
            report.warn("slurm.conf SuspendExcParts", f"partition {part}'s {fold(names)} never powered down: "
                        "their VMs, and GPUs, stay up while the nodes are idle",
                        f"remove {part} from SuspendExcParts, or keep a few up with SuspendExcNodes and a count")


def _top_level(value: str) -> list[str]:
    """A slurm.conf list whose items may be hostlists, each stripped, empty ones left out."""
    return [item.strip() for item in split_top_level(value) if item.strip()]


def _names(conf: SlurmConf, expression: str) -> list[str]:
    """The nodes a slurm.conf node expression names (ALL: every node); [] for what is not a hostlist (a
    NodeSet name names no node of ours either way)."""
    if expression.upper() == "ALL":
        return list(conf.nodes)
    try:
        return expand(expression) if expression else []
    except HostlistError:
        return []


def check_timers(report: Report, config: Config, conf: SlurmConf) -> None:
    """ResumeTimeout above boot_timeout; SuspendTimeout above the suspend bound; poweroff flagged."""
    longest = max(ns.boot_timeout for ns in config.nodesets)
    resume = conf.seconds("ResumeTimeout")
    if resume is None or resume <= longest:
        report.problem("slurm.conf ResumeTimeout", f"{conf.get('ResumeTimeout')} s is not above the longest "
                       f"boot_timeout {longest:g} s: Slurm gives up on nodes still booting",
                       f"set ResumeTimeout={math.ceil(longest) + RESUME_MARGIN}, or lower boot_timeout")
    else:
        report.ok("slurm.conf ResumeTimeout", f"{resume} s, above the longest boot_timeout {longest:g} s")
    bound = config.power.suspend_timeout
    suspend = conf.seconds("SuspendTimeout")
    actions = "/".join(sorted({ns.suspend_action for ns in config.nodesets}))
    if suspend is None or suspend < bound:
        report.problem("slurm.conf SuspendTimeout", f"{conf.get('SuspendTimeout')} s is below [power] "
                       f"suspend_timeout {bound:g} s: a {actions} may still run when slurmctld reuses the "
                       "node name, and a quick resume meets the old VM",
                       f"set SuspendTimeout={math.ceil(bound) + SUSPEND_MARGIN}, or lower suspend_timeout")
    else:
        report.ok("slurm.conf SuspendTimeout", f"{suspend} s, enough for {actions} ([power] suspend_timeout "
                  f"{bound:g} s)")


def check_poweroff(report: Report, config: Config) -> None:
    """suspend_action = poweroff holds the GPU of every idle node."""
    for nodeset in config.nodesets:
        if nodeset.suspend_action == "poweroff":
            report.problem(f"node set {nodeset.nodes_expr}", 'suspend_action = "poweroff": a powered-off VM '
                           "keeps its GPU reserved on its host while the node is idle",
                           'use "terminate" (or "undeploy" to keep the disks)')


def check_programs(report: Report, conf: SlurmConf, version: tuple[int, int] | None) -> None:
    """Resume/Suspend/ResumeFail programs are ours and executable (also through a PowerAction);
    PrivateData=cloud."""
    for key, name in PROGRAMS.items():
        value, (expected, _) = conf.params.get(key.lower(), ""), program_path(name)
        if value in conf.actions:
            program = _action_program(report, key, value, conf.actions[value], str(expected))
            if program is None:
                continue
            value = program
        if os.path.basename(value) != name:
            report.problem(f"slurm.conf {key}", f"is {value or 'not set'}, not {name}", f"{key}={expected}")
        elif not os.access(value, X):
            report.problem(f"slurm.conf {key}", f"{value} does not exist or is not executable",
                           f"install slurm-nebula-power there, or {key}={expected}")
        else:
            report.ok(f"slurm.conf {key}", value)
    private = [p.strip().lower() for p in conf.get("PrivateData").split(",")]
    if (version is None or version < (23, 2)) and "cloud" not in private:
        report.problem("slurm.conf PrivateData", "lacks cloud: Slurm 22.05 hides powered-down cloud nodes, "
                       "so status and reconcile cannot see them", "add cloud to PrivateData")
    check_release_settings(report, conf, version)


def _action_program(report: Report, key: str, action: str, keys: Mapping[str, str], expected: str) -> str | None:
    """The program a PowerAction named by `key` runs (Slurm 26.05), or None once a problem with it is reported:
    ours must run on the controller (Location=slurmctld) and take nothing but the node list Slurm appends."""
    subject, location = f"slurm.conf {key}", keys.get("location", "")
    if location.lower() != "slurmctld":
        report.problem(subject, f"names PowerAction {action}, whose Location is {location or 'not set'}: the "
                       "power programs run on the controller, where the OpenNebula credentials are",
                       f"Location=slurmctld on the PowerAction={action} line")
        return None
    try:
        argv = shlex.split(keys.get("program", ""))
    except ValueError:
        argv = []
    if len(argv) != 1:
        report.problem(subject, f"names PowerAction {action}, whose Program is "
                       f"{keys.get('program') or 'not set'}: the power programs take only the node list Slurm "
                       "adds", f'Program="{expected}" on the PowerAction={action} line')
        return None
    return argv[0]


def _options(conf: SlurmConf, key: str) -> list[str]:
    """The comma-separated options of a slurm.conf parameter, lower case, without their values."""
    return [o.strip().lower().partition("=")[0] for o in conf.get(key).split(",") if o.strip()]


def check_release_settings(report: Report, conf: SlurmConf, version: tuple[int, int] | None) -> None:
    """Power-saving settings whose meaning depends on the Slurm release (docs/SLURM-FINDINGS.md)."""
    release = "this Slurm" if version is None else f"Slurm {version[0]}.{version[1]:02d}"
    if "cloud_reg_addrs" in _options(conf, "SlurmctldParameters"):
        if version is not None and version >= (23, 11):
            report.problem("slurm.conf SlurmctldParameters", f"cloud_reg_addrs is defunct in {release} (it is "
                           "always on from 23.11) and slurmctld complains about it", "remove cloud_reg_addrs")
        else:
            report.warn("slurm.conf SlurmctldParameters", "cloud_reg_addrs replaces the NodeAddr resume sets "
                        "from OpenNebula's lease with the address slurmd registers from (another NIC's on a "
                        "multi-NIC GPU VM)", "remove cloud_reg_addrs")
    check_power_actions(report, conf, version, release)
    check_suspend_exc_states(report, conf, version, release)
    if version is not None and version >= (25, 5) \
            and "requeue_on_resume_failure" not in _options(conf, "SchedulerParameters"):
        report.warn("slurm.conf SchedulerParameters", f"lacks requeue_on_resume_failure ({release}): a job "
                    "whose node never registers by ResumeTimeout is not sure to be requeued",
                    "add requeue_on_resume_failure to SchedulerParameters")


def check_power_actions(report: Report, conf: SlurmConf, version: tuple[int, int] | None, release: str) -> None:
    """PowerAction lines are Slurm 26.05's: 22.05 and 24.11 refuse to start with one (unrecognized key)."""
    if not conf.actions or version is None or version >= (26, 5):
        return
    fix = ("give ResumeProgram, SuspendProgram and ResumeFailProgram the programs' paths and remove the "
           "PowerAction lines")
    if version < (25, 5):
        report.problem("slurm.conf PowerAction", f"{release} refuses to start with it (unrecognized key; "
                       "PowerAction is from Slurm 26.05)", fix)
    else:
        report.warn("slurm.conf PowerAction", f"known to work from Slurm 26.05 (24.11 refuses to start with "
                    f"it), not tried on {release}", fix)


# SuspendExcStates that keep a broken node's VM, and its GPUs, running while the node is idle.
BROKEN_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "INVALID_REG")


def check_suspend_exc_states(report: Report, conf: SlurmConf, version: tuple[int, int] | None,
                             release: str) -> None:
    """SuspendExcStates (Slurm 23.02+; 22.05 refuses to start with it): node states never powered down."""
    states = [s.strip().upper() for s in conf.get("SuspendExcStates").split(",") if s.strip()]
    subject = "slurm.conf SuspendExcStates"
    if not states:
        return
    if version is not None and version < (23, 2):
        report.problem(subject, f"{release} refuses to start with it (unrecognized key; SuspendExcStates is "
                       "from Slurm 23.02)", "remove SuspendExcStates")
    elif "CLOUD" in states:
        report.problem(subject, "has CLOUD: no cloud node is ever powered down, so every VM keeps its GPUs "
                       "after its jobs end", "remove CLOUD from SuspendExcStates")
    elif broken := [s for s in states if s in BROKEN_STATES]:
        names = ",".join(broken)
        report.warn(subject, f"has {names}: an idle cloud node in that state keeps its VM, and its GPUs, until "
                    "an administrator acts (else Slurm powers it down after SuspendTime)",
                    f"remove {names} from SuspendExcStates, unless you keep such VMs to look into on purpose")


def check_prolog(report: Report, config: Config, conf: SlurmConf) -> None:
    """PrologSlurmctld is slurm-nebula-prolog (else jobs wait for slurmctld's 30 s check), executable, not cut
    short by PrologEpilogTimeout; [slurm] prolog_chain is executable and not the prolog itself."""
    subject, prolog = "slurm.conf PrologSlurmctld", conf.params.get("prologslurmctld", "")
    expected = program_path(PROLOG)[0]
    if os.path.basename(prolog) != PROLOG:
        report.warn(subject, f"is {prolog or 'not set'}, not {PROLOG}: a job on cloud nodes starts only at "
                    "slurmctld's next 30 s check after they are up",
                    f"PrologSlurmctld={expected} (a site prolog goes to [slurm] prolog_chain)")
    elif not os.access(prolog, X):
        report.problem(subject, f"{prolog} does not exist or is not executable: every job fails its prolog "
                       "and is requeued", f"install slurm-nebula-power there, or PrologSlurmctld={expected}")
    else:
        report.ok(subject, f"{prolog}: jobs start as soon as their cloud nodes are up")
        resume, limit = conf.seconds("ResumeTimeout") or 60, conf.seconds("PrologEpilogTimeout")
        if conf.get("PrologEpilogTimeout") and limit is not None and 0 < limit < resume + MARGIN:
            report.warn("slurm.conf PrologEpilogTimeout", f"{limit} s is below ResumeTimeout {resume} s + "
                        f"{MARGIN:.0f} s: slurmctld kills {PROLOG} while nodes still boot and requeues the "
                        "job",
                        f"set PrologEpilogTimeout={resume + math.ceil(MARGIN)} or more, or remove it")
    chain = config.slurm.prolog_chain
    if chain is not None:
        if os.path.basename(chain) == PROLOG:
            report.problem(f"{config.path} slurm.prolog_chain", f"{chain} is {PROLOG} itself: it would run "
                           "itself without end", "name the site's own prolog, or remove prolog_chain")
        elif not os.access(chain, X):
            report.problem(f"{config.path} slurm.prolog_chain", f"{chain} does not exist or is not "
                           f"executable: {PROLOG} fails every job",
                           f"chmod +x {chain}, or remove prolog_chain")
        else:
            report.ok(f"{config.path} slurm.prolog_chain", f"{chain}, run after the nodes are up")


# ---- the run ------------------------------------------------------------------------------------------


def run_checks(config_arg: str | None, environ: Mapping[str, str], open_cloud: Callable[[Config], Cloud]) -> Report:
    """Every check, in order; later checks are skipped only when what they need is missing.

    open_cloud makes the OpenNebula client (without retries: check reports, it does not insist)."""
    report = Report()
    try:
        config = load_config(find_config(config_arg, environ), environ)
    except ConfigError as exc:
        report.problem("configuration", str(exc), "see etc/nebula-power.toml")
        return report
    report.ok(f"configuration {config.path}", f"cluster {config.slurm.cluster}, {len(config.nodesets)} node "
              f"set(s), {len(config.all_nodes)} nodes")
    conf = None
    assert config.slurm.slurm_conf is not None
    try:
        conf = read_slurm_conf(config.slurm.slurm_conf)
    except ConfigError as exc:
        report.problem("slurm.conf", str(exc), "run check on the slurmctld host")
    if conf is not None:
        name = conf.get("SlurmUser")
        try:
            check_files(report, config, pwd.getpwnam(name))
        except KeyError:
            report.problem("slurm.conf SlurmUser", f"{name} does not exist on this host",
                           "run check on the slurmctld host, or create the user")
    try:
        report.ok("scontrol", str(find_scontrol(config, environ)))
    except PowerError as exc:
        report.problem("scontrol", str(exc), "install Slurm's client commands or set [slurm] scontrol")
    check_ownership(report, config)
    check_transport(report, config)
    cloud = check_cloud(report, config, open_cloud(config))
    if cloud is not None:
        check_templates(report, config, cloud, conf)
        check_onegate(report, config, cloud)
        check_capacity(report, config, cloud)
    if conf is not None:
        check_coverage(report, config, conf)
        check_suspend_exclusions(report, config, conf)
        check_timers(report, config, conf)
        check_programs(report, conf, slurm_version(config, environ))
        check_prolog(report, config, conf)
    check_poweroff(report, config)
    return report
