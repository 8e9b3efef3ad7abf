"""Helpers for the reliability tests (tests/test_reliability_*.py): a tuned site, Slurm's view of the nodes
as a model, the leak invariants, and a spy on the simulator's API calls.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opsupport import show
from simfixtures import AUTH
from support import Setup, make_setup, run_env

from opennebula_sim import states as S
from slurm_nebula_power.hostlists import expand

CLUSTER = "testcluster"  # ClusterName that make_setup writes into slurm.conf
DONE = S.DONE
# A VM in one of these is being torn down by an action already issued; it is DONE a tick or two later.
TEARING_DOWN = frozenset({S.SHUTDOWN, S.EPILOG, S.CLEANUP_DELETE, S.CLEANUP_RESUBMIT})
# Calls that change a VM (the first parameter after the session is the VM id).
VM_CHANGES = frozenset({"one.vm.action", "one.vm.recover", "one.vm.deploy", "one.vm.migrate", "one.vm.update",
                        "one.vm.rename", "one.vm.chown", "one.vm.chmod", "one.vm.lock", "one.vm.unlock"})


def nodes_of(expression: str) -> list[str]:
    """gpu[01-03] -> [gpu01, gpu02, gpu03]."""
    return expand(expression)


def tune(setup: Setup, **values: object) -> Setup:
    """Change `key = value` lines that make_setup wrote (timeout, retry_seconds, poll_max, ...)."""
    text = setup.config.read_text()
    for key, value in values.items():
        literal = f'"{value}"' if isinstance(value, str) else str(value).lower() if isinstance(value, bool) \
            else value
        text, count = re.subn(rf"(?m)^{key} = .*$", f"{key} = {literal}", text)
        assert count == 1, f"{key} is not a line of {setup.config}"
    setup.config.write_text(text)
    return setup


def site(root: Path, sim: Any, nodes: str = "gpu[01-08]", boot_timeout: float = 20,
         suspend_action: str = "terminate", auth: str = AUTH, template: str | int = "slurm-gpu-worker",
         **values: object) -> Setup:
    """One GPU node set over the simulator, reconcile_grace 0 (any orphan is old enough), tuned keys."""
    template = f'"{template}"' if isinstance(template, str) else template
    nodesets = (f'[[nodeset]]\nnodes = "{nodes}"\ntemplate = {template}\n'
                f'suspend_action = "{suspend_action}"\nboot_timeout = {boot_timeout}\n')
    setup = make_setup(root, sim.endpoint, auth, nodesets=nodesets, extra="reconcile_grace = 0")
    return tune(setup, **values)


# ---- what the simulator holds ---------------------------------------------------------------------


def is_ours(vm: Any, cluster: str = CLUSTER) -> bool:
    """The programs' identity rule: our user's VM (oneadmin, uid 0), NAME is the node, and the CONTEXT set at
    instantiate (which a guest cannot write) names this cluster and that node."""
    context = vm.template.get("CONTEXT") or {}
    context = context[0] if isinstance(context, list) else context
    return vm.uid == 0 and context.get("SLURM_CLUSTER") == cluster and context.get("SLURM_NODENAME") == vm.name


def live_ours(sim: Any) -> dict[str, list[Any]]:
    """Our VMs that are not DONE, by node."""
    found: dict[str, list[Any]] = defaultdict(list)
    for vm in sim.vms():
        if vm.state != DONE and is_ours(vm):
            found[vm.name].append(vm)
    return dict(found)


def settle(sim: Any, timeout: float = 10.0) -> None:
    """Wait until no VM is half-way through a teardown already ordered (SHUTDOWN, EPILOG, CLEANUP)."""
    sim.wait_for(lambda: not any(v.state == S.ACTIVE and v.lcm_state in TEARING_DOWN for v in sim.vms()),
                 timeout)


def gpu_holders(sim: Any) -> dict[int, int]:
    """VM id -> GPUs it holds, over every host."""
    held: dict[int, int] = defaultdict(int)
    for host in sim.hosts():
        for vm_id in host.gpu_holders.values():
            if vm_id is not None:
                held[vm_id] += 1
    return dict(held)


def violations(sim: Any, up: Iterable[str], down: Iterable[str]) -> list[str]:
    """The leak invariants, as one line per breach (empty: all hold).

    Every node Slurm considers powered down has no live VM of ours, every node it considers up exactly
    one, no two live VMs share a node name, and every GPU held belongs to the VM of an up node.
    """
    up, down = set(up), set(down)
    ours = live_ours(sim)
    found = []
    for node in sorted(down):
        if ours.get(node):
            found.append(f"{node} powered down but has live VM(s) "
                         + ", ".join(f"{v.id} {v.state_str}" for v in ours[node]))
    for node in sorted(up):
        if len(ours.get(node, [])) != 1:
            found.append(f"{node} up with {len(ours.get(node, []))} live VMs of ours")
    by_name: dict[str, list[int]] = defaultdict(list)
    for vm in sim.vms():
        if vm.state != DONE:
            by_name[vm.name].append(vm.id)
    for name, ids in sorted(by_name.items()):
        if len(ids) > 1:
            found.append(f"{len(ids)} live VMs named {name}: {ids}")
    allowed = {vm.id for node in up for vm in ours.get(node, [])}
    for vm_id, count in sorted(gpu_holders(sim).items()):
        if vm_id not in allowed:
            vm = sim.vm(vm_id)
            found.append(f"VM {vm_id} ({vm.name}, {vm.state_str}) holds {count} GPU(s), not an up node's VM")
    return found


# ---- Slurm's view ----------------------------------------------------------------------------------


@dataclass
class SlurmModel:
    """What slurmctld considers up or powered down, learnt from what the programs told it (fake scontrol).

    resume done -> up; resume handed back (POWER_DOWN_FORCE) -> down; suspend and resume-fail -> down
    (slurmctld powers the node down whatever the program's exit code); a reconcile hand-back -> down.
    """

    setup: Setup
    nodes: list[str]
    up: set[str] = field(default_factory=set)
    addr: dict[str, str] = field(default_factory=dict)
    handed_back: int = 0
    _seen: int = 0

    @property
    def down(self) -> set[str]:
        """Every node not up."""
        return set(self.nodes) - self.up

    def new_updates(self) -> list[list[str]]:
        """`scontrol update` argv received since the last call."""
        updates = self.setup.updates()
        fresh, self._seen = updates[self._seen:], len(updates)
        return fresh

    def absorb(self) -> set[str]:
        """Apply the new updates: NodeAddr settings, and hand-backs (which power the node down); returns
        the nodes handed back."""
        back: set[str] = set()
        for update in self.new_updates():
            names = expand(update[0].removeprefix("NodeName="))
            settings = dict(item.split("=", 1) for item in update[1:])
            if "NodeAddr" in settings:
                self.addr.update(zip(names, settings["NodeAddr"].split(","), strict=True))
            if settings.get("State") in ("POWER_DOWN_FORCE", "DOWN"):
                back.update(names)
        self.up -= back
        self.handed_back += len(back)
        return back

    def resumed(self, nodes: Iterable[str]) -> None:
        """After a resume: nodes it did not hand back are up."""
        back = self.absorb()
        self.up |= set(nodes) - back

    def powered_down(self, nodes: Iterable[str]) -> None:
        """After a suspend or resume-fail."""
        self.absorb()
        self.up -= set(nodes)

    def publish(self, powering_up: Iterable[str] = ()) -> None:
        """Make the fake scontrol's `show node -o` print this view (for reconcile), with `powering_up` the nodes
        slurmctld is resuming (what it says while it runs the ResumeProgram for them)."""
        self.absorb()
        starting = set(powering_up)

        def state(n: str) -> str:
            if n in starting:
                return f"{n} State=IDLE+CLOUD+POWERING_UP"
            if n in self.up:
                return f"{n} State=IDLE+CLOUD" + (f" NodeAddr={self.addr[n]}" if n in self.addr else "")
            return f"{n} State=IDLE+CLOUD+POWERED_DOWN"

        self.setup.set_nodes(show(*(state(n) for n in self.nodes)))


# ---- a spy on the simulator's API ------------------------------------------------------------------


@contextlib.contextmanager
def recorded_calls(sim: Any) -> Iterator[list[tuple[str, tuple[Any, ...]]]]:
    """Record every API call the simulator executes as (method, parameters after the session)."""
    calls: list[tuple[str, tuple[Any, ...]]] = []
    lock = threading.Lock()
    original = sim.api.dispatch

    def spy(method: str, params: tuple[Any, ...]) -> Any:
        with lock:
            calls.append((method, tuple(params[1:])))
        return original(method, params)

    sim.api.dispatch = spy
    try:
        yield calls
    finally:
        sim.api.dispatch = original


def vm_changes(calls: Iterable[tuple[str, tuple[Any, ...]]]) -> dict[int, list[str]]:
    """VM id -> the changing calls made on it (one.vm.action terminate, one.vm.recover 3, ...)."""
    changed: dict[int, list[str]] = defaultdict(list)
    for method, params in calls:
        if method in VM_CHANGES and params:
            vm_id = params[1] if method == "one.vm.action" else params[0]
            what = params[0] if method == "one.vm.action" else params[1:2]
            changed[int(vm_id)].append(f"{method} {what}")
    return dict(changed)


def log_lines(*setups: Setup) -> list[str]:
    """Every line the programs logged for these sites."""
    return [line for s in setups for line in s.log_text().splitlines()]


# ---- programs as processes -------------------------------------------------------------------------


def launch(setup: Setup, name: str, *args: str) -> subprocess.Popen[str]:
    """Start one of the installed programs as slurmctld would (its environment only), without waiting."""
    from test_cli import program  # the installed entry point, as test_cli finds it

    return subprocess.Popen([program(name), *args], env=run_env(setup), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], guard: float = 120) -> int:
    """Wait for a launched program; the timeout is only a guard against a hang (it fails the test)."""
    try:
        proc.communicate(timeout=guard)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{proc.args} still running after {guard}s: hung") from None
    return proc.returncode


def lock_is_held(setup: Setup, node: str) -> bool:
    """Whether some process holds node's flock now (we try to take it without waiting)."""
    return held(setup.root / "locks", node)


def held(lock_dir: Path, node: str) -> bool:
    """Whether another open file description holds node's lock in lock_dir."""
    path = lock_dir / f"{node}.lock"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


PROGRAMS = {"resume": ("slurm-nebula-resume",), "suspend": ("slurm-nebula-suspend",),
            "resume-fail": ("slurm-nebula-resume-fail",), "reconcile": ("slurm-nebula-power", "reconcile")}


def run_program(setup: Setup, program: str, *args: str, guard: float = 120
                ) -> subprocess.CompletedProcess[str]:
    """Run resume, suspend, resume-fail or reconcile as a process and wait for it (guarded)."""
    name, *sub = PROGRAMS[program]
    proc = launch(setup, name, *sub, *args)
    try:
        out, err = proc.communicate(timeout=guard)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{program} {args} still running after {guard}s: hung") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
