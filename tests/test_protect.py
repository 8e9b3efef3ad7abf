"""Protected mode (protect.py, protectlog.py, cli/unprotect.py) against the simulator through real pyone: a
template that boots nothing costs a handful of VMs across Slurm's repeated resumes, then no VM at all until
a good boot, the timer or the operator clears it."""

from __future__ import annotations

import json
import time
from collections import defaultdict

import pytest
from opsupport import show
from simfixtures import AUTH, calls, fast_config, vms_of
from support import make_setup

from opennebula_sim import running_simulator
from opennebula_sim import states as S
from slurm_nebula_power.cli import check, status, unprotect
from slurm_nebula_power.cli.main import resume_main
from slurm_nebula_power.config import load_config
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK, EXIT_USAGE
from slurm_nebula_power.protectlog import Protection, ProtectLog, after_failures

NODESETS = ('[[nodeset]]\nnodes = "gpu[01-08]"\ntemplate = "slurm-gpu-worker"\nboot_timeout = 20\n\n'
            '[[nodeset]]\nnodes = "cpu[01-04]"\ntemplate = "slurm-cpu-worker"\nboot_timeout = 20\n')


def handbacks(setup) -> list[list[str]]:
    return [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]


def created(sim) -> int:
    return calls(sim, "one.template.instantiate")


def state(setup, nodes: str = "gpu[01-08]") -> Protection | None:
    return ProtectLog.of(load_config(setup.config, setup.env)).read(nodes)


def test_a_template_that_boots_nothing_costs_three_vms_then_resume_creates_none(sim, setup) -> None:
    sim.set_faults(boot_failure_rate=1.0)
    # Slurm's requeue storm: the job's node is resumed again and again, every ~10-20 s.
    codes = [resume_main(["gpu01"], setup.env) for _ in range(5)]
    assert codes == [EXIT_NODES_FAILED] * 5
    assert created(sim) == 3, "2 VMs in the first resume (recreate_attempts 1), the 3rd protects the node set"
    reasons = [u[2] for u in handbacks(setup)]
    assert reasons[0] == "Reason=nebula: VM failed to boot (ACTIVE/BOOT_FAILURE)"
    protected = reasons[1:]
    assert all("protected after 3 boot failures (VM failed to boot (ACTIVE/BOOT_FAILURE))" in r for r in protected)
    assert all("`slurm-nebula-power unprotect gpu[01-08]`" in r and "(or wait 30 min)" in r for r in protected)
    assert all(len(r) <= len("Reason=") + 200 for r in reasons), "a Slurm Reason is cut at 200 characters"
    assert not [vm for vm in sim.vms() if vm.state != S.DONE], "every failed VM removed"
    assert state(setup).failures == 3


def test_while_protected_resume_makes_no_api_call_but_the_other_node_sets_run(sim, setup) -> None:
    sim.set_faults(boot_failure_rate=1.0)
    for _ in range(2):
        resume_main(["gpu01"], setup.env)
    sim.set_faults(boot_failure_rate=0.0)  # too late: the node set is protected until cleared
    sim.reset_stats()
    assert resume_main(["gpu[01-02],cpu01"], setup.env) == EXIT_NODES_FAILED
    assert created(sim) == 1 and vms_of(sim, "cpu01") and not vms_of(sim, "gpu01") and not vms_of(sim, "gpu02")
    [back] = handbacks(setup)[-1:]
    assert back[0] == "NodeName=gpu[01-02]" and "protected after 3 boot failures" in back[2]


def test_a_two_node_job_on_a_broken_template_costs_at_most_four_vms(sim, setup) -> None:
    sim.set_faults(boot_failure_rate=1.0)
    for _ in range(4):
        assert resume_main(["gpu[01-02]"], setup.env) == EXIT_NODES_FAILED
    # 2 fail at once (2 of 3), both are recreated, 2 more fail: protected; no VM after that.
    assert created(sim) == 4


def test_a_wide_job_stops_sending_its_waiting_nodes_once_protected(tmp_path) -> None:
    # One host: the 8 nodes go out one per wave (pacing.py); once 3 VMs failed, the nodes still waiting for
    # a wave are handed back unsent.
    with running_simulator(fast_config(hosts=1, gpus=8), auth=AUTH) as sim:
        setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=NODESETS)
        sim.set_faults(boot_failure_rate=1.0)
        assert resume_main(["gpu[01-08]"], setup.env) == EXIT_NODES_FAILED
        assert created(sim) < 8, created(sim)
        unsent = [u for u in handbacks(setup) if "protected after" in u[2]]
        assert unsent and not vms_of(sim, "gpu08", live=False), handbacks(setup)


def test_a_later_good_boot_clears_it(sim, setup) -> None:
    config = setup.config.read_text().replace("poll_max = 0.5", "poll_max = 0.5\nprotect_for = 2")
    setup.config.write_text(config)
    sim.set_faults(boot_failure_rate=1.0)
    for _ in range(2):
        resume_main(["gpu01"], setup.env)
    assert state(setup).since is not None
    # While the template is still broken, the lapse of protect_for buys one VM, not three.
    time.sleep(2.1)
    before = created(sim)
    assert resume_main(["gpu01"], setup.env) == EXIT_NODES_FAILED
    assert created(sim) == before + 1 and "protected after 4 boot failures" in handbacks(setup)[-1][2]
    time.sleep(2.1)
    sim.set_faults(boot_failure_rate=0.0)  # the template fixed
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    assert state(setup) is None, "a good boot forgets the failures"
    assert resume_main(["gpu02"], setup.env) == EXIT_OK


def test_a_gpu_shortage_is_no_boot_failure(tmp_path) -> None:
    with running_simulator(fast_config(hosts=1, gpus=1), auth=AUTH) as sim:
        setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, extra="shortage_cooldown = 1")
        for _ in range(4):
            resume_main(["gpu[01-02]"], setup.env)
            time.sleep(1.1)
        assert state(setup) is None
        assert not [u for u in handbacks(setup) if "protected" in u[2]]


def test_unprotect_clears_it_and_resume_creates_vms_again(sim, setup, capsys) -> None:
    sim.set_faults(boot_failure_rate=1.0)
    for _ in range(2):
        resume_main(["gpu01"], setup.env)
    sim.set_faults(boot_failure_rate=0.0)
    assert unprotect.main(["gpu05"], setup.env) == EXIT_OK  # any node names its node set
    out = capsys.readouterr().out
    assert out.startswith("gpu[01-08]: protected mode cleared (it followed 3 boot failures, the last: VM failed")
    assert state(setup) is None
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    assert unprotect.main(["--all"], setup.env) == EXIT_OK
    assert capsys.readouterr().out == "gpu[01-08]: not protected\ncpu[01-04]: not protected\n"


@pytest.mark.parametrize(("argv", "says"), [
    (["nope01"], "nope01: in no [[nodeset]]"),
    ([], "give the node sets' nodes"),
    (["gpu01", "--all"], "give the node sets' nodes"),
    (["gpu[01"], "malformed hostlist"),
])
def test_unprotect_refuses_what_names_no_node_set(setup, capsys, argv, says) -> None:
    assert unprotect.main(argv, setup.env) == EXIT_USAGE
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_status_check_and_the_metrics_show_it(sim, setup, capsys) -> None:
    sim.set_faults(boot_failure_rate=1.0)
    for _ in range(2):
        resume_main(["gpu01"], setup.env)
    capsys.readouterr()
    setup.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN", "cpu01 State=IDLE+CLOUD+POWERED_DOWN"))
    assert status.main(["--json", "gpu01,cpu01"], setup.env) == EXIT_NODES_FAILED
    rows = {r["node"]: r for r in json.loads(capsys.readouterr().out)}
    [problem] = rows["gpu01"]["problems"]
    assert problem.startswith("protected mode: 3 boot failures in a row (last: VM failed to boot")
    assert "`slurm-nebula-power unprotect gpu[01-08]`" in problem and rows["cpu01"]["problems"] == []
    check.main(["--json"], setup.env)
    found = [f for f in json.loads(capsys.readouterr().out) if f["subject"] == "node set gpu[01-08]"]
    [found] = [f for f in found if "protected mode" in f["text"]]
    assert found["level"] == "problem" and "unprotect gpu[01-08]" in found["fix"]
    metrics = setup.metrics.read_text()
    assert 'slurm_nebula_power_nodeset_protected{nodeset="gpu[01-08]"} 1.0' in metrics
    assert 'slurm_nebula_power_nodeset_protected{nodeset="cpu[01-04]"} 0.0' in metrics
    assert 'slurm_nebula_power_handbacks_total{program="resume",reason="protected"} 1.0' in metrics


def test_the_rules() -> None:
    # threshold 3, period 100: failures add up, protected at the 3rd; after the lapse the 4th protects again.
    one = after_failures(None, "gpu[01-02]", 2, "VM failed", now=0.0, threshold=3, period=100.0)
    assert one.since is None and not one.active(0.0, 100.0)
    two = after_failures(one, "gpu[01-02]", 1, "VM failed", now=10.0, threshold=3, period=100.0)
    assert two.since == 10.0 and two.active(109.0, 100.0) and not two.active(110.0, 100.0)
    again = after_failures(two, "gpu[01-02]", 1, "VM failed", now=50.0, threshold=3, period=100.0)
    assert again.since == 10.0, "a failure while protected does not extend it"
    lapsed = after_failures(two, "gpu[01-02]", 1, "VM failed", now=120.0, threshold=3, period=100.0)
    assert lapsed.since == 120.0 and lapsed.failures == 4
    never = after_failures(None, "gpu[01-02]", 50, "VM failed", now=0.0, threshold=0, period=100.0)
    assert never.since is None, "protect_after = 0 turns it off"


def test_a_malformed_or_foreign_state_file_is_ignored(setup, tmp_path) -> None:
    store = ProtectLog(tmp_path / "locks")
    store.failed("gpu[01-08]", 3, "VM failed", 3, 100.0)
    assert store.read("gpu[01-08]").since is not None
    store.path("gpu[01-08]").write_text('{"nodes": "gpu[01-08]", "failures": -4}')
    assert store.read("gpu[01-08]") is None
    store.path("gpu[01-08]").write_text('{"nodes": "other[1-2]", "failures": 9, "since": 1}')
    assert store.read("gpu[01-08]") is None
    store.path("gpu[01-08]").unlink()
    store.path("gpu[01-08]").symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text('{"nodes": "gpu[01-08]", "failures": 9, "since": 1}')
    assert store.read("gpu[01-08]") is None, "never read through a link"


def test_a_poll_that_sees_a_good_boot_and_failures_counts_the_good_boot(tmp_path) -> None:
    from types import SimpleNamespace

    from slurm_nebula_power.protect import Guard

    power = SimpleNamespace(lock_dir=tmp_path, protect_after=3, protect_for=100.0)
    config = SimpleNamespace(power=power, slurm=SimpleNamespace(cluster="c"))
    guard = Guard(SimpleNamespace(config=config, owner=None), {})  # type: ignore[arg-type]
    nodeset = SimpleNamespace(nodes_expr="gpu[01-99]", nodes=("gpu01",))
    guard.note(nodeset, 2, ["VM failed to boot"] * 2)  # type: ignore[arg-type]
    guard.note(nodeset, 1, ["VM failed to boot"] * 5)  # type: ignore[arg-type]
    assert ProtectLog(tmp_path, cluster="c").read("gpu[01-99]") is None and guard.holding(nodeset) is None  # type: ignore[arg-type]
    guard.note(nodeset, 0, ["VM failed to boot"] * 3)  # type: ignore[arg-type]
    assert "protected after 3 boot failures" in (guard.holding(nodeset) or "")  # type: ignore[arg-type]


def test_a_guest_that_never_reports_ready_is_a_boot_failure_unless_its_slurmd_registered(tmp_path) -> None:
    from types import SimpleNamespace

    from slurm_nebula_power.booting import Boot, not_ready_up
    from slurm_nebula_power.operation import Outcome

    nodeset = SimpleNamespace(nodes_expr="gpu[01-03]", boot_timeout=60.0)
    late = [Boot(node, nodeset, 0.0, vm_id=i) for i, node in enumerate(("gpu01", "gpu02", "gpu03"))]  # type: ignore[arg-type]
    ctx = SimpleNamespace(slurm=SimpleNamespace(registered=lambda nodes: {"gpu02"}))
    noted = []
    outcome, failures = Outcome(), defaultdict(list)
    not_ready_up(ctx, outcome, late, failures, lambda ns, good, bad: noted.append((good, bad)))  # type: ignore[arg-type]
    assert outcome.done == ["gpu02"]
    assert [b.node for b in failures["guest did not report READY=YES within boot_timeout 60s (RUNNING)"]] == [
        "gpu01", "gpu03"]
    assert noted == [(1, ["guest did not report READY=YES"] * 2)]


def test_a_protected_node_sets_vm_whose_host_left_service_is_not_placed_again(tmp_path) -> None:
    """Direct placement moves a VM whose host left service after the deploy (Step.MOVE): a new VM, which a
    protected node set must not get, as a recreate must not."""
    from types import SimpleNamespace

    from slurm_nebula_power.booting import Boot, Step
    from slurm_nebula_power.pacing import Pacer, Waves
    from slurm_nebula_power.protect import Guard

    power = SimpleNamespace(lock_dir=tmp_path, protect_after=3, protect_for=100.0)
    ctx = SimpleNamespace(config=SimpleNamespace(power=power, slurm=SimpleNamespace(cluster="c")), owner=None,
                          observe=lambda node, vm: None)
    guard = Guard(ctx, {})  # type: ignore[arg-type]
    nodeset = SimpleNamespace(nodes_expr="gpu[01-99]", nodes=("gpu01",))
    boot = Boot("gpu01", nodeset, 1000.0, vm_id=5)  # type: ignore[arg-type]
    vm = SimpleNamespace(id=5)
    waves: Waves[Boot] = Waves(Pacer(30))
    [(_, _, verdict)] = guard.judged([boot], {5: vm}, 1.0, {}, waves, moved={"gpu01"})  # type: ignore[dict-item]
    assert verdict.step is Step.MOVE, "not protected: moved"
    guard.note(nodeset, 0, ["VM failed to boot"] * 3)  # type: ignore[arg-type]
    [(_, _, verdict)] = guard.judged([boot], {5: vm}, 1.0, {}, waves, moved={"gpu01"})  # type: ignore[dict-item]
    assert verdict.step is Step.FAIL and "protected after 3 boot failures" in verdict.reason
