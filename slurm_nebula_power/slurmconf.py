"""The one slurm.conf reader: parameters, NodeName lines, Include files (for config, check, prolog, status); and
the gres.conf beside it (for check)."""

from __future__ import annotations

import glob
import logging
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError, HostlistError
from .hostlists import expand

log = logging.getLogger(__name__)

# Slurm's defaults (slurm.conf(5)).
DEFAULTS = {"resumetimeout": "60", "suspendtimeout": "30", "slurmuser": "root"}
# Lines that describe one thing (a node, a partition, ...) rather than set parameters.
LINE_KINDS = ("nodename", "poweraction", "partitionname", "nodeset", "switchname", "frontendname", "downnodes")
UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}  # Gres count suffixes


def release_name(version: tuple[int, int] | None) -> str:
    """How check names a Slurm release in its findings: "Slurm 24.11", or "this Slurm" when unknown."""
    return "this Slurm" if version is None else f"Slurm {version[0]}.{version[1]:02d}"


# ---- reading slurm.conf -----------------------------------------------------------------------------


@dataclass
class SlurmConf:
    """The parameters, NodeName, PowerAction and PartitionName lines of a slurm.conf (and its Include files)."""

    path: Path
    params: dict[str, str] = field(default_factory=dict)  # lower-case key -> last value
    nodes: dict[str, dict[str, str]] = field(default_factory=dict)  # node -> lower-case keys of its line
    # PowerAction lines (Slurm 26.05): name -> their lower-case keys (location, program)
    actions: dict[str, dict[str, str]] = field(default_factory=dict)
    partitions: dict[str, str] = field(default_factory=dict)  # PartitionName -> its Nodes expression

    def get(self, key: str) -> str:
        """A parameter's value (case-insensitive key), Slurm's default, or ''."""
        return self.params.get(key.lower(), DEFAULTS.get(key.lower(), ""))

    def seconds(self, key: str) -> int | None:
        """A parameter in whole seconds, or None when it is not a number."""
        try:
            return int(self.get(key))
        except ValueError:
            return None

    @property
    def cloud_nodes(self) -> list[str]:
        """Nodes whose NodeName line says State=CLOUD."""
        return [node for node, keys in self.nodes.items() if "CLOUD" in keys.get("state", "").upper()]


def read_slurm_conf(path: Path) -> SlurmConf:
    """Parse slurm.conf: KEY=VALUE parameters, NodeName lines (with NodeName=DEFAULT), PowerAction and
    PartitionName lines, Include files."""
    conf = SlurmConf(path)
    _read(conf, path, {"nodename": {}}, depth=0)
    return conf


def read_if_any(path: Path | None) -> SlurmConf | None:
    """slurm.conf, or None when no path is set or it cannot be read (for what only adds a remark)."""
    if path is None:
        return None
    try:
        return read_slurm_conf(path)
    except ConfigError:
        return None


def _read(conf: SlurmConf, path: Path, defaults: dict[str, dict[str, str]], depth: int) -> None:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read slurm.conf: {exc.strerror}; set [slurm] slurm_conf or "
                          "SLURM_CONF to the controller's slurm.conf") from None
    for line in _logical_lines(text):
        try:
            tokens = shlex.split(line)
        except ValueError:
            continue
        if not tokens:
            continue
        if tokens[0].lower() == "include" and len(tokens) > 1 and depth < 8:
            pattern = tokens[1] if os.path.isabs(tokens[1]) else str(path.parent / tokens[1])
            for included in sorted(glob.glob(pattern)):
                _read(conf, Path(included), defaults, depth + 1)
            continue
        pairs = [t.partition("=") for t in tokens]
        keys = {k.lower(): v for k, sep, v in pairs if sep}
        first = pairs[0][0].lower()
        if first in LINE_KINDS and not pairs[0][1]:
            continue  # "NodeName gpu01" without "=" names nothing
        if first == "nodename":
            _node_line(conf, keys, defaults["nodename"])
        elif first == "poweraction":
            conf.actions[keys.pop("poweraction")] = keys
        elif first == "partitionname":
            if keys["partitionname"].upper() != "DEFAULT":
                conf.partitions[keys["partitionname"]] = keys.get("nodes", "")
        elif first not in LINE_KINDS:
            conf.params.update(keys)


def _logical_lines(text: str) -> list[str]:
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = re.sub(r"(?<!\\)#.*", "", raw).replace("\\#", "#").rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return lines + ([pending] if pending else [])


def _node_line(conf: SlurmConf, keys: dict[str, str], default: dict[str, str]) -> None:
    expression = keys.pop("nodename")
    if expression.upper() == "DEFAULT":
        default.update(keys)
        return
    try:
        names = expand(expression)
    except HostlistError:
        log.warning("%s: NodeName=%s is not a hostlist this tool reads; skipped", conf.path, expression)
        return
    for name in names:
        conf.nodes[name] = {**default, **keys}


_COUNT = re.compile(r"[0-9]{1,9}")  # ASCII digits: str.isdigit() takes "²", which int() refuses


def count(text: str | None) -> int | None:
    """A node line's count (CPUs=, RealMemory=, ...) as a number, or None when it is not one."""
    return int(text) if text and _COUNT.fullmatch(text) else None


def node_cpus(keys: Mapping[str, str]) -> int:
    """CPUs of a NodeName line: CPUs=, else boards x sockets x cores x threads (Slurm's defaults: 1)."""
    cpus = count(keys.get("cpus"))
    if cpus is not None:
        return cpus
    product = 1
    sockets = keys.get("sockets") or keys.get("socketsperboard") or "1"
    for value in (keys.get("boards", "1"), sockets, keys.get("corespersocket", "1"),
                  keys.get("threadspercore", "1")):
        product *= count(value) or 1
    return product


def gres_gpus(gres: str) -> int:
    """GPUs in a Gres= value: `gpu:2`, `gpu:h100:1`, `gpu:a100:2(S:0-1),nic:1` (count suffixes K/M/G)."""
    return sum(gres_gpu_types(gres).values())


def gres_gpu_types(gres: str) -> dict[str, int]:
    """The GPUs of a Gres= value by type ("" untyped): `gpu:h100:2,gpu:1` -> {"h100": 2, "": 1}."""
    types: dict[str, int] = {}
    for item in re.split(r",(?![^(]*\))", gres):
        parts = re.sub(r"\(.*\)", "", item).strip().split(":")
        if not parts or parts[0].lower() != "gpu":
            continue
        match = re.fullmatch(r"(\d+)([kKmMgG]?)", parts[-1]) if len(parts) > 1 else None
        # gpu:h100 (a type without a count) means one
        kind = ":".join(parts[1:-1] if match else parts[1:])
        count = int(match.group(1)) * UNITS[match.group(2).lower()] if match else 1
        types[kind] = types.get(kind, 0) + count
    return types


# ---- reading gres.conf --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GresLine:
    """One gres.conf line: the nodes it names (None: no NodeName, so every node) and its lower-case keys."""

    nodes: frozenset[str] | None
    keys: Mapping[str, str]

    def covers(self, node: str) -> bool:
        """The line applies to this node."""
        return self.nodes is None or node in self.nodes


@dataclass
class GresConf:
    """The lines of a gres.conf (the one beside slurm.conf, as slurmctld and configless slurmd read it)."""

    path: Path
    lines: list[GresLine] = field(default_factory=list)

    def gpu_lines(self, node: str) -> list[GresLine]:
        """The Name=gpu lines that apply to a node."""
        return [line for line in self.lines if line.keys.get("name", "").lower() == "gpu" and line.covers(node)]

    def autodetect(self, node: str) -> str:
        """The AutoDetect that applies to a node, lower case: its own line's, else the global one, else ''."""
        own = [line.keys["autodetect"] for line in self.lines
               if "autodetect" in line.keys and line.nodes is not None and node in line.nodes]
        shared = [line.keys["autodetect"] for line in self.lines if "autodetect" in line.keys and line.nodes is None]
        return (own or shared or [""])[-1].lower()


def read_gres_conf(path: Path) -> GresConf | None:
    """Parse gres.conf: NodeName (a hostlist, or none for every node), Name, Type, File, Count, AutoDetect...;
    None when there is no such file."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read gres.conf: {exc.strerror}; run check as root or as SlurmUser "
                          "on the slurmctld host") from None
    conf = GresConf(path)
    for line in _logical_lines(text):
        try:
            tokens = shlex.split(line)
        except ValueError:
            continue
        keys = {k.lower(): v for k, sep, v in (t.partition("=") for t in tokens) if sep}
        if not keys:
            continue
        nodes: frozenset[str] | None = None
        if "nodename" in keys:
            try:
                nodes = frozenset(expand(keys.pop("nodename")))
            except HostlistError:
                log.warning("%s: a NodeName that is not a hostlist this tool reads; line skipped", path)
                continue
        conf.lines.append(GresLine(nodes, keys))
    return conf
