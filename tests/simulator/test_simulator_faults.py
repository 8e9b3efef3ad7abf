"""Injected faults (seeded and repeatable) and 64 clients served in parallel."""

from __future__ import annotations

import threading
import time
import xmlrpc.client

import pyone
import pytest
import requests

from opennebula_sim import Durations, Faults, NetworkSpec, SimConfig, running_simulator
from opennebula_sim.handle import Simulator

# the simulator conftest's `sim` fixture runs
SIM_CONFIG = FAST = SimConfig(durations=Durations(0, 0, 0, 0), network=NetworkSpec(cidr="127.3.0.0/16"))


def test_latency_delays_every_call(sim: Simulator, one: pyone.OneServer) -> None:
    sim.set_faults(latency_ms=150)
    started = time.monotonic()
    one.system.version()
    assert time.monotonic() - started >= 0.15


def test_transient_internal_error(sim: Simulator, one: pyone.OneServer) -> None:
    sim.set_faults(transient_rate=1.0, transient_kinds=("internal",))
    with pytest.raises(pyone.OneInternalException, match=r"^\[one.vm.info\] Internal error$"):
        one.vm.info(0)
    assert sim.stats()["faults_injected"] == {"internal": 1}


def test_transient_http_503(sim: Simulator, one: pyone.OneServer) -> None:
    sim.set_faults(transient_rate=1.0, transient_kinds=("http503",))
    with pytest.raises(xmlrpc.client.ProtocolError) as caught:
        one.system.version()
    assert caught.value.errcode == 503


def test_transient_dropped_connection(sim: Simulator, one: pyone.OneServer) -> None:
    sim.set_faults(transient_rate=1.0, transient_kinds=("drop",))
    with pytest.raises(requests.exceptions.ConnectionError):
        one.system.version()


def test_transient_faults_do_not_change_state(sim: Simulator, one: pyone.OneServer) -> None:
    sim.set_faults(transient_rate=1.0, transient_kinds=("internal",))
    with pytest.raises(pyone.OneInternalException):
        one.template.instantiate(0, "x", False, "", False)
    assert sim.vms() == []
    assert sim.stats()["calls"] == {"one.template.instantiate": 1}


def _outcomes(seed: int, calls: int = 40) -> list[str]:
    cfg = SimConfig(seed=seed, faults=Faults(transient_rate=0.5))
    with running_simulator(cfg) as sim:
        one = pyone.OneServer(sim.endpoint, session=sim.auth)
        out = []
        for _ in range(calls):
            try:
                one.system.version()
                out.append("ok")
            except pyone.OneInternalException:
                out.append("internal")
            except xmlrpc.client.ProtocolError:
                out.append("503")
            except requests.exceptions.ConnectionError:
                out.append("drop")
        return out


def test_transient_faults_are_seeded_and_repeatable() -> None:
    first = _outcomes(seed=7)
    assert first == _outcomes(seed=7)
    assert {"ok", "internal", "503", "drop"} == set(first)
    assert first != _outcomes(seed=8)


def test_boot_failures_are_seeded_and_repeatable() -> None:
    def failed(seed: int) -> list[int]:
        cfg = SimConfig(seed=seed, durations=FAST.durations, network=FAST.network,
                        faults=Faults(boot_failure_rate=0.5))
        with running_simulator(cfg) as sim:
            one = pyone.OneServer(sim.endpoint, session=sim.auth)
            ids = [one.template.instantiate(1, f"v{i}", False, "", False) for i in range(16)]
            sim.wait_for(lambda: all(sim.vm(i).state_str in ("RUNNING", "BOOT_FAILURE") for i in ids), 5)
            return [i for i in ids if sim.vm(i).state_str == "BOOT_FAILURE"]

    first = failed(3)
    assert first == failed(3)
    assert 0 < len(first) < 16


def test_stuck_pending_vm_never_leaves_pending(sim: Simulator, one: pyone.OneServer) -> None:
    sim.set_faults(stuck_pending_rate=1.0)
    stuck = one.template.instantiate(1, "stuck", False, "", False)
    sim.set_faults(stuck_pending_rate=0.0)
    fine = one.template.instantiate(1, "fine", False, "", False)
    sim.wait_for(lambda: sim.vm(fine).state_str == "RUNNING", 5)
    assert sim.vm(stuck).state_str == "PENDING"
    assert "SCHED_MESSAGE" in sim.vm(stuck).user_template


def test_stuck_pending_is_seeded_and_repeatable() -> None:
    def stuck(seed: int) -> list[int]:
        cfg = SimConfig(seed=seed, durations=FAST.durations, network=FAST.network,
                        faults=Faults(stuck_pending_rate=0.5))
        with running_simulator(cfg) as sim:
            one = pyone.OneServer(sim.endpoint, session=sim.auth)
            ids = [one.template.instantiate(1, f"v{i}", True, "", False) for i in range(16)]
            for vm_id in ids:
                one.vm.action("release", vm_id)
            sim.wait_for(lambda: sum(sim.vm(i).state_str == "RUNNING" for i in ids) > 0, 5)
            time.sleep(0.1)
            return [i for i in ids if sim.vm(i).state_str == "PENDING"]

    first = stuck(11)
    assert first == stuck(11)
    assert 0 < len(first) < 16


def test_hang_holds_calls_until_released(sim: Simulator) -> None:
    sim.set_faults(hang=True)
    result: list[str] = []
    caller = threading.Thread(
        target=lambda: result.append(pyone.OneServer(sim.endpoint, session=sim.auth).system.version()))
    caller.start()
    caller.join(0.5)
    assert caller.is_alive() and result == []
    sim.set_faults(hang=False)
    caller.join(5)
    assert result == ["6.10.0"]


def _clients(sim: Simulator, count: int) -> tuple[list[threading.Thread], list[int]]:
    answers: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(count)

    def client(index: int) -> None:
        one = pyone.OneServer(sim.endpoint, session=sim.auth)
        barrier.wait()
        vm_id = one.template.instantiate(1, f"c{index}", True, "", False)
        with lock:
            answers.append(vm_id)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads, answers


def test_64_clients_are_served_in_parallel(sim: Simulator) -> None:
    sim.set_faults(hang=True)  # every call waits inside the server until released
    threads, answers = _clients(sim, 64)
    sim.wait_for(lambda: sim.server.in_flight == 64, 20)
    assert answers == []
    sim.set_faults(hang=False)
    for thread in threads:
        thread.join(20)
    assert sorted(answers) == list(range(64))


def test_slow_calls_overlap(sim: Simulator) -> None:
    sim.set_faults(latency_ms=2000)  # long enough for 64 threads to start on a loaded machine
    threads, answers = _clients(sim, 64)
    for thread in threads:
        thread.join(60)
    assert sorted(answers) == list(range(64))
    assert sim.stats()["max_in_flight"] == 64, "all 64 slow calls were inside the server at the same time"


def test_fault_settings_are_validated(sim: Simulator) -> None:
    from opennebula_sim.config import ConfigError

    with pytest.raises(ConfigError, match="transient_rate"):
        sim.set_faults(transient_rate=2.0)
    with pytest.raises(ConfigError, match="transient_kinds"):
        sim.set_faults(transient_kinds=("timeout",))
    with pytest.raises(ConfigError, match=r"durations\.boot"):
        sim.set_durations(boot=-1)
