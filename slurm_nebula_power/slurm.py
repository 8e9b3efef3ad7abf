"""The only module that runs scontrol (argument lists, batching, version detection), and Slurm's node state
and resume file read once for every caller."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .config import Config
from .errors import PowerError, SlurmError, SlurmUnreachable
from .hostlists import expand, fold
from .model import printable
from .nodestate import STARTING, UP, NodeState

log = logging.getLogger(__name__)

BATCH = 256  # nodes per scontrol update: keeps argv well under ARG_MAX for any node-name length
SEARCH_DIRS = (Path("/usr/bin"), Path("/usr/local/bin"))
REASON_PREFIX = "nebula: "


class SlurmControl(Protocol):
    """What resume, suspend and reconcile need of Slurm."""

    def set_addresses(self, addresses: Mapping[str, str], instances: Mapping[str, int] | None = None) -> None:
        """Tell slurmctld each node's address (NodeAddr) and hostname, and its VM id where Slurm keeps it."""

    def hand_back(self, nodes: Sequence[str], reason: str) -> None:
        """Give nodes that cannot start back to Slurm now, so their jobs requeue."""

    def confirm_addresses(self, addresses: Mapping[str, str]) -> list[str]:
        """Tell slurmctld again the addresses it no longer has; the nodes told again (never raises)."""

    def registered(self, nodes: Sequence[str]) -> set[str]:
        """Those of these nodes whose slurmd has registered and that serve jobs now (none when Slurm cannot
        be asked)."""

    def set_drain(self, nodes: Sequence[str], reason: str | None) -> None:
        """Drain nodes with a reason (their jobs finish, no new one starts), or undrain them (reason None)."""

    def set_down(self, nodes: Sequence[str], reason: str) -> None:
        """Mark nodes whose guest is gone DOWN, so their jobs requeue without waiting for the dead slurmd."""

    def show_nodes(self, nodes: Iterable[str]) -> dict[str, NodeState]:
        """These nodes as slurmctld shows them ({} without a controller); SlurmError when it cannot be asked."""

    def set_resume(self, nodes: Sequence[str]) -> None:
        """Return down~ nodes to service (State=RESUME): idle and powered down, ready for the next job."""


def find_scontrol(config: Config | None, environ: Mapping[str, str]) -> Path:
    """scontrol by absolute path: config, SLURM_CONF's bin/sbin siblings, /usr/bin, /usr/local/bin."""
    if config is not None and config.slurm.scontrol is not None:
        return config.slurm.scontrol
    candidates: list[Path] = []
    if environ.get("SLURM_CONF"):
        prefix = Path(environ["SLURM_CONF"]).resolve().parent.parent
        candidates += [prefix / "bin", prefix / "sbin"]
    candidates += list(SEARCH_DIRS)
    for directory in candidates:
        path = directory / "scontrol"
        if os.access(path, os.X_OK):
            return path
    raise SlurmError("scontrol not found in " + ", ".join(map(str, candidates))
                     + "; set [slurm] scontrol = \"/path/to/scontrol\"")


def scontrol_for(config: Config, environ: Mapping[str, str], timeout: float = 30.0) -> Scontrol:
    """The configured site's scontrol: found by find_scontrol, run with the configured SLURM_CONF."""
    env = {"SLURM_CONF": str(config.slurm.slurm_conf)} if config.slurm.slurm_conf else {}
    return Scontrol(find_scontrol(config, environ), env=env, timeout=timeout)


def slurm_version(config: Config, environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(major, minor) of the local scontrol, or None when there is none."""
    try:
        return scontrol_for(config, environ).version()
    except SlurmError:
        return None


MOST_RESUME_FILE = 64 << 20  # bytes of SLURM_RESUME_FILE read at most (a 10,000-job file is a few MB)
MOST_JOB_ID = 0xFFFFFFFD  # Slurm's job ids are uint32, the top values NO_VAL and INFINITE


def _job_id(value: object) -> int:
    """A job id as Slurm writes one: a JSON integer from 1 to MOST_JOB_ID (not 1e30, 2**40, -5, true)."""
    if type(value) is not int or not 0 < value <= MOST_JOB_ID:
        raise ValueError(f"job_id {str(value)[:20]} is not a Slurm job id")
    return value


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def jobs_from_resume_file(environ: Mapping[str, str]) -> dict[str, list[int]]:
    """Job ids per node from SLURM_RESUME_FILE (22.05 `nodes`, 23.02+ `nodes_resume`); {} when absent, and
    when the file is not what slurmctld writes (logged: the run goes on without job ids)."""
    path = environ.get("SLURM_RESUME_FILE")
    if not path:
        return {}
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MOST_RESUME_FILE + 1)
        if len(raw) > MOST_RESUME_FILE:
            raise ValueError(f"larger than {MOST_RESUME_FILE >> 20} MiB")
        data = json.loads(raw, parse_constant=_no_constant)
        jobs: dict[str, list[int]] = {}
        for job in data.get("jobs") or []:
            nodes = job.get("nodes_resume") or job.get("nodes") or ""
            if not isinstance(nodes, str):
                raise TypeError("nodes is not a hostlist")
            job_id = _job_id(job["job_id"])
            for node in expand(nodes) if nodes else []:
                jobs.setdefault(node, []).append(job_id)
        return jobs
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError, PowerError) as exc:
        log.warning("SLURM_RESUME_FILE %s unreadable, continuing without job ids: %s", path,
                    getattr(exc, "strerror", None) or type(exc).__name__ + (f": {str(exc)[:120]}" if str(exc) else ""))
        return {}


Runner = Callable[..., "subprocess.CompletedProcess[str]"]


@dataclass
class Scontrol:
    """scontrol run by absolute path with argument lists, never a shell."""

    path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    timeout: float = 30.0
    runner: Runner = subprocess.run
    _version: tuple[int, int] | None = None

    def run(self, *args: str, check: bool = True) -> str:
        """Run scontrol with these arguments; returns stdout."""
        argv = [str(self.path), *args]
        try:
            done = self.runner(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=self.timeout, env=dict(self.env), check=False)
        except subprocess.TimeoutExpired as exc:
            raise SlurmUnreachable(f"{self.path} {' '.join(args[:2])}: {exc}") from None
        except OSError as exc:
            raise SlurmError(f"{self.path} {' '.join(args[:2])}: {exc}") from None
        if check and done.returncode != 0:
            said = (done.stderr or done.stdout).strip()
            # scontrol's words when no controller answers (slurmctld down, or no route to it)
            error = SlurmUnreachable if "Unable to contact slurm controller" in said else SlurmError
            raise error(f"scontrol {' '.join(args)} failed ({done.returncode}): {said}")
        return done.stdout

    def version(self) -> tuple[int, int]:
        """(major, minor) from `scontrol --version` ("slurm 22.05.8")."""
        if self._version is None:
            match = re.search(r"(\d+)\.(\d+)", self.run("--version"))
            if not match:
                raise SlurmError("cannot read the Slurm version from scontrol --version")
            self._version = (int(match.group(1)), int(match.group(2)))
        return self._version

    def update(self, *settings: str) -> None:
        """scontrol update with the given KEY=VALUE settings."""
        log.info("scontrol update %s", " ".join(settings))
        self.run("update", *settings)

    def set_addresses(self, addresses: Mapping[str, str], instances: Mapping[str, int] | None = None) -> None:
        """NodeAddr/NodeHostname updates, batched: names and addresses as matching comma lists.

        From Slurm 23.11 the VM id is recorded too (InstanceId, shown by `scontrol show node`); slurmctld
        splits only NodeAddr/NodeHostname lists per node, so InstanceId takes one update per node.
        """
        items = sorted(addresses.items())
        for start in range(0, len(items), BATCH):
            chunk = items[start:start + BATCH]
            names = ",".join(name for name, _ in chunk)
            self.update(f"NodeName={names}", "NodeAddr=" + ",".join(ip for _, ip in chunk),
                        f"NodeHostname={names}")
        if instances and self.version() >= (23, 11):
            for name, _ in items:
                if name in instances:
                    self.update(f"NodeName={name}", f"InstanceId={instances[name]}", "InstanceType=opennebula")

    def hand_back(self, nodes: Sequence[str], reason: str) -> None:
        """Hand failed nodes back so their jobs requeue now and the nodes return to the cloud pool.

        State=POWER_DOWN_FORCE on every release (checked against the real controller on 22.05, 24.11 and
        26.05, tests/releases/probe_slurm.py): it cancels the power-up, requeues the job at once and powers
        the node down (SuspendProgram is called for it); the node is idle~ again after SuspendTimeout, and
        the Reason given with it stays in `scontrol show node` until the node next registers. The requeue
        storm that follows while a shortage lasts is stopped by [power] shortage_cooldown, on every release.
        Not State=DOWN ResumeAfter=...: on a POWERING_UP node (24.11, 26.05) the job requeues, but the node
        stays POWERING_UP and unusable until ResumeTimeout, then turns DOWN+POWERED_DOWN "ResumeTimeout
        reached" for good (its ResumeAfter has fired by then): out of use until an admin's state=resume.
        From 25.05 `scontrol power down force <nodes> Reason=...`, which 26.05's scontrol(1) has replace the
        update form (the same requeue and power-down: docs/SLURM-FINDINGS.md).
        """
        text = printable(REASON_PREFIX + reason)[:200]  # one line: a newline would forge a record
        for start in range(0, len(nodes), BATCH):
            names = fold(nodes[start:start + BATCH])
            if self.version() >= (25, 5):
                log.info("scontrol power down force %s Reason=%s", names, text)
                self.run("power", "down", "force", names, f"Reason={text}")
            else:
                self.update(f"NodeName={names}", "State=POWER_DOWN_FORCE", f"Reason={text}")

    def set_drain(self, nodes: Sequence[str], reason: str | None) -> None:
        """State=DRAIN with Reason="nebula: <reason>": running jobs finish, no new job starts, and an idle
        drained node is powered down as any idle node (SuspendTime; SuspendExcStates can exclude DRAIN from
        23.02), which idle_on_node_suspend undrains. reason None: State=UNDRAIN (our drain is over; the
        node keeps any other state). Checked against the real slurmctld 22.05, 24.11 and 26.05
        (tests/test_e2e_maintenance.py)."""
        text = printable(REASON_PREFIX + (reason or ""))[:200]
        for start in range(0, len(nodes), BATCH):
            names = fold(nodes[start:start + BATCH])
            if reason is None:
                self.update(f"NodeName={names}", "State=UNDRAIN")
            else:
                self.update(f"NodeName={names}", "State=DRAIN", f"Reason={text}")

    def set_down(self, nodes: Sequence[str], reason: str) -> None:
        """State=DOWN with Reason="nebula: <reason>", for nodes whose guest died under a job (its VM UNKNOWN or
        POWEROFF): the job is requeued and completes at once. A hand-back alone (POWER_DOWN_FORCE) requeues
        it too, but it then stays COMPLETING, waiting for the dead slurmd's epilog until SlurmdTimeout (300 s
        stock), and cannot start again meanwhile (22.05, tests/test_e2e_maintenance.py). The caller hands
        the node back after this, which returns it to the cloud pool (idle_on_node_suspend clears DOWN)."""
        text = printable(REASON_PREFIX + reason)[:200]
        for start in range(0, len(nodes), BATCH):
            self.update(f"NodeName={fold(nodes[start:start + BATCH])}", "State=DOWN", f"Reason={text}")

    def set_resume(self, nodes: Sequence[str]) -> None:
        """State=RESUME: a DOWN+POWERED_DOWN node (ResumeTimeout reached, no VM) becomes IDLE+POWERED_DOWN on
        22.05, 24.11 and 26.05, and is allocated again (tests/releases/probe_slurm.py)."""
        for start in range(0, len(nodes), BATCH):
            self.update(f"NodeName={fold(nodes[start:start + BATCH])}", "State=RESUME")

    def registered(self, nodes: Sequence[str]) -> set[str]:
        """Those of these nodes that serve jobs now (one `scontrol show node`); none when it fails."""
        try:
            states = self.show_nodes(nodes)
        except SlurmError as exc:
            log.warning("could not ask slurmctld whether %s registered: %s", fold(nodes), exc)
            return set()
        return {name for name, state in states.items() if name in nodes and state.is_up}

    def confirm_addresses(self, addresses: Mapping[str, str]) -> list[str]:
        """Set again the NodeAddr of the nodes slurmctld shows starting or up with another address: a
        backup controller that took over while a resume was in flight recovered a state saved before
        resume told the primary the addresses, and 22.05 never takes one from slurmd's registration, so
        the job's launch found no address ("Can't find an address") and it stayed COMPLETING (seen in
        test_e2e_ha.py under load). One `scontrol show node`; the nodes told again, logged."""
        try:
            states = self.show_nodes(addresses)
            lost = {node: addr for node, addr in addresses.items() if node in states
                    and states[node].phase in (STARTING, UP) and states[node].addr not in ("", addr)}
            if lost:
                log.warning("slurmctld lost the addresses of %s (a controller took over?): told again",
                            fold(sorted(lost)))
                self.set_addresses(lost)
        except SlurmError as exc:
            log.warning("could not confirm the addresses of %s with slurmctld: %s", fold(sorted(addresses)), exc)
            return []
        return sorted(lost)

    def show_all_nodes(self) -> dict[str, NodeState]:
        """Every node slurmctld shows (one `scontrol show node -o`); SlurmError when it cannot be asked."""
        return parse_show_node(self.run("show", "node", "-o"))

    def show_nodes(self, nodes: Iterable[str]) -> dict[str, NodeState]:
        """Parse `scontrol show node -o` for these nodes (missing ones are left out)."""
        names = list(nodes)
        if not names:
            return {}
        try:
            out = self.run("show", "node", "-o", fold(names))
        except SlurmUnreachable:
            raise
        except SlurmError as exc:  # "Node gpu04 not found": every node, and those it knows of these
            if "not found" not in str(exc):
                raise
            wanted = set(names)
            return {name: state for name, state in self.show_all_nodes().items() if name in wanted}
        return parse_show_node(out)


def parse_show_node(text: str) -> dict[str, NodeState]:
    """Parse one-line `scontrol show node -o` records."""
    result: dict[str, NodeState] = {}
    for line in text.splitlines():
        fields = _fields(line)
        name = fields.get("NodeName")
        if name:
            result[name] = NodeState(name=name, state=fields.get("State", ""),
                                     reason=fields.get("Reason", ""), addr=fields.get("NodeAddr", ""))
    return result


def _fields(line: str) -> dict[str, str]:
    # Values never contain " Key=" except Reason, which is last on the line and may hold spaces.
    fields: dict[str, str] = {}
    reason = line.find(" Reason=")
    if reason >= 0:
        fields["Reason"] = line[reason + len(" Reason="):].strip()
        line = line[:reason]
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


@dataclass
class PrintedSlurm:
    """No controller (the demo): show the scontrol commands that would run."""

    emit: Callable[[str], None] = print
    commands: list[list[str]] = field(default_factory=list)

    def _show(self, *settings: str) -> None:
        self.commands.append(["scontrol", "update", *settings])
        self.emit("would run: scontrol update " + " ".join(settings))

    def set_addresses(self, addresses: Mapping[str, str], instances: Mapping[str, int] | None = None) -> None:
        """Show the NodeAddr update."""
        items = sorted(addresses.items())
        names = ",".join(name for name, _ in items)
        self._show(f"NodeName={names}", "NodeAddr=" + ",".join(ip for _, ip in items), f"NodeHostname={names}")

    def registered(self, nodes: Sequence[str]) -> set[str]:
        """No controller: no node has registered."""
        return set()

    def confirm_addresses(self, addresses: Mapping[str, str]) -> list[str]:
        """No controller: nothing was lost."""
        return []

    def show_nodes(self, nodes: Iterable[str]) -> dict[str, NodeState]:
        """No controller: no node to show."""
        return {}

    def set_drain(self, nodes: Sequence[str], reason: str | None) -> None:
        """Show the drain (or undrain)."""
        self._show(f"NodeName={fold(nodes)}", *(["State=UNDRAIN"] if reason is None else
                                                ["State=DRAIN", f"Reason={REASON_PREFIX}{reason}"]))

    def set_resume(self, nodes: Sequence[str]) -> None:
        """Show the return to service."""
        self._show(f"NodeName={fold(nodes)}", "State=RESUME")

    def set_down(self, nodes: Sequence[str], reason: str) -> None:
        """Show the DOWN."""
        self._show(f"NodeName={fold(nodes)}", "State=DOWN", f"Reason={REASON_PREFIX}{reason}")

    def hand_back(self, nodes: Sequence[str], reason: str) -> None:
        """Show the hand-back."""
        self._show(f"NodeName={fold(nodes)}", "State=POWER_DOWN_FORCE", f"Reason={REASON_PREFIX}{reason}")
