"""gres.conf for the cloud node sets: the lines `slurm-conf --gres-conf` prints, and `check`'s look at the
gres.conf beside slurm.conf.

slurm.conf's `Gres=gpu:N` only counts GPUs; slurmd binds a job to devices (CUDA_VISIBLE_DEVICES, the device
cgroup) only from gres.conf's `File=` lines: without them slurmctld drains the node as it registers. gres.conf(5)
rules AutoDetect out for cloud nodes (22.05's slurmctld does not start with it), so every line here says
AutoDetect=off, which a site-wide AutoDetect would otherwise reach. What each release does with each case
`check` reports is in docs/SLURM-FINDINGS.md.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from . import __version__
from .config import Config, NodeSet
from .errors import ConfigError
from .findings import Report
from .hostlists import fold, size
from .shapes import Shape
from .slurmconf import GresConf, GresLine, SlurmConf, gres_gpu_types, read_gres_conf, release_name

NVIDIA = "10de"
DEVICE = "/dev/nvidia"  # the NVIDIA driver's device files, one a GPU (vGPUs included), numbered from 0
HOW = "slurm-nebula-power slurm-conf --gres-conf prints them"
# AutoDetect on a cloud node: 22.05's slurmctld exits at start for the values it knows (and ignores others,
# "unknown autodetect flag"); 24.11's and 26.05's log "Cannot use AutoDetect on cloud/dynamic node" and start.
# Releases between are taken for 22.05 (measured on 22.05, 24.11 and 26.05: docs/SLURM-FINDINGS.md).
AUTODETECT_STARTS = (24, 11)
AUTODETECT_22 = ("nvml", "rsmi", "oneapi")


# ---- writing gres.conf lines --------------------------------------------------------------------------


def device_files(count: int) -> str:
    """File= for `count` NVIDIA GPUs: /dev/nvidia0, /dev/nvidia[0-3]."""
    return f"{DEVICE}0" if count == 1 else f"{DEVICE}[0-{count - 1}]"


def gres_line(nodeset: NodeSet, shape: Shape) -> str:
    """The gres.conf line of a node set whose VMs have NVIDIA GPUs (Type as in its Gres=, Count as File=)."""
    kind = nodeset.options.get("gpu_type")
    return " ".join([f"NodeName={fold(nodeset.nodes)}", "AutoDetect=off", "Name=gpu",
                     *([f"Type={kind}"] if kind else []), f"Count={shape.gpus}", f"File={device_files(shape.gpus)}"])


def _what(shape: Shape) -> str:
    if shape.gpu_profile:
        return (f"{shape.gpus} vGPU(s) of profile {shape.gpu_profile}, each a /dev/nvidiaN of its own in the "
                "guest (a MIG-backed profile too: one GPU to the guest)")
    return f"{shape.gpus} GPU(s) by PCI passthrough, each a /dev/nvidiaN in the guest"


def generate_gres(config: Config, shapes: Sequence[tuple[NodeSet, Shape]], notes: Sequence[str] = ()) -> list[str]:
    """Every gres.conf line for this configuration's GPU node sets, with comments that say why."""
    lines = [f"# gres.conf lines from slurm-nebula-power {__version__} for {config.path}",
             "# Put them in the gres.conf beside slurm.conf on the controller (merge with your own lines) and",
             "# restart slurmctld. Configless nodes (slurmd --conf-server) fetch it with slurm.conf when slurmd",
             "# starts; a node with a slurm.conf of its own needs this gres.conf beside it.",
             "# File=: the devices slurmd binds a job to (CUDA_VISIBLE_DEVICES, the device cgroup); without them",
             "# slurmctld drains the node as it registers. AutoDetect=off: gres.conf(5) rules AutoDetect out for",
             "# cloud nodes, and a site-wide AutoDetect line would reach them.",
             *[f"# {note}" for note in notes]]
    gpu_sets = [(nodeset, shape) for nodeset, shape in shapes if shape.gpus]
    for nodeset, shape in gpu_sets:
        source = f"# {nodeset.nodes_expr}: {shape.source} ({nodeset.template!r})"
        if shape.gpu_vendor not in ("", NVIDIA):
            lines += [f"{source}: {shape.gpus} GPU(s) of PCI vendor {shape.gpu_vendor}, not NVIDIA: write their",
                      "# line yourself, with the device files their driver makes (AMD: /dev/dri/renderD*):",
                      f"# NodeName={fold(nodeset.nodes)} AutoDetect=off Name=gpu Count={shape.gpus} File=..."]
            continue
        lines += [f"{source}: {_what(shape)}", gres_line(nodeset, shape)]
    if not gpu_sets:
        lines.append("# No node set has GPUs: nothing to bind.")
    return lines


# ---- checking the gres.conf beside slurm.conf ---------------------------------------------------------


def check_gres(report: Report, config: Config, conf: SlurmConf, version: tuple[int, int] | None) -> None:
    """GPU cloud nodes (Gres=gpu in slurm.conf) need GresTypes=gpu, and gres.conf lines with File= for each
    GPU slurm.conf gives them, of the same Type, without AutoDetect; else slurmd finds no device to bind."""
    wanted = {node: gres_gpu_types(conf.nodes[node].get("gres", "")) for ns in config.nodesets
              for node in ns.nodes if node in conf.nodes}
    gpu_nodes = {node: types for node, types in wanted.items() if sum(types.values())}
    if not gpu_nodes:
        return
    names = fold(sorted(gpu_nodes))
    types = [t.strip().lower() for t in conf.get("GresTypes").split(",")]
    if "gpu" not in types:
        report.problem("slurm.conf GresTypes", f"lacks gpu, and {names} have Gres=gpu: slurmctld drops their GPUs "
                       "and refuses every job that asks for one (\"Invalid generic resource (gres) specification\")",
                       "add gpu to GresTypes (GresTypes=gpu)")
    path = conf.path.parent / "gres.conf"
    try:
        gres = read_gres_conf(path)
    except ConfigError as exc:
        report.problem(f"gres.conf {path}", str(exc), "make it readable by SlurmUser (it holds no secret)")
        return
    if gres is None:
        report.problem(f"gres.conf {path}", f"missing, and slurm.conf gives {names} Gres=gpu: slurmd finds no "
                       "GPU device on them, and slurmctld drains each one as it registers (\"gres/gpu count reported "
                       "lower than configured\")", f"slurm-nebula-power slurm-conf --gres-conf > {path}, then "
                       "restart slurmctld (configless nodes fetch it when their slurmd starts)")
        return
    verdicts: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for node, want in gpu_nodes.items():
        declared = conf.nodes[node].get("gres", "")
        autodetect = _autodetect(gres.autodetect(node), version)
        if autodetect is not None:
            verdicts[autodetect].append(node)
        verdicts[_verdict(gres, node, want, declared)].append(node)
    for (level, text, fix), nodes in verdicts.items():
        subject = f"gres.conf NodeName={fold(sorted(nodes))}"
        if level == "ok":
            report.ok(subject, text)
        elif level == "warning":
            report.warn(subject, text, fix)
        else:
            report.problem(subject, text, fix)


def _autodetect(value: str, version: tuple[int, int] | None) -> tuple[str, str, str] | None:
    """(level, text, fix) for an AutoDetect other than off that reaches a GPU cloud node, else None."""
    if value in ("", "off"):
        return None
    fix = f"add AutoDetect=off to their line ({HOW})"
    release = release_name(version)
    if version is None or version < AUTODETECT_STARTS:
        if value in AUTODETECT_22:
            return ("problem", f"AutoDetect={value} applies to them: {release} refuses AutoDetect on cloud nodes, "
                    "and slurmctld exits at start (\"Cannot use AutoDetect on cloud node\")", fix)
        what = f"{release} does not know it and ignores it (\"unknown autodetect flag\")"
    else:
        what = ("slurmctld logs \"Cannot use AutoDetect on cloud/dynamic node\" and starts, and slurmd detects the "
                "VM's GPUs itself where it can (AutoDetect=nvidia, or nvml with Slurm's NVML plugin and the driver's "
                "libnvidia-ml), draining the node when they differ from File=")
    return ("warning", f"AutoDetect={value} applies to them, which gres.conf(5) rules out for cloud nodes: {what}",
            fix)


def _files(line: GresLine) -> int:
    """The devices a gres.conf line names: File= (a range such as /dev/nvidia[0-3]), MultipleFiles= (one GPU,
    a MIG instance's files), else none."""
    if "file" in line.keys:
        return size(line.keys["file"])
    return 1 if "multiplefiles" in line.keys else 0


def _verdict(gres: GresConf, node: str, want: Mapping[str, int], declared: str) -> tuple[str, str, str]:
    """(level, text, fix) for one GPU node's File= lines against its Gres=."""
    lines = [line for line in gres.gpu_lines(node) if _files(line)]
    if not lines:
        return ("problem", f"no Name=gpu line with File= for them, and slurm.conf says Gres={declared}: slurmd "
                "finds no GPU device, and slurmctld drains the node as it registers (\"gres/gpu count reported "
                "lower than configured\")", f"add their lines ({HOW})")
    have: dict[str, int] = defaultdict(int)
    for line in lines:
        have[line.keys.get("type", "")] += _files(line)
    # An untyped Gres=gpu:N takes typed lines too (slurmd logs a warning and binds them all).
    if dict(have) == dict(want) or (set(want) == {""} and sum(have.values()) == want[""]):
        return ("ok", f"File= lines for Gres={declared}", "")
    said = ",".join(f"gpu:{kind + ':' if kind else ''}{count}" for kind, count in sorted(have.items()))
    if all(have.get(kind, 0) >= count for kind, count in want.items()):
        why = ("a VM with the GPUs slurm.conf gives lacks the devices beyond them: slurmd waits for them, then "
               "exits (\"can't stat gres.conf file\") and the node never registers")
    else:
        why = ("slurmd reports fewer GPUs of the type slurm.conf names, and slurmctld drains the node as it "
               "registers (\"gres/gpu count reported lower than configured\")")
    fix = " and ".join(f"{'Type=' + kind + ' ' if kind else ''}File={device_files(count)}"
                       for kind, count in sorted(want.items()))
    return ("problem", f"their File= lines give {said}, slurm.conf Gres={declared}: {why}",
            f"{fix} on their line ({HOW})")
