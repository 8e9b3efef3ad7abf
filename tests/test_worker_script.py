"""The worker bootstrap (slurm-nebula-worker.sh) run by /bin/sh with a CONTEXT and stubbed daemons.

munged, slurmd, runuser, systemctl, systemd-run and curl are stubs given by absolute path through the
script's WORKER_* overrides; every path it writes (key, log, console, run dirs) is under tmp_path.
"""

from __future__ import annotations

import base64
import os
import pwd
import shutil
import stat
import subprocess
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "slurm_nebula_power" / "worker" / "slurm-nebula-worker.sh"
KEY = bytes(range(256)) * 4  # 1024 bytes, like `mungekey`'s default
KEY_B64 = base64.b64encode(KEY).decode()
TOKEN = "0123456789abcdef0123456789abcdef"

try:
    MUNGE = pwd.getpwnam("munge")
except KeyError:
    MUNGE = None

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or MUNGE is None,
                                reason="needs root and a munge user (install munge) to chown the key")

STUB = """#!/bin/sh
printf '%s\\n' "$*" >>"{dir}/{name}.args"
env >"{dir}/{name}.env"
{extra}
exit "$(cat "{dir}/{name}.rc" 2>/dev/null || echo 0)"
"""


@dataclass
class Run:
    """One run of the script: its exit code, output and what the stubs saw."""

    code: int
    stdout: str
    stderr: str
    root: Path

    def args(self, name: str) -> list[str]:
        """Each call's arguments, but for `slurmd --help` (the worker's check for --instance-id)."""
        path = self.root / "stubs" / f"{name}.args"
        return [a for a in path.read_text().splitlines() if a != "--help"] if path.exists() else []

    def env(self, name: str) -> str:
        return (self.root / "stubs" / f"{name}.env").read_text()

    @property
    def log(self) -> str:
        path = self.root / "worker.log"
        return path.read_text() if path.exists() else ""

    @property
    def console(self) -> str:
        return (self.root / "console").read_text()

    @property
    def key(self) -> Path:
        return self.root / "etc-munge" / "munge.key"

    @property
    def ready(self) -> Path:
        return self.root / "run-worker" / "ready"


class Worker:
    """Stubs, override environment and a runner for the script."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stubs = root / "stubs"
        self.stubs.mkdir()
        (root / "console").write_text("")
        for name in ("munged", "slurmd", "systemctl", "systemd-run"):
            self.stub(name)
        self.stub("curl", extra=f'cat >"{self.stubs}/curl.stdin"')  # the OneGate headers come on stdin
        self.stub("runuser", extra='shift 3\nexec "$@"')  # runuser -u munge -- CMD...: run CMD
        self.env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "WORKER_LOG": str(root / "worker.log"),
            "WORKER_CONSOLE": str(root / "console"),
            "WORKER_RUN_DIR": str(root / "run-worker"),
            "WORKER_ONE_ENV": str(root / "one_env"),
            "WORKER_INIT": "direct",
            "WORKER_MUNGE_KEY": str(root / "etc-munge" / "munge.key"),
            "WORKER_MUNGE_RUN": str(root / "run-munge"),
            "WORKER_MUNGED": str(self.stubs / "munged"),
            "WORKER_SLURMD": str(self.stubs / "slurmd"),
            "WORKER_RUNUSER": str(self.stubs / "runuser"),
            "WORKER_SYSTEMCTL": str(self.stubs / "systemctl"),
            "WORKER_SYSTEMD_RUN": str(self.stubs / "systemd-run"),
            "WORKER_CURL": str(self.stubs / "curl"),
            "WORKER_ONEGATE": str(root / "no-onegate"),
            "WORKER_TOKEN_FILE": str(root / "cd" / "token.txt"),
            "WORKER_SLURMD_PID": str(root / "slurmd.pid"),
            "WORKER_READY_WAIT": "0",
            "WORKER_NVIDIA_SMI": str(root / "no-nvidia-smi"),
            "WORKER_DEV_DIR": str(root / "dev"),
        }

    def stub(self, name: str, extra: str = "") -> None:
        path = self.stubs / name
        path.write_text(STUB.format(dir=self.stubs, name=name, extra=extra))
        path.chmod(0o755)

    def fail(self, name: str, code: int = 1) -> None:
        (self.stubs / f"{name}.rc").write_text(str(code))

    def context_file(self, **values: str) -> Path:
        path = self.root / "context"
        path.write_text("".join(f"{k}='{v}'\n" for k, v in values.items()))
        return path

    def run(self, *args: str, env: dict[str, str] | None = None) -> Run:
        proc = subprocess.run(["/bin/sh", str(SCRIPT), *args], env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        return Run(proc.returncode, proc.stdout, proc.stderr, self.root)


def full_context(**changes: str | None) -> dict[str, str]:
    context = {"SLURM_NODENAME": "gpu01", "SLURM_CONTROLLER": "ctl.example:6817", "MUNGE_KEY_BASE64": KEY_B64,
               "SLURMD_OPTIONS": "-b", "ONEGATE_ENDPOINT": "http://127.0.0.1:5030", "VMID": "7",
               "TOKENTXT": TOKEN, "TOKEN": "YES", "NETWORK": "YES"}
    for key, value in changes.items():
        if value is None:
            context.pop(key, None)
        else:
            context[key] = value
    return context


@pytest.fixture
def worker(tmp_path: Path) -> Worker:
    return Worker(tmp_path)


def assert_secret_kept(run: Run) -> None:
    for text in (run.log, run.console, run.stdout, run.stderr):
        assert KEY_B64 not in text and TOKEN not in text


def test_boots_the_node_from_a_context_file(worker: Worker) -> None:
    run = worker.run(str(worker.context_file(**full_context())))
    assert run.code == 0, run.stderr
    info = run.key.stat()
    assert run.key.read_bytes() == KEY
    assert stat.S_IMODE(info.st_mode) == 0o400 and info.st_uid == MUNGE.pw_uid and info.st_gid == MUNGE.pw_gid
    assert run.args("runuser") == [f"-u munge -- {worker.stubs / 'munged'}"]  # munged runs as munge
    assert run.args("munged") == [""]
    assert run.args("slurmd") == ["-N gpu01 --conf-server ctl.example:6817 -b"]
    [curl] = run.args("curl")
    assert curl == "-sS -f -X PUT http://127.0.0.1:5030/vm --max-time 10 --retry 3 -H @- -d READY=YES"
    assert TOKEN not in curl, "no secret on a command line (ps shows it to every local user)"
    assert (worker.stubs / "curl.stdin").read_text() == f"X-ONEGATE-TOKEN: {TOKEN}\nX-ONEGATE-VMID: 7\n"
    assert not run.ready.exists()  # READY is the worker's alone: net-99 gets no READY_SCRIPT_PATH to run
    munge_run = worker.root / "run-munge"
    assert munge_run.stat().st_uid == MUNGE.pw_uid
    assert "slurmd started as node gpu01" in run.log and "READY=YES reported" in run.log
    assert "node gpu01 is up" in run.console
    for daemon in ("munged", "slurmd"):  # the daemons never see the secrets or a SLURM_CONF
        env = run.env(daemon)
        assert KEY_B64 not in env and TOKEN not in env and "SLURM_CONF=" not in env
    assert_secret_kept(run)


def test_context_from_the_environment_and_the_appliance_names(worker: Worker) -> None:
    context = full_context(SLURM_CONTROLLER=None, MUNGE_KEY_BASE64=None, SLURMD_OPTIONS=None,
                           ONEAPP_SLURM_CONTROLLER_IP="10.0.0.5", ONEAPP_MUNGE_KEY_BASE64=KEY_B64)
    run = worker.run(env={**context, "SLURM_CONF": "/etc/slurm/slurm.conf"})
    assert run.code == 0, run.stderr
    assert run.args("slurmd") == ["-N gpu01 --conf-server 10.0.0.5"]
    assert run.key.read_bytes() == KEY
    assert "SLURM_CONF=" not in run.env("slurmd")
    assert "CONTEXT from the environment" in run.log


def test_context_from_the_context_packages_one_env(worker: Worker) -> None:
    (worker.root / "one_env").write_text("".join(f'export {k}="{v}"\n' for k, v in full_context().items()))
    run = worker.run()
    assert run.code == 0, run.stderr
    assert run.args("slurmd") == ["-N gpu01 --conf-server ctl.example:6817 -b"]
    assert f"CONTEXT from {worker.root / 'one_env'}" in run.log


def test_an_existing_key_is_replaced(worker: Worker) -> None:
    other = base64.b64encode(b"x" * 64).decode()
    worker.run(str(worker.context_file(**full_context(MUNGE_KEY_BASE64=other))))
    run = worker.run(str(worker.context_file(**full_context())))
    assert run.code == 0 and run.key.read_bytes() == KEY
    assert sorted(p.name for p in run.key.parent.iterdir()) == ["munge.key"]  # no temporary left behind


@pytest.mark.parametrize(("changes", "code", "message"), [
    ({"SLURM_NODENAME": None}, 2, "CONTEXT lacks SLURM_NODENAME;"),
    ({"SLURM_CONTROLLER": None}, 2, "CONTEXT lacks SLURM_CONTROLLER(or ONEAPP_SLURM_CONTROLLER_IP);"),
    ({"MUNGE_KEY_BASE64": None}, 2, "CONTEXT lacks MUNGE_KEY_BASE64(or ONEAPP_MUNGE_KEY_BASE64);"),
    ({"MUNGE_KEY_BASE64": None, "SLURM_NODENAME": None}, 2,
     "CONTEXT lacks SLURM_NODENAME MUNGE_KEY_BASE64(or ONEAPP_MUNGE_KEY_BASE64);"),
    ({"MUNGE_KEY_BASE64": "not*base64!"}, 2, "MUNGE_KEY_BASE64 is not valid base64"),
    ({"MUNGE_KEY_BASE64": base64.b64encode(b"short").decode()}, 2,
     "MUNGE_KEY_BASE64 decodes to 5 bytes; a munge key has at least 32"),
    ({"SLURM_NODENAME": "gpu01; reboot"}, 2, "SLURM_NODENAME 'gpu01; reboot' is not a node name"),
    ({"SLURM_CONTROLLER": "ctl $(id)"}, 2, "SLURM_CONTROLLER 'ctl $(id)' is not host[:port]"),
])
def test_refuses_an_incomplete_or_invalid_context(worker: Worker, changes, code, message) -> None:
    run = worker.run(str(worker.context_file(**full_context(**changes))))
    assert run.code == code
    for where in (run.log, run.console, run.stderr):
        assert "REFUSED: " + message in where
    assert f"(log: {worker.root / 'worker.log'})" in run.console
    assert not run.key.exists() and run.args("munged") == [] and run.args("slurmd") == []
    assert not run.ready.exists() and run.args("curl") == []  # never READY
    assert_secret_kept(run)


def test_refuses_without_any_context(worker: Worker) -> None:
    run = worker.run()
    assert run.code == 2
    assert "REFUSED: CONTEXT lacks SLURM_NODENAME SLURM_CONTROLLER" in run.console


@pytest.mark.parametrize(("args", "message"), [
    (["/nonexistent/context"], "cannot read the CONTEXT file /nonexistent/context"),
    (["a", "b"], "usage: "),
])
def test_refuses_bad_arguments(worker: Worker, args, message) -> None:
    run = worker.run(*args)
    assert run.code == 2 and "REFUSED: " + message in run.log and "REFUSED: " + message in run.console


def test_refuses_a_context_file_that_is_not_shell(worker: Worker) -> None:
    path = worker.root / "context"
    path.write_text("SLURM_NODENAME='gpu01\n")  # unterminated quote
    run = worker.run(str(path))
    assert run.code == 2 and f"REFUSED: the CONTEXT file {path} is not shell" in run.console


def test_refuses_without_a_munge_user(worker: Worker) -> None:
    run = worker.run(str(worker.context_file(**full_context())), env={"WORKER_MUNGE_USER": "no-such-user-x"})
    assert run.code == 3 and "REFUSED: no user 'no-such-user-x' in the image: install munge" in run.console
    assert run.args("slurmd") == []


@pytest.mark.parametrize(("override", "path", "message"), [
    ("WORKER_MUNGE_KEY", "file/munge.key", "cannot create the directory of {root}/file/munge.key"),
    ("WORKER_MUNGE_KEY", "dir", "cannot install the munge key as {root}/dir: a directory is in the way"),
    ("WORKER_MUNGE_RUN", "file/munge", "cannot prepare {root}/file/munge for munged"),
])
def test_refuses_when_the_munge_paths_are_unusable(worker: Worker, override, path, message) -> None:
    (worker.root / "file").write_text("a file, not a directory")
    (worker.root / "dir").mkdir()
    run = worker.run(str(worker.context_file(**full_context())), env={override: str(worker.root / path)})
    assert run.code == 3 and "REFUSED: " + message.format(root=worker.root) in run.console
    assert run.args("munged") == [] and run.args("slurmd") == [] and not run.ready.exists()


def test_refuses_when_munged_fails(worker: Worker) -> None:
    worker.fail("munged", 7)
    run = worker.run(str(worker.context_file(**full_context())))
    assert run.code == 3
    assert f"REFUSED: munged did not start: {worker.stubs / 'munged'} exited with 7" in run.console
    assert run.args("slurmd") == [] and not run.ready.exists() and run.args("curl") == []


def test_refuses_when_slurmd_fails(worker: Worker) -> None:
    worker.fail("slurmd", 1)
    run = worker.run(str(worker.context_file(**full_context())))
    assert run.code == 4
    message = "REFUSED: slurmd did not start for node gpu01 against ctl.example:6817: exited with 1"
    assert message in run.console
    assert not run.ready.exists() and run.args("curl") == []


def test_a_refusal_removes_the_ready_check_of_an_earlier_run(worker: Worker) -> None:
    assert worker.run(str(worker.context_file(**full_context()))).code == 0
    worker.fail("slurmd")
    run = worker.run(str(worker.context_file(**full_context())))
    assert run.code == 4 and not run.ready.exists()


def test_console_that_cannot_be_written_is_skipped(worker: Worker) -> None:
    run = worker.run(str(worker.context_file(**full_context(SLURM_NODENAME=None))),
                     env={"WORKER_CONSOLE": str(worker.root / "no-such-dir" / "console")})
    assert run.code == 2 and "REFUSED" in run.log and "REFUSED" in run.stderr


@pytest.mark.parametrize(("changes", "fail_curl", "message"), [
    ({"ONEGATE_ENDPOINT": None}, False, "READY not reported: no ONEGATE_ENDPOINT in CONTEXT"),
    ({"TOKENTXT": None}, False, "READY not reported: no OneGate token or VMID"),
    ({}, True, "READY not accepted by OneGate (http://127.0.0.1:5030), attempt 2 of 3"),
])
def test_ready_is_best_effort(worker: Worker, changes, fail_curl, message) -> None:
    if fail_curl:
        worker.fail("curl", 22)
    run = worker.run(str(worker.context_file(**full_context(**changes))))
    assert run.code == 0 and message in run.log and "READY=YES not reported" in run.log
    assert not run.ready.exists()


def test_ready_is_retried_until_onegate_accepts_it(worker: Worker) -> None:
    # curl fails twice (OneGate still coming up), then succeeds.
    worker.stub("curl", extra=f'cat >"{worker.stubs}/curl.stdin"\n'
                              f'[ "$(wc -l <"{worker.stubs}/curl.args")" -ge 3 ] || exit 22')
    run = worker.run(str(worker.context_file(**full_context())))
    assert run.code == 0 and len(run.args("curl")) == 3 and "READY=YES reported" in run.log


def test_onegate_token_from_one_env_when_the_context_is_in_the_environment(worker: Worker) -> None:
    # one-context exports the CONTEXT variables to START_SCRIPT but never TOKENTXT: loc-16-gen-env writes
    # it to one_env only.
    (worker.root / "one_env").write_text(f'export TOKENTXT="{TOKEN}"\nexport VMID="7"\n')
    run = worker.run(env=full_context(TOKENTXT=None))
    assert run.code == 0 and "READY=YES reported" in run.log, run.log
    assert (worker.stubs / "curl.stdin").read_text() == f"X-ONEGATE-TOKEN: {TOKEN}\nX-ONEGATE-VMID: 7\n"
    assert_secret_kept(run)


def test_onegate_token_from_the_context_cd(worker: Worker) -> None:
    (worker.root / "cd").mkdir()
    (worker.root / "cd" / "token.txt").write_text(TOKEN)  # one-contextd mounts the CD at $MOUNT_DIR
    run = worker.run(env=full_context(TOKENTXT=None))
    assert run.code == 0 and "READY=YES reported" in run.log, run.log
    assert f"X-ONEGATE-TOKEN: {TOKEN}\n" in (worker.stubs / "curl.stdin").read_text()


def test_onegate_token_from_onegate_token_variable(worker: Worker) -> None:
    run = worker.run(str(worker.context_file(**full_context(TOKENTXT=None, ONEGATE_TOKEN=TOKEN))))
    assert run.code == 0 and f"X-ONEGATE-TOKEN: {TOKEN}" in (worker.stubs / "curl.stdin").read_text()


def test_the_onegate_command_is_used_when_installed(worker: Worker) -> None:
    worker.stub("onegate")
    run = worker.run(str(worker.context_file(**full_context())),
                     env={"WORKER_ONEGATE": str(worker.stubs / "onegate")})
    assert run.code == 0 and run.args("onegate") == ["vm update --data READY=YES"] and run.args("curl") == []
    assert f"TOKENTXT={TOKEN}\n" in run.env("onegate") and "VMID=7\n" in run.env("onegate")


def test_the_onegate_command_gets_the_token_from_one_env(worker: Worker) -> None:
    worker.stub("onegate")
    (worker.root / "one_env").write_text(f'export TOKENTXT="{TOKEN}"\n')
    run = worker.run(env={**full_context(TOKENTXT=None), "WORKER_ONEGATE": str(worker.stubs / "onegate")})
    assert run.code == 0 and f"TOKENTXT={TOKEN}\n" in run.env("onegate")


def test_a_slurmd_that_knows_instance_id_is_given_the_vm_id(worker: Worker) -> None:
    # 23.11+ lists --instance-id in `slurmd --help`: the VM's id then reaches slurmctld at registration.
    worker.stub("slurmd", extra='[ "$1" = --help ] && echo "  --instance-id=id  cloud instance id"')
    run = worker.run(str(worker.context_file(**full_context())))
    assert run.code == 0, run.stderr
    assert run.args("slurmd") == ["-N gpu01 --conf-server ctl.example:6817 --instance-id 7 "
                                  "--instance-type opennebula -b"]
    run = worker.run(str(worker.context_file(**full_context(VMID="7 -x"))))  # not a VM id: left out
    assert run.args("slurmd")[-1] == "-N gpu01 --conf-server ctl.example:6817 -b"


def test_systemd_mode_restarts_munge_and_runs_slurmd_in_a_unit_of_its_own(worker: Worker) -> None:
    run = worker.run(str(worker.context_file(**full_context())), env={"WORKER_INIT": "systemd"})
    assert run.code == 0, run.stderr
    assert run.args("systemctl") == ["restart munge.service",
                                     "stop slurmd.service slurm-nebula-slurmd.service",
                                     "reset-failed slurm-nebula-slurmd.service"]
    [systemd_run] = run.args("systemd-run")
    assert systemd_run.startswith("--unit=slurm-nebula-slurmd --description=Slurm node daemon for gpu01")
    assert "-p Type=forking" in systemd_run and "-p KillMode=process" in systemd_run
    assert systemd_run.endswith(f"{worker.stubs / 'slurmd'} -N gpu01 --conf-server ctl.example:6817 -b")
    assert run.args("munged") == [] and run.args("slurmd") == []  # systemd starts them
    assert run.key.read_bytes() == KEY


@pytest.mark.parametrize(("stub", "code", "message"), [
    ("systemctl", 3, "munged did not start: systemctl restart munge.service failed"),
    ("systemd-run", 4, "slurmd did not start for node gpu01 against ctl.example:6817 (journalctl -u "),
])
def test_systemd_mode_refusals(worker: Worker, stub, code, message) -> None:
    worker.fail(stub)
    run = worker.run(str(worker.context_file(**full_context())), env={"WORKER_INIT": "systemd"})
    assert run.code == code and "REFUSED: " + message in run.console and not run.ready.exists()


# ---- reruns on a live node (one-context's udev rules, onevm updateconf) ---------------------------------


@pytest.fixture
def live_daemons(worker: Worker):
    """After a first boot: a munged and a slurmd that run (sleep processes behind their pid files)."""
    first = worker.run(str(worker.context_file(**full_context())))
    assert first.code == 0, first.stderr
    procs = {name: subprocess.Popen(["sleep", "300"]) for name in ("munged", "slurmd")}
    (worker.root / "run-munge" / "munged.pid").write_text(f"{procs['munged'].pid}\n")
    (worker.root / "slurmd.pid").write_text(f"{procs['slurmd'].pid}\n")
    for name in ("munged", "slurmd", "runuser"):
        (worker.stubs / f"{name}.args").unlink()
    yield procs
    for proc in procs.values():
        proc.kill()
        proc.wait()


def test_a_rerun_leaves_a_healthy_munged_and_slurmd_alone(worker: Worker, live_daemons) -> None:
    run = worker.run(str(worker.context_file(**full_context())))
    assert run.code == 0, run.stderr
    assert run.args("munged") == [] and run.args("slurmd") == []
    assert all(proc.poll() is None for proc in live_daemons.values())  # nothing killed under the jobs
    assert "munged already runs with this key: left alone" in run.log
    assert "slurmd already runs as node gpu01" in run.log and "READY=YES reported" in run.log


def test_a_rerun_with_a_new_key_restarts_munged_only(worker: Worker, live_daemons) -> None:
    new_key = base64.b64encode(bytes(reversed(KEY))).decode()
    run = worker.run(str(worker.context_file(**full_context(MUNGE_KEY_BASE64=new_key))))
    assert run.code == 0, run.stderr
    assert run.args("munged") == [""] and run.args("slurmd") == []
    assert live_daemons["munged"].wait(5) is not None and live_daemons["slurmd"].poll() is None


def test_a_rerun_starts_a_slurmd_that_died(worker: Worker, live_daemons) -> None:
    live_daemons["slurmd"].kill()
    live_daemons["slurmd"].wait()
    run = worker.run(str(worker.context_file(**full_context())))
    assert run.code == 0, run.stderr
    assert run.args("slurmd") == ["-N gpu01 --conf-server ctl.example:6817 -b"] and run.args("munged") == []


def test_a_rerun_with_another_controller_restarts_slurmd(worker: Worker, live_daemons) -> None:
    run = worker.run(str(worker.context_file(**full_context(SLURM_CONTROLLER="ctl2.example"))))
    assert run.code == 0, run.stderr
    assert run.args("slurmd") == ["-N gpu01 --conf-server ctl2.example -b"]
    assert live_daemons["slurmd"].wait(5) is not None and live_daemons["munged"].poll() is None


def test_systemd_mode_rerun_leaves_active_units_alone(worker: Worker) -> None:
    env = {"WORKER_INIT": "systemd"}
    assert worker.run(str(worker.context_file(**full_context())), env=env).code == 0
    (worker.stubs / "systemctl.args").unlink()
    (worker.stubs / "systemd-run.args").unlink()
    run = worker.run(str(worker.context_file(**full_context())), env=env)  # the stub says: active
    assert run.code == 0, run.stderr
    assert run.args("systemctl") == ["is-active --quiet munge.service",
                                     "is-active --quiet slurm-nebula-slurmd.service"]
    assert run.args("systemd-run") == []


# ---- GPU devices ------------------------------------------------------------------------------------


def nvidia_smi(worker: Worker, gpus: int, code: int = 0) -> dict[str, str]:
    """A stub nvidia-smi that makes `gpus` device files, as the driver's tools do, and exits `code`; and a
    slurmd stub that notes whether they were there when it started."""
    dev = worker.root / "dev"
    dev.mkdir()
    worker.stub("nvidia-smi", extra=f'i=0; while [ "$i" -lt {gpus} ]; do : >"{dev}/nvidia$i"; i=$((i+1)); done\n'
                f': >"{dev}/nvidiactl"; exit {code}')
    worker.stub("slurmd", extra=f'ls "{dev}" >"{worker.stubs}/slurmd.saw"')
    return {"WORKER_NVIDIA_SMI": str(worker.stubs / "nvidia-smi")}


def test_nvidia_smi_makes_the_gpu_devices_before_slurmd_starts(worker: Worker) -> None:
    # gres.conf names /dev/nvidia0...: slurmd waits about 20 s for a missing one, then exits
    run = worker.run(str(worker.context_file(**full_context())), env=nvidia_smi(worker, 2))
    assert run.code == 0, run.stderr
    assert run.args("nvidia-smi") == ["-L"]
    saw = (worker.stubs / "slurmd.saw").read_text().split()
    assert saw == ["nvidia0", "nvidia1", "nvidiactl"], "the devices exist when slurmd starts"
    dev = worker.root / "dev"
    assert f"GPU devices: {dev}/nvidia0 {dev}/nvidia1" in run.log


def test_a_failing_nvidia_smi_is_logged_and_slurmd_still_starts(worker: Worker) -> None:
    run = worker.run(str(worker.context_file(**full_context())), env=nvidia_smi(worker, 0, code=9))
    assert run.code == 0, run.stderr
    assert "nvidia-smi -L failed (see above): no GPU driver or no GPU" in run.log
    assert run.args("slurmd") == ["-N gpu01 --conf-server ctl.example:6817 -b"]


def test_without_nvidia_smi_nothing_is_tried(worker: Worker) -> None:
    run = worker.run(str(worker.context_file(**full_context())))
    assert run.code == 0 and "GPU devices" not in run.log and "nvidia-smi" not in run.log


def test_a_rerun_that_keeps_slurmd_leaves_the_gpus_alone(worker: Worker, live_daemons) -> None:
    run = worker.run(str(worker.context_file(**full_context())), env=nvidia_smi(worker, 1))
    assert run.code == 0 and run.args("nvidia-smi") == [] and run.args("slurmd") == []


# ---- shipping and linting ---------------------------------------------------------------------------


def test_shipped_once_in_the_package_and_linked_from_etc() -> None:
    link = REPO / "etc" / "worker" / "slurm-nebula-worker.sh"
    assert link.is_symlink() and link.resolve() == SCRIPT.resolve()
    packaged = resources.files("slurm_nebula_power").joinpath("worker/slurm-nebula-worker.sh")
    assert packaged.read_text() == SCRIPT.read_text()
    assert os.access(SCRIPT, os.X_OK)


def test_posix_sh_syntax() -> None:
    for shell in ("/bin/sh", "/bin/dash", "/bin/bash"):
        if os.path.exists(shell):
            proc = subprocess.run([shell, "-n", str(SCRIPT)], capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr


SHELLCHECK = Path("/usr/bin/shellcheck")  # Debian's package (tests/setup-and-run.sh installs it)


def test_shellcheck_clean() -> None:
    shellcheck = str(SHELLCHECK) if os.access(SHELLCHECK, os.X_OK) else shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    proc = subprocess.run([shellcheck, "-s", "sh", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
