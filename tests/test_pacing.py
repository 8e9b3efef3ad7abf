"""The window that paces resume's instantiates (pacing.py): what oned is sent at most, and when it widens."""

from __future__ import annotations

from slurm_nebula_power.model import ACTIVE, PENDING, RUNNING_LCM, Vm
from slurm_nebula_power.pacing import GROWTH, Pacer, placing

SHORTAGE = "Mon Nov 30 10:00:00 2026: Cannot allocate VM. Not enough capacity in hosts 0,1"
DISPATCH = "Tue Dec  1 08:53:32 2026: [HOST] Dispatch limit reached on hosts: 0,1,2,3,4,5,6,7,8,9"


def vm(vm_id: int, state: int = PENDING, message: str = "") -> Vm:
    lcm = RUNNING_LCM if state == ACTIVE else 0
    return Vm(id=vm_id, name=f"gpu{vm_id:02d}", state=state, lcm_state=lcm,
              user_template={"SCHED_MESSAGE": message} if message else {})


def test_the_window_holds_the_vms_oned_has_to_place_and_the_calls_not_seen_yet() -> None:
    pacer = Pacer(30)
    assert pacer.room(placing=0, unseen=0) == 30
    assert pacer.room(placing=20, unseen=8) == 2
    assert pacer.room(placing=25, unseen=10) == 0


def test_placing_leaves_out_vms_oned_cannot_place_but_counts_a_dispatch_limit() -> None:
    """A shortage is pending_timeout's to judge: it must not hold the window shut.  A VM a plan left for
    the next one (a dispatch limit) is still oned's to place."""
    vms = {1: vm(1), 2: vm(2, message=DISPATCH), 3: vm(3, message=SHORTAGE), 4: vm(4, state=ACTIVE)}
    assert placing(vms) == 2


def test_a_full_window_placed_before_the_first_look_widens_it_up_to_its_cap() -> None:
    pacer = Pacer(30)
    for _ in range(10):
        pacer.looked(size=pacer.limit, limit=pacer.limit, still_pending=0, placing=0)
    assert pacer.limit == 30 * GROWTH
    assert 30 * GROWTH < 300, "300 instantiates at once stalled oned 7.0.2 and 7.4.0"


def test_vms_still_pending_at_the_first_look_narrow_it_to_max_pending() -> None:
    pacer = Pacer(30)
    pacer.looked(size=30, limit=30, still_pending=0, placing=0)
    pacer.looked(size=60, limit=60, still_pending=0, placing=0)
    assert pacer.limit == 120
    pacer.looked(size=120, limit=120, still_pending=1, placing=1)
    assert pacer.limit == 30


def test_only_a_full_window_with_nothing_left_to_place_widens_it() -> None:
    """A few VMs placed fast say nothing of a burst; nor does a send while other VMs still wait."""
    pacer = Pacer(30)
    pacer.looked(size=5, limit=30, still_pending=0, placing=0)
    pacer.looked(size=30, limit=30, still_pending=0, placing=4)
    assert pacer.limit == 30
