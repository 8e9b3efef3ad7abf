"""slurm-nebula-resume with `placement = "direct"` against the simulator through real pyone: resume places each
VM itself (instantiate on hold, deploy with enforce to a host it chose), jobs first, a job's nodes together,
and a refused deploy moves the VM elsewhere or hands it to oned's scheduler, never leaves it on hold."""

from __future__ import annotations

import json
import textwrap

import pytest
from simfixtures import AUTH, calls, fast_config, vms_of
from support import make_setup

from opennebula_sim import Durations, HostSpec, SimConfig, running_simulator
from opennebula_sim import states as S
from opennebula_sim.config import TemplateSpec, default_pci
from slurm_nebula_power.cli.main import resume_main
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK

RUNNING = (3, 3)
GPU = '''CPU = "8"
VCPU = "8"
MEMORY = "65536"
PCI = [ VENDOR = "10de", CLASS = "0302" ]
NIC = [ NETWORK = "slurm-net" ]
CONTEXT = [ NETWORK = "YES", SET_HOSTNAME = "$NAME" ]
'''


def nodeset(placement: str = "direct", extra: str = "", template: str = "slurm-gpu-worker",
            nodes: str = "gpu[01-16]") -> str:
    return textwrap.dedent(f"""\
        [[nodeset]]
        nodes = "{nodes}"
        template = "{template}"
        boot_timeout = 20
        pending_timeout = 3
        placement = "{placement}"
        """) + extra


def direct_setup(tmp_path, sim, extra: str = "", **kw):
    return make_setup(tmp_path / "site", sim.endpoint, AUTH, nodeset(extra=extra, **kw))


def resume_file(tmp_path, jobs: list[tuple[int, str]]) -> str:
    path = tmp_path / "resume.json"
    path.write_text(json.dumps({"all_nodes_resume": ",".join(n for _, n in jobs),
                                "jobs": [{"job_id": job, "nodes_resume": nodes} for job, nodes in jobs]}))
    return str(path)


def state(vm) -> tuple[int, int]:
    return (vm.state, vm.lcm_state)


def hosts_of(sim, nodes) -> dict[str, str]:
    return {node: vms_of(sim, node)[0].host for node in nodes}


def test_direct_placement_deploys_each_vm_to_a_host_it_chose(tmp_path, sim) -> None:
    setup = direct_setup(tmp_path, sim)
    assert resume_main(["gpu[01-06]"], setup.env) == EXIT_OK
    stats = sim.stats()["calls"]
    assert stats["one.vm.deploy"] == 6 and stats["one.template.instantiate"] == 6
    assert "one.vm.action" not in stats  # nothing released: every VM went where resume sent it
    for node in [f"gpu0{i}" for i in range(1, 7)]:
        [vm] = vms_of(sim, node)
        assert state(vm) == RUNNING and vm.pci and vm.host is not None
    # pack: 4 GPUs a host, so the first host is full before the second is used
    placed = sorted(hosts_of(sim, [f"gpu0{i}" for i in range(1, 7)]).values())
    assert placed == ["gpu-host-01"] * 4 + ["gpu-host-02"] * 2
    assert "direct placement on 4 of 4 hosts" in setup.log_text()


def test_the_scheduler_places_by_default(tmp_path, sim) -> None:
    setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodeset(placement="scheduler"))
    assert resume_main(["gpu[01-02]"], setup.env) == EXIT_OK
    assert calls(sim, "one.vm.deploy") == 0
    assert all(state(vms_of(sim, n)[0]) == RUNNING for n in ("gpu01", "gpu02"))


def test_a_jobs_nodes_go_to_one_host_and_the_earliest_job_first(tmp_path, sim) -> None:
    setup = direct_setup(tmp_path, sim)
    # job 7 (first in the file) wants 3 nodes, job 8 two; the hostlist order puts job 8's nodes first
    env = {**setup.env, "SLURM_RESUME_FILE": resume_file(tmp_path, [(7, "gpu[03-05]"), (8, "gpu[01-02]")])}
    assert resume_main(["gpu[01-05]"], env) == EXIT_OK
    placed = hosts_of(sim, ["gpu01", "gpu02", "gpu03", "gpu04", "gpu05"])
    assert placed["gpu03"] == placed["gpu04"] == placed["gpu05"] == "gpu-host-01"  # first job, first host
    assert placed["gpu01"] == placed["gpu02"] == "gpu-host-02"  # 1 GPU left on host 01: job 8 goes together
    assert min(sim.vms(), key=lambda vm: vm.id).name == "gpu03"  # the first VM sent is the first job's


def test_a_gpu_another_user_takes_after_the_read_moves_the_vm_to_another_host(tmp_path, sim) -> None:
    setup = direct_setup(tmp_path, sim)
    # between resume's host pool read and its deploy, another user takes a GPU of the first host
    sim.after_call("one.hostpool.info", lambda: [sim.add_vm(name="theirs", uid=7, host="gpu-host-01")
                                                  for _ in range(4)])
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    [vm] = vms_of(sim, "gpu01")
    assert state(vm) == RUNNING and vm.host == "gpu-host-02" and vm.pci
    assert calls(sim, "one.vm.deploy") == 2  # refused on host 01, then accepted on host 02
    assert "does not fit in host [0]. Unavailable PCI device." in setup.log_text()


def test_a_refused_deploy_without_room_elsewhere_goes_to_the_scheduler_never_on_hold(tmp_path) -> None:
    with running_simulator(fast_config(hosts=1, gpus=1), auth=AUTH) as sim:
        setup = direct_setup(tmp_path, sim)
        taken = []
        sim.after_call("one.hostpool.info", lambda: taken.append(sim.add_vm(name="theirs", uid=7)))
        assert resume_main(["gpu01"], setup.env) == EXIT_NODES_FAILED  # no GPU: pending_timeout hands it back
        assert not [vm for vm in sim.vms() if vm.state == S.HOLD]
        assert calls(sim, "one.vm.deploy") == 1
        assert "released to oned's scheduler: no host in the host pool read has room" in setup.log_text()


def test_without_the_deploy_right_the_scheduler_places_and_the_log_says_why(tmp_path) -> None:
    with running_simulator(fast_config(), auth="slurm:Plain-pass-1") as sim:
        setup = make_setup(tmp_path / "site", sim.endpoint, "slurm:Plain-pass-1", nodeset())
        assert resume_main(["gpu[01-04]"], setup.env) == EXIT_OK
        assert all(state(vms_of(sim, f"gpu0{i}")[0]) == RUNNING for i in range(1, 5))
        assert calls(sim, "one.vm.deploy") == 1  # the first VM tells: the others go to the scheduler, paced
        assert calls(sim, "one.vm.action") == 1  # that first VM released from hold
        log = setup.log_text()
        assert "user slurm may not deploy" in log and "Not authorized to perform ADMIN VM" in log
        assert not [vm for vm in sim.vms() if vm.state == S.HOLD]


def test_without_the_deploy_right_a_node_set_met_after_the_refusal_deploys_nothing_either(tmp_path) -> None:
    # the refusal used to reach only the node sets seen so far: each later one paid an instantiate on hold
    # and a refused deploy of its own, and its first VM was released as "no host ... has room"
    sets = nodeset(nodes="gpu[01-04]") + nodeset(nodes="gpu[05-08]")
    with running_simulator(fast_config(), auth="slurm:Plain-pass-1") as sim:
        setup = make_setup(tmp_path / "site", sim.endpoint, "slurm:Plain-pass-1", sets)
        assert resume_main(["gpu[01-02,05-06]"], setup.env) == EXIT_OK
        assert calls(sim, "one.vm.deploy") == 1 and calls(sim, "one.vm.action") == 1
        assert not [vm for vm in sim.vms() if vm.state == S.HOLD]
        assert "no host in the host pool read has room" not in setup.log_text()


def test_a_deploy_refused_for_a_missing_datastore_tries_the_next_host(tmp_path, sim, monkeypatch) -> None:
    # oned's NO_EXISTS names what is missing: only "virtual machine" means the VM is gone; a datastore (or
    # host) removed meanwhile left the VM on hold until boot_timeout
    from slurm_nebula_power.cloud import OneCloud
    from slurm_nebula_power.errors import VmNotFound

    real, refused = OneCloud.deploy, []

    def deploy(self, vm_id: int, host_id: int) -> None:
        if not refused:
            refused.append(host_id)
            raise VmNotFound("[one.vm.deploy] Error getting datastore [0].")
        real(self, vm_id, host_id)

    monkeypatch.setattr(OneCloud, "deploy", deploy)
    setup = direct_setup(tmp_path, sim)
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    [vm] = vms_of(sim, "gpu01")
    assert state(vm) == RUNNING and vm.host != f"gpu-host-{refused[0] + 1:02d}"
    assert "Error getting datastore [0]" in setup.log_text()


def test_the_deploy_right_granted_in_the_user_template_is_enough(tmp_path) -> None:
    with running_simulator(fast_config(), auth="slurm:Plain-pass-1") as sim:
        sim.set_user_template(VM_MANAGE_OPERATIONS="deploy")
        setup = make_setup(tmp_path / "site", sim.endpoint, "slurm:Plain-pass-1", nodeset())
        assert resume_main(["gpu[01-04]"], setup.env) == EXIT_OK
        assert calls(sim, "one.vm.deploy") == 4 and calls(sim, "one.vm.action") == 0


def test_sched_requirements_are_respected(tmp_path) -> None:
    cfg = fast_config(templates=(TemplateSpec(0, "slurm-gpu-worker", GPU + 'SCHED_REQUIREMENTS = "ID > 1"\n'),))
    with running_simulator(cfg, auth=AUTH) as sim:
        setup = direct_setup(tmp_path, sim)
        assert resume_main(["gpu[01-05]"], setup.env) == EXIT_OK
        placed = hosts_of(sim, [f"gpu0{i}" for i in range(1, 6)])
        assert set(placed.values()) == {"gpu-host-03", "gpu-host-04"}
        assert "direct placement on 2 of 4 hosts" in setup.log_text()


@pytest.mark.parametrize(("attribute", "why"), [
    # CURRENT_VMS is the host's VMS/ID list (false on a host with none, for oned too): the | keeps every host
    ('SCHED_REQUIREMENTS = "CURRENT_VMS != 3 | ID > -1"', "attribute 'CURRENT_VMS'"),
    ('SCHED_DS_REQUIREMENTS = "ID = 0"', "SCHED_DS_REQUIREMENTS"),
    ('VMGROUP = [ VMGROUP_ID = "0", ROLE = "a" ]', "VMGROUP affinity"),
])
def test_a_template_we_cannot_honour_is_left_to_the_scheduler(tmp_path, attribute, why) -> None:
    cfg = fast_config(templates=(TemplateSpec(0, "slurm-gpu-worker", GPU + attribute + "\n"),))
    with running_simulator(cfg, auth=AUTH) as sim:
        setup = direct_setup(tmp_path, sim)
        assert resume_main(["gpu[01-03]"], setup.env) == EXIT_OK
        assert all(state(vms_of(sim, f"gpu0{i}")[0]) == RUNNING for i in range(1, 4))
        assert calls(sim, "one.vm.deploy") == 0
        assert f"the template asks for {why}" in setup.log_text()


def test_a_host_disabled_after_the_placement_moves_the_node_elsewhere(tmp_path, sim) -> None:
    setup = direct_setup(tmp_path, sim)
    # oned accepts a deploy to a DISABLED host: disabled right after resume read the pool, before it deploys
    sim.after_call("one.hostpool.info", lambda: sim.set_host_state("gpu-host-01", "DISABLED"))
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    [vm] = vms_of(sim, "gpu01")
    assert state(vm) == RUNNING and vm.host == "gpu-host-02"
    assert "its host left service after we placed it there" in setup.log_text()


def test_a_vm_that_got_no_device_is_made_again(tmp_path, sim) -> None:
    """oned accepted two deploys to one last device at once; the VM that lost it runs without a GPU."""
    setup = direct_setup(tmp_path, sim)

    def race() -> None:  # another client deploys our VM without enforce onto a full host... as oned's race does
        import xmlrpc.client
        [vm] = [v for v in sim.vms() if v.name == "gpu01" and v.state == S.HOLD]
        for _ in range(4):
            sim.add_vm(name="theirs", uid=7, host="gpu-host-01")
        xmlrpc.client.ServerProxy(sim.endpoint).one.vm.deploy(AUTH, vm.id, 0, False, -1)

    sim.after_call("one.vm.info", race)  # after resume read the first VM's needs, before its own deploy
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    [vm] = vms_of(sim, "gpu01")
    assert state(vm) == RUNNING and vm.pci and vm.host == "gpu-host-02"
    assert "without a host device for its PCI entries" in setup.log_text()


def test_nodes_no_host_has_room_for_go_to_the_scheduler_paced_not_released(tmp_path) -> None:
    """The GPU count admits 12 nodes (16 GPUs free), but the hosts' CPU takes 8 VMs: resume deploys 8 and sends
    the other 4 to oned's scheduler in its waves, instead of making them on hold and releasing them at once."""
    hosts = tuple(HostSpec(name=f"gpu-host-0{i}", cpu=1600, pci=default_pci(4, 1)) for i in range(1, 5))
    with running_simulator(SimConfig(hosts=hosts, durations=Durations(0, 0, 0, 0)), auth=AUTH) as sim:
        setup = direct_setup(tmp_path, sim, extra='job_policy = "best-effort"\n')
        assert resume_main(["gpu[01-12]"], setup.env) == EXIT_NODES_FAILED
        assert calls(sim, "one.vm.deploy") == 8 and calls(sim, "one.vm.action") == 4  # the 4 removed at the end
        log = setup.log_text()
        assert "released to oned's scheduler" not in log
        running = [vm for vm in sim.vms() if vm.state_str == "RUNNING"]
        assert len(running) == 8
        assert "8 done, 4 failed (not placed within pending_timeout 3s although 8 free" in log
