"""Fixtures of the simulator's own tests: a simulator and a pyone client of it, defined once.

A test module chooses its simulator with SIM_CONFIG (a SimConfig; by default every phase takes no time)
and SIM_AUTH (by default the simulator's own, oneadmin:secret). Helpers (support, simfixtures) import as
in tests/: tests/conftest.py puts tests/ on sys.path.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyone
import pytest

from opennebula_sim import Durations, SimConfig, running_simulator
from opennebula_sim.handle import Simulator

INSTANT = SimConfig(durations=Durations(prolog=0, boot=0, shutdown=0, epilog=0))
DEFAULT_AUTH = "oneadmin:secret"  # running_simulator's


@pytest.fixture
def sim(request: pytest.FixtureRequest) -> Iterator[Simulator]:
    """A simulator of the module's SIM_CONFIG and SIM_AUTH on a free loopback port."""
    cfg = getattr(request.module, "SIM_CONFIG", INSTANT)
    with running_simulator(cfg, auth=getattr(request.module, "SIM_AUTH", DEFAULT_AUTH)) as running:
        yield running


@pytest.fixture
def one(sim: Simulator) -> pyone.OneServer:
    """A pyone client of `sim`."""
    return pyone.OneServer(sim.endpoint, session=sim.auth)
