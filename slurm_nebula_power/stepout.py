"""A node set short of GPUs steps out of Slurm's way, and back in by itself.

While a node set is short (resume's count found fewer free GPUs than it needs, oned could not place a VM, a
quota: gate.py records the shortage, cooldown.py keeps it), its powered-down nodes are drained with a Reason
of ours ("nebula: out of service since ..."), so that slurmctld sends jobs to the other node sets of their
partitions at once, and the job that met the shortage runs elsewhere after its one requeue. A drain set
while the hand-back's power-down is queued is cleared when it starts (idle_on_node_suspend), so the nodes
are drained once powered down or powering down: by SuspendProgram (after_suspend), by resume for the node
set's other powered-down nodes, and again by every reconcile (docs/SLURM-FINDINGS.md, 22.05, 24.11, 26.05).
Only a node without a Reason or with one of ours is drained, and only a node drained with our
out-of-service Reason is ever undrained (State=UNDRAIN): an administrator's drain or down is never lifted.

A node set steps back in (its shortage forgotten, its nodes undrained) as soon as a host pool read
(reconcile's, or any resume's) shows free the GPUs the refused run wanted (after oned could not place a
VM: more than were free then), or once [power] shortage_cooldown has passed and one count shows room for
one VM; when nothing can be counted (a quota, a node set without GPUs, the pool unreadable) the cooldown's
end is enough: at worst one more bounce. A shortage file that is lost, unreadable or planted keeps no node
out: drained nodes of ours with no live shortage step back in at the next reconcile. Each node set is
stepped under a lock of its own, from a Slurm read made under it, so racing runs leave it out or in,
never half.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .admission import Shortage, may_retry
from .config import Config, NodeSet
from .cooldown import ShortageLog
from .errors import SlurmError
from .gate import shortage_free
from .hosts import Host
from .nodestate import OFF, NodeState
from .operation import Context
from .slurm import REASON_PREFIX

log = logging.getLogger(__name__)
OUT_FOR = "out of service"  # our step-out Reason begins REASON_PREFIX + OUT_FOR
LOCK_WAIT = 10.0  # seconds for another run stepping the same node set
FUTURE_SLACK = 60.0  # a shortage recorded later than now + this is no shortage (a clock set back, a plant)
Hosts = Callable[[], "list[Host] | None"]  # the host pool, read when first asked (None: unreadable)


def stepped_out(state: NodeState) -> bool:
    """Drained by a step-out of ours."""
    return state.is_drained and state.reason.startswith(REASON_PREFIX + OUT_FOR)


def takeable(state: NodeState) -> bool:
    """A node a step-out drains: powered down or powering down (not a power-down only queued, as the hand-back
    leaves it: idle_on_node_suspend would clear the drain when it starts, and the hand-back's Reason says
    why), neither drained nor down, and without a Reason that is not ours (an administrator's note stays)."""
    return ((state.phase == OFF or "POWERING_DOWN" in state.flags) and not state.is_drained and not state.is_down
            and (not state.reason or state.reason.startswith(REASON_PREFIX)))


@dataclass(frozen=True)
class Verdict:
    """Whether a node set stays out, and why; renew: its cooldown starts again (still short at its end)."""

    out: bool
    why: str
    renew: bool = False


def judge(shortage: Shortage | None, free: int | None, now: float, cooldown: float) -> Verdict:
    """Out or in, from the node set's shortage and the free devices now (None: not counted)."""
    if shortage is None:
        return Verdict(False, "no shortage on record")
    if shortage.at > now + FUTURE_SLACK:
        return Verdict(False, "its shortage record lies in the future: ignored")
    wanted = max(shortage.wanted, len(shortage.requests))
    seen = "" if free is None else f", {free} free"
    if shortage.age(now) < cooldown:
        if may_retry(shortage, free, wanted):
            return Verdict(False, f"GPUs back: {free} free, {wanted} wanted")
        return Verdict(True, f"short{seen}")
    if shortage.requests and free is not None and free < len(shortage.requests):
        return Verdict(True, f"still short at the cooldown's end{seen}", renew=True)
    return Verdict(False, f"cooldown {cooldown:g}s over{seen}")


def out_reason(shortage: Shortage, cooldown: float) -> str:
    """The Reason of a node stepped out (after REASON_PREFIX): when, until when, why."""
    since = time.strftime("%H:%M:%S", time.localtime(shortage.at))
    check = time.strftime("%H:%M:%S", time.localtime(shortage.at + cooldown))
    return f"{OUT_FOR} since {since}, back when GPUs return (checked at {check} at the latest): {shortage.reason}"


@dataclass(frozen=True)
class Step:
    """What one node set's step did: out (drained these nodes) or in (undrained these), and why."""

    nodeset: NodeSet
    out: bool
    nodes: tuple[str, ...]
    why: str

    def describe(self) -> str:
        """node set gpa[1-2] out (short, 0 free): drained gpa1; in: GPUs back."""
        what = ("drained " if self.out else "undrained ") + ",".join(self.nodes) if self.nodes else "no node to change"
        return f"node set {self.nodeset.nodes_expr} {'out' if self.out else 'in'} ({self.why}): {what}"


def out_nodes(nodeset: NodeSet, states: Mapping[str, NodeState]) -> list[str]:
    """The node set's nodes this Slurm read shows stepped out."""
    return [node for node in nodeset.nodes if node in states and stepped_out(states[node])]


class StepOut:
    """Steps node sets out of Slurm's way and back in (the module docstring). `seen`: whether to ask Slurm about
    a node set that has no shortage on record (reconcile: its own read shows a node of it out; resume: it has
    just forgotten the node set's shortage)."""

    def __init__(self, ctx: Context, shortages: ShortageLog | None = None,
                 clock: Callable[[], float] = time.time, seen: Callable[[NodeSet], bool] = lambda _: False) -> None:
        self.ctx = ctx
        self.shortages = shortages or ShortageLog.of(ctx.config, ctx.owner, clock)
        self.clock = clock
        self.seen = seen

    def settle(self, nodeset: NodeSet, hosts: Hosts, *, step_out: bool = True, step_in: bool = True) -> Step | None:
        """Step one node set out or in as its shortage and the host pool say (under its lock, from a fresh
        Slurm read); None when it has neither a shortage nor a node of ours out, when the verdict is a way this
        call does not step (judged before locking or asking Slurm), or when Slurm cannot be asked."""
        shortage = self.shortages.read(nodeset.nodes_expr)
        if shortage is None and not self.seen(nodeset):
            return None
        if not (step_out and step_in) and self.judged(nodeset, shortage, hosts).out is not step_out:
            return None
        try:
            with self.shortages.locked(nodeset.nodes_expr, LOCK_WAIT):
                return self._settle(nodeset, hosts)
        except (OSError, TimeoutError) as exc:
            log.warning("node set %s: step out/in skipped (its lock: %s); the next run does it", nodeset.nodes_expr,
                        exc)
        except SlurmError as exc:
            log.warning("node set %s: step out/in failed, the next run tries again: %s", nodeset.nodes_expr, exc)
        return None

    def judged(self, nodeset: NodeSet, shortage: Shortage | None, hosts: Hosts) -> Verdict:
        """judge() of the node set's shortage against the free devices now."""
        free = None if shortage is None else shortage_free(self.ctx.config, nodeset, shortage, hosts)
        return judge(shortage, free, self.clock(), self.ctx.config.power.shortage_cooldown)

    def _settle(self, nodeset: NodeSet, hosts: Hosts) -> Step | None:
        states = self.ctx.slurm.show_nodes(nodeset.nodes)
        if not states:
            return None
        shortage = self.shortages.read(nodeset.nodes_expr)  # again, under the lock: another run may have stepped
        out = out_nodes(nodeset, states)
        if shortage is None and not out:
            return None
        verdict = self.judged(nodeset, shortage, hosts)
        if verdict.out:
            assert shortage is not None
            if verdict.renew:
                shortage = self.shortages.record(nodeset.nodes_expr, shortage.kind, shortage.free, shortage.reason,
                                                 shortage.requests, shortage.wanted)
            take = [node for node in nodeset.nodes if node in states and takeable(states[node])]
            if take:
                self.ctx.slurm.set_drain(take, out_reason(shortage, self.ctx.config.power.shortage_cooldown))
            step = Step(nodeset, True, tuple(take), verdict.why)
        else:
            if shortage is not None:
                self.shortages.clear(nodeset.nodes_expr)
            if out:
                self.ctx.slurm.set_drain(out, None)
            step = Step(nodeset, False, tuple(out), verdict.why)
        if step.nodes:
            log.warning("%s", step.describe())
            event = "stepped_out" if step.out else "stepped_in"
            for node in step.nodes:
                self.ctx.recorder.record(event, node, reason=f"{OUT_FOR}: {verdict.why}")
        return step


def settle_all(stepper: StepOut, nodesets: Iterable[NodeSet], hosts: Hosts, **ways: bool) -> list[Step]:
    """Settle these node sets (`ways`: step_out, step_in as settle takes them); the steps taken."""
    return [step for nodeset in nodesets if (step := stepper.settle(nodeset, hosts, **ways)) is not None]


def surveyed(ctx: Context, states: Mapping[str, NodeState]) -> StepOut:
    """reconcile's stepper: every node set with a shortage, or a node its Slurm read shows stepped out."""
    return StepOut(ctx, seen=lambda nodeset: bool(out_nodes(nodeset, states)))


def out_now(steps: Sequence[Step], states: Mapping[str, NodeState], nodesets: Iterable[NodeSet]) -> int:
    """How many node sets are out after these steps (the gauge): those a step left out, and those whose
    nodes the Slurm read shows stepped out that no step brought in."""
    stepped = {step.nodeset.nodes_expr: step.out for step in steps}
    return sum(stepped[ns.nodes_expr] if ns.nodes_expr in stepped else bool(out_nodes(ns, states)) for ns in nodesets)


def after_resume(ctx: Context, short: Iterable[NodeSet], lifted: Iterable[NodeSet], hosts: Hosts) -> list[Step]:
    """At the end of a resume: step out the node sets short in it (their powered-down nodes; SuspendProgram
    drains the nodes it hands back), step back in those whose cooldown it lifted (GPUs back), and, when it
    read the host pool (`hosts` gives that read, or None: it makes no call), step back in the others whose GPUs
    that read shows free again (still short, they are left to reconcile and SuspendProgram)."""
    short, lifted = list(short), list(lifted)
    steps = settle_all(StepOut(ctx), short, lambda: None)  # just recorded: no count lifts it
    steps += settle_all(StepOut(ctx, seen=lambda _: True), lifted, hosts)
    if hosts() is not None:
        others = [ns for ns in ctx.config.nodesets if all(ns is not s for s in short + lifted)]
        steps += settle_all(StepOut(ctx), others, hosts, step_out=False)
    return steps


def after_suspend(ctx: Context, nodes: Sequence[str]) -> list[Step]:
    """At the end of a suspend: drain the nodes of node sets still short (within their cooldown), now powering
    down (a drain set before the power-down started was cleared by idle_on_node_suspend). It steps nothing
    in: without a host pool read, the end of a cooldown is reconcile's to judge."""
    nodesets = {id(ns): ns for node in nodes if (ns := ctx.config.nodeset_for(node)) is not None}.values()
    return settle_all(StepOut(ctx), nodesets, lambda: None, step_in=False)


def outlook(config: Config, states: Mapping[str, NodeState] | None, now: float) -> list[str]:
    """status's lines: each node set out of Slurm's way (or short and about to be), since when, why, until
    when, and its nodes drained."""
    shortages = ShortageLog.of(config)
    cooldown = config.power.shortage_cooldown
    lines = []
    for nodeset in config.nodesets:
        shortage = shortages.read(nodeset.nodes_expr)
        out = out_nodes(nodeset, states or {})
        if shortage is not None and shortage.at <= now + FUTURE_SLACK:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(shortage.at))
            until = time.strftime("%H:%M:%S", time.localtime(shortage.at + cooldown))
            drained = f"drained: {','.join(out)}" if out else "no node drained yet"
            lines.append(f"{nodeset.nodes_expr} out of Slurm's way since {since} ({shortage.reason}); back when "
                         f"GPUs return, checked by {until} at the latest; {drained}")
        elif out:
            lines.append(f"{nodeset.nodes_expr}: {','.join(out)} drained for a shortage no longer on record: the "
                         "next reconcile steps them back in")
    return lines
