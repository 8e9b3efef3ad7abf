"""slurm.conf both ways: read what `check` needs, and print the lines for the node sets (`slurm-conf`)."""

from __future__ import annotations

import glob
import logging
import math
import os
import re
import shlex
import shutil
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__
from .errors import EXIT_OK, ConfigError, HostlistError, PowerError
from .hostlists import expand, fold

if TYPE_CHECKING:
    from .config import Config, NodeSet
    from .power import Cloud

log = logging.getLogger(__name__)

PROGRAMS = {"ResumeProgram": "slurm-nebula-resume", "SuspendProgram": "slurm-nebula-suspend",
            "ResumeFailProgram": "slurm-nebula-resume-fail"}
PROLOG = "slurm-nebula-prolog"
# Slurm's defaults (slurm.conf(5)).
DEFAULTS = {"resumetimeout": "60", "suspendtimeout": "30", "slurmuser": "root"}
# slurmd reports the guest's MemTotal, which is below the VM's MEMORY (kernel, firmware, crash kernel):
# a RealMemory at 95 % of MEMORY never trips "Low RealMemory" (AWS ParallelCluster uses the same ratio).
MEMORY_RATIO = 0.95
RESUME_MARGIN = 300  # seconds for the guest to start slurmd after the VM is RUNNING
SUSPEND_MARGIN = 30  # seconds beyond [power] suspend_timeout before slurmctld forgets the node's address
UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}  # Gres count suffixes
GPU_VENDORS = ("10de", "1002")  # NVIDIA, AMD: a PCI device of theirs without CLASS is taken as a GPU


# ---- reading slurm.conf -----------------------------------------------------------------------------


@dataclass
class SlurmConf:
    """The parameters, NodeName lines and partitions of a slurm.conf (and its Include files)."""

    path: Path
    params: dict[str, str] = field(default_factory=dict)  # lower-case key -> last value
    nodes: dict[str, dict[str, str]] = field(default_factory=dict)  # node -> lower-case keys of its line

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
    """Parse slurm.conf: KEY=VALUE parameters, NodeName lines (with NodeName=DEFAULT), Include files."""
    conf = SlurmConf(path)
    _read(conf, path, {"nodename": {}}, depth=0)
    return conf


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
        if first == "nodename":
            _node_line(conf, keys, defaults["nodename"])
        elif first not in ("partitionname", "nodeset", "switchname", "frontendname", "downnodes"):
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


def node_cpus(keys: Mapping[str, str]) -> int:
    """CPUs of a NodeName line: CPUs=, else boards x sockets x cores x threads (Slurm's defaults: 1)."""
    if keys.get("cpus", "").isdigit():
        return int(keys["cpus"])
    product = 1
    sockets = keys.get("sockets") or keys.get("socketsperboard") or "1"
    for value in (keys.get("boards", "1"), sockets, keys.get("corespersocket", "1"),
                  keys.get("threadspercore", "1")):
        product *= int(value) if value.isdigit() else 1
    return product


def gres_gpus(gres: str) -> int:
    """GPUs in a Gres= value: `gpu:2`, `gpu:h100:1`, `gpu:a100:2(S:0-1),nic:1` (count suffixes K/M/G)."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres):
        parts = re.sub(r"\(.*\)", "", item).strip().split(":")
        if not parts or parts[0].lower() != "gpu":
            continue
        count = parts[-1] if len(parts) > 1 else "1"
        match = re.fullmatch(r"(\d+)([kKmMgG]?)", count)
        if match:
            total += int(match.group(1)) * UNITS[match.group(2).lower()]
        else:
            total += 1  # gpu:h100 (type without count) means one
    return total


# ---- what a template gives a node -------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What slurmd will find in a VM: vCPUs, memory and GPUs, and where that was learned."""

    vcpus: int
    memory_mb: int
    gpus: int
    source: str


def pci_gpus(pci: Any) -> int:
    """GPUs among a template's PCI entries (CLASS 03xx, a vGPU PROFILE or a GPU vendor; not TYPE=NIC)."""
    devices = pci if isinstance(pci, list) else [pci] if isinstance(pci, dict) else []
    count = 0
    for device in devices:
        if not isinstance(device, dict) or str(device.get("TYPE", "")).upper() == "NIC":
            continue
        klass, vendor = str(device.get("CLASS", "")), str(device.get("VENDOR", "")).lower()
        if klass.startswith("03") or device.get("PROFILE") or (not klass and vendor in GPU_VENDORS):
            count += 1
        elif not klass and not vendor and device.get("SHORT_ADDRESS"):
            count += 1  # one exact device by address: what passthrough of a GPU looks like
    return count


def _number(value: Any) -> float | None:
    try:
        return float(str(value))
    except ValueError:
        return None


def template_shape(template: Mapping[str, Any], tid: int) -> Shape:
    """The Shape of a VM built from this template (oned gives one vCPU when VCPU is unset)."""
    vcpu = _number(template.get("VCPU", 1)) or 1
    memory = _number(template.get("MEMORY", 0)) or 0
    return Shape(int(vcpu), int(memory), pci_gpus(template.get("PCI")), f"template {tid}")


def options_shape(nodeset: NodeSet) -> Shape | None:
    """The Shape the node set's options describe (vcpu and memory_mb needed), or None."""
    opts = nodeset.options
    if "vcpu" not in opts or "memory_mb" not in opts:
        return None
    return Shape(int(opts["vcpu"]), int(opts["memory_mb"]), int(opts.get("gpus", 0)), "node set options")


def read_shapes(config: Config, cloud: Cloud) -> list[tuple[NodeSet, Shape | None, str]]:
    """Per node set: its template's Shape, or None and why it could not be read."""
    from .errors import CloudError

    out: list[tuple[NodeSet, Shape | None, str]] = []
    for nodeset in config.nodesets:
        try:
            tid = cloud.template_id(nodeset.template)
            out.append((nodeset, template_shape(cloud.template(tid), tid), ""))
        except CloudError as exc:
            out.append((nodeset, None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
    return out


# ---- writing slurm.conf lines -----------------------------------------------------------------------


def program_path(name: str) -> tuple[Path, bool]:
    """Absolute path of one of our console scripts: this installation's scripts dir, then PATH."""
    for directory in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = Path(directory) / name
        if os.access(candidate, os.X_OK):
            return candidate, True
    found = shutil.which(name)
    if found:
        return Path(found).absolute(), True
    return Path(sysconfig.get_path("scripts")) / name, False


def real_memory(memory_mb: int) -> int:
    """RealMemory for a VM of memory_mb MiB."""
    return max(1, math.floor(memory_mb * MEMORY_RATIO))


def features(nodeset: NodeSet) -> str:
    """Feature= of a node set: its features option, else cloud plus the GPU type."""
    if nodeset.options.get("features"):
        return str(nodeset.options["features"])
    kind = nodeset.options.get("gpu_type")
    return ",".join(["cloud"] + ([str(kind)] if kind else []))


def node_line(nodeset: NodeSet, shape: Shape) -> str:
    """The NodeName line of a node set."""
    parts = [f"NodeName={fold(nodeset.nodes)}", "State=CLOUD", f"CPUs={shape.vcpus}",
             f"RealMemory={real_memory(shape.memory_mb)}"]
    if shape.gpus:
        kind = nodeset.options.get("gpu_type")
        parts.append(f"Gres=gpu:{kind}:{shape.gpus}" if kind else f"Gres=gpu:{shape.gpus}")
    parts.append(f"Feature={features(nodeset)}")
    return " ".join(parts)


def partition_of(nodeset: NodeSet, shape: Shape) -> str:
    """The partition a node set goes to: its partition option, else gpu or cloud."""
    return str(nodeset.options.get("partition") or ("gpu" if shape.gpus else "cloud"))


def generate(config: Config, shapes: Sequence[tuple[NodeSet, Shape]], version: tuple[int, int] | None,
             notes: Sequence[str] = ()) -> list[str]:
    """Every slurm.conf line for this configuration, with comments that say why."""
    resume_timeout = math.ceil(max(ns.boot_timeout for ns in config.nodesets)) + RESUME_MARGIN
    suspend_timeout = math.ceil(config.power.suspend_timeout) + SUSPEND_MARGIN
    lines = [f"# slurm.conf lines from slurm-nebula-power {__version__} for {config.path}",
             "# Paste them into slurm.conf (merge SlurmctldParameters with yours) and restart slurmctld.",
             *[f"# {note}" for note in notes]]
    for key, name in PROGRAMS.items():
        path, found = program_path(name)
        lines += [] if found else [f"# {name} is not installed here: fix the path below"]
        lines.append(f"{key}={path}")
    prolog, found = program_path(PROLOG)
    lines += [] if found else [f"# {PROLOG} is not installed here: fix the path below"]
    lines += ["# a job starts as soon as its cloud nodes are up, not at slurmctld's next 30 s check (a site "
              "PrologSlurmctld goes to [slurm] prolog_chain)", f"PrologSlurmctld={prolog}"]
    lines += [f"# longest boot_timeout {resume_timeout - RESUME_MARGIN} s + {RESUME_MARGIN} s for the guest "
              "to start slurmd", f"ResumeTimeout={resume_timeout}",
              f"# [power] suspend_timeout {config.power.suspend_timeout:g} s + {SUSPEND_MARGIN} s: the VM is "
              "gone before slurmctld reuses the node name", f"SuspendTimeout={suspend_timeout}",
              "# idle seconds before a node's VM is powered down: tune to your workload", "SuspendTime=600",
              "ResumeRate=0", "SuspendRate=0"]
    # No cloud_reg_addrs: resume sets NodeAddr from OpenNebula's lease, which cloud_reg_addrs would
    # overwrite with whatever source address slurmd registers from (wrong on multi-NIC GPU VMs).
    # Nodes booted by the worker bootstrap (a node set with `controller`) fetch slurm.conf from slurmctld.
    configless = any(ns.options.get("controller") for ns in config.nodesets)
    lines.append("SlurmctldParameters=idle_on_node_suspend" + (",enable_configless" if configless else ""))
    if version is None or version < (23, 2):
        lines += ["# Slurm 22.05 hides powered-down cloud nodes from sinfo/scontrol (and from status and "
                  "reconcile) without this", "PrivateData=cloud"]
    if any(shape.gpus for _, shape in shapes):
        lines.append("GresTypes=gpu")
    partitions: dict[str, list[str]] = {}
    for nodeset, shape in shapes:
        lines += [f"# {nodeset.nodes_expr}: {shape.source} ({nodeset.template!r}): {shape.vcpus} vCPU, "
                  f"{shape.memory_mb} MiB (RealMemory {MEMORY_RATIO:.0%}), {shape.gpus} GPU",
                  node_line(nodeset, shape)]
        partitions.setdefault(partition_of(nodeset, shape), []).extend(nodeset.nodes)
    for name, nodes in partitions.items():
        lines.append(f"PartitionName={name} Nodes={fold(nodes)} MaxTime=INFINITE State=UP")
    return lines


def slurm_version(config: Config, environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(major, minor) of the local scontrol, or None when there is none."""
    from .slurm import Scontrol, find_scontrol

    try:
        return Scontrol(find_scontrol(config, environ)).version()
    except PowerError:
        return None


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """slurm-nebula-power slurm-conf: print the slurm.conf lines for the configured node sets."""
    from .cli import load, make_parser, parse, setup_logging

    env = os.environ if environ is None else environ
    parser = make_parser("slurm-nebula-power slurm-conf", "Print the slurm.conf lines for the configured node "
                     "sets (NodeName from each template's VCPU, MEMORY and PCI GPUs), their partitions and "
                     "the power-saving parameters with this installation's program paths.")
    parser.epilog = ("A template OpenNebula cannot show is described from the node set's vcpu, memory_mb and "
                     "gpus options instead. exit: 0 printed, 3 configuration error, 4 a template could be "
                     "read neither from OpenNebula nor from the options")
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        config = load(args, env)
        setup_logging("slurm-nebula-power slurm-conf", None)
        logging.getLogger("slurm_nebula_power").setLevel(logging.WARNING)
        from .cloud import OneCloud

        shapes, notes = [], []
        for nodeset, shape, error in read_shapes(config, OneCloud(config.opennebula, retry_seconds=5)):
            if shape is None:
                shape = options_shape(nodeset)
                if shape is None:
                    raise PowerError(f"node set {nodeset.nodes_expr}: template {nodeset.template!r}: "
                                     f"{error}; fix the template, or give vcpu, memory_mb and gpus in the "
                                     "node set")
                notes.append(f"{nodeset.nodes_expr}: template unreadable ({error}): from the node set's "
                             "options")
            shapes.append((nodeset, shape))
    except PowerError as exc:
        print(f"slurm-nebula-power slurm-conf: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print("\n".join(generate(config, shapes, slurm_version(config, env), notes)))
    return EXIT_OK
