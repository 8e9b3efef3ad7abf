"""slurm-nebula-power status: Slurm's view and OpenNebula's per node, and what is wrong."""

from __future__ import annotations

import json

import pytest
from opsupport import boot_node, ours_vm, real_site, show
from simfixtures import AUTH, fast_config
from support import make_setup

from slurm_nebula_power import drift, statustable
from slurm_nebula_power.cli import status
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK, EXIT_USAGE
from slurm_nebula_power.model import ACTIVE, RUNNING_LCM, Vm
from slurm_nebula_power.nodestate import NodeState

ORPHAN = "VM ACTIVE/RUNNING but node powered down (within reconcile_grace 300s)"


def rows(capsys, env, *args: str) -> tuple[int, dict[str, dict]]:
    code = status.main(["--json", *args], env)
    return code, {r["node"]: r for r in json.loads(capsys.readouterr().out)}


def test_table_has_one_row_per_node_with_every_column(sim, setup, capsys) -> None:
    vm_id = sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="RUNNING")
    setup.set_nodes(show("gpu01 State=IDLE+CLOUD NodeAddr=127.0.1.1", "gpu02 State=IDLE+CLOUD+POWERED_DOWN"))
    assert status.main(["gpu[01-02]"], setup.env) == EXIT_OK
    header, gpu01, gpu02, placement, footer = capsys.readouterr().out.splitlines()
    assert header.split() == ["NODE", "SLURM", "VM", "STATE", "IP", "HOST", "AGE", "PROBLEM"]
    assert gpu01.split()[:6] == ["gpu01", "IDLE+CLOUD", str(vm_id), "ACTIVE/RUNNING", "127.0.1.1",
                                 "gpu-host-01"]
    assert gpu01.split()[6].endswith("s"), "an age such as 0s"
    assert gpu02.split() == ["gpu02", "IDLE+CLOUD+POWERED_DOWN", "-", "-", "-", "-", "-"]
    assert placement == "Placement: gpu[01-08] scheduler, cpu[01-04] scheduler"
    assert footer.startswith("PrologSlurmctld: not set, not slurm-nebula-prolog: a job starts only at")


def test_footer_says_whether_the_prolog_is_ours(sim, setup, capsys) -> None:
    conf = setup.root / "slurm.conf"
    conf.write_text(conf.read_text() + "PrologSlurmctld=/opt/snp/bin/slurm-nebula-prolog\n")
    setup.set_nodes("")
    status.main(["gpu01"], setup.env)
    footer = capsys.readouterr().out.splitlines()[-1]
    assert footer == ("PrologSlurmctld: slurm-nebula-prolog (a job starts as soon as its cloud nodes are "
                      "up)")
    conf.write_text(conf.read_text().replace("/opt/snp/bin/slurm-nebula-prolog", "/etc/slurm/site.sh"))
    status.main(["gpu01"], setup.env)
    assert capsys.readouterr().out.splitlines()[-1].startswith("PrologSlurmctld: /etc/slurm/site.sh, not "
                                                                "slurm-nebula-prolog")
    status.main(["--json", "gpu01"], setup.env)
    assert json.loads(capsys.readouterr().out)[0]["node"] == "gpu01", "JSON stays a list of rows"


def test_json_rows_name_states_in_words(sim, setup, capsys) -> None:
    sim.set_durations(boot=60)
    vm_id = sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="BOOT")
    setup.set_nodes(show("gpu01 State=ALLOCATED+CLOUD+POWERING_UP"))
    code, found = rows(capsys, setup.env, "gpu01")
    assert code == EXIT_OK
    assert found["gpu01"] == {
        "node": "gpu01", "nodeset": "gpu[01-08]", "placement": "scheduler",
        "slurm_state": "ALLOCATED+CLOUD+POWERING_UP", "slurm_reason": "", "vm_id": vm_id, "vm_ids": [vm_id],
        "vm_state": "ACTIVE", "lcm_state": "BOOT",
        "ip": "127.0.1.1", "host": "gpu-host-01", "age_seconds": found["gpu01"]["age_seconds"],
        "problems": []}
    assert isinstance(found["gpu01"]["age_seconds"], int)


def test_vm_running_while_node_powered_down_is_a_problem(sim, setup, capsys) -> None:
    sim.add_vm(name="gpu03", **ours_vm("gpu03"), state="RUNNING")
    setup.set_nodes(show("gpu03 State=IDLE+CLOUD+POWERED_DOWN"))
    code, found = rows(capsys, setup.env, "gpu03")
    assert code == EXIT_NODES_FAILED
    assert found["gpu03"]["problems"] == [ORPHAN]


def test_node_powering_up_with_vm_pending_for_lack_of_a_gpu(tmp_path, capsys) -> None:
    from opennebula_sim import running_simulator

    with running_simulator(fast_config(hosts=1, gpus=0), auth=AUTH) as sim:
        site = make_setup(tmp_path / "site", sim.endpoint, AUTH)
        sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="PENDING")
        sim.wait_for(lambda: "SCHED_MESSAGE" in sim.vm(0).user_template)
        site.set_nodes(show("gpu01 State=ALLOCATED+CLOUD+POWERING_UP"))
        code, found = rows(capsys, site.env, "gpu01")
    assert code == EXIT_NODES_FAILED
    assert found["gpu01"]["problems"] == ["node powering up, VM PENDING: no host can take the VM (oned: Cannot "
                                          "allocate VM. Not enough capacity in hosts 0)"]


@pytest.mark.parametrize(("state", "vm_state", "problem"), [
    ("IDLE+CLOUD", None, "node up in Slurm but it has no VM"),
    ("MIXED+CLOUD", "BOOT_FAILURE", "node up but VM failed (ACTIVE/BOOT_FAILURE)"),
    ("IDLE+CLOUD+NOT_RESPONDING", "POWEROFF", "node up but VM POWEROFF"),
    ("DOWN+CLOUD+POWERED_DOWN Reason=ResumeTimeout reached", None, "Slurm DOWN: ResumeTimeout reached"),
    ("IDLE+DRAIN+CLOUD Reason=nebula: bad GPU", "RUNNING", "Slurm DRAIN: nebula: bad GPU"),
])
def test_what_is_wrong(sim, setup, capsys, state: str, vm_state: str | None, problem: str) -> None:
    if vm_state:
        sim.add_vm(name="gpu04", **ours_vm("gpu04"), state=vm_state)
    setup.set_nodes(show(f"gpu04 State={state}"))
    code, found = rows(capsys, setup.env, "gpu04")
    assert code == EXIT_NODES_FAILED
    assert found["gpu04"]["problems"] == [problem]


def test_address_mismatch_is_shown(sim, setup, capsys) -> None:
    sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="RUNNING")
    setup.set_nodes(show("gpu01 State=IDLE+CLOUD NodeAddr=127.0.9.9"))
    _, found = rows(capsys, setup.env, "gpu01")
    assert found["gpu01"]["problems"] == ["Slurm NodeAddr 127.0.9.9 but VM IP 127.0.1.1"]


def test_poweroff_vm_of_a_poweroff_node_set_is_not_a_problem(sim, setup, capsys) -> None:
    sim.add_vm(name="cpu01", **ours_vm("cpu01"), state="POWEROFF", template_id=1)
    setup.set_nodes(show("cpu01 State=IDLE+CLOUD+POWERED_DOWN"))
    code, found = rows(capsys, setup.env, "cpu01")
    assert (code, found["cpu01"]["problems"]) == (EXIT_OK, [])


def test_a_vm_named_like_a_node_failing_identity_is_a_problem_and_a_stray_vm_of_ours_is_listed(
        sim, setup, capsys) -> None:
    foreign = sim.add_vm(name="gpu05", user_template={}, state="RUNNING")  # same name, no identity
    stray = sim.add_vm(name="old7", **ours_vm("old7"), state="RUNNING")
    setup.set_nodes(show(*(f"gpu0{i} State=IDLE+CLOUD+POWERED_DOWN" for i in range(1, 9)),
                         *(f"cpu0{i} State=IDLE+CLOUD+POWERED_DOWN" for i in range(1, 5))))
    code, found = rows(capsys, setup.env)
    assert found["gpu05"]["vm_id"] is None
    assert found["gpu05"]["problems"] == [f"VM {foreign} (ACTIVE/RUNNING) is named gpu05 but its CONTEXT does not "
                                          "make it ours (made by hand, or not by this cluster): left alone, remove "
                                          "it with onevm terminate if it is a leak"]
    assert found["old7"]["vm_id"] == stray
    assert found["old7"]["problems"] == [f"VM {stray} tagged for this cluster but the node is in no "
                                         "[[nodeset]]: left alone"]
    assert code == EXIT_NODES_FAILED and len(found) == 13


def test_two_vms_for_one_node_are_shown(sim, setup, capsys) -> None:
    first = sim.add_vm(name="gpu02", **ours_vm("gpu02"), state="RUNNING")
    second = sim.add_vm(name="gpu02", **ours_vm("gpu02"), state="POWEROFF")
    setup.set_nodes(show("gpu02 State=IDLE+CLOUD"))
    _, found = rows(capsys, setup.env, "gpu02")
    assert found["gpu02"]["vm_id"] == first, "the running one counts"
    assert found["gpu02"]["problems"] == [f"2 VMs for one node: {first}, {second}"]


def test_node_unknown_to_slurm(sim, setup, capsys) -> None:
    setup.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN"))
    _, found = rows(capsys, setup.env, "gpu02")
    assert found["gpu02"]["problems"][0].startswith("unknown to slurmctld")


def test_without_a_controller_the_table_still_shows_the_vms(sim, setup, capsys) -> None:
    sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="RUNNING")
    (setup.scontrol_dir / "scontrol.rc").write_text("1")
    code = status.main(["gpu01"], setup.env)
    out, err = capsys.readouterr()
    assert code == EXIT_OK
    assert "Slurm state unavailable" in err
    assert out.splitlines()[1].split()[:4] == ["gpu01", "?", "0", "ACTIVE/RUNNING"]


def test_no_slurm_option_never_runs_scontrol(sim, setup, capsys) -> None:
    assert status.main(["--no-slurm", "gpu01"], setup.env) == EXIT_OK
    assert setup.scontrol_calls() == []
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["gpu01", "n/a"]


def test_one_pool_query_and_one_host_pool_query(sim, setup, capsys) -> None:
    setup.set_nodes("")
    status.main([], setup.env)
    # the host pool: which VMs run on hosts in maintenance (drift.py)
    assert sim.stats()["calls"] == {"one.vmpool.infoextended": 1, "one.hostpool.info": 1}


def test_bad_hostlist_is_a_usage_error(sim, setup, capsys) -> None:
    assert status.main(["gpu[01-"], setup.env) == EXIT_USAGE
    assert "malformed hostlist" in capsys.readouterr().err


def test_unreachable_endpoint_exits_4(tmp_path, capsys) -> None:
    site = make_setup(tmp_path / "site", "http://127.0.0.1:9/RPC2", AUTH, extra="")
    (site.config).write_text(site.config.read_text().replace("retry_seconds = 10", "retry_seconds = 0.5"))
    assert status.main(["--no-slurm"], site.env) == 4
    assert "connection failed" in capsys.readouterr().err


@pytest.mark.parametrize(("seconds", "text"), [(None, "-"), (0, "0s"), (59, "59s"), (61, "1m01s"),
                                               (7260, "2h01m"), (90000, "1d01h")])
def test_age(seconds, text: str) -> None:
    assert statustable.age(seconds) == text


@pytest.mark.parametrize(("state", "where"), [
    ("IDLE+CLOUD+POWERED_DOWN", "off"), ("DOWN+CLOUD+POWERED_DOWN", "off"),
    ("IDLE+CLOUD+POWERING_DOWN", "stopping"),
    ("IDLE+CLOUD+POWER_DOWN", "stopping"), ("ALLOCATED+CLOUD+POWERING_UP", "starting"),
    ("IDLE+CLOUD+NOT_RESPONDING+POWERING_UP", "starting"), ("MIXED+CLOUD", "up"), ("IDLE*+CLOUD", "up"),
    ("DOWN+CLOUD", "other"), ("FUTURE+CLOUD", "other"),
])
def test_phase(state: str, where: str) -> None:
    assert NodeState("n", state).phase == where


def test_diagnose_respects_grace_by_vm_age() -> None:
    from slurm_nebula_power.config import NodeSet

    vm = Vm(id=1, name="n1", state=ACTIVE, lcm_state=RUNNING_LCM, stime=1000)
    off = NodeState("n1", "IDLE+CLOUD+POWERED_DOWN")
    view = drift.NodeView("n1", NodeSet("n1", ("n1",), "t"), off, [vm])
    assert drift.diagnose(view, now=1100, grace=300).repair is None
    late = drift.diagnose(view, now=1400, grace=300)
    assert late.repair is not None and late.repair.terminate == (vm,) and not late.repair.hand_back


@pytest.mark.parametrize(("message", "problems", "why"), [
    # 7.4.0 and 7.0.2 on a burst, GPUs free: the VM waits for a later placement plan, no problem
    ("Tue Dec  1 08:53:32 2026: [HOST] Dispatch limit reached on hosts: 0,1,2", [],
     ", waiting for oned's scheduler (oned: [HOST] Dispatch limit reached on hosts: 0,1,2)"),
    ("Tue Dec  1 08:58:02 2026: Cannot dispatch VM to any Host. Possible reasons: Not enough capacity in Host "
     "or System DS, dispatch...", [], ", waiting for oned's scheduler (oned: Cannot dispatch VM to any Host. "
     "Possible reasons: Not enough capacity in Host or System DS, dispatch...)"),
    # a real shortage: "no free GPU" only where oned names the PCI devices
    ("Mon Nov 30 10:00:00 2026: [HOST] Unavailable PCI devices on hosts: 0,1",
     ["node powering up, VM PENDING: no free GPU (oned: [HOST] Unavailable PCI devices on hosts: 0,1)"],
     ": no free GPU (oned: [HOST] Unavailable PCI devices on hosts: 0,1)"),
    ("Mon Nov 30 10:00:00 2026: Cannot allocate VM. Not enough capacity in hosts 0,1",
     ["node powering up, VM PENDING: no host can take the VM (oned: Cannot allocate VM. Not enough capacity "
      "in hosts 0,1)"], ": no host can take the VM (oned: Cannot allocate VM. Not enough capacity in hosts 0,1)"),
])
def test_a_pending_vm_is_described_in_oned_s_words(message: str, problems: list[str], why: str) -> None:
    from slurm_nebula_power.config import NodeSet
    from slurm_nebula_power.model import PENDING

    vm = Vm(id=1, name="n1", state=PENDING, lcm_state=0, stime=1000, user_template={"SCHED_MESSAGE": message})
    starting = NodeState("n1", "ALLOCATED+CLOUD+POWERING_UP")
    view = drift.NodeView("n1", NodeSet("n1", ("n1",), "t", boot_timeout=600), starting, [vm])
    assert list(drift.diagnose(view, now=1100, grace=300).problems) == problems
    late = drift.diagnose(view, now=2000, grace=300)  # past boot_timeout: the repair's reason says why
    assert late.repair is not None and late.repair.reason == f"VM PENDING past boot_timeout 600s{why}"


# ---- the real controller ----------------------------------------------------------------------------


@pytest.mark.slurm
def test_status_against_the_real_controller(sim, tmp_path, slurm_factory, capsys) -> None:
    cluster = slurm_factory(nodes=["gpu01", "gpu02", "gpu03"], suspend_time=3600)
    site = real_site(tmp_path / "site", sim, cluster, '[[nodeset]]\nnodes = "gpu[01-03]"\n'
                     'template = "slurm-gpu-worker"\n')
    orphan = sim.add_vm(name="gpu01", **ours_vm("gpu01", "cloudtest"))
    boot_node(cluster, "gpu02", "127.0.1.2")
    code, found = rows(capsys, {"SLURM_NEBULA_POWER_CONFIG": str(site.config)})
    assert code == EXIT_NODES_FAILED
    assert found["gpu01"]["slurm_state"] == "IDLE+CLOUD+POWERED_DOWN" and found["gpu01"]["vm_id"] == orphan
    assert found["gpu01"]["problems"] == [ORPHAN]
    assert found["gpu02"]["slurm_state"] == "IDLE+CLOUD"
    assert found["gpu02"]["problems"] == ["node up in Slurm but it has no VM"]
    assert (found["gpu03"]["slurm_state"], found["gpu03"]["problems"]) == ("IDLE+CLOUD+POWERED_DOWN", [])


@pytest.mark.parametrize("state", ["DOWN+CLOUD", "DOWN*+CLOUD", "IDLE*+DRAIN+CLOUD"])
def test_a_down_or_drained_node_is_a_problem_also_when_not_responding(sim, setup, capsys, state) -> None:
    # scontrol appends '*' to the base state of a node that does not respond: DOWN* is the DOWN that
    # matters most (its slurmd is gone), and status once missed it.
    sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="RUNNING")
    setup.set_nodes(show(f"gpu01 State={state} Reason=Not_responding"))
    code, found = rows(capsys, setup.env, "gpu01")
    assert code == EXIT_NODES_FAILED
    word = "DRAIN" if "DRAIN" in state else "DOWN"
    assert f"Slurm {word}: Not_responding" in found["gpu01"]["problems"]


def test_status_says_who_places_each_node_sets_vms(sim, tmp_path, capsys) -> None:
    nodesets = ('[[nodeset]]\nnodes = "gpu[01-02]"\ntemplate = "slurm-gpu-worker"\nplacement = "direct"\n\n'
                '[[nodeset]]\nnodes = "cpu01"\ntemplate = "slurm-cpu-worker"\n')
    setup = make_setup(tmp_path / "direct", sim.endpoint, AUTH, nodesets)
    setup.set_nodes("")
    status.main(["gpu01"], setup.env)
    placement = capsys.readouterr().out.splitlines()[-2]
    assert placement == ("Placement: gpu[01-02] direct, cpu01 scheduler (direct: resume deploys each VM to a host "
                         "it chose)")
    _, found = rows(capsys, setup.env, "gpu01,cpu01")
    assert (found["gpu01"]["placement"], found["cpu01"]["placement"]) == ("direct", "scheduler")
