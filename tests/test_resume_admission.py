"""slurm-nebula-resume acts only on cloud nodes slurmctld is powering up (the simulator, the recording scontrol).

What slurmctld says of a node decides: a static node inside a node set's hostlist, a node it does not know, and
a cloud node it is not powering up (resume run by hand) are refused with one line, exit 2, and nothing done;
--force lets an administrator resume the last kind only. A configuration that cannot be loaded hands back the
nodes slurmctld is powering up instead of leaving them to ResumeTimeout.
"""

from __future__ import annotations

import pytest
from simfixtures import vms_of

from slurm_nebula_power.cli.main import resume_main
from slurm_nebula_power.errors import EXIT_CONFIG, EXIT_OK, EXIT_USAGE


def shown(*lines: str) -> str:
    return "".join(f"NodeName={line} Reason=\n" for line in lines)


@pytest.mark.parametrize(("slurm", "said"), [
    (shown("gpu01 State=IDLE+CLOUD+POWERING_UP", "gpu02 State=IDLE"), "gpu02: static nodes (no State=CLOUD"),
    (shown("gpu01 State=IDLE+CLOUD+POWERING_UP", "gpu02 State=DOWN*"), "gpu02: static nodes (no State=CLOUD"),
    (shown("gpu01 State=IDLE+CLOUD+POWERING_UP"), "gpu02: unknown to slurmctld (no NodeName line"),
    (shown("gpu01 State=IDLE+CLOUD+POWERING_UP", "gpu02 State=IDLE+CLOUD+POWERED_DOWN"),
     "gpu02: not being powered up by slurmctld (IDLE+CLOUD+POWERED_DOWN): nothing done"),
    (shown("gpu01 State=IDLE+CLOUD+POWERING_UP", "gpu02 State=IDLE+CLOUD"), "gpu02: not being powered up"),
], ids=["static-idle", "static-down", "unknown", "powered-down-by-hand", "cloud-up-by-hand"])
def test_a_node_slurmctld_did_not_ask_for_refuses_the_whole_call_with_one_line(sim, setup, capsys, slurm: str,
                                                                                said: str) -> None:
    setup.set_nodes(slurm)
    assert resume_main(["gpu[01-02]"], setup.env) == EXIT_USAGE
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err
    assert sim.vms() == [] and setup.updates() == [], "no VM made, no address set, no node handed back"


def test_force_resumes_a_cloud_node_slurmctld_is_not_powering_up_with_a_warning(sim, setup) -> None:
    setup.set_nodes(shown("gpu01 State=IDLE+CLOUD+POWERED_DOWN"))
    assert resume_main(["--force", "gpu01"], setup.env) == EXIT_OK
    [vm] = vms_of(sim, "gpu01")
    assert vm.state == 3
    assert "--force: resuming gpu01, which slurmctld is not powering up" in setup.log_text()


@pytest.mark.parametrize("slurm", [shown("gpu01 State=IDLE"), ""], ids=["static", "unknown"])
def test_force_never_resumes_a_static_or_unknown_node(sim, setup, slurm: str) -> None:
    setup.set_nodes(slurm)
    assert resume_main(["--force", "gpu01"], setup.env) == EXIT_USAGE
    assert sim.vms() == []


def test_slurmctld_unreachable_refuses_a_run_by_hand_and_lets_slurmctlds_own_run_go_on(sim, setup, tmp_path,
                                                                                      capsys) -> None:
    (setup.scontrol_dir / "scontrol.rc").write_text("1")  # every scontrol call fails
    assert resume_main(["gpu01"], setup.env) == EXIT_USAGE
    assert "slurmctld cannot say whether it is powering them up" in capsys.readouterr().err
    assert sim.vms() == []
    resume_file = tmp_path / "resume.json"
    resume_file.write_text('{"jobs": [{"job_id": 7, "nodes": "gpu01"}]}')
    code = resume_main(["gpu01"], {**setup.env, "SLURM_RESUME_FILE": str(resume_file)})
    assert [vm.name for vm in sim.vms()] == ["gpu01"], code
    assert "slurmctld cannot say how gpu01 stand" in setup.log_text()


@pytest.mark.parametrize("slurm", [shown("gpu01 State=IDLE+CLOUD+POWERING_UP", "gpu02 State=IDLE+CLOUD+POWERED_DOWN",
                                         "gpu03 State=IDLE+POWERING_UP")], ids=["mixed"])
def test_a_configuration_error_hands_back_only_the_cloud_nodes_slurmctld_is_powering_up(sim, setup, capsys,
                                                                                       slurm: str) -> None:
    setup.set_nodes(slurm)
    setup.config.write_text(setup.config.read_text().replace("suspend_timeout = 15", "suspend_timeout = 15\nbogus = 1"))
    assert resume_main(["gpu[01-03]"], setup.env) == EXIT_CONFIG
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert setup.updates() == [["NodeName=gpu01", "State=POWER_DOWN_FORCE",
                                "Reason=nebula: configuration unusable: run slurm-nebula-power check"]]
    assert sim.vms() == []


def test_a_configuration_error_with_an_unreadable_hostlist_hands_back_nothing(sim, setup) -> None:
    setup.config.write_text("not toml [")
    assert resume_main(["gpu[01-"], setup.env) == EXIT_CONFIG
    assert setup.updates() == []


def test_in_slurmctlds_own_run_a_node_no_longer_powering_up_is_left_out_and_the_others_go_on(sim, setup,
                                                                                           tmp_path) -> None:
    # powered down by hand between slurmctld starting resume and resume asking it: the rest must not wait
    setup.set_nodes(shown("gpu01 State=IDLE+CLOUD+POWERING_UP", "gpu02 State=IDLE+CLOUD+POWERED_DOWN"))
    resume_file = tmp_path / "resume.json"
    resume_file.write_text('{"jobs": [{"job_id": 7, "nodes": "gpu[01-02]"}]}')
    assert resume_main(["gpu[01-02]"], {**setup.env, "SLURM_RESUME_FILE": str(resume_file)}) == EXIT_OK
    assert [vm.name for vm in sim.vms()] == ["gpu01"]
    assert "gpu02: no longer being powered up by slurmctld (IDLE+CLOUD+POWERED_DOWN): left out" in setup.log_text()
