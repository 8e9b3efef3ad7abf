"""`check`'s look at slurm.conf: every node covered by a node set, what SuspendTime may power down, the
timers against boot_timeout, the programs and release settings, the prolog (checks.py runs them)."""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Mapping

from .config import Config
from .errors import HostlistError
from .findings import Report, X
from .hostlists import expand, fold, split_top_level
from .prolog import MARGIN
from .shapes import PROGRAMS, PROLOG, SUSPEND_MARGIN, outage_bound, program_path, resume_timeout_for
from .slurmconf import SlurmConf, release_name

# ---- slurm.conf ---------------------------------------------------------------------------------------


def static_nodes(config: Config, conf: SlurmConf) -> dict[str, list[str]]:
    """Per node set (its nodes expression): its nodes slurm.conf declares without State=CLOUD."""
    cloud, known = set(conf.cloud_nodes), set(conf.nodes)
    found = {ns.nodes_expr: [n for n in ns.nodes if n in known and n not in cloud] for ns in config.nodesets}
    return {expr: nodes for expr, nodes in found.items() if nodes}


def check_coverage(report: Report, config: Config, conf: SlurmConf) -> None:
    """Every State=CLOUD node in a node set; every node-set node a CLOUD node of slurm.conf."""
    cloud, known, configured = set(conf.cloud_nodes), set(conf.nodes), set(config.all_nodes)
    before = len(report.problems)
    if cloud - configured:
        report.problem(f"slurm.conf {fold(sorted(cloud - configured))}", "State=CLOUD but in no [[nodeset]]: "
                       "resume refuses them", "add them to a node set's nodes, or drop State=CLOUD")
    overlaps = static_nodes(config, conf)
    for nodeset in config.nodesets:
        missing = [n for n in nodeset.nodes if n not in known]
        static = overlaps.get(nodeset.nodes_expr, [])
        if missing:
            report.problem(f"node set {nodeset.nodes_expr}", f"{fold(missing)} not in slurm.conf",
                           "add NodeName lines with State=CLOUD (slurm-nebula-power slurm-conf prints them)")
        if static:  # a production node inside a node set's hostlist: never to be made a cloud node
            report.problem(f"node set {nodeset.nodes_expr}", f"{fold(static)} are static nodes in slurm.conf (no "
                           "State=CLOUD): resume refuses them and never makes a VM for them",
                           f"take {fold(static)} out of the node set's nodes (a node set holds cloud nodes only)")
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
                       f"set ResumeTimeout={resume_timeout_for(config, longest)}, or lower boot_timeout")
    elif resume < longest + outage_bound(config):
        report.warn("slurm.conf ResumeTimeout", f"{resume} s: with OpenNebula gone mid-resume, resume hands its "
                    f"nodes back up to {outage_bound(config)} s (retry_seconds + timeout) after the longest "
                    f"boot_timeout {longest:g} s, after slurmctld has marked them DOWN",
                    f"set ResumeTimeout={resume_timeout_for(config, longest)}")
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


def _option_values(conf: SlurmConf, key: str) -> dict[str, str]:
    """The comma-separated options of a slurm.conf parameter: lower-case name -> its value ("" without one),
    the first of a name repeated (what slurmctld's search for it finds)."""
    values: dict[str, str] = {}
    for option in conf.get(key).split(","):
        name, _, value = option.strip().partition("=")
        if name:
            values.setdefault(name.lower(), value)
    return values


def _options(conf: SlurmConf, key: str) -> list[str]:
    """The comma-separated options of a slurm.conf parameter, lower case, without their values."""
    return list(_option_values(conf, key))


def check_configless(report: Report, config: Config, conf: SlurmConf) -> None:
    """Node sets whose workers fetch slurm.conf from slurmctld (a `controller` option: the template's
    SLURM_CONTROLLER, slurmd --conf-server) need enable_configless in the SlurmctldParameters slurmctld
    uses: the last such line, which replaces every earlier one (tested against the real slurmctld)."""
    workers = ", ".join(ns.nodes_expr for ns in config.nodesets if ns.options.get("controller"))
    if not workers:
        return
    subject = "slurm.conf SlurmctldParameters"
    if "enable_configless" in _options(conf, "SlurmctldParameters"):
        report.ok(subject, f"enable_configless, for the configless workers of {workers}")
    else:
        report.problem(subject, f"lacks enable_configless (only the last SlurmctldParameters line counts): the "
                       f"workers of {workers} start slurmd with --conf-server and get no configuration",
                       "add enable_configless to the last SlurmctldParameters line")


def check_cluster_name(report: Report, config: Config, conf: SlurmConf) -> None:
    """[slurm] cluster, when set, is slurm.conf's ClusterName: VMs are tagged and found by it."""
    name = conf.get("ClusterName")
    if name and config.slurm.cluster != name:
        report.problem("[slurm] cluster", f"is {config.slurm.cluster!r} but slurm.conf says ClusterName={name}: "
                       "the VMs are tagged for another cluster than the one slurmctld runs, and a second "
                       f"installation for {name} would not know them",
                       "remove [slurm] cluster (it defaults to ClusterName), or make the two the same")


def check_release_settings(report: Report, conf: SlurmConf, version: tuple[int, int] | None) -> None:
    """Power-saving settings whose meaning depends on the Slurm release (docs/SLURM-FINDINGS.md)."""
    release = release_name(version)
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


def check_power_limits(report: Report, config: Config, conf: SlurmConf, version: tuple[int, int] | None) -> None:
    """What caps or stops powering cloud nodes up and down: max_powered_nodes, a NodeName line's SuspendTime."""
    release = release_name(version)
    check_max_powered_nodes(report, config, conf, version, release)
    check_node_suspend_time(report, config, conf, version, release)


def _max_powered_nodes(conf: SlurmConf) -> int | None:
    """SlurmctldParameters' max_powered_nodes as slurmctld reads it (strtol of what follows the =: leading
    digits, else 0), or None when unset or negative (no limit then)."""
    value = _option_values(conf, "SlurmctldParameters").get("max_powered_nodes")
    if value is None:
        return None
    number = re.match(r"\s*[+-]?\d{1,12}", value)
    limit = int(number.group()) if number else 0
    return limit if limit >= 0 else None


def check_max_powered_nodes(report: Report, config: Config, conf: SlurmConf, version: tuple[int, int] | None,
                            release: str) -> None:
    """SlurmctldParameters=max_powered_nodes=N (Slurm 24.05+): slurmctld starts a job that would power nodes up
    only while the powered-up nodes, static ones included (every node not powered down and not FUTURE: its
    power_up_node_bitmap), stay at most N; else the job waits with Reason MaxPoweredUpNodes."""
    limit = _max_powered_nodes(conf)
    if limit is None:
        return
    subject = f"slurm.conf SlurmctldParameters max_powered_nodes={limit}"
    if version is not None and version < (24, 5):
        report.warn(subject, f"ignored by {release} (max_powered_nodes is from Slurm 24.05): no limit applies "
                    "to powering cloud nodes up", "remove max_powered_nodes, or keep it for an upgrade to 24.05+")
        return
    static = [n for n, keys in conf.nodes.items() if "CLOUD" not in keys.get("state", "").upper()
              and "FUTURE" not in keys.get("state", "").upper()]
    counted = f" ({len(static)} static node{'s count' if len(static) > 1 else ' counts'} as powered up)" \
        if static else ""
    largest = max(config.nodesets, key=lambda ns: len(ns.nodes))
    room = limit - len(static)
    if room <= 0:
        report.problem(subject, f"no cloud node can ever be powered up{counted}: every job on cloud nodes waits "
                       "for ever with Reason MaxPoweredUpNodes",
                       f"raise max_powered_nodes above {len(static)}, or remove it")
    elif room < len(largest.nodes):
        report.warn(subject, f"at most {room} cloud nodes up at once{counted}, fewer than node set "
                    f"{largest.nodes_expr}'s {len(largest.nodes)}: a job needing more than {room} of them never "
                    "starts (Reason MaxPoweredUpNodes)",
                    f"raise max_powered_nodes to {len(static) + len(largest.nodes)}, or accept that limit on jobs")
    else:
        report.ok(subject, f"at most {room} cloud nodes up at once{counted}")


NEVER = ("INFINITE", "NONE", "-1")  # SuspendTime values that never power a node down (slurm.conf(5))


def check_node_suspend_time(report: Report, config: Config, conf: SlurmConf, version: tuple[int, int] | None,
                            release: str) -> None:
    """SuspendTime on NodeName lines (Slurm 26.05+; 22.05 and 24.11 refuse to start with it): a cloud node of a
    node set whose SuspendTime is INFINITE is never powered down, its VM keeps its GPUs while idle."""
    timed = {node: keys["suspendtime"] for node, keys in conf.nodes.items() if "suspendtime" in keys}
    if not timed:
        return
    subject = "slurm.conf NodeName SuspendTime"
    if version is not None and version < (26, 5):
        report.problem(subject, f"{release} refuses to start with it on {fold(sorted(timed))} (unrecognized key; "
                       "a NodeName line's SuspendTime is from Slurm 26.05)",
                       "remove SuspendTime from the NodeName lines (a PartitionName line's SuspendTime is in "
                       "every release)")
        return
    ours, cloud = set(config.all_nodes), set(conf.cloud_nodes)
    never = sorted(n for n, value in timed.items() if value.strip().upper() in NEVER and n in ours and n in cloud)
    if never:
        report.warn(subject, f"{fold(never)} never powered down (SuspendTime={timed[never[0]]}): their VMs, and "
                    "GPUs, stay up while the nodes are idle",
                    f"remove SuspendTime from the NodeName lines of {fold(never)}, or give it seconds")


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
