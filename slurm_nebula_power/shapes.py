"""slurm.conf from the templates: what a VM gives a node (Shape), and the lines `slurm-conf` prints."""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import __version__
from .config import Config, NodeSet
from .domains import Topology, topology
from .errors import CloudError, CredentialsRefused, TransientCloudError, first_line
from .hostlists import fold
from .model import Pci, printable
from .operation import Cloud
from .template import DEFAULT_GPU_VENDOR, HEX4, gpus_of

PROGRAMS = {"ResumeProgram": "slurm-nebula-resume", "SuspendProgram": "slurm-nebula-suspend",
            "ResumeFailProgram": "slurm-nebula-resume-fail"}
PROLOG = "slurm-nebula-prolog"
# slurmd reports the guest's MemTotal, which is below the VM's MEMORY (kernel, firmware, crash kernel):
# a RealMemory at 95 % of MEMORY never trips "Low RealMemory" (AWS ParallelCluster uses the same ratio).
MEMORY_RATIO = 0.95
RESUME_MARGIN = 300  # seconds for the guest to start slurmd after the VM is RUNNING
SUSPEND_MARGIN = 30  # seconds beyond [power] suspend_timeout before slurmctld forgets the node's address


# ---- what a template gives a node -------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What slurmd will find in a VM: vCPUs, memory and GPUs, and where that was learned."""

    vcpus: int
    memory_mb: int
    gpus: int
    source: str
    gpu_vendor: str = ""  # PCI vendor id of the GPUs when known and the same for all ("10de": NVIDIA)
    gpu_profile: str = ""  # the vGPU (or MIG-backed vGPU) profile the GPUs are made with, if any
    gpu_model: str = ""  # a Feature naming the GPUs' model (gpu_10de_2330), when the template names one


def gpu_entries(pci: Any) -> list[Pci]:
    """The GPUs among a template's PCI entries (CLASS 03xx, a vGPU PROFILE or a GPU vendor; not TYPE=NIC)."""
    devices = pci if isinstance(pci, list) else [pci] if isinstance(pci, dict) else []
    return [entry for entry in (Pci.from_entry(d) for d in devices if isinstance(d, dict)) if entry.is_gpu]


def pci_gpus(pci: Any) -> int:
    """How many GPUs a template's PCI entries ask for."""
    return len(gpu_entries(pci))


def _number(value: Any) -> float | None:
    """A template's number, or None: not a number, not finite, or beyond any machine (1e9 vCPUs or MiB)."""
    try:
        number = float(str(value)[:32])
    except ValueError:
        return None
    return number if math.isfinite(number) and 0 <= number < 1e9 else None


def model_feature(vendor: str, device: str, profile: str) -> str:
    """A Slurm feature naming one GPU model (letters, digits and underscores): its vGPU profile (gpu_nvidia_558),
    else its PCI vendor and device ids (gpu_10de_2330); "" when neither a profile nor a device is named (a
    VENDOR and CLASS take any model)."""
    if profile:
        words = [profile]
    elif device:
        words = [vendor, device]
    else:
        return ""
    token = re.sub(r"[^a-z0-9]+", "_", "_".join(w for w in words if w).lower()).strip("_")
    return f"gpu_{token}"[:64] if token else ""


PROFILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 _.:()/+-]{0,63}")  # nvidia-558, NVIDIA L40S-1B, GRID T4-2Q


def _checked(gpus: list[Pci], tid: int) -> list[Pci]:
    """The template's GPU entries, each value that reaches a generated file (gres.conf, slurm.conf's comments)
    checked: ValueError naming the template and the key otherwise (a PROFILE with a newline once wrote a
    whole gres.conf line of OpenNebula's choosing)."""
    for gpu in gpus:
        for key, value, rule, what in (("VENDOR", gpu.vendor, HEX4, "4 hex digits"),
                                       ("DEVICE", gpu.device, HEX4, "4 hex digits"),
                                       ("PROFILE", gpu.profile, PROFILE, "a profile name")):
            if value and not rule.fullmatch(value):
                raise ValueError(f"template {tid}: PCI {key} {printable(value[:40])!r} is not {what}: fix the "
                                 "template (onetemplate update)")
    return gpus


def template_shape(template: Mapping[str, Any], tid: int) -> Shape:
    """The Shape of a VM built from this template (oned gives one vCPU when VCPU is unset); ValueError when a
    GPU entry holds a value no generated file may carry."""
    vcpu = _number(template.get("VCPU", 1)) or 1
    memory = _number(template.get("MEMORY", 0)) or 0
    gpus = _checked(gpu_entries(template.get("PCI")), tid)
    vendors = {gpu.vendor.lower() for gpu in gpus}
    profiles = {gpu.profile for gpu in gpus}
    models = {model_feature(gpu.vendor, gpu.device, gpu.profile) for gpu in gpus}
    return Shape(int(vcpu), int(memory), len(gpus), f"template {tid}",
                 vendors.pop() if len(vendors) == 1 else "", profiles.pop() if len(profiles) == 1 else "",
                 models.pop() if len(models) == 1 else "")


def options_shape(nodeset: NodeSet) -> Shape | None:
    """The Shape the node set's options describe (vcpu and memory_mb needed), or None."""
    opts = nodeset.options
    if "vcpu" not in opts or "memory_mb" not in opts:
        return None
    gpus = gpus_of(nodeset)
    vendor, profile = str(opts.get("gpu_vendor", DEFAULT_GPU_VENDOR)).lower(), str(opts.get("gpu_profile", ""))
    return Shape(int(opts["vcpu"]), int(opts["memory_mb"]), gpus, "node set options", vendor if gpus else "",
                 profile if gpus else "",
                 model_feature(vendor, str(opts.get("gpu_device", "")), profile) if gpus else "")


def read_shapes(config: Config, cloud: Cloud, unreachable_raises: bool = False
                ) -> list[tuple[NodeSet, Shape | None, str]]:
    """Per node set: its template's Shape, or None and why it could not be read. unreachable_raises: an
    OpenNebula that does not answer (TransientCloudError), or refuses the credentials (CredentialsRefused), is
    raised, not blamed on each template."""
    out: list[tuple[NodeSet, Shape | None, str]] = []
    for nodeset in config.nodesets:
        try:
            tid = cloud.template_id(nodeset.template)
            out.append((nodeset, template_shape(cloud.template(tid), tid), ""))
        except TransientCloudError:
            if unreachable_raises:
                raise
            out.append((nodeset, None, "OpenNebula did not answer"))
        except CredentialsRefused as exc:  # the session, not the template: no template fix would help
            if unreachable_raises:
                raise
            out.append((nodeset, None, first_line(exc)))
        except CloudError as exc:
            out.append((nodeset, None, first_line(exc)))
        except ValueError as exc:  # a value from OpenNebula no generated file may carry
            out.append((nodeset, None, str(exc)))
    return out


# ---- writing slurm.conf lines -----------------------------------------------------------------------


def outage_bound(config: Config) -> int:
    """Seconds a resume may go on after boot_timeout when OpenNebula goes away mid-run: the run's retry window
    (retry_seconds, shared by its calls: cloud.OneCloud) and the call in flight (timeout), then every call
    fails at once and the nodes are handed back (docs/behaviour.md)."""
    return math.ceil(config.opennebula.retry_seconds + config.opennebula.timeout)


def resume_timeout_for(config: Config, boot: float) -> int:
    """ResumeTimeout for a longest boot_timeout of `boot`: room for the guest to start slurmd once its VM runs
    (RESUME_MARGIN), and at least for a resume to hand its nodes back with OpenNebula gone."""
    return math.ceil(boot) + max(RESUME_MARGIN, outage_bound(config) + 30)


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


def features(nodeset: NodeSet, shape: Shape) -> str:
    """Feature= of a node set: its features option, else cloud plus the GPU type (gpu_type, else the model the
    template names: Shape.gpu_model)."""
    if nodeset.options.get("features"):
        return str(nodeset.options["features"])
    kind = nodeset.options.get("gpu_type") or (shape.gpu_model if shape.gpus else "")
    return ",".join(["cloud"] + ([str(kind)] if kind else []))


def node_line(nodeset: NodeSet, shape: Shape, weight: int | None = None) -> str:
    """The NodeName line of a node set (Weight= when its partition holds other node sets: weights())."""
    parts = [f"NodeName={fold(nodeset.nodes)}", "State=CLOUD", f"CPUs={shape.vcpus}",
             f"RealMemory={real_memory(shape.memory_mb)}"]
    if shape.gpus:
        kind = nodeset.options.get("gpu_type")
        parts.append(f"Gres=gpu:{kind}:{shape.gpus}" if kind else f"Gres=gpu:{shape.gpus}")
    parts.append(f"Feature={features(nodeset, shape)}")
    return " ".join(parts + ([f"Weight={weight}"] if weight is not None else []))


WEIGHT_STEP = 10  # Weight=10, 20, 30...: a site's static nodes (Weight 1 by default) go first, and room between


Partitions = dict[str, list[tuple[NodeSet, Shape]]]


def by_partition(shapes: Sequence[tuple[NodeSet, Shape]]) -> Partitions:
    """The node sets of each partition, in the configuration's order."""
    partitions: Partitions = {}
    for nodeset, shape in shapes:
        partitions.setdefault(partition_of(nodeset, shape), []).append((nodeset, shape))
    return partitions


def weights(partitions: Partitions) -> dict[str, int]:
    """Per node set (its nodes expression) sharing its partition with others: its Weight, in the order the
    configuration lists them (the first is preferred: the lowest Weight). A node set alone in its partition
    gets none (Slurm's default, 1)."""
    return {ns.nodes_expr: WEIGHT_STEP * (rank + 1) for sets in partitions.values() if len(sets) > 1
            for rank, (ns, _) in enumerate(sets)}


def fallback_notes(config: Config, partitions: Partitions, weight: Mapping[str, int]) -> list[str]:
    """The comment lines above the NodeName lines of partitions holding several node sets: the order, the
    fallback and how a job pins a model."""
    lines = []
    for name, sets in partitions.items():
        if len(sets) < 2:
            continue
        order = ", ".join(f"{ns.nodes_expr} Weight={weight[ns.nodes_expr]} ({features(ns, shape)})"
                          for ns, shape in sets)
        lines.append(f"# partition {name}: {order}, in their order in {config.path}: jobs go to the lowest Weight "
                     "first; a node set that runs out of GPUs steps out (drained with a nebula: reason) and jobs "
                     "fall back to the next; --constraint=<feature> pins a model")
        lines += [f"# {ns.nodes_expr}: no GPU model feature (the template's PCI entry names no DEVICE or PROFILE): "
                  "set gpu_type to pin it with --constraint" for ns, shape in sets
                  if shape.gpus and features(ns, shape) == "cloud"]
    return lines


def partition_of(nodeset: NodeSet, shape: Shape) -> str:
    """The partition a node set goes to: its partition option, else gpu or cloud."""
    return str(nodeset.options.get("partition") or ("gpu" if shape.gpus else "cloud"))


def generate(config: Config, shapes: Sequence[tuple[NodeSet, Shape]], version: tuple[int, int] | None,
             notes: Sequence[str] = ()) -> list[str]:
    """Every slurm.conf line for this configuration, with comments that say why."""
    resume_timeout = resume_timeout_for(config, max(ns.boot_timeout for ns in config.nodesets))
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
    if version is not None and version >= (23, 11):
        lines.append(f"# Slurm {version[0]}.{version[1]:02d}: when a node's slurmd registers, NodeAddr becomes "
                     "the address it registers from (cloud_reg_addrs, always on from 23.11)")
    if version is not None and version >= (25, 5):
        lines += ["# a job whose node never registers by ResumeTimeout is requeued, not ended (25.05+; merge "
                  "with your SchedulerParameters)", "SchedulerParameters=requeue_on_resume_failure"]
    if any(shape.gpus for _, shape in shapes):
        lines += ["# the GPUs' devices go in gres.conf beside slurm.conf: slurm-nebula-power slurm-conf --gres-conf",
                  "GresTypes=gpu"]
    partitions = by_partition(shapes)
    weight = weights(partitions)
    lines += fallback_notes(config, partitions, weight)
    for nodeset, shape in shapes:
        lines += [f"# {nodeset.nodes_expr}: {shape.source} ({nodeset.template!r}): {shape.vcpus} vCPU, "
                  f"{shape.memory_mb} MiB (RealMemory {MEMORY_RATIO:.0%}), {shape.gpus} GPU",
                  node_line(nodeset, shape, weight.get(nodeset.nodes_expr))]
    for name, sets in partitions.items():
        lines.append(f"PartitionName={name} Nodes={fold([n for ns, _ in sets for n in ns.nodes])} "
                     "MaxTime=INFINITE State=UP")
    domains = config_topology(config, version)
    if domains is not None:
        where = config.slurm.slurm_conf.parent / "topology.conf" if config.slurm.slurm_conf else "topology.conf"
        lines += [f"# the node sets' domains as Slurm {domains.plugin.split('/')[1]}s: a job Slurm keeps in one runs "
                  f"in one domain; write topology.conf with: slurm-nebula-power slurm-conf --topology > {where}",
                  *([f"# {domains.note}"] if domains.note else []), f"TopologyPlugin={domains.plugin}"]
    return lines


def config_topology(config: Config, version: tuple[int, int] | None) -> Topology | None:
    """The topology of the configured node sets' domains (domains.topology), or None when no node set has one."""
    if not any(ns.domain for ns in config.nodesets):
        return None
    domains: dict[str, list[str]] = {}
    for nodeset in config.nodesets:
        if nodeset.domain is not None:
            domains.setdefault(nodeset.domain, []).extend(nodeset.nodes)
    return topology(domains, [node for ns in config.nodesets if ns.domain is None for node in ns.nodes], version)


def topology_conf(config: Config, version: tuple[int, int] | None) -> list[str]:
    """topology.conf for the node sets' domains (`slurm-conf --topology`); [] when no node set has one."""
    found = config_topology(config, version)
    if found is None:
        return []
    release = "an unknown Slurm (tree: every release takes it)" if version is None else \
        f"Slurm {version[0]}.{version[1]:02d}"
    return [f"# topology.conf from slurm-nebula-power {__version__} for {config.path}, {release}",
            f"# one {'block' if found.plugin.endswith('block') else 'switch'} per domain ([opennebula] "
            f"domain_attribute {config.opennebula.domain_attribute}), one for the nodes without a domain",
            *([f"# {found.note}"] if found.note else []), *found.lines]
