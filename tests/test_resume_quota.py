"""Resume against a user over its OpenNebula VM quota (the simulator answers as real oned does, checked by
tests/test_contract.py): a refusal like a GPU shortage, not an authentication failure."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from simfixtures import AUTH, calls, fast_config, vms_of
from support import Setup, make_setup

from opennebula_sim import Simulator, running_simulator
from opennebula_sim import states as S
from slurm_nebula_power.cli.main import resume_main, suspend_main
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK

NODESETS = """
[[nodeset]]
nodes = "gpu[01-04]"
template = "slurm-gpu-worker"
boot_timeout = 300

[[nodeset]]
nodes = "cpu[01-02]"
template = "slurm-cpu-worker"
suspend_action = "poweroff"
boot_timeout = 300
"""


@pytest.fixture
def sim() -> Iterator[Simulator]:
    with running_simulator(fast_config(hosts=1, gpus=4), auth=AUTH) as handle:
        yield handle


def site(tmp_path: Path, sim: Simulator) -> Setup:
    return make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=NODESETS)


def reasons(setup: Setup) -> dict[str, str]:
    """node list -> Reason of every hand-back."""
    return {u[0].removeprefix("NodeName="): next(a for a in u if a.startswith("Reason="))
            for u in setup.updates() if "State=POWER_DOWN_FORCE" in u}


def test_a_quota_refusal_hands_the_node_back_naming_the_quota(tmp_path, sim) -> None:
    setup = site(tmp_path, sim)
    sim.set_faults(quota_exceeded=True)
    assert resume_main(["gpu01"], setup.env) == EXIT_NODES_FAILED
    reason = reasons(setup)["gpu01"]
    assert reason.startswith("Reason=nebula: OpenNebula quota: user [0] limit of ") and "VMS quota in VM" in reason
    assert "authenticat" not in setup.log_text().lower()
    assert calls(sim, "one.template.instantiate") == 1  # refused once, not retried
    assert vms_of(sim, "gpu01") == []


def test_after_a_quota_refusal_the_node_set_is_handed_back_at_once_without_calling_oned(tmp_path, sim) -> None:
    # Slurm resumes a requeued job's nodes again and again: each try would be refused the same way.
    setup = site(tmp_path, sim)
    sim.set_faults(quota_exceeded=True)
    assert resume_main(["gpu01"], setup.env) == EXIT_NODES_FAILED
    sim.reset_stats()
    assert resume_main(["gpu[01-02]"], setup.env) == EXIT_NODES_FAILED
    assert sim.stats()["calls"] == {}  # no quota in the host pool to look at
    assert reasons(setup)["gpu[01-02]"].startswith("Reason=nebula: cooldown ")
    assert "after OpenNebula quota: user [0] limit of" in reasons(setup)["gpu[01-02]"]


def test_a_powered_off_vm_resumed_over_the_running_vms_quota_is_handed_back_naming_the_quota(tmp_path, sim) -> None:
    # oned answers resume over RUNNING_VMS with ACTION (0x800), not AUTHORIZATION: the same refusal.
    setup = site(tmp_path, sim)
    assert resume_main(["cpu01"], setup.env) == EXIT_OK
    assert suspend_main(["cpu01"], setup.env) == EXIT_OK
    [vm] = vms_of(sim, "cpu01")
    assert vm.state == S.POWEROFF
    sim.set_faults(quota_exceeded=True)
    assert resume_main(["cpu01"], setup.env) == EXIT_NODES_FAILED
    assert "limit of" in reasons(setup)["cpu01"] and "RUNNING_VMS quota" in reasons(setup)["cpu01"]
    assert sim.vm(vm.id).state != S.ACTIVE or sim.vm(vm.id).lcm_state != S.RUNNING
