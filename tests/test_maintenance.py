"""reconcile and hosts (drift.py): a host in maintenance drains the nodes whose VMs run there, a VM lost under
its node (UNKNOWN, POWEROFF) is removed and its node handed back; nodes and VMs not ours are never touched.

Against the simulator with the recording scontrol; the real controller's answers to these updates are in
test_e2e_maintenance.py, the real oned's in test_real_oned_fleet.py."""

from __future__ import annotations

import pytest
from opsupport import ours_vm, show
from simfixtures import AUTH
from support import make_setup

from opennebula_sim import states as S
from slurm_nebula_power.cli import reconcile, status
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK

DRAIN = "Reason=nebula: host {host} {state} in OpenNebula: drained for maintenance, powered down once idle"


@pytest.fixture
def site(sim, tmp_path):
    return make_setup(tmp_path / "site", sim.endpoint, AUTH, extra="reconcile_grace = 0")


def run(site, capsys, *args: str) -> tuple[int, str]:
    code = reconcile.main(list(args), site.env)
    return code, capsys.readouterr().out


def two_vms(sim) -> dict[str, int]:
    """gpu01 on gpu-host-01, gpu02 on gpu-host-02, both RUNNING."""
    return {node: sim.add_vm(name=node, **ours_vm(node), state="RUNNING", host=host)
            for node, host in (("gpu01", "gpu-host-01"), ("gpu02", "gpu-host-02"))}


@pytest.mark.parametrize("state", ["DISABLED", "OFFLINE"])
def test_a_host_in_maintenance_drains_the_nodes_whose_vms_run_there(sim, site, capsys, state) -> None:
    vms = two_vms(sim)
    sim.set_host_state("gpu-host-01", state)
    site.set_nodes(show("gpu01 State=ALLOCATED+CLOUD", "gpu02 State=ALLOCATED+CLOUD"))
    code, out = run(site, capsys)
    assert code == EXIT_OK
    assert out.splitlines() == [f"gpu01: VM runs on host gpu-host-01, {state} in OpenNebula -> drain in Slurm: done"]
    assert site.updates() == [["NodeName=gpu01", "State=DRAIN", DRAIN.format(host="gpu-host-01", state=state)]]
    assert all(sim.vm(vm).state_str == "RUNNING" for vm in vms.values()), "the job's VM keeps running"


def test_a_node_drained_for_maintenance_is_not_drained_again_and_status_says_why(sim, site, capsys) -> None:
    two_vms(sim)
    sim.set_host_state("gpu-host-01", "DISABLED")
    reason = DRAIN.format(host="gpu-host-01", state="DISABLED").removeprefix("Reason=")
    site.set_nodes(show(f"gpu01 State=MIXED+DRAIN+CLOUD Reason={reason} [slurm@2026-12-03T16:00:00]",
                        "gpu02 State=IDLE+CLOUD"))
    code, out = run(site, capsys)
    assert (code, out, site.updates()) == (EXIT_OK, "nothing to repair\n", [])
    assert status.main(["gpu01"], site.env) == EXIT_NODES_FAILED
    assert "draining: host gpu-host-01 is DISABLED in OpenNebula" in capsys.readouterr().out


def test_the_drain_ends_when_the_host_takes_vms_again_or_the_vm_is_gone(sim, site, capsys) -> None:
    vms = two_vms(sim)
    reason = DRAIN.format(host="gpu-host-01", state="DISABLED").removeprefix("Reason=")
    site.set_nodes(show(f"gpu01 State=IDLE+DRAIN+CLOUD Reason={reason} [slurm@2026-12-03T16:00:00]",
                        f"gpu02 State=IDLE+DRAIN+CLOUD+POWERED_DOWN Reason={reason.replace('01', '02')}"))
    code, out = run(site, capsys)
    assert code == EXIT_OK
    assert out.splitlines() == [
        "gpu01: Slurm DRAIN: " + reason + " [slurm@2026-12-03T16:00:00]; drained for host maintenance, and host "
        "gpu-host-01 takes VMs again -> undrain in Slurm: done",
        f"gpu02: Slurm DRAIN: {reason.replace('01', '02')}; drained for host maintenance, and the node is powered "
        f"down; VM ACTIVE/RUNNING but node powered down -> terminate VM {vms['gpu02']} and undrain in Slurm: done",
    ]
    assert ["NodeName=gpu[01-02]", "State=UNDRAIN"] in site.updates()
    assert sim.vm(vms["gpu02"]).state == S.DONE, "the leaked VM of the powered-down node terminated too"


def test_a_drain_that_is_not_ours_is_left_alone(sim, site, capsys) -> None:
    two_vms(sim)
    sim.set_host_state("gpu-host-01", "DISABLED")
    site.set_nodes(show("gpu01 State=IDLE+DRAIN+CLOUD Reason=bad GPU, see ticket 42 [root@2026-12-03T16:00:00]",
                        "gpu02 State=IDLE+CLOUD"))
    code, out = run(site, capsys)
    assert (code, out, site.updates()) == (EXIT_OK, "nothing to repair\n", [])


@pytest.mark.parametrize("lost", ["UNKNOWN", "POWEROFF"])
def test_a_vm_lost_under_a_running_job_is_removed_and_its_node_handed_back(sim, site, capsys, lost) -> None:
    vms = two_vms(sim)
    if lost == "UNKNOWN":
        sim.fail_vm(vms["gpu01"], lcm="UNKNOWN")  # oned lost it: the host failed
    else:
        sim.lock_vm(vms["gpu01"])
        sim.unlock_vm(vms["gpu01"])
        import pyone

        pyone.OneServer(sim.endpoint, session=AUTH).vm.action("poweroff-hard", vms["gpu01"])
        sim.wait_for(lambda: sim.vm(vms["gpu01"]).state == S.POWEROFF)
    site.set_nodes(show("gpu01 State=ALLOCATED+CLOUD", "gpu02 State=ALLOCATED+CLOUD"))
    code, out = run(site, capsys)
    name = "ACTIVE/UNKNOWN" if lost == "UNKNOWN" else "POWEROFF"
    assert code == EXIT_OK
    assert out.splitlines() == [f"gpu01: node up but VM {name} -> terminate VM {vms['gpu01']} and hand back to "
                                "Slurm: done"]
    reason = (f"Reason=nebula: reconcile: VM {name} under the node (host gpu-host-01 failed, or its hypervisor "
              "process was killed)")
    # DOWN first: the job requeues and completes without waiting for the dead guest's slurmd; then the
    # hand-back returns the node to the cloud pool (test_e2e_maintenance.py, on the real controller).
    assert site.updates() == [["NodeName=gpu01", "State=DOWN", reason],
                              ["NodeName=gpu01", "State=POWER_DOWN_FORCE", reason]]
    sim.wait_for(lambda: sim.vm(vms["gpu01"]).state == S.DONE)
    assert sim.vm(vms["gpu02"]).state_str == "RUNNING"


def test_a_lost_vm_under_a_node_down_by_hand_is_reported_not_repaired(sim, site, capsys) -> None:
    vms = two_vms(sim)
    sim.fail_vm(vms["gpu01"], lcm="UNKNOWN")
    site.set_nodes(show("gpu01 State=DOWN+CLOUD Reason=maintenance by hand [root@2026-12-03T16:00:00]"))
    code, out = run(site, capsys, "gpu01")
    assert (code, out, site.updates()) == (EXIT_OK, "nothing to repair\n", [])
    site.set_nodes(show("gpu01 State=DOWN+CLOUD+NOT_RESPONDING Reason=Not responding [slurm@2026-12-03T16:00:00]"))
    code, out = run(site, capsys, "gpu01")
    assert "gpu01: Slurm DOWN: Not responding" in out and "node not responding but VM ACTIVE/UNKNOWN" in out


def test_vms_and_nodes_not_ours_are_never_touched(sim, site, capsys) -> None:
    foreign = sim.add_vm(name="gpu01", user_template={}, state="RUNNING", host="gpu-host-01")
    other = sim.add_vm(name="static07", **ours_vm("static07"), state="RUNNING", host="gpu-host-01")
    sim.set_host_state("gpu-host-01", "DISABLED")
    sim.fail_vm(other, lcm="UNKNOWN")
    site.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN", "static07 State=ALLOCATED"))
    code, out = run(site, capsys)
    assert code == EXIT_OK and site.updates() == []
    assert sim.vm(foreign).state_str == "RUNNING" and sim.vm(other).state_str == "UNKNOWN"
    assert "in no [[nodeset]]" not in out


def test_dry_run_says_what_it_would_drain(sim, site, capsys) -> None:
    two_vms(sim)
    sim.set_host_state("gpu-host-02", "OFFLINE")
    site.set_nodes(show("gpu01 State=IDLE+CLOUD", "gpu02 State=IDLE+CLOUD"))
    code, out = run(site, capsys, "--dry-run")
    assert code == EXIT_OK and site.updates() == []
    assert out == "gpu02: VM runs on host gpu-host-02, OFFLINE in OpenNebula -> would drain in Slurm\n"
