"""A real Slurm 22.05+ controller with CLOUD nodes in a temporary directory, for end-to-end tests.

One `SlurmCluster` owns a directory B holding munge's key and socket, slurm.conf, state, spool, pid files
and logs. It starts munged and slurmctld, starts and stops one `slurmd -b -N <node>` per cloud node (each
in a network namespace of its own at the node's VM address, as a VM: tests/vmnet.py), and
stops every process it (or a power program started through its slurm.conf) left behind, by pid.
See ../shared/reference/slurm-e2e.md for why each setting is there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import vmnet

from slurm_nebula_power.shapes import PROGRAMS  # slurm.conf key -> our program

T = TypeVar("T")

BINARIES = ("slurmctld", "slurmd", "scontrol", "sbatch", "sinfo", "squeue", "scancel", "munged", "mungekey")
SEARCH_DIRS = ("/usr/sbin", "/usr/bin", "/sbin", "/bin", "/usr/local/sbin", "/usr/local/bin")
INSTALL_HINT = (
    "install Debian's slurmctld slurmd slurm-client munge: apt-get update && "
    "DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
    "slurmctld slurmd slurm-client munge"
)
# Slurm's own state suffixes (sinfo %T): ~ powered down, # powering up, % powering down, ! pending power
# down, * not responding, $ maintenance, @ pending reboot, ^ rebooting, - planned.
STATE_SUFFIXES = "~#%!*$@^-"

# Prepended to every Python power program written by `python_program`: slurmctld starts the programs with
# fds 0-2 closed, signals blocked and no PATH (reference/slurm-e2e.md, pitfalls 3-5).
PROGRAM_PRELUDE = '''\
import os, signal
for _fd in (0, 1, 2):
    try:
        os.fstat(_fd)
    except OSError:
        _new = os.open(os.devnull, os.O_RDWR)
        if _new != _fd:
            os.dup2(_new, _fd)
            os.close(_new)
signal.pthread_sigmask(signal.SIG_SETMASK, [])
'''


class SlurmUnavailable(Exception):
    """Slurm or munge binaries are missing; the message says how to install them."""


class SlurmCommandError(subprocess.CalledProcessError):
    """A Slurm/munge command exited non-zero; str() carries its output."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


class SlurmTimeout(AssertionError):
    """A bounded wait ran out; the message says what was awaited and what was seen last."""


def find_binary(name: str) -> str | None:
    """Absolute path of a Slurm/munge binary, looked up in the system directories only."""
    for d in SEARCH_DIRS:
        p = Path(d, name)
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which(name)


def find_binaries() -> dict[str, str]:
    """Paths of every binary the harness needs; raises SlurmUnavailable naming the missing ones."""
    found = {name: find_binary(name) for name in BINARIES}
    missing = sorted(n for n, p in found.items() if p is None)
    if missing:
        raise SlurmUnavailable(f"missing {', '.join(missing)}; {INSTALL_HINT}")
    return {n: p for n, p in found.items() if p is not None}


def slurm_version(binaries: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(major, minor) of the Slurm under test, from `slurmctld -V` (which, unlike scontrol, needs no config)."""
    slurmctld = (binaries or find_binaries())["slurmctld"]
    out = subprocess.run([slurmctld, "-V"], capture_output=True, text=True, timeout=10, check=False).stdout
    match = re.search(r"(\d+)\.(\d+)", out)
    if not match:
        raise SlurmUnavailable(f"cannot read the Slurm version from `{slurmctld} -V`: {out!r}")
    return int(match.group(1)), int(match.group(2))


# Runs a command in a mount namespace whose /dev is a VM's with N GPU devices: `vm-devices.sh N ARGV...`.
VM_DEVICES = Path(__file__).resolve().parent / "vm-devices.sh"

PRIMARY_HOST, BACKUP_HOST = "ctl1", "ctl2"  # the controllers' hostnames with backup_controller
BACKUP_ADDR = "127.0.0.3"  # the backup controller's address (its own network namespace)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free right now on `host` (all held open together, then released)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def python_program(path: Path, body: str) -> Path:
    """Write an executable Python program for slurmctld to run: absolute interpreter, fd/signal hygiene."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n{PROGRAM_PRELUDE}\n{body}")
    path.chmod(0o755)
    return path


RECORDING_BODY = '''
import json, subprocess, sys, time
RECORD = {record!r}
SCONTROL = {scontrol!r}
SLURMD = {slurmd!r}
GUEST = {guest!r}  # tests/vmnet.py: runs a command in a network namespace of its own at the VM's address
CONF = os.environ.get("SLURM_CONF", "")
ASKED = {{{asked_env!r}: repr(time.time())}}  # this boot's request: no guest of it starts before the next second
def note(**fields):
    with open(RECORD, "a") as f:
        f.write(json.dumps(dict(fields, t=time.time(), pid=os.getpid())) + "\\n")
_resume = os.environ.get("SLURM_RESUME_FILE")
_content = None
if _resume:
    with open(_resume) as f:
        _content = f.read()
note(event="call", argv=sys.argv[1:], env=dict(os.environ), resume_file=_content)
HOSTS = subprocess.run([SCONTROL, "show", "hostnames", sys.argv[1]], capture_output=True, text=True,
                       timeout=30).stdout.split() if len(sys.argv) > 1 else []
def scontrol(*args):
    started = time.time()
    p = subprocess.run([SCONTROL, *args], capture_output=True, text=True, timeout=30,
                       stdin=subprocess.DEVNULL)
    note(event="scontrol", args=list(args), rc=p.returncode, out=p.stdout + p.stderr, started=started)
    return p
def boot(nodes, addrs, guest_addrs=None):
    """Tell Slurm each node's address, then start its slurmd (-b: fresh boot) as a VM at that address
    (or at guest_addrs: a guest whose address is not the one Slurm was told)."""
    scontrol("update", "NodeName=" + ",".join(nodes), "NodeAddr=" + ",".join(addrs),
             "NodeHostname=" + ",".join(nodes))
    for n, a in zip(nodes, guest_addrs or addrs):
        p = subprocess.run([*GUEST, a, n, "--", SLURMD, "-b", "-N", n, "-f", CONF], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=60, env=dict(os.environ, **ASKED))
        note(event="slurmd", node=n, addr=a, rc=p.returncode, out=p.stdout + p.stderr)
'''


def recording_program(path: Path, record: Path, action: str = "", binaries: Mapping[str, str] | None = None,
                      ) -> Path:
    """A Python power program that appends its argv, env and SLURM_RESUME_FILE to `record` (JSON lines),
    then runs `action`, which may use HOSTS (expanded argv[1]), scontrol(*args), boot(nodes, addrs,
    guest_addrs=None), note(**fields)."""
    bins = dict(binaries) if binaries else find_binaries()
    body = RECORDING_BODY.format(record=str(record), scontrol=bins["scontrol"], slurmd=bins["slurmd"],
                                 guest=vmnet.guest_argv("", [])[:2], asked_env=vmnet.ASKED_AT_ENV)
    return python_program(path, body + "\n" + action + "\n")


def wait_until(get: Callable[[], T], ok: Callable[[T], bool], timeout: float, what: str,
               interval: float = 0.2) -> T:
    """Poll get() until ok(value) holds and return that value; SlurmTimeout names `what` and the last."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = get()
        except (subprocess.SubprocessError, OSError) as exc:
            last = exc
        else:
            if ok(last):
                return last
        if time.monotonic() >= deadline:
            raise SlurmTimeout(f"timed out after {timeout:g}s waiting for {what}; last seen: {last!r}")
        time.sleep(interval)


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll `predicate` until it returns a truthy value (returned); SlurmTimeout names `what` otherwise."""
    return wait_until(predicate, bool, timeout, what, interval)


def parse_oneliner(line: str) -> dict[str, str]:
    """Parse one `scontrol show ... -o` record into key -> value (values may contain spaces)."""
    out: dict[str, str] = {}
    for token in re.split(r" +(?=[A-Za-z][A-Za-z0-9_/:.]*=)", line.strip()):
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value
    return out


def pid_alive(pid: int) -> bool:
    """True when `pid` exists and is not a zombie (daemons are reaped by init, maybe late)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def stop_pid(pid: int, timeout: float = 5.0) -> None:
    """SIGTERM `pid`, wait up to `timeout`, then SIGKILL it; never touches our own process."""
    if pid <= 1 or pid == os.getpid():
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 2.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # only reaps our own children; others are reaped by init
            if not pid_alive(pid):
                return
            time.sleep(0.05)


@dataclass(eq=False)
class SlurmCluster:
    """A slurmctld with CLOUD nodes under `base`; use as a context manager or call start()/stop()."""

    base: Path
    nodes: Sequence[str] = ("cloud1", "cloud2")
    # slurmctld disables power saving unless both ResumeProgram and SuspendProgram are set, so a missing
    # one defaults to /bin/true.
    resume_program: Path | str | None = "/bin/true"
    suspend_program: Path | str | None = "/bin/true"
    resume_fail_program: Path | str | None = None
    suspend_time: int = 10
    suspend_timeout: int = 10
    resume_timeout: int = 60
    # True: a built-in prolog that lets a job start as soon as its nodes are up (reference pitfall 7);
    # a path: that program; None: no PrologSlurmctld (a job then waits for slurmctld's 30 s pass).
    prolog_slurmctld: Path | str | bool | None = True
    partition: str = "cloud"
    cluster_name: str = "cloudtest"
    cpus: int = 1
    real_memory: int = 100
    node_extra: str = ""  # appended to every NodeName line, e.g. "Feature=gpu"
    extra_conf: str = ""  # appended to slurm.conf
    # AuthInfo cred_expire: also the delay before a requeued batch job may start again (Slurm: 120 s).
    cred_expire: int | None = 10
    slurmctld_parameters: Sequence[str] = ()  # added to idle_on_node_suspend,power_save_interval=1
    # SchedulerParameters sched_interval (Slurm: 60 s): how soon a requeued job is looked at again.
    sched_interval: int | None = 2
    # A backup controller: SlurmctldHost twice, primary and backup sharing StateSaveLocation (and whatever
    # else is under base). slurmctld picks its role by its hostname, so the primary runs as host PRIMARY_HOST
    # at 127.0.0.1 and the backup as BACKUP_HOST in a network namespace of its own at BACKUP_ADDR, on the
    # same SlurmctldPort (tests/vmnet.py); the backup's slurm.conf differs only in its pid and log files.
    backup_controller: bool = False
    slurmctld_timeout: int = 5  # SlurmctldTimeout (Slurm: 120 s): how long the backup waits to take over
    timeout: float = 30.0  # bound for one command (scontrol, sbatch, a daemon start)
    binaries: dict[str, str] = field(default_factory=find_binaries)
    extra_logs: dict[str, Path] = field(default_factory=dict)
    _log_marks: dict[Path, int] = field(default_factory=dict, repr=False)
    _started: bool = field(default=False, repr=False)
    _version: tuple[int, int] | None = field(default=None, repr=False)

    live: ClassVar[set[SlurmCluster]] = set()  # clusters started and not yet stopped (for log reports)

    # ---- layout -------------------------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        """Path of slurm.conf (what SLURM_CONF names)."""
        return self.base / "slurm.conf"

    @property
    def log_dir(self) -> Path:
        """Directory of every log: slurmctld.log, slurmd-<node>.log, munged.log, plus the programs' own."""
        return self.base / "log"

    @property
    def run_dir(self) -> Path:
        """Directory of the pid files."""
        return self.base / "run"

    @property
    def job_dir(self) -> Path:
        """Working directory of batch jobs; their output is slurm-<jobid>.out here."""
        return self.base / "jobs"

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm commands: ours without inherited SLURM_* variables, plus SLURM_CONF."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        return env

    @property
    def backup_conf(self) -> Path:
        """The backup controller's slurm.conf (its own SlurmctldPidFile and SlurmctldLogFile)."""
        return self.base / "slurm-backup.conf"

    def slurmd_pidfile(self, node: str) -> Path:
        """Pid file slurmd writes for `node` (SlurmdPidFile=.../slurmd-%n.pid)."""
        return self.run_dir / f"slurmd-{node}.pid"

    @property
    def version(self) -> tuple[int, int]:
        """(major, minor) of this cluster's Slurm."""
        if self._version is None:
            self._version = slurm_version(self.binaries)
        return self._version

    def slurmd_argv(self, node: str) -> list[str]:
        """Command that boots `node`: slurmd reporting a fresh boot time (-b), as a hook would run it."""
        return [self.binaries["slurmd"], "-b", "-N", node, "-f", str(self.conf)]

    def guest_argv(self, node: str, addr: str, gpus: int = 0) -> list[str]:
        """slurmd_argv run as a VM would: in a network namespace of its own whose address is `addr` (and
        hostname `node`), so it registers from `addr` (tests/vmnet.py). From 23.11 slurmctld takes the
        address a CLOUD node registers from as its NodeAddr (cloud_reg_addrs, the default). With `gpus`, in a
        mount namespace too whose /dev has that many GPUs, /dev/nvidia0... (tests/vm-devices.sh)."""
        argv = self.slurmd_argv(node)
        return vmnet.guest_argv(addr, [str(VM_DEVICES), str(gpus), *argv] if gpus else argv, hostname=node)

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> SlurmCluster:
        """Create the directory tree, start munged and slurmctld, and wait until `scontrol ping` is UP."""
        for d in ("munge", "state", "spool", "run", "log", "bin", "jobs"):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        (self.base / "munge").chmod(0o755)
        self.base.chmod(0o755)
        SlurmCluster.live.add(self)
        self._started = True
        self._start_munged()
        self.write_conf()
        if self.backup_controller:
            vmnet.reserve(BACKUP_ADDR)  # until the backup runs (after the primary), not the primary itself
        self._run(self._slurmctld_argv(clear_state=True), what="slurmctld start")
        self._wait_ping()
        if self.backup_controller:
            backup = [self.binaries["slurmctld"], "-f", str(self.backup_conf)]
            self._run(vmnet.guest_argv(BACKUP_ADDR, backup, hostname=BACKUP_HOST), what="backup slurmctld start")
            self._wait_ping(f"Slurmctld(backup) at {BACKUP_HOST} is UP")
        return self

    def _slurmctld_argv(self, clear_state: bool) -> list[str]:
        argv = [self.binaries["slurmctld"], "-f", str(self.conf)] + (["-c"] if clear_state else [])
        return vmnet.guest_argv("", argv, hostname=PRIMARY_HOST) if self.backup_controller else argv

    def kill_primary(self) -> int:
        """SIGKILL the primary slurmctld (a controller host that dies); returns its pid once it is gone."""
        pid = self._pid_from(self.run_dir / "slurmctld.pid")
        assert pid is not None, "no primary slurmctld running"
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), self.timeout, f"slurmctld {pid} gone")
        return pid

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_conf(self) -> None:
        """Write slurm.conf from the fields (call restart_slurmctld() after changing them)."""
        b = self.base
        ctld_port, *node_ports = free_ports(1 + len(self.nodes))
        prolog = self.prolog_slurmctld
        if prolog is True:
            prolog = self._write_prolog()
        controllers = [f"SlurmctldHost={PRIMARY_HOST}(127.0.0.1)", f"SlurmctldHost={BACKUP_HOST}({BACKUP_ADDR})",
                       f"SlurmctldTimeout={self.slurmctld_timeout}"] if self.backup_controller else [
                       "SlurmctldHost=localhost(127.0.0.1)"]
        lines = [
            f"ClusterName={self.cluster_name}",
            *controllers,
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={b}/munge/munge.socket"
            + (f",cred_expire={self.cred_expire}" if self.cred_expire else ""),
            f"SlurmctldPort={ctld_port}",
            f"StateSaveLocation={b}/state",
            f"SlurmdSpoolDir={b}/spool/%n",
            f"SlurmctldPidFile={b}/run/slurmctld.pid",
            f"SlurmdPidFile={b}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={b}/log/slurmctld.log",
            f"SlurmdLogFile={b}/log/slurmd-%n.log",
            "SlurmctldDebug=verbose",
            "SlurmdDebug=verbose",
            # The backup's slurm.conf differs in its pid and log files: slurmctld would log every registration.
            "DebugFlags=Power" + (",NO_CONF_HASH" if self.backup_controller else ""),
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "PrivateData=cloud",
            f"SuspendTime={self.suspend_time}",
            f"SuspendTimeout={self.suspend_timeout}",
            f"ResumeTimeout={self.resume_timeout}",
            "ResumeRate=0",
            "SuspendRate=0",
            "SlurmctldParameters=" + ",".join(
                ["idle_on_node_suspend", "power_save_interval=1", *self.slurmctld_parameters]),
        ]
        if self.sched_interval:
            lines.append(f"SchedulerParameters=sched_interval={self.sched_interval}")
        for key, value in (
            ("ResumeProgram", self.resume_program),
            ("SuspendProgram", self.suspend_program),
            ("ResumeFailProgram", self.resume_fail_program),
            ("PrologSlurmctld", prolog),
        ):
            if value:
                lines.append(f"{key}={value}")
        for node, port in zip(self.nodes, node_ports, strict=True):
            # No NodeAddr: a cloud node's address reaches Slurm only through `scontrol update NodeAddr=`.
            lines.append(
                f"NodeName={node} Port={port} CPUs={self.cpus} RealMemory={self.real_memory} "
                f"State=CLOUD {self.node_extra}".rstrip()
            )
        lines.append(f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=10 State=UP")
        if self.extra_conf:
            lines.append(self.extra_conf)
        self.conf.write_text("\n".join(lines) + "\n")
        if self.backup_controller:
            own = {f"SlurmctldPidFile={b}/run/slurmctld.pid": f"SlurmctldPidFile={b}/run/slurmctld-backup.pid",
                   f"SlurmctldLogFile={b}/log/slurmctld.log": f"SlurmctldLogFile={b}/log/slurmctld-backup.log"}
            self.backup_conf.write_text("\n".join(own.get(line, line) for line in lines) + "\n")

    def restart_slurmctld(self, clear_state: bool = False) -> None:
        """Stop slurmctld and start it again from slurm.conf (state kept unless clear_state)."""
        self._stop_pidfile(self.run_dir / "slurmctld.pid", "slurmctld")
        self._run(self._slurmctld_argv(clear_state), what="slurmctld restart")
        self._wait_ping()

    def stop(self) -> None:
        """Stop jobs, every slurmd, slurmctld, leftover children of the power programs, then munged."""
        if not self._started:
            return
        self._started = False
        try:
            if self._pid_from(self.run_dir / "slurmctld.pid"):
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    subprocess.run([self.binaries["scancel"], "--full", "--user", "root"], env=self.env,
                                   capture_output=True, timeout=5, check=False)
            for pidfile in sorted(self.run_dir.glob("slurmd-*.pid")):
                self._stop_pidfile(pidfile, "slurmd")
            self._stop_pidfile(self.run_dir / "slurmctld.pid", "slurmctld")
            self._stop_pidfile(self.run_dir / "slurmctld-backup.pid", "slurmctld")
            # Whatever still carries our SLURM_CONF (job steps, detached program children) goes too.
            for conf in (self.conf, self.backup_conf):
                for pid in self._pids_with_env(f"SLURM_CONF={conf}".encode()):
                    stop_pid(pid, timeout=2)
            self._stop_pidfile(self.run_dir / "munged.pid", "munged")
            # 24.11 and 26.05's slurmstepd (a batch step whose slurmd is gone) carries the job's environment,
            # not SLURM_CONF, and outlives SIGTERM: find what still works in this directory.
            for pid in self._pids_under(self.base):
                stop_pid(pid, timeout=2)
        finally:
            SlurmCluster.live.discard(self)

    # ---- commands -----------------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float | None = None,
            ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client (name or path) with SLURM_CONF set, bounded, capturing text output."""
        exe = self.binaries.get(argv[0], argv[0])
        return self._run([exe, *argv[1:]], check=check, timeout=timeout, what=" ".join(argv[:3]))

    def scontrol(self, *args: str, check: bool = True) -> str:
        """`scontrol ARGS...`; returns stdout; raises on a non-zero exit unless check=False."""
        return self.run("scontrol", *args, check=check).stdout

    def sbatch(self, *args: str, script: str | None = None, nodes: int = 1) -> int:
        """Submit a batch job (default: each node prints its Slurm name via srun) and return its job id."""
        if script is None and not any(a.startswith("--wrap") for a in args):
            script = "#!/bin/sh\n/usr/bin/srun /usr/bin/printenv SLURMD_NODENAME\n"
        argv = ["sbatch", "--parsable", f"--nodes={nodes}", f"--chdir={self.job_dir}",
                f"--partition={self.partition}", *args]
        if script is not None:
            path = self.job_dir / f"job-{time.monotonic_ns()}.sh"
            path.write_text(script)
            argv.append(str(path))
        out = self.run(*argv).stdout.strip()
        return int(out.split(";")[0])

    def node_info(self, name: str) -> dict[str, str]:
        """`scontrol show node -o NAME` as a dict (State, Reason, NodeAddr, NodeHostName, ...)."""
        out = self.scontrol("show", "node", "-o", name)
        return parse_oneliner(out.splitlines()[0]) if out.strip() else {}

    def node_state(self, name: str) -> str:
        """Node State as scontrol prints it, e.g. IDLE+CLOUD+POWERED_DOWN."""
        return self.node_info(name).get("State", "")

    def sinfo_state(self, name: str) -> str:
        """Node state as sinfo prints it, with Slurm's suffixes, e.g. idle~, alloc#, down~."""
        return self.run("sinfo", "-h", "-N", "-n", name, "-o", "%T").stdout.strip()

    def job_info(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o ID` as a dict (JobState, Reason, Restarts, NodeList, ...)."""
        out = self.scontrol("show", "job", "-o", str(job_id))
        return parse_oneliner(out.splitlines()[0]) if out.strip() else {}

    def job_state(self, job_id: int) -> str:
        """JobState of a job, e.g. PENDING, CONFIGURING, RUNNING, COMPLETED."""
        return self.job_info(job_id).get("JobState", "")

    def job_output(self, job_id: int) -> str:
        """The batch job's stdout file content ('' when not written yet)."""
        path = self.job_dir / f"slurm-{job_id}.out"
        return path.read_text() if path.exists() else ""

    def wait_until(self, get: Callable[[], T], ok: Callable[[T], bool], timeout: float, what: str,
                   interval: float = 0.2) -> T:
        """Module-level wait_until; on timeout the message also carries the tail of slurmctld.log."""
        try:
            return wait_until(get, ok, timeout, what, interval)
        except SlurmTimeout as exc:
            raise SlurmTimeout(f"{exc}\n--- slurmctld.log (tail) ---\n{self.log_tail('slurmctld.log', 40)}"
                               ) from None

    def wait_for(self, predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
        """Poll until predicate() is truthy and return it; on timeout, say what and show slurmctld.log."""
        return self.wait_until(predicate, bool, timeout, what, interval)

    def wait_node(self, name: str, ok: Callable[[str], bool], timeout: float, what: str) -> str:
        """Wait until ok(sinfo state of NAME) holds, e.g. `lambda s: s == "idle~"`; returns that state."""
        return self.wait_until(lambda: self.sinfo_state(name), ok, timeout, f"node {name} {what}")

    def wait_job(self, job_id: int, states: Sequence[str], timeout: float) -> str:
        """Wait until the job's JobState is one of `states`; returns it."""
        return self.wait_until(lambda: self.job_state(job_id), lambda s: s in states, timeout,
                               f"job {job_id} in {'/'.join(states)}")

    # ---- slurmd -------------------------------------------------------------------------------------
    def start_slurmd(self, node: str, addr: str, gpus: int = 0) -> int:
        """Boot NODE as a VM at `addr` (with `gpus` GPU devices): start `slurmd -b -N NODE` in a network
        namespace of its own at that address (guest_argv); returns its pid once the pid file names a live
        process."""
        self._run(self.guest_argv(node, addr, gpus), what=f"slurmd {node} start")
        pidfile = self.slurmd_pidfile(node)
        return wait_for(lambda: self._pid_from(pidfile), self.timeout, f"pid file {pidfile}")

    def stop_slurmd(self, node: str) -> None:
        """Stop NODE's slurmd by the pid in its pid file (no-op when it is not running)."""
        self._stop_pidfile(self.slurmd_pidfile(node), "slurmd")

    # ---- logs ---------------------------------------------------------------------------------------
    def add_log(self, title: str, path: Path) -> None:
        """Register another log (a program's, the simulator's) to attach to a failing test's report."""
        self.extra_logs[title] = Path(path)

    def logs(self) -> dict[str, Path]:
        """Every log file by title: slurmctld, each slurmd, munged, and the registered ones."""
        logs = {p.name: p for p in sorted(self.log_dir.glob("*.log"))}
        logs.update(self.extra_logs)
        return logs

    def mark_logs(self) -> None:
        """Remember the current end of every log; log_sections() then shows only what came after."""
        self._log_marks = {p: p.stat().st_size for p in self.logs().values() if p.exists()}

    def log_sections(self, max_lines: int = 300) -> list[tuple[str, str]]:
        """(title, text) per log since mark_logs(), at most max_lines each, for a failing test's report."""
        sections = []
        for title, path in self.logs().items():
            if not path.exists():
                continue
            with path.open("rb") as f:
                f.seek(self._log_marks.get(path, 0))
                lines = f.read().decode(errors="replace").splitlines()
            if lines:
                sections.append((title, "\n".join(lines[-max_lines:])))
        return sections

    def log_tail(self, title: str, lines: int = 40) -> str:
        """Last lines of one log by title ('' when absent)."""
        return "\n".join(self.log_text(title).splitlines()[-lines:])

    def log_text(self, title: str) -> str:
        """One log by title, whole ('' when absent): for what must be in it, however much came after."""
        path = self.logs().get(title)
        if path is None or not path.exists():
            return ""
        return path.read_text(errors="replace")

    def read_jsonl(self, path: Path) -> list[dict[str, Any]]:
        """Records of a JSON-lines file a test program appended to ([] when absent)."""
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    # ---- internals ----------------------------------------------------------------------------------
    def _run(self, argv: list[str], *, check: bool = True, timeout: float | None = None,
             what: str = "") -> subprocess.CompletedProcess[str]:
        try:
            proc = subprocess.run(argv, env=self.env, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=timeout or self.timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise SlurmTimeout(f"{what or argv[0]}: no answer within {exc.timeout}s: {argv}") from None
        if check and proc.returncode != 0:
            raise SlurmCommandError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc

    def _start_munged(self) -> None:
        m = self.base / "munge"
        key = m / "munge.key"
        if not key.exists():
            self._run([self.binaries["mungekey"], "-c", "-k", str(key)], what="mungekey")
            key.chmod(0o400)
        self._run([self.binaries["munged"], f"--socket={m}/munge.socket", f"--key-file={key}",
                   f"--pid-file={self.run_dir}/munged.pid", f"--log-file={self.log_dir}/munged.log",
                   f"--seed-file={m}/munge.seed"], what="munged start")
        wait_for(lambda: (m / "munge.socket").exists() and self._pid_from(self.run_dir / "munged.pid"),
                 self.timeout, "munged socket and pid file")

    def _wait_ping(self, expect: str = "UP") -> None:
        def up() -> bool:
            proc = self.run("scontrol", "ping", check=False, timeout=10)
            return expect in proc.stdout
        try:
            wait_for(up, self.timeout, f"`scontrol ping` to say {expect}", interval=0.1)
        except SlurmTimeout as exc:
            tail = self.log_tail("slurmctld.log", 60)
            raise SlurmTimeout(f"{exc}\n--- slurmctld.log ---\n{tail}") from None

    def _write_prolog(self) -> Path:
        # PrologSlurmctld gets SLURM_JOB_ID and SLURM_JOB_NODELIST but no PATH. It returns once every node
        # of the job is up, so the job starts now rather than at slurmctld's next 30 s scheduling pass.
        # It must also return when the job leaves CONFIGURING (requeued after a failed resume): slurmctld
        # does not stop it, and the requeued job stays PENDING "Cleaning" until the old prolog ends.
        body = f'''
import os, subprocess, time
env = dict(os.environ, SLURM_CONF={str(self.conf)!r})
nodes = os.environ.get("SLURM_JOB_NODELIST", "")
job = os.environ.get("SLURM_JOB_ID", "")
def out(*argv):
    try:  # a failing prolog would requeue the job: never fail, at worst wait for the next poll
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
deadline = time.monotonic() + {self.resume_timeout + 30}
while nodes and time.monotonic() < deadline:
    states = out({self.binaries["sinfo"]!r}, "-h", "-N", "-n", nodes, "-o", "%T")
    if states and not any(c in s for s in states for c in "~#%!*") and not any(
            s.startswith(("down", "drain", "fail")) for s in states):
        break
    if out({self.binaries["squeue"]!r}, "-h", "-j", job, "-o", "%T") not in (None, ["CONFIGURING"]):
        break
    time.sleep(0.2)
'''
        return python_program(self.base / "bin" / "prolog-wait-nodes", body)

    @staticmethod
    def _pid_from(pidfile: Path) -> int | None:
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def _stop_pidfile(self, pidfile: Path, comm: str) -> None:
        pid = self._pid_from(pidfile)
        if pid is None:
            return
        try:  # a stale pid file may name a reused pid: only stop the program we started
            if not Path(f"/proc/{pid}/comm").read_text().strip().startswith(comm[:15]):
                return
        except OSError:
            return
        stop_pid(pid, timeout=self.timeout / 3)

    @staticmethod
    def _pids_under(base: Path) -> list[int]:
        """Processes other than this one whose working directory or an open file is under `base`."""
        me, prefix = os.getpid(), f"{base}/"
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                links = [os.readlink(entry / "cwd"), *(os.readlink(fd) for fd in (entry / "fd").iterdir())]
            except OSError:
                continue
            if any(link.startswith(prefix) for link in links):
                pids.append(int(entry.name))
        return pids

    def _pids_with_env(self, marker: bytes) -> list[int]:
        me = os.getpid()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids



def rewrite_lines(path: Path, change: Callable[[list[str]], list[str]]) -> None:
    """Replace a file's lines (a slurm.conf) with `change(lines)`."""
    path.write_text("\n".join(change(path.read_text().splitlines())) + "\n")


def as_power_actions(lines: list[str], location: str = "slurmctld", arguments: str = "") -> list[str]:
    """slurm.conf lines with the power programs named through Slurm 26.05's PowerAction lines (an action per
    program, at `location`, its Program the path plus `arguments`)."""
    out, actions = [], []
    for line in lines:
        key, _, path = line.partition("=")
        if key in PROGRAMS:
            name = f"nebula_{key.lower()}"
            out.append(f"{key}={name}")
            actions.append(f'PowerAction={name} Location={location} Program="{path}{arguments}"')
        else:
            out.append(line)
    assert actions, lines
    return out + actions


def make_base(prefix: str = "snp-slurm-") -> Path:
    """A fresh 0755 directory under /tmp for one cluster.

    munged refuses a socket under a directory that others cannot traverse (pytest's tmp dirs are 0700),
    and the socket path must fit in sockaddr_un (108 bytes): keep it short and world-executable.
    """
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    base.chmod(0o755)
    return base


@contextlib.contextmanager
def slurm_cluster(base: Path | None = None, keep: bool = False, **kwargs: Any) -> Iterator[SlurmCluster]:
    """Context manager form: `with slurm_cluster(resume_program=...) as c: ...`; removes the directory
    afterwards unless keep (or an exception escaped)."""
    cluster = SlurmCluster(base or make_base(), **kwargs)
    try:
        yield cluster.start()
    except BaseException:
        keep = True
        raise
    finally:
        cluster.stop()
        if not keep:
            shutil.rmtree(cluster.base, ignore_errors=True)
