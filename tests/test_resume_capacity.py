"""GPU-aware resume against the simulator: the capacity count before instantiating, pending_timeout, the
job policy (all-or-nothing / best-effort) and the shortage cooldown (issue 16)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from simfixtures import AUTH, calls, fast_config, vms_of
from support import Setup, make_setup

from opennebula_sim import Durations, HostSpec, SimConfig, Simulator, running_simulator
from opennebula_sim import states as S
from opennebula_sim.config import default_pci
from slurm_nebula_power.cli.common import build_context
from slurm_nebula_power.cli.main import resume_main
from slurm_nebula_power.config import load_config
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK
from slurm_nebula_power.resume import resume

BOOT_TIMEOUT = 300  # every hand-back below names its cause (the count, pending_timeout), never boot_timeout


def nodeset(policy: str | None = None, pending_timeout: float = 1) -> str:
    extra = f'job_policy = "{policy}"\n' if policy else ""
    return (f'[[nodeset]]\nnodes = "gpu[01-08]"\ntemplate = "slurm-gpu-worker"\nboot_timeout = {BOOT_TIMEOUT}\n'
            f"pending_timeout = {pending_timeout}\n{extra}")


@pytest.fixture
def sim() -> Iterator[Simulator]:
    """One host with 4 GPUs."""
    with running_simulator(fast_config(hosts=1, gpus=4), auth=AUTH) as handle:
        yield handle


def site(tmp_path: Path, sim: Simulator, policy: str | None = None, extra: str = "") -> Setup:
    return make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=nodeset(policy), extra=extra)


def resume_file(tmp_path: Path, jobs: dict[int, str]) -> dict[str, str]:
    path = tmp_path / "resume.json"
    path.write_text(json.dumps({"jobs": [{"job_id": j, "nodes": n} for j, n in jobs.items()],
                                "all_nodes": ",".join(jobs.values())}))
    return {"SLURM_RESUME_FILE": str(path)}


def handbacks(setup: Setup) -> dict[str, str]:
    """node list -> Reason of every hand-back."""
    out = {}
    for update in setup.updates():
        if "State=POWER_DOWN_FORCE" in update or "State=DOWN" in update:
            out[update[0].removeprefix("NodeName=")] = next(a for a in update if a.startswith("Reason="))
    return out


def ours_holding_gpus(sim: Simulator) -> list[int]:
    return [vm for h in sim.hosts() for vm in h.gpu_holders.values() if vm is not None
            and sim.vm(vm).user_template.get("SLURM_CLUSTER") == "testcluster"]


def take_gpus(sim: Simulator, count: int) -> list[int]:
    """Someone else's GPU VMs (no tags of ours), running now."""
    return [sim.add_vm(name=f"other{i}", uid=7, state="RUNNING") for i in range(count)]


def test_a_4_node_job_on_3_free_gpus_is_handed_back_whole_with_no_vm_created(tmp_path, sim) -> None:
    take_gpus(sim, 1)
    setup = site(tmp_path, sim)
    env = {**setup.env, **resume_file(tmp_path, {7: "gpu[01-04]"})}
    assert resume_main(["gpu[01-04]"], env) == EXIT_NODES_FAILED
    assert handbacks(setup) == {"gpu[01-04]": "Reason=nebula: job 7: needs 4 GPUs 10de:0302, 3 free"}
    assert calls(sim, "one.template.instantiate") == 0 and calls(sim, "one.hostpool.info") == 1
    assert not ours_holding_gpus(sim)


def test_best_effort_starts_what_fits_and_hands_back_the_rest(tmp_path, sim) -> None:
    take_gpus(sim, 1)
    setup = site(tmp_path, sim, policy="best-effort")
    env = {**setup.env, **resume_file(tmp_path, {7: "gpu[01-04]"})}
    assert resume_main(["gpu[01-04]"], env) == EXIT_NODES_FAILED
    assert handbacks(setup) == {"gpu04": "Reason=nebula: job 7: needs 4 GPUs 10de:0302, 3 free"}
    assert [len(vms_of(sim, f"gpu0{i}")) for i in (1, 2, 3, 4)] == [1, 1, 1, 0]
    assert all(vms_of(sim, f"gpu0{i}")[0].state_str == "RUNNING" for i in (1, 2, 3))


def test_a_smaller_job_in_the_same_resume_gets_the_gpus_the_whole_job_cannot_use(tmp_path, sim) -> None:
    take_gpus(sim, 1)
    setup = site(tmp_path, sim)
    env = {**setup.env, **resume_file(tmp_path, {7: "gpu[01-04]", 8: "gpu05"})}
    assert resume_main(["gpu[01-05]"], env) == EXIT_NODES_FAILED
    assert list(handbacks(setup)) == ["gpu[01-04]"]
    assert vms_of(sim, "gpu05")[0].state_str == "RUNNING"


def test_disabled_and_offline_hosts_do_not_count(tmp_path) -> None:
    with running_simulator(fast_config(hosts=3, gpus=1), auth=AUTH) as sim:
        sim.set_host_state("gpu-host-01", "DISABLED")
        sim.set_host_state("gpu-host-02", "OFFLINE")
        setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=nodeset())
        env = {**setup.env, **resume_file(tmp_path, {3: "gpu[01-02]"})}
        assert resume_main(["gpu[01-02]"], env) == EXIT_NODES_FAILED
        assert handbacks(setup) == {"gpu[01-02]": "Reason=nebula: job 3: needs 2 GPUs 10de:0302, 1 free"}
        assert sim.vms() == []


def test_a_powered_off_vm_keeps_its_gpu_and_needs_no_new_one(tmp_path, sim) -> None:
    setup = site(tmp_path, sim)
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    [vm] = vms_of(sim, "gpu01")
    import pyone

    pyone.OneServer(sim.endpoint, session=AUTH).vm.action("poweroff", vm.id)
    sim.wait_for(lambda: sim.vm(vm.id).state == S.POWEROFF, 10)
    take_gpus(sim, 3)  # every other GPU is taken: only gpu01's own is left, and it holds it
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    assert sim.vm(vm.id).state_str == "RUNNING"


class Thief:
    """The cloud, but someone else takes a GPU right after resume counted them (the race)."""

    def __init__(self, cloud, sim: Simulator, count: int = 1) -> None:
        self.cloud, self.sim, self.count = cloud, sim, count

    def __getattr__(self, name: str):
        return getattr(self.cloud, name)

    def hosts(self):
        hosts = self.cloud.hosts()
        if self.count:
            take_gpus(self.sim, self.count)
            self.count = 0
        return hosts


def raced_resume(setup: Setup, sim: Simulator, nodes: list[str], jobs: dict[str, list[int]], take: int = 1):
    config = load_config(setup.config, setup.env)
    ctx = build_context(config, setup.env)
    ctx = dataclasses.replace(ctx, cloud=Thief(ctx.cloud, sim, take))
    return resume(ctx, nodes, jobs)


def test_a_gpu_taken_after_the_count_is_caught_by_pending_timeout(tmp_path, sim) -> None:
    setup = site(tmp_path, sim)
    nodes = ["gpu01", "gpu02", "gpu03", "gpu04"]
    outcome = raced_resume(setup, sim, nodes, {n: [7] for n in nodes})  # the reason: at pending_timeout
    assert sorted(outcome.failed_nodes) == nodes and outcome.done == []
    reasons = handbacks(setup)
    [late] = [n for n, r in reasons.items() if "no free GPU 10de:0302: PENDING 1s, 0 free" in r]
    assert "Cannot allocate VM. Not enough capacity" in reasons[late]
    [dragged] = [r for n, r in reasons.items() if n != late]
    assert dragged == f"Reason=nebula: all-or-nothing: job 7 cannot start whole ({late} cannot start)"
    assert not ours_holding_gpus(sim), "no GPU of ours idles for the requeued job"
    assert not [v for v in sim.vms() if v.name.startswith("gpu") and v.state != S.DONE]


def test_best_effort_keeps_the_nodes_that_started_when_one_is_not_placed(tmp_path, sim) -> None:
    setup = site(tmp_path, sim, policy="best-effort")
    nodes = ["gpu01", "gpu02", "gpu03", "gpu04"]
    outcome = raced_resume(setup, sim, nodes, {n: [7] for n in nodes})
    assert len(outcome.done) == 3 and len(outcome.failed_nodes) == 1
    assert len(ours_holding_gpus(sim)) == 3


def test_a_node_another_job_needs_is_kept(tmp_path, sim) -> None:
    take_gpus(sim, 1)
    setup = site(tmp_path, sim)
    env = {**setup.env, **resume_file(tmp_path, {7: "gpu[01-04]", 9: "gpu01"})}
    assert resume_main(["gpu[01-04]"], env) == EXIT_NODES_FAILED
    assert handbacks(setup) == {"gpu[02-04]": "Reason=nebula: job 7: needs 4 GPUs 10de:0302, 3 free"}
    assert vms_of(sim, "gpu01")[0].state_str == "RUNNING", "job 9 still needs gpu01"


def test_on_22_05_a_placement_shortage_makes_no_vm_churn_during_the_cooldown(tmp_path) -> None:
    # 4 free GPUs on a host without the memory for a GPU VM: the count says yes, oned never places it
    small = HostSpec("small", memory_kb=32 * 1024 * 1024, pci=default_pci(4, 0))
    with running_simulator(SimConfig(hosts=(small,), durations=Durations(0, 0, 0, 0)), auth=AUTH) as sim:
        setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=nodeset())
        env = {**setup.env, **resume_file(tmp_path, {7: "gpu01"})}
        assert resume_main(["gpu01"], env) == EXIT_NODES_FAILED
        assert "not placed within pending_timeout 1s although 4 free" in \
            handbacks(setup)["gpu01"]
        sim.reset_stats()
        for _ in range(3):  # 22.05's requeue storm: the same node resumed again and again
            assert resume_main(["gpu01"], env) == EXIT_NODES_FAILED
        assert sim.stats()["calls"] == {"one.hostpool.info": 3}, "the capacity read, and no VM"
        assert handbacks(setup)["gpu01"].startswith("Reason=nebula: cooldown ")


def test_after_a_count_shortage_only_the_capacity_read_is_made_during_the_cooldown(tmp_path, sim) -> None:
    take_gpus(sim, 1)
    setup = site(tmp_path, sim)
    env = {**setup.env, **resume_file(tmp_path, {7: "gpu[01-04]"})}
    assert resume_main(["gpu[01-04]"], env) == EXIT_NODES_FAILED
    sim.reset_stats()
    assert resume_main(["gpu[01-04]"], env) == EXIT_NODES_FAILED
    assert sim.stats()["calls"] == {"one.hostpool.info": 1}
    assert handbacks(setup)["gpu[01-04]"].startswith("Reason=nebula: cooldown ")
    # a job that fits is not held back by the cooldown
    assert resume_main(["gpu05"], {**setup.env, **resume_file(tmp_path, {8: "gpu05"})}) == EXIT_OK


def test_the_cooldown_ends_when_gpus_are_freed(tmp_path, sim) -> None:
    setup = site(tmp_path, sim)
    outcome = raced_resume(setup, sim, ["gpu01"], {"gpu01": [7]}, take=4)
    assert outcome.failed_nodes == ["gpu01"]
    assert resume_main(["gpu01"], setup.env) == EXIT_NODES_FAILED, "0 free: still cooling down"
    thief = next(v.id for v in sim.vms() if v.name == "other0")
    import pyone

    pyone.OneServer(sim.endpoint, session=AUTH).vm.action("terminate", thief)
    sim.wait_for(lambda: sim.vm(thief).state == S.DONE, 10)
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    assert "cooldown lifted" in setup.log_text()


def test_on_23_02_the_hand_back_is_power_down_force_and_the_cooldown_is_ours(tmp_path, sim) -> None:
    take_gpus(sim, 4)
    setup = site(tmp_path, sim, extra="shortage_cooldown = 90")
    setup.set_version("slurm 23.02.7")
    assert resume_main(["gpu01"], setup.env) == EXIT_NODES_FAILED
    [update] = [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
    assert not [a for a in update if a.startswith("ResumeAfter")]


class NoHosts(Thief):
    """The cloud, but the host pool cannot be read (e.g. a user without the right to list hosts)."""

    def hosts(self):
        from slurm_nebula_power.errors import CloudAuthError

        raise CloudAuthError("[one.hostpool.info] User [2] not authorized to perform action on host.")


def test_an_unreadable_host_pool_skips_the_count_and_resume_proceeds(tmp_path, sim, caplog) -> None:
    setup = site(tmp_path, sim)
    config = load_config(setup.config, setup.env)
    ctx = build_context(config, setup.env)
    ctx = dataclasses.replace(ctx, cloud=NoHosts(ctx.cloud, sim))
    outcome = resume(ctx, ["gpu01", "gpu02"], {"gpu01": [7], "gpu02": [7]})
    assert sorted(outcome.done) == ["gpu01", "gpu02"]
    assert "host pool unreadable, GPU capacity not checked" in caplog.text


def test_a_node_set_without_gpus_never_reads_the_host_pool(tmp_path, sim) -> None:
    setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=(
        '[[nodeset]]\nnodes = "cpu[01-02]"\ntemplate = "slurm-cpu-worker"\nboot_timeout = 20\n'))
    assert resume_main(["cpu[01-02]"], setup.env) == EXIT_OK
    assert calls(sim, "one.hostpool.info") == 0


OURS_OUT = "nebula: out of service since 10:00:00, back when GPUs return (checked at 10:01:00 at the latest): x"


def show_nodes(states: dict[str, tuple[str, str]]) -> str:
    return "".join(f"NodeName={n} Arch=x86_64 State={s} Reason={r}\n" for n, (s, r) in states.items())


def test_a_count_shortage_steps_the_node_sets_powered_down_nodes_out_and_freed_gpus_step_them_in(tmp_path,
                                                                                                   sim) -> None:
    take_gpus(sim, 4)
    setup = site(tmp_path, sim)
    nodes = {"gpu01": ("IDLE+CLOUD+POWERING_UP", ""), "gpu02": ("IDLE+CLOUD+POWERED_DOWN", ""),
             "gpu03": ("IDLE+CLOUD+DRAIN+POWERED_DOWN", "RMA 42"), "gpu04": ("ALLOCATED+CLOUD", "")}
    setup.set_nodes(show_nodes(nodes))
    assert resume_main(["gpu01"], {**setup.env, **resume_file(tmp_path, {7: "gpu01"})}) == EXIT_NODES_FAILED
    drains = [u for u in setup.updates() if "State=DRAIN" in u]
    assert [u[0] for u in drains] == ["NodeName=gpu02"], "only the powered-down node without a Reason"
    assert drains[0][2].startswith("Reason=nebula: out of service since ") and "0 free" in drains[0][2]
    assert [r["node"] for r in setup.records() if r["event"] == "stepped_out"] == ["gpu02"]

    # the GPUs are freed; a resume of a node still up reads the host pool and brings gpu02 back
    for vm in sim.vms():
        if vm.name.startswith("other"):
            import pyone

            pyone.OneServer(sim.endpoint, session=AUTH).vm.action("terminate", vm.id)
            sim.wait_for(lambda vm=vm: sim.vm(vm.id).state == S.DONE, 10)
    nodes["gpu02"] = ("IDLE+CLOUD+DRAIN+POWERED_DOWN", OURS_OUT)
    setup.set_nodes(show_nodes(nodes))
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    undrains = [u for u in setup.updates() if "State=UNDRAIN" in u]
    assert [u[0] for u in undrains] == ["NodeName=gpu02"], "ours only: the administrator's drain of gpu03 stays"
    assert [r["node"] for r in setup.records() if r["event"] == "stepped_in"] == ["gpu02"]


@pytest.mark.parametrize(("version", "form"), [("slurm 24.11.5", "update"), ("slurm 25.05.0", "power"),
                                               ("slurm 26.05.5", "power")])
def test_from_25_05_the_hand_back_is_scontrol_power_down_force_with_its_reason(tmp_path, sim, version, form) -> None:
    take_gpus(sim, 4)
    setup = site(tmp_path, sim)
    setup.set_version(version)
    assert resume_main(["gpu01"], setup.env) == EXIT_NODES_FAILED
    calls = [c for c in setup.scontrol_calls() if c[:3] == ["power", "down", "force"] or "State=POWER_DOWN_FORCE" in c]
    [call] = calls
    if form == "power":
        assert call[:4] == ["power", "down", "force", "gpu01"], call
        assert call[4].startswith("Reason=nebula: needs 1 GPU"), call
    else:
        assert call[:3] == ["update", "NodeName=gpu01", "State=POWER_DOWN_FORCE"], call
