"""The OpenNebula API the product relies on, written once and run against the simulator and real oned 7.0.2 and
7.4.0 (tests/contract_support.py; docs/OPENNEBULA-FIDELITY.md lists each behaviour and what each side answers):
the VM life cycle, placement by oned's scheduler and by one.vm.deploy (direct placement), leases, CONTEXT,
OneGate, pool queries, errors, quotas and the product's own template.

Every test leaves the cloud as it found it: the `backend` fixture removes the test's VMs and waits until every
GPU is free again, because the real instance is shared by the whole session.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from contract_support import GPUS, SIM_CONFIG, Backend, oned_backend, sim_backend, state_str
from onedfix import VERSIONS, OnedUnavailable, shared
from simfixtures import AUTH
from support import make_setup

from opennebula_sim import running_simulator
from slurm_nebula_power.cli import template as template_cmd
from slurm_nebula_power.cloud import OneCloud, stale_update
from slurm_nebula_power.config import OneConfig, load_config
from slurm_nebula_power.errors import EXIT_CONFIG, EXIT_OK, QuotaExceeded
from slurm_nebula_power.findings import Report
from slurm_nebula_power.hosts import hosts_from_xml, vm_needs_from_xml
from slurm_nebula_power.model import vms_from_xml
from slurm_nebula_power.onerpc import translate
from slurm_nebula_power.operation import cloud_reason
from slurm_nebula_power.owned import IMAGE, NETWORK, Owned, owned_from_xml
from slurm_nebula_power.placement import deploy_level
from slurm_nebula_power.plan import extra_template
from slurm_nebula_power.templateuse import check_template_use

BACKENDS = [pytest.param("sim", id="sim"),
            *(pytest.param(v, id=f"oned-{v}", marks=pytest.mark.xdist_group(f"oned-{v}")) for v in VERSIONS)]
REFUSED = 0x800
AUTHORIZATION, NO_EXISTS, ALLOCATE = 0x200, 0x400, 0x4000


@pytest.fixture(scope="module", params=BACKENDS)
def cloud(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """The simulator (one per module, shaped like the real instance), or the session's real oned."""
    if request.param == "sim":
        with running_simulator(SIM_CONFIG, auth=AUTH) as sim:
            yield sim_backend(sim)
        return
    try:
        instance = shared(request.param)
    except OnedUnavailable as exc:
        pytest.skip(str(exc))
    yield oned_backend(instance)


@pytest.fixture
def backend(cloud: Backend) -> Iterator[Backend]:
    """The back end, found clean and left clean (the test's VMs DONE, every GPU free)."""
    cloud.wait_gpus_free()
    cloud.mark()
    yield cloud
    cloud.clean()


def in_order(seen: list[str], path: list[str]) -> bool:
    """`seen` is `path` with some states skipped (polling misses short ones), nothing added or reordered."""
    it = iter(path)
    return all(state in it for state in seen)


def refused(answer: list[object], action: str, state: str) -> bool:
    """oned's refusal of an action in a state: ACTION (0x800) and DispatchManager's sentence."""
    return answer[0] is False and answer[2] == REFUSED and answer[1] == (
        f'[one.vm.action] Error performing action "{action}": This action is not available for state {state}')


def fill_gpus(backend: Backend) -> list[int]:
    """One running GPU VM per GPU: the cloud has no free GPU afterwards."""
    ids = [backend.instantiate(name=f"fill{i}") for i in range(GPUS)]
    for vm_id in ids:
        backend.wait(vm_id, "RUNNING")
    assert all(v != -1 for v in backend.gpus().values())
    return ids


# ---- VM state sequences ----------------------------------------------------------------------------------


def test_instantiate_goes_pending_prolog_boot_running(backend: Backend) -> None:
    with backend.slow(1.0, "deploy"):
        vm_id = backend.instantiate(name="seq")
        vm, seen = backend.wait(vm_id, "RUNNING")
    # dispatched VMs are ACTIVE/LCM_INIT for a moment before PROLOG starts
    assert in_order(seen, ["PENDING", "LCM_INIT", "PROLOG", "BOOT", "RUNNING"]) and "BOOT" in seen, seen
    assert (vm.STATE, vm.LCM_STATE) == (3, 3)
    [parsed] = vms_from_xml(backend.pool_text())
    assert parsed.running and parsed.host is not None and parsed.ip == vm.TEMPLATE["NIC"]["IP"]


@pytest.mark.parametrize(("action", "driver", "path", "slow_state"), [
    ("terminate", "shutdown", ["RUNNING", "SHUTDOWN", "EPILOG", "DONE"], "SHUTDOWN"),
    ("terminate-hard", "cancel", ["RUNNING", "SHUTDOWN", "EPILOG", "DONE"], "SHUTDOWN"),
    ("poweroff", "shutdown", ["RUNNING", "SHUTDOWN_POWEROFF", "POWEROFF"], "SHUTDOWN_POWEROFF"),
    ("poweroff-hard", "cancel", ["RUNNING", "SHUTDOWN_POWEROFF", "POWEROFF"], "SHUTDOWN_POWEROFF"),
    ("undeploy", "shutdown", ["RUNNING", "SHUTDOWN_UNDEPLOY", "EPILOG_UNDEPLOY", "UNDEPLOYED"],
     "SHUTDOWN_UNDEPLOY"),
    ("undeploy-hard", "cancel", ["RUNNING", "SHUTDOWN_UNDEPLOY", "EPILOG_UNDEPLOY", "UNDEPLOYED"],
     "SHUTDOWN_UNDEPLOY"),
    ("stop", "save", ["RUNNING", "SAVE_STOP", "EPILOG_STOP", "STOPPED"], "SAVE_STOP"),
])
def test_action_from_running_passes_its_states(backend: Backend, action, driver, path, slow_state) -> None:
    vm_id = backend.running(name="down")
    with backend.slow(1.0, driver):
        answer = backend.action(action, vm_id)
        assert answer[:2] == [True, vm_id], answer
        vm, seen = backend.wait(vm_id, path[-1])
    assert in_order(seen, path) and slow_state in seen, seen
    numbers = {"DONE": (6, 0), "POWEROFF": (8, 0), "UNDEPLOYED": (9, 0), "STOPPED": (4, 0)}
    assert (vm.STATE, vm.LCM_STATE) == numbers[path[-1]]


@pytest.mark.parametrize(("down", "driver", "path"), [
    ("poweroff", "deploy", ["POWEROFF", "BOOT_POWEROFF", "RUNNING"]),
    ("undeploy", "deploy", ["UNDEPLOYED", "PENDING", "LCM_INIT", "PROLOG_UNDEPLOY", "BOOT_UNDEPLOY", "RUNNING"]),
    ("stop", "restore", ["STOPPED", "PENDING", "LCM_INIT", "PROLOG_RESUME", "BOOT_STOPPED", "RUNNING"]),
])
def test_resume_brings_a_vm_back_through_its_boot_state(backend: Backend, down, driver, path) -> None:
    vm_id = backend.running(name="back")
    backend.action(down, vm_id)
    backend.wait(vm_id, path[0])
    with backend.slow(1.0, driver):
        assert backend.action("resume", vm_id)[:2] == [True, vm_id]
        vm, seen = backend.wait(vm_id, "RUNNING")
    assert in_order(seen, path) and path[-2] in seen, seen
    assert (vm.STATE, vm.LCM_STATE) == (3, 3)


def test_instantiate_on_hold_then_release(backend: Backend) -> None:
    vm_id = backend.instantiate(name="held", hold=True)
    vm = backend.vm(vm_id)
    assert (vm.STATE, vm.LCM_STATE) == (2, 0)  # HOLD
    assert vm.TEMPLATE["NIC"]["IP"]  # leased at instantiate, on hold too
    assert vm_id not in backend.gpus().values()
    assert backend.action("release", vm_id)[:2] == [True, vm_id]
    _, seen = backend.wait(vm_id, "RUNNING")
    assert in_order(seen, ["PENDING", "LCM_INIT", "PROLOG", "BOOT", "RUNNING"]), seen


def test_failed_boot_is_boot_failure_and_recover_delete_ends_it(backend: Backend) -> None:
    with backend.failing_boots():
        vm_id = backend.instantiate(name="fails")
        vm, _ = backend.wait(vm_id, "BOOT_FAILURE")
    print(f"{backend.name}: ERROR of a failed boot {vm.USER_TEMPLATE.get('ERROR')!r}")
    assert re.fullmatch(DATED, vm.USER_TEMPLATE["ERROR"]) and ": DEPLOY: " in vm.USER_TEMPLATE["ERROR"]
    assert (vm.STATE, vm.LCM_STATE) == (3, 36)
    [parsed] = vms_from_xml(backend.pool_text())
    assert parsed.failed and not parsed.running
    assert vm_id in backend.gpus().values()  # a failed VM keeps its host share until it is cleaned up
    assert backend.as_admin("one.vm.recover", vm_id, 3)[:2] == [True, vm_id]  # ADMIN_OPERATIONS, see RECOVER
    vm, _ = backend.wait(vm_id, "DONE")
    assert (vm.STATE, vm.LCM_STATE) == (6, 0)
    assert vm_id not in backend.gpus().values()


# recover is an ADMIN operation in oned.conf's stock VM_ADMIN_OPERATIONS: a plain user's is refused (below); the
# tests of what it does call it as oneadmin.
RECOVER_REFUSED = "[one.vm.recover] User [{uid}] : Not authorized to perform ADMIN VM [{vm}]."


def test_recover_delete_of_a_running_vm(backend: Backend) -> None:
    vm_id = backend.running(name="gone")
    if not backend.administrator():
        assert backend.raw("one.vm.recover", vm_id, 3)[:3] == [
            False, RECOVER_REFUSED.format(uid=backend.uid(), vm=vm_id), AUTHORIZATION]
    assert backend.as_admin("one.vm.recover", vm_id, 3)[:2] == [True, vm_id]
    backend.wait(vm_id, "DONE")
    assert vm_id not in backend.gpus().values()


# The actions refused in each state the product meets, with the state name oned puts in the message.
REFUSALS = {
    "RUNNING": ("resume", "release", "hold"),
    "POWEROFF": ("poweroff", "poweroff-hard", "stop", "suspend", "hold", "release"),
    "UNDEPLOYED": ("poweroff", "undeploy", "stop", "suspend", "hold", "release"),
    "STOPPED": ("poweroff", "undeploy", "stop", "hold", "release"),
    "HOLD": ("poweroff", "undeploy", "resume", "stop", "hold"),
    "DONE": ("resume", "poweroff", "undeploy", "hold", "release"),
}
REACH = {"POWEROFF": "poweroff", "UNDEPLOYED": "undeploy", "STOPPED": "stop", "DONE": "terminate-hard"}


@pytest.mark.parametrize("state", list(REFUSALS))
def test_actions_refused_in_a_state(backend: Backend, state: str) -> None:
    vm_id = backend.instantiate(name="refuse", hold=state == "HOLD")
    if state != "HOLD":
        backend.wait(vm_id, "RUNNING")
    if state in REACH:
        backend.action(REACH[state], vm_id)
        backend.wait(vm_id, state)
    answers = {action: backend.action(action, vm_id) for action in REFUSALS[state]}
    assert {a: refused(answer, a, state) for a, answer in answers.items()} == dict.fromkeys(answers, True), answers
    assert state_str(backend.vm(vm_id)) == state  # nothing moved


def test_a_booting_vm_refuses_terminate_and_recover_delete_drops_it(backend: Backend) -> None:
    # What the product's remove_vm and suspend rely on: terminate is refused in a transient state, and
    # recover --delete frees the VM and its GPU there. The VM boots from POWEROFF (BOOT_POWEROFF): a first
    # boot (BOOT) belongs to a scheduler placement plan, and deleting it mid-deploy stalled real oned 7.0.2's
    # scheduler for about 5 minutes ("Cannot add plan. A placement plan is already in progress."), which
    # would starve every later test of the shared instance. See docs/OPENNEBULA-FIDELITY.md.
    vm_id = backend.running(name="booting")
    backend.action("poweroff", vm_id)
    backend.wait(vm_id, "POWEROFF")
    with backend.slow(4.0, "deploy"):
        backend.action("resume", vm_id)
        backend.wait(vm_id, "BOOT_POWEROFF")
        answers = {action: backend.action(action, vm_id) for action in ("terminate", "terminate-hard")}
        print(f"{backend.name}: terminate in BOOT_POWEROFF -> {answers}")
        for action, answer in answers.items():
            assert answer == [False, f"[one.vm.action] Error performing action \"{action}\": Could not "
                                     f"terminate VM {vm_id}, wrong state BOOT_POWEROFF.", REFUSED, -1, -1], answer
        assert refused(backend.action("poweroff", vm_id), "poweroff", "BOOT_POWEROFF")
        assert backend.as_admin("one.vm.recover", vm_id, 3)[:2] == [True, vm_id]  # ADMIN_OPERATIONS
        vm, seen = backend.wait(vm_id, "DONE")
    print(f"{backend.name}: recover --delete in BOOT_POWEROFF passes {seen}")
    assert (vm.STATE, vm.LCM_STATE) == (6, 0)
    backend.wait_gpus_free()


def test_a_first_boot_refuses_terminate_until_running_then_terminate_hard_ends_it(backend: Backend) -> None:
    # What the product's removal of a booting VM relies on (operation.remove_vm): a first boot (BOOT) refuses
    # terminate and terminate-hard, BOOT ends by itself when the driver's deploy answers, and terminate-hard
    # then ends the VM, frees its GPU and leaves the scheduler placing the next VM. (recover --delete in
    # BOOT instead stalls real oned's scheduler for ACTION_TIMEOUT, 300 s: see docs/OPENNEBULA-FIDELITY.md.)
    with backend.slow(2.0, "deploy"):
        vm_id = backend.instantiate(name="firstboot")
        backend.wait(vm_id, "BOOT")
        booted = time.monotonic()
        answers = {action: backend.action(action, vm_id) for action in ("terminate-hard", "terminate")}
        for action, answer in answers.items():
            assert answer == [False, f"[one.vm.action] Error performing action \"{action}\": Could not "
                                     f"terminate VM {vm_id}, wrong state BOOT.", REFUSED, -1, -1], answer
        backend.wait(vm_id, "RUNNING")
    print(f"{backend.name}: BOOT (deploy slowed to 2 s) left after {time.monotonic() - booted:.2f} s")
    assert backend.action("terminate-hard", vm_id)[:2] == [True, vm_id]
    stopped = time.monotonic()
    vm, seen = backend.wait(vm_id, "DONE")
    print(f"{backend.name}: terminate-hard of the booted VM: {seen} in {time.monotonic() - stopped:.2f} s")
    assert (vm.STATE, vm.LCM_STATE) == (6, 0)
    backend.wait_gpus_free()
    placed = time.monotonic()
    backend.running(name="next")  # the scheduler is not stalled
    print(f"{backend.name}: the next VM RUNNING {time.monotonic() - placed:.2f} s after instantiate")


def test_an_unslowed_first_boot_is_short(backend: Backend) -> None:
    # A first boot with the dummy driver's own deploy (nothing slowed) passes its states by itself; the time
    # it takes is printed for docs/OPENNEBULA-FIDELITY.md (on a real hypervisor BOOT lasts as long as deploy).
    vm_id = backend.instantiate(name="quickboot")
    backend.wait(vm_id, lambda vm: state_str(vm) in ("LCM_INIT", "PROLOG", "BOOT", "RUNNING"), interval=0.005)
    started = time.monotonic()
    _, seen = backend.wait(vm_id, "RUNNING", interval=0.005)
    took = time.monotonic() - started
    print(f"{backend.name}: dispatched -> RUNNING in {took:.3f} s, seen {seen}")
    assert in_order(seen, ["LCM_INIT", "PROLOG", "BOOT", "RUNNING"]), (seen, took)


def test_terminate_of_a_done_vm(backend: Backend) -> None:
    vm_id = backend.running(template=backend.cpu_template, name="twice")
    backend.action("terminate-hard", vm_id)
    backend.wait(vm_id, "DONE")
    assert backend.action("terminate", vm_id)[:3] == [True, vm_id, 0]  # a no-op that succeeds
    assert state_str(backend.vm(vm_id)) == "DONE"


# ---- PCI accounting ----------------------------------------------------------------------------------------


def _vm_pci(backend: Backend, vm_id: int) -> dict[str, str]:
    pci = backend.vm(vm_id).TEMPLATE["PCI"]
    assert isinstance(pci, dict), pci
    return pci


def test_running_vm_holds_one_hosts_device(backend: Backend) -> None:
    vm_id = backend.running(name="pci")
    pci = _vm_pci(backend, vm_id)
    held = [key for key, holder in backend.gpus().items() if holder == vm_id]
    [parsed] = vms_from_xml(backend.pool_text())
    assert held == [(parsed.host, pci["SHORT_ADDRESS"])]
    bus, slot_function = pci["SHORT_ADDRESS"].split(":")
    assert pci["ADDRESS"] == f"0000:{bus}:{slot_function.replace('.', ':')}"  # 0000:02:00:0 for 02:00.0
    assert (pci["VENDOR"], pci["CLASS"]) == ("10de", "0302")


def test_poweroff_keeps_the_device_and_undeploy_frees_it(backend: Backend) -> None:
    vm_id = backend.running(name="keep")
    where = [key for key, holder in backend.gpus().items() if holder == vm_id]
    backend.action("poweroff", vm_id)
    backend.wait(vm_id, "POWEROFF")
    assert [key for key, holder in backend.gpus().items() if holder == vm_id] == where
    assert "ADDRESS" in _vm_pci(backend, vm_id)
    backend.action("undeploy", vm_id)
    backend.wait(vm_id, "UNDEPLOYED")
    assert vm_id not in backend.gpus().values()
    pci = _vm_pci(backend, vm_id)
    assert "ADDRESS" not in pci and (pci["VENDOR"], pci["CLASS"]) == ("10de", "0302"), pci


# ---- no capacity -----------------------------------------------------------------------------------------

DATED = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}: .+"  # oned's one_util::log_time, then ": "
SCHED_TEXTS = {  # what each release says when no GPU is free (the hosts' ids end it)
    "7.0.2": "Cannot allocate VM. Not enough capacity in hosts 0,1,2,3",
    "7.4.0": "[HOST] Unavailable PCI devices on hosts: 0,1,2,3",
}


def _sched_message(vm: object) -> str:
    return str(getattr(vm, "USER_TEMPLATE", {}).get("SCHED_MESSAGE", ""))


def test_no_free_gpu_leaves_a_vm_pending_with_a_sched_message_until_one_frees(backend: Backend) -> None:
    filled = fill_gpus(backend)
    extra = backend.instantiate(name="waits")
    vm, _ = backend.wait(extra, lambda vm: bool(_sched_message(vm)))
    message = _sched_message(vm)
    print(f"{backend.name}: SCHED_MESSAGE {message!r}")
    assert (vm.STATE, vm.LCM_STATE) == (1, 0)
    assert re.fullmatch(DATED, message), message
    assert re.search(r"hosts:? 0,1,2,3$", message), message  # release-independent: the hosts tried
    version = tuple(int(p) for p in backend.one.system.version().split(".")[:2])
    assert message.endswith(SCHED_TEXTS["7.4.0" if version >= (7, 4) else "7.0.2"]), message
    [parsed] = [v for v in vms_from_xml(backend.pool_text()) if v.id == extra]
    assert parsed.sched_message == message and parsed.starting and parsed.host is None
    backend.action("terminate-hard", filled[0])
    vm, _ = backend.wait(extra, "RUNNING", timeout=30)  # real oned retries every SCHED_RETRY_TIME (5 s)
    assert "SCHED_MESSAGE" not in vm.USER_TEMPLATE


def test_hold_and_release_of_a_pending_vm(backend: Backend) -> None:
    fill_gpus(backend)
    extra = backend.instantiate(name="waits")
    assert state_str(backend.vm(extra)) == "PENDING"
    assert backend.action("hold", extra)[:2] == [True, extra]
    assert state_str(backend.vm(extra)) == "HOLD"
    assert backend.action("release", extra)[:2] == [True, extra]
    assert state_str(backend.vm(extra)) == "PENDING"


def test_undeploy_gives_the_gpu_to_a_pending_vm(backend: Backend) -> None:
    filled = fill_gpus(backend)
    extra = backend.instantiate(name="waits")
    backend.action("poweroff", filled[0])
    backend.wait(filled[0], "POWEROFF")
    assert filled[0] in backend.gpus().values() and state_str(backend.vm(extra)) == "PENDING"
    backend.action("undeploy", filled[0])
    backend.wait(extra, "RUNNING", timeout=30)
    assert filled[0] not in backend.gpus().values()


# ---- direct placement: hold, one.vm.deploy and its right ---------------------------------------------




def host_ids(backend: Backend) -> list[int]:
    ok, body, *_ = backend.as_admin("one.hostpool.info")  # every host, whatever the user's ACLs show it
    assert ok, body
    return sorted(h.id for h in hosts_from_xml(body))


def holder(backend: Backend, host: int) -> int:
    """The VM holding the host's GPU (-1: free)."""
    [held] = [vm for (name, _), vm in backend.gpus().items() if name == f"gpu-host-{host + 1:02d}"]
    return held


def deploy(backend: Backend, vm_id: int, host: int, enforce: bool = True, ds: int = -1) -> list[object]:
    return backend.raw("one.vm.deploy", vm_id, host, enforce, ds)


def test_a_vm_instantiated_on_hold_waits_and_carries_what_placing_it_needs(backend: Backend) -> None:
    vm_id = backend.instantiate(name="held", hold=True)
    assert state_str(backend.vm(vm_id)) == "HOLD"
    needs = vm_needs_from_xml(backend.raw("one.vm.info", vm_id)[1])
    print(f"{backend.name}: AUTOMATIC_REQUIREMENTS {needs.requirements!r}, DS {needs.ds_requirements!r}")
    assert (needs.cpu, needs.memory_kb) == (10, 128 * 1024)  # CPU 0.1, MEMORY 128 of the template
    assert [(p.vendor, p.klass) for p in needs.pci] == [("10de", "0302")]
    assert "CLUSTER_ID = 0" in needs.requirements and "PIN_POLICY = PINNED" in needs.requirements
    assert needs.ds_requirements == '("CLUSTERS/ID" @> 0)'


def test_deploy_with_enforce_runs_the_vm_on_that_host_with_its_device(backend: Backend) -> None:
    host = host_ids(backend)[2]
    vm_id = backend.instantiate(name="placed", hold=True)
    assert deploy(backend, vm_id, host)[:2] == [True, vm_id]
    _, seen = backend.wait(vm_id, "RUNNING")
    assert "HOLD" not in seen[1:] and "PENDING" not in seen, seen  # no scheduler in between
    [parsed] = [v for v in vms_from_xml(backend.pool_text()) if v.id == vm_id]
    assert parsed.host == f"gpu-host-{host + 1:02d}" and parsed.gpus and not parsed.without_devices
    assert holder(backend, host) == vm_id  # oned's own accounting: the host's device names the VM


def full_host(backend: Backend, index: int) -> tuple[int, int]:
    """(host, the VM now holding its one GPU): a VM on hold deployed there, RUNNING."""
    host = host_ids(backend)[index]
    first = backend.instantiate(name="first", hold=True)
    assert deploy(backend, first, host)[0] is True
    backend.wait(first, "RUNNING")
    return host, first


def test_deploy_with_enforce_to_a_full_host_is_refused_and_the_vm_stays_on_hold(backend: Backend) -> None:
    host, first = full_host(backend, 0)
    second = backend.instantiate(name="second", hold=True)
    answer = deploy(backend, second, host)
    assert answer[:3] == [False, f"[one.vm.deploy] virtual machine [{second}] does not fit in host [{host}]. "
                          "Unavailable PCI device.", REFUSED], answer
    assert state_str(backend.vm(second)) == "HOLD" and holder(backend, host) == first


def test_deploy_with_enforce_of_a_vm_asking_too_much_cpu_names_both_figures(backend: Backend) -> None:
    ok, tid, *_ = backend.raw("one.template.allocate", 'NAME = "contract-huge"\nCPU = "1000"\nMEMORY = "64"\n')
    assert ok, tid
    backend.cleanup(lambda: backend.raw("one.template.delete", tid, False))
    vm_id = backend.instantiate(template=tid, name="huge", hold=True)
    answer = deploy(backend, vm_id, host_ids(backend)[0])
    print(f"{backend.name}: {answer[1]}")
    assert answer[0] is False and answer[2] == REFUSED
    assert re.fullmatch(rf"\[one\.vm\.deploy\] virtual machine \[{vm_id}\] does not fit in host \[\d+\]\. "
                        r"Not enough CPU: 100000/\d+", answer[1]), answer


def test_deploy_without_enforce_to_a_full_host_runs_the_vm_without_a_device(backend: Backend) -> None:
    host, first = full_host(backend, 1)
    second = backend.instantiate(name="second", hold=True)
    assert deploy(backend, second, host, enforce=False)[:2] == [True, second]
    backend.wait(second, "RUNNING")
    [parsed] = [v for v in vms_from_xml(backend.pool_text()) if v.id == second]
    assert parsed.without_devices and holder(backend, host) == first


def test_deploy_refusals_name_what_is_wrong(backend: Backend) -> None:
    held = backend.instantiate(name="held", hold=True)
    running = backend.running(name="running")
    assert deploy(backend, held, 99999) == [False, "[one.vm.deploy] Error getting host [99999].", NO_EXISTS, 99999, -1]
    assert deploy(backend, held, 0, True, 99)[:3] == [False, "[one.vm.deploy] Error getting datastore [99].",
                                                      NO_EXISTS]
    assert deploy(backend, running, 0)[:3] == [False, "[one.vm.deploy] Deploy action is not available for state "
                                                      "RUNNING", REFUSED]
    assert state_str(backend.vm(held)) == "HOLD"


@pytest.mark.parametrize(("status", "accepted"), [(1, True), (2, False)])
def test_a_disabled_host_is_deployed_to_an_offline_one_refused(backend: Backend, status: int,
                                                               accepted: bool) -> None:
    """oned only refuses an OFFLINE host: a host disabled after a client read the pool still gets its VM."""
    host = host_ids(backend)[3]
    assert backend.as_admin("one.host.status", host, status)[0] is True
    backend.cleanup(lambda: backend.enable_host(host))
    vm_id = backend.instantiate(name="onto", hold=True)
    answer = deploy(backend, vm_id, host)
    if accepted:
        assert answer[:2] == [True, vm_id]
        backend.wait(vm_id, "RUNNING")
    else:
        assert answer[:3] == [False, "[one.vm.deploy] Host is offline, cannot use it to deploy VM", REFUSED]
        assert state_str(backend.vm(vm_id)) == "HOLD"


def _deploy_right(plain: Backend) -> str:
    """The deploy level the product reads from the plain user's documents."""
    cloud = OneCloud(OneConfig(endpoint=plain.endpoint, auth_file=Path("/dev/null"), session=plain.auth))
    rights = cloud.rights()
    return deploy_level(rights.user, rights.group, rights.system)


@pytest.mark.parametrize("whose", ["user", "group"])
def test_deploy_is_an_admin_operation_a_user_or_group_template_makes_it_manage(backend: Backend,
                                                                              whose: str) -> None:
    with backend.plain_user() as (plain, grant_user, grant_group):
        uid = int(ET.fromstring(plain.raw("one.user.info", -1)[1]).findtext("ID") or -1)
        vm_id = plain.instantiate(name="plain", hold=True)
        answer = deploy(plain, vm_id, host_ids(backend)[0])
        assert answer[:3] == [False, f"[one.vm.deploy] User [{uid}] : Not authorized to perform ADMIN VM "
                              f"[{vm_id}].", AUTHORIZATION], answer
        assert _deploy_right(plain) == "ADMIN"
        (grant_user if whose == "user" else grant_group)('VM_MANAGE_OPERATIONS = "deploy"')
        assert _deploy_right(plain) == "MANAGE"
        assert deploy(plain, vm_id, host_ids(backend)[0])[:2] == [True, vm_id]
        plain.wait(vm_id, "RUNNING")


def test_two_deploys_to_one_last_device_at_once_never_give_it_twice(backend: Backend) -> None:
    """Real oned tests the room at the call and takes it later (LifeCycleManager::trigger_deploy): several
    deploys to the last device at once may all be accepted, and the VMs that lost run without it."""
    host = host_ids(backend)[0]
    ids = [backend.instantiate(name=f"race{i}", hold=True) for i in range(4)]
    answers: dict[int, list[object]] = {}
    threads = [threading.Thread(target=lambda v=vm_id: answers.__setitem__(v, deploy(backend, v, host)))
               for vm_id in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    accepted = [v for v in ids if answers[v][0] is True]
    for vm_id in accepted:
        backend.wait(vm_id, "RUNNING")
    print(f"{backend.name}: {len(accepted)} of 4 deploys to the last device accepted")
    parsed = {v.id: v for v in vms_from_xml(backend.pool_text())}
    with_device = [v for v in accepted if not parsed[v].without_devices]
    assert with_device == [holder(backend, host)]  # one VM has the device, as oned's host share says
    assert all(state_str(backend.vm(v)) == "HOLD" for v in ids if v not in accepted)


# ---- the IP lease ------------------------------------------------------------------------------------------


def _leases(backend: Backend) -> dict[str, int]:
    ok, body, *_ = backend.raw("one.vn.info", 0, False)
    assert ok, body
    return {lease.findtext("IP") or "": int(lease.findtext("VM") or -1)
            for lease in ET.fromstring(body).iterfind("AR_POOL/AR/LEASES/LEASE")}


def test_ip_is_leased_while_pending_and_released_at_done(backend: Backend) -> None:
    fill_gpus(backend)
    extra = backend.instantiate(name="waits")
    vm = backend.vm(extra)
    ip = vm.TEMPLATE["NIC"]["IP"]
    assert state_str(vm) == "PENDING" and ip and _leases(backend).get(ip) == extra
    [parsed] = [v for v in vms_from_xml(backend.pool_text()) if v.id == extra]
    assert parsed.ip == ip
    backend.action("terminate", extra)
    backend.wait(extra, "DONE")
    assert ip not in _leases(backend)
    assert backend.vm(extra).TEMPLATE["NIC"]["IP"] == ip  # the DONE VM's record keeps it


# ---- CONTEXT at instantiate ----------------------------------------------------------------------------


def _context(backend: Backend, vm_id: int) -> dict[str, str]:
    context = backend.vm(vm_id).TEMPLATE["CONTEXT"]
    assert isinstance(context, dict)
    return {k: str(v) for k, v in context.items()}


def test_context_in_the_extra_template_replaces_the_templates_context(backend: Backend) -> None:
    vm_id = backend.instantiate(name="ctx", hold=True, extra='CONTEXT = [ ONLY_THIS = "1" ]')
    context = _context(backend, vm_id)
    print(f"{backend.name}: CONTEXT of a replaced context: {sorted(context)}")
    assert context["ONLY_THIS"] == "1"
    assert not {"SET_HOSTNAME", "REPORT_READY", "NETWORK", "TOKEN", "ETH0_IP", "ONEGATE_ENDPOINT"} & set(context)


# VirtualMachineContext.cc NETWORK_CONTEXT + NETWORK6_CONTEXT (ROUTES from 7.4 on), as real oned shows them
ETH0_KEYS = ("IP", "MAC", "MASK", "NETWORK", "GATEWAY", "DNS", "SEARCH_DOMAIN", "MTU", "METRIC", "METHOD", "VLAN_ID",
             "VROUTER_IP", "VROUTER_MANAGEMENT", "EXTERNAL", "ROUTES", "IP6", "IP6_ULA", "IP6_GATEWAY", "IP6_METRIC",
             "IP6_METHOD", "IP6_PREFIX_LENGTH", "VROUTER_IP6")


def test_context_the_product_sends_is_kept_and_oned_adds_network_token_and_vmid(backend: Backend) -> None:
    template_context = backend.one.template.info(backend.gpu_template).TEMPLATE["CONTEXT"]
    extra = extra_template("c1", "gpu01", [42], template_context)
    vm_id = backend.instantiate(name="gpu01", hold=True, extra=extra)
    vm = backend.vm(vm_id)
    context = _context(backend, vm_id)
    print(f"{backend.name}: CONTEXT {dict(sorted(context.items()))}; USER_TEMPLATE keys {sorted(vm.USER_TEMPLATE)}")
    eth0 = {k for k in context if k.startswith("ETH0_")}
    version = tuple(int(p) for p in backend.one.system.version().split(".")[:2])
    assert eth0 == {f"ETH0_{k}" for k in ETH0_KEYS if k != "ROUTES" or version >= (7, 4)}, sorted(eth0)
    sent = {"NETWORK": "YES", "TOKEN": "YES", "REPORT_READY": "YES", "SET_HOSTNAME": "gpu01",
            "SLURM_NODENAME": "gpu01", "SLURM_CLUSTER": "c1"}
    assert {k: context.get(k) for k in sent} == sent
    assert (context["DISK_ID"], context["TARGET"]) == ("0", "hda")  # the context CD, after the template's 0 disks
    nic = vm.TEMPLATE["NIC"]
    assert (context["ETH0_IP"], context["ETH0_MAC"]) == (nic["IP"], nic["MAC"])
    assert context["ONEGATE_ENDPOINT"] == backend.onegate and context["VMID"] == str(vm_id)
    user = {k: str(v) for k, v in vm.USER_TEMPLATE.items()}
    assert (user["SLURM_CLUSTER"], user["SLURM_NODENAME"], user["SLURM_JOB_IDS"]) == ("c1", "gpu01", "42")
    assert "SLURM_NEBULA_POWER" in user and "CONTEXT" not in user
    [parsed] = vms_from_xml(backend.pool_text())
    assert parsed.is_ours("c1", "gpu01") and parsed.context["SLURM_NODENAME"] == "gpu01"


def test_template_variables_in_context_are_substituted(backend: Backend) -> None:
    vm_id = backend.instantiate(name="subst", hold=True)  # the template's SET_HOSTNAME = "$NAME"
    assert _context(backend, vm_id)["SET_HOSTNAME"] == "subst"


# ---- USER_TEMPLATE updates -------------------------------------------------------------------------------


def test_update_type_1_merges_and_type_0_replaces_the_user_template(backend: Backend) -> None:
    vm_id = backend.instantiate(name="upd", hold=True, extra='KEEP = "k"\nCHANGE = "old"')
    assert backend.raw("one.vm.update", vm_id, 'CHANGE = "new"\nADDED = "a"', 1)[:2] == [True, vm_id]
    user = backend.vm(vm_id).USER_TEMPLATE
    assert (user["KEEP"], user["CHANGE"], user["ADDED"]) == ("k", "new", "a")
    assert backend.raw("one.vm.update", vm_id, 'ONLY = "o"', 0)[:2] == [True, vm_id]
    user = backend.vm(vm_id).USER_TEMPLATE
    print(f"{backend.name}: USER_TEMPLATE after a type 0 update: {dict(user)}")
    assert "ONLY" in user and not {"KEEP", "CHANGE", "ADDED"} & set(user)
    assert _context(backend, vm_id)["SET_HOSTNAME"] == "upd"  # TEMPLATE untouched


# ---- OneGate ---------------------------------------------------------------------------------------------


def test_onegate_put_writes_only_the_user_template(backend: Backend) -> None:
    extra = extra_template("c1", "gpu02", [], backend.one.template.info(backend.gpu_template).TEMPLATE["CONTEXT"])
    vm_id = backend.running(name="gpu02", extra=extra)
    body = "READY=YES\nCONTEXT=[SLURM_NODENAME=evil]\nNAME=renamed\nSLURM_X=1"  # bare values, as `onegate` sends
    assert backend.put_vm(vm_id, backend.token(vm_id), body) == 200
    vm = backend.vm(vm_id)
    user = vm.USER_TEMPLATE
    assert (user["READY"], user["NAME"], user["SLURM_X"]) == ("YES", "renamed", "1")
    assert user["CONTEXT"]["SLURM_NODENAME"] == "evil"
    assert vm.NAME == "gpu02" and _context(backend, vm_id)["SLURM_NODENAME"] == "gpu02"
    [parsed] = vms_from_xml(backend.pool_text())
    assert parsed.ready and parsed.is_ours("c1", "gpu02")


@pytest.mark.parametrize("off", ["poweroff", "undeploy"])
def test_ready_outlives_the_boot_that_reported_it_until_an_update_clears_it(backend: Backend, off: str) -> None:
    """What resume's clear_stale rests on: oned keeps a guest's READY=YES while the VM is off, and a merge
    update of a VM that is off replaces it."""
    extra = extra_template("c1", "gpu01", [], backend.one.template.info(backend.gpu_template).TEMPLATE["CONTEXT"])
    vm_id = backend.running(name="gpu01", extra=extra)
    assert backend.put_vm(vm_id, backend.token(vm_id), "READY=YES") == 200
    backend.action(off, vm_id)
    backend.wait(vm_id, {"poweroff": "POWEROFF", "undeploy": "UNDEPLOYED"}[off])
    assert backend.vm(vm_id).USER_TEMPLATE["READY"] == "YES"
    assert backend.raw("one.vm.update", vm_id, 'READY = "NO"', 1)[:2] == [True, vm_id]
    [parsed] = vms_from_xml(backend.pool_text())
    assert not parsed.ready and parsed.user_template["READY"] == "NO"


def test_a_guest_writes_sched_message_and_resumes_merge_clears_it(backend: Backend) -> None:
    """What resume's clear_stale rests on: OneGate lets a guest write SCHED_MESSAGE (the scheduler's reason a
    PENDING VM is not placed), oned keeps it while the VM is undeployed, and stale_update's merge empties it."""
    extra = extra_template("c1", "gpu01", [], backend.one.template.info(backend.gpu_template).TEMPLATE["CONTEXT"])
    vm_id = backend.running(name="gpu01", extra=extra)
    planted = "Cannot dispatch VM: PCI planted"
    assert backend.put_vm(vm_id, backend.token(vm_id), f"READY=YES\nSCHED_MESSAGE={planted}") == 200
    backend.action("undeploy", vm_id)
    backend.wait(vm_id, "UNDEPLOYED")
    [parsed] = vms_from_xml(backend.pool_text())
    assert parsed.sched_message == planted and parsed.ready
    assert backend.raw("one.vm.update", vm_id, stale_update(True, True), 1)[:2] == [True, vm_id]
    [parsed] = vms_from_xml(backend.pool_text())
    assert (parsed.ready, parsed.sched_message) == (False, "")


def test_onegate_refuses_a_wrong_token(backend: Backend) -> None:
    vm_id = backend.running(template=backend.cpu_template, name="guest")
    assert backend.put_vm(vm_id, "0" * 32, "READY=YES") == 401
    assert "READY" not in backend.vm(vm_id).USER_TEMPLATE


# ---- pool queries ----------------------------------------------------------------------------------------


def test_pool_filter_flags_and_states(backend: Backend) -> None:
    mine = backend.running(template=backend.cpu_template, name="mine")
    theirs = backend.foreign_vm()
    done = backend.running(template=backend.cpu_template, name="done")
    backend.action("terminate-hard", done)
    backend.wait(done, "DONE")

    def ids(who: int, state: int) -> set[int]:
        return {vm.id for vm in vms_from_xml(backend.pool_text(who, state))} & {mine, theirs, done}

    assert ids(-3, -1) == {mine}  # my VMs, not DONE
    # everyone's that the user may use: an administrator's every VM, a plain user's own (theirs is not shared)
    assert ids(-2, -1) == ({mine, theirs} if backend.administrator() else {mine})
    assert ids(-1, -1) == {mine}  # mine and my group's (the other VM is in group users)
    assert ids(-3, -2) == {mine, done}  # DONE included
    assert ids(-2, 6) == {done}  # an exact state


def test_pool_id_range_from_an_id_up(backend: Backend) -> None:
    """resume reads only the VMs it has in flight: the range (first_id, -1) is every id from first_id up."""
    older = backend.instantiate(template=backend.cpu_template, name="older", hold=True)
    newer = backend.instantiate(template=backend.cpu_template, name="newer", hold=True)
    ok, body, *_ = backend.raw("one.vmpool.infoextended", -3, newer, -1, -1)
    assert ok, body
    ids = {vm.id for vm in vms_from_xml(str(body))}
    assert newer in ids and older not in ids
    ok, body, *_ = backend.raw("one.vmpool.infoextended", -3, older, -1, -1)
    assert {older, newer} <= {vm.id for vm in vms_from_xml(str(body))}


def test_pool_info_short_body_lacks_pci_and_context(backend: Backend) -> None:
    vm_id = backend.running(name="short", extra='TAG = "x"')
    short = next(vm for vm in ET.fromstring(backend.pool_text(extended=False)) if vm.findtext("ID") == str(vm_id))
    full = next(vm for vm in ET.fromstring(backend.pool_text()) if vm.findtext("ID") == str(vm_id))
    for path in ("TEMPLATE/PCI", "TEMPLATE/CONTEXT", "USER_TEMPLATE/TAG"):
        assert short.find(path) is None and full.find(path) is not None, path
    assert short.findtext("TEMPLATE/NIC/IP") == full.findtext("TEMPLATE/NIC/IP") is not None
    assert (short.findtext("STATE"), short.findtext("LCM_STATE")) == ("3", "3")


# ---- errors ----------------------------------------------------------------------------------------------


def test_bad_session_is_authentication_256(backend: Backend) -> None:
    answer = backend.raw("one.vm.info", 0, session="oneadmin:wrong-password")
    assert answer[:3] == [False, "[one.vm.info] User couldn't be authenticated, aborting call.", 0x100]


def test_missing_template_and_vm_are_no_exists_1024(backend: Backend) -> None:
    assert backend.raw("one.template.instantiate", 99999, "", False, "", False)[:3] == [
        False, "[one.template.instantiate] Error getting virtual machine template [99999].", 0x400]
    assert backend.raw("one.vm.info", 99999) == [  # all 5: the object's id, then the replication index
        False, "[one.vm.info] Error getting virtual machine [99999].", 0x400, 99999, -1]
    assert backend.raw("one.vm.action", "terminate", 99999)[:3] == [
        False, "[one.vm.action] Error getting virtual machine [99999].", 0x400]


def test_unknown_action_is_refused(backend: Backend) -> None:
    vm_id = backend.instantiate(name="x", hold=True)
    assert backend.action("explode", vm_id)[:3] == [False, '[one.vm.action] Action "explode" is not supported',
                                                    REFUSED]


def test_onegate_quotes_bare_values_so_a_spaced_template_fails(backend: Backend) -> None:
    vm_id = backend.running(template=backend.cpu_template, name="guest")
    assert backend.put_vm(vm_id, backend.token(vm_id), 'READY = "YES"') == 500  # becomes READY =" "YES""
    assert backend.put_vm(vm_id, backend.token(vm_id), "NOTE=two words") == 200  # becomes NOTE="two words"
    assert backend.vm(vm_id).USER_TEMPLATE["NOTE"] == "two words"


@pytest.mark.parametrize("attribute", ["SCHED_REQUIREMENTS", "SERVICE_ID", "ROLE_NAME"])
def test_onegate_refuses_restricted_attributes(backend: Backend, attribute: str) -> None:
    vm_id = backend.running(template=backend.cpu_template, name="guest")
    assert backend.put_vm(vm_id, backend.token(vm_id), f"{attribute}=1") == 403
    assert attribute not in backend.vm(vm_id).USER_TEMPLATE


# ---- quota -----------------------------------------------------------------------------------------------

QUOTA = re.compile(r"\[one\.template\.instantiate\] User \[(\d+)\] : user \[\1\] limit of \d+ reached for "
                   r"(RUNNING_)?VMS quota in VM\.")


def test_instantiate_over_the_vm_quota_is_authorization_512(backend: Backend) -> None:
    session = backend.quota_session()
    answer = backend.raw("one.template.instantiate", backend.cpu_template, "quota", False, "", False,
                         session=session)
    print(f"{backend.name}: over quota -> {answer[:3]}")
    assert answer[0] is False and answer[2] == 0x200 and QUOTA.fullmatch(answer[1]), answer
    assert isinstance(translate(answer[1], answer[2]), QuotaExceeded)  # the product's class: not an auth failure


def test_resume_over_the_running_vms_quota_is_action_2048(backend: Backend) -> None:
    session = backend.quota_session(limit=None)  # no limit yet
    quota = dataclasses.replace(backend, auth=session)  # that user's VM, seen and acted on as that user
    vm_id = quota.instantiate(backend.cpu_template, name="resumer")
    quota.wait(vm_id, "RUNNING")
    quota.action("poweroff", vm_id)
    quota.wait(vm_id, "POWEROFF")
    backend.quota_session(limit='VM = [ RUNNING_VMS = "0" ]')  # now over it
    answer = backend.raw("one.vm.action", "resume", vm_id, session=session)
    print(f"{backend.name}: resume over quota -> {answer[:3]}")
    assert answer[0] is False and answer[2] == REFUSED, answer
    assert re.fullmatch(r"\[one\.vm\.action\] user \[\d+\] limit of \d+ reached for RUNNING_VMS quota in VM", answer[1])
    assert isinstance(translate(answer[1], answer[2]), QuotaExceeded)  # not an ordinary refused action
    assert state_str(quota.vm(vm_id)) == "POWEROFF"


# ---- the product's own template ------------------------------------------------------------------------

NODESET = """
[[nodeset]]
nodes = "tg[01-02]"
template = "contract-worker"
vcpu = 1
cpu = 0.1
memory_mb = 128
gpus = 1
network = "slurm-net"
image = "contract-image"
controller = "127.0.0.1:6817"
munge_key_file = "{key}"
"""


def test_the_template_command_output_is_allocated_and_runs(backend: Backend, tmp_path, capsys) -> None:
    key = tmp_path / "munge.key"
    key.write_bytes(bytes(range(64)))
    key.chmod(0o400)
    setup = make_setup(tmp_path / "site", backend.endpoint, backend.auth, nodesets=NODESET.format(key=key))
    assert template_cmd.main([], setup.env) == EXIT_CONFIG  # no image of that name yet: refused, naming it
    assert 'nodeset[0].image: user ' in capsys.readouterr().err
    image = backend.image("contract-image")  # the user's own, READY (the dummy datastore's)
    assert template_cmd.main([], setup.env) == EXIT_OK  # the names, looked up as the user sees them, by id
    text = capsys.readouterr().out
    assert f'DISK = [ IMAGE_ID = "{image}" ]' in text and 'NIC = [ NETWORK_ID = "' in text
    ok, tid, *rest = backend.raw("one.template.allocate", text)
    assert ok, (tid, rest)
    backend.cleanup(lambda: backend.raw("one.template.delete", tid, False))
    vm_id = backend.instantiate(tid, name="tg01", extra=extra_template(
        "c1", "tg01", [], backend.one.template.info(tid).TEMPLATE["CONTEXT"]))
    backend.wait(vm_id, "RUNNING")
    context = _context(backend, vm_id)
    assert (context["SLURM_NODENAME"], context["SET_HOSTNAME"], context["SLURM_CONTROLLER"]) == (
        "tg01", "tg01", "127.0.0.1:6817")
    assert vm_id in backend.gpus().values()


# ---- names in a template: a network or an image is looked up among one owner's (issue 32) --------------------

NAMED = 'NAME = "{name}"\nCPU = "0.05"\nVCPU = "1"\nMEMORY = "64"\n{lines}\n'
BY_OWNER = 'NIC = [ NETWORK = "slurm-net", NETWORK_UNAME = "oneadmin" ]'
ALLOCATING = "[one.template.instantiate] Error allocating a new virtual machine template. "


def _template(backend: Backend, name: str, lines: str) -> int:
    """A template of the tests' user with these NIC and DISK lines, deleted by clean()."""
    ok, template_id, *rest = backend.raw("one.template.allocate", NAMED.format(name=name, lines=lines))
    assert ok, (template_id, rest)
    backend.cleanup(lambda: backend.raw("one.template.delete", template_id, False))
    return int(template_id)


def _owned(backend: Backend, method: str, who: int = -2) -> dict[str, Owned]:
    """one.vnpool.info or one.imagepool.info as the tests' user sees it, read by the product's parser."""
    ok, body, *_ = backend.raw(method, who, -1, -1)
    assert ok, body
    return {o.name: o for o in owned_from_xml(str(body), NETWORK if method == "one.vnpool.info" else IMAGE)}


def test_vnpool_lists_the_networks_a_plain_user_may_use_with_their_owner(backend: Backend) -> None:
    with backend.plain_user() as (plain, _, _):
        net = _owned(plain, "one.vnpool.info")["slurm-net"]
        assert (net.uid, net.uname) == (0, "oneadmin")
        assert _owned(plain, "one.vnpool.info", -3) == {}, "none is its own"
        cloud = OneCloud(OneConfig(endpoint=plain.endpoint, auth_file=Path("/dev/null"), session=plain.auth))
        assert net in cloud.networks()  # what template and check read


def test_a_nic_network_by_name_is_looked_up_among_the_instantiating_users_own(backend: Backend) -> None:
    # issue 32: `template` wrote NIC = [ NETWORK = "slurm-net" ] and every resume of the Slurm user failed
    with backend.plain_user() as (plain, _, _):
        uid, net = plain.uid(), _owned(plain, "one.vnpool.info")["slurm-net"]
        template_id = _template(plain, "contract-by-name", 'NIC = [ NETWORK = "slurm-net" ]')
        answer = plain.raw("one.template.instantiate", template_id, "by-name", True, "", False)
        print(f"{backend.name}: NIC by name of another owner -> {answer[:3]}")
        assert answer[:3] == [False, f"{ALLOCATING}User {uid} does not own a network with name: slurm-net . Set "
                              "NETWORK_UNAME or NETWORK_UID of owner in NIC.", ALLOCATE]
        assert cloud_reason(translate(answer[1], answer[2])) == (
            f"OpenNebula: template NIC: network slurm-net not owned by user {uid}; set NETWORK_UNAME or use "
            "NETWORK_ID (check says how)")
        missing = plain.raw("one.template.instantiate", template_id, "no-id", True, 'NIC = [ NETWORK_ID = "9999" ]',
                            False)
        assert missing[:3] == [False, f"{ALLOCATING}Virtual network with ID: 9999 does not exist", ALLOCATE]
        for nic in ('NETWORK = "slurm-net", NETWORK_UNAME = "oneadmin"', f'NETWORK_ID = "{net.id}"'):
            vm_id = plain.instantiate(template_id, name="resolved", hold=True, extra=f"NIC = [ {nic} ]")
            resolved = plain.vm(vm_id).TEMPLATE["NIC"]
            print(f"{backend.name}: NIC {nic} -> {dict(resolved)}")
            assert (str(resolved["NETWORK_ID"]), resolved["NETWORK"]) == (str(net.id), "slurm-net")
            assert resolved.get("NETWORK_UNAME") == ("oneadmin" if "UNAME" in nic else None), "kept as given only"


def test_a_disk_image_by_name_is_looked_up_among_the_users_own_and_needs_use(backend: Backend) -> None:
    with backend.plain_user() as (plain, _, _):
        uid = plain.uid()
        image_id = plain.image("contract-oneadmins", admin=True)  # oneadmin's, not shared (umask 177)
        assert "contract-oneadmins" not in _owned(plain, "one.imagepool.info")
        template_id = _template(plain, "contract-disk", f'{BY_OWNER}\nDISK = [ IMAGE = "contract-oneadmins" ]')
        answer = plain.raw("one.template.instantiate", template_id, "disk", True, "", False)
        print(f"{backend.name}: DISK by name of another owner -> {answer[:3]}")
        assert answer[:3] == [False, f"{ALLOCATING}DISK 0: User {uid} does not own an image with name: "
                              "contract-oneadmins . Set IMAGE_UNAME or IMAGE_UID of owner in DISK.", ALLOCATE]
        owner = 'DISK = [ IMAGE = "contract-oneadmins", IMAGE_UNAME = "oneadmin" ]'
        refused = f"User [{uid}] : Not authorized to perform USE IMAGE [{image_id}]."
        answer = plain.raw("one.template.instantiate", template_id, "disk", True, owner, False)
        assert answer[:3] == [False, f"[one.template.instantiate] {refused}", AUTHORIZATION], answer
        assert plain.raw("one.image.info", image_id)[:3] == [False, f"[one.image.info] {refused}", AUTHORIZATION]
        missing = plain.raw("one.template.instantiate", template_id, "disk", True, 'DISK = [ IMAGE_ID = "99999" ]',
                            False)
        assert missing[:3] == [False, f"{ALLOCATING}DISK 0: Image with ID: 99999 does not exist", ALLOCATE]
        plain.share_image(image_id)  # `oneimage chmod`: others may use it
        assert _owned(plain, "one.imagepool.info")["contract-oneadmins"] == Owned(image_id, "contract-oneadmins", 0,
                                                                                  "oneadmin")
        vm_id = plain.instantiate(template_id, name="disk", hold=True, extra=owner)
        assert state_str(plain.vm(vm_id)) == "HOLD"


def test_check_proves_a_template_as_a_plain_user_and_its_probe_leaves_nothing(backend: Backend, tmp_path) -> None:
    with backend.plain_user() as (plain, _, _):
        good = _template(plain, "contract-good", BY_OWNER)
        bad = _template(plain, "contract-bad", 'NIC = [ NETWORK = "slurm-net" ]')
        setup = make_setup(tmp_path / "site", plain.endpoint, plain.auth, nodesets=(
            f'[[nodeset]]\nnodes = "g[01-02]"\ntemplate = {good}\n\n[[nodeset]]\nnodes = "b[01-02]"\n'
            f"template = {bad}\n"))
        config = load_config(setup.config, setup.env)
        report = Report()
        cloud = OneCloud(config.opennebula, retry_seconds=0)
        check_template_use(report, config, cloud, instantiate=True)
        said = {(f.level, f.subject): f.text for f in report.findings}
        print(f"{backend.name}: {said}")
        assert ("ok", f"node set g[01-02] template {good} instantiate") in said
        assert ("problem", f"node set b[01-02] template {bad} NIC 0") in said
        assert "does not own a network with name: slurm-net" in said[("problem", f"node set b[01-02] template {bad} "
                                                                      "instantiate")]
        probes = [vm for vm in vms_from_xml(plain.pool_text(-3, -2)) if vm.name.startswith("slurm-nebula-power check")]
        assert len(probes) == 1 and probes[0].state == 6, "the one VM oned made, DONE at once"


# ---- hosts: attributes, SCHED_REQUIREMENTS, disable and offline (issue 26) -----------------------------------

def _hosts(backend: Backend) -> dict[str, ET.Element]:
    ok, body, *_ = backend.as_admin("one.hostpool.info")
    assert ok, body
    return {h.findtext("NAME") or "": h for h in ET.fromstring(body).iterfind("HOST")}


def _wait_monitored(backend: Backend) -> None:
    deadline = time.monotonic() + 60
    while any(h.findtext("STATE") != "2" for h in _hosts(backend).values()):
        assert time.monotonic() < deadline, {n: h.findtext("STATE") for n, h in _hosts(backend).items()}
        time.sleep(0.3)


def test_a_host_attribute_set_by_update_places_vms_through_sched_requirements(backend: Backend) -> None:
    hosts = _hosts(backend)
    name = sorted(hosts)[-1]
    host_id = int(hosts[name].findtext("ID") or -1)
    ok, answer, *_ = backend.as_admin("one.host.update", host_id, 'CONTRACT_DOMAIN = "nvl-x"', 1)  # --append
    backend.cleanup(lambda: backend.as_admin("one.host.update", host_id, 'CONTRACT_DOMAIN = ""', 1))
    assert ok and answer == host_id
    assert _hosts(backend)[name].findtext("TEMPLATE/CONTRACT_DOMAIN") == "nvl-x"
    assert _hosts(backend)[name].findtext("TEMPLATE/HOSTNAME"), "merged: the monitor's attributes kept"
    # the product's extra template with a domain's requirement (what resume sends)
    placed = backend.instantiate(extra=extra_template("contract", "dom1", [], {}, 'CONTRACT_DOMAIN = "nvl-x"'))
    backend.wait(placed, "RUNNING")
    [vm] = [v for v in vms_from_xml(backend.pool_text()) if v.id == placed]
    assert vm.host == name and vm.user_template["SCHED_REQUIREMENTS"] == 'CONTRACT_DOMAIN = "nvl-x"'
    # no host of that domain: PENDING, and oned says why (pending_timeout then hands the node back)
    nowhere = backend.instantiate(extra=extra_template("contract", "dom2", [], {}, 'CONTRACT_DOMAIN = "nvl-none"'))
    vm, _ = backend.wait(nowhere, lambda v: "SCHED_MESSAGE" in (v.USER_TEMPLATE or {}))
    assert re.fullmatch(DATED.replace(".+", "Cannot dispatch VM: No host meets SCHED_REQUIREMENTS"),
                        vm.USER_TEMPLATE["SCHED_MESSAGE"]), vm.USER_TEMPLATE["SCHED_MESSAGE"]
    [parsed] = [v for v in vms_from_xml(backend.pool_text()) if v.id == nowhere]
    assert parsed.unplaceable, "no dispatch wait: a shortage of hosts, judged at pending_timeout"


@pytest.mark.parametrize(("status", "state"), [(1, "4"), (2, "8")])
def test_a_disabled_or_offline_host_keeps_its_vm_and_takes_no_new_one(backend: Backend, status, state) -> None:
    vm_id = backend.running(name="stays")
    [vm] = [v for v in vms_from_xml(backend.pool_text()) if v.id == vm_id]
    hosts = _hosts(backend)
    host_id = int(hosts[vm.host].findtext("ID") or -1)
    backend.cleanup(lambda: _wait_monitored(backend))
    backend.cleanup(lambda: backend.as_admin("one.host.status", host_id, 0))  # onehost enable
    ok, answer, *_ = backend.as_admin("one.host.status", host_id, status)  # onehost disable / offline
    assert ok and answer == host_id
    assert _hosts(backend)[vm.host].findtext("STATE") == state
    time.sleep(6)  # a monitoring pass and a scheduler retry
    assert state_str(backend.vm(vm_id)) == "RUNNING", "its VM keeps running"
    assert [v.host for v in vms_from_xml(backend.pool_text()) if v.id == vm_id] == [vm.host]
    others = [backend.running(name=f"new{i}") for i in range(3)]  # the 3 other hosts' GPUs
    assert vm.host not in {v.host for v in vms_from_xml(backend.pool_text()) if v.id in others}
    ok, answer, code, *_ = backend.as_admin("one.host.status", host_id, 7)
    assert not ok and "Wrong status code" in answer and code == 0x2000  # INTERNAL, as RequestManagerHost.cc
