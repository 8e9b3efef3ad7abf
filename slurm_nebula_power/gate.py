"""What the host pool and the job policy let resume start: the shortage cooldown, the GPU count before
anything is created, the reason for a VM oned could not place, and the nodes an all-or-nothing job drags
down with it. Decides and records; resume removes the VMs and hands the nodes back."""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from .admission import COUNT, PLACEMENT, QUOTA, Need, Shortage, admit, may_retry
from .capacity import PciRequest, Pool, Requests, gpu_requests, held_by, label
from .config import Config, NodeSet
from .cooldown import ShortageLog
from .domains import hosts_of_domain, requirement
from .errors import (
    CloudError,
    CredentialsRefused,
    EndpointUnresolved,
    EndpointUntrusted,
    QuotaExceeded,
    TransientCloudError,
    first_line,
)
from .hostlists import fold
from .hosts import Host
from .model import PENDING, Vm
from .operation import REASON_LENGTH, Context, cloud_reason
from .plan import Plan, dragged

log = logging.getLogger(__name__)
Planned = tuple[str, NodeSet, Plan]  # a node, its node set, what resume would do for it


class Placed(Protocol):
    """A node with its node set (resume's Boot)."""

    @property
    def nodeset(self) -> NodeSet: ...


P = TypeVar("P", bound=Placed)


class Gate:
    """One resume run's view of GPU capacity: the host pool read at most once before starting."""

    def __init__(self, ctx: Context, jobs: Mapping[str, Sequence[int]]) -> None:
        self.ctx = ctx
        self.jobs = jobs
        self.requests: dict[int, Requests] = {}  # id(nodeset) -> the GPUs one of its VMs needs
        self.placing: dict[int, str] = {}  # id(nodeset) -> the SCHED_REQUIREMENTS of its domain
        self.shortages = ShortageLog.of(ctx.config, ctx.owner)
        self.short: dict[int, NodeSet] = {}  # id(nodeset) -> the node sets short in this run (or cooling)
        self.lifted: dict[int, NodeSet] = {}  # id(nodeset) -> the node sets whose cooldown this run lifted
        self._hosts: list[Host] | None = None
        self._hosts_read = False

    def learn_template(self, nodeset: NodeSet, template: Mapping[str, Any]) -> None:
        """Note what GPUs a VM of this node set asks for, and where it may run (its domain)."""
        self.requests[id(nodeset)] = gpu_requests(template)
        attribute = self.ctx.config.opennebula.domain_attribute
        if nodeset.domain is not None and attribute is not None:
            theirs = template.get("SCHED_REQUIREMENTS")
            own = theirs if isinstance(theirs, str) else ""  # never a vector; absent in most templates
            self.placing[id(nodeset)] = requirement(attribute, nodeset.domain, own)

    def hosts(self) -> list[Host] | None:
        """The host pool, read once per run (None: unreadable or empty, so capacity is unknown)."""
        if not self._hosts_read:
            self._hosts_read = True
            self._hosts = self.fresh_hosts()
        return self._hosts

    def hosts_read(self) -> list[Host] | None:
        """The host pool if this run has read it already (no call), else None."""
        return self._hosts if self._hosts_read else None

    def fresh_hosts(self) -> list[Host] | None:
        """The host pool read now (one call)."""
        try:
            hosts = self.ctx.cloud.hosts()
        except CloudError as exc:
            log.warning("host pool unreadable, GPU capacity not checked: %s", exc)
            return None
        if not hosts:
            log.warning("no host visible to user %s, GPU capacity not checked", self.ctx.config.opennebula.user)
            return None
        return hosts

    def all_or_nothing(self, node: str) -> bool:
        """The node's node set hands back a job's other nodes when one cannot start (default: with GPUs)."""
        nodeset = self.ctx.config.nodeset_for(node)
        if nodeset is None:
            return False
        if nodeset.job_policy is not None:
            return nodeset.job_policy == "all-or-nothing"
        return bool(self.requests.get(id(nodeset)))

    def template_failed(self, nodeset: NodeSet, exc: CloudError) -> str:
        """Log why a node set's template could not be read, and give its nodes' reason: refused credentials
        name the user and the auth file, and an endpoint unreachable or not trusted is no fault of the
        template either (a wrong password read "template slurm-gpu-worker: ... couldn't be authenticated")."""
        one = self.ctx.config.opennebula
        if isinstance(exc, CredentialsRefused):
            reason = f"OpenNebula refused the credentials of user {one.user} in {one.auth_file}"[:REASON_LENGTH]
            log.error("node set %s: %s (%s): put valid ones there (user:password or user:token)",
                      nodeset.nodes_expr, reason, first_line(exc, REASON_LENGTH))
            return reason
        log.error("node set %s: template %r: %s", nodeset.nodes_expr, nodeset.template, exc)
        if isinstance(exc, (TransientCloudError, EndpointUnresolved, EndpointUntrusted)):
            return cloud_reason(exc)
        return f"template {nodeset.template}: {first_line(exc, REASON_LENGTH)}"

    # -- before anything is read or created --

    def cooling(self, nodeset: NodeSet, count: int) -> str | None:
        """Why this node set's `count` nodes are handed back at once (its shortage cooldown), or None."""
        cooldown = self.ctx.config.power.shortage_cooldown
        now = self.shortages.clock()
        shortage = self.shortages.read(nodeset.nodes_expr)
        if shortage is None or shortage.age(now) >= cooldown:
            return None
        free = shortage_free(self.ctx.config, nodeset, shortage, self.hosts)
        if may_retry(shortage, free, count * len(shortage.requests)):
            log.info("node set %s: %s GPUs %s free, cooldown lifted", nodeset.nodes_expr, free,
                     label(tuple(pci_request(r) for r in shortage.requests)))
            self.shortages.clear(nodeset.nodes_expr)
            self.lifted[id(nodeset)] = nodeset
            return None
        now_free = "" if free is None else f", {free} free now"
        self.short[id(nodeset)] = nodeset
        return f"cooldown {cooldown - shortage.age(now):.0f}s left after {shortage.reason}{now_free}"

    # -- after the plan, before starting --

    def refuse(self, plans: Sequence[Planned], lost: Sequence[str]) -> dict[str, tuple[str, list[Vm]]]:
        """Count the free GPUs once: node -> (reason, VMs of ours to remove) for the nodes the count cannot
        take and for those their all-or-nothing jobs (or the `lost` nodes' jobs) drag down."""
        refused: dict[str, str] = {}
        if any(self._needs_devices(nodeset, plan) for _, nodeset, plan in plans):
            hosts = self.hosts()
            if hosts is not None:
                released = [vm.id for _, _, plan in plans for vm in (
                    ((plan.vm,) if plan.action == "recreate" and plan.vm else ()) + plan.duplicates)]
                needs = [self._need(node, nodeset, plan, hosts) for node, nodeset, plan in plans]
                refused = admit(needs, self.jobs, self.all_or_nothing, Pool(hosts, released))
                self._record_counted(plans, refused, Pool(hosts, released), hosts)
        down = set(refused) | set(lost)
        drag = {node: self.drag_reason(job, down)
                for node, job in dragged(down, self.jobs, self.all_or_nothing).items() if node not in refused}
        out: dict[str, tuple[str, list[Vm]]] = {}
        for node, _, plan in plans:
            reason = refused.get(node) or drag.get(node)
            if reason is not None:
                # A VM that is off stays as it is (its suspend_action left it so); any other of ours goes.
                keep_off = plan.vm is not None and plan.vm.off
                out[node] = (reason, ([] if keep_off or plan.vm is None else [plan.vm]) + list(plan.duplicates))
        return out

    def _needs_devices(self, nodeset: NodeSet, plan: Plan) -> bool:
        return bool(self.requests.get(id(nodeset))) and not (
            plan.action == "wait" and plan.vm is not None and plan.vm.state != PENDING)

    def where(self, nodeset: NodeSet, hosts: Sequence[Host]) -> frozenset[int] | None:
        """The ids of the hosts a VM of this node set may run on (its domain's), or None: any host."""
        return domain_hosts(self.ctx.config, nodeset, hosts)

    def _need(self, node: str, nodeset: NodeSet, plan: Plan, hosts: list[Host]) -> Need:
        """What a node's plan needs anew (on the hosts of its domain, if it has one)."""
        return dataclasses.replace(self._anew(node, nodeset, plan, hosts), hosts=self.where(nodeset, hosts))

    def _anew(self, node: str, nodeset: NodeSet, plan: Plan, hosts: list[Host]) -> Need:
        """What a node's plan needs anew: nothing when its VM holds its GPUs (booting, running, POWEROFF)."""
        requests = self.requests.get(id(nodeset), ())
        vm = plan.vm
        if not requests or vm is None or plan.action in ("recreate", "release"):
            return Need(node, nodeset.nodes_expr, requests)
        if plan.action == "wait":
            queued = vm.state == PENDING
            return Need(node, nodeset.nodes_expr, requests if queued else (), queued=queued)
        return Need(node, nodeset.nodes_expr, requests if held_by(hosts, vm.id) < len(requests) else ())

    def _record_counted(self, plans: Sequence[Planned], refused: Mapping[str, str], pool: Pool,
                        hosts: Sequence[Host]) -> None:
        """A shortage the count found starts its node set's cooldown."""
        for nodeset in {id(ns): ns for node, ns, _ in plans if node in refused}.values():
            requests = self.requests.get(id(nodeset), ())
            reason = next(refused[node] for node, ns, _ in plans if ns is nodeset and node in refused)
            free = pool.free(requests, self.where(nodeset, hosts))
            wanted = len(requests) * sum(1 for node, ns, _ in plans if ns is nodeset and node in refused)
            self._record(nodeset, COUNT, free, f"GPU shortage ({reason})", [_plain(r) for r in requests], wanted)

    # -- while watching --

    def unplaced(self, nodeset: NodeSet, vm: Vm, hosts: list[Host] | None) -> str:
        """The reason for a node set's VMs oned did not place within pending_timeout (`vm` one of them),
        from the host pool read now; starts the node set's cooldown."""
        requests = self.requests.get(id(nodeset), ())
        free = Pool(hosts).free(requests, self.where(nodeset, hosts)) if hosts is not None and requests else None
        what = f"GPU {label(requests)}" if requests else "room"
        oned = vm.oned_message
        if free is not None and free < len(requests):
            reason = f"no free {what}: PENDING {nodeset.pending_timeout:g}s, {free} free (oned: {oned})"
        else:
            seen = "" if free is None else f" although {free} free"
            reason = f"not placed within pending_timeout {nodeset.pending_timeout:g}s{seen} (oned: {oned})"
        self._record(nodeset, PLACEMENT, free, reason, [_plain(r) for r in requests])
        return reason

    def unplaced_all(self, unplaced: Sequence[tuple[P, Vm]]) -> dict[str, list[P]]:
        """The nodes whose VM oned did not place within pending_timeout, by reason (the shortage a fresh read
        of the host pool shows); their node sets' cooldown starts."""
        hosts = self.fresh_hosts() if any(self.requests.get(id(b.nodeset)) for b, _ in unplaced) else None
        out: dict[str, list[P]] = defaultdict(list)
        for nodeset in {id(b.nodeset): b.nodeset for b, _ in unplaced}.values():
            mine = [(b, vm) for b, vm in unplaced if b.nodeset is nodeset]
            out[self.unplaced(nodeset, mine[0][1], hosts)].extend(b for b, _ in mine)
        return out

    def quota(self, nodeset: NodeSet, exc: QuotaExceeded) -> str:
        """The reason for a node oned refused for a quota ("OpenNebula quota: user [3] limit of 4 reached for
        VMS quota in VM"); starts the node set's cooldown, which only time lifts (the quota is not in the
        host pool), so Slurm's next resume of these nodes is handed back at once, with no call to oned."""
        reason = f"OpenNebula quota: {exc.quota}"
        self._record(nodeset, QUOTA, None, reason, [])
        return reason

    def _record(self, nodeset: NodeSet, kind: str, free: int | None, reason: str,
                requests: Sequence[Mapping[str, str]], wanted: int = 0) -> None:
        """Record a shortage of the node set, which is then short in this run (it steps out: stepout.py)."""
        self.shortages.record(nodeset.nodes_expr, kind, free, reason, requests, wanted)
        self.short[id(nodeset)] = nodeset

    def drag(self, lost: Sequence[str]) -> dict[str, str]:
        """node -> reason: the nodes all-or-nothing jobs that lost these nodes give back too."""
        down = set(lost)
        return {node: self.drag_reason(job, down)
                for node, job in dragged(down, self.jobs, self.all_or_nothing).items()}

    def drag_reason(self, job: int, down: set[str]) -> str:
        """all-or-nothing: job 7 cannot start whole (gpu04 cannot start)."""
        culprits = [node for node, ids in self.jobs.items() if job in ids and node in down]
        return f"all-or-nothing: job {job} cannot start whole ({fold(culprits)} cannot start)"


def domain_hosts(config: Config, nodeset: NodeSet, hosts: Sequence[Host]) -> frozenset[int] | None:
    """The ids of the hosts a VM of this node set may run on (its domain's), or None: any host."""
    attribute = config.opennebula.domain_attribute
    if nodeset.domain is None or attribute is None:
        return None
    return frozenset(host.id for host in hosts_of_domain(hosts, attribute, nodeset.domain))


def shortage_free(config: Config, nodeset: NodeSet, shortage: Shortage, hosts: Callable[[], list[Host] | None],
                  ) -> int | None:
    """The free devices of the kind the shortage's VMs need, on the hosts the node set may use (the pool read
    when first asked); None when the shortage names none or the host pool cannot be read."""
    requests = tuple(pci_request(r) for r in shortage.requests)
    pool = hosts() if requests else None
    return None if pool is None else Pool(pool).free(requests, domain_hosts(config, nodeset, pool))


def pci_request(data: Mapping[str, str]) -> PciRequest:
    """A PCI request from its plain form (a shortage file's)."""
    return PciRequest(**{k: v for k, v in data.items() if k in PciRequest.__dataclass_fields__})


def _plain(request: PciRequest) -> dict[str, str]:
    return {k: v for k, v in dataclasses.asdict(request).items() if v}
