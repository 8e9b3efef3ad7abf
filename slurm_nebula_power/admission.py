"""Pure decisions before resume creates anything: which nodes the free GPUs can take (job by job), and
whether a node set in its shortage cooldown may be tried again."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .capacity import Pool, Requests, gpus, label
from .plan import nodes_by_job

COUNT, PLACEMENT = "count", "placement"  # found by counting the host pool / by oned not placing our VM
QUOTA = "quota"  # oned refused for a user or group quota: no count of free GPUs lifts it, only time


@dataclass(frozen=True)
class Need:
    """What one node of this resume needs from the host pool."""

    node: str
    nodeset: str  # the node set's nodes expression
    requests: Requests = ()  # the GPUs its VM needs anew; () when it needs none (or already holds them)
    queued: bool = False  # its VM is already PENDING: oned places it before anything we create now
    hosts: frozenset[int] | None = None  # the ids of the hosts its VM may run on (its domain's); None: any


def admit(needs: Sequence[Need], jobs: Mapping[str, Sequence[int]], all_or_nothing: Callable[[str], bool],
          pool: Pool) -> dict[str, str]:
    """The nodes the free devices cannot take, with the reason ("job 7: needs 4 GPUs 10de:0302, 3 free").

    Jobs are taken in the resume file's order, then the nodes resumed for no job, one by one. An
    all-or-nothing job's nodes get devices only if all of them do; a best-effort job's nodes one by one.
    PENDING VMs of ours are counted first: oned places them before the VMs created now.
    """
    by_node = {need.node: need for need in needs}
    wanting = {need.node: need for need in needs if need.requests and not need.queued}
    per_set: dict[str, int] = {}
    free: dict[str, int] = {}
    for need in wanting.values():
        per_set[need.nodeset] = per_set.get(need.nodeset, 0) + len(need.requests)
        if need.nodeset not in free:  # once a node set: setdefault would count the pool for every node
            free[need.nodeset] = pool.free(need.requests, need.hosts)
    for need in needs:
        if need.requests and need.queued:
            pool.take(need.requests, need.hosts)
    groups: list[tuple[int | None, list[str]]] = [
        (job, [n for n in nodes if n in wanting]) for job, nodes in nodes_by_job(jobs).items()]
    groups += [(None, [node]) for node in wanting if not jobs.get(node)]
    admitted: set[str] = set()
    refused: dict[str, str] = {}
    for job, nodes in groups:
        todo = [n for n in nodes if n not in admitted]
        whole = [n for n in todo if all_or_nothing(n)]
        if whole and pool.take_all([wanting[n].requests for n in whole], [wanting[n].hosts for n in whole]):
            admitted.update(whole)
        for node in todo:
            if node in admitted:
                continue
            if node not in whole and pool.take(wanting[node].requests, wanting[node].hosts):
                admitted.add(node)
                continue
            need = by_node[node]
            prefix = f"job {job}: " if job is not None else ""
            refused.setdefault(node, f"{prefix}needs {gpus(per_set[need.nodeset])} {label(need.requests)}, "
                                     f"{free[need.nodeset]} free")
    return {node: reason for node, reason in refused.items() if node not in admitted}


@dataclass(frozen=True)
class Shortage:
    """A GPU shortage seen in a node set: when, how it was found, the free devices then, what a VM needs.

    cooldown.ShortageLog keeps one per node set across resume processes; may_retry judges it.
    """

    nodes: str
    at: float  # wall-clock seconds (time.time): shared by separate processes
    kind: str
    free: int | None
    reason: str
    requests: tuple[Mapping[str, str], ...] = field(default=())
    wanted: int = 0  # the devices the run that met it wanted (0: one VM's)

    def age(self, now: float) -> float:
        """Seconds since it was seen."""
        return now - self.at


def may_retry(shortage: Shortage, free_now: int | None, gpus_wanted: int) -> bool:
    """Whether a node set in its cooldown is tried again now rather than handed back at once.

    After a shortage found by counting, the count is as good now as then: retry once the GPUs this
    resume could want fit. After oned could not place a VM the count had room for, the count is not to
    be trusted: retry only once more devices are free than when that happened (someone freed one).
    """
    if free_now is None or not shortage.requests:
        return False
    if shortage.kind == PLACEMENT and (shortage.free is None or free_now <= shortage.free):
        return False
    return gpus_wanted <= free_now
