"""API calls per run: resume and suspend of N nodes cost N actions plus a few pool and template queries.

OpenNebula has no bulk instantiate, so N calls are the floor; everything else (template lookup, the
plan's pool query, the polls that watch the VMs) must not grow with N, except for one pool query per
wave of max_pending instantiates (resume paces a burst so oned's scheduler never stalls: the next wave is
sent once a poll has seen the last placed). Not timed: bench/ measures time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from simfixtures import AUTH, fast_config
from support import Setup, make_setup

from opennebula_sim import Simulator, running_simulator
from slurm_nebula_power.cli.main import resume_main, suspend_main
from slurm_nebula_power.config import MAX_PENDING
from slurm_nebula_power.errors import EXIT_OK

N = 100
NODES = "gpu[001-100]"
SLACK = 10  # template lookup (2), the plan's pool query, and the polls that watch the VMs
WAVES = math.ceil(N / MAX_PENDING)  # one more pool query per wave of resume's instantiates


@pytest.fixture
def sim() -> Iterator[Simulator]:
    """Room for N GPU VMs (25 hosts x 4 GPUs); phases take no time, as in bench/power_bench.py."""
    with running_simulator(fast_config(hosts=N // 4, gpus=4), auth=AUTH) as handle:
        yield handle


@pytest.fixture
def site(tmp_path, sim: Simulator) -> Setup:
    return make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=(
        f'[[nodeset]]\nnodes = "{NODES}"\ntemplate = "slurm-gpu-worker"\nboot_timeout = 60\n'))


def calls_of(sim: Simulator) -> dict[str, int]:
    """Calls per method since the last reset."""
    return dict(sim.stats()["calls"])


@pytest.mark.parametrize("latency_ms", [0, 20])
def test_resume_and_suspend_of_100_nodes_use_at_most_n_plus_10_calls(sim, site, latency_ms) -> None:
    sim.set_faults(latency_ms=latency_ms)
    assert resume_main([NODES], site.env) == EXIT_OK
    resumed = calls_of(sim)
    assert sum(resumed.values()) <= N + SLACK + WAVES, resumed
    assert resumed["one.template.instantiate"] == N
    assert sim.stats()["vms"] == {"RUNNING": N}
    sim.reset_stats()
    assert suspend_main([NODES], site.env) == EXIT_OK
    suspended = calls_of(sim)
    assert sum(suspended.values()) <= N + SLACK, suspended
    assert suspended["one.vm.action"] == N
    assert sim.stats()["vms"] == {"DONE": N}


def test_nothing_is_looked_up_node_by_node(sim, site) -> None:
    assert resume_main([NODES], site.env) == EXIT_OK
    assert suspend_main([NODES], site.env) == EXIT_OK
    per_node = {m: n for m, n in calls_of(sim).items()
                if m in ("one.vm.info", "one.vmpool.info", "one.template.info", "one.templatepool.info")}
    assert per_node == {"one.template.info": 1, "one.templatepool.info": 1}, "a template lookup, no VM lookup"


def test_a_second_resume_of_running_nodes_costs_a_constant_number_of_calls(sim, site) -> None:
    assert resume_main([NODES], site.env) == EXIT_OK
    sim.reset_stats()
    assert resume_main([NODES], site.env) == EXIT_OK
    again = calls_of(sim)
    assert sum(again.values()) <= SLACK and "one.template.instantiate" not in again, again
