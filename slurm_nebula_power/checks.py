"""`check`: what would make a deployment fail later, found now; one line per problem with its fix."""

from __future__ import annotations

import base64
import math
import pwd
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .capacity import Pool, gpu_requests, label
from .config import Config, NodeSet, find_config, load_config
from .errors import (
    CloudAuthError,
    CloudError,
    ConfigError,
    EndpointError,
    PowerError,
    TransientCloudError,
    first_line,
)
from .findings import Report, check_files, check_ownership, check_program_access, check_transport
from .fleetchecks import check_domains, check_protected
from .gres import check_gres
from .hostlists import fold
from .model import printable
from .operation import Cloud
from .placecheck import check_placement
from .shapes import (
    MEMORY_RATIO,
    Shape,
    read_shapes,
    real_memory,
    resume_timeout_for,
)
from .slurm import find_scontrol, slurm_version
from .slurmchecks import (
    check_cluster_name,
    check_configless,
    check_coverage,
    check_power_limits,
    check_poweroff,
    check_programs,
    check_prolog,
    check_suspend_exclusions,
    check_timers,
)
from .slurmconf import SlurmConf, count, gres_gpus, node_cpus, read_slurm_conf
from .template import worker_script
from .templateuse import check_template_use, missing_template_fix

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
    except EndpointError as exc:  # its host name or its certificate, with the fix in [opennebula]
        report.problem(subject, exc.problem, exc.fix)
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
    try:
        shapes = read_shapes(config, cloud, unreachable_raises=True)
    except TransientCloudError as exc:  # no template's fault: "create the template" would mislead
        report.problem("OpenNebula templates", f"not read: {first_line(exc, 200)}",
                       "check [opennebula] endpoint and that oned answers, then run check again")
        return
    for nodeset, shape, error in shapes:
        subject = f"node set {nodeset.nodes_expr} template {nodeset.template!r}"
        if shape is None:
            report.problem(subject, error, missing_template_fix(config, nodeset))
            continue
        # Only an explicit `gpus` is held against the template: the 1 a gpu_* key implies (template.gpus_of) is
        # what `template` prints, and a template made by hand with more GPUs serves them all.
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


def check_template_context(report: Report, config: Config, cloud: Cloud) -> None:
    """The CONTEXT of each worker node set's template (one with a `controller`) against what `template` would
    print: SLURM_CONTROLLER, the munge key (compared, never shown) and this version's bootstrap."""
    script = base64.b64encode(worker_script()).decode()
    for nodeset in config.nodesets:
        controller = nodeset.options.get("controller")
        if not controller:
            continue
        subject = f"node set {nodeset.nodes_expr} template {nodeset.template!r} CONTEXT"
        try:
            context = cloud.template(cloud.template_id(nodeset.template)).get("CONTEXT")
        except CloudError:
            continue  # check_templates has said why
        context = context if isinstance(context, Mapping) else {}
        remake = "make the template again: slurm-nebula-power template, then onetemplate update"
        missing = [k for k in ("SLURM_NODENAME", "SLURM_CONTROLLER", "MUNGE_KEY_BASE64", "START_SCRIPT_BASE64")
                   if not context.get(k)]
        if missing:
            report.problem(subject, f"lacks {', '.join(missing)}: the worker bootstrap refuses to start slurmd",
                           remake)
            continue
        before = len(report.findings)
        if str(context["SLURM_CONTROLLER"]) != str(controller):
            report.problem(subject, f"SLURM_CONTROLLER is {context['SLURM_CONTROLLER']}, the node set's "
                           f"controller {controller}", remake)
        key = _munge_key(nodeset)
        if key is not None and str(context["MUNGE_KEY_BASE64"]) != base64.b64encode(key).decode():
            report.problem(subject, "MUNGE_KEY_BASE64 is not the key in the node set's munge_key_file: the "
                           "nodes' munge credentials fail", remake)
        if str(context["START_SCRIPT_BASE64"]) != script:
            report.warn(subject, "START_SCRIPT_BASE64 is another bootstrap than this version's (an older "
                        "template, or edited by hand)", remake + " (docs/upgrading.md)")
        if len(report.findings) == before:
            report.ok(subject, "controller, " + ("munge key " if key is not None else "") +
                      "and bootstrap as `template` prints them" + ("" if key is not None else
                                                                  " (the munge key not compared: run check as root)"))


def _munge_key(nodeset: NodeSet) -> bytes | None:
    path = nodeset.options.get("munge_key_file")
    try:
        return Path(str(path)).read_bytes() if path else None
    except OSError:
        return None  # readable by root and munge only: run check as root to compare it


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
    paced = [ns for ns in config.nodesets if ns.placement == "scheduler"]  # direct placement sends no waves
    total = sum(len(ns.nodes) for ns in paced)
    waves = math.ceil(total / per_plan)
    if waves < 2:
        return
    last = (waves - 1) * PLAN_SECONDS
    how = (f"a resume of all {total} nodes oned's scheduler places at once goes out in {waves} waves of at most "
           f"{per_plan} VMs (one a placement plan), the last about {last} s after the first at {PLAN_SECONDS} s a "
           "plan with oned's stock scheduler settings")
    short = [ns for ns in paced if ns.boot_timeout <= last]
    if not short:
        report.ok("[opennebula] bursts", f"{how}: within every node set's boot_timeout")
    for nodeset in short:
        boot = math.ceil(last + nodeset.boot_timeout)
        report.warn(f"node set {nodeset.nodes_expr} boot_timeout",
                    f"{how}: above its boot_timeout {nodeset.boot_timeout:g} s, so its nodes still unsent by "
                    "then are handed back to Slurm as failed",
                    f"set boot_timeout = {boot} (the time to send them all plus the boot time allowed now) and "
                    f"ResumeTimeout={resume_timeout_for(config, boot)}, or let more hosts take VMs")


def _against_slurm_conf(report: Report, nodeset: NodeSet, shape: Shape, conf: SlurmConf) -> None:
    groups: dict[tuple[int, int, int], list[str]] = defaultdict(list)
    unreadable: dict[str, list[str]] = defaultdict(list)
    for node in nodeset.nodes:
        keys = conf.nodes.get(node)
        if keys is not None:
            memory = count(keys.get("realmemory")) or 1
            groups[(node_cpus(keys), memory, gres_gpus(keys.get("gres", "")))].append(node)
            for key in ("CPUs", "RealMemory"):
                if key.lower() in keys and count(keys[key.lower()]) is None:
                    unreadable[f"{key}={printable(keys[key.lower()])[:40]}"].append(node)
    for said, nodes in unreadable.items():
        report.problem(f"slurm.conf NodeName={fold(nodes)}", f"{said} is not a number",
                       f"give {said.split('=')[0]} in ASCII digits")
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
                           f"set Gres=gpu:{shape.gpus}" if shape.gpus else
                           "give the template its GPUs (set gpus in the node set and make it again with "
                           "`slurm-nebula-power template`), or remove gpu from Gres")


# ---- the run ------------------------------------------------------------------------------------------


def run_checks(config_arg: str | None, environ: Mapping[str, str], open_cloud: Callable[[Config], Cloud], *,
               instantiate: bool = False) -> Report:
    """Every check, in order; later checks are skipped only when what they need is missing.

    open_cloud makes the OpenNebula client (without retries: check reports, it does not insist); `instantiate`:
    each template is also instantiated on hold as the user and removed at once (nothing is made otherwise)."""
    report = Report()
    try:
        config = load_config(find_config(config_arg, environ), environ)
    except ConfigError as exc:
        report.problem("configuration", exc.problem, exc.fix or "slurm-nebula-power example-config prints an example "
                       "to start from")  # the fix of its own, when it has one (an auth file of mode 0644)
        return report
    report.ok(f"configuration {config.path}", f"cluster {config.slurm.cluster}, {len(config.nodesets)} node "
              f"set(s), {len(config.all_nodes)} nodes")
    conf = None
    slurm_user: pwd.struct_passwd | None = None
    assert config.slurm.slurm_conf is not None
    try:
        conf = read_slurm_conf(config.slurm.slurm_conf)
    except ConfigError as exc:
        report.problem("slurm.conf", str(exc), "run check on the slurmctld host")
    slurm_user = None
    if conf is not None:
        name = conf.get("SlurmUser")
        try:
            slurm_user = pwd.getpwnam(name)
            check_files(report, config, slurm_user)
        except KeyError:
            report.problem("slurm.conf SlurmUser", f"{name} does not exist on this host",
                           "run check on the slurmctld host, or create the user")
    try:
        report.ok("scontrol", str(find_scontrol(config, environ)))
    except PowerError as exc:
        report.problem("scontrol", str(exc), "install Slurm's client commands or set [slurm] scontrol")
    check_ownership(report, config, slurm_user)
    check_transport(report, config)
    version = slurm_version(config, environ)
    cloud = check_cloud(report, config, open_cloud(config))
    if cloud is not None:
        check_templates(report, config, cloud, conf)
        check_template_use(report, config, cloud, instantiate=instantiate)
        check_onegate(report, config, cloud)
        check_template_context(report, config, cloud)
        check_capacity(report, config, cloud)
        check_placement(report, config, cloud)
        check_domains(report, config, cloud, conf, version)
    if conf is not None:
        check_coverage(report, config, conf)
        check_suspend_exclusions(report, config, conf)
        check_power_limits(report, config, conf, version)
        check_timers(report, config, conf)
        check_programs(report, conf, version)
        check_prolog(report, config, conf)
        check_configless(report, config, conf)
        check_gres(report, config, conf, version)
        check_cluster_name(report, config, conf)
        if slurm_user is not None:
            check_program_access(report, conf, slurm_user)
    check_poweroff(report, config)
    check_protected(report, config)
    return report
