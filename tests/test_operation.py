"""operation.remove_vm against the simulator: a VM oned is deploying is waited for, not dropped.

recover --delete of a VM in its first BOOT stalls real oned's scheduler until ACTION_TIMEOUT (300 s stock,
docs/OPENNEBULA-FIDELITY.md); the simulator models that (SimConfig.action_timeout), so a removal that
dropped it would leave the next VM PENDING here too.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyone
import pytest
from simfixtures import AUTH
from support import make_setup

from opennebula_sim import Durations, SimConfig, default_hosts, running_simulator
from opennebula_sim import states as S
from opennebula_sim.handle import Simulator
from slurm_nebula_power.cli.common import open_cloud
from slurm_nebula_power.cli.main import resume_main
from slurm_nebula_power.config import load_config
from slurm_nebula_power.errors import EXIT_NODES_FAILED
from slurm_nebula_power.operation import Cloud, Patience, remove_vm

GPU_TEMPLATE = 0  # default_templates(): slurm-gpu-worker


@pytest.fixture
def slow_boot() -> Iterator[Simulator]:
    """A simulator whose boots take 1.5 s (BOOT, BOOT_POWEROFF...), everything else a tick."""
    config = SimConfig(hosts=default_hosts(2, 1), durations=Durations(prolog=0, boot=1.5, shutdown=0, epilog=0))
    with running_simulator(config, auth=AUTH) as sim:
        yield sim


def _cloud(sim: Simulator, tmp_path) -> Cloud:
    setup = make_setup(tmp_path / "site", sim.endpoint, AUTH)
    return open_cloud(load_config(setup.config, setup.env))


def _booting(sim: Simulator, name: str = "n1") -> int:
    vm_id = int(pyone.OneServer(sim.endpoint, session=AUTH).template.instantiate(GPU_TEMPLATE, name, False, "",
                                                                                 False))
    sim.wait_for(lambda: sim.vm(vm_id).lcm_state == S.BOOT, 10)
    return vm_id


def _placed(sim: Simulator) -> bool:
    """A new VM is placed: the scheduler is not stalled."""
    vm_id = int(pyone.OneServer(sim.endpoint, session=AUTH).template.instantiate(GPU_TEMPLATE, "next", False, "",
                                                                                 False))
    return sim.wait_for(lambda: sim.vm(vm_id).state == S.ACTIVE, 10)


def test_a_vm_in_its_first_boot_is_waited_for_then_terminated_hard(slow_boot, tmp_path) -> None:
    cloud = _cloud(slow_boot, tmp_path)
    vm_id = _booting(slow_boot)
    assert remove_vm(cloud, cloud.vm(vm_id), Patience(30, poll_first=0.05)) == "terminate-hard"
    slow_boot.wait_for(lambda: slow_boot.vm(vm_id).state == S.DONE, 10)
    assert _placed(slow_boot)


def test_a_vm_still_deploying_past_the_bound_is_dropped(slow_boot, tmp_path) -> None:
    slow_boot.set_durations(boot=60)
    cloud = _cloud(slow_boot, tmp_path)
    vm_id = _booting(slow_boot)
    assert remove_vm(cloud, cloud.vm(vm_id), Patience(0.3, poll_first=0.05)) == "recover-delete"
    slow_boot.wait_for(lambda: slow_boot.vm(vm_id).state == S.DONE, 10)


def test_a_vm_booting_back_from_poweroff_is_dropped_at_once(slow_boot, tmp_path) -> None:
    # BOOT_POWEROFF is no scheduler deploy (the VM kept its host): recover --delete there stalls nothing.
    cloud = _cloud(slow_boot, tmp_path)
    vm_id = _booting(slow_boot)
    slow_boot.wait_for(lambda: slow_boot.vm(vm_id).lcm_state == S.RUNNING, 10)
    cloud.action("poweroff-hard", vm_id)
    slow_boot.wait_for(lambda: slow_boot.vm(vm_id).state == S.POWEROFF, 10)
    cloud.action("resume", vm_id)
    slow_boot.wait_for(lambda: slow_boot.vm(vm_id).lcm_state == S.BOOT_POWEROFF, 10)
    slept: list[float] = []
    assert remove_vm(cloud, cloud.vm(vm_id), Patience(30, sleep=slept.append)) == "recover-delete"
    assert slept == []
    slow_boot.wait_for(lambda: slow_boot.vm(vm_id).state == S.DONE, 10)
    assert _placed(slow_boot)


def test_resume_gives_up_on_a_booting_vm_without_stalling_oned(slow_boot, tmp_path) -> None:
    # boot_timeout passes while the VM is in BOOT: resume hands the node back and removes the VM once BOOT
    # ends, with terminate-hard, and the scheduler goes on placing.
    slow_boot.set_durations(boot=3)
    setup = make_setup(tmp_path / "site", slow_boot.endpoint, AUTH, nodesets='''
[[nodeset]]
nodes = "gpu[01-02]"
template = "slurm-gpu-worker"
boot_timeout = 1
''')
    assert resume_main(["gpu01"], setup.env) == EXIT_NODES_FAILED
    [vm] = slow_boot.vms()
    assert vm.state == S.DONE or vm.lcm_state in (S.SHUTDOWN, S.EPILOG)
    assert "not up after boot_timeout 1s (ACTIVE/BOOT)" in setup.log_text()
    assert _placed(slow_boot)  # removed with terminate-hard once RUNNING: recover --delete would stall it
