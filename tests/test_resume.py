"""slurm-nebula-resume against the simulator through real pyone: every plan branch and failure path."""

from __future__ import annotations

import json

import pytest
from simfixtures import AUTH, calls, vms_of
from support import make_setup

from opennebula_sim import states as S
from slurm_nebula_power.cli.main import resume_main
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK, EXIT_USAGE

RUNNING = (3, 3)


def state(vm) -> tuple[int, int]:
    return (vm.state, vm.lcm_state)


def test_resume_creates_tagged_vms_and_sets_node_addresses(sim, setup) -> None:
    assert resume_main(["gpu[01-02]"], setup.env) == EXIT_OK
    addrs = {}
    for node in ("gpu01", "gpu02"):
        [vm] = vms_of(sim, node)
        assert state(vm) == RUNNING
        assert vm.user_template["SLURM_CLUSTER"] == "testcluster"
        assert vm.user_template["SLURM_NODENAME"] == node
        context = vm.template["CONTEXT"]
        assert context["SET_HOSTNAME"] == node and context["SLURM_NODENAME"] == node
        assert context["TOKEN"] == "YES"  # the template's own CONTEXT is kept
        assert vm.pci, "a GPU VM holds a PCI device"
        addrs[node] = vm.ip
    [update] = [u for u in setup.updates() if any(a.startswith("NodeAddr=") for a in u)]
    assert update == ["NodeName=gpu01,gpu02", f"NodeAddr={addrs['gpu01']},{addrs['gpu02']}",
                      "NodeHostname=gpu01,gpu02"]
    assert all(ip.startswith("127.0.1.") for ip in addrs.values())


def test_one_pool_query_plans_all_nodes_and_no_per_node_lookups(sim, setup) -> None:
    assert resume_main(["gpu[01-08]"], setup.env) == EXIT_OK
    assert calls(sim, "one.template.instantiate") == 8
    assert calls(sim, "one.vm.info") == 0
    first = calls(sim, "one.vmpool.infoextended")
    sim.reset_stats()
    # Everything is up now: a second resume plans from one pool query and acts on nothing.
    assert resume_main(["gpu[01-08]"], setup.env) == EXIT_OK
    stats = sim.stats()["calls"]
    assert stats.get("one.vmpool.infoextended") == 2  # the plan, then one look that confirms all running
    assert "one.template.instantiate" not in stats and "one.vm.action" not in stats
    assert first <= 8  # polls while booting do not grow with the node count


@pytest.mark.parametrize("off", ["poweroff", "undeploy", "stop", "suspend"])
def test_resume_of_a_stopped_vm_resumes_it(sim, setup, off) -> None:
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    [vm] = vms_of(sim, "gpu01")
    import pyone

    pyone.OneServer(sim.endpoint, session=AUTH).vm.action(off, vm.id)
    sim.wait_for(lambda: sim.vm(vm.id).state in (S.STOPPED, S.SUSPENDED, S.POWEROFF, S.UNDEPLOYED), 10)
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    [again] = vms_of(sim, "gpu01")
    assert again.id == vm.id and state(again) == RUNNING


def test_failed_vm_is_recreated(sim, setup) -> None:
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    [vm] = vms_of(sim, "gpu01")
    sim.fail_vm(vm.id, lcm="BOOT_FAILURE")
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    [new] = vms_of(sim, "gpu01")
    assert new.id != vm.id and state(new) == RUNNING
    assert sim.vm(vm.id).state == S.DONE
    assert sum(h.gpus_total - h.gpus_free for h in sim.hosts()) == 1  # the failed VM's GPU was freed


def test_foreign_vm_with_the_node_name_is_never_touched(sim, setup) -> None:
    foreign = sim.add_vm(name="gpu01", user_template={}, state="POWEROFF", uid=0)
    other_cluster = sim.add_vm(name="gpu02", user_template={"SLURM_CLUSTER": "other", "SLURM_NODENAME": "gpu02"},
                               state="POWEROFF", uid=0)
    assert resume_main(["gpu[01-02]"], setup.env) == EXIT_OK
    for foreign_id in (foreign, other_cluster):
        fid = foreign_id if isinstance(foreign_id, int) else foreign_id.id
        assert sim.vm(fid).state == S.POWEROFF, "a VM without our tags stays as it was"
    for node in ("gpu01", "gpu02"):
        ours = [v for v in vms_of(sim, node) if v.user_template.get("SLURM_CLUSTER") == "testcluster"]
        assert len(ours) == 1 and state(ours[0]) == RUNNING


def test_job_ids_from_resume_file_22_05_form(sim, setup, tmp_path) -> None:
    resume_file = tmp_path / "resume.json"
    resume_file.write_text(json.dumps({"jobs": [{"job_id": 7, "nodes": "gpu[01-02]"},
                                                {"job_id": 9, "nodes": "gpu02"}], "all_nodes": "gpu[01-02]"}))
    assert resume_main(["gpu[01-02]"], {**setup.env, "SLURM_RESUME_FILE": str(resume_file)}) == EXIT_OK
    assert vms_of(sim, "gpu01")[0].user_template["SLURM_JOB_IDS"] == "7"
    assert vms_of(sim, "gpu02")[0].user_template["SLURM_JOB_IDS"] == "7,9"


def test_job_ids_from_resume_file_23_02_form(sim, setup, tmp_path) -> None:
    resume_file = tmp_path / "resume.json"
    resume_file.write_text(json.dumps({
        "all_nodes_resume": "gpu[01-03]",
        "jobs": [{"job_id": 140814, "nodes_alloc": "gpu[01-04]", "nodes_resume": "gpu[01-03]", "partition": "gpu",
                  "features": "a100", "extra": None, "reservation": None, "oversubscribe": "NO"}]}))
    assert resume_main(["gpu[01-03]"], {**setup.env, "SLURM_RESUME_FILE": str(resume_file)}) == EXIT_OK
    assert [vms_of(sim, f"gpu0{i}")[0].user_template["SLURM_JOB_IDS"] for i in (1, 2, 3)] == ["140814"] * 3


def test_no_free_gpu_is_handed_back_before_any_vm_is_created(tmp_path) -> None:
    from simfixtures import fast_config

    from opennebula_sim import running_simulator

    with running_simulator(fast_config(hosts=1, gpus=2), auth=AUTH) as sim:
        setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=(
            '[[nodeset]]\nnodes = "gpu[01-03]"\ntemplate = "slurm-gpu-worker"\nboot_timeout = 20\n'))
        # One host: resume sends one VM a wave (oned places one per host a plan), so gpu02 goes after
        # gpu01 is placed; 2 s of boot_timeout was too short for that on a loaded machine.
        assert resume_main(["gpu[01-03]"], setup.env) == EXIT_NODES_FAILED
        assert len(sim.vms()) == 2 and all(state(v) == RUNNING for v in sim.vms()), "no VM for gpu03"
        [handback] = [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
        assert handback == ["NodeName=gpu03", "State=POWER_DOWN_FORCE",
                            "Reason=nebula: needs 3 GPUs 10de:0302, 2 free"]
        assert calls(sim, "one.hostpool.info") == 1


def test_boot_failure_is_recreated_then_handed_back(sim, setup) -> None:
    sim.set_faults(boot_failure_rate=1.0)
    assert resume_main(["gpu01"], setup.env) == EXIT_NODES_FAILED
    gpu01 = [v for v in sim.vms() if v.name == "gpu01"]
    assert len(gpu01) == 2, "one recreation (recreate_attempts = 1)"
    assert all(v.state == S.DONE for v in gpu01), "every failed VM is terminated"
    assert all(h.gpus_free == h.gpus_total for h in sim.hosts())
    [handback] = [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
    assert handback[0] == "NodeName=gpu01" and any("failed to boot" in a for a in handback)


def test_transient_faults_are_retried(sim, setup) -> None:
    sim.set_faults(transient_rate=0.3)
    assert resume_main(["gpu[01-04]"], setup.env) == EXIT_OK
    for i in range(1, 5):
        assert len(vms_of(sim, f"gpu0{i}")) == 1, "a retried instantiate never leaves a second VM"
    assert "retrying" in setup.log_text()


def test_authentication_failure_is_not_retried(sim, setup) -> None:
    bad = make_setup(setup.root.parent / "bad", sim.endpoint, "oneadmin:wrong")
    assert resume_main(["gpu01"], bad.env) == EXIT_NODES_FAILED
    assert sum(sim.stats()["calls"].values()) == 1, "no retry on authentication errors"
    assert "retrying" not in bad.log_text()
    [handback] = bad.updates()
    assert handback[0] == "NodeName=gpu01" and "State=POWER_DOWN_FORCE" in handback


def test_unknown_template_hands_back_without_creating_anything(sim, setup) -> None:
    bad = make_setup(setup.root.parent / "bad", sim.endpoint, AUTH, nodesets=(
        '[[nodeset]]\nnodes = "gpu[01-02]"\ntemplate = "no-such-template"\n'))
    assert resume_main(["gpu[01-02]"], bad.env) == EXIT_NODES_FAILED
    assert sim.vms() == []
    [handback] = bad.updates()
    assert handback[0] == "NodeName=gpu[01-02]"
    assert any("no VM template named 'no-such-template'" in a for a in handback)


def test_a_node_slurmctld_powers_up_outside_every_nodeset_is_handed_back_the_rest_proceed(sim, setup) -> None:
    setup.set_nodes("NodeName=other7 State=IDLE+CLOUD+POWERING_UP Reason=x\n"
                    "NodeName=gpu01 State=IDLE+CLOUD+POWERING_UP Reason=\n")
    assert resume_main(["gpu01,other7"], setup.env) == EXIT_NODES_FAILED
    assert len(vms_of(sim, "gpu01")) == 1 and not vms_of(sim, "other7")
    assert "other7 is in no [[nodeset]]" in setup.log_text()
    assert ["NodeName=other7", "State=POWER_DOWN_FORCE",
            "Reason=nebula: not in any nodeset of nebula-power.toml"] in setup.updates()


@pytest.mark.parametrize("shown", ["", "NodeName=login01 State=IDLE Reason=x\n",
                                   "NodeName=login01 State=IDLE+CLOUD+POWERED_DOWN Reason=x\n"],
                         ids=["unknown-to-slurm", "static-idle", "cloud-powered-down"])
def test_a_node_in_no_nodeset_that_slurmctld_is_not_powering_up_is_an_error_and_nothing_is_done(
        sim, setup, capsys, shown: str) -> None:
    # issue 25: `slurm-nebula-resume login01` by hand forced a static IDLE node down (POWER_DOWN_FORCE)
    setup.set_nodes(shown)
    assert resume_main(["gpu01,login01"], setup.env) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "login01: in no [[nodeset]] of" in err and "(node sets: gpu[01-08], cpu[01-04])" in err
    assert "nothing done" in err and len(err.strip().splitlines()) == 1
    assert sim.vms() == [] and setup.updates() == [], "no VM made, no node forced down"


def test_newer_slurm_hands_back_with_power_down_force_too(tmp_path) -> None:
    from simfixtures import fast_config

    from opennebula_sim import running_simulator

    with running_simulator(fast_config(), auth=AUTH) as sim:
        setup = make_setup(tmp_path / "site", sim.endpoint, AUTH)
        setup.set_version("slurm 23.11.4")
        sim.set_faults(boot_failure_rate=1.0)
        assert resume_main(["gpu01"], setup.env) == EXIT_NODES_FAILED
        [handback] = [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
        assert handback[0] == "NodeName=gpu01" and not [a for a in handback if a.startswith("ResumeAfter")]


def test_slurm_23_11_records_the_vm_id_as_instance_id(sim, setup) -> None:
    setup.set_version("slurm 23.11.4")
    assert resume_main(["gpu[01-02]"], setup.env) == EXIT_OK
    for node in ("gpu01", "gpu02"):
        [vm] = vms_of(sim, node)
        assert [f"NodeName={node}", f"InstanceId={vm.id}", "InstanceType=opennebula"] in setup.updates()


def test_slurm_22_05_gets_no_instance_id(sim, setup) -> None:
    assert resume_main(["gpu[01-02]"], setup.env) == EXIT_OK
    assert not [u for u in setup.updates() if any(a.startswith("InstanceId=") for a in u)]
