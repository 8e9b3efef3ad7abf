"""A hostile guest (issue 15, item 2): a job user inside a worker VM rewrites what OneGate lets it write.

Identity rests on NAME and the CONTEXT set at instantiate, which OneGate cannot touch (a guest's update goes
through one.vm.update into USER_TEMPLATE only; real-oned.md), so the guest cannot detach its VM: suspend
still frees its GPU, and the next resume makes no second VM.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from typing import Any

import pytest
from opsupport import show
from reliability_support import gpu_holders, live_ours, run_env, site
from test_cli import program

from opennebula_sim import states as S
from slurm_nebula_power.cli import reconcile, status
from slurm_nebula_power.cli.main import resume_main, suspend_main
from slurm_nebula_power.errors import EXIT_OK

DETACH = 'SLURM_CLUSTER="evil"\nSLURM_NODENAME="elsewhere"\nCONTEXT=[ SLURM_CLUSTER="evil", SLURM_NODENAME="x" ]'


def guest_put(sim: Any, vm_id: int, body: str) -> int:
    """What a job user inside the VM can do: OneGate PUT /vm with the VM's own token."""
    with sim.cloud.lock:
        token = sim.cloud.vms[vm_id].onegate_token
    endpoint = sim.vm(vm_id).template["CONTEXT"]["ONEGATE_ENDPOINT"]
    request = urllib.request.Request(f"{endpoint}/vm", data=body.encode(), method="PUT",
                                     headers={"X-ONEGATE-TOKEN": token, "X-ONEGATE-VMID": str(vm_id)})
    with urllib.request.urlopen(request, timeout=5) as answer:
        return int(answer.status)


def test_a_guest_cannot_detach_its_vm_from_management(tmp_path, sim, capsys) -> None:
    setup = site(tmp_path / "site", sim, boot_timeout=20, poll_max=0.2)
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    [vm] = live_ours(sim)["gpu01"]
    assert guest_put(sim, vm.id, DETACH) == 200
    seen = sim.vm(vm.id)
    assert seen.user_template["SLURM_CLUSTER"] == "evil", "the guest did rewrite its USER_TEMPLATE"
    assert seen.template["CONTEXT"]["SLURM_CLUSTER"] == "testcluster", "but not the CONTEXT"
    # The node is resumed again (its job requeued, say): the VM is still ours, no second one is made.
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    assert [v.id for v in sim.vms() if v.name == "gpu01" and v.state != S.DONE] == [vm.id]
    setup.set_nodes(show("gpu01 State=IDLE+CLOUD"))
    assert status.main(["--json", "gpu01"], setup.env) == EXIT_OK
    assert f'"vm_id": {vm.id}' in capsys.readouterr().out
    # Suspend frees its GPU as for any VM of ours.
    assert suspend_main(["gpu01"], setup.env) == EXIT_OK
    assert sim.vm(vm.id).state == S.DONE and gpu_holders(sim) == {}


def run(setup, name: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """An installed program as slurmctld runs it (its environment, plus `env`)."""
    return subprocess.run([program(name), *args], env={**run_env(setup), **env}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)


# What a job user can write as its VM's job ids: a digit to str.isdigit() that int() refuses, more digits
# than int() parses, another script's digits, Python's literal forms, far too long. (A list cannot get
# through OneGate: onegate-server's escape_attr turns `A=1,2` into a template oned refuses; the parser's
# own bounds on lists are in test_audit.py.)
HOSTILE_JOB_IDS = ["\u00b2", "4" * 5000, "\u0663", "1_0", "-1", "99999999999", "7" * 200_000]


@pytest.mark.parametrize("ids", HOSTILE_JOB_IDS, ids=["superscript", "5000-digits", "arabic-indic", "underscore",
                                                      "negative", "over-uint32", "200000-digits"])
def test_a_guest_writing_its_job_ids_crashes_nothing_and_bills_nothing(tmp_path, sim, ids: str) -> None:
    # issue 22, item 1: SLURM_JOB_IDS=² from a guest once made every suspend of its node set exit 4, the
    # other nodes got no "off" record, and usage billed another user's job as still running
    setup = site(tmp_path / "site", sim, boot_timeout=20, poll_max=0.2)
    resume_file = tmp_path / "resume.json"
    resume_file.write_text(json.dumps({"jobs": [{"job_id": 7, "nodes": "gpu[01-02]"}], "all_nodes": "gpu[01-02]"}))
    up = run(setup, "slurm-nebula-resume", "gpu[01-02]", SLURM_RESUME_FILE=str(resume_file))
    assert up.returncode == EXIT_OK, up.stderr
    [vm] = live_ours(sim)["gpu01"]
    assert guest_put(sim, vm.id, f'SLURM_JOB_IDS="{ids}"') == 200
    assert sim.vm(vm.id).user_template["SLURM_JOB_IDS"] == ids, "the guest did write it"
    for name, args in (("slurm-nebula-power", ("reconcile",)), ("slurm-nebula-resume", ("gpu03",)),
                       ("slurm-nebula-suspend", ("gpu[01-03]",))):
        done = run(setup, name, *args)
        assert done.returncode == EXIT_OK, (name, done.stderr, setup.log_text()[-1500:])
    assert "internal error" not in setup.log_text()
    ends = {r["node"]: r["jobs"] for r in setup.records() if r["event"] == "removed"}
    assert ends == {"gpu01": [7], "gpu02": [7], "gpu03": []}, "billed by the ids resume set, not the guest's"
    assert gpu_holders(sim) == {}
    # resume-fail of a node whose guest rewrote its ids
    assert run(setup, "slurm-nebula-resume", "gpu01", SLURM_RESUME_FILE=str(resume_file)).returncode == EXIT_OK
    [vm] = live_ours(sim)["gpu01"]
    assert guest_put(sim, vm.id, f'SLURM_JOB_IDS="{ids}"') == 200
    failed = run(setup, "slurm-nebula-resume-fail", "gpu01")
    assert failed.returncode == EXIT_OK, failed.stderr
    assert live_ours(sim) == {} and gpu_holders(sim) == {}
    usage = run(setup, "slurm-nebula-power", "usage", "--by", "job", "--json")
    assert usage.returncode == EXIT_OK, usage.stderr
    rows = json.loads(usage.stdout)["rows"]
    assert {r["job"] for r in rows} <= {"7", "-"} and not any(r["still_running"] for r in rows)
    assert json.loads(usage.stdout)["disagreements"] == []


def test_a_vm_made_by_hand_from_the_printed_template_never_becomes_the_nodes(tmp_path, sim, capsys) -> None:
    # issue 34, item 8: the printed template puts the node in CONTEXT and not the cluster; the rule kept for
    # 0.1.0's VMs then trusted USER_TEMPLATE's SLURM_CLUSTER, which the guest writes: resume adopted the VM
    # (and set its address), reconcile would have terminated it
    setup = site(tmp_path / "site", sim, boot_timeout=20, poll_max=0.2)
    by_hand = sim.add_vm(name="gpu01", context={"SLURM_NODENAME": "gpu01", "NETWORK": "YES", "TOKEN": "YES"})
    assert guest_put(sim, by_hand, 'SLURM_CLUSTER="testcluster"\nSLURM_NODENAME="gpu01"') == 200
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    mine = [vm for vm in sim.vms() if vm.name == "gpu01" and vm.id != by_hand and vm.state != S.DONE]
    assert len(mine) == 1, "resume made the node a VM of its own rather than adopting the hand-made one"
    capsys.readouterr()
    assert reconcile.main([], setup.env) == EXIT_OK
    said = capsys.readouterr().out
    assert f"VM {by_hand} (ACTIVE/RUNNING) is named gpu01 but its CONTEXT does not make it ours" in said, said
    assert sim.vm(by_hand).state != S.DONE, "reconcile leaves it alone"
