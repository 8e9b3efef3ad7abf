"""What a poll of resume makes of a node on its way up (booting.py): the verdict on its VM, as a type."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slurm_nebula_power.booting import DONE, NOT_READY, UNPLACED, WAIT, Boot, Step, Verdict, judge
from slurm_nebula_power.model import ACTIVE, PENDING, RUNNING_LCM, Vm

SHORTAGE = "Mon Nov 30 10:00:00 2026: Cannot allocate VM. Not enough capacity in hosts 0,1"
BOOT_FAILURE = 36  # LCM BOOT_FAILURE


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def record(self, event: str, node: str, *args: object, **kw: object) -> None:
        self.events.append((event, node))


def ctx(recreate_attempts: int = 1) -> SimpleNamespace:
    return SimpleNamespace(observe=lambda node, vm: None, recorder=Recorder(),
                           config=SimpleNamespace(power=SimpleNamespace(recreate_attempts=recreate_attempts)))


def boot(wait_for: str = "running", deadline: float = 100.0, attempts: int = 0) -> Boot:
    nodeset = SimpleNamespace(wait_for=wait_for, pending_timeout=60.0, boot_timeout=600.0)
    return Boot("gpu01", nodeset, deadline, vm_id=7, attempts=attempts)


def vm(state: int = ACTIVE, lcm: int = RUNNING_LCM, ip: str | None = "127.0.1.7", **user: str) -> Vm:
    return Vm(id=7, name="gpu01", state=state, lcm_state=lcm, ip=ip, user_template=user)


@pytest.mark.parametrize(("case", "the_boot", "the_vm", "now", "verdict"), [
    ("running with an address", boot(), vm(), 1.0, DONE),
    ("running, waiting for READY", boot("ready"), vm(), 1.0, WAIT),
    ("ready", boot("ready"), vm(READY="YES"), 1.0, DONE),
    ("no READY by boot_timeout", boot("ready"), vm(), 200.0, NOT_READY),
    ("vanished, an attempt left", boot(), None, 1.0, Verdict(Step.RECREATE, "VM vanished while booting")),
    ("vanished, none left", boot(attempts=1), None, 1.0, Verdict(Step.FAIL, "VM vanished while booting")),
    ("failed to boot, an attempt left", boot(), vm(lcm=BOOT_FAILURE), 1.0,
     Verdict(Step.RECREATE, "VM failed to boot (ACTIVE/BOOT_FAILURE)", boot_failure=True)),
    ("failed to boot, none left", boot(attempts=1), vm(lcm=BOOT_FAILURE), 1.0,
     Verdict(Step.FAIL, "VM failed to boot (ACTIVE/BOOT_FAILURE)", boot_failure=True)),
    # PENDING past boot_timeout was never placed: the scheduler's or the cloud's doing, not a boot failure
    ("pending past boot_timeout", boot(), vm(PENDING, 0, None), 200.0,
     Verdict(Step.FAIL, "not up after boot_timeout 600s (PENDING)")),
    ("placed, never running by boot_timeout", boot(), vm(lcm=2, ip=None), 200.0,
     Verdict(Step.FAIL, "not up after boot_timeout 600s (ACTIVE/BOOT)", boot_failure=True)),
])
def test_judge_gives_a_verdict_not_a_string(case: str, the_boot: Boot, the_vm: Vm | None, now: float,
                                            verdict: Verdict) -> None:
    assert judge(ctx(), {}, the_boot, the_vm, now) == verdict


def test_unplaced_once_oned_said_it_cannot_place_the_vm_for_pending_timeout() -> None:
    the_boot, pending = boot(deadline=1000.0), vm(PENDING, 0, None, SCHED_MESSAGE=SHORTAGE)
    assert judge(ctx(), {}, the_boot, pending, 10.0) == WAIT
    assert judge(ctx(), {}, the_boot, pending, 70.0) == UNPLACED


def test_running_is_recorded_once() -> None:
    context, the_boot = ctx(), boot("ready")
    for now in (1.0, 2.0):
        judge(context, {}, the_boot, vm(), now)
    assert context.recorder.events == [("running", "gpu01")]
