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

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .admission import Shortage, may_retry
from .capacity import Pool, label
from .config import Config, NodeSet
from .cooldown import ShortageLog, state_key
from .errors import SlurmError
from .files import PRIVATE_DIRECTORY, flocked, make_directory
from .gate import domain_hosts, pci_request
from .hosts import Host
from .operation import Context
from .slurm import OFF, REASON_PREFIX, NodeState

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
    shortage: Shortage | None = None

    def describe(self) -> str:
        """node set gpa[1-2] out (short, 0 free): drained gpa1; in: GPUs back."""
        what = ("drained " if self.out else "undrained ") + ",".join(self.nodes) if self.nodes else "no node to change"
        return f"node set {self.nodeset.nodes_expr} {'out' if self.out else 'in'} ({self.why}): {what}"


class StepOut:
    """Steps node sets out of Slurm's way and back in (the module docstring)."""

    def __init__(self, ctx: Context, shortages: ShortageLog | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.ctx = ctx
        self.shortages = shortages or ShortageLog.of(ctx.config, ctx.owner, clock)
        self.clock = clock

    def settle(self, nodeset: NodeSet, hosts: Hosts) -> Step | None:
        """Step one node set out or in as its shortage and the host pool say (under its lock, from a fresh
        Slurm read); None when it has neither a shortage nor a node of ours out, or Slurm cannot be asked."""
        if self.shortages.read(nodeset.nodes_expr) is None and not self._maybe_out(nodeset):
            return None
        try:
            with self._locked(nodeset):
                return self._settle(nodeset, hosts)
        except (OSError, TimeoutError) as exc:
            log.warning("node set %s: step out/in skipped (its lock: %s); the next run does it", nodeset.nodes_expr,
                        exc)
        except SlurmError as exc:
            log.warning("node set %s: step out/in failed, the next run tries again: %s", nodeset.nodes_expr, exc)
        return None

    def _maybe_out(self, nodeset: NodeSet) -> bool:
        """Whether the caller's own Slurm read shows one of its nodes stepped out (subclasses that have one)."""
        return False

    def _settle(self, nodeset: NodeSet, hosts: Hosts) -> Step | None:
        states = self.ctx.slurm.node_states(nodeset.nodes)
        if not states:
            return None
        shortage = self.shortages.read(nodeset.nodes_expr)
        out = [node for node in nodeset.nodes if node in states and stepped_out(states[node])]
        if shortage is None and not out:
            return None
        cooldown = self.ctx.config.power.shortage_cooldown
        verdict = judge(shortage, self.free(nodeset, shortage, hosts), self.clock(), cooldown)
        if verdict.out:
            assert shortage is not None
            if verdict.renew:
                shortage = self.shortages.record(nodeset.nodes_expr, shortage.kind, shortage.free, shortage.reason,
                                                 shortage.requests, shortage.wanted)
            take = [node for node in nodeset.nodes if node in states and takeable(states[node])]
            if take:
                self.ctx.slurm.set_drain(take, out_reason(shortage, cooldown))
            step = Step(nodeset, True, tuple(take), verdict.why, shortage)
        else:
            if shortage is not None:
                self.shortages.clear(nodeset.nodes_expr)
            if out:
                self.ctx.slurm.set_drain(out, None)
            step = Step(nodeset, False, tuple(out), verdict.why, shortage)
        if step.nodes:
            log.warning("%s", step.describe())
            event = "stepped_out" if step.out else "stepped_in"
            for node in step.nodes:
                self.ctx.recorder.record(event, node, reason=f"{OUT_FOR}: {verdict.why}")
        return step

    def free(self, nodeset: NodeSet, shortage: Shortage | None, hosts: Hosts) -> int | None:
        """The free devices of the kind the node set's VMs need, on the hosts they may use; None when the
        shortage names none or the host pool cannot be read."""
        if shortage is None or not shortage.requests:
            return None
        pool = hosts()
        if pool is None:
            return None
        requests = tuple(pci_request(r) for r in shortage.requests)
        free = Pool(pool).free(requests, domain_hosts(self.ctx.config, nodeset, pool))
        log.debug("node set %s: %d GPUs %s free", nodeset.nodes_expr, free, label(requests))
        return free

    def _locked(self, nodeset: NodeSet) -> contextlib.AbstractContextManager[None]:
        directory = self.ctx.config.power.lock_dir
        make_directory(directory, self.ctx.owner, PRIVATE_DIRECTORY)
        key = state_key(self.ctx.config.slurm.cluster, nodeset.nodes_expr)
        return flocked(directory / f"stepout-{key}.lock", LOCK_WAIT, self.ctx.owner)


class Survey(StepOut):
    """reconcile's pass: every node set with a shortage or a node of ours out, from its own Slurm read."""

    def __init__(self, ctx: Context, states: Mapping[str, NodeState], **kwargs: object) -> None:
        super().__init__(ctx, **kwargs)  # type: ignore[arg-type]
        self.states = states

    def _maybe_out(self, nodeset: NodeSet) -> bool:
        return any(stepped_out(self.states[n]) for n in nodeset.nodes if n in self.states)


def settle_all(stepper: StepOut, nodesets: Iterable[NodeSet], hosts: Hosts) -> list[Step]:
    """Settle these node sets; the steps taken."""
    return [step for nodeset in nodesets if (step := stepper.settle(nodeset, hosts)) is not None]


def out_now(steps: Sequence[Step], states: Mapping[str, NodeState], nodesets: Iterable[NodeSet]) -> int:
    """How many node sets are out after these steps (the gauge): those a step left out, and those whose
    nodes the Slurm read shows stepped out that no step brought in."""
    stepped = {step.nodeset.nodes_expr: step.out for step in steps}
    count = 0
    for nodeset in nodesets:
        if nodeset.nodes_expr in stepped:
            count += stepped[nodeset.nodes_expr]
        elif any(stepped_out(states[n]) for n in nodeset.nodes if n in states):
            count += 1
    return count


class Recheck(StepOut):
    """Looks at Slurm whatever the shortage files say: for node sets whose shortage a run has just forgotten."""

    def _maybe_out(self, nodeset: NodeSet) -> bool:
        return True


def after_resume(ctx: Context, short: Iterable[NodeSet], lifted: Iterable[NodeSet], hosts: Hosts,
                 read: bool) -> list[Step]:
    """At the end of a resume: step out the node sets short in it (their powered-down nodes; SuspendProgram
    drains the nodes it hands back), step back in those whose cooldown it lifted (GPUs back), and, when it
    read the host pool (`read`), the others whose GPUs that read shows free again."""
    stepper = StepOut(ctx)
    short, lifted = list(short), list(lifted)
    steps = settle_all(stepper, short, lambda: None)  # just recorded: no count lifts it
    steps += settle_all(Recheck(ctx), lifted, hosts)
    if read:
        others = [ns for ns in ctx.config.nodesets if all(ns is not s for s in short + lifted)]
        steps += settle_all(stepper, others, hosts)
    return steps


def after_suspend(ctx: Context, nodes: Sequence[str]) -> list[Step]:
    """At the end of a suspend: drain the nodes of node sets still short (within their cooldown), now powering
    down (a drain set before the power-down started was cleared by idle_on_node_suspend)."""
    stepper = StepOut(ctx)
    now = stepper.clock()
    cooldown = ctx.config.power.shortage_cooldown
    steps = []
    for nodeset in {id(ns): ns for node in nodes if (ns := ctx.config.nodeset_for(node)) is not None}.values():
        shortage = stepper.shortages.read(nodeset.nodes_expr)
        if shortage is not None and 0 <= shortage.age(now) < cooldown:
            step = stepper.settle(nodeset, lambda: None)
            steps += [step] if step is not None else []
    return steps


def outlook(config: Config, states: Mapping[str, NodeState] | None, now: float) -> list[str]:
    """status's lines: each node set out of Slurm's way (or short and about to be), since when, why, until
    when, and its nodes drained."""
    shortages = ShortageLog.of(config)
    cooldown = config.power.shortage_cooldown
    lines = []
    for nodeset in config.nodesets:
        shortage = shortages.read(nodeset.nodes_expr)
        out = [n for n in nodeset.nodes if states is not None and n in states and stepped_out(states[n])]
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
