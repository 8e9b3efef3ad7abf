"""slurm-nebula-power reconcile: orphans terminated, vanished VMs handed back, stuck boots cleared."""

from __future__ import annotations

import configparser
import time
from pathlib import Path

import pytest
from opsupport import boot_node, ours_vm, real_site, show
from simfixtures import AUTH, fast_config
from support import make_setup

from opennebula_sim import states as S
from slurm_nebula_power.cli import reconcile
from slurm_nebula_power.cli.common import build_context
from slurm_nebula_power.config import load_config
from slurm_nebula_power.drift import reconcile as repair_drift
from slurm_nebula_power.errors import EXIT_OK
from slurm_nebula_power.locks import NodeLocks

ETC = Path(__file__).resolve().parent.parent / "etc" / "systemd"
NO_GRACE = "reconcile_grace = 0"
DONE, RUNNING = 6, (3, 3)


def run(setup, capsys, *args: str) -> tuple[int, str]:
    code = reconcile.main(list(args), setup.env)
    return code, capsys.readouterr().out


@pytest.fixture
def site(sim, tmp_path):
    """A deployment whose reconcile_grace is 0: any orphan is old enough."""
    return make_setup(tmp_path / "site", sim.endpoint, AUTH, extra=NO_GRACE)


def test_orphan_is_terminated_and_foreign_vm_reported_and_left_alone(sim, site, capsys) -> None:
    orphan = sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="RUNNING")
    foreign = sim.add_vm(name="gpu01", user_template={}, state="RUNNING")
    site.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN"))
    code, out = run(site, capsys)
    assert code == EXIT_OK
    what = "VM ACTIVE/RUNNING but node powered down"
    assert out.splitlines() == [
        f"gpu01: VM {foreign} (ACTIVE/RUNNING) is named gpu01 but its CONTEXT does not make it ours (made by "
        "hand, or not by this cluster): left alone, remove it with onevm terminate if it is a leak",
        f"gpu01: {what} -> terminate VM {orphan}: done"]
    assert sim.vm(orphan).state == DONE
    assert (sim.vm(foreign).state, sim.vm(foreign).lcm_state) == RUNNING
    held = {h.name: h.gpus_total - h.gpus_free for h in sim.hosts()}
    assert held == {h.name: int(h.name == sim.vm(foreign).host) for h in sim.hosts()}, "only the foreign GPU"
    assert site.updates() == [], "a powered-down node is not handed back"
    assert f"node=gpu01 reconcile: {what} -> terminate VM {orphan}" in site.log_text()


def test_dry_run_changes_nothing(sim, site, capsys) -> None:
    orphan = sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="RUNNING")
    site.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN", "gpu02 State=IDLE+CLOUD"))
    code, out = run(site, capsys, "--dry-run")
    assert code == EXIT_OK
    assert out.splitlines() == [f"gpu01: VM ACTIVE/RUNNING but node powered down -> would terminate VM "
                                f"{orphan}",
                                "gpu02: node up in Slurm but it has no VM -> would hand back to Slurm"]
    assert (sim.vm(orphan).state, sim.vm(orphan).lcm_state) == RUNNING
    assert site.updates() == [] and "one.vm.action" not in sim.stats()["calls"]
    assert not site.log.exists(), "a dry run does not write the log"


def test_orphan_within_grace_is_left(sim, setup, capsys) -> None:
    young = sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="RUNNING")
    setup.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN"))
    code, out = run(setup, capsys)  # the default grace: 300 s
    assert (code, out.strip()) == (EXIT_OK, "nothing to repair")
    assert sim.vm(young).state == S.ACTIVE


def test_node_up_whose_vm_is_gone_is_handed_back(sim, site, capsys) -> None:
    site.set_nodes(show("gpu02 State=IDLE+CLOUD+NOT_RESPONDING NodeAddr=127.0.1.7"))
    code, out = run(site, capsys)
    assert code == EXIT_OK
    assert out.splitlines() == ["gpu02: node up in Slurm but it has no VM -> hand back to Slurm: done"]
    assert site.updates() == [["NodeName=gpu02", "State=POWER_DOWN_FORCE",
                               "Reason=nebula: reconcile: its VM is gone"]]


def test_node_up_whose_vm_failed_has_it_terminated_and_is_handed_back(sim, site, capsys) -> None:
    failed = sim.add_vm(name="gpu03", **ours_vm("gpu03"), state="BOOT_FAILURE")
    site.set_nodes(show("gpu03 State=ALLOCATED+CLOUD"))
    assert run(site, capsys)[0] == EXIT_OK
    assert sim.vm(failed).state == DONE
    assert all(h.gpus_free == h.gpus_total for h in sim.hosts())
    [update] = site.updates()
    assert update[:2] == ["NodeName=gpu03", "State=POWER_DOWN_FORCE"]
    assert update[2] == "Reason=nebula: reconcile: VM failed (ACTIVE/BOOT_FAILURE)"


def test_newer_slurm_hands_back_with_power_down_force_too(sim, site, capsys) -> None:
    # DOWN+ResumeAfter would leave a POWERING_UP node unusable until ResumeTimeout, then DOWN for good.
    site.set_version("slurm 24.11.5")
    site.set_nodes(show("gpu02 State=IDLE+CLOUD"))
    run(site, capsys)
    assert site.updates() == [["NodeName=gpu02", "State=POWER_DOWN_FORCE",
                               "Reason=nebula: reconcile: its VM is gone"]]


def test_vm_pending_past_boot_timeout_is_terminated_and_node_handed_back(tmp_path, capsys) -> None:
    from opennebula_sim import running_simulator

    with running_simulator(fast_config(hosts=1, gpus=0), auth=AUTH) as sim:
        site = make_setup(tmp_path / "site", sim.endpoint, AUTH)
        stuck = sim.add_vm(name="gpu04", **ours_vm("gpu04"), state="PENDING")
        sim.wait_for(lambda: "SCHED_MESSAGE" in sim.vm(stuck).user_template)
        site.set_nodes(show("gpu04 State=ALLOCATED+CLOUD+POWERING_UP"))
        config = load_config(site.config, site.env)
        ctx = build_context(config, site.env)
        lines: list[str] = []

        def later() -> float:
            return time.time() + 3600  # an hour on: well past boot_timeout (20 s)

        outcome = repair_drift(ctx, ctx.slurm.show_all_nodes, emit=lines.append, now=later)
        assert outcome.done == ["gpu04"] and not outcome.failed
        assert sim.vm(stuck).state == DONE
    oned = "oned: Cannot allocate VM. Not enough capacity in hosts 0"  # 7.0's words: the resource unnamed
    assert lines == [f"gpu04: node powering up, VM PENDING: no host can take the VM ({oned}); PENDING for "
                     f"longer than boot_timeout 20s -> terminate VM {stuck} and hand back to Slurm: done"]
    [update] = site.updates()
    assert update[:2] == ["NodeName=gpu04", "State=POWER_DOWN_FORCE"]
    assert update[2] == f"Reason=nebula: reconcile: VM PENDING past boot_timeout 20s: no host can take the VM ({oned})"


def test_pending_vm_within_boot_timeout_is_left(sim, site, capsys) -> None:
    sim.set_durations(prolog=60)
    booting = sim.add_vm(name="gpu04", **ours_vm("gpu04"), state="PROLOG")
    site.set_nodes(show("gpu04 State=ALLOCATED+CLOUD+POWERING_UP"))
    assert run(site, capsys) == (EXIT_OK, "nothing to repair\n")
    assert sim.vm(booting).state == S.ACTIVE


def test_busy_node_is_skipped(sim, site, capsys) -> None:
    orphan = sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="RUNNING")
    site.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN"))
    lock_dir = Path(load_config(site.config, site.env).power.lock_dir)
    with NodeLocks(lock_dir, ["gpu01"], 0) as held:  # a suspend still working on gpu01
        assert held.held == ["gpu01"]
        code, out = run(site, capsys)
    assert code == EXIT_OK
    assert out.splitlines() == ["gpu01: skipped, a resume or suspend holds its lock (next run)"]
    assert sim.vm(orphan).state == S.ACTIVE


@pytest.mark.parametrize("state", ["IDLE+CLOUD+POWERING_DOWN", "IDLE+CLOUD+POWER_DOWN", "ALLOCATED+CLOUD",
                                   "ALLOCATED+CLOUD+POWERING_UP"])
def test_vm_of_a_node_not_powered_down_is_left(sim, site, capsys, state: str) -> None:
    vm = sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="RUNNING")
    site.set_nodes(show(f"gpu01 State={state}"))
    assert run(site, capsys) == (EXIT_OK, "nothing to repair\n")
    assert sim.vm(vm).state == S.ACTIVE


def test_powered_off_vm_of_a_poweroff_node_set_is_left(sim, site, capsys) -> None:
    vm = sim.add_vm(name="cpu01", **ours_vm("cpu01"), state="POWEROFF", template_id=1)
    site.set_nodes(show("cpu01 State=IDLE+CLOUD+POWERED_DOWN"))
    assert run(site, capsys) == (EXIT_OK, "nothing to repair\n")
    assert sim.vm(vm).state == S.POWEROFF


def test_node_unknown_to_slurm_and_stray_vms_are_never_acted_on(sim, site, capsys) -> None:
    mine = sim.add_vm(name="gpu05", **ours_vm("gpu05"), state="RUNNING")
    stray = sim.add_vm(name="old9", **ours_vm("old9"), state="RUNNING")
    site.set_nodes("")
    assert run(site, capsys) == (EXIT_OK, "nothing to repair\n")
    assert sim.vm(mine).state == S.ACTIVE and sim.vm(stray).state == S.ACTIVE


def test_hostlist_limits_the_nodes(sim, site, capsys) -> None:
    a = sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="RUNNING")
    b = sim.add_vm(name="gpu02", **ours_vm("gpu02"), state="RUNNING")
    site.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN", "gpu02 State=IDLE+CLOUD+POWERED_DOWN"))
    code, _ = run(site, capsys, "gpu02")
    assert code == EXIT_OK and sim.vm(a).state == S.ACTIVE and sim.vm(b).state == DONE


def test_unreachable_controller_changes_nothing_and_exits_4(sim, site, capsys) -> None:
    orphan = sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="RUNNING")
    site.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN"))
    (site.scontrol_dir / "scontrol.rc").write_text("1")
    assert reconcile.main([], site.env) == 4
    assert "scontrol show node -o failed" in capsys.readouterr().err
    assert sim.vm(orphan).state == S.ACTIVE and "one.vm.action" not in sim.stats()["calls"]


# ---- the real controller ----------------------------------------------------------------------------


@pytest.mark.slurm
def test_reconcile_against_the_real_controller(sim, tmp_path, slurm_factory, capsys) -> None:
    cluster = slurm_factory(nodes=["gpu01", "gpu02", "gpu03"], suspend_time=3600)
    site = real_site(tmp_path / "site", sim, cluster, '[[nodeset]]\nnodes = "gpu[01-03]"\n'
                     'template = "slurm-gpu-worker"\n', extra=NO_GRACE)
    orphan = sim.add_vm(name="gpu01", **ours_vm("gpu01", "cloudtest"))
    foreign = sim.add_vm(name="gpu03", user_template={})
    boot_node(cluster, "gpu02", "127.0.1.2")  # up in Slurm, but no VM behind it
    env = {"SLURM_NEBULA_POWER_CONFIG": str(site.config)}
    assert reconcile.main([], env) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    assert out == [f"gpu03: VM {foreign} (ACTIVE/RUNNING) is named gpu03 but its CONTEXT does not make it ours "
                   "(made by hand, or not by this cluster): left alone, remove it with onevm terminate if it is a "
                   "leak",
                   f"gpu01: VM ACTIVE/RUNNING but node powered down -> terminate VM {orphan}: done",
                   "gpu02: node up in Slurm but it has no VM -> hand back to Slurm: done"]
    assert sim.vm(orphan).state == DONE
    assert (sim.vm(foreign).state, sim.vm(foreign).lcm_state) == RUNNING
    # POWER_DOWN_FORCE powers the node down at once (SuspendProgram runs for it), on every release.
    state = cluster.wait_until(lambda: cluster.node_state("gpu02"), lambda s: "POWER" in s, 30, "gpu02 down")
    assert "POWER_DOWN" in state or "POWERING_DOWN" in state or "POWERED_DOWN" in state
    assert cluster.node_state("gpu01") == "IDLE+CLOUD+POWERED_DOWN", "a powered-down node is left as it is"
    # A second run finds nothing left to do.
    assert reconcile.main([], env) == EXIT_OK
    assert capsys.readouterr().out.splitlines()[-1] == "nothing to repair", "the impostor is reported each run"


# ---- systemd units ----------------------------------------------------------------------------------


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(ETC / name)
    return parser


def test_systemd_service_runs_reconcile_as_slurm_user() -> None:
    service = unit("slurm-nebula-power-reconcile.service")["Service"]
    assert service["Type"] == "oneshot"
    assert service["User"] == "slurm"
    argv = service["ExecStart"].split()
    assert argv[0].startswith("/") and argv[0].endswith("/slurm-nebula-power") and argv[1:] == ["reconcile"]
    assert "SLURM_CONF=" in service["Environment"]


def test_systemd_timer_runs_it_every_minute() -> None:
    timer = unit("slurm-nebula-power-reconcile.timer")
    assert timer["Timer"]["OnUnitInactiveSec"] == "1min"
    assert timer["Timer"]["Unit"] == "slurm-nebula-power-reconcile.service"
    assert timer["Install"]["WantedBy"] == "timers.target"
