"""Resume: plan from one pool query, act in parallel, watch the VMs boot, hand back what cannot start."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from .backoff import Backoff
from .booting import Boot, Step, collect_calls, not_ready_up, set_addresses
from .direct import Direct
from .errors import CloudError, Unanswered
from .gate import Gate
from .hostlists import fold
from .model import Vm, ours_by_node
from .operation import (
    Context,
    Outcome,
    Patience,
    Removals,
    cloud_reason,
    hand_back,
    log_by_kind,
    remove_vm,
    timed,
    unseen_vm,
)
from .pacing import Pacer, Waves, pending_floor, placing
from .placement import jobs_first
from .plan import Plan, extra_template, plan_resume
from .protect import Guard
from .stepout import after_resume

log = logging.getLogger(__name__)
PACING_POLL = 0.5  # seconds between pool queries at most while nodes wait for max_pending
PACED = frozenset({"instantiate", "recreate", "resume", "release"})  # plans whose VM goes PENDING


def resume(ctx: Context, nodes: Sequence[str], jobs: Mapping[str, Sequence[int]]) -> Outcome:
    """Bring nodes up: plan from one pool query, act in parallel, watch, hand back what cannot start."""
    outcome = Outcome()
    config = ctx.config
    boots: list[Boot] = []
    start = ctx.clock()
    refused = [node for node in nodes if config.nodeset_for(node) is None]
    for node in refused:
        log.error("node %s is in no [[nodeset]] of %s: refused", node, config.path)
    if refused:
        hand_back(ctx, outcome, refused, f"not in any nodeset of {config.path.name}")
    for node in nodes:
        nodeset = config.nodeset_for(node)
        if nodeset is not None:
            boots.append(Boot(node, nodeset, start + nodeset.boot_timeout))
    if not boots:
        return outcome
    run = _Resume(ctx, jobs, outcome)
    try:
        run.run(boots)
    except BaseException:
        # Fail safe: whatever went wrong, nobody waits for ResumeTimeout.
        left = [b.node for b in boots if b.node not in outcome.done and b.node not in outcome.failed_nodes]
        log.exception("internal error during resume; handing back %s", fold(left) if left else "nothing")
        if left:
            hand_back(ctx, outcome, left, "internal error in resume, see nebula-power log")
        raise
    gate = run.gate
    after_resume(ctx, gate.short.values(), gate.lifted.values(), gate.hosts_read)
    return outcome


class _Resume:
    """One resume run: its templates, its thread pool, the VMs it is removing."""

    def __init__(self, ctx: Context, jobs: Mapping[str, Sequence[int]], outcome: Outcome) -> None:
        self.ctx = ctx
        self.jobs = jobs
        self.outcome = outcome
        self.removals = Removals(ctx.cloud, Patience.of(ctx), ctx.recorder)
        self.templates: dict[int, tuple[int, dict[str, Any]]] = {}  # id(nodeset) -> (template id, CONTEXT)
        self.gate, self.guard = Gate(ctx, jobs), Guard(ctx, jobs)
        self.direct = Direct(ctx, self.gate, jobs)  # node sets with placement = "direct" (direct.py)
        self.boots: dict[str, Boot] = {}
        self.pool = ThreadPoolExecutor(max_workers=ctx.config.opennebula.max_parallel)
        self.waves: Waves[Boot] = Waves(Pacer(ctx.config.opennebula.max_pending))  # the paced plans
        self.floor: int | None = None  # the lowest id of a VM of our user PENDING at the last pool read

    def run(self, boots: list[Boot]) -> None:
        """Read templates and the pool once, start every node, watch them, sweep what failed."""
        ctx = self.ctx
        self.boots = {boot.node: boot for boot in boots}
        try:
            boots = self._cooldown(boots)
            boots = self._read_templates(boots)
            if not boots:
                return
            try:
                vms = ctx.cloud.cluster_vms(ctx.cluster)
            except CloudError as exc:
                hand_back(ctx, self.outcome, [b.node for b in boots], cloud_reason(exc))
                return
            self.floor = pending_floor(vms)
            ours = ours_by_node(vms, ctx.cluster, (b.node for b in boots))
            plans = [(boot, plan_resume(ours.get(boot.node, []))) for boot in boots]
            log_by_kind((f"plan={plan.action}", boot.node, plan.vm) for boot, plan in plans)
            plans = self._admit(plans)
            hosts = self.gate.hosts_read()  # read for the GPU count (not for a node set without GPUs)
            self.waves.pacer = Pacer(ctx.config.opennebula.max_pending,
                                     None if hosts is None else sum(1 for h in hosts if h.placeable))
            for boot, plan in jobs_first(plans, self.jobs, lambda item: item[0].node):
                if self.direct.takes(boot, plan) and self.direct.send(boot, plan, self.pool, self._start):
                    continue
                if plan.action in PACED:
                    self.waves.waiting.append((boot, plan))
                else:
                    boot.future = self.pool.submit(self._start, boot, plan)
            first = {vm.id: vm for vm in vms}
            self._expire(self._send(first, ctx.clock()), first)  # a slow host pool read can take boot_timeout
            self._watch(boots)
            # A backup controller that took over meanwhile may not have the addresses: tell them again.
            ctx.slurm.confirm_addresses({node: addr for node in self.outcome.done
                                         if (addr := self.boots[node].addr) is not None})
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self._sweep_failed()

    def _read_templates(self, boots: list[Boot]) -> list[Boot]:
        ctx = self.ctx
        for nodeset in {id(b.nodeset): b.nodeset for b in boots}.values():
            try:
                tid = ctx.cloud.template_id(nodeset.template)
                body = ctx.cloud.template(tid)
                context = body.get("CONTEXT") or {}
                self.templates[id(nodeset)] = (tid, context if isinstance(context, dict) else {})
                self.gate.learn_template(nodeset, body)
            except CloudError as exc:  # the credentials, the endpoint or the template: gate says which
                bad = [b.node for b in boots if b.nodeset is nodeset]
                hand_back(ctx, self.outcome, bad, self.gate.template_failed(nodeset, exc))
                boots = [b for b in boots if b.nodeset is not nodeset]
        return boots

    # -- capacity, cooldown and job policy, before anything is created --

    def _cooldown(self, boots: list[Boot]) -> list[Boot]:
        """Hand back at once the nodes of node sets protected or in their shortage cooldown (unless GPUs came back)."""
        for nodeset in {id(b.nodeset): b.nodeset for b in boots}.values():
            mine = [b.node for b in boots if b.nodeset is nodeset]
            reason = self.guard.holding(nodeset) or self.gate.cooling(nodeset, len(mine))
            if reason is not None:
                hand_back(self.ctx, self.outcome, mine, reason)
                boots = [b for b in boots if b.nodeset is not nodeset]
        return boots

    def _admit(self, plans: list[tuple[Boot, Plan]]) -> list[tuple[Boot, Plan]]:
        """Hand back what the free GPUs cannot take, and the jobs that cannot start whole."""
        refused = self.gate.refuse([(b.node, b.nodeset, plan) for b, plan in plans], self.outcome.failed_nodes)
        by_reason: dict[str, list[tuple[Boot, Vm | None]]] = defaultdict(list)
        for boot, _ in plans:
            if boot.node in refused:
                reason, vms = refused[boot.node]
                by_reason[reason] += [(boot, vm) for vm in vms] or [(boot, None)]
        for reason, entries in by_reason.items():
            self._drop(entries, reason)
        return [(boot, plan) for boot, plan in plans if boot.node not in refused]

    def _drop(self, entries: Sequence[tuple[Boot, Vm | None]], reason: str) -> None:
        """Terminate these VMs of ours (no GPU stays held), then hand their nodes back."""
        removals = []
        for boot, vm in entries:
            log.error("node=%s vm=%s not started: %s", boot.node, vm.id if vm else None, reason)
            self.ctx.recorder.record("failed", boot.node, vm, reason=reason, jobs=self.jobs.get(boot.node, ()))
            if vm is not None and self.removals.claim(vm.id):
                removals.append(self.pool.submit(self.removals.remove, boot.node, vm))
        for removal in removals:
            removal.result()
        hand_back(self.ctx, self.outcome, list(dict.fromkeys(boot.node for boot, _ in entries)), reason)

    # -- pacing: waves no larger than oned places in a plan (pacing.py) --

    def _send(self, snapshot: Mapping[int, Vm] | None, now: float) -> list[Boot]:
        """After a pool read: let the pacer judge the sends it has looked at, then send the next wave if any.

        The window counts the VMs of our user PENDING for oned to place (another resume's too: they share
        the scheduler; one oned said it cannot place is left to pending_timeout) and our calls whose VM
        no read has seen yet.  A node's boot_timeout counts from when its plan is sent, not from the start
        of the run; one that could not be sent within boot_timeout of the start (oned placed nothing for
        that long) is returned, to fail.  No snapshot (the pool query failed): nothing is sent.
        """
        expired = self.waves.expire(set(self.outcome.done) | set(self.outcome.failed_nodes), now)
        if snapshot is None:
            return expired
        for before, after, still, sent in self.waves.look(snapshot):
            log.info("window %d -> %d: %d of the %d VMs sent last still PENDING for oned to place",
                     before, after, still, sent)
        if not self.waves.waiting:
            return expired
        unseen = sum(1 for b in self.boots.values() if b.future is not None)
        wave = self.waves.wave(placing(snapshot), unseen)
        for boot, plan in wave:
            boot.deadline = now + boot.nodeset.boot_timeout
            boot.future = self.pool.submit(self._start, boot, plan)
        if wave and self.waves.waiting:
            log.info("sent %d, %d waiting for oned to place the VMs before them (window %d, max_pending %d)",
                     len(wave), len(self.waves.waiting), self.waves.pacer.limit,
                     self.ctx.config.opennebula.max_pending)
        return expired

    # -- starting a node (in the pool) --

    def _start(self, boot: Boot, plan: Plan) -> int:
        ctx = self.ctx
        jobs = self.jobs.get(boot.node, ())
        for duplicate in plan.duplicates:
            self.removals.remove(boot.node, duplicate)
        direct = self.direct.takes(boot, plan)
        if plan.action in ("resume", "release") and plan.vm is not None and not direct:
            vm_id = plan.vm.id
            ready, message = plan.vm.ready and boot.nodeset.wait_for == "ready", bool(plan.vm.sched_message)
            if plan.action == "resume" and (ready or message):  # the last boot's (cloud.stale_update)
                timed("clear-stale", boot.node, vm_id, lambda: ctx.cloud.clear_stale(vm_id, ready, message))
            timed(plan.action, boot.node, vm_id, lambda: ctx.cloud.action(plan.action, vm_id))
            ctx.recorder.record("resumed", boot.node, plan.vm, jobs=jobs, action=plan.action)
            return vm_id
        if plan.action == "wait" and plan.vm is not None:
            return plan.vm.id
        if plan.action == "recreate" and plan.vm is not None:
            old = plan.vm
            log.warning("node=%s vm=%d is %s: recreating it", boot.node, old.id, old.state_name)
            self.removals.claim(old.id)
            try:
                action = timed("remove", boot.node, old.id, lambda: remove_vm(ctx.cloud, old, self.removals.patience))
            except CloudError:
                self.removals.release(old.id)  # still ours to remove: the sweep or reconcile will
                raise
            ctx.recorder.record("removed", boot.node, old, action=action)
        tid, context = self.templates[id(boot.nodeset)]
        extra = extra_template(ctx.cluster, boot.node, jobs, context, self.gate.placing.get(id(boot.nodeset)))
        if direct:
            return self.direct.start(boot, plan, tid, extra)
        result: int = timed("instantiate", boot.node, None, lambda: ctx.cloud.instantiate(tid, boot.node, extra))
        ctx.recorder.record("created", boot.node, vm_id=result, jobs=jobs, action="instantiate")
        return result

    # -- watching --

    def _watch(self, boots: list[Boot]) -> None:
        ctx = self.ctx
        active = list(boots)
        interval = Backoff(ctx.poll_first, ctx.config.power.poll_max)
        while active:
            pause = interval.next()
            if self.waves.waiting:  # oned places a plan every few seconds: see it soon, send the next VMs
                pause = min(pause, PACING_POLL)
            self._pause([b.future for b in active if b.future is not None], pause)
            now = ctx.clock()
            failures = collect_calls(ctx, self.gate, active, now)
            failing = {id(b) for boots in failures.values() for b in boots}
            known = [b for b in active if b.vm_id is not None and b.future is None and id(b) not in failing]
            snapshot = self._snapshot(known, now, failures)
            seen = snapshot
            if snapshot is None:
                known, snapshot = [], {}
            known = set_addresses(ctx, known, snapshot, failures)
            moved = self.direct.displaced(known)
            unplaced: list[tuple[Boot, Vm]] = []
            not_ready: list[Boot] = []
            for boot, vm, verdict in self.guard.judged(known, snapshot, now, failures, self.waves, moved):
                if verdict.step is Step.DONE:
                    self.outcome.done.append(boot.node)
                elif verdict.step in (Step.RECREATE, Step.MOVE):
                    boot.attempts += verdict.step is Step.RECREATE
                    boot.vm_id, boot.addr, boot.pending_since = None, None, None
                    boot.future = self.pool.submit(self._start, boot, Plan("recreate", vm))
                elif verdict.step is Step.UNPLACED and vm is not None:
                    unplaced.append((boot, vm))
                elif verdict.step is Step.NOT_READY:
                    not_ready.append(boot)
                elif verdict.step is Step.FAIL:
                    failures[verdict.reason].append(boot)
            for reason, placeless in self.gate.unplaced_all(unplaced).items():
                failures[reason].extend(placeless)
            if not_ready:
                not_ready_up(ctx, self.outcome, not_ready, failures, self.guard.note)
            for reason, failed in failures.items():
                self._give_up(failed, snapshot, reason)
            if failures:
                self._drag(snapshot)
            self._expire(self._send(seen, now), snapshot)
            settled = set(self.outcome.done) | set(self.outcome.failed_nodes)
            active = [b for b in active if b.node not in settled]

    def _expire(self, expired: list[Boot], snapshot: Mapping[int, Vm]) -> None:
        """Give up the nodes no wave sent within boot_timeout, and what their jobs drag down."""
        if expired:
            reason = (f"not sent within boot_timeout: oned placed too few of the VMs before it, or OpenNebula "
                      f"answered too slowly (max_pending {self.ctx.config.opennebula.max_pending})")
            self._give_up(expired, snapshot, reason)
            self._drag(snapshot)

    def _snapshot(self, known: Sequence[Boot], now: float,
                  failures: dict[str, list[Boot]]) -> dict[int, Vm] | None:
        """One pool query for the nodes whose VM id is known ({} when there are none, None when it failed).

        Only the VMs from the lowest id still to watch up are read (ids only grow): those of the known
        nodes, the duplicates a retried call made, and, from the last read's lowest PENDING VM up, every VM
        of our user PENDING for oned (another resume's too), which the pacing counts.  A 1,000-node burst
        then reads its last waves, not the 1,000 VMs (0.6-0.8 s a read on oned 7.4.0, most of resume's CPU).
        A VM of an earlier node a failure drags is not in the answer: _drag removes it by id.
        """
        if not known:
            return {}
        ctx = self.ctx
        first = min([b.vm_id for b in known if b.vm_id is not None] + ([] if self.floor is None else [self.floor]))
        try:
            vms = ctx.cloud.cluster_vms(ctx.cluster, first)
        except CloudError as exc:
            log.warning("pool query failed: %s", exc)
            for boot in known:  # OpenNebula away for the whole retry window: no use watching on
                if now >= boot.deadline or isinstance(exc, Unanswered):
                    failures[cloud_reason(exc)].append(boot)
            return None
        self.floor = pending_floor(vms)
        self._remove_duplicates(known, ours_by_node(vms, ctx.cluster, (b.node for b in known)))
        return {vm.id: vm for vm in vms}

    def _pause(self, calls: Sequence[Future[int]], interval: float) -> None:
        """Until the next poll: until every call in flight has answered, else the interval.

        The VMs those calls made or resumed are then worth a look at once: oned leases their addresses
        at instantiate (NodeAddr can be set now), and a VM that boots fast is seen without a wasted pause.
        While calls are still in flight the pool is read at most every poll_max: their VMs are not up
        yet, and reading a 1,000-VM pool holds the interpreter ~0.2 s, stalling the calls' threads;
        except while nodes wait for the window: oned frees slots as it places, whatever is in flight.
        """
        if calls:
            wait(calls, timeout=interval if self.waves.waiting else max(interval, self.ctx.config.power.poll_max))
        else:
            self.ctx.sleep(interval)

    def _remove_duplicates(self, known: Sequence[Boot], ours: Mapping[str, list[Vm]]) -> None:
        """A retried instantiate whose first answer was lost leaves a second VM of ours: remove it."""
        for boot in known:
            for vm in ours.get(boot.node, []):
                if vm.id != boot.vm_id and self.removals.claim(vm.id):
                    log.warning("node=%s vm=%d duplicates vm=%s: removing it", boot.node, vm.id, boot.vm_id)
                    self.pool.submit(self.removals.remove, boot.node, vm)

    # -- failing --

    def _give_up(self, failed: list[Boot], snapshot: Mapping[int, Vm], reason: str) -> None:
        """Terminate the VMs of nodes that cannot start (no GPU stays held), then hand the nodes back."""
        removals = []
        for boot in failed:
            vm = None if boot.vm_id is None else snapshot.get(boot.vm_id, unseen_vm(boot.vm_id, boot.node))
            log.error("node=%s vm=%s failed: %s", boot.node, boot.vm_id, reason)
            seen = None if boot.vm_id is None else snapshot.get(boot.vm_id)
            self.ctx.recorder.record("failed", boot.node, seen, vm_id=boot.vm_id, reason=reason,
                                     jobs=self.jobs.get(boot.node, ()))
            if vm is not None and vm.id not in self.removals:
                removals.append(self.pool.submit(self.removals.remove, boot.node, vm))
        for removal in removals:
            removal.result()
        hand_back(self.ctx, self.outcome, [b.node for b in failed], reason)

    def _drag(self, snapshot: Mapping[int, Vm]) -> None:
        """After failures: the all-or-nothing jobs that lost a node give back their other nodes too."""
        by_reason: dict[str, list[tuple[Boot, Vm | None]]] = defaultdict(list)
        for node, reason in self.gate.drag(self.outcome.failed_nodes).items():
            boot = self.boots.get(node)
            if boot is None:
                continue
            vm = None if boot.vm_id is None else snapshot.get(boot.vm_id, unseen_vm(boot.vm_id, node))
            by_reason[reason].append((boot, vm))
            if node in self.outcome.done:
                self.outcome.done.remove(node)
        for reason, entries in by_reason.items():
            self._drop(entries, reason)

    def _sweep_failed(self) -> None:
        """After the actions drained: no VM of ours may remain for a node handed back in this run.

        Catches VMs oned created for calls whose answer never reached us (a timed-out instantiate that
        was abandoned), which no one would ever terminate.  Runs under the nodes' locks.
        """
        if not self.outcome.failed:
            return
        ctx = self.ctx
        failed = self.outcome.failed_nodes
        try:
            vms = ctx.cloud.cluster_vms(ctx.cluster)
        except CloudError as exc:
            log.error("could not check %s for leftover VMs, reconcile will: %s", fold(failed), exc)
            return
        for node, leftovers in ours_by_node(vms, ctx.cluster, failed).items():
            for vm in leftovers:
                if vm.id not in self.removals:
                    log.warning("node=%s vm=%d left over after the node was handed back: removing it", node, vm.id)
                    self.removals.remove(node, vm)
