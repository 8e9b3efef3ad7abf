"""`check` of the fleet: node sets in protected mode, and the domains (hosts by their domain attribute)
against the node sets and slurm.conf's topology."""

from __future__ import annotations

import time

from .capacity import gpu_requests, label
from .config import Config, NodeSet
from .domains import BLOCK_SINCE, hosts_of_domain, parse_topology
from .errors import CloudError, HostlistError, first_line
from .files import read_capped
from .findings import Report
from .hostlists import expand, fold
from .hosts import Host
from .model import cell
from .operation import Cloud
from .protectlog import ProtectLog
from .shapes import config_topology
from .slurmconf import SlurmConf

MOST_TOPOLOGY = 4 << 20  # topology.conf read at most (a 10,000-node site's is some 100 KB)


def check_protected(report: Report, config: Config, now: float | None = None) -> None:
    """A node set in protected mode is a problem until its template is fixed and it is cleared."""
    store, period = ProtectLog.of(config), config.power.protect_for
    when = time.time() if now is None else now
    for nodeset in config.nodesets:
        state = store.read(nodeset.nodes_expr)
        if state is not None and state.active(when, period):
            report.problem(f"node set {nodeset.nodes_expr}", state.summary(when, period), state.fix)


def check_domains(report: Report, config: Config, cloud: Cloud, conf: SlurmConf | None,
                  version: tuple[int, int] | None) -> None:
    """Each node set's domain against the host pool (hosts that carry it, take VMs and have the GPUs), and
    slurm.conf's topology against the domains (each domain's nodes one block or switch, no other node in it)."""
    attribute = config.opennebula.domain_attribute
    wanted: dict[str, list[NodeSet]] = {}
    for nodeset in config.nodesets:
        if nodeset.domain is not None:
            wanted.setdefault(nodeset.domain, []).append(nodeset)
    if not wanted or attribute is None:
        return
    try:
        hosts = cloud.hosts()
    except CloudError as exc:
        report.warn(f"domains ({attribute})", f"host pool unreadable ({first_line(exc)}): not checked",
                    f"let user {config.opennebula.user} see the hosts")
    else:
        for domain, nodesets in wanted.items():
            _check_domain(report, cloud, attribute, domain, nodesets, hosts)
    if conf is not None:
        _check_topology(report, config, conf, version, wanted)


def _check_domain(report: Report, cloud: Cloud, attribute: str, domain: str, nodesets: list[NodeSet],
                  hosts: list[Host]) -> None:
    subject = f"domain {attribute}={domain}"
    members = hosts_of_domain(hosts, attribute, domain)
    nodes = [node for ns in nodesets for node in ns.nodes]
    if not members:
        report.problem(subject, f"no host carries it: the VMs of {fold(nodes)} would never be placed",
                       f'onehost update <host> --append with {attribute} = "{domain}" on the hosts of that domain')
        return
    names = ", ".join(cell(h.name, 40) for h in members[:8]) + (", ..." if len(members) > 8 else "")
    placeable = [h for h in members if h.placeable]
    if not placeable:
        report.problem(subject, f"its hosts ({names}) take no VMs ({', '.join(h.state_name for h in members[:4])})",
                       "onehost enable them, or give the node sets another domain")
        return
    short = []
    for nodeset in nodesets:
        try:
            requests = gpu_requests(cloud.template(cloud.template_id(nodeset.template)))
        except CloudError:
            continue  # check_templates says why
        devices = sum(1 for h in placeable for d in h.devices if any(r.matches(d) for r in requests))
        if requests and devices < len(nodeset.nodes) * len(requests):
            short.append(f"{nodeset.nodes_expr} needs {len(nodeset.nodes) * len(requests)} GPUs {label(requests)}, "
                         f"its hosts have {devices}")
    if short:
        report.warn(subject, f"{len(placeable)} of its hosts take VMs ({names}), but " + "; ".join(short) +
                    ": the rest of its nodes are handed back when they are resumed", "add hosts to the domain or "
                    "shrink the node set")
    else:
        report.ok(subject, f"{len(placeable)} hosts take VMs ({names}) for {fold(nodes)}")


def _check_topology(report: Report, config: Config, conf: SlurmConf, version: tuple[int, int] | None,
                    wanted: dict[str, list[NodeSet]]) -> None:
    fix = f"slurm-nebula-power slurm-conf --topology > {conf.path.parent / 'topology.conf'}, and TopologyPlugin as " \
          "slurm-conf prints it; restart slurmctld"
    plugin = conf.get("TopologyPlugin")
    subject = "slurm.conf TopologyPlugin"
    if plugin not in ("topology/block", "topology/tree"):
        report.problem(subject, f"{plugin or 'not set'}: Slurm may give a job nodes of several domains", fix)
        return
    expected = config_topology(config, version)
    if expected is not None and expected.note:
        report.warn(subject, expected.note, "give the node sets without a domain one, or enough nodes")
    if plugin == "topology/block" and version is not None and version < BLOCK_SINCE:
        report.problem(subject, f"topology/block needs Slurm 23.11, this is {version[0]}.{version[1]:02d}",
                       "TopologyPlugin=topology/tree, with " + fix)
        return
    if (conf.path.parent / "topology.yaml").exists():
        report.warn("topology.yaml", "exists: Slurm then ignores topology.conf; each domain's nodes must be one "
                    "block there", f"give each domain one block in {conf.path.parent / 'topology.yaml'}")
        return
    path = conf.path.parent / "topology.conf"
    try:
        raw = read_capped(path, MOST_TOPOLOGY, None)
    except OSError as exc:
        report.problem("topology.conf", f"{path}: unreadable ({exc.strerror or exc})", fix)
        return
    if raw is None:
        report.problem("topology.conf", f"{path} does not exist: {plugin} has no blocks", fix)
        return
    groups: dict[str, set[str]] = {}
    for name, (expression,) in parse_topology(raw.decode("utf-8", "replace")).items():
        try:
            groups[name] = set(expand(expression))  # bounded: a topology.conf is read, not trusted
        except HostlistError:
            report.problem("topology.conf", f"{name}: malformed Nodes={cell(expression, 60)}", fix)
            return
    for domain, nodesets in wanted.items():
        nodes = {node for ns in nodesets for node in ns.nodes}
        others = {node for d, sets in wanted.items() if d != domain for ns in sets for node in ns.nodes}
        holding = [name for name, members in groups.items() if nodes <= members and not members & others]
        if holding:
            report.ok(f"topology.conf {domain}", f"{fold(sorted(nodes))} in {holding[0]}")
        else:
            report.problem(f"topology.conf {domain}", f"{fold(sorted(nodes))} (domain {domain}) are not one "
                           f"{plugin.split('/')[1]} of their own: a job can span domains", fix)
