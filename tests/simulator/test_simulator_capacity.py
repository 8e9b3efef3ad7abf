"""GPU capacity, when host resources are held and freed, and IP leases."""

from __future__ import annotations

import tracemalloc

import pyone
import pytest

from opennebula_sim import Durations, SimConfig, default_hosts
from opennebula_sim.handle import Simulator
from opennebula_sim.messages import sched_text

# the simulator conftest's `sim` fixture runs
SIM_CONFIG = TWO_GPUS = SimConfig(hosts=default_hosts(count=1, gpus=2), durations=Durations(0, 0, 0, 0))


def _state(sim: Simulator, vm_id: int) -> str:
    return sim.vm(vm_id).state_str


def _gpus_free(sim: Simulator) -> int:
    return sim.hosts()[0].gpus_free


def _start(sim: Simulator, one: pyone.OneServer, count: int) -> list[int]:
    ids = [one.template.instantiate(0, f"gpu{i}", False, "", False) for i in range(count)]
    sim.wait_for(lambda: all(_state(sim, i) == "RUNNING" for i in ids), 5)
    return ids


def test_gpu_vm_beyond_free_devices_stays_pending_with_sched_message(sim: Simulator,
                                                                     one: pyone.OneServer) -> None:
    _start(sim, one, 2)
    third = one.template.instantiate(0, "gpu2", False, "", False)
    message = sim.wait_for(lambda: sim.vm(third).user_template.get("SCHED_MESSAGE"), 5)
    # real oned 7.0.2's text (the simulator says 6.10.0, before 7.4's); it was "Cannot dispatch VM to any
    # Host. Check VM log for detailed reasons." with " : " before the contract suite compared it with oned
    assert message.endswith(": Cannot allocate VM. Not enough capacity in hosts 0") and " : " not in message
    assert _state(sim, third) == "PENDING"
    assert "SCHED_MESSAGE" in one.vmpool.info(-2, -1, -1, -1).VM[0].USER_TEMPLATE


def test_terminating_a_gpu_vm_lets_the_pending_one_run(sim: Simulator, one: pyone.OneServer) -> None:
    first, _ = _start(sim, one, 2)
    third = one.template.instantiate(0, "gpu2", False, "", False)
    sim.wait_for(lambda: "SCHED_MESSAGE" in sim.vm(third).user_template, 5)
    one.vm.action("terminate", first)
    sim.wait_for(lambda: _state(sim, third) == "RUNNING", 5)
    assert "SCHED_MESSAGE" not in sim.vm(third).user_template
    assert sim.vm(third).pci == ("0000:41:00:0",), "it got the device the terminated VM held"
    assert sim.vm(first).pci == ()


def test_cpu_vm_needs_no_gpu(sim: Simulator, one: pyone.OneServer) -> None:
    _start(sim, one, 2)
    cpu = one.template.instantiate(1, "cpu", False, "", False)
    sim.wait_for(lambda: _state(sim, cpu) == "RUNNING", 5)
    assert sim.vm(cpu).pci == ()


def test_memory_limits_placement_too(sim: Simulator, one: pyone.OneServer) -> None:
    huge = one.template.instantiate(1, "huge", False, 'MEMORY = "99999999"', False)
    sim.wait_for(lambda: "SCHED_MESSAGE" in sim.vm(huge).user_template, 5)
    assert _state(sim, huge) == "PENDING"


@pytest.mark.parametrize(("action", "end", "freed"), [
    ("poweroff", "POWEROFF", False),
    ("poweroff-hard", "POWEROFF", False),
    ("suspend", "SUSPENDED", False),
    ("undeploy", "UNDEPLOYED", True),
    ("stop", "STOPPED", True),
    ("terminate", "DONE", True),
])
def test_devices_are_freed_only_at_the_end_of_terminate_undeploy_stop(
        sim: Simulator, one: pyone.OneServer, action: str, end: str, freed: bool) -> None:
    (vm_id,) = _start(sim, one, 1)
    assert _gpus_free(sim) == 1
    one.vm.action(action, vm_id)
    sim.wait_for(lambda: _state(sim, vm_id) == end, 5)
    assert _gpus_free(sim) == (2 if freed else 1)
    assert (sim.vm(vm_id).host is None) == freed


def test_devices_are_held_during_the_shutdown_phase(sim: Simulator, one: pyone.OneServer) -> None:
    (vm_id,) = _start(sim, one, 1)
    sim.set_durations(shutdown=60)
    one.vm.action("undeploy", vm_id)
    assert _state(sim, vm_id) == "SHUTDOWN_UNDEPLOY"
    assert _gpus_free(sim) == 1


def test_poweroff_keeps_the_gpu_for_resume_on_the_same_device(sim: Simulator, one: pyone.OneServer) -> None:
    first, second = _start(sim, one, 2)
    one.vm.action("poweroff", first)
    sim.wait_for(lambda: _state(sim, first) == "POWEROFF", 5)
    waiting = one.template.instantiate(0, "waiting", False, "", False)
    sim.wait_for(lambda: "SCHED_MESSAGE" in sim.vm(waiting).user_template, 5)
    one.vm.action("resume", first)
    sim.wait_for(lambda: _state(sim, first) == "RUNNING", 5)
    assert sim.vm(first).pci == ("0000:41:00:0",)
    assert _state(sim, waiting) == "PENDING"
    assert second != waiting


def test_boot_failure_keeps_host_resources_until_terminated(sim: Simulator, one: pyone.OneServer) -> None:
    sim.set_faults(boot_failure_rate=1.0)
    vm_id = one.template.instantiate(0, "bad", False, "", False)
    sim.wait_for(lambda: _state(sim, vm_id) == "BOOT_FAILURE", 5)
    assert _gpus_free(sim) == 1
    assert "Error deploying virtual machine" in sim.vm(vm_id).user_template["ERROR"]
    one.vm.action("terminate", vm_id)
    sim.wait_for(lambda: _state(sim, vm_id) == "DONE", 5)
    assert _gpus_free(sim) == 2


def test_undeployed_vm_resumes_onto_whatever_device_is_free(sim: Simulator, one: pyone.OneServer) -> None:
    first, _ = _start(sim, one, 2)
    one.vm.action("undeploy", first)
    sim.wait_for(lambda: _state(sim, first) == "UNDEPLOYED", 5)
    taker = one.template.instantiate(0, "taker", False, "", False)
    sim.wait_for(lambda: _state(sim, taker) == "RUNNING", 5)
    one.vm.action("resume", first)
    sim.wait_for(lambda: "SCHED_MESSAGE" in sim.vm(first).user_template, 5)
    assert _state(sim, first) == "PENDING", "its GPU went to another VM while it was undeployed"


def test_ip_is_leased_at_allocation_and_released_at_done(sim: Simulator, one: pyone.OneServer) -> None:
    a = one.template.instantiate(1, "a", True, "", False)
    b = one.template.instantiate(1, "b", True, "", False)
    assert (sim.vm(a).ip, sim.vm(b).ip) == ("127.0.1.1", "127.0.1.2")
    one.vm.action("terminate", a)
    sim.wait_for(lambda: _state(sim, a) == "DONE", 5)
    c = one.template.instantiate(1, "c", True, "", False)
    assert sim.vm(c).ip == "127.0.1.1", "the lowest free address is leased again"
    assert one.vm.info(a).TEMPLATE["NIC"]["IP"] == "127.0.1.1", "a DONE VM still shows the address it had"


def test_a_large_range_starts_at_once_and_leases_lowest_free_first() -> None:
    from opennebula_sim import NetworkSpec
    from opennebula_sim.model import IpPool

    tracemalloc.start()
    try:
        pool = IpPool(NetworkSpec(cidr="127.64.0.0/10"))
        built = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert built < 1 << 20, f"nothing is built per address (4M of them): {built} bytes"
    assert pool.free == 2**22 - 2
    first = [pool.lease(i) for i in range(3)]
    assert first == ["127.64.0.1", "127.64.0.2", "127.64.0.3"]
    pool.release("127.64.0.2")
    pool.release("127.64.0.1")
    assert [pool.lease(9), pool.lease(9), pool.lease(9)] == ["127.64.0.1", "127.64.0.2", "127.64.0.4"]
    assert pool.free == 2**22 - 2 - 4


def test_an_exhausted_range_leases_nothing_until_an_address_comes_back() -> None:
    from opennebula_sim import NetworkSpec
    from opennebula_sim.model import IpPool

    pool = IpPool(NetworkSpec(cidr="127.0.9.0/30"))  # two usable addresses: .1 and .2
    assert [pool.lease(1), pool.lease(2), pool.lease(3)] == ["127.0.9.1", "127.0.9.2", None]
    pool.release("127.0.9.2")
    pool.release("127.0.9.2")  # twice: still one address back
    assert (pool.free, pool.lease(4), pool.lease(5)) == (1, "127.0.9.2", None)


def test_poweroff_keeps_the_ip(sim: Simulator, one: pyone.OneServer) -> None:
    (vm_id,) = _start(sim, one, 1)
    one.vm.action("poweroff", vm_id)
    sim.wait_for(lambda: _state(sim, vm_id) == "POWEROFF", 5)
    other = one.template.instantiate(1, "other", True, "", False)
    assert sim.vm(other).ip == "127.0.1.2"


def test_delete_recreate_keeps_id_and_ip(sim: Simulator, one: pyone.OneServer) -> None:
    (vm_id,) = _start(sim, one, 1)
    ip = sim.vm(vm_id).ip
    one.vm.recover(vm_id, 4)
    sim.wait_for(lambda: _state(sim, vm_id) == "RUNNING"
                 and len(one.vm.info(vm_id).HISTORY_RECORDS.HISTORY) == 2, 5)
    assert sim.vm(vm_id).ip == ip


def test_add_vm_holds_resources_like_a_vm_in_that_state(sim: Simulator, one: pyone.OneServer) -> None:
    foreign = sim.add_vm(name="foreign", user_template={"OWNER": "someone"}, state="POWEROFF", uid=7)
    assert _gpus_free(sim) == 1
    snap = sim.vm(foreign)
    assert (snap.uid, snap.state_str, snap.user_template["OWNER"], snap.host) == (7, "POWEROFF", "someone",
                                                                                  "gpu-host-01")
    parked = sim.add_vm(name="parked", state="UNDEPLOYED")
    assert sim.vm(parked).host is None and _gpus_free(sim) == 1


def test_add_vm_without_room_fails_and_leaves_nothing_behind(sim: Simulator) -> None:
    sim.add_vm(name="a", state="RUNNING")
    sim.add_vm(name="b", state="RUNNING")
    with pytest.raises(ValueError, match="no capacity"):
        sim.add_vm(name="c", state="RUNNING")
    assert [vm.name for vm in sim.vms()] == ["a", "b"]
    assert sim.add_vm(name="d", state="PENDING") == 3
    assert sim.vm(3).ip == "127.0.1.3", "the failed VM's lease went back"


@pytest.mark.parametrize(("version", "shortages", "text"), [
    ("6.10.0", {0: "PCI", 1: "CPU"}, "Cannot allocate VM. Not enough capacity in hosts 0,1"),
    ("7.0.2", {0: "PCI"}, "Cannot allocate VM. Not enough capacity in hosts 0"),
    ("7.4.0", {0: "PCI", 1: "PCI"}, "[HOST] Unavailable PCI devices on hosts: 0,1"),  # seen on real 7.4.0
    # 7.4's SchedulerFailure::log_failures, one part per shortage in its enum order (from the source)
    ("7.4.0", {0: "PCI", 1: "MEMORY", 2: "CPU"},
     "[HOST] Not enough CPU on hosts: 2[HOST] Not enough MEMORY on hosts: 1[HOST] Unavailable PCI devices on hosts: 0"),
])
def test_sched_message_text_follows_the_version(version, shortages, text) -> None:
    assert sched_text(version, shortages) == text
