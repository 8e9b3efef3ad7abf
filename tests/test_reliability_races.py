"""Races between real processes: per-node locks order resume and suspend, overlapping resumes create one VM
per node, and a lock whose holder was killed with SIGKILL blocks nobody.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from reliability_support import finish, held, launch, live_ours, lock_is_held, settle, site

from opennebula_sim import states as S
from slurm_nebula_power.cli.main import resume_main
from slurm_nebula_power.errors import EXIT_OK
from slurm_nebula_power.locks import NodeLocks

BOOTING = (S.LCM_INIT, S.PROLOG, S.BOOT)
NODES = ["gpu01", "gpu02"]


@pytest.fixture
def setup(tmp_path, sim):
    """gpu[01-08] with a long boot_timeout: a run waiting for a lock must not give up first."""
    return site(tmp_path / "site", sim, boot_timeout=60, poll_max=0.2)


def all_nodes(sim, nodes, predicate) -> bool:
    """Each node has a live VM of ours, and every such VM satisfies predicate."""
    ours = live_ours(sim)
    return all(ours.get(n) and all(predicate(vm) for vm in ours[n]) for n in nodes)


def assert_no_lock_timeouts(setup) -> None:
    log = setup.log_text()
    assert "still locked" not in log and "busy" not in log, "no run gave up on a lock"


def test_suspend_during_an_in_flight_resume_ends_with_no_vm(sim, setup) -> None:
    sim.set_durations(prolog=1.5, boot=0.5)
    resume = launch(setup, "slurm-nebula-resume", "gpu[01-02]")
    sim.wait_for(lambda: all_nodes(sim, NODES, lambda vm: vm.state == S.PENDING or vm.lcm_state in BOOTING),
                 30)
    assert resume.poll() is None and all(lock_is_held(setup, n) for n in NODES), "the resume is in flight"
    suspend = launch(setup, "slurm-nebula-suspend", "gpu[01-02]")
    assert finish(resume) == EXIT_OK
    assert finish(suspend) == EXIT_OK
    settle(sim)
    assert live_ours(sim) == {}, "the suspend waited for the resume, then powered its VMs down"
    assert all(h.gpus_free == h.gpus_total for h in sim.hosts())
    # The suspend acted only once the resume had its VMs RUNNING. (Not the summary lines' order: the resume
    # releases its locks before it logs its summary, and the suspend's summary came first in a CI run.)
    lines = setup.log_text().splitlines()
    running = [i for i, line in enumerate(lines) if "slurm-nebula-resume[" in line and "state=ACTIVE/RUNNING" in line]
    acted = [i for i, line in enumerate(lines) if "slurm-nebula-suspend[" in line and "action=" in line]
    assert running and acted and max(running) < min(acted)
    assert_no_lock_timeouts(setup)


def test_resume_during_an_in_flight_suspend_ends_with_one_running_vm(sim, setup) -> None:
    assert resume_main(["gpu[01-02]"], setup.env) == EXIT_OK
    old = {n: vms[0].id for n, vms in live_ours(sim).items()}
    sim.set_durations(shutdown=1.5, epilog=0.5)
    suspend = launch(setup, "slurm-nebula-suspend", "gpu[01-02]")
    sim.wait_for(lambda: all(sim.vm(i).lcm_state in (S.SHUTDOWN, S.EPILOG) for i in old.values()), 30)
    assert suspend.poll() is None and all(lock_is_held(setup, n) for n in NODES), "the suspend is in flight"
    resume = launch(setup, "slurm-nebula-resume", "gpu[01-02]")
    assert finish(suspend) == EXIT_OK
    assert finish(resume) == EXIT_OK
    ours = live_ours(sim)
    for node in NODES:
        [vm] = ours[node]
        assert vm.state_str == "RUNNING" and vm.id != old[node], "a new VM, after the old one was DONE"
        assert sim.vm(old[node]).state == S.DONE
    [*_, addresses] = [u for u in setup.updates() if any(a.startswith("NodeAddr=") for a in u)]
    assert addresses[1] == "NodeAddr=" + ",".join(ours[n][0].ip for n in NODES), "Slurm has the new VMs' IPs"
    assert_no_lock_timeouts(setup)


@pytest.mark.parametrize(("first", "second"), [("gpu[01-06]", "gpu[04-08]"), ("gpu[01-08]", "gpu[08,01-07]"),
                                               ("gpu[02-07]", "gpu[01-03,05,07-08]")])
def test_two_overlapping_resumes_at_once_create_one_vm_per_node(sim, setup, first, second) -> None:
    sim.set_durations(prolog=0.3, boot=0.3)
    runs = [launch(setup, "slurm-nebula-resume", first), launch(setup, "slurm-nebula-resume", second)]
    assert [finish(run) for run in runs] == [EXIT_OK, EXIT_OK]
    ours = live_ours(sim)
    assert sorted(ours) == [f"gpu0{i}" for i in range(1, 9)]
    for node, vms in ours.items():
        assert [vm.state_str for vm in vms] == ["RUNNING"], node
        assert len([vm for vm in sim.vms() if vm.name == node]) == 1, f"{node}: one instantiate, no duplicate"
    assert_no_lock_timeouts(setup)


def test_a_lock_held_by_a_process_killed_with_sigkill_blocks_nobody(sim, setup) -> None:
    sim.set_durations(prolog=2.0)
    doomed = launch(setup, "slurm-nebula-resume", "gpu[01-02]")
    sim.wait_for(lambda: all_nodes(sim, NODES, lambda vm: True), 30)
    assert all(lock_is_held(setup, n) for n in NODES)
    os.kill(doomed.pid, signal.SIGKILL)
    assert finish(doomed) == -signal.SIGKILL
    assert all((setup.root / "locks" / f"{n}.lock").exists() for n in NODES), "the lock files stay behind"
    assert not any(lock_is_held(setup, n) for n in NODES), "but the kernel dropped the locks"
    assert resume_main(["gpu[01-02]"], setup.env) == EXIT_OK
    ours = live_ours(sim)
    assert [len(ours[n]) for n in NODES] == [1, 1] and all(ours[n][0].state_str == "RUNNING" for n in NODES)
    assert_no_lock_timeouts(setup)


def test_overlapping_resumes_never_wait_for_each_other_in_a_cycle(sim, tmp_path) -> None:
    # A third run (a reconcile repairing gpu05, say) holds gpu05 while two overlapping resumes start: the
    # first holds gpu04 and waits for gpu05, the second must not take gpu05 and then wait for gpu04/06.
    setup = site(tmp_path / "site", sim, boot_timeout=10, suspend_timeout=5, poll_max=0.2)
    sim.set_durations(prolog=0.3, boot=0.3)
    with NodeLocks(setup.root / "locks", ["gpu05"], 0) as third:
        assert third.held == ["gpu05"]
        first = launch(setup, "slurm-nebula-resume", "gpu[04-06]")
        sim_wait(lambda: lock_is_held(setup, "gpu04"), 30)
        second = launch(setup, "slurm-nebula-resume", "gpu[05-07]")
        # Release gpu05 just as the second run starts waiting (it polls fast then; the first, waiting for
        # longer, polls every 0.5 s): where a run holds locks out of order, the second takes gpu05.
        sim_wait(lambda: lock_is_held(setup, "gpu07"), 3, must=False)
    assert [finish(first), finish(second)] == [EXIT_OK, EXIT_OK]
    ours = live_ours(sim)
    assert {n: len(v) for n, v in ours.items()} == {"gpu04": 1, "gpu05": 1, "gpu06": 1, "gpu07": 1}
    assert_no_lock_timeouts(setup)


def sim_wait(predicate, timeout: float, must: bool = True) -> None:
    """Poll predicate until true; with must=False a timeout only ends the wait (sequencing, not a check)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            assert not must, "condition not reached"
            return
        time.sleep(0.01)


def test_a_waiting_run_holds_only_locks_that_sort_before_the_busy_one(tmp_path) -> None:
    lock_dir = tmp_path / "locks"
    seen: list[tuple[bool, bool]] = []
    with NodeLocks(lock_dir, ["gpu05"], 0) as third:
        def probe(_: float) -> None:  # the waiting run's sleep: look at what it holds, then free gpu05
            seen.append((held(lock_dir, "gpu04"), held(lock_dir, "gpu06")))
            third.release()

        with NodeLocks(lock_dir, ["gpu06", "gpu04", "gpu05"], 60, sleep=probe) as run:
            assert run.held == ["gpu04", "gpu05", "gpu06"] and run.busy == []
    assert seen == [(True, False)], "while waiting for gpu05 it held gpu04, not gpu06"

