"""End-to-end deployment for tests/test_e2e.py: real slurmctld + the OpenNebula simulator + our programs.

`E2E` wires a `SlurmCluster` (tests/slurmharness.py) whose ResumeProgram, SuspendProgram and
ResumeFailProgram are the installed console scripts, a `nebula-power.toml` beside its slurm.conf (found the
way production finds it: through the SLURM_CONF slurmctld passes), and an in-process simulator whose hooks
play the guest: `on_running` starts `slurmd -b -N <VM name>` in a network namespace of its own at the VM's
IP (tests/vmnet.py), `on_stopped` stops that slurmd and then kills whatever else runs in its namespace
(slurmstepd, the job's processes), as a powered-off guest loses them. slurm.conf gives the nodes no
NodeAddr, so slurmctld reaches a VM's slurmd (127.0.1.x) only through the NodeAddr our resume sets from the
VM's lease (or, from 23.11, the address it registers from: the same).

Every log lands in the cluster's log directory (slurmctld.log, slurmd-<node>.log, munged.log,
nebula-power.log, simulator.log, hooks.log), which the conftest attaches to a failing test's report.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import vmnet
from slurmharness import SlurmCluster, python_program

from opennebula_sim import Durations, SimConfig, Simulator
from opennebula_sim.config import default_hosts

BIN = Path(sys.executable).parent
RESUME = BIN / "slurm-nebula-resume"
SUSPEND = BIN / "slurm-nebula-suspend"
RESUME_FAIL = BIN / "slurm-nebula-resume-fail"
POWER = BIN / "slurm-nebula-power"

DONE = 6  # OpenNebula VM STATE DONE
PENDING = 1

# Short simulated phases: a VM runs ~0.7 s after it is dispatched, is DONE ~0.5 s after terminate.
FAST = Durations(prolog=0.3, boot=0.4, shutdown=0.2, epilog=0.2)

# One program for both hooks (ONE_VM_EVENT tells which). The guest's "boot" is its slurmd; a file
# `no-slurmd-<node>` in the hook directory makes that node's VM run without one (a guest that never
# registers). Each event is appended to hooks.jsonl; slurmd's own output goes to hooks.log.
HOOK_BODY = '''
import json, os, signal, subprocess, sys, time
HOOK_DIR = {hook_dir!r}
RECORD = {record!r}
LOG = {log!r}
SLURMD = {slurmd_argv!r}
GUEST = {guest!r}
PIDFILE = {pidfile!r}
SCONTROL = {scontrol!r}
CONF = {conf!r}
event, node = os.environ["ONE_VM_EVENT"], os.environ["ONE_VM_NAME"]
vm_id, ip = os.environ["ONE_VM_ID"], os.environ.get("ONE_VM_IP", "")
context = {{}}
try:
    for line in open(os.environ["ONE_VM_CONTEXT"]):
        key, _, value = line.rstrip("\\n").partition("=")
        context[key] = value.strip("'")
except OSError:
    pass
def note(**fields):
    record = dict(fields, event=event, node=node, vm_id=int(vm_id), ip=ip, t=time.time())
    with open(RECORD, "a") as f:
        f.write(json.dumps(record) + "\\n")
    with open(LOG, "a") as f:
        fields = " ".join(f"{{k}}={{v}}" for k, v in record.items())
        f.write(time.strftime("%Y-%m-%d %H:%M:%S ") + fields + "\\n")
def addr_in_slurm(node):
    """The NodeAddr slurmctld has for the node now: before slurmd registers, only resume can have set it."""
    try:
        out = subprocess.run([SCONTROL, "show", "node", "-o", node], env=dict(os.environ, SLURM_CONF=CONF),
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((t[len("NodeAddr="):] for t in out.split() if t.startswith("NodeAddr=")), None)
def pid_of(node):
    try:
        pid = int(open(PIDFILE.replace("%n", node)).read().strip())
        comm = open(f"/proc/{{pid}}/comm").read().strip()
    except (OSError, ValueError):
        return None
    return pid if comm.startswith("slurmd") else None
def namespace_of(pid):
    """The guest's network namespace (None for the hook's own: never a namespace to empty)."""
    try:
        ns = os.readlink(f"/proc/{{pid}}/ns/net")
    except OSError:
        return None
    return None if ns == os.readlink("/proc/self/ns/net") else ns
def guest_processes(ns):
    """Every process left in the guest's network namespace: slurmd's slurmstepds and the jobs' processes
    outlive slurmd, and a later guest of the same name would find the old job still running ("Duplicate
    jobid"), which no powered-off VM leaves behind."""
    found = []
    for entry in os.listdir("/proc") if ns else ():
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if os.readlink(f"/proc/{{entry}}/ns/net") == ns:
                    found.append(int(entry))
            except OSError:
                pass
    return found
with open(LOG, "a") as log:
    if event == "running":
        if os.path.exists(os.path.join(HOOK_DIR, "no-slurmd-" + node)):
            note(action="skipped", hostname=context.get("SET_HOSTNAME"))
        else:
            # The guest: slurmd in a network namespace of its own at the VM's IP, hostname as CONTEXT says.
            argv = [*GUEST, ip, context.get("SET_HOSTNAME") or node, "--", *(a.replace("%n", node) for a in SLURMD)]
            addr = addr_in_slurm(node)
            rc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=30).returncode
            note(action="slurmd", rc=rc, hostname=context.get("SET_HOSTNAME"), addr_at_boot=addr)
    else:
        pid = pid_of(node)
        ns = namespace_of(pid) if pid else None
        if pid:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while pid_of(node) == pid and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_of(node) == pid:
                os.kill(pid, signal.SIGKILL)
        rest = guest_processes(ns)
        for other in rest:
            try:
                os.kill(other, signal.SIGKILL)
            except OSError:
                pass
        note(action="stopped slurmd" if pid else "no slurmd", pid=pid, killed=len(rest))
'''


def gpu_hosts(count: int, gpus_per_host: int) -> Any:
    """Simulated hypervisors: `count` hosts with `gpus_per_host` GPUs each."""
    return default_hosts(count, gpus_per_host)


@dataclass
class E2E:
    """One deployment: cluster, simulator, configuration; see the module docstring."""

    cluster: SlurmCluster
    sim: Simulator
    config: Path
    hook_dir: Path
    boot_timeout: float
    _handler: logging.Handler | None = field(default=None, repr=False)
    _watching: threading.Event = field(default_factory=threading.Event, repr=False)
    # (time.time(), vm id, state_str, host) each time the watcher saw a VM change state: the truth usage is
    # checked against (the watcher looks every 0.05 s)
    timeline: list[tuple[float, int, str, str | None]] = field(default_factory=list, repr=False)

    def watch_vms(self, interval: float = 0.05) -> None:
        """Log every VM state change to simulator.log (a failing test's report shows the VMs' life)."""
        log = logging.getLogger("opennebula_sim.e2e")

        def run() -> None:
            seen: dict[int, tuple[Any, ...]] = {}
            while not self._watching.wait(interval):
                try:
                    vms = self.sim.vms()
                except Exception:  # the simulator is stopping
                    return
                stamp = time.time()
                for vm in vms:
                    now = (vm.state_str, vm.host, vm.ip, vm.user_template.get("SLURM_JOB_IDS"))
                    if seen.get(vm.id, (None,))[0] != vm.state_str:
                        self.timeline.append((stamp, vm.id, vm.state_str, vm.host))
                    if seen.get(vm.id) != now:
                        seen[vm.id] = now
                        log.info("vm=%d name=%s state=%s host=%s ip=%s jobs=%s", vm.id, vm.name, *now)

        threading.Thread(target=run, name="e2e-vm-watch", daemon=True).start()

    # ---- files --------------------------------------------------------------------------------------
    def seen_in(self, vm_id: int, state_str: str) -> tuple[float, str | None]:
        """When the watcher first saw the VM in this state (time.time()), and on which host."""
        return next((t, host) for t, vm, state, host in self.timeline if vm == vm_id and state == state_str)

    @property
    def audit_file(self) -> Path:
        """The usage records ([log] audit_file)."""
        return self.cluster.log_dir / "audit.jsonl"

    @property
    def metrics_file(self) -> Path:
        """The metrics ([log] metrics_file)."""
        return self.cluster.base / "nebula-power.prom"

    @property
    def program_log(self) -> Path:
        """Where our three programs log (nebula-power.toml [log] file)."""
        return self.cluster.log_dir / "nebula-power.log"

    def program_log_text(self) -> str:
        """Everything our programs logged so far."""
        return self.program_log.read_text() if self.program_log.exists() else ""

    def hook_events(self) -> list[dict[str, Any]]:
        """The hooks' records: {event, node, vm_id, ip, action, ...} in order."""
        path = self.hook_dir / "hooks.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def addr_at_boot(self, node: str) -> str | None:
        """The NodeAddr slurmctld had for `node` when its latest guest booted, before its slurmd registered:
        only our resume can have put it there (from 23.11 registration sets it too, from the address the
        guest connects from, which is the VM's: tests/vmnet.py)."""
        def boots() -> list[dict[str, Any]]:
            return [e for e in self.hook_events() if e["node"] == node and e.get("action") == "slurmd"]
        # The hook records the boot once slurmd has daemonized, which can come after slurmd registered.
        with contextlib.suppress(AssertionError):
            self.wait(boots, 10, f"the boot of {node} recorded")
        found = boots()
        return found[-1].get("addr_at_boot") if found else None

    def no_slurmd(self, node: str) -> None:
        """From now on, VMs of `node` run without starting slurmd (the guest never registers)."""
        (self.hook_dir / f"no-slurmd-{node}").touch()

    # ---- simulator views ----------------------------------------------------------------------------
    def vms_of(self, node: str, live: bool = False) -> list[Any]:
        """The simulator's VMs named `node` (every one, or only the not-DONE ones), by id."""
        return [vm for vm in self.sim.vms() if vm.name == node and (not live or vm.state != DONE)]

    def live_vms(self) -> list[Any]:
        """Every VM not DONE."""
        return [vm for vm in self.sim.vms() if vm.state != DONE]

    def gpus_free(self) -> int:
        """Free GPUs over all simulated hosts."""
        return sum(h.gpus_free for h in self.sim.hosts())

    def gpus_total(self) -> int:
        """GPUs over all simulated hosts."""
        return sum(h.gpus_total for h in self.sim.hosts())

    # ---- waiting ------------------------------------------------------------------------------------
    def wait(self, predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
        """Poll until truthy; on timeout the message carries slurmctld's and our programs' log tails."""
        try:
            return self.cluster.wait_for(predicate, timeout, what, interval)
        except AssertionError as exc:
            tail = "\n".join(self.program_log_text().splitlines()[-30:])
            raise AssertionError(f"{exc}\n--- nebula-power.log (tail) ---\n{tail}") from None

    def wait_nodes(self, nodes: Iterable[str], state: str, timeout: float) -> None:
        """Wait until every node's sinfo state is exactly `state` (e.g. `idle~`)."""
        nodes = list(nodes)
        self.wait(lambda: all(self.cluster.sinfo_state(n) == state for n in nodes), timeout,
                  f"{','.join(nodes)} {state} (now {[self.cluster.sinfo_state(n) for n in nodes]})")

    def wait_powered_down(self, nodes: Iterable[str], timeout: float) -> None:
        """Wait until every node is idle~, or drain~ with our out-of-service Reason (its node set short of
        GPUs steps out of Slurm's way: stepout.py)."""
        def down(node: str) -> bool:
            state = self.cluster.sinfo_state(node)
            return state == "idle~" or (state == "drained~" and self.cluster.node_info(node).get(
                "Reason", "").startswith("nebula: out of service"))
        nodes = list(nodes)
        self.wait(lambda: all(down(n) for n in nodes), timeout, f"{','.join(nodes)} idle~ or stepped out (drained~)")

    def wait_no_live_vms(self, timeout: float) -> None:
        """Wait until every VM is DONE."""
        self.wait(lambda: not self.live_vms(), timeout, "every VM DONE")

    def stop(self) -> None:
        """Stop the cluster first (no program calls the simulator after), then the simulator."""
        try:
            self.cluster.stop()
        finally:
            self._watching.set()
            self.sim.stop()
            if self._handler is not None:
                logging.getLogger("opennebula_sim").removeHandler(self._handler)
                self._handler.close()


def start_e2e(
    slurm_factory: Callable[..., SlurmCluster],
    nodes: tuple[str, ...] = ("gpu01", "gpu02"),
    hosts: int = 2,
    gpus_per_host: int = 1,
    boot_timeout: float = 6,
    durations: Durations = FAST,
    power_extra: str = "",
    nodeset_extra: str = "",
    sim_hosts: Any = None,
    templates: Any = None,
    nodesets: str | None = None,
    **cluster_kw: Any,
) -> E2E:
    """Start slurmctld (our installed programs as its power programs), the simulator and the configuration.

    Timings by default: SuspendTime 4, SuspendTimeout 6 ([power] suspend_timeout 5), ResumeTimeout 60
    (ten times boot_timeout 6: in a full run the simulated guest, the hook that starts slurmd, once began
    26 s after its VM was RUNNING), cred_expire 5. `templates` (the simulator's) and `nodesets` (the
    configuration's [[nodeset]] tables) replace the one GPU template and the one node set of `nodes`.
    """
    for program in (RESUME, SUSPEND, RESUME_FAIL):
        assert program.is_file(), f"{program} missing: install the package (pip install -e .)"
    kw: dict[str, Any] = dict(
        nodes=nodes, partition="gpu", resume_program=RESUME, suspend_program=SUSPEND,
        resume_fail_program=RESUME_FAIL, suspend_time=4, suspend_timeout=6, resume_timeout=60,
        cred_expire=5,
    )
    kw.update(cluster_kw)
    cluster = slurm_factory(**kw)
    base = cluster.base
    hook_dir = base / "hooks"
    hook_dir.mkdir()
    hook = python_program(base / "bin" / "vm-hook", HOOK_BODY.format(
        hook_dir=str(hook_dir), record=str(hook_dir / "hooks.jsonl"), log=str(cluster.log_dir / "hooks.log"),
        slurmd_argv=cluster.slurmd_argv("%n"), guest=vmnet.guest_argv("", [])[:2],
        pidfile=str(cluster.slurmd_pidfile("%n")),
        scontrol=cluster.binaries["scontrol"], conf=str(cluster.conf)))

    handler = logging.FileHandler(cluster.log_dir / "simulator.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    sim_logger = logging.getLogger("opennebula_sim")
    sim_logger.addHandler(handler)
    sim_logger.setLevel(logging.INFO)

    auth = f"oneadmin:{secrets.token_hex(8)}"
    sim_cfg = SimConfig(hosts=sim_hosts or gpu_hosts(hosts, gpus_per_host), durations=durations, tick_seconds=0.02,
                        on_running=(str(hook),), on_stopped=(str(hook),),
                        **({"templates": templates} if templates is not None else {}))
    sim = Simulator(sim_cfg, auth=auth).start()
    auth_file = base / "one_auth"
    auth_file.write_text(auth + "\n")
    auth_file.chmod(stat.S_IRUSR | stat.S_IWUSR)
    config = base / "nebula-power.toml"  # beside slurm.conf: found through SLURM_CONF
    config.write_text(textwrap.dedent(f"""\
        [opennebula]
        endpoint = "{sim.endpoint}"
        auth_file = "one_auth"
        timeout = 5
        retry_seconds = 10
        max_parallel = 8

        [log]
        file = "{cluster.log_dir / 'nebula-power.log'}"
        level = "debug"
        audit_file = "{cluster.log_dir / 'audit.jsonl'}"
        metrics_file = "{base / 'nebula-power.prom'}"

        [power]
        lock_dir = "{base / 'locks'}"
        suspend_timeout = 5
        poll_max = 0.5
        {power_extra}

        """) + (nodesets if nodesets is not None else textwrap.dedent(f"""\
        [[nodeset]]
        nodes = "{','.join(nodes)}"
        template = "slurm-gpu-worker"
        boot_timeout = {boot_timeout}
        """) + textwrap.dedent(nodeset_extra)))
    env = E2E(cluster=cluster, sim=sim, config=config, hook_dir=hook_dir, boot_timeout=boot_timeout,
              _handler=handler)
    env.watch_vms()
    cluster.mark_logs()
    return env


def job_script(sleep: float = 0, first: str = "") -> str:
    """A batch job: every node prints its Slurm name via srun (then the batch step sleeps a little); `first`
    is a shell line the batch step runs before."""
    return "#!/bin/sh\n" + (f"{first}\n" if first else "") + "/usr/bin/srun /usr/bin/printenv SLURMD_NODENAME\n" + (
        f"/bin/sleep {sleep}\n" if sleep else "")


class Stopwatch:
    """Seconds since start, for the printed measurements."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.start


HAND_BACK_LINE = r"scontrol (?:update NodeName=\S+ State=POWER_DOWN_FORCE|power down force \S+) Reason=.*"


def hand_back_line(env: E2E, names: str, reason: str) -> str:
    """The log line of our hand-back of `names`: `scontrol power down force` from 25.05 (slurm.Scontrol)."""
    if env.cluster.version >= (25, 5):
        return f"scontrol power down force {names} Reason={reason}"
    return f"scontrol update NodeName={names} State=POWER_DOWN_FORCE Reason={reason}"


def reconcile(env: E2E, *args: str) -> list[str]:
    """`slurm-nebula-power reconcile ARGS` as its timer or the operator runs it (config found beside SLURM_CONF);
    its output lines."""
    proc = subprocess.run([str(POWER), "reconcile", *args], env=env.cluster.env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()
