"""A node set short of GPUs steps out of Slurm's way and back in by itself (stepout.py, issue 33): the rules,
against a recording Slurm and the real shortage files. The real slurmctld is in test_e2e_fallback.py."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from support import make_setup

from slurm_nebula_power.admission import COUNT, PLACEMENT, QUOTA, Shortage
from slurm_nebula_power.audit import AuditLog
from slurm_nebula_power.config import load_config
from slurm_nebula_power.cooldown import ShortageLog
from slurm_nebula_power.drift import NodeView, diagnose, returnable
from slurm_nebula_power.errors import SlurmUnreachable
from slurm_nebula_power.hosts import Host, PciDevice
from slurm_nebula_power.model import ACTIVE, RUNNING_LCM, Vm
from slurm_nebula_power.nodestate import NodeState
from slurm_nebula_power.operation import Context
from slurm_nebula_power.stepout import (
    StepOut,
    after_resume,
    after_suspend,
    judge,
    out_nodes,
    out_now,
    outlook,
    stepped_out,
    surveyed,
    takeable,
)

GPU = {"vendor": "10de", "device": "2330"}
NOW = 1_000_000.0
COOLDOWN = 60


def shortage(kind: str = COUNT, age: float = 5, free: int | None = 0, wanted: int = 2) -> Shortage:
    return Shortage("gpa[1-2]", NOW - age, kind, free, "GPU shortage (job 7: needs 2 GPUs, 0 free)",
                    (GPU,) if kind != QUOTA else (), wanted)


@pytest.mark.parametrize(("case", "free", "out", "renew"), [
    (None, 4, False, False),  # no shortage on record (lost, unreadable, planted): back in
    (shortage(age=-3600), 0, False, False),  # recorded an hour in the future: no shortage
    (shortage(), 0, True, False),  # within the cooldown, none free
    (shortage(), 1, True, False),  # within the cooldown, fewer than the refused run wanted
    (shortage(), 2, False, False),  # within the cooldown, what the refused run wanted is free: back at once
    (shortage(), None, True, False),  # within the cooldown, pool unreadable
    (shortage(PLACEMENT, free=3), 3, True, False),  # oned could not place with 3 free: 3 free proves nothing
    (shortage(PLACEMENT, free=3), 4, False, False),  # one more freed since: back in
    (shortage(age=61), 0, True, True),  # cooldown over, still none for one VM: out, the cooldown again
    (shortage(age=61), 1, False, False),  # cooldown over, room for one VM: back in
    (shortage(age=61), None, False, False),  # cooldown over, nothing to count: back in (one bounce at worst)
    (shortage(QUOTA, age=61, free=None), None, False, False),  # a quota: only time lifts it
    (shortage(QUOTA, free=None), None, True, False),
])
def test_judge(case: Shortage | None, free: int | None, out: bool, renew: bool) -> None:
    verdict = judge(case, free, NOW, COOLDOWN)
    assert (verdict.out, verdict.renew) == (out, renew), verdict.why


@pytest.mark.parametrize(("state", "reason", "takes"), [
    ("IDLE+CLOUD+POWERED_DOWN", "", True),
    ("IDLE+CLOUD+POWERING_DOWN", "nebula: job 7: needs 2 GPUs, 0 free", True),  # our hand-back, powering down
    # the hand-back's power-down only queued: a drain now is cleared when it starts; SuspendProgram drains it
    ("IDLE+CLOUD+POWER_DOWN+NOT_RESPONDING", "nebula: job 7: needs 2 GPUs, 0 free", False),
    ("IDLE+CLOUD+POWERED_DOWN", "maintenance window", False),  # an administrator's note
    ("IDLE+CLOUD+DRAIN+POWERED_DOWN", "RMA", False),  # an administrator's drain
    ("DOWN+CLOUD+POWERED_DOWN", "ResumeTimeout reached", False),  # reconcile returns it first
    ("ALLOCATED+CLOUD", "", False),  # running a job
    ("MIXED+CLOUD+POWERING_UP", "", False),
])
def test_only_powered_down_nodes_without_a_foreign_reason_step_out(state: str, reason: str, takes: bool) -> None:
    assert takeable(NodeState("gpa1", state, reason)) is takes


def test_only_our_out_of_service_drain_counts_as_stepped_out() -> None:
    assert stepped_out(NodeState("a", "IDLE+CLOUD+DRAIN+POWERED_DOWN",
                                 "nebula: out of service since 10:00:00, ... [slurm@2026-12-07T10:00:00]"))
    assert not stepped_out(NodeState("a", "IDLE+CLOUD+DRAIN+POWERED_DOWN", "out of service (admin)"))
    assert not stepped_out(NodeState("a", "IDLE+CLOUD+DRAIN+POWERED_DOWN", "nebula: host h1 DISABLED ..."))
    assert not stepped_out(NodeState("a", "IDLE+CLOUD+POWERED_DOWN", "nebula: out of service since ..."))


class FakeSlurm:
    """Slurm's node states, changed by the drains and undrains it is sent (as slurmctld would)."""

    def __init__(self, states: dict[str, tuple[str, str]]) -> None:
        self.states = dict(states)
        self.drains: list[tuple[list[str], str | None]] = []
        self.unreachable = False

    def show_nodes(self, nodes):
        if self.unreachable:
            raise SlurmUnreachable("scontrol show node failed: Unable to contact slurm controller")
        return {n: NodeState(n, *self.states[n]) for n in nodes if n in self.states}

    def set_drain(self, nodes, reason) -> None:
        self.drains.append((list(nodes), reason))
        for node in nodes:
            state, _ = self.states[node]
            if reason is None:
                self.states[node] = (state.replace("+DRAIN", ""), "")
            else:
                base, _, rest = state.partition("+")
                self.states[node] = (f"{base}+DRAIN+{rest}", "nebula: " + reason)


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def context(tmp_path: Path, slurm: FakeSlurm) -> tuple[Context, AuditLog]:
    nodesets = ('[[nodeset]]\nnodes = "gpa[1-4]"\ntemplate = "a"\n\n'
                '[[nodeset]]\nnodes = "gpb[1-2]"\ntemplate = "b"\n')
    setup = make_setup(tmp_path / "site", "http://127.0.0.1:9/RPC2", "u:p", nodesets=nodesets,
                       extra=f"shortage_cooldown = {COOLDOWN}")
    config = load_config(setup.config, setup.env)
    audit = AuditLog(setup.audit, "reconcile", config.slurm.cluster)
    return Context(config=config, cloud=None, slurm=slurm, recorder=audit), audit  # type: ignore[arg-type]


def host(free: int) -> Host:
    devices = tuple(PciDevice(f"0{i}:00.0", vendor="10de", device="2330", vmid=-1 if i < free else 9)
                    for i in range(4))
    return Host(id=0, name="h0", state=2, devices=devices)


ADMIN = ("IDLE+CLOUD+DRAIN+POWERED_DOWN", "RMA ticket 42 [root@2026-12-07T09:00:00]")


def test_a_short_node_set_drains_its_powered_down_nodes_and_steps_back_in_when_gpus_return(tmp_path) -> None:
    slurm = FakeSlurm({"gpa1": ("IDLE+CLOUD+POWERED_DOWN", ""), "gpa2": ("IDLE+CLOUD+POWERING_DOWN", "nebula: x"),
                       "gpa3": ADMIN, "gpa4": ("ALLOCATED+CLOUD", "")})
    ctx, audit = context(tmp_path, slurm)
    clock = Clock()
    shortages = ShortageLog.of(ctx.config, clock=clock)
    nodeset = ctx.config.nodesets[0]
    shortages.record(nodeset.nodes_expr, COUNT, 0, "GPU shortage (job 7: needs 2 GPUs 10de:2330, 0 free)", [GPU], 2)
    stepper = StepOut(ctx, shortages, clock)

    step = stepper.settle(nodeset, lambda: [host(0)])
    assert step is not None and step.out and step.nodes == ("gpa1", "gpa2")
    reason = slurm.drains[-1][1]
    assert reason is not None and reason.startswith("out of service since ") and "needs 2 GPUs" in reason
    assert slurm.states["gpa3"] == ADMIN  # an administrator's drain is left as it is

    clock.now += 10  # within the cooldown, one GPU free: the refused run wanted two
    step = stepper.settle(nodeset, lambda: [host(1)])
    assert step is not None and step.out and step.nodes == ()
    clock.now += 10  # two free: back in at once, the shortage forgotten
    step = stepper.settle(nodeset, lambda: [host(2)])
    assert step is not None and not step.out and step.nodes == ("gpa1", "gpa2")
    assert slurm.drains[-1] == (["gpa1", "gpa2"], None)
    assert slurm.states["gpa3"] == ADMIN
    assert shortages.read(nodeset.nodes_expr) is None
    assert stepper.settle(nodeset, lambda: [host(2)]) is None  # nothing left to do
    audit.close()
    events = [(r["event"], r["node"]) for r in map(json.loads, audit.path.read_text().splitlines())]
    assert events == [("stepped_out", "gpa1"), ("stepped_out", "gpa2"), ("stepped_in", "gpa1"), ("stepped_in", "gpa2")]


def test_still_short_at_the_cooldowns_end_stays_out_and_the_cooldown_starts_again(tmp_path) -> None:
    slurm = FakeSlurm({"gpa1": ("IDLE+CLOUD+POWERED_DOWN", "")})
    ctx, _ = context(tmp_path, slurm)
    clock = Clock()
    shortages = ShortageLog.of(ctx.config, clock=clock)
    nodeset = ctx.config.nodesets[0]
    shortages.record(nodeset.nodes_expr, COUNT, 0, "GPU shortage", [GPU], 2)
    clock.now += COOLDOWN + 1
    step = StepOut(ctx, shortages, clock).settle(nodeset, lambda: [host(0)])
    assert step is not None and step.out
    renewed = shortages.read(nodeset.nodes_expr)
    assert renewed is not None and renewed.at == clock.now
    clock.now += COOLDOWN + 1  # a GPU for one VM: back in
    step = StepOut(ctx, shortages, clock).settle(nodeset, lambda: [host(1)])
    assert step is not None and not step.out and step.nodes == ("gpa1",)


@pytest.mark.parametrize("damage", ["lost", "malformed", "future", "foreign node set"])
def test_a_lost_or_planted_shortage_file_keeps_no_node_out(tmp_path, damage: str) -> None:
    out = ("IDLE+CLOUD+DRAIN+POWERED_DOWN", "nebula: out of service since 10:00:00, back when GPUs return")
    slurm = FakeSlurm({"gpa1": out, "gpa2": out, "gpa3": ADMIN})
    ctx, _ = context(tmp_path, slurm)
    shortages = ShortageLog.of(ctx.config, clock=Clock())
    nodeset = ctx.config.nodesets[0]
    shortages.record(nodeset.nodes_expr, COUNT, 0, "GPU shortage", [GPU], 2)
    path = shortages.path(nodeset.nodes_expr)
    if damage == "lost":
        path.unlink()
    elif damage == "malformed":
        path.write_text('{"nodes": "gpa[1-4]", "at": "soon"')
    elif damage == "future":
        body = json.loads(path.read_text())
        path.write_text(json.dumps(dict(body, at=NOW + 10**9)))
    else:
        body = json.loads(path.read_text())
        path.write_text(json.dumps(dict(body, nodes="gpb[1-2]")))
    states = slurm.show_nodes(["gpa1", "gpa2", "gpa3"])
    step = StepOut(ctx, shortages, Clock(), seen=lambda ns: bool(out_nodes(ns, states))).settle(nodeset, lambda: None)
    assert step is not None and not step.out and step.nodes == ("gpa1", "gpa2")
    assert slurm.states["gpa3"] == ADMIN
    assert out_now([step], slurm.show_nodes(["gpa1", "gpa2"]), ctx.config.nodesets) == 0


def test_slurmctld_down_while_stepping_out_loses_nothing(tmp_path) -> None:
    slurm = FakeSlurm({"gpa1": ("IDLE+CLOUD+POWERED_DOWN", "")})
    ctx, _ = context(tmp_path, slurm)
    shortages = ShortageLog.of(ctx.config, clock=Clock())
    nodeset = ctx.config.nodesets[0]
    shortages.record(nodeset.nodes_expr, COUNT, 0, "GPU shortage", [GPU], 2)
    slurm.unreachable = True
    assert StepOut(ctx, shortages, Clock()).settle(nodeset, lambda: None) is None
    assert shortages.read(nodeset.nodes_expr) is not None  # kept for the next run
    slurm.unreachable = False
    step = StepOut(ctx, shortages, Clock()).settle(nodeset, lambda: None)
    assert step is not None and step.out and step.nodes == ("gpa1",)


def test_suspend_drains_the_nodes_it_powers_down_only_while_the_node_set_is_short(tmp_path) -> None:
    slurm = FakeSlurm({"gpa1": ("IDLE+CLOUD+POWERING_DOWN", "nebula: job 7: needs 2 GPUs, 0 free"),
                       "gpb1": ("IDLE+CLOUD+POWERING_DOWN", "")})
    ctx, _ = context(tmp_path, slurm)
    assert after_suspend(ctx, ["gpa1", "gpb1"]) == []  # no shortage: nothing
    ShortageLog.of(ctx.config).record("gpa[1-4]", COUNT, 0, "GPU shortage", [GPU], 2)
    steps = after_suspend(ctx, ["gpa1", "gpb1"])
    assert [(s.nodeset.nodes_expr, s.out, s.nodes) for s in steps] == [("gpa[1-4]", True, ("gpa1",))]
    assert slurm.states["gpb1"] == ("IDLE+CLOUD+POWERING_DOWN", "")


def test_the_step_lock_is_not_a_file_others_can_replace(tmp_path) -> None:
    slurm = FakeSlurm({"gpa1": ("IDLE+CLOUD+POWERED_DOWN", "")})
    ctx, _ = context(tmp_path, slurm)
    nodeset = ctx.config.nodesets[0]
    ShortageLog.of(ctx.config).record(nodeset.nodes_expr, COUNT, 0, "GPU shortage", [GPU], 2)
    locks = list(ctx.config.power.lock_dir.glob("shortage-*.lock"))
    assert locks == []
    StepOut(ctx).settle(nodeset, lambda: None)
    (lock,) = ctx.config.power.lock_dir.glob("shortage-*.lock")
    lock.unlink()
    os.symlink("/etc/passwd", lock)  # a link planted where the lock goes: refused, nothing stepped, no raise
    assert StepOut(ctx).settle(nodeset, lambda: None) is None


@pytest.mark.parametrize(("reason", "any_reason", "returned"), [
    ("ResumeTimeout reached [slurm@2026-12-07T10:00:00]", False, True),  # slurmctld's own
    ("ResumeTimeout reached", False, True),
    ("nebula: reconcile: its VM is gone : ResumeTimeout reached [slurm@2026-12-07T10:00:00]", False, True),
    ("RMA ticket 42 : ResumeTimeout reached [slurm@2026-12-07T10:00:00]", False, False),  # an administrator's
    ("RMA ticket 42 [root@2026-12-07T10:00:00]", False, False),
    ("RMA ticket 42 [root@2026-12-07T10:00:00]", True, True),  # [power] return_any_down
    ("", False, False),
])
def test_reconcile_returns_only_down_nodes_whose_reason_is_ours_or_resume_timeouts(reason, any_reason,
                                                                                  returned) -> None:
    assert returnable(reason, any_reason) is returned


@pytest.mark.parametrize(("state", "vms", "returned"), [
    ("DOWN+CLOUD+POWERED_DOWN+NOT_RESPONDING", 0, True),
    ("DOWN+CLOUD+POWERED_DOWN", 1, False),  # a VM of ours still there: ResumeFailProgram's, or reconcile's
    ("DOWN+CLOUD+NOT_RESPONDING", 0, False),  # not powered down: not a down~ node
    ("DOWN+CLOUD+DRAIN+POWERED_DOWN", 0, False),  # drained as well: left to whoever drained it
    ("IDLE+CLOUD+POWERED_DOWN", 0, False),
])
def test_reconcile_returns_a_down_powered_down_node_only_without_a_vm(tmp_path, state, vms, returned) -> None:
    ctx, _ = context(tmp_path, FakeSlurm({}))
    vm = [Vm(7, "gpa1", ACTIVE, RUNNING_LCM, stime=int(NOW))] * vms  # RUNNING, the node's slurmd never registered
    view = NodeView("gpa1", ctx.config.nodesets[0], NodeState("gpa1", state, "ResumeTimeout reached"), vm)
    repair = diagnose(view, NOW, 300).repair
    assert (repair is not None and repair.back) is returned, repair


class SlowSlurm(FakeSlurm):
    """Changes its nodes one at a time, slowly: a step not under its lock would be seen half done."""

    def set_drain(self, nodes, reason) -> None:
        for node in nodes:
            time.sleep(0.002)
            super().set_drain([node], reason)


def test_racing_steps_leave_a_node_set_out_or_in_never_half(tmp_path) -> None:
    nodes = {f"gpa{i}": ("IDLE+CLOUD+POWERED_DOWN", "") for i in range(1, 5)}
    slurm = SlowSlurm(nodes)
    ctx, _ = context(tmp_path, slurm)
    nodeset = ctx.config.nodesets[0]
    shortages = ShortageLog.of(ctx.config)
    for _ in range(10):
        shortages.record(nodeset.nodes_expr, COUNT, 0, "GPU shortage", [GPU], 2)
        barrier = threading.Barrier(3)

        def resume_steps_out(barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            StepOut(ctx).settle(nodeset, lambda: [host(0)])

        def reconcile_sees_gpus_back(barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            surveyed(ctx, slurm.show_nodes(list(nodes))).settle(nodeset, lambda: [host(4)])

        threads = [threading.Thread(target=f) for f in (resume_steps_out, resume_steps_out, reconcile_sees_gpus_back)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        drained = {n for n, (state, _) in slurm.states.items() if "DRAIN" in state}
        assert drained in (set(), set(nodes)), drained
        on_record = shortages.read(nodeset.nodes_expr) is not None
        assert on_record == bool(drained), "the shortage file and Slurm agree"
        surveyed(ctx, slurm.show_nodes(list(nodes))).settle(nodeset, lambda: [host(4)])  # back in for the next
        assert not any("DRAIN" in state for state, _ in slurm.states.values())


def test_status_says_which_node_sets_are_out_since_when_why_and_until_when(tmp_path) -> None:
    out = ("IDLE+CLOUD+DRAIN+POWERED_DOWN", "nebula: out of service since 10:00:00, back when GPUs return")
    slurm = FakeSlurm({"gpa1": out, "gpa2": ("IDLE+CLOUD+POWERED_DOWN", ""), "gpb1": out})
    ctx, _ = context(tmp_path, slurm)
    ShortageLog.of(ctx.config, clock=lambda: NOW).record(
        "gpa[1-4]", COUNT, 0, "GPU shortage (job 7: needs 2 GPUs 10de:2330, 0 free)", [GPU], 2)
    lines = outlook(ctx.config, slurm.show_nodes(["gpa1", "gpa2", "gpb1"]), NOW + 10)
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(NOW))
    until = time.strftime("%H:%M:%S", time.localtime(NOW + COOLDOWN))
    assert lines == [
        f"gpa[1-4] out of Slurm's way since {since} (GPU shortage (job 7: needs 2 GPUs 10de:2330, 0 free)); back "
        f"when GPUs return, checked by {until} at the latest; drained: gpa1",
        "gpb[1-2]: gpb1 drained for a shortage no longer on record: the next reconcile steps them back in"]


def test_two_configurations_sharing_a_lock_dir_keep_their_node_sets_state_apart(tmp_path) -> None:
    # issue 34, item 14: a test configuration on the controller (another ClusterName, the default lock_dir)
    # must not put production's node set of the same hostlist in protected mode or its cooldown
    from slurm_nebula_power.protectlog import ProtectLog

    ctx, _ = context(tmp_path, FakeSlurm({}))
    lock_dir = ctx.config.power.lock_dir
    ShortageLog(lock_dir, cluster="test").record("gpa[1-4]", COUNT, 0, "GPU shortage", [GPU], 2)
    ProtectLog(lock_dir, cluster="test").failed("gpa[1-4]", 5, "VM failed", 3, 1800)
    assert ShortageLog.of(ctx.config).read("gpa[1-4]") is None
    assert ProtectLog.of(ctx.config).read("gpa[1-4]") is None
    ShortageLog.of(ctx.config).record("gpa[1-4]", COUNT, 0, "GPU shortage", [GPU], 2)
    assert ShortageLog.of(ctx.config).read("gpa[1-4]") is not None
    assert ShortageLog(lock_dir, cluster="test").read("gpa[1-4]") is not None
    assert len(list(lock_dir.glob("shortage-*.json"))) == 2
    # a file copied under the other cluster's name is not taken either (its content names its cluster)
    ours = ShortageLog.of(ctx.config).path("gpa[1-4]")
    ShortageLog(lock_dir, cluster="test").path("gpa[1-4]").write_bytes(ours.read_bytes())
    assert ShortageLog(lock_dir, cluster="test").read("gpa[1-4]") is None


class CountingSlurm(FakeSlurm):
    def __init__(self, states) -> None:
        super().__init__(states)
        self.reads = 0

    def show_nodes(self, nodes):
        self.reads += 1
        return super().show_nodes(nodes)


def test_a_resume_steps_other_node_sets_only_back_in_and_asks_slurm_only_then(tmp_path) -> None:
    out = ("IDLE+CLOUD+DRAIN+POWERED_DOWN", "nebula: out of service since 10:00:00, back when GPUs return")
    slurm = CountingSlurm({"gpa1": out, "gpb1": ("IDLE+CLOUD+POWERED_DOWN", "")})
    ctx, _ = context(tmp_path, slurm)
    gpa = ctx.config.nodesets[0]
    ShortageLog.of(ctx.config).record(gpa.nodes_expr, COUNT, 0, "GPU shortage", [GPU], 2)
    assert after_resume(ctx, [], [], lambda: [host(0)]) == []  # still short: left to reconcile and suspend
    assert slurm.reads == 0, "no scontrol show node for a node set whose verdict is no step"
    [step] = after_resume(ctx, [], [], lambda: [host(2)])
    assert (step.nodeset, step.out, step.nodes) == (gpa, False, ("gpa1",))
    assert slurm.reads == 1
    assert after_resume(ctx, [], [], lambda: None) == [], "no host pool read: nothing to judge the others by"


def test_a_suspend_steps_nothing_back_in_after_the_cooldown(tmp_path) -> None:
    slurm = FakeSlurm({"gpa1": ("IDLE+CLOUD+POWERING_DOWN", "")})
    ctx, _ = context(tmp_path, slurm)
    ShortageLog.of(ctx.config, clock=lambda: NOW - COOLDOWN - 1).record("gpa[1-4]", COUNT, 0, "short", [GPU], 2)
    assert after_suspend(ctx, ["gpa1"]) == [] and slurm.drains == []
    assert ShortageLog.of(ctx.config).read("gpa[1-4]") is not None, "the end of a cooldown is reconcile's to judge"
