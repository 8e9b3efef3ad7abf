"""one.vm.action and one.vm.recover: which states allow each action and the state it leads to first."""

from __future__ import annotations

from collections.abc import Iterator

import pyone
import pytest

from opennebula_sim import Durations, HostSpec, NetworkSpec, SimConfig, running_simulator
from opennebula_sim.config import default_pci
from opennebula_sim.handle import Simulator

# Phases last a minute so a VM stays exactly where the action put it.
FROZEN = SimConfig(
    hosts=(HostSpec("big", cpu=10**7, memory_kb=10**12, pci=default_pci(0, 0)),),
    network=NetworkSpec(cidr="127.2.0.0/16"),
    durations=Durations(prolog=60, boot=60, shutdown=60, epilog=60),
)
ALL = ("terminate", "terminate-hard", "undeploy", "undeploy-hard", "poweroff", "poweroff-hard", "reboot",
       "reboot-hard", "hold", "release", "stop", "suspend", "resume", "resched", "unresched")
# start state -> {action: the state_str right after the call}; every other action is refused.
ALLOWED = {
    "RUNNING": {"terminate": "SHUTDOWN", "terminate-hard": "SHUTDOWN", "undeploy": "SHUTDOWN_UNDEPLOY",
                "undeploy-hard": "SHUTDOWN_UNDEPLOY", "poweroff": "SHUTDOWN_POWEROFF",
                "poweroff-hard": "SHUTDOWN_POWEROFF", "reboot": "RUNNING", "reboot-hard": "RUNNING",
                "stop": "SAVE_STOP", "suspend": "SAVE_SUSPEND", "resched": "RUNNING", "unresched": "RUNNING"},
    "UNKNOWN": {"terminate": "SHUTDOWN", "terminate-hard": "SHUTDOWN", "undeploy": "SHUTDOWN_UNDEPLOY",
                "undeploy-hard": "SHUTDOWN_UNDEPLOY", "poweroff": "SHUTDOWN_POWEROFF",
                "poweroff-hard": "SHUTDOWN_POWEROFF", "resume": "BOOT_UNKNOWN", "resched": "UNKNOWN",
                "unresched": "UNKNOWN"},
    "POWEROFF": {"terminate": "EPILOG", "terminate-hard": "EPILOG", "undeploy": "EPILOG_UNDEPLOY",
                 "undeploy-hard": "EPILOG_UNDEPLOY", "resume": "BOOT_POWEROFF", "resched": "POWEROFF",
                 "unresched": "POWEROFF"},
    "SUSPENDED": {"terminate": "EPILOG", "terminate-hard": "EPILOG", "stop": "EPILOG_STOP",
                  "resume": "BOOT_SUSPENDED"},
    # back to PENDING, where the scheduler may pick them up at once (the host is big)
    "STOPPED": {"terminate": "EPILOG", "terminate-hard": "EPILOG", "resume": "PENDING|LCM_INIT|PROLOG_RESUME"},
    "UNDEPLOYED": {"terminate": "EPILOG", "terminate-hard": "EPILOG", "resume": "PENDING|LCM_INIT|PROLOG_UNDEPLOY"},
    "PENDING": {"terminate": "DONE", "terminate-hard": "DONE", "hold": "HOLD"},
    "HOLD": {"terminate": "DONE", "terminate-hard": "DONE", "release": "PENDING|LCM_INIT|PROLOG"},
    "DONE": {"terminate": "DONE", "terminate-hard": "DONE"},
    "BOOT_FAILURE": {"terminate": "CLEANUP_DELETE", "terminate-hard": "CLEANUP_DELETE"},
    "PROLOG_FAILURE": {"terminate": "CLEANUP_DELETE", "terminate-hard": "CLEANUP_DELETE"},
    "EPILOG_FAILURE": {"terminate": "CLEANUP_DELETE", "terminate-hard": "CLEANUP_DELETE"},
    "PROLOG": {},
    "BOOT": {},
    "EPILOG": {},
    "SHUTDOWN": {"terminate-hard": "SHUTDOWN"},
    "SHUTDOWN_POWEROFF": {"poweroff-hard": "SHUTDOWN_POWEROFF"},
    "SHUTDOWN_UNDEPLOY": {"undeploy-hard": "SHUTDOWN_UNDEPLOY"},
    "SAVE_SUSPEND": {},
    "BOOT_POWEROFF": {},
}
TABLE = [(start, action) for start in ALLOWED for action in ALL]


def _add(sim: Simulator, name: str, start: str) -> int:
    # A PENDING VM asks for a GPU the only host lacks, so the scheduler leaves it PENDING.
    return sim.add_vm(name=name, state=start, template_id=0 if start == "PENDING" else 1)


@pytest.fixture(scope="module")
def frozen() -> Iterator[Simulator]:
    with running_simulator(FROZEN) as sim:
        yield sim


@pytest.fixture
def one(frozen: Simulator) -> pyone.OneServer:
    return pyone.OneServer(frozen.endpoint, session=frozen.auth)


@pytest.mark.parametrize(("start", "action"), TABLE, ids=[f"{s}-{a}" for s, a in TABLE])
def test_action_state_rule(frozen: Simulator, one: pyone.OneServer, start: str, action: str) -> None:
    vm_id = _add(frozen, f"{start}-{action}", start)
    expected = ALLOWED[start].get(action)
    if expected is None:
        with pytest.raises(pyone.OneActionException) as caught:
            one.vm.action(action, vm_id)
        if action.startswith("terminate"):
            text = f'Error performing action "{action}": Could not terminate VM {vm_id}, wrong state {start}.'
        else:
            text = f'Error performing action "{action}": This action is not available for state {start}'
        assert str(caught.value) == f"[one.vm.action] {text}"
        assert frozen.vm(vm_id).state_str == start, "a refused action changes nothing"
    else:
        assert one.vm.action(action, vm_id) == vm_id
        assert frozen.vm(vm_id).state_str in expected.split("|")


def test_unknown_action_is_not_supported(frozen: Simulator, one: pyone.OneServer) -> None:
    vm_id = frozen.add_vm(name="x", state="RUNNING", template_id=1)
    with pytest.raises(pyone.OneActionException, match=r'^\[one.vm.action\] Action "delete" is not supp'):
        one.vm.action("delete", vm_id)


def test_resched_sets_and_reboot_clears_the_flag(frozen: Simulator, one: pyone.OneServer) -> None:
    vm_id = frozen.add_vm(name="r", state="RUNNING", template_id=1)
    one.vm.action("resched", vm_id)
    assert one.vm.info(vm_id).RESCHED == 1
    one.vm.action("reboot", vm_id)
    assert one.vm.info(vm_id).RESCHED == 0


@pytest.mark.parametrize(("start", "op", "expected"), [
    ("BOOT", 0, "BOOT_FAILURE"),
    ("PROLOG", 0, "PROLOG_FAILURE"),
    ("SHUTDOWN_POWEROFF", 0, "RUNNING"),
    ("BOOT_POWEROFF", 0, "POWEROFF"),
    ("EPILOG", 0, "EPILOG_FAILURE"),
    ("BOOT_FAILURE", 1, "RUNNING"),
    ("BOOT", 1, "RUNNING"),
    ("PROLOG_FAILURE", 1, "BOOT"),
    ("SHUTDOWN_POWEROFF", 1, "POWEROFF"),
    ("SHUTDOWN_UNDEPLOY", 1, "EPILOG_UNDEPLOY"),
    ("EPILOG_FAILURE", 1, "DONE"),
    ("BOOT_FAILURE", 2, "BOOT"),
    ("PROLOG_FAILURE", 2, "PROLOG"),
    ("RUNNING", 2, "RUNNING"),
    ("RUNNING", 3, "CLEANUP_DELETE"),
    ("POWEROFF", 3, "DONE"),
    ("PENDING", 3, "DONE"),
    ("RUNNING", 4, "CLEANUP_RESUBMIT"),
    ("UNDEPLOYED", 4, "PENDING|LCM_INIT|PROLOG"),
    ("HOLD", 4, "PENDING|LCM_INIT|PROLOG"),
    ("RUNNING", 5, "DONE"),
    ("DONE", 5, "DONE"),
])
def test_recover_operation(frozen: Simulator, one: pyone.OneServer, start: str, op: int,
                           expected: str) -> None:
    vm_id = _add(frozen, f"rec-{start}-{op}", start)
    assert one.vm.recover(vm_id, op) == vm_id
    assert frozen.vm(vm_id).state_str in expected.split("|")


@pytest.mark.parametrize(("start", "op", "message"), [
    ("POWEROFF", 0, "Could not perform a recover operation on VM {id}, wrong state POWEROFF."),
    ("PENDING", 1, "Could not perform a recover operation on VM {id}, wrong state PENDING."),
    ("STOPPED", 2, "Could not perform a retry on VM {id}, wrong state STOPPED."),
    ("POWEROFF", 4, "Cannot delete-recreate a powered off VM. Resume it first"),
    ("SUSPENDED", 4, "Cannot delete-recreate a suspended VM. Resume it first"),
    ("DONE", 4, "Cannot delete-recreate a VM already in DONE state"),
    ("RUNNING", 9, "Wrong recovery operation code"),
])
def test_recover_refusals(frozen: Simulator, one: pyone.OneServer, start: str, op: int, message: str) -> None:
    vm_id = _add(frozen, f"norec-{start}-{op}", start)
    with pytest.raises(pyone.OneActionException) as caught:
        one.vm.recover(vm_id, op)
    assert str(caught.value) == "[one.vm.recover] " + message.format(id=vm_id)


def test_recover_on_locked_vm_is_locked(frozen: Simulator, one: pyone.OneServer) -> None:
    vm_id = frozen.add_vm(name="locked", state="BOOT_FAILURE", template_id=1)
    frozen.lock_vm(vm_id)
    with pytest.raises(pyone.OneException, match=r"is locked"):
        one.vm.recover(vm_id, 3)
    assert frozen.vm(vm_id).state_str == "BOOT_FAILURE"


@pytest.fixture
def fast() -> Iterator[Simulator]:
    cfg = SimConfig(hosts=FROZEN.hosts, network=FROZEN.network, durations=Durations(0, 0, 0, 0))
    with running_simulator(cfg) as sim:
        yield sim


@pytest.mark.parametrize(("actions", "end"), [
    (("poweroff",), "POWEROFF"),
    (("poweroff-hard",), "POWEROFF"),
    (("undeploy",), "UNDEPLOYED"),
    (("stop",), "STOPPED"),
    (("suspend",), "SUSPENDED"),
    (("terminate",), "DONE"),
    (("terminate-hard",), "DONE"),
    (("poweroff", "resume"), "RUNNING"),
    (("suspend", "resume"), "RUNNING"),
    (("undeploy", "resume"), "RUNNING"),
    (("stop", "resume"), "RUNNING"),
    (("poweroff", "undeploy"), "UNDEPLOYED"),
    (("suspend", "stop"), "STOPPED"),
    (("poweroff", "terminate"), "DONE"),
    (("undeploy", "terminate"), "DONE"),
])
def test_action_paths_end_where_oned_ends(fast: Simulator, actions: tuple[str, ...], end: str) -> None:
    one = pyone.OneServer(fast.endpoint, session=fast.auth)
    vm_id = one.template.instantiate(1, "p", False, "", False)
    fast.wait_for(lambda: fast.vm(vm_id).state_str == "RUNNING", 5)
    for action in actions:
        fast.wait_for(lambda: fast.vm(vm_id).state_str in ("RUNNING", "POWEROFF", "SUSPENDED", "UNDEPLOYED",
                                                            "STOPPED"), 5)
        one.vm.action(action, vm_id)
    fast.wait_for(lambda: fast.vm(vm_id).state_str == end, 5)


def test_resume_after_stop_goes_through_prolog_resume_and_boot_stopped(fast: Simulator) -> None:
    one = pyone.OneServer(fast.endpoint, session=fast.auth)
    vm_id = one.template.instantiate(1, "s", False, "", False)
    fast.wait_for(lambda: fast.vm(vm_id).state_str == "RUNNING", 5)
    one.vm.action("stop", vm_id)
    fast.wait_for(lambda: fast.vm(vm_id).state_str == "STOPPED", 5)
    fast.set_durations(prolog=60)
    one.vm.action("resume", vm_id)
    assert fast.wait_for(lambda: fast.vm(vm_id).state_str == "PROLOG_RESUME", 5)


# recover --delete of a VM the scheduler is deploying: real oned's placement plan waits for the deploy's answer
# until ACTION_TIMEOUT (300 s stock) and takes no other plan meanwhile (7.0.2 and 7.4.0, FIDELITY).
def _stall_sim(action_timeout: float) -> SimConfig:
    return SimConfig(hosts=FROZEN.hosts, network=FROZEN.network, durations=Durations(0, 60, 0, 0),
                     action_timeout=action_timeout)


def _placed(sim: Simulator, one: pyone.OneServer) -> bool:
    """Instantiate a VM: whether the scheduler places it within a second (100 ticks)."""
    vm_id = one.template.instantiate(1, "next", False, "", False)
    try:
        sim.wait_for(lambda: sim.vm(vm_id).state_str != "PENDING", 1.0)
    except TimeoutError:
        return False
    return True


@pytest.mark.parametrize(("action_timeout", "placed"), [(300.0, False), (0.0, True)])
def test_recover_delete_in_a_first_boot_stalls_placement_for_the_action_timeout(action_timeout, placed) -> None:
    with running_simulator(_stall_sim(action_timeout)) as sim:
        one = pyone.OneServer(sim.endpoint, session=sim.auth)
        vm_id = one.template.instantiate(1, "booting", False, "", False)
        sim.wait_for(lambda: sim.vm(vm_id).state_str == "BOOT", 5)
        one.vm.recover(vm_id, 3)
        sim.wait_for(lambda: sim.vm(vm_id).state_str == "DONE", 5)
        assert _placed(sim, one) is placed


def test_recover_delete_in_boot_poweroff_does_not_stall_placement() -> None:
    with running_simulator(_stall_sim(300.0)) as sim:
        one = pyone.OneServer(sim.endpoint, session=sim.auth)
        vm_id = one.template.instantiate(1, "back", False, "", False)
        sim.set_durations(boot=0)
        sim.wait_for(lambda: sim.vm(vm_id).state_str == "RUNNING", 5)
        one.vm.action("poweroff-hard", vm_id)
        sim.wait_for(lambda: sim.vm(vm_id).state_str == "POWEROFF", 5)
        sim.set_durations(boot=60)
        one.vm.action("resume", vm_id)
        assert sim.vm(vm_id).state_str == "BOOT_POWEROFF"
        one.vm.recover(vm_id, 3)
        assert _placed(sim, one)
