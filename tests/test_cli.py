"""The programs as slurmctld runs them: process hygiene, exit codes, bad input, hung endpoint, secrets."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from simfixtures import AUTH, vms_of
from support import make_setup, run_env

from slurm_nebula_power.cli.main import power_main, resume_fail_main, resume_main, suspend_main
from slurm_nebula_power.errors import EXIT_CONFIG, EXIT_INTERNAL, EXIT_NODES_FAILED, EXIT_OK, EXIT_USAGE

PROGRAMS = ["slurm-nebula-resume", "slurm-nebula-suspend", "slurm-nebula-resume-fail", "slurm-nebula-power"]


def program(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    assert os.access(path, os.X_OK), f"{name} is not installed (pip install -e .)"
    return path


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_program_answers_help_and_version(name: str) -> None:
    version = subprocess.run([program(name), "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and version.stdout.strip() == f"{name} 0.1.0"
    helped = subprocess.run([program(name), "--help"], capture_output=True, text=True, timeout=30)
    assert helped.returncode == 0 and "usage:" in helped.stdout


def test_help_and_version_do_not_import_pyone() -> None:
    code = ("import sys; from slurm_nebula_power.cli.main import resume_main\n"
            "try:\n    resume_main(['--version'])\nexcept SystemExit:\n    pass\n"
            "print('pyone' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip().splitlines()[-1] == "False"


BAD_HOSTLISTS = ["gpu[01-04", "gpu[04-01]", "gpu01;reboot", "$(id)", "gpü01", "gpu[1-1000000]", "", "-gpu01"]


@pytest.mark.parametrize("main", [resume_main, suspend_main, resume_fail_main])
@pytest.mark.parametrize("hostlist", BAD_HOSTLISTS)
def test_bad_hostlist_exits_2_with_zero_api_calls(sim, setup, main, hostlist, capsys) -> None:
    assert main([hostlist], setup.env) == EXIT_USAGE
    assert sum(sim.stats()["calls"].values()) == 0
    assert setup.updates() == []
    err = capsys.readouterr().err.strip()
    assert err.startswith(("slurm-nebula-", "usage:")) and "\n" not in err.split("error: ", 1)[-1]


def test_usage_errors_exit_2(setup) -> None:
    assert resume_main([], setup.env) == EXIT_USAGE
    assert resume_main(["gpu01", "gpu02"], setup.env) == EXIT_USAGE
    assert power_main(["no-such-command"]) == EXIT_USAGE


def test_config_error_exits_3_with_zero_api_calls(sim, setup, capsys) -> None:
    setup.config.write_text(setup.config.read_text().replace("[power]", "[power]\nwhatever = 1"))
    assert resume_main(["gpu01"], setup.env) == EXIT_CONFIG
    assert sum(sim.stats()["calls"].values()) == 0
    err = capsys.readouterr().err
    assert "power.whatever: unknown key" in err and str(setup.config) in err


LAUNCHER = """
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP})
prog, args, env = sys.argv[1], sys.argv[2:], {k: v for k, v in os.environ.items() if k.startswith("SLURM")}
for fd in (0, 1, 2):
    os.close(fd)
os.execve(prog, [prog, *args], env)
"""


def slurmctld_style(setup, name: str, *args: str, timeout: float = 120) -> int:
    """Run a program as slurmctld does: fds 0-2 closed, signals blocked, no PATH, SLURM_* env only."""
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, program(name), *args], env=run_env(setup),
                          timeout=timeout, check=False)
    return proc.returncode


def test_runs_with_closed_fds_blocked_signals_and_no_path(sim, setup) -> None:
    assert slurmctld_style(setup, "slurm-nebula-resume", "gpu[01-02]") == EXIT_OK
    assert len(vms_of(sim, "gpu01")) == 1 and len(vms_of(sim, "gpu02")) == 1
    log = setup.log_text()
    assert "summary: slurm-nebula-resume gpu[01-02]: 2 done, 0 failed" in log
    # scontrol, our child, ran with no signal blocked
    assert int((setup.scontrol_dir / "scontrol.sigblk").read_text(), 16) == 0
    assert slurmctld_style(setup, "slurm-nebula-suspend", "gpu[01-02]") == EXIT_OK
    assert vms_of(sim, "gpu01") == [] and vms_of(sim, "gpu02") == []


class HungEndpoint:
    """Accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/RPC2"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.mark.parametrize("name", ["slurm-nebula-resume", "slurm-nebula-suspend", "slurm-nebula-resume-fail"])
def test_hung_endpoint_finishes_within_bounds_and_hands_nodes_back(tmp_path, name) -> None:
    hung = HungEndpoint()
    try:
        setup = make_setup(tmp_path / "site", hung.endpoint, AUTH)
        setup.config.write_text(setup.config.read_text().replace("timeout = 5", "timeout = 1")
                                .replace("retry_seconds = 10", "retry_seconds = 2"))
        # The subprocess timeout is only a guard against a hang; a hung program fails the test with it.
        assert slurmctld_style(setup, name, "gpu[01-02]", timeout=60) == EXIT_NODES_FAILED
        assert hung.held, "the program did connect"
        if name == "slurm-nebula-resume":
            [handback] = setup.updates()
            assert handback[:2] == ["NodeName=gpu[01-02]", "State=POWER_DOWN_FORCE"]
        assert "no answer within the timeout" in setup.log_text()
    finally:
        hung.close()


def test_secret_never_logged(sim, setup) -> None:
    sim.set_faults(transient_rate=0.3)
    resume_main(["gpu[01-03]"], setup.env)
    bad = make_setup(setup.root.parent / "bad", sim.endpoint, "oneadmin:Wr0ng-S3cret")
    resume_main(["gpu04"], bad.env)
    for s in (setup, bad):
        assert s.password not in s.log_text()
    assert "Sim-S3cret-pass" not in setup.log_text()


def test_detach_returns_at_once_and_finishes_in_the_background(sim, setup, tmp_path) -> None:
    sim.set_durations(prolog=0.5, boot=0.5)
    setup.config.write_text(setup.config.read_text().replace("[power]", "[power]\ndetach = true"))
    resume_file = tmp_path / "resume.json"
    resume_file.write_text('{"jobs":[{"job_id":41,"nodes":"gpu[01-02]"}],"all_nodes":"gpu[01-02]"}')
    env = {**run_env(setup), "SLURM_RESUME_FILE": str(resume_file)}
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, program("slurm-nebula-resume"), "gpu[01-02]"],
                          env=env, timeout=60, check=False)
    assert proc.returncode == EXIT_OK
    assert "summary:" not in setup.log_text(), "the VMs take a second to boot: resume returned before"
    resume_file.unlink()  # like slurmctld's memfd, gone once the program returned
    assert "detached: gpu[01-02] continues in the background" in setup.log_text()
    sim.wait_for(lambda: "summary: slurm-nebula-resume gpu[01-02]: 2 done" in setup.log_text(), 30)
    for node in ("gpu01", "gpu02"):
        [vm] = vms_of(sim, node)
        assert (vm.state, vm.lcm_state) == (3, 3)
        assert vm.user_template["SLURM_JOB_IDS"] == "41"


@pytest.mark.parametrize("command", ["simulator", "status", "check", "reconcile", "usage", "template",
                                     "slurm-conf", "demo"])
def test_every_operator_command_answers_version(command: str) -> None:
    # issue 25: `slurm-nebula-power simulator --version` exited 2
    done = subprocess.run([program("slurm-nebula-power"), command, "--version"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"slurm-nebula-power {command} 0.1.0"


def test_an_operator_command_that_fails_unexpectedly_exits_4_in_one_line(monkeypatch, capsys) -> None:
    # A record `usage` could not parse once ended in a traceback and exit 1, which to usage, check and status
    # means "problems found"; an unexpected error is exit 4 with its one line after the traceback.
    from slurm_nebula_power.cli import main as cli_main

    def broken(argv: list[str]) -> int:
        raise OverflowError("cannot convert float infinity to integer")

    monkeypatch.setitem(cli_main.COMMANDS, "usage", (broken, "GPU-hours"))
    assert power_main(["usage", "--no-cloud"]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1] == (
        "slurm-nebula-power usage: error: internal error: cannot convert float infinity to integer (a bug: please "
        "report it with the traceback above)")


@pytest.mark.parametrize("argv", [["--config", "{config}", "template"], ["--config={config}", "template"],
                                  ["template", "--config", "{config}"]])
def test_config_works_before_the_command_and_after_it(tmp_path, argv: list[str]) -> None:
    # issue 32: `slurm-nebula-power --config PATH status` said "unknown command '--config'"
    setup = make_setup(tmp_path / "site", "http://127.0.0.1:9/RPC2", AUTH,
                       nodesets='[[nodeset]]\nnodes = "gpu[01-02]"\ntemplate = "t"\n')
    config = setup.config.rename(setup.root / "site.toml")  # not beside slurm.conf's name: only --config finds it
    env = {key: value for key, value in run_env(setup).items() if key != "SLURM_NEBULA_POWER_CONFIG"}
    done = subprocess.run([program("slurm-nebula-power"), *(a.format(config=config) for a in argv)],
                          env=env, capture_output=True, text=True, timeout=60)
    # `template` reads the configuration and refuses the node set for its missing keys: it read this file
    assert done.returncode == EXIT_CONFIG, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"slurm-nebula-power template: error: {config}: nodeset[0]: missing vcpu"), line


@pytest.mark.parametrize("argv", [["--config", "a.toml", "--config", "b.toml", "status"],
                                  ["--config", "a.toml", "status", "--config", "b.toml"],
                                  ["--config=a.toml", "status", "--config=b.toml"],
                                  ["status", "--config", "a.toml", "--config", "b.toml"]])
def test_config_given_twice_is_a_usage_error_in_one_line(tmp_path, argv: list[str]) -> None:
    done = subprocess.run([program("slurm-nebula-power"), *argv], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert done.returncode == EXIT_USAGE and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("slurm-nebula-power") and line.endswith(
        ": error: --config given twice (a.toml and b.toml): give it once"), line


@pytest.mark.parametrize(("argv", "said"), [
    (["--config"], "--config needs a PATH"),
    (["--config", "a.toml", "image", "build"], "image reads no configuration: remove --config a.toml"),
    (["--config", "a.toml", "simulator"], "simulator reads no configuration"),
    (["--verbose", "status"], "unknown option '--verbose' before the command"),
])
def test_a_bad_option_before_the_command_is_one_line(argv: list[str], said: str, capsys) -> None:
    assert power_main(argv) == EXIT_USAGE
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert out == "" and line.startswith("slurm-nebula-power: error: ") and said in line, line
