"""The only module that runs scontrol: argument lists, batching, version detection."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .config import Config
from .errors import SlurmError
from .hostlists import fold

log = logging.getLogger(__name__)

BATCH = 256  # nodes per scontrol update: keeps argv well under ARG_MAX for any node-name length
SEARCH_DIRS = (Path("/usr/bin"), Path("/usr/local/bin"))
REASON_PREFIX = "nebula: "
# 23.02+: a handed-back node returns to service by itself after this cooldown (no create/delete loop).
RESUME_AFTER = 60


class SlurmControl(Protocol):
    """What power.py needs of Slurm."""

    def set_addresses(self, addresses: Mapping[str, str], instances: Mapping[str, int] | None = None) -> None:
        """Tell slurmctld each node's address (NodeAddr) and hostname, and its VM id where Slurm keeps it."""

    def hand_back(self, nodes: Sequence[str], reason: str) -> None:
        """Give nodes that cannot start back to Slurm now, so their jobs requeue."""


@dataclass(frozen=True)
class NodeState:
    """A node as `scontrol show node -o` reports it."""

    name: str
    state: str  # e.g. IDLE+CLOUD+POWERED_DOWN
    reason: str = ""
    addr: str = ""

    @property
    def flags(self) -> set[str]:
        """The state's words: base state and flags."""
        return set(self.state.upper().replace("*", "").split("+"))

    @property
    def powered_down(self) -> bool:
        """Powered down or on its way down: no VM should run for it."""
        # Not POWER_DOWN: that flag marks a power-down still queued, the node may be allocated.
        return bool(self.flags & {"POWERED_DOWN", "POWERING_DOWN"})


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
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SlurmError(f"{self.path} {' '.join(args[:2])}: {exc}") from None
        if check and done.returncode != 0:
            raise SlurmError(f"scontrol {' '.join(args)} failed ({done.returncode}): "
                             f"{(done.stderr or done.stdout).strip()}")
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

        Slurm 22.05 (checked against the real controller, tests/test_e2e.py): State=POWER_DOWN_FORCE
        cancels the power-up, requeues the job at once and powers the node down (SuspendProgram is
        called for it); the Reason given with it stays in `scontrol show node` while the node powers
        down and stays down, until the node next registers.  23.02+ gets DOWN with ResumeAfter, which
        also keeps the reason and returns the node by itself.
        """
        text = (REASON_PREFIX + reason)[:200]
        for start in range(0, len(nodes), BATCH):
            names = fold(nodes[start:start + BATCH])
            if self.version() >= (23, 2):
                self.update(f"NodeName={names}", "State=DOWN", f"Reason={text}",
                            f"ResumeAfter={RESUME_AFTER}")
            else:
                self.update(f"NodeName={names}", "State=POWER_DOWN_FORCE", f"Reason={text}")

    def show_nodes(self, nodes: Iterable[str]) -> dict[str, NodeState]:
        """Parse `scontrol show node -o` for these nodes (missing ones are left out)."""
        names = list(nodes)
        if not names:
            return {}
        out = self.run("show", "node", "-o", fold(names))
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

    def hand_back(self, nodes: Sequence[str], reason: str) -> None:
        """Show the hand-back."""
        self._show(f"NodeName={fold(nodes)}", "State=POWER_DOWN_FORCE", f"Reason={REASON_PREFIX}{reason}")
