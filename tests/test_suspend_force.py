"""resume-fail's force path (power_down with force) against the simulator: a VM oned starts deploying between
the pool read and the terminate is waited for, then terminated; recover --delete there would stall oned's
scheduler until ACTION_TIMEOUT (the simulator models it, docs/OPENNEBULA-FIDELITY.md)."""

from __future__ import annotations

from collections.abc import Iterator

import pyone
import pytest
from opsupport import ours_vm
from simfixtures import AUTH
from support import make_setup

from opennebula_sim import Durations, SimConfig, default_hosts, running_simulator
from opennebula_sim import states as S
from opennebula_sim.handle import Simulator
from slurm_nebula_power.cloud import OneCloud
from slurm_nebula_power.config import load_config
from slurm_nebula_power.operation import Context
from slurm_nebula_power.suspend import power_down


class NoSlurm:
    def set_addresses(self, addresses, instances=None) -> None:
        pass

    def hand_back(self, nodes, reason) -> None:
        pass


class PlacedMeanwhile(OneCloud):
    """oned places the PENDING VM while our terminate is on its way: the host comes back before the first
    terminate is sent, which then finds the VM deploying (LCM_INIT, PROLOG or BOOT) and is refused."""

    def __init__(self, config, sim: Simulator, host: str) -> None:
        super().__init__(config)
        self.sim, self.host, self.raced = sim, host, False

    def action(self, action: str, vm_id: int) -> None:
        if not self.raced:
            self.raced = True
            self.sim.set_host_state(self.host, "MONITORED")
            self.sim.wait_for(lambda: self.sim.vm(vm_id).state == S.ACTIVE, 10)
        super().action(action, vm_id)


@pytest.fixture
def sim() -> Iterator[Simulator]:
    config = SimConfig(hosts=default_hosts(1, 2), durations=Durations(prolog=0, boot=1.5, shutdown=0, epilog=0))
    with running_simulator(config, auth=AUTH) as handle:
        yield handle


def test_resume_fail_waits_for_a_vm_placed_meanwhile_then_terminates_it(tmp_path, sim, caplog) -> None:
    caplog.set_level("INFO", logger="slurm_nebula_power")
    [host] = sim.hosts()
    sim.set_host_state(host.name, "DISABLED")
    vm_id = sim.add_vm(name="gpu01", state="PENDING", **ours_vm("gpu01"))
    setup = make_setup(tmp_path / "site", sim.endpoint, AUTH)
    config = load_config(setup.config, setup.env)
    ctx = Context(config=config, cloud=PlacedMeanwhile(config.opennebula, sim, host.name), slurm=NoSlurm())  # type: ignore[arg-type]
    outcome = power_down(ctx, ["gpu01"], "resume failed", force=True)
    assert outcome.done == ["gpu01"] and not outcome.failed
    sim.wait_for(lambda: sim.vm(vm_id).state == S.DONE, 10)
    assert "waiting for it to finish, then terminating it" in caplog.text
    # the scheduler still places: a VM deleted while deploying would have stalled it
    one = pyone.OneServer(sim.endpoint, session=AUTH)
    next_id = int(one.template.instantiate(0, "next", False, "", False))
    sim.wait_for(lambda: sim.vm(next_id).state == S.ACTIVE, 10)
