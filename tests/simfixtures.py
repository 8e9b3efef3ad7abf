"""Simulator helpers shared by the program tests (the `sim` and `setup` fixtures are in conftest.py)."""

from __future__ import annotations

from opennebula_sim import SimConfig
from opennebula_sim import states as S
from opennebula_sim.config import Durations, default_hosts

AUTH = "oneadmin:Sim-S3cret-pass"


def fast_config(hosts: int = 4, gpus: int = 4, **kw: object) -> SimConfig:
    """A simulator whose phases take no time (a VM runs within a few ticks)."""
    return SimConfig(hosts=default_hosts(hosts, gpus), durations=Durations(0, 0, 0, 0), **kw)  # type: ignore[arg-type]


def vms_of(sim, name: str, live: bool = True) -> list:
    """The simulator's VMs with this name (live = not DONE)."""
    return [vm for vm in sim.vms() if vm.name == name and (not live or vm.state != S.DONE)]


def calls(sim, method: str) -> int:
    """How many times a method was called."""
    return int(sim.stats()["calls"].get(method, 0))
