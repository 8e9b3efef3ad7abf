"""one.vm.action and one.vm.recover: which states allow what, and where each leads (DispatchManager, LCM).

All functions expect the caller to hold `cloud.lock`.
"""

from __future__ import annotations

from collections.abc import Callable

from opennebula_sim import states as S
from opennebula_sim.cloud import Cloud, User
from opennebula_sim.model import Vm
from opennebula_sim.states import OneError

# LifeCycleManager::recover(failure): where a VM in a transient state goes when the operation failed.
_FAIL_TO = {
    S.PROLOG: (S.ACTIVE, S.PROLOG_FAILURE), S.BOOT: (S.ACTIVE, S.BOOT_FAILURE),
    S.BOOT_POWEROFF: (S.POWEROFF, S.LCM_INIT), S.BOOT_SUSPENDED: (S.SUSPENDED, S.LCM_INIT),
    S.BOOT_UNKNOWN: (S.ACTIVE, S.UNKNOWN), S.BOOT_STOPPED: (S.ACTIVE, S.BOOT_STOPPED_FAILURE),
    S.BOOT_UNDEPLOY: (S.ACTIVE, S.BOOT_UNDEPLOY_FAILURE),
    S.PROLOG_RESUME: (S.ACTIVE, S.PROLOG_RESUME_FAILURE),
    S.PROLOG_UNDEPLOY: (S.ACTIVE, S.PROLOG_UNDEPLOY_FAILURE), S.SHUTDOWN: (S.ACTIVE, S.RUNNING),
    S.SHUTDOWN_POWEROFF: (S.ACTIVE, S.RUNNING), S.SHUTDOWN_UNDEPLOY: (S.ACTIVE, S.RUNNING),
    S.SAVE_STOP: (S.ACTIVE, S.RUNNING), S.SAVE_SUSPEND: (S.ACTIVE, S.RUNNING),
    S.EPILOG: (S.ACTIVE, S.EPILOG_FAILURE), S.EPILOG_STOP: (S.ACTIVE, S.EPILOG_STOP_FAILURE),
    S.EPILOG_UNDEPLOY: (S.ACTIVE, S.EPILOG_UNDEPLOY_FAILURE),
}
# The transient state each *_FAILURE state failed in (recover success completes it, retry repeats it).
_ORIGIN = {failed: origin for origin, (_, failed) in _FAIL_TO.items() if failed in S.FAILURE_STATES}


def quota_message(cloud: Cloud, user: User) -> str:
    """The text oned's VM quota check gives (Quota.cc, prefixed by Request::user_quota_authorization) when
    the user's RUNNING_VMS is exhausted: the limit taken to be what the user runs now."""
    running = sum(1 for vm in cloud.vms.values() if vm.uid == user.uid and vm.state not in (S.DONE,))
    return f"user [{user.uid}] limit of {running} reached for RUNNING_VMS quota in VM"


def vm_action(cloud: Cloud, action: str, vm_id: int, user: User) -> int:
    """Perform one.vm.action; raise OneError exactly where oned refuses."""
    vm = _get(cloud, vm_id)
    if vm.lock is not None:
        raise OneError(S.LOCKED, "", vm_id)
    handler = _HANDLERS.get(action)
    if handler is None:
        raise OneError(S.ACTION, f'Action "{action}" is not supported')
    if action == "resume" and cloud.faults.quota_exceeded:
        raise OneError(S.ACTION, quota_message(cloud, user))
    error = handler(cloud, vm, action.endswith("-hard"))
    if error is not None:
        raise OneError(S.ACTION, f'Error performing action "{action}": {error}')
    cloud.locked_record_action(vm, action)
    return vm_id


def _get(cloud: Cloud, vm_id: int) -> Vm:
    vm = cloud.vms.get(vm_id)
    if vm is None:
        raise OneError(S.NO_EXISTS, "", vm_id)
    return vm


def _refuse(vm: Vm) -> str:
    return f"This action is not available for state {S.state_str(vm.state, vm.lcm)}"


def _running(vm: Vm, *, unknown: bool = True) -> bool:
    return vm.state == S.ACTIVE and (vm.lcm == S.RUNNING or (unknown and vm.lcm == S.UNKNOWN))


def _terminate(cloud: Cloud, vm: Vm, hard: bool) -> str | None:
    if vm.state in (S.SUSPENDED, S.POWEROFF, S.STOPPED, S.UNDEPLOYED):
        _epilog(cloud, vm, S.EPILOG)
    elif vm.state in (S.INIT, S.PENDING, S.HOLD, S.CLONING, S.CLONING_FAILURE):
        cloud.locked_done(vm)
    elif vm.state == S.DONE:
        pass
    elif _running(vm) or (hard and vm.lcm == S.SHUTDOWN):
        cloud.locked_set_state(vm, S.ACTIVE, S.SHUTDOWN)
    elif vm.lcm in S.FAILURE_STATES:
        cloud.locked_set_state(vm, S.ACTIVE, S.CLEANUP_DELETE)
    else:
        return f"Could not terminate VM {vm.id}, wrong state {S.state_str(vm.state, vm.lcm)}."
    return None


def _epilog(cloud: Cloud, vm: Vm, lcm: int) -> None:
    if vm.history:
        vm.history[-1].estime = int(cloud.clock())
    cloud.locked_set_state(vm, S.ACTIVE, lcm)


def _undeploy(cloud: Cloud, vm: Vm, hard: bool) -> str | None:
    if vm.state == S.POWEROFF:
        _epilog(cloud, vm, S.EPILOG_UNDEPLOY)
    elif _running(vm) or (hard and vm.state == S.ACTIVE and vm.lcm == S.SHUTDOWN_UNDEPLOY):
        cloud.locked_set_state(vm, S.ACTIVE, S.SHUTDOWN_UNDEPLOY)
    else:
        return _refuse(vm)
    return None


def _poweroff(cloud: Cloud, vm: Vm, hard: bool) -> str | None:
    if _running(vm) or (hard and vm.state == S.ACTIVE and vm.lcm == S.SHUTDOWN_POWEROFF):
        cloud.locked_set_state(vm, S.ACTIVE, S.SHUTDOWN_POWEROFF)
        return None
    return _refuse(vm)


def _hold(cloud: Cloud, vm: Vm, hard: bool) -> str | None:
    if vm.state != S.PENDING:
        return _refuse(vm)
    cloud.locked_set_state(vm, S.HOLD)
    return None


def _release(cloud: Cloud, vm: Vm, hard: bool) -> str | None:
    if vm.state != S.HOLD:
        return _refuse(vm)
    cloud.locked_set_state(vm, S.PENDING)
    return None


def _stop(cloud: Cloud, vm: Vm, hard: bool) -> str | None:
    if vm.state == S.SUSPENDED:
        _epilog(cloud, vm, S.EPILOG_STOP)
    elif _running(vm, unknown=False):
        cloud.locked_set_state(vm, S.ACTIVE, S.SAVE_STOP)
    else:
        return _refuse(vm)
    return None


def _suspend(cloud: Cloud, vm: Vm, hard: bool) -> str | None:
    if not _running(vm, unknown=False):
        return _refuse(vm)
    cloud.locked_set_state(vm, S.ACTIVE, S.SAVE_SUSPEND)
    return None


def _resume(cloud: Cloud, vm: Vm, hard: bool) -> str | None:
    if vm.state in (S.STOPPED, S.UNDEPLOYED):
        cloud.locked_set_state(vm, S.PENDING)  # scheduled again, maybe onto another host
    elif vm.state == S.SUSPENDED:
        cloud.locked_set_state(vm, S.ACTIVE, S.BOOT_SUSPENDED)
    elif vm.state == S.POWEROFF:
        cloud.locked_set_state(vm, S.ACTIVE, S.BOOT_POWEROFF)  # same host: it never gave its share back
    elif vm.state == S.ACTIVE and vm.lcm == S.UNKNOWN:
        cloud.locked_set_state(vm, S.ACTIVE, S.BOOT_UNKNOWN)
    else:
        return _refuse(vm)
    return None


def _reboot(cloud: Cloud, vm: Vm, hard: bool) -> str | None:
    if not _running(vm, unknown=False):
        return _refuse(vm)
    vm.resched = 0  # rebooting cancels re-scheduling
    vm.touch()
    return None


def _resched(cloud: Cloud, vm: Vm, hard: bool, flag: int = 1) -> str | None:
    if not (vm.state == S.POWEROFF or _running(vm)):
        return _refuse(vm)
    vm.resched = flag
    vm.touch()
    return None


def _unresched(cloud: Cloud, vm: Vm, hard: bool) -> str | None:
    return _resched(cloud, vm, hard, flag=0)


_HANDLERS: dict[str, Callable[[Cloud, Vm, bool], str | None]] = {
    "terminate": _terminate, "terminate-hard": _terminate, "undeploy": _undeploy, "undeploy-hard": _undeploy,
    "poweroff": _poweroff, "poweroff-hard": _poweroff, "hold": _hold, "release": _release, "stop": _stop,
    "suspend": _suspend, "resume": _resume, "reboot": _reboot, "reboot-hard": _reboot, "resched": _resched,
    "unresched": _unresched,
}
assert set(_HANDLERS) == set(S.ACTIONS)

RECOVER_FAILURE, RECOVER_SUCCESS, RECOVER_RETRY = 0, 1, 2
RECOVER_DELETE, RECOVER_RECREATE, RECOVER_DELETE_DB = 3, 4, 5


def vm_recover(cloud: Cloud, vm_id: int, op: int) -> int:
    """one.vm.recover: op 0 failure, 1 success, 2 retry, 3 delete, 4 delete-recreate, 5 delete-db."""
    vm = _get(cloud, vm_id)
    if vm.lock is not None:
        raise OneError(S.LOCKED, "", vm_id)
    name = S.state_str(vm.state, vm.lcm)
    if op in (RECOVER_FAILURE, RECOVER_SUCCESS):
        if vm.state != S.ACTIVE:
            raise OneError(S.ACTION,
                           f"Could not perform a recover operation on VM {vm_id}, wrong state {name}.")
        _recover_active(cloud, vm, op == RECOVER_SUCCESS)
    elif op == RECOVER_RETRY:
        if vm.state != S.ACTIVE:
            raise OneError(S.ACTION, f"Could not perform a retry on VM {vm_id}, wrong state {name}.")
        if vm.lcm in _ORIGIN:
            cloud.locked_set_state(vm, S.ACTIVE, _ORIGIN[vm.lcm])
    elif op == RECOVER_DELETE:
        _delete(cloud, vm)
    elif op == RECOVER_RECREATE:
        _delete_recreate(cloud, vm)
    elif op == RECOVER_DELETE_DB:
        if vm.state != S.DONE:
            cloud.locked_done(vm)
    else:
        raise OneError(S.ACTION, "Wrong recovery operation code")
    if op in (RECOVER_DELETE, RECOVER_RECREATE):
        cloud.locked_record_action(vm, "delete" if op == RECOVER_DELETE else "delete-recreate")
    return vm_id


def _recover_active(cloud: Cloud, vm: Vm, success: bool) -> None:
    if success:
        origin = _ORIGIN.get(vm.lcm, vm.lcm)
        if origin in S.PHASE_KIND:
            cloud.locked_complete(vm, origin)
    elif vm.lcm in _FAIL_TO:
        cloud.locked_set_state(vm, *_FAIL_TO[vm.lcm])


def _delete(cloud: Cloud, vm: Vm) -> None:
    if vm.state == S.ACTIVE:
        cloud.locked_set_state(vm, S.ACTIVE, S.CLEANUP_DELETE)
    elif vm.state != S.DONE:
        cloud.locked_done(vm)


def _delete_recreate(cloud: Cloud, vm: Vm) -> None:
    refusals = {
        S.POWEROFF: "Cannot delete-recreate a powered off VM. Resume it first",
        S.SUSPENDED: "Cannot delete-recreate a suspended VM. Resume it first",
        S.DONE: "Cannot delete-recreate a VM already in DONE state",
    }
    if vm.state in refusals:
        raise OneError(S.ACTION, refusals[vm.state])
    if vm.state == S.ACTIVE:
        cloud.locked_set_state(vm, S.ACTIVE, S.CLEANUP_RESUBMIT)
    elif vm.state in (S.STOPPED, S.UNDEPLOYED, S.HOLD):
        vm.next_prolog = S.PROLOG
        cloud.locked_set_state(vm, S.PENDING)
