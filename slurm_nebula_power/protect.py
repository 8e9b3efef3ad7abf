"""Protected mode in one resume run: a node set whose VMs keep failing to boot gets no more VMs.

[power] protect_after boot failures in a row in a node set (a VM that failed, one placed but never RUNNING
by boot_timeout, one RUNNING that never reported READY; not a GPU shortage, a quota or an API error)
protect it: resume hands its nodes back at once, with a Reason saying so and how to clear it, and creates
none of its VMs until a good boot, [power] protect_for or the operator (`slurm-nebula-power unprotect`)
clears it. Within a run, protection stops recreating the node set's VMs and sending its nodes still
waiting for a wave. A poll that sees a good boot and failures in one node set counts the good boot only:
the template works, and a fleet that fails a VM in ten is no broken template. The state is kept across
runs by protectlog.py.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Container, Mapping, Sequence

from .booting import Boot, Step, Verdict, judge
from .config import NodeSet
from .model import Vm
from .operation import Context
from .pacing import Waves
from .protectlog import ProtectLog

log = logging.getLogger(__name__)
Judged = tuple[Boot, "Vm | None", Verdict]


class Guard:
    """One resume run's view of protected mode, per node set."""

    def __init__(self, ctx: Context, jobs: Mapping[str, Sequence[int]]) -> None:
        self.ctx = ctx
        self.jobs = jobs
        power = ctx.config.power
        self.log = ProtectLog.of(ctx.config, ctx.owner)
        self.threshold, self.period = power.protect_after, power.protect_for
        self.held: dict[int, str] = {}  # id(nodeset) -> the hand-back reason of a node set protected in this run

    def holding(self, nodeset: NodeSet) -> str | None:
        """Why this node set's nodes are handed back at once (protected), or None; read at the start."""
        if self.threshold == 0:
            return None
        state = self.log.read(nodeset.nodes_expr)
        if state is None:
            return None
        now = self.log.clock()
        if not state.active(now, self.period):
            return None
        reason = state.hand_back_reason(now, self.period, _name(nodeset))
        log.warning("node set %s is protected since %d boot failures in a row (last: %s): handing its nodes "
                    "back; clear it with `slurm-nebula-power unprotect %s`", nodeset.nodes_expr, state.failures,
                    state.reason, _name(nodeset))
        return reason

    def judged(self, known: Sequence[Boot], snapshot: Mapping[int, Vm], now: float,
               failures: dict[str, list[Boot]], waves: Waves[Boot], moved: Container[str] = ()) -> list[Judged]:
        """Each node's verdict at this poll (booting.judge; `moved`: nodes direct placement deployed to a host
        that left service meanwhile), after protected mode: a good boot clears its
        node set, boot failures count, and once the node set is protected its failed VMs are not recreated
        (their nodes fail with the protected reason) and its nodes waiting for a wave go to `failures`."""
        out = [(b, vm, judge(self.ctx, self.jobs, b, vm, now, b.node in moved)) for b in known
               for vm in (snapshot.get(b.vm_id if b.vm_id is not None else -1),)]
        if self.threshold == 0:
            return out
        for nodeset, good, bad in _by_nodeset([(b, v.step is Step.DONE, v.boot_failure, v.reason) for b, _, v in out]):
            self.note(nodeset, good, bad)
        if not self.held:
            return out
        kept = []
        for boot, vm, verdict in out:
            reason = self.held.get(id(boot.nodeset))
            if reason is not None and (verdict.step in (Step.RECREATE, Step.MOVE) or verdict.boot_failure):
                verdict = Verdict(Step.FAIL, reason)
            kept.append((boot, vm, verdict))
        waiting = [(b, p) for b, p in waves.waiting if id(b.nodeset) in self.held]
        for boot, plan in waiting:
            waves.waiting.remove((boot, plan))
            failures[self.held[id(boot.nodeset)]].append(boot)
        return kept

    def note(self, nodeset: NodeSet, good: int, bad: Sequence[str]) -> None:
        """Record one poll's good boots and boot failures (their reasons) of a node set."""
        key = id(nodeset)
        if good:
            self.held.pop(key, None)
            cleared = self.log.clear(nodeset.nodes_expr)
            if cleared is not None and cleared.since is not None:
                log.warning("node set %s booted a VM well: protected mode cleared", nodeset.nodes_expr)
            return
        if not bad or self.threshold == 0:
            return
        state = self.log.failed(nodeset.nodes_expr, len(bad), bad[-1], self.threshold, self.period)
        now = self.log.clock()
        if state.active(now, self.period) and key not in self.held:
            self.held[key] = state.hand_back_reason(now, self.period, _name(nodeset))
            log.error("node set %s: %d boot failures in a row (last: %s): protected mode, no more of its VMs "
                      "until a good boot, %gs, or `slurm-nebula-power unprotect %s`", nodeset.nodes_expr,
                      state.failures, bad[-1], self.period, _name(nodeset))


def _by_nodeset(items: Sequence[tuple[Boot, bool, bool, str]]) -> list[tuple[NodeSet, int, list[str]]]:
    """(node set, good boots, the reasons of its boot failures) per node set among these verdicts."""
    sets: dict[int, NodeSet] = {}
    good: dict[int, int] = defaultdict(int)
    bad: dict[int, list[str]] = defaultdict(list)
    for boot, done, failed, reason in items:
        sets[id(boot.nodeset)] = boot.nodeset
        good[id(boot.nodeset)] += done
        if failed:
            bad[id(boot.nodeset)].append(reason)
    return [(nodeset, good[key], bad[key]) for key, nodeset in sets.items()]


def _name(nodeset: NodeSet) -> str:
    """What to give unprotect: the node set's nodes, or its first node when that expression is long."""
    return nodeset.nodes_expr if len(nodeset.nodes_expr) <= 32 else nodeset.nodes[0]
