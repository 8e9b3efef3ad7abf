"""Simulator fixtures shared by the program tests (import them into a test module to use them)."""

from __future__ import annotations

import pytest
from support import make_setup

from opennebula_sim import SimConfig, running_simulator
from opennebula_sim.config import Durations, default_hosts

AUTH = "oneadmin:Sim-S3cret-pass"


def fast_config(hosts: int = 4, gpus: int = 4, **kw: object) -> SimConfig:
    """A simulator whose phases take no time (a VM runs within a few ticks)."""
    return SimConfig(hosts=default_hosts(hosts, gpus), durations=Durations(0, 0, 0, 0), **kw)  # type: ignore[arg-type]


@pytest.fixture
def sim():
    """A fast simulator on a free loopback port."""
    with running_simulator(fast_config(), auth=AUTH) as handle:
        yield handle


@pytest.fixture
def setup(tmp_path, sim):
    """A deployment (config, auth file, fake scontrol) pointing at the simulator."""
    return make_setup(tmp_path / "site", sim.endpoint, AUTH)


def vms_of(sim, name: str, live: bool = True) -> list:
    """The simulator's VMs with this name (live = not DONE)."""
    return [vm for vm in sim.vms() if vm.name == name and (not live or vm.state != 6)]


def calls(sim, method: str) -> int:
    """How many times a method was called."""
    return int(sim.stats()["calls"].get(method, 0))
