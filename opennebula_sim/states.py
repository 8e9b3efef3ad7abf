"""oned's VM states, LCM states, error codes and the error every simulated call may raise."""

from __future__ import annotations

# VirtualMachine::VmState
INIT, PENDING, HOLD, ACTIVE, STOPPED, SUSPENDED, DONE = 0, 1, 2, 3, 4, 5, 6
POWEROFF, UNDEPLOYED, CLONING, CLONING_FAILURE = 8, 9, 10, 11

STATE_NAMES = {
    INIT: "INIT", PENDING: "PENDING", HOLD: "HOLD", ACTIVE: "ACTIVE", STOPPED: "STOPPED",
    SUSPENDED: "SUSPENDED", DONE: "DONE", POWEROFF: "POWEROFF", UNDEPLOYED: "UNDEPLOYED",
    CLONING: "CLONING", CLONING_FAILURE: "CLONING_FAILURE",
}
STATE_BY_NAME = {name: value for value, name in STATE_NAMES.items()}

# VirtualMachine::LcmState, 0..71 (pyone 7.3.80's LCM_STATE stops at 68)
_LCM_ORDER = """LCM_INIT PROLOG BOOT RUNNING MIGRATE SAVE_STOP SAVE_SUSPEND SAVE_MIGRATE PROLOG_MIGRATE
PROLOG_RESUME EPILOG_STOP EPILOG SHUTDOWN CANCEL FAILURE CLEANUP_RESUBMIT UNKNOWN HOTPLUG SHUTDOWN_POWEROFF
BOOT_UNKNOWN BOOT_POWEROFF BOOT_SUSPENDED BOOT_STOPPED CLEANUP_DELETE HOTPLUG_SNAPSHOT HOTPLUG_NIC
HOTPLUG_SAVEAS HOTPLUG_SAVEAS_POWEROFF HOTPLUG_SAVEAS_SUSPENDED SHUTDOWN_UNDEPLOY EPILOG_UNDEPLOY
PROLOG_UNDEPLOY BOOT_UNDEPLOY HOTPLUG_PROLOG_POWEROFF HOTPLUG_EPILOG_POWEROFF BOOT_MIGRATE BOOT_FAILURE
BOOT_MIGRATE_FAILURE PROLOG_MIGRATE_FAILURE PROLOG_FAILURE EPILOG_FAILURE EPILOG_STOP_FAILURE
EPILOG_UNDEPLOY_FAILURE PROLOG_MIGRATE_POWEROFF PROLOG_MIGRATE_POWEROFF_FAILURE PROLOG_MIGRATE_SUSPEND
PROLOG_MIGRATE_SUSPEND_FAILURE BOOT_UNDEPLOY_FAILURE BOOT_STOPPED_FAILURE PROLOG_RESUME_FAILURE
PROLOG_UNDEPLOY_FAILURE DISK_SNAPSHOT_POWEROFF DISK_SNAPSHOT_REVERT_POWEROFF DISK_SNAPSHOT_DELETE_POWEROFF
DISK_SNAPSHOT_SUSPENDED DISK_SNAPSHOT_REVERT_SUSPENDED DISK_SNAPSHOT_DELETE_SUSPENDED DISK_SNAPSHOT
DISK_SNAPSHOT_REVERT DISK_SNAPSHOT_DELETE PROLOG_MIGRATE_UNKNOWN PROLOG_MIGRATE_UNKNOWN_FAILURE DISK_RESIZE
DISK_RESIZE_POWEROFF DISK_RESIZE_UNDEPLOYED HOTPLUG_NIC_POWEROFF HOTPLUG_RESIZE HOTPLUG_SAVEAS_UNDEPLOYED
HOTPLUG_SAVEAS_STOPPED BACKUP BACKUP_POWEROFF RESTORE""".split()
LCM_NAMES = dict(enumerate(_LCM_ORDER))
LCM_BY_NAME = {name: value for value, name in LCM_NAMES.items()}

LCM_INIT, PROLOG, BOOT, RUNNING = 0, 1, 2, 3
SAVE_STOP, SAVE_SUSPEND, PROLOG_RESUME, EPILOG_STOP, EPILOG, SHUTDOWN = 5, 6, 9, 10, 11, 12
CLEANUP_RESUBMIT, UNKNOWN, BOOT_UNKNOWN = 15, 16, 19
SHUTDOWN_POWEROFF, BOOT_POWEROFF, BOOT_SUSPENDED, BOOT_STOPPED, CLEANUP_DELETE = 18, 20, 21, 22, 23
SHUTDOWN_UNDEPLOY, EPILOG_UNDEPLOY, PROLOG_UNDEPLOY, BOOT_UNDEPLOY = 29, 30, 31, 32
BOOT_FAILURE, PROLOG_FAILURE, EPILOG_FAILURE = 36, 39, 40
EPILOG_STOP_FAILURE, EPILOG_UNDEPLOY_FAILURE = 41, 42
BOOT_UNDEPLOY_FAILURE, BOOT_STOPPED_FAILURE, PROLOG_RESUME_FAILURE, PROLOG_UNDEPLOY_FAILURE = 47, 48, 49, 50

# The LCM states DispatchManager::terminate sends straight to cleanup (lcm->trigger_delete).
FAILURE_STATES = frozenset(
    {BOOT_FAILURE, 37, 38, PROLOG_FAILURE, EPILOG_FAILURE, EPILOG_STOP_FAILURE, EPILOG_UNDEPLOY_FAILURE,
     44, 46, BOOT_UNDEPLOY_FAILURE, BOOT_STOPPED_FAILURE, PROLOG_RESUME_FAILURE, PROLOG_UNDEPLOY_FAILURE, 61}
)

# A deploy the scheduler's placement plan dispatched and waits for (src/schedm/PlanManager.cc): from
# dispatch to RUNNING. Deleting the VM now leaves the plan's action unanswered until ACTION_TIMEOUT.
DEPLOYING = frozenset({LCM_INIT, PROLOG, BOOT, PROLOG_UNDEPLOY, BOOT_UNDEPLOY, PROLOG_RESUME, BOOT_STOPPED})

# Which configured duration a transient LCM state lasts.
PHASE_KIND = {
    PROLOG: "prolog", PROLOG_RESUME: "prolog", PROLOG_UNDEPLOY: "prolog",
    BOOT: "boot", BOOT_UNKNOWN: "boot", BOOT_POWEROFF: "boot", BOOT_SUSPENDED: "boot", BOOT_STOPPED: "boot",
    BOOT_UNDEPLOY: "boot",
    SHUTDOWN: "shutdown", SHUTDOWN_POWEROFF: "shutdown", SHUTDOWN_UNDEPLOY: "shutdown",
    SAVE_STOP: "shutdown", SAVE_SUSPEND: "shutdown",
    EPILOG: "epilog", EPILOG_STOP: "epilog", EPILOG_UNDEPLOY: "epilog",
    CLEANUP_DELETE: "epilog", CLEANUP_RESUBMIT: "epilog",
}

# VMActions::Action numbers, as HISTORY/ACTION records them.
HISTORY_ACTION = {
    "none": 0, "undeploy": 5, "undeploy-hard": 6, "hold": 7, "release": 8, "stop": 9, "suspend": 10,
    "resume": 11, "delete": 13, "delete-recreate": 14, "reboot": 15, "reboot-hard": 16, "resched": 17,
    "unresched": 18, "poweroff": 19, "poweroff-hard": 20, "terminate": 27, "terminate-hard": 28,
}
ACTIONS = ("terminate", "terminate-hard", "undeploy", "undeploy-hard", "poweroff", "poweroff-hard", "reboot",
           "reboot-hard", "hold", "release", "stop", "suspend", "resume", "resched", "unresched")

# Request::ErrorCode
AUTHENTICATION, AUTHORIZATION, NO_EXISTS, ACTION = 0x100, 0x200, 0x400, 0x800
XML_RPC_API, INTERNAL, ALLOCATE, LOCKED = 0x1000, 0x2000, 0x4000, 0x8000


class OneError(Exception):
    """A failed call: oned's error code, its resp_msg, the object id and object kind the message names."""

    def __init__(self, code: int, message: str, resp_id: int = -1, obj: str = "virtual machine") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.resp_id = resp_id
        self.obj = obj


def state_str(state: int, lcm: int) -> str:
    """VirtualMachine::state_str: the LCM state's name when ACTIVE, else the VM state's name."""
    if state == ACTIVE:
        return LCM_NAMES.get(lcm, str(lcm))
    return STATE_NAMES.get(state, str(state))
