"""Domains, pure: a site names each host's domain (an NVLink domain, a rack, an InfiniBand leaf) with a host
attribute (`onehost update`, [opennebula] domain_attribute) and gives a node set a `domain`. From that: the
hosts of a domain, the SCHED_REQUIREMENTS that keep a VM on them, and the Slurm topology in which each
domain's nodes are one block (one switch on releases before 23.11), so a job Slurm puts in one block runs
inside one domain.

The domain is static: a node's block is in topology.conf while it is powered down, when Slurm picks the nodes
of a job. Registering the block at boot (26.05: `slurmd --conf "Topology=..."`) would come after that choice,
and only suits nodes whose domain is decided by where their VM lands, which is what this avoids.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .hostlists import fold
from .hosts import Host

BLOCK_SINCE = (23, 11)  # topology/block
BLOCK_SIZES_SINCE = (24, 5)  # topology.conf BlockSizes
TOP_SWITCH = "nebula-top"  # topology/tree: the switch above the domains' switches
OTHERS = "nebula-other"  # the block (switch) of the nodes of node sets without a domain


def hosts_of_domain(hosts: Iterable[Host], attribute: str, value: str) -> tuple[Host, ...]:
    """The hosts of a domain: those whose TEMPLATE attribute `attribute` is exactly `value`, placeable or not
    (the caller that places a VM keeps the placeable ones: Host.placeable). What SCHED_REQUIREMENTS
    `requirement(attribute, value)` lets oned's scheduler use, for a host choice of our own (direct placement)."""
    return tuple(host for host in hosts if host.attributes.get(attribute) == value)


def requirement(attribute: str, value: str, theirs: str = "") -> str:
    """SCHED_REQUIREMENTS for a VM of this domain, with the template's own kept: oned's instantiate replaces
    a top-level attribute the extra template gives again, so both go in one expression. oned compares a
    quoted value as an fnmatch pattern: config.py allows no wildcard in a domain."""
    own = f'{attribute} = "{value}"'
    theirs = theirs.strip()
    return f"({theirs}) & ({own})" if theirs else own


@dataclass(frozen=True)
class Topology:
    """slurm.conf's TopologyPlugin and topology.conf's lines for the node sets' domains."""

    plugin: str
    lines: tuple[str, ...]
    groups: tuple[tuple[str, tuple[str, ...]], ...]  # (block or switch name, its nodes), in order
    note: str = ""  # why topology/tree where the release has topology/block


def topology(domains: Mapping[str, Sequence[str]], others: Sequence[str], version: tuple[int, int] | None
             ) -> Topology:
    """One block per domain, and one for the nodes of the node sets without a domain (`others`), so that every
    node is in the topology: topology/block (23.11+) leaves a node outside every block unusable ("Requested
    topology configuration is not available", 24.11).

    BlockSizes (24.05+) is the smallest domain's node count: Slurm then keeps a job of up to that many nodes
    inside one block, waiting for room rather than spanning two (measured on 24.11: with BlockSizes=1 a 2-node
    job took a node of each of two blocks). Every block must hold at least BlockSizes nodes or slurmctld
    refuses to start, so when the nodes without a domain are fewer than a domain's, topology/tree is used
    instead (it prefers one switch, it does not wait for one), and `note` says why. Before 23.11, and for an
    unknown release, topology/tree: a switch per domain and one above them."""
    groups: list[tuple[str, tuple[str, ...]]] = [(name, tuple(nodes)) for name, nodes in domains.items()]
    base = min((len(nodes) for _, nodes in groups), default=0)
    if others:
        name = OTHERS
        while name in domains:
            name += "_"
        groups.append((name, tuple(others)))
    note = ""
    block = version is not None and version >= BLOCK_SINCE
    if block and others and len(others) < base:
        block = False
        note = (f"topology/tree, not topology/block: the {len(others)} nodes without a domain are fewer than the "
                f"smallest domain's {base}, and every block needs at least BlockSizes nodes; give them a domain "
                "to have Slurm keep a job inside one domain")
    if block:
        lines = [f"BlockName={name} Nodes={fold(nodes)}" for name, nodes in groups]
        if version is not None and version >= BLOCK_SIZES_SINCE and groups:
            lines.append(f"BlockSizes={base}")
        return Topology("topology/block", tuple(lines), tuple(groups))
    lines = [f"SwitchName={name} Nodes={fold(nodes)}" for name, nodes in groups]
    if len(groups) > 1:
        top = TOP_SWITCH
        while top in domains or top == groups[-1][0]:
            top += "_"
        lines.append(f"SwitchName={top} Switches={','.join(name for name, _ in groups)}")
    return Topology("topology/tree", tuple(lines), tuple(groups), note)


def parse_topology(text: str) -> dict[str, tuple[str, ...]]:
    """The leaf groups of a topology.conf (BlockName=, or SwitchName= with Nodes=): name -> its Nodes= as
    written (a hostlist expression); comments and other lines are left out. Bounded by the caller's read."""
    found: dict[str, tuple[str, ...]] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        fields = dict(part.partition("=")[::2] for part in line.split() if "=" in part)
        lowered = {key.lower(): value for key, value in fields.items()}
        name = lowered.get("blockname") or lowered.get("switchname")
        if name and lowered.get("nodes"):
            found[name] = (lowered["nodes"],)
    return found
