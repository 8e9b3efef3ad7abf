"""Planning without I/O: which action resume and suspend choose for each VM state."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from slurm_nebula_power.model import LCM_NAMES, STATE_NAMES, TAG_CLUSTER, TAG_NODE, Vm, ours_by_node
from slurm_nebula_power.plan import extra_template, next_down_action, plan_resume

TAGS = {TAG_CLUSTER: "c1", TAG_NODE: "gpu01"}


STATES = {name: number for number, name in STATE_NAMES.items()}
LCM = {name: number for number, name in LCM_NAMES.items()}


def vm(state: str, lcm: str = "LCM_INIT", vid: int = 1, host: str | None = "h1", **kw) -> Vm:
    tags = kw.get("tags", TAGS)
    return Vm(id=vid, name=kw.get("name", "gpu01"), state=STATES[state], lcm_state=LCM[lcm], host=host,
              user_template=kw.get("user_template", tags), context=tags)


@pytest.mark.parametrize(("vms", "action"), [
    ([], "instantiate"),
    ([vm("POWEROFF")], "resume"),
    ([vm("UNDEPLOYED")], "resume"),
    ([vm("STOPPED")], "resume"),
    ([vm("SUSPENDED")], "resume"),
    ([vm("ACTIVE", "UNKNOWN")], "resume"),
    ([vm("HOLD")], "release"),
    ([vm("PENDING")], "wait"),
    ([vm("ACTIVE", "BOOT")], "wait"),
    ([vm("ACTIVE", "RUNNING")], "wait"),
    ([vm("ACTIVE", "BOOT_FAILURE")], "recreate"),
    ([vm("ACTIVE", "PROLOG_FAILURE")], "recreate"),
    ([vm("CLONING_FAILURE")], "recreate"),
])
def test_resume_plan_per_state(vms: list[Vm], action: str) -> None:
    assert plan_resume(vms).action == action


def test_resume_keeps_the_best_vm_and_removes_duplicates() -> None:
    running, failed = vm("ACTIVE", "RUNNING", vid=7), vm("ACTIVE", "BOOT_FAILURE", vid=8)
    off = vm("POWEROFF", vid=9)
    plan = plan_resume([failed, running, off])
    assert plan.action == "wait" and plan.vm == running
    assert {v.id for v in plan.duplicates} == {8, 9}


def test_identity_needs_name_and_both_context_tags() -> None:
    vms = [
        vm("ACTIVE", "RUNNING", vid=1),
        vm("ACTIVE", "RUNNING", vid=2, tags={}),                                     # no identity, same name
        vm("ACTIVE", "RUNNING", vid=3, tags={TAG_CLUSTER: "other", TAG_NODE: "gpu01"}),  # another cluster
        vm("ACTIVE", "RUNNING", vid=4, tags={TAG_CLUSTER: "c1", TAG_NODE: "gpu02"}),     # another node's
        vm("DONE", vid=5),
        # a guest rewrote its USER_TEMPLATE (OneGate): CONTEXT still says it is ours
        vm("ACTIVE", "RUNNING", vid=6, user_template={TAG_CLUSTER: "evil", TAG_NODE: "x"}),
    ]
    assert [v.id for v in ours_by_node(vms, "c1", ["gpu01"])["gpu01"]] == [1, 6]
    assert [v.id for v in vms if v.is_impostor("c1", {"gpu01"})] == [2, 4]


def test_identity_never_comes_from_user_template() -> None:
    # issue 34, item 8: a VM instantiated by hand from the printed template (the node in CONTEXT, no cluster
    # there) became the node's once its guest wrote SLURM_CLUSTER into USER_TEMPLATE through OneGate
    by_hand = Vm(id=1, name="gpu01", state=3, lcm_state=3, user_template=TAGS, context={TAG_NODE: "gpu01"})
    assert not by_hand.is_ours("c1", "gpu01") and by_hand.is_impostor("c1", {"gpu01"})
    detached = Vm(id=2, name="gpu01", state=3, lcm_state=3, user_template={TAG_CLUSTER: "x"},
                  context={TAG_NODE: "gpu01"})
    assert not detached.is_ours("c1", "gpu01") and detached.is_impostor("c1", {"gpu01"})
    ours = Vm(id=3, name="gpu01", state=3, lcm_state=3, user_template={TAG_CLUSTER: "evil"},
              context={TAG_NODE: "gpu01", TAG_CLUSTER: "c1"})
    assert ours.is_ours("c1", "gpu01")


@pytest.mark.parametrize(("action", "state", "lcm", "host", "escalate", "expected"), [
    ("terminate", "ACTIVE", "RUNNING", "h", False, "terminate"),
    ("terminate", "ACTIVE", "RUNNING", "h", True, "terminate-hard"),
    ("terminate", "POWEROFF", "LCM_INIT", "h", False, "terminate"),
    ("terminate", "PENDING", "LCM_INIT", None, False, "terminate"),
    ("terminate", "ACTIVE", "BOOT", "h", False, None),           # BOOT: wait until it can be acted on
    ("terminate", "ACTIVE", "SHUTDOWN", "h", False, None),          # SHUTDOWN already under way
    ("terminate", "ACTIVE", "BOOT_FAILURE", "h", False, "terminate"),   # failure: freed at once
    ("undeploy", "ACTIVE", "RUNNING", "h", False, "undeploy"),
    ("undeploy", "POWEROFF", "LCM_INIT", "h", False, "undeploy"),
    ("undeploy", "ACTIVE", "RUNNING", "h", True, "undeploy-hard"),
    ("undeploy", "PENDING", "LCM_INIT", "h", False, None),  # after a resume of an undeployed VM: keep disks
    ("undeploy", "PENDING", "LCM_INIT", None, False, "terminate"),    # never deployed: nothing to keep
    ("poweroff", "ACTIVE", "RUNNING", "h", False, "poweroff"),
    ("poweroff", "ACTIVE", "RUNNING", "h", True, "poweroff-hard"),
])
def test_suspend_next_action(action, state, lcm, host, escalate, expected) -> None:
    assert next_down_action(action, vm(state, lcm, host=host), escalate) == expected


def test_extra_template_carries_tags_jobs_and_whole_context() -> None:
    text = extra_template("c1", "gpu01", [12, 11, 12], {"NETWORK": "YES", "START_SCRIPT": 'echo "<hi>" & x'})
    root = ET.fromstring(text)
    assert root.tag == "TEMPLATE"
    assert root.findtext("SLURM_CLUSTER") == "c1"
    assert root.findtext("SLURM_NODENAME") == "gpu01"
    assert root.findtext("SLURM_JOB_IDS") == "11,12"
    context = root.find("CONTEXT")
    assert context is not None
    assert context.findtext("NETWORK") == "YES"
    assert context.findtext("START_SCRIPT") == 'echo "<hi>" & x'
    assert context.findtext("SET_HOSTNAME") == "gpu01"
    assert context.findtext("SLURM_NODENAME") == "gpu01"
    assert context.findtext("SLURM_CLUSTER") == "c1", "identity where a guest cannot write"


def test_state_tables_match_pyone_and_the_simulator() -> None:
    """The model's names are oned's: the same as pyone's enums and the simulator's own tables."""
    import pyone

    from opennebula_sim import states as S
    from slurm_nebula_power import model

    # 7 FAILED is obsolete in oned (never reported) and left out of both tables
    assert {s.value: s.name for s in pyone.VM_STATE if s.value != 7} == model.STATE_NAMES
    assert all(model.LCM_NAMES[s.value] == s.name for s in pyone.LCM_STATE)  # pyone stops at 68
    assert model.LCM_NAMES == S.LCM_NAMES and model.STATE_NAMES == S.STATE_NAMES
    assert model.FAILURE_LCM == {n for n, name in S.LCM_NAMES.items() if name.endswith("FAILURE")}


@pytest.mark.parametrize(("message", "unplaceable"), [
    ("Tue Dec  1 08:53:32 2026: [HOST] Dispatch limit reached on hosts: 0,1,2,3,4,5,6,7,8,9", False),
    ("Tue Dec  1 08:58:02 2026: Cannot dispatch VM to any Host. Possible reasons: Not enough capacity in Host "
     "or System DS, dispatch... see more details in VM log", False),
    ("Tue Dec  1 08:58:00 2026: Cannot dispatch VM: No system datastores found to run VMs", False),
    ("", False),
    ("Mon Nov 30 10:00:00 2026: Cannot allocate VM. Not enough capacity in hosts 0,1", True),
    ("Mon Nov 30 10:00:00 2026: [HOST] Unavailable PCI devices on hosts: 0,1,2,3", True),
    ("Mon Nov 30 10:00:00 2026 : Cannot dispatch VM to any Host. Check VM log for detailed reasons.", True),
])
def test_a_vm_left_for_a_later_plan_is_not_unplaceable(message: str, unplaceable: bool) -> None:
    """What oned 7.0.2 and 7.4.0 wrote on VMs that waited for a dispatch limit with GPUs free, and on real
    shortages (real-oned.md, bench/README.md "Real oned")."""
    pending = Vm(id=1, name="gpu01", state=STATES["PENDING"], lcm_state=0, user_template={"SCHED_MESSAGE": message})
    assert pending.unplaceable is unplaceable
