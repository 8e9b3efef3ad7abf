"""The window that paces resume's instantiates (pacing.py): what oned is sent at most, and when it widens."""

from __future__ import annotations

from dataclasses import dataclass

from slurm_nebula_power.model import ACTIVE, PENDING, RUNNING_LCM, Vm
from slurm_nebula_power.pacing import GROWTH, STEP, Pacer, Waves, placing
from slurm_nebula_power.plan import Plan

SHORTAGE = "Mon Nov 30 10:00:00 2026: Cannot allocate VM. Not enough capacity in hosts 0,1"
DISPATCH = "Tue Dec  1 08:53:32 2026: [HOST] Dispatch limit reached on hosts: 0,1,2,3,4,5,6,7,8,9"


def vm(vm_id: int, state: int = PENDING, message: str = "") -> Vm:
    lcm = RUNNING_LCM if state == ACTIVE else 0
    return Vm(id=vm_id, name=f"gpu{vm_id:02d}", state=state, lcm_state=lcm,
              user_template={"SCHED_MESSAGE": message} if message else {})


def test_the_next_wave_goes_once_oned_placed_the_last_and_every_call_was_seen() -> None:
    pacer = Pacer(30)
    assert pacer.room(placing=0, unseen=0, waiting=100) == 30
    assert pacer.room(placing=1, unseen=0, waiting=100) == 0, "oned still places the last wave"
    assert pacer.room(placing=0, unseen=1, waiting=100) == 0, "a call whose VM no read has seen"
    assert pacer.room(placing=0, unseen=0, waiting=3) == 3


def test_placing_leaves_out_vms_oned_cannot_place_but_counts_a_dispatch_limit() -> None:
    """A shortage is pending_timeout's to judge: it must not hold the window shut.  A VM a plan left for
    the next one (a dispatch limit) is still oned's to place."""
    vms = {1: vm(1), 2: vm(2, message=DISPATCH), 3: vm(3, message=SHORTAGE), 4: vm(4, state=ACTIVE)}
    assert placing(vms) == 2


def test_a_full_window_placed_before_the_first_look_widens_it_up_to_its_cap() -> None:
    pacer = Pacer(30)
    limits = []
    for _ in range(5):
        pacer.looked(size=pacer.limit, limit=pacer.limit, still_pending=0, placing=0)
        limits.append(pacer.limit)
    assert limits == [30 * STEP, 30 * STEP * STEP, 30 * GROWTH, 30 * GROWTH, 30 * GROWTH] == [120, 480, 480, 480, 480]


def test_vms_still_pending_at_the_first_look_narrow_it_to_max_pending() -> None:
    pacer = Pacer(30)
    pacer.looked(size=30, limit=30, still_pending=0, placing=0)
    assert pacer.limit == 120
    pacer.looked(size=120, limit=120, still_pending=1, placing=1)
    assert pacer.limit == 30


def test_only_a_full_window_with_nothing_left_to_place_widens_it() -> None:
    """A few VMs placed fast say nothing of a burst; nor does a send while other VMs still wait."""
    pacer = Pacer(30)
    pacer.looked(size=5, limit=30, still_pending=0, placing=0)
    pacer.looked(size=30, limit=30, still_pending=0, placing=4)
    assert pacer.limit == 30


def test_the_window_is_at_most_one_vm_per_host_that_takes_vms() -> None:
    """oned places at most one VM per host a plan (MAX_HOST 1); waves of 30 on 20 hosts stalled 7.4.0."""
    assert Pacer(30, hosts=20).room(placing=0, unseen=0, waiting=100) == 20
    assert Pacer(30, hosts=100).room(placing=0, unseen=0, waiting=100) == 30
    assert Pacer(30, hosts=None).room(placing=0, unseen=0, waiting=100) == 30, "host pool unread"


@dataclass
class Node:
    """What Waves reads of resume's Boot."""

    node: str
    deadline: float = 100.0
    vm_id: int | None = None
    future: object | None = None


def test_waves_send_a_window_then_nothing_until_its_vms_are_placed() -> None:
    waves: Waves[Node] = Waves(Pacer(2))
    nodes = [Node(f"gpu{i:02d}") for i in range(5)]
    waves.waiting.extend((n, Plan("instantiate")) for n in nodes)
    first = waves.wave(placing=0, unseen=0)
    assert [n for n, _ in first] == nodes[:2] and len(waves.waiting) == 3
    assert waves.sends == [(nodes[:2], 2)]
    assert waves.wave(placing=1, unseen=0) == [], "oned still places the last wave"


def test_waves_look_only_at_sends_whose_calls_all_answered_and_report_each_change() -> None:
    waves: Waves[Node] = Waves(Pacer(2))
    nodes = [Node("gpu01", vm_id=1), Node("gpu02", vm_id=2, future=object())]
    waves.waiting.extend((n, Plan("instantiate")) for n in nodes)
    waves.wave(placing=0, unseen=0)
    assert waves.look({1: vm(1)}) == [] and len(waves.sends) == 1, "gpu02's call is in flight"
    nodes[1].future = None
    assert waves.look({1: vm(1, state=ACTIVE), 2: vm(2, state=ACTIVE)}) == [(2, 2 * STEP, 0, 2)]
    assert waves.sends == []


def test_waves_expire_drops_settled_nodes_and_returns_those_past_their_deadline() -> None:
    waves: Waves[Node] = Waves(Pacer(2))
    done, late, fresh = Node("gpu01"), Node("gpu02", deadline=5.0), Node("gpu03")
    waves.waiting.extend((n, Plan("instantiate")) for n in (done, late, fresh))
    assert waves.expire({"gpu01"}, now=10.0) == [late]
    assert [n for n, _ in waves.waiting] == [fresh]
