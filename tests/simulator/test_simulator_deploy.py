"""one.vm.deploy and its right beyond the contract suite (tests/test_contract.py runs the common part against
real oned): deploying a VM from PENDING, UNDEPLOYED or STOPPED, a system datastore chosen, a foreign VM,
one.user.info / one.group.info of others, one.host.status, oned.conf's operations in one.system.config."""

from __future__ import annotations

import xmlrpc.client

import pytest

from opennebula_sim import Durations, SimConfig, default_hosts, running_simulator
from opennebula_sim import states as S

CFG = SimConfig(hosts=default_hosts(2, 1), durations=Durations(0, 0, 0, 0))
PLAIN = "slurm:Plain-pass-1"


def raw(sim, method: str, *args, session: str | None = None) -> list:
    return getattr(xmlrpc.client.ServerProxy(sim.endpoint), method)(session or sim.auth, *args)


def test_a_pending_vm_deployed_leaves_the_scheduler_for_that_host() -> None:
    with running_simulator(SimConfig(hosts=default_hosts(2, 1), durations=Durations(0, 0, 0, 0))) as sim:
        sim.set_host_state("gpu-host-01", "DISABLED")
        sim.set_host_state("gpu-host-02", "DISABLED")
        vm = raw(sim, "one.template.instantiate", 0, "p", False, "", False)[1]
        sim.wait_for(lambda: sim.vm(vm).user_template.get("SCHED_MESSAGE"), 5)  # nowhere to go for the scheduler
        assert raw(sim, "one.vm.deploy", vm, 1, True, -1)[:2] == [True, vm]
        sim.wait_for(lambda: sim.vm(vm).state_str == "RUNNING", 5)
        assert sim.vm(vm).host == "gpu-host-02" and "SCHED_MESSAGE" not in sim.vm(vm).user_template


@pytest.mark.parametrize(("down", "path"), [("undeploy", "PROLOG_UNDEPLOY"), ("stop", "PROLOG_RESUME")])
def test_an_undeployed_or_stopped_vm_deployed_takes_the_way_back_of_its_kind(down: str, path: str) -> None:
    with running_simulator(CFG) as sim:
        vm = raw(sim, "one.template.instantiate", 0, "back", True, "", False)[1]
        assert raw(sim, "one.vm.deploy", vm, 0, True, 0)[:2] == [True, vm]  # the system datastore by id
        sim.wait_for(lambda: sim.vm(vm).state_str == "RUNNING", 5)
        raw(sim, "one.vm.action", down, vm)
        sim.wait_for(lambda: sim.vm(vm).state in (S.UNDEPLOYED, S.STOPPED), 5)
        sim.set_durations(prolog=0.5)
        assert raw(sim, "one.vm.deploy", vm, 1, True, -1)[:2] == [True, vm]
        sim.wait_for(lambda: sim.vm(vm).state_str == path, 5)
        sim.wait_for(lambda: sim.vm(vm).state_str == "RUNNING", 5)
        assert sim.vm(vm).host == "gpu-host-02" and sim.vm(vm).pci


def test_an_image_datastore_and_a_missing_one_are_refused() -> None:
    with running_simulator(CFG) as sim:
        vm = raw(sim, "one.template.instantiate", 0, "ds", True, "", False)[1]
        assert raw(sim, "one.vm.deploy", vm, 0, True, 1)[:3] == [
            False, "[one.vm.deploy] Trying to use datastore [1] to deploy the VM, but it is not of type system "
                   "datastore.", S.INTERNAL]
        assert raw(sim, "one.vm.deploy", vm, 0, True, 9)[:4] == [
            False, "[one.vm.deploy] Error getting datastore [9].", S.NO_EXISTS, 9]


def test_a_plain_user_granted_deploy_still_may_not_deploy_another_users_vm() -> None:
    with running_simulator(CFG, auth=PLAIN) as sim:
        sim.set_user_template(VM_MANAGE_OPERATIONS="deploy")
        theirs = sim.add_vm(name="theirs", uid=7, state="HOLD")
        assert raw(sim, "one.vm.deploy", theirs, 0, True, -1)[:3] == [
            False, f"[one.vm.deploy] User [2] : Not authorized to perform MANAGE VM [{theirs}].", S.AUTHORIZATION]


def test_a_group_template_grants_but_the_users_own_admin_entry_wins() -> None:
    with running_simulator(CFG, auth=PLAIN) as sim:
        vm = raw(sim, "one.template.instantiate", 0, "g", True, "", False)[1]
        sim.set_group_template(VM_MANAGE_OPERATIONS="deploy")
        sim.set_user_template(VM_ADMIN_OPERATIONS="deploy")
        assert raw(sim, "one.vm.deploy", vm, 0, True, -1)[2] == S.AUTHORIZATION
        sim.set_user_template(VM_ADMIN_OPERATIONS="")
        assert raw(sim, "one.vm.deploy", vm, 0, True, -1)[:2] == [True, vm]


def test_user_and_group_documents_are_the_sessions_own() -> None:
    with running_simulator(CFG, auth=PLAIN) as sim:
        sim.set_user_template(VM_MANAGE_OPERATIONS="deploy")
        ok, body, *_ = raw(sim, "one.user.info", -1)
        assert ok and "<NAME>slurm</NAME>" in body and "<VM_MANAGE_OPERATIONS><![CDATA[deploy]]>" in body
        assert raw(sim, "one.user.info", 0)[2] == S.AUTHORIZATION  # another user's document
        assert raw(sim, "one.group.info", 1)[0] is True
        assert raw(sim, "one.group.info", 0)[2] == S.AUTHORIZATION
        ok, config, *_ = raw(sim, "one.system.config")
        assert "<VM_ADMIN_OPERATIONS><![CDATA[migrate, delete, recover, retry, deploy, resched," in config


def test_host_status_disables_offlines_and_enables() -> None:
    with running_simulator(CFG) as sim:
        assert raw(sim, "one.host.status", 0, 1)[:2] == [True, 0]
        assert sim.hosts()[0].state == "DISABLED"
        assert raw(sim, "one.host.status", 0, 2)[:2] == [True, 0]
        assert sim.hosts()[0].state == "OFFLINE"
        assert raw(sim, "one.host.status", 0, 0)[:2] == [True, 0]
        assert sim.hosts()[0].state == "MONITORED"
        assert raw(sim, "one.host.status", 0, 7)[:3] == [False, "[one.host.status] Wrong status code", S.INTERNAL]
        assert raw(sim, "one.host.status", 9, 1)[:3] == [False, "[one.host.status] Error getting host [9].",
                                                         S.NO_EXISTS]
