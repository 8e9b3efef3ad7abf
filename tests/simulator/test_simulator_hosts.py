"""The host pool as a real oned shows it: PCI devices with the VM holding each (-1 free), host states that
take no new VMs (DISABLED, OFFLINE), and the SCHED_MESSAGE oned 7.x writes on a VM no host can take
(reference/real-oned.md, src/schedm/SchedulerManagerDriver.cc of 7.4.0)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pyone
import pytest

from opennebula_sim import Durations, HostSpec, PciDevice, SimConfig, default_hosts, running_simulator
from opennebula_sim.config import ConfigError, default_pci
from slurm_nebula_power.hosts import hosts_from_xml

FAST = Durations(0, 0, 0, 0)


def _raw(sim, method: str, *params) -> str:
    import xmlrpc.client

    ok, body, *_ = getattr(xmlrpc.client.ServerProxy(sim.endpoint), method)(sim.auth, *params)
    assert ok, body
    return str(body)


def test_hostpool_shows_each_pci_device_with_the_vm_holding_it() -> None:
    with running_simulator(SimConfig(hosts=default_hosts(1, 2, 1), durations=FAST)) as sim:
        one = pyone.OneServer(sim.endpoint, session=sim.auth)
        vm = one.template.instantiate(0, "a", False, "", False)
        sim.wait_for(lambda: sim.vm(vm).state_str == "RUNNING", 5)
        pool = ET.fromstring(_raw(sim, "one.hostpool.info"))
        devices = {pci.findtext("SHORT_ADDRESS"): pci.findtext("VMID")
                   for pci in pool.iterfind("HOST/HOST_SHARE/PCI_DEVICES/PCI")}
        assert devices == {"41:00.0": str(vm), "42:00.0": "-1", "21:00.0": "-1"}
        [host] = hosts_from_xml(_raw(sim, "one.hostpool.info"))
        assert (host.state_name, host.placeable) == ("MONITORED", True)
        assert [(d.short_address, d.vmid, d.klass) for d in host.devices][:2] == [("41:00.0", vm, "0302"),
                                                                                 ("42:00.0", -1, "0302")]


def test_profiles_are_listed_as_the_monitor_reports_them() -> None:
    gpu = PciDevice("41:00.0", profiles=("1145 (NVIDIA L40S-1B)", "1146 (NVIDIA L40S-2B)"))
    with running_simulator(SimConfig(hosts=(HostSpec("h", pci=(gpu,)),), durations=FAST)) as sim:
        pci = ET.fromstring(_raw(sim, "one.hostpool.info")).find("HOST/HOST_SHARE/PCI_DEVICES/PCI")
        assert pci is not None and pci.findtext("PROFILES") == "1145 (NVIDIA L40S-1B),1146 (NVIDIA L40S-2B)"
        [host] = hosts_from_xml(_raw(sim, "one.hostpool.info"))
        assert host.devices[0].profiles == ("1145 (NVIDIA L40S-1B)", "1146 (NVIDIA L40S-2B)")


@pytest.mark.parametrize(("state", "number"), [("DISABLED", 4), ("OFFLINE", 8), ("ERROR", 3)])
def test_a_host_that_is_not_monitored_takes_no_new_vm_but_keeps_its_own(state: str, number: int) -> None:
    with running_simulator(SimConfig(hosts=default_hosts(1, 2, 0), durations=FAST, version="7.4.0")) as sim:
        one = pyone.OneServer(sim.endpoint, session=sim.auth)
        running = one.template.instantiate(0, "a", False, "", False)
        sim.wait_for(lambda: sim.vm(running).state_str == "RUNNING", 5)
        sim.set_host_state("gpu-host-01", state)
        [host] = hosts_from_xml(_raw(sim, "one.hostpool.info"))
        assert (host.state, host.placeable, sim.hosts()[0].state) == (number, False, state)
        waiting = one.template.instantiate(0, "b", False, "", False)
        message = sim.wait_for(lambda: sim.vm(waiting).user_template.get("SCHED_MESSAGE"), 5)
        assert message.endswith(": Cannot dispatch VM: No hosts enabled to run VMs")
        assert sim.vm(waiting).state_str == "PENDING" and sim.vm(running).state_str == "RUNNING"
        sim.set_host_state("gpu-host-01", "MONITORED")
        sim.wait_for(lambda: sim.vm(waiting).state_str == "RUNNING", 5)
        assert "SCHED_MESSAGE" not in sim.vm(waiting).user_template


@pytest.mark.parametrize(("version", "text"), [
    ("7.0.2", r"Cannot allocate VM\. Not enough capacity in hosts 0,1"),  # what a real 7.0.2 wrote
    ("7.4.0", r"\[HOST\] Unavailable PCI devices on hosts: 0,1"),  # and a real 7.4.0 (test_contract.py)
])
def test_oned_7_names_the_hosts_without_capacity(version, text) -> None:
    with running_simulator(SimConfig(hosts=default_hosts(2, 1, 0), durations=FAST, version=version)) as sim:
        one = pyone.OneServer(sim.endpoint, session=sim.auth)
        ids = [one.template.instantiate(0, f"g{i}", False, "", False) for i in range(3)]
        message = sim.wait_for(lambda: sim.vm(ids[2]).user_template.get("SCHED_MESSAGE"), 5)
        assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}: " + text, message)


def test_host_state_in_sim_toml(tmp_path) -> None:
    from opennebula_sim import load_sim_config

    path = tmp_path / "sim.toml"
    path.write_text('[[host]]\nname = "a"\nstate = "OFFLINE"\n')
    assert load_sim_config(path).hosts[0].state == "OFFLINE"
    path.write_text('[[host]]\nname = "a"\nstate = "SLEEPY"\n')
    with pytest.raises(ConfigError, match="state must be one of"):
        load_sim_config(path)
    assert default_pci(1, 0)[0].profiles == ()


def test_after_call_runs_once_between_the_answer_and_the_next_call() -> None:
    with running_simulator(SimConfig(hosts=default_hosts(1, 1, 0), durations=FAST)) as sim:
        sim.after_call("one.hostpool.info", lambda: sim.add_vm(name="thief", uid=7, state="RUNNING"))
        [counted] = hosts_from_xml(_raw(sim, "one.hostpool.info"))
        assert counted.devices[0].free, "the answer was made before the action"
        [now] = hosts_from_xml(_raw(sim, "one.hostpool.info"))
        assert not now.devices[0].free
        assert [vm.name for vm in sim.vms()] == ["thief"], "once"
