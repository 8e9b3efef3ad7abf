"""Planning without I/O: which action resume and suspend choose for each VM state."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from slurm_nebula_power.model import TAG_CLUSTER, TAG_NODE, Vm, ours_by_node
from slurm_nebula_power.plan import extra_template, next_down_action, plan_resume

TAGS = {TAG_CLUSTER: "c1", TAG_NODE: "gpu01"}


def vm(state: int, lcm: int = 0, vid: int = 1, host: str | None = "h1", **kw) -> Vm:
    return Vm(id=vid, name=kw.get("name", "gpu01"), state=state, lcm_state=lcm, host=host,
              user_template=kw.get("tags", TAGS))


@pytest.mark.parametrize(("vms", "action"), [
    ([], "instantiate"),
    ([vm(8)], "resume"),             # POWEROFF
    ([vm(9)], "resume"),             # UNDEPLOYED
    ([vm(4)], "resume"),             # STOPPED
    ([vm(5)], "resume"),             # SUSPENDED
    ([vm(3, 16)], "resume"),         # ACTIVE/UNKNOWN
    ([vm(2)], "release"),            # HOLD
    ([vm(1)], "wait"),               # PENDING
    ([vm(3, 2)], "wait"),            # BOOT
    ([vm(3, 3)], "wait"),            # RUNNING
    ([vm(3, 36)], "recreate"),       # BOOT_FAILURE
    ([vm(3, 39)], "recreate"),       # PROLOG_FAILURE
    ([vm(11)], "recreate"),          # CLONING_FAILURE
])
def test_resume_plan_per_state(vms: list[Vm], action: str) -> None:
    assert plan_resume(vms).action == action


def test_resume_keeps_the_best_vm_and_removes_duplicates() -> None:
    running, failed, off = vm(3, 3, vid=7), vm(3, 36, vid=8), vm(8, vid=9)
    plan = plan_resume([failed, running, off])
    assert plan.action == "wait" and plan.vm == running
    assert {v.id for v in plan.duplicates} == {8, 9}


def test_identity_needs_name_and_both_tags() -> None:
    vms = [
        vm(3, 3, vid=1),
        vm(3, 3, vid=2, tags={}),                                     # untagged, same name
        vm(3, 3, vid=3, tags={TAG_CLUSTER: "other", TAG_NODE: "gpu01"}),  # another cluster
        vm(3, 3, vid=4, tags={TAG_CLUSTER: "c1", TAG_NODE: "gpu02"}),     # tags of another node
        vm(6, vid=5),                                                 # DONE
    ]
    assert [v.id for v in ours_by_node(vms, "c1", ["gpu01"])["gpu01"]] == [1]


@pytest.mark.parametrize(("action", "state", "lcm", "host", "escalate", "expected"), [
    ("terminate", 3, 3, "h", False, "terminate"),
    ("terminate", 3, 3, "h", True, "terminate-hard"),
    ("terminate", 8, 0, "h", False, "terminate"),
    ("terminate", 1, 0, None, False, "terminate"),
    ("terminate", 3, 2, "h", False, None),           # BOOT: wait until it can be acted on
    ("terminate", 3, 12, "h", False, None),          # SHUTDOWN already under way
    ("terminate", 3, 36, "h", False, "terminate"),   # failure: freed at once
    ("undeploy", 3, 3, "h", False, "undeploy"),
    ("undeploy", 8, 0, "h", False, "undeploy"),
    ("undeploy", 3, 3, "h", True, "undeploy-hard"),
    ("undeploy", 1, 0, "h", False, None),            # PENDING after a resume of an undeployed VM: keep disks
    ("undeploy", 1, 0, None, False, "terminate"),    # never deployed: nothing to keep
    ("poweroff", 3, 3, "h", False, "poweroff"),
    ("poweroff", 3, 3, "h", True, "poweroff-hard"),
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
