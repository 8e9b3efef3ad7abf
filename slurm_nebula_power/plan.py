"""Pure decisions, no I/O: per node, what resume does; per VM, the next step down; how to remove a VM."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape

from . import __version__
from .model import (
    ACTIVE,
    CLONING,
    DONE,
    HOLD,
    OFF_STATES,
    PENDING,
    POWEROFF,
    RUNNING_LCM,
    STOPPED,
    SUSPENDED,
    TAG_CLUSTER,
    TAG_JOBS,
    TAG_MANAGER,
    TAG_NODE,
    UNDEPLOYED,
    UNKNOWN_LCM,
    Vm,
)

# ---- resume ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What resume does for one node."""

    action: str  # instantiate | resume | release | recreate | wait
    vm: Vm | None = None
    duplicates: tuple[Vm, ...] = ()  # further VMs of ours for the node, to terminate


def _rank(vm: Vm) -> int:
    if vm.failed:
        return 0
    if vm.off:
        return 1
    if vm.state in (PENDING, HOLD):
        return 2
    return 4 if vm.running else 3


def plan_resume(vms: Sequence[Vm]) -> Plan:
    """Decide the resume action for one node from its VMs of ours."""
    if not vms:
        return Plan("instantiate")
    ordered = sorted(vms, key=lambda vm: (_rank(vm), vm.id), reverse=True)
    keep, duplicates = ordered[0], tuple(ordered[1:])
    if keep.failed:
        action = "recreate"
    elif keep.off or (keep.state == ACTIVE and keep.lcm_state == UNKNOWN_LCM):
        action = "resume"
    elif keep.state == HOLD:
        action = "release"
    else:
        action = "wait"
    return Plan(action, keep, duplicates)


def counting_vm(vms: Sequence[Vm]) -> Vm | None:
    """The VM that counts for a node (running before booting before off before failed)."""
    return plan_resume(vms).vm if vms else None


def extra_template(cluster: str, node: str, jobs: Sequence[int], context: Mapping[str, Any],
                   requirements: str | None = None) -> str:
    """The extra template given at instantiate, in oned's XML form (values escaped, CDATA-free).

    oned's instantiate replaces a template attribute given again in the extra template, so CONTEXT
    is sent whole: the template's own CONTEXT plus SET_HOSTNAME, SLURM_NODENAME and SLURM_CLUSTER (the
    identity) and SLURM_JOB_IDS (what the usage records bill). The USER_TEMPLATE tags repeat them for
    people; a guest may rewrite those, and nothing reads them back. `requirements`: the node set's
    SCHED_REQUIREMENTS (domains.requirement: its domain, with the template's own kept).
    """
    def element(key: str, value: object) -> str:
        return f"<{key}>{escape(str(value))}</{key}>"

    merged = {str(k): v for k, v in context.items() if not isinstance(v, (dict, list))}
    # Identity lives in CONTEXT, which a guest cannot rewrite (OneGate writes USER_TEMPLATE only).
    merged.update({"SET_HOSTNAME": node, TAG_NODE: node, TAG_CLUSTER: cluster})
    job_ids = ",".join(str(j) for j in sorted(set(jobs)))
    # The job ids too: the usage records bill by them, so they come from CONTEXT, never USER_TEMPLATE.
    merged.pop(TAG_JOBS, None)
    if jobs:
        merged[TAG_JOBS] = job_ids
    parts = [element(TAG_CLUSTER, cluster), element(TAG_NODE, node), element(TAG_MANAGER, __version__)]
    if jobs:
        parts.append(element(TAG_JOBS, job_ids))  # for people: a guest may rewrite it
    parts.append("<CONTEXT>" + "".join(element(k, v) for k, v in merged.items()) + "</CONTEXT>")
    if requirements:
        parts.append(element("SCHED_REQUIREMENTS", requirements))
    return "<TEMPLATE>" + "".join(parts) + "</TEMPLATE>"


# ---- jobs ------------------------------------------------------------------------------------------


def nodes_by_job(jobs: Mapping[str, Sequence[int]]) -> dict[int, list[str]]:
    """The other direction of slurm.jobs_from_resume_file: each job's nodes in this resume, jobs in file order."""
    out: dict[int, list[str]] = {}
    for node, ids in jobs.items():
        for job in ids:
            out.setdefault(job, []).append(node)
    return out


def dragged(lost: Iterable[str], jobs: Mapping[str, Sequence[int]], all_or_nothing: Callable[[str], bool]
            ) -> dict[str, int]:
    """Nodes that go down with the lost ones: node -> the job that drags it.

    A job with a lost node is requeued by Slurm, so its other nodes idle. Each of those whose node set is
    all-or-nothing is dragged, unless another job of this resume that lost nothing needs it; a dragged
    node can in turn break the jobs it was in (a fixed point). A node resumed for no job is its own group.
    """
    by_job = nodes_by_job(jobs)
    down = set(lost)
    found: dict[str, int] = {}
    while True:
        broken = [job for job, nodes in by_job.items() if down.intersection(nodes)]
        new: dict[str, int] = {}
        for job in broken:
            for node in by_job[job]:
                if node not in down and all_or_nothing(node) and all(j in broken for j in jobs.get(node, ())):
                    new.setdefault(node, job)  # the first job that breaks, for the reason
        if not new:
            return found
        found.update(new)
        down.update(new)


# ---- suspend and removal -----------------------------------------------------------------------------

# The state a suspend action leaves a VM in, and the states that already satisfy it.
SATISFIED = {"terminate": (DONE,), "undeploy": (UNDEPLOYED, STOPPED),
             "poweroff": (POWEROFF, UNDEPLOYED, STOPPED, SUSPENDED)}
ACTS_FROM = {"terminate": (POWEROFF, UNDEPLOYED, STOPPED, SUSPENDED), "undeploy": (POWEROFF,), "poweroff": ()}


def next_down_action(action: str, vm: Vm, escalate: bool) -> str | None:
    """The oned action that moves vm toward the suspend action's end state now, or None to wait."""
    never_ran = vm.state == PENDING and vm.host is None
    if vm.failed or vm.state in (HOLD, CLONING) or never_ran or (action == "terminate" and vm.state == PENDING):
        # Never ran (or cannot run): nothing to keep, and oned frees it at once.
        return "terminate"
    if vm.state in ACTS_FROM[action]:
        return action
    if vm.state == ACTIVE and vm.lcm_state in (RUNNING_LCM, UNKNOWN_LCM):
        return f"{action}-hard" if escalate else action
    return None


def removal_action(vm: Vm) -> str:
    """How to terminate a VM of ours now: plain terminate where oned frees it at once, else -hard."""
    quick = vm.failed or vm.state in (PENDING, HOLD, CLONING) or vm.state in OFF_STATES
    return "terminate" if quick else "terminate-hard"
