"""Suspend and resume-fail: take nodes' VMs down, confirmed by polling, escalating to the -hard action."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from .backoff import Backoff
from .errors import ActionRefused, CloudError
from .hostlists import fold
from .model import ACTIVE, DONE, Vm, ours_by_node
from .operation import Context, Outcome, cloud_reason, log_by_kind, timed
from .plan import SATISFIED, next_down_action

log = logging.getLogger(__name__)


@dataclass
class _Down:
    node: str
    vm: Vm
    action: str
    issued: str | None = None
    placed: Vm | None = None  # the VM as last seen on a host (its GPUs), for the usage record

    def __post_init__(self) -> None:
        self.placed = self.vm if self.vm.host else None

    def record(self, ctx: Context) -> None:
        """The usage record of a VM this run took down: removed (DONE, or dropped) or off."""
        if self.issued is None:
            return  # found down already: not this run's doing
        seen = self.vm if self.placed is None else replace(self.placed, state=self.vm.state,
                                                            lcm_state=self.vm.lcm_state)
        event = "removed" if self.vm.state == DONE or self.issued == "recover-delete" else "off"
        ctx.recorder.record(event, self.node, seen, action=self.issued)


def power_down(ctx: Context, nodes: Sequence[str], why: str, force: bool) -> Outcome:
    """Take nodes' VMs down: each node set's suspend_action (or terminate when force), confirmed by polling.

    Escalates to the -hard form half-way through the bound; with force (resume-fail, reconcile) a VM
    that refuses terminate is dropped with recover --delete so no GPU stays held.
    """
    outcome = Outcome()
    config = ctx.config
    nodesets = {node: config.nodeset_for(node) for node in nodes}
    for node in nodes:
        if nodesets[node] is None:
            log.error("node %s is in no [[nodeset]] of %s: left alone", node, config.path)
            outcome.fail(node, "not in any nodeset")
    wanted = [n for n in nodes if nodesets[n] is not None]
    if not wanted:
        return outcome
    start = ctx.clock()
    deadline = start + config.power.suspend_timeout
    try:
        vms = ctx.cloud.cluster_vms(ctx.cluster)
    except CloudError as exc:
        for node in wanted:
            outcome.fail(node, cloud_reason(exc))
        return outcome
    ours = ours_by_node(vms, ctx.cluster, wanted)
    tasks: list[_Down] = []
    for node in wanted:
        nodeset = nodesets[node]
        assert nodeset is not None
        if not ours.get(node):
            outcome.done.append(node)
        for vm in ours.get(node, []):
            tasks.append(_Down(node, vm, "terminate" if force else nodeset.suspend_action))
    if outcome.done:
        log.info("nodes=%s: no VM of ours, nothing to do", fold(outcome.done))
    log_by_kind((f"state={t.vm.state_name}: {t.action} ({why})", t.node, t.vm) for t in tasks)
    interval = Backoff(ctx.poll_first, config.power.poll_max)
    with ThreadPoolExecutor(max_workers=config.opennebula.max_parallel) as pool:
        while tasks:
            now = ctx.clock()
            escalate = now >= start + config.power.suspend_timeout / 2
            pending = [t for t in tasks if t.vm.state not in SATISFIED[t.action]]
            satisfied = [t for t in tasks if t.vm.state in SATISFIED[t.action]]
            log_by_kind((f"now {t.vm.state_name}", t.node, t.vm) for t in satisfied)
            for task in satisfied:
                task.record(ctx)
            last = now >= deadline
            futures = [pool.submit(_step_down, ctx, task, escalate, force, last) for task in pending]
            acted = [future.result() for future in futures]
            for task in pending:
                if task.issued == "recover-delete":
                    task.record(ctx)  # dropped at once: oned frees its host share now
            tasks = [t for t in pending if t.issued != "recover-delete"]
            if now >= deadline:
                # One reason per state, so that the summary of 1,000 late VMs is a line, not a page; the
                # VM ids are in the warning.
                late = [(f"VM still {t.vm.state_name} after {config.power.suspend_timeout:g}s", t.node, t.vm)
                        for t in tasks]
                log_by_kind(late, logging.WARNING)
                for reason, node, _ in late:
                    outcome.fail(node, reason)
                break
            if not tasks:
                break
            if not any(acted):  # actions just issued are looked at once: some end at once (PENDING, failed)
                ctx.sleep(interval.next())
            try:
                snapshot = {vm.id: vm for vm in ctx.cloud.cluster_vms(ctx.cluster)}
            except CloudError as exc:
                log.warning("pool query failed: %s", exc)
                continue
            for task in tasks:
                task.vm = snapshot.get(task.vm.id, _gone(task.vm))
                if task.vm.host and task.vm.state == ACTIVE:  # still holding its host share
                    task.placed = task.vm
                ctx.observe(task.node, task.vm)
    settled = set(outcome.failed_nodes) | set(outcome.done)
    outcome.done.extend(n for n in wanted if n not in settled)
    return outcome


def _gone(vm: Vm) -> Vm:
    # The pool query leaves out DONE VMs: a VM no longer listed has reached DONE.
    return Vm(id=vm.id, name=vm.name, state=DONE, lcm_state=0, user_template=vm.user_template)


def _step_down(ctx: Context, task: _Down, escalate: bool, force: bool, last: bool) -> bool:
    """Issue the next action for one VM if it needs one; True when an action was issued now."""
    vm = task.vm
    before = task.issued
    action = next_down_action(task.action, vm, escalate)
    if force and last and task.action == "terminate":
        action = "recover-delete"  # stuck past suspend_timeout: dropped, even while deploying (operation.remove_vm)
    if action is None:
        log.debug("node=%s vm=%d in %s: waiting until it can be acted on", task.node, vm.id, vm.state_name)
        return False
    if action == task.issued:
        return False
    try:
        if action == "recover-delete":
            timed(action, task.node, vm.id, lambda: ctx.cloud.recover_delete(vm.id))
        else:
            timed(action, task.node, vm.id, lambda: ctx.cloud.action(action, vm.id))
        task.issued = action
    except ActionRefused as exc:
        log.info("node=%s vm=%d %s refused in %s, will retry: %s", task.node, vm.id, action, vm.state_name, exc)
        if force and task.action == "terminate" and _may_drop(ctx, task):
            timed("recover-delete", task.node, vm.id, lambda: ctx.cloud.recover_delete(vm.id))
            task.issued = "recover-delete"
    except CloudError as exc:
        log.warning("node=%s vm=%d %s failed, will retry: %s", task.node, vm.id, action, exc)
    return task.issued != before


def _may_drop(ctx: Context, task: _Down) -> bool:
    """Whether a VM that refused terminate may be dropped with recover --delete now: not while oned's scheduler
    is deploying it (that stalls oned's placements, see operation.remove_vm), nor when its state cannot be
    read; it is then looked at again at the next poll, and dropped at the deadline if still stuck."""
    try:
        task.vm = ctx.cloud.vm(task.vm.id)
    except CloudError as exc:
        log.warning("node=%s vm=%d state unreadable after a refusal: %s", task.node, task.vm.id, exc)
        return False
    if task.vm.deploying:
        log.info("node=%s vm=%d is %s: waiting for it to finish, then terminating it", task.node, task.vm.id,
                 task.vm.state_name)
        return False
    return True
