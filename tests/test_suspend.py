"""slurm-nebula-suspend and slurm-nebula-resume-fail against the simulator."""

from __future__ import annotations

import pyone
from simfixtures import AUTH, calls, vms_of

from opennebula_sim import states as S
from slurm_nebula_power.cli.main import resume_fail_main, resume_main, suspend_main
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK


def gpus_held(sim) -> int:
    return sum(h.gpus_total - h.gpus_free for h in sim.hosts())


def test_suspend_terminates_and_frees_the_gpus(sim, setup) -> None:
    assert resume_main(["gpu[01-03]"], setup.env) == EXIT_OK
    assert gpus_held(sim) == 3
    assert suspend_main(["gpu[01-03]"], setup.env) == EXIT_OK
    assert [vms_of(sim, f"gpu0{i}") for i in (1, 2, 3)] == [[], [], []]
    assert gpus_held(sim) == 0
    assert all(not vm.ip or vm.state == S.DONE for vm in sim.vms())


def test_suspend_uses_the_nodesets_action(sim, setup) -> None:
    assert resume_main(["cpu[01-02]"], setup.env) == EXIT_OK
    assert suspend_main(["cpu[01-02]"], setup.env) == EXIT_OK
    assert {vm.state for vm in sim.vms()} == {8}  # POWEROFF, as cpu[01-04] is configured


def test_suspend_of_nodes_without_vm_does_nothing(sim, setup) -> None:
    assert suspend_main(["gpu[01-08]"], setup.env) == EXIT_OK
    assert sim.stats()["calls"] == {"one.vmpool.infoextended": 1}


def test_suspend_waits_for_a_booting_vm_then_terminates_it(sim, setup) -> None:
    sim.set_durations(prolog=1.0, boot=1.0)
    client = pyone.OneServer(sim.endpoint, session=AUTH)
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    [vm] = vms_of(sim, "gpu01")
    client.vm.action("poweroff", vm.id)
    sim.wait_for(lambda: sim.vm(vm.id).state == S.POWEROFF, 10)
    client.vm.action("resume", vm.id)  # now in BOOT_POWEROFF: terminate is refused until RUNNING
    assert suspend_main(["gpu01"], setup.env) == EXIT_OK
    assert sim.vm(vm.id).state == S.DONE
    assert "in ACTIVE/BOOT_POWEROFF: waiting until it can be acted on" in setup.log_text()


def test_suspend_leaves_foreign_vms_alone(sim, setup) -> None:
    foreign = sim.add_vm(name="gpu01", user_template={}, state="RUNNING", uid=0)
    fid = foreign if isinstance(foreign, int) else foreign.id
    assert suspend_main(["gpu01"], setup.env) == EXIT_OK
    assert resume_fail_main(["gpu01"], setup.env) == EXIT_OK
    assert (sim.vm(fid).state, sim.vm(fid).lcm_state) == (3, 3)
    assert calls(sim, "one.vm.action") == 0


def test_resume_fail_terminates_whatever_state(sim, setup) -> None:
    assert resume_main(["gpu[01-02]"], setup.env) == EXIT_OK
    [one] = vms_of(sim, "gpu01")
    sim.fail_vm(one.id, lcm="BOOT_FAILURE")
    assert resume_fail_main(["gpu[01-02]"], setup.env) == EXIT_OK
    assert vms_of(sim, "gpu01") == [] and vms_of(sim, "gpu02") == []
    assert gpus_held(sim) == 0
    assert "resume failed" in setup.log_text()


def test_vms_still_up_at_suspend_timeout_make_one_reason_and_one_warning_naming_their_ids(sim, setup) -> None:
    assert resume_main(["gpu[01-03]"], setup.env) == EXIT_OK
    setup.config.write_text(setup.config.read_text().replace("suspend_timeout = 15", "suspend_timeout = 2"))
    ids = set()
    for node in ("gpu01", "gpu02", "gpu03"):
        [vm] = vms_of(sim, node)
        sim.lock_vm(vm.id)  # refuses every action: the VM stays RUNNING
        ids.add(str(vm.id))
    assert suspend_main(["gpu[01-03]"], setup.env) == EXIT_NODES_FAILED
    log = setup.log_text()
    assert "0 done, 3 failed (VM still ACTIVE/RUNNING after 2s: gpu[01-03])" in log
    late = " WARNING VM still ACTIVE/RUNNING after 2s nodes=gpu[01-03] "
    [warning] = [line for line in log.splitlines() if late in line]
    assert set(warning.rpartition("vms=")[2].split(",")) == ids
