"""Pacing resume's instantiates: how many may go to oned now, so that a burst never stalls its scheduler.

A few hundred instantiates at once stall the scheduler of oned 7.0.2 and 7.4.0 for good (VMs PENDING
without a SCHED_MESSAGE for minutes, "Cannot add plan. A placement plan is already in progress." in
oned.log, only a restart helps); the same VMs sent so that at most a plan's worth waits at a time all
run.  The rule, waves judged at every pool read:

- at most `limit` VMs may be waiting for oned to place them (max_pending, or fewer when fewer hosts take
  VMs: one placement plan places at most one VM per host, MAX_HOST in schedulers/rank.conf, and VMs
  beyond that only queue for a later plan; the stall is a race between overlapping plans: waves of 30 on
  20 hosts stalled 7.4.0 for good at 1,000 nodes, "Cannot add plan" in oned.log, where 30 at a time on
  10-12 hosts had run at 100 and 300): VMs of the user PENDING without a message
  that says oned cannot place them (a shortage is pending_timeout's business, not the window's), plus
  the calls sent whose VM no pool read has seen yet (in flight, or answered after the last read began);
- the next wave goes once none is left: a sliding window refilled as slots freed sent 1-9 VMs at a
  time, and oned's scheduler plans only once SCHED_MAX_WND_LENGTH (stock 7) new VMs arrived or
  SCHED_MAX_WND_TIME (stock 10 s) after the first; refilled 8 at a time it still trailed the waves;
- `limit` starts there; it grows fourfold (up to GROWTH x max_pending) when a full window was
  placed before the first pool read after its calls answered, so a back end that places at once (the
  simulator, an oned whose scheduler places more than a plan of 30 within a round trip) is not held to
  max_pending a round trip; it falls back to where it started as soon as a window's VMs are still
  PENDING at that first read.  The 300 instantiates that stalled oned went to a scheduler placing 10-12 VMs a plan;
  the window reaches 120 only after oned placed 30 before it was looked at, 480 after it placed 120.

Pure: the window (Pacer) and one resume run's queue of plans and sends (Waves); resume (resume.py) calls
oned, logs and submits what they decide. Measured against the simplest clients in bench/README.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterable, Mapping
from typing import Generic, Protocol, TypeVar

from .model import PENDING, Vm
from .plan import Plan

GROWTH = 16  # the window grows (4x a step) to at most this many times max_pending
STEP = 4


def pending_floor(vms: Iterable[Vm]) -> int | None:
    """The lowest id of a PENDING VM (resume reads the pool from there up: ids only grow)."""
    return min((vm.id for vm in vms if vm.state == PENDING), default=None)


def placing(vms: Mapping[int, Vm]) -> int:
    """VMs PENDING that oned's scheduler has still to place (not those it said it cannot place)."""
    return sum(1 for vm in vms.values() if vm.state == PENDING and not vm.unplaceable)


class Pacer:
    """The window: how many instantiates may be sent now, and how it widens or narrows."""

    def __init__(self, max_pending: int, hosts: int | None = None) -> None:
        """`hosts`: how many hosts take VMs, when the host pool was read (oned places at most MAX_HOST, stock
        1, VMs per host per plan, so more than that many waiting only queue for a second plan)."""
        self.base = min(max_pending, hosts) if hosts else max_pending
        self.limit = self.base

    def room(self, placing: int, unseen: int, waiting: int) -> int:
        """Sends allowed now: `placing` VMs wait for oned, `unseen` calls have no VM seen by a read yet,
        `waiting` nodes wait to be sent.  A whole window once oned placed the last (waves): a window
        refilled as slots freed trailed the wave client of the same size (7.4.0 100 nodes: 185 s against
        109 s; 7.0.2: 119 against 71 s), oned placing a plan's VMs a few at a time."""
        return min(waiting, self.limit) if placing == 0 and unseen == 0 else 0

    def looked(self, size: int, limit: int, still_pending: int, placing: int) -> None:
        """The first pool read after every call of one send answered: `size` calls sent under `limit`,
        `still_pending` of their VMs PENDING for oned to place, `placing` of the user's in all."""
        if still_pending:
            self.limit = self.base
        elif size >= limit and placing == 0:
            self.limit = min(self.limit * STEP, self.base * GROWTH)


# ---- one resume run's waves --------------------------------------------------------------------------


class Paced(Protocol):
    """What the waves read of a node whose plan is paced (resume's Boot)."""

    @property
    def node(self) -> str: ...
    @property
    def deadline(self) -> float: ...
    @property
    def vm_id(self) -> int | None: ...
    @property
    def future(self) -> object | None: ...  # its call, while one is in flight


B = TypeVar("B", bound=Paced)


class Waves(Generic[B]):
    """The paced plans of one resume run not sent yet (max_pending), and the sends not looked at yet."""

    def __init__(self, pacer: Pacer) -> None:
        self.pacer = pacer
        self.waiting: deque[tuple[B, Plan]] = deque()  # paced plans not sent yet
        self.sends: list[tuple[list[B], int]] = []  # each send not looked at yet, with the window it had

    def expire(self, settled: Container[str], now: float) -> list[B]:
        """Forget the settled nodes; those waiting past their deadline leave the queue and are returned."""
        self.waiting = deque((b, p) for b, p in self.waiting if b.node not in settled)
        expired = [b for b, _ in self.waiting if now >= b.deadline]
        self.waiting = deque((b, p) for b, p in self.waiting if now < b.deadline)
        return expired

    def look(self, snapshot: Mapping[int, Vm]) -> list[tuple[int, int, int, int]]:
        """The window learns from each send whose calls have all answered (their VMs are in this read).

        Each change of the window, in order: (limit before, limit after, VMs still PENDING, VMs sent).
        """
        keep = []
        changes = []
        for boots, limit in self.sends:
            if any(b.future is not None for b in boots):
                keep.append((boots, limit))
                continue
            vms = [snapshot.get(b.vm_id) for b in boots if b.vm_id is not None]
            still = sum(1 for vm in vms if vm is not None and vm.state == PENDING and not vm.unplaceable)
            before = self.pacer.limit
            self.pacer.looked(len(boots), limit, still, placing(snapshot))
            if self.pacer.limit != before:
                changes.append((before, self.pacer.limit, still, len(boots)))
        self.sends = keep
        return changes

    def wave(self, placing: int, unseen: int) -> list[tuple[B, Plan]]:
        """The next wave, taken off the queue and kept as a send to look at (none while the window is full)."""
        room = self.pacer.room(placing, unseen, len(self.waiting))
        wave = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        if wave:
            self.sends.append(([b for b, _ in wave], self.pacer.limit))
        return wave
