"""Resume, suspend and resume-fail: planning and orchestration over a Cloud and a Slurm (no direct I/O)."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol
from xml.sax.saxutils import escape

from . import __version__
from .cloud import (
    ACTIVE,
    CLONING,
    DONE,
    HOLD,
    PENDING,
    POWEROFF,
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
from .config import Config, NodeSet
from .errors import ActionRefused, CloudError, SlurmError
from .hostlists import fold
from .slurm import SlurmControl

log = logging.getLogger(__name__)


class Cloud(Protocol):
    """What power.py needs of OpenNebula (cloud.OneCloud, or a fake in tests)."""

    def cluster_vms(self, cluster: str) -> list[Vm]: ...
    def template_id(self, ref: str | int) -> int: ...
    def template(self, template_id: int) -> dict[str, Any]: ...
    def instantiate(self, template_id: int, name: str, extra: str, retry: bool = True) -> int: ...
    def action(self, action: str, vm_id: int) -> None: ...
    def recover_delete(self, vm_id: int) -> None: ...


@dataclass
class Outcome:
    """Partial success as a value: nodes done, nodes failed grouped by reason."""

    done: list[str] = field(default_factory=list)
    failed: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def fail(self, node: str, reason: str) -> None:
        """Record a failed node with its reason."""
        self.failed[reason].append(node)

    @property
    def failed_nodes(self) -> list[str]:
        """Every failed node."""
        return sorted(node for nodes in self.failed.values() for node in nodes)

    def describe(self) -> str:
        """One line: counts and the failures by reason."""
        text = f"{len(self.done)} done, {len(self.failed_nodes)} failed"
        if self.failed:
            text += " (" + "; ".join(f"{reason}: {fold(nodes)}" for reason, nodes in self.failed.items()) + ")"
        return text


@dataclass
class Context:
    """Everything an operation needs, handed in (tests pass fakes and fake clocks)."""

    config: Config
    cloud: Cloud
    slurm: SlurmControl
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    on_vm: Callable[[str, Vm], None] | None = None  # progress observer (the demo)
    poll_first: float = 0.25
    removing: set[int] = field(default_factory=set)  # VM ids already being removed in this run

    @property
    def cluster(self) -> str:
        """Our cluster name, the first half of every VM's identity."""
        return self.config.slurm.cluster


def ours_by_node(vms: Iterable[Vm], cluster: str, nodes: Iterable[str]) -> dict[str, list[Vm]]:
    """Our live VMs for these nodes (identity: name and tags), by node."""
    wanted = set(nodes)
    found: dict[str, list[Vm]] = defaultdict(list)
    for vm in vms:
        if vm.name in wanted and vm.state != DONE and vm.is_ours(cluster, vm.name):
            found[vm.name].append(vm)
    return found


# ---- planning -------------------------------------------------------------------------------------

OFF_STATES = (POWEROFF, UNDEPLOYED, STOPPED, SUSPENDED)


@dataclass(frozen=True)
class Plan:
    """What resume does for one node."""

    action: str  # instantiate | resume | release | recreate | wait
    vm: Vm | None = None
    extra: tuple[Vm, ...] = ()  # duplicate VMs of ours for the node, to terminate


def _rank(vm: Vm) -> int:
    if vm.failed:
        return 0
    if vm.state in OFF_STATES:
        return 1
    if vm.state in (PENDING, HOLD):
        return 2
    return 4 if vm.running else 3


def plan_resume(vms: Sequence[Vm]) -> Plan:
    """Decide the resume action for one node from its VMs of ours."""
    if not vms:
        return Plan("instantiate")
    ordered = sorted(vms, key=lambda vm: (_rank(vm), vm.id), reverse=True)
    keep, extra = ordered[0], tuple(ordered[1:])
    if keep.failed:
        action = "recreate"
    elif keep.state in OFF_STATES or (keep.state == ACTIVE and keep.lcm_state == UNKNOWN_LCM):
        action = "resume"
    elif keep.state == HOLD:
        action = "release"
    else:
        action = "wait"
    return Plan(action, keep, extra)


def extra_template(cluster: str, node: str, jobs: Sequence[int], context: Mapping[str, Any]) -> str:
    """The extra template given at instantiate, in oned's XML form (values escaped, CDATA-free).

    oned's instantiate replaces a template attribute given again in the extra template, so CONTEXT
    is sent whole: the template's own CONTEXT plus SET_HOSTNAME and SLURM_NODENAME.
    """
    def element(key: str, value: object) -> str:
        return f"<{key}>{escape(str(value))}</{key}>"

    merged = {str(k): v for k, v in context.items() if not isinstance(v, (dict, list))}
    merged.update({"SET_HOSTNAME": node, TAG_NODE: node})
    parts = [element(TAG_CLUSTER, cluster), element(TAG_NODE, node), element(TAG_MANAGER, __version__)]
    if jobs:
        parts.append(element(TAG_JOBS, ",".join(str(j) for j in sorted(set(jobs)))))
    parts.append("<CONTEXT>" + "".join(element(k, v) for k, v in merged.items()) + "</CONTEXT>")
    return "<TEMPLATE>" + "".join(parts) + "</TEMPLATE>"


# ---- removing a VM (used by every operation) ------------------------------------------------------


def remove_vm(cloud: Cloud, vm: Vm) -> str:
    """Terminate a VM of ours now, whatever its state; returns the action used."""
    quick = vm.failed or vm.state in (PENDING, HOLD, CLONING) or vm.state in OFF_STATES
    action = "terminate" if quick else "terminate-hard"
    try:
        cloud.action(action, vm.id)
        return action
    except ActionRefused:
        # A VM stuck in a transitional state (BOOT, PROLOG...) refuses terminate; recover --delete
        # is oned's way to drop it and free its host resources, GPU included.
        cloud.recover_delete(vm.id)
        return "recover-delete"


def _timed(what: str, node: str, vm_id: int | None, fn: Callable[[], Any]) -> Any:
    start = time.monotonic()
    try:
        result = fn()
    except Exception as exc:
        log.info("node=%s vm=%s action=%s result=error seconds=%.2f error=%s", node, vm_id, what,
                 time.monotonic() - start, exc)
        raise
    log.info("node=%s vm=%s action=%s result=ok seconds=%.2f", node, result if vm_id is None else vm_id,
             what, time.monotonic() - start)
    return result


# ---- resume ---------------------------------------------------------------------------------------


@dataclass
class _Boot:
    node: str
    nodeset: NodeSet
    deadline: float
    vm_id: int | None = None
    future: Future[int] | None = None
    attempts: int = 0
    addr: str | None = None
    seen: str = ""


def resume(ctx: Context, nodes: Sequence[str], jobs: Mapping[str, Sequence[int]]) -> Outcome:
    """Bring nodes up: plan from one pool query, act in parallel, watch, hand back what cannot start."""
    outcome = Outcome()
    config = ctx.config
    boots: list[_Boot] = []
    start = ctx.clock()
    refused = [node for node in nodes if config.nodeset_for(node) is None]
    for node in refused:
        log.error("node %s is in no [[nodeset]] of %s: refused", node, config.path)
    if refused:
        _hand_back(ctx, outcome, refused, f"not in any nodeset of {config.path.name}")
    for node in nodes:
        nodeset = config.nodeset_for(node)
        if nodeset is not None:
            boots.append(_Boot(node, nodeset, start + nodeset.boot_timeout))
    if not boots:
        return outcome
    try:
        _resume(ctx, boots, jobs, outcome)
    except BaseException:
        # Fail safe: whatever went wrong, nobody waits for ResumeTimeout.
        left = [b.node for b in boots if b.node not in outcome.done and b.node not in outcome.failed_nodes]
        log.exception("internal error during resume; handing back %s", fold(left) if left else "nothing")
        if left:
            _hand_back(ctx, outcome, left, "internal error in resume, see nebula-power log")
        raise
    return outcome


def _resume(ctx: Context, boots: list[_Boot], jobs: Mapping[str, Sequence[int]], outcome: Outcome) -> None:
    templates: dict[int, tuple[int, dict[str, Any]]] = {}
    for nodeset in {id(b.nodeset): b.nodeset for b in boots}.values():
        try:
            tid = ctx.cloud.template_id(nodeset.template)
            context = ctx.cloud.template(tid).get("CONTEXT") or {}
            templates[id(nodeset)] = (tid, context if isinstance(context, dict) else {})
        except CloudError as exc:
            log.error("node set %s: template %r: %s", nodeset.nodes_expr, nodeset.template, exc)
            bad = [b for b in boots if b.nodeset is nodeset]
            _hand_back(ctx, outcome, [b.node for b in bad], f"template {nodeset.template}: {_short(exc)}")
            boots[:] = [b for b in boots if b.nodeset is not nodeset]
    if not boots:
        return
    try:
        vms = ctx.cloud.cluster_vms(ctx.cluster)
    except CloudError as exc:
        _hand_back(ctx, outcome, [b.node for b in boots], f"OpenNebula: {_short(exc)}")
        return
    ours = ours_by_node(vms, ctx.cluster, (b.node for b in boots))
    plans = [(boot, plan_resume(ours.get(boot.node, []))) for boot in boots]
    _log_by_kind((f"plan={plan.action}", boot.node, plan.vm) for boot, plan in plans)
    pool = ThreadPoolExecutor(max_workers=ctx.config.opennebula.max_parallel)
    try:
        for boot, plan in plans:
            tid, context = templates[id(boot.nodeset)]
            boot.future = pool.submit(_start_boot, ctx, boot, plan, tid,
                                      extra_template(ctx.cluster, boot.node, jobs.get(boot.node, ()), context))
        _watch_boots(ctx, pool, boots, templates, jobs, outcome)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    _sweep_failed(ctx, outcome)


def _log_by_kind(items: Iterable[tuple[str, str, Vm | None]]) -> None:
    """One log line per kind (a plan, a state) naming its nodes and VMs, not one line per node.

    A 1,000-node run otherwise writes thousands of lines that say the same thing, and each costs
    the interpreter lock while the calls' threads wait for it.
    """
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for kind, node, vm in items:
        nodes, vms = groups.setdefault(kind, ([], []))
        nodes.append(node)
        if vm is not None:
            vms.append(str(vm.id))
    for kind, (nodes, vms) in groups.items():
        log.info("%s nodes=%s vms=%s", kind, fold(nodes), ",".join(vms) or "none")


def _sweep_failed(ctx: Context, outcome: Outcome) -> None:
    """After the actions drained: no VM of ours may remain for a node handed back in this run.

    Catches VMs oned created for calls whose answer never reached us (a timed-out instantiate that
    was abandoned), which no one would ever terminate.  Runs under the nodes' locks.
    """
    if not outcome.failed:
        return
    failed = outcome.failed_nodes
    try:
        vms = ctx.cloud.cluster_vms(ctx.cluster)
    except CloudError as exc:
        log.error("could not check %s for leftover VMs, reconcile will: %s", fold(failed), exc)
        return
    for node, leftovers in ours_by_node(vms, ctx.cluster, failed).items():
        for vm in leftovers:
            if vm.id not in ctx.removing:
                log.warning("node=%s vm=%d left over after the node was handed back: removing it", node, vm.id)
                _remove(ctx, node, vm)


def _remove(ctx: Context, node: str, vm: Vm) -> None:
    """Remove one VM of ours (once per run), logging the action; errors are logged, reconcile retries."""
    ctx.removing.add(vm.id)
    try:
        _timed("remove", node, vm.id, lambda: remove_vm(ctx.cloud, vm))
    except CloudError as exc:
        log.error("node=%s vm=%d could not be removed, reconcile will: %s", node, vm.id, exc)


def _unknown(vm_id: int, node: str) -> Vm:
    """A VM whose state we did not see: treated as running, so removal tries terminate-hard, then delete."""
    return Vm(id=vm_id, name=node, state=ACTIVE, lcm_state=3)


def _start_boot(ctx: Context, boot: _Boot, plan: Plan, tid: int, extra: str) -> int:
    for duplicate in plan.extra:
        _remove(ctx, boot.node, duplicate)
    if plan.action in ("resume", "release") and plan.vm is not None:
        vm_id = plan.vm.id
        _timed(plan.action, boot.node, vm_id, lambda: ctx.cloud.action(plan.action, vm_id))
        return vm_id
    if plan.action == "wait" and plan.vm is not None:
        return plan.vm.id
    if plan.action == "recreate" and plan.vm is not None:
        old = plan.vm
        log.warning("node=%s vm=%d is %s: recreating it", boot.node, old.id, old.state_name)
        ctx.removing.add(old.id)
        try:
            _timed("remove", boot.node, old.id, lambda: remove_vm(ctx.cloud, old))
        except CloudError:
            ctx.removing.discard(old.id)  # still ours to remove: the sweep or reconcile will
            raise
    result: int = _timed("instantiate", boot.node, None,
                         lambda: ctx.cloud.instantiate(tid, boot.node, extra))
    return result


def _watch_boots(ctx: Context, pool: ThreadPoolExecutor, boots: list[_Boot],
                 templates: Mapping[int, tuple[int, dict[str, Any]]],
                 jobs: Mapping[str, Sequence[int]], outcome: Outcome) -> None:
    active = list(boots)
    interval = ctx.poll_first
    while active:
        _pause(ctx, [b.future for b in active if b.future is not None], interval)
        interval = min(interval * 1.5, ctx.config.power.poll_max)
        now = ctx.clock()
        failures: dict[str, list[_Boot]] = defaultdict(list)
        for boot in active:
            future = boot.future
            if future is not None and future.done():
                boot.future = None
                try:
                    boot.vm_id = future.result()
                except CloudError as exc:
                    failures[f"OpenNebula: {_short(exc)}"].append(boot)
            elif future is not None and now >= boot.deadline + ctx.config.opennebula.timeout:
                failures["OpenNebula did not answer in time"].append(boot)
        failing = {id(b) for b in _flat(failures)}
        known = [b for b in active if b.vm_id is not None and b.future is None and id(b) not in failing]
        snapshot: dict[int, Vm] = {}
        if known:
            try:
                vms = ctx.cloud.cluster_vms(ctx.cluster)
            except CloudError as exc:
                log.warning("pool query failed: %s", exc)
                for boot in known:
                    if now >= boot.deadline:
                        failures[f"OpenNebula: {_short(exc)}"].append(boot)
                known = []
            else:
                snapshot = {vm.id: vm for vm in vms}
                _remove_duplicates(ctx, pool, known, ours_by_node(vms, ctx.cluster, (b.node for b in known)))
        addresses: dict[str, str] = {}
        for boot in known:
            vm = snapshot.get(boot.vm_id if boot.vm_id is not None else -1)
            if vm is not None and vm.ip and vm.ip != boot.addr:
                addresses[boot.node] = boot.addr = vm.ip
            verdict = _judge(ctx, boot, vm, now)
            if verdict == "done":
                outcome.done.append(boot.node)
            elif verdict == "recreate":
                boot.attempts += 1
                tid, context = templates[id(boot.nodeset)]
                boot.vm_id, boot.addr = None, None
                boot.future = pool.submit(_start_boot, ctx, boot, Plan("recreate", vm), tid, extra_template(
                    ctx.cluster, boot.node, jobs.get(boot.node, ()), context))
            elif verdict:
                failures[verdict].append(boot)
        if addresses:
            try:
                ctx.slurm.set_addresses(addresses, {b.node: b.vm_id for b in known if b.vm_id is not None})
            except SlurmError as exc:
                log.error("could not set node addresses: %s", exc)
        for reason, failed in failures.items():
            _give_up(ctx, pool, failed, snapshot, reason, outcome)
        settled = set(outcome.done) | {b.node for b in _flat(failures)}
        active = [b for b in active if b.node not in settled]


def _pause(ctx: Context, calls: Sequence[Future[int]], interval: float) -> None:
    """Until the next poll: until every call in flight has answered, else the interval.

    The VMs those calls made or resumed are then worth a look at once: oned leases their addresses
    at instantiate (NodeAddr can be set now), and a VM that boots fast is seen without a wasted pause.
    While calls are still in flight the pool is read at most every poll_max: their VMs are not up
    yet, and reading a 1,000-VM pool holds the interpreter ~0.2 s, stalling the calls' threads.
    """
    if calls:
        wait(calls, timeout=max(interval, ctx.config.power.poll_max))
    else:
        ctx.sleep(interval)


def _flat(failures: Mapping[str, list[_Boot]]) -> list[_Boot]:
    return [boot for boots in failures.values() for boot in boots]


def _remove_duplicates(ctx: Context, pool: ThreadPoolExecutor, known: Sequence[_Boot],
                       ours: Mapping[str, list[Vm]]) -> None:
    """A retried instantiate whose first answer was lost leaves a second VM of ours: remove it."""
    for boot in known:
        for vm in ours.get(boot.node, []):
            if vm.id != boot.vm_id and vm.id not in ctx.removing:
                ctx.removing.add(vm.id)  # before the pool runs it: the next poll must not submit it again
                log.warning("node=%s vm=%d duplicates vm=%s: removing it", boot.node, vm.id, boot.vm_id)
                pool.submit(_remove, ctx, boot.node, vm)


def _judge(ctx: Context, boot: _Boot, vm: Vm | None, now: float) -> str:
    """'' keep waiting, 'done', 'recreate', or a failure reason."""
    if vm is not None and ctx.on_vm is not None:
        ctx.on_vm(boot.node, vm)
    if vm is None:
        return _retry_or(ctx, boot, now, "VM vanished while booting")
    if vm.state_name != boot.seen:
        log.info("node=%s vm=%d state=%s ip=%s", boot.node, vm.id, vm.state_name, vm.ip)
        boot.seen = vm.state_name
    if vm.failed:
        return _retry_or(ctx, boot, now, f"VM failed to boot ({vm.state_name})")
    if vm.running and vm.ip and (boot.nodeset.wait_for == "running" or vm.ready):
        return "done"
    if now < boot.deadline:
        return ""
    if vm.state == PENDING and vm.sched_message:
        return "no host with a free GPU (VM PENDING past boot_timeout)"
    if vm.running and vm.ip and boot.nodeset.wait_for == "ready":
        return f"guest did not report READY=YES within boot_timeout {boot.nodeset.boot_timeout:g}s (RUNNING)"
    return f"not up after boot_timeout {boot.nodeset.boot_timeout:g}s ({vm.state_name})"


def _retry_or(ctx: Context, boot: _Boot, now: float, reason: str) -> str:
    if boot.attempts < ctx.config.power.recreate_attempts and now < boot.deadline:
        return "recreate"
    return reason


def _give_up(ctx: Context, pool: ThreadPoolExecutor, failed: list[_Boot], snapshot: Mapping[int, Vm],
             reason: str, outcome: Outcome) -> None:
    """Terminate the VMs of nodes that cannot start (no GPU stays held), then hand the nodes back."""
    removals = []
    for boot in failed:
        vm = None if boot.vm_id is None else snapshot.get(boot.vm_id, _unknown(boot.vm_id, boot.node))
        log.error("node=%s vm=%s failed: %s", boot.node, boot.vm_id, reason)
        if vm is not None and vm.id not in ctx.removing:
            removals.append(pool.submit(_remove, ctx, boot.node, vm))
    for removal in removals:
        removal.result()
    _hand_back(ctx, outcome, [b.node for b in failed], reason)


def _hand_back(ctx: Context, outcome: Outcome, nodes: Sequence[str], reason: str) -> None:
    for node in nodes:
        outcome.fail(node, reason)
    try:
        ctx.slurm.hand_back(list(nodes), reason)
        log.warning("handed %s back to Slurm: %s", fold(nodes), reason)
    except SlurmError as exc:
        log.error("could not hand %s back to Slurm (%s): %s", fold(nodes), reason, exc)


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:150]


# ---- suspend and resume-fail ----------------------------------------------------------------------

# The state a suspend action leaves a VM in, and the states that already satisfy it.
SATISFIED = {"terminate": (DONE,), "undeploy": (UNDEPLOYED, STOPPED),
             "poweroff": (POWEROFF, UNDEPLOYED, STOPPED, SUSPENDED)}
ACTS_FROM = {"terminate": (POWEROFF, UNDEPLOYED, STOPPED, SUSPENDED), "undeploy": (POWEROFF,), "poweroff": ()}


@dataclass
class _Down:
    node: str
    vm: Vm
    action: str
    issued: str | None = None


def next_down_action(action: str, vm: Vm, escalate: bool) -> str | None:
    """The oned action that moves vm toward the suspend action's end state now, or None to wait."""
    never_ran = vm.state == PENDING and vm.host is None
    if vm.failed or vm.state in (HOLD, CLONING) or never_ran or (action == "terminate" and vm.state == PENDING):
        # Never ran (or cannot run): nothing to keep, and oned frees it at once.
        return "terminate"
    if vm.state in ACTS_FROM[action]:
        return action
    if vm.state == ACTIVE and vm.lcm_state in (3, UNKNOWN_LCM):
        return f"{action}-hard" if escalate else action
    return None


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
            outcome.fail(node, f"OpenNebula: {_short(exc)}")
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
    _log_by_kind((f"state={t.vm.state_name}: {t.action} ({why})", t.node, t.vm) for t in tasks)
    interval = ctx.poll_first
    with ThreadPoolExecutor(max_workers=config.opennebula.max_parallel) as pool:
        while tasks:
            now = ctx.clock()
            escalate = now >= start + config.power.suspend_timeout / 2
            pending = [t for t in tasks if t.vm.state not in SATISFIED[t.action]]
            _log_by_kind((f"now {t.vm.state_name}", t.node, t.vm)
                         for t in tasks if t.vm.state in SATISFIED[t.action])
            last = now >= deadline
            futures = [pool.submit(_step_down, ctx, task, escalate, force, last) for task in pending]
            acted = [future.result() for future in futures]
            tasks = pending
            tasks = [t for t in tasks if t.issued != "recover-delete"]
            if now >= deadline:
                for task in tasks:
                    outcome.fail(task.node, f"VM {task.vm.id} still {task.vm.state_name} after "
                                 f"{config.power.suspend_timeout:g}s")
                break
            if not tasks:
                break
            if not any(acted):  # actions just issued are looked at once: some end at once (PENDING, failed)
                ctx.sleep(interval)
                interval = min(interval * 1.5, config.power.poll_max)
            try:
                snapshot = {vm.id: vm for vm in ctx.cloud.cluster_vms(ctx.cluster)}
            except CloudError as exc:
                log.warning("pool query failed: %s", exc)
                continue
            for task in tasks:
                task.vm = snapshot.get(task.vm.id, _gone(task.vm))
                if ctx.on_vm is not None:
                    ctx.on_vm(task.node, task.vm)
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
        action = "recover-delete"
    if action is None:
        log.debug("node=%s vm=%d in %s: waiting until it can be acted on", task.node, vm.id, vm.state_name)
        return False
    if action == task.issued:
        return False
    try:
        if action == "recover-delete":
            _timed(action, task.node, vm.id, lambda: ctx.cloud.recover_delete(vm.id))
        else:
            _timed(action, task.node, vm.id, lambda: ctx.cloud.action(action, vm.id))
        task.issued = action
    except ActionRefused as exc:
        log.info("node=%s vm=%d %s refused in %s, will retry: %s", task.node, vm.id, action, vm.state_name, exc)
        if force and task.action == "terminate":
            _timed("recover-delete", task.node, vm.id, lambda: ctx.cloud.recover_delete(vm.id))
            task.issued = "recover-delete"
    except CloudError as exc:
        log.warning("node=%s vm=%d %s failed, will retry: %s", task.node, vm.id, action, exc)
    return task.issued != before
