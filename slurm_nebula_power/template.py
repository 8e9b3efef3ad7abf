"""`slurm-nebula-power template`: a node set's OpenNebula VM template, ready for `onetemplate create`.

The template boots a VM straight into its Slurm node: CONTEXT carries the node name, the controller, the
munge key and the worker bootstrap (worker/slurm-nebula-worker.sh) as START_SCRIPT_BASE64, which the
context packages run at every boot.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from . import __version__
from .config import Config, NodeSet
from .errors import ConfigError, UsageError
from .hostlists import expand
from .operation import Cloud
from .owned import IMAGE, NETWORK, Kind, Owned, Unresolved, by_name, numeric

WORKER_SCRIPT = "worker/slurm-nebula-worker.sh"
# READY=YES comes from the worker alone, once slurmd runs, so one-context's own report (net-99, CONTEXT
# REPORT_READY) is off: before 6.10.0 it reports READY=YES regardless, even after the worker refused; from
# 6.10.0 (READY_SCRIPT_PATH arrived then) it executes READY_SCRIPT_PATH, which fails "Permission denied" three
# times, 10 s apart, where /run is mounted noexec (initramfs-tools on Debian and Ubuntu).
REPORT_READY = "NO"
DEFAULT_GPU_VENDOR = "10de"  # NVIDIA
DEFAULT_GPU_CLASS = "0302"  # 3D controller: datacenter GPUs (A100, H100, L40S, ...)
MIN_MUNGE_KEY = 32  # bytes: munged refuses shorter keys
HEX4 = re.compile(r"[0-9a-fA-F]{4}")  # a PCI VENDOR or DEVICE id


def worker_script() -> bytes:
    """The shipped worker bootstrap, as installed with the package."""
    return resources.files("slurm_nebula_power").joinpath(WORKER_SCRIPT).read_bytes()


def pick_nodeset(config: Config, wanted: str | None) -> tuple[int, NodeSet]:
    """The node set named by --nodeset (its nodes expression, or nodes of it), or the only one."""
    if wanted is None:
        if len(config.nodesets) == 1:
            return 0, config.nodesets[0]
        raise UsageError("several node sets: choose one with --nodeset (" +
                         ", ".join(ns.nodes_expr for ns in config.nodesets) + ")")
    for index, nodeset in enumerate(config.nodesets):
        if nodeset.nodes_expr == wanted:
            return index, nodeset
    nodes = set(expand(wanted))
    for index, nodeset in enumerate(config.nodesets):
        if nodes <= set(nodeset.nodes):
            return index, nodeset
    raise UsageError(f"--nodeset {wanted}: not the nodes of one node set (" +
                     ", ".join(ns.nodes_expr for ns in config.nodesets) + ")")


class _Options:
    """A node set's options, each error naming the file and the key."""

    def __init__(self, config: Config, index: int, nodeset: NodeSet) -> None:
        self.path = config.path
        self.prefix = f"nodeset[{index}]"
        self.opts: Mapping[str, Any] = nodeset.options

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: {self.prefix}.{key}: {problem}")

    def required(self, key: str, why: str) -> Any:
        if key not in self.opts:
            raise self.fail(key, f"missing; `template` needs it for {why} (see `slurm-nebula-power example-config`)")
        return self.text(key) if isinstance(self.opts[key], str) else self.opts[key]

    def text(self, key: str, default: str | None = None) -> str | None:
        value = self.opts.get(key, default)
        if value is None:
            return None
        value = str(value)
        if not value or any(c in value for c in '"\\\n\r'):
            raise self.fail(key, f"{value!r} cannot go into a template: empty, or has a quote, backslash "
                                 "or newline")
        return value

    def hex4(self, key: str, default: str | None = None) -> str | None:
        value = self.text(key, default)
        if value is not None and not HEX4.fullmatch(value):
            raise self.fail(key, f"{value!r} is not a PCI id: four hex digits such as \"10de\"")
        return value.lower() if value else None


def read_munge_key(opts: _Options) -> bytes:
    """The munge key file's bytes (never shown in any message)."""
    path = Path(opts.required("munge_key_file", "MUNGE_KEY_BASE64"))
    try:
        key = path.read_bytes()
    except OSError as exc:
        raise opts.fail("munge_key_file", f"cannot read {path}: {exc.strerror}; run as root (the key is "
                                          "owned by munge, mode 0400) or fix the path") from None
    if len(key) < MIN_MUNGE_KEY:
        raise opts.fail("munge_key_file", f"{path} holds {len(key)} bytes, not a munge key (at least "
                                          f"{MIN_MUNGE_KEY}; create one with mungekey)")
    return key


GPU_KEYS = ("gpu_vendor", "gpu_class", "gpu_device", "gpu_profile", "gpu_type")  # any of them: a GPU node set


def gpus_wanted(nodeset: NodeSet) -> int | None:
    """The GPUs a node set asks for: `gpus`, else 1 when any gpu_* option is set (docs/configuration.md), else
    None (it says nothing of GPUs)."""
    if "gpus" in nodeset.options:
        return int(nodeset.options["gpus"])
    return 1 if any(key in nodeset.options for key in GPU_KEYS) else None


def gpus_of(nodeset: NodeSet) -> int:
    """The GPUs a node set's template gets: `gpus`, else 1 when any gpu_* option is set, else none."""
    wanted = gpus_wanted(nodeset)
    return 0 if wanted is None else wanted


def _quote(value: object) -> str:
    return '"' + str(value) + '"'


def _vector(name: str, items: Sequence[tuple[str, object]]) -> str:
    return f"{name} = [ " + ", ".join(f"{k} = {_quote(v)}" for k, v in items) + " ]"


def named(config: Config, index: int, nodeset: NodeSet) -> dict[str, tuple[Kind, str]]:
    """The node set's network, image (and InfiniBand network, when it has that NIC) given by name rather than
    numeric id: what oned must resolve, as the configured user sees it, before the template can name them by id."""
    opts = _Options(config, index, nodeset)
    keys = [("network", NETWORK), ("image", IMAGE)]
    if "ib_vendor" in opts.opts or "ib_device" in opts.opts:
        keys.append(("ib_network", NETWORK))
    found = {key: (kind, opts.text(key)) for key, kind in keys}
    return {key: (kind, value) for key, (kind, value) in found.items() if value and not numeric(value)}


class UsablePools:
    """The networks and images the user may use, each asked of oned once, when first needed (template, check)."""

    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud
        self.seen: dict[str, list[Owned]] = {}

    def of(self, kind: Kind) -> list[Owned]:
        """The pool of `kind` the user may use (filter -2), read on first use."""
        if kind.noun not in self.seen:
            self.seen[kind.noun] = self.cloud.networks() if kind is NETWORK else self.cloud.images()
        return self.seen[kind.noun]


def resolve_names(config: Config, index: int, nodeset: NodeSet, cloud: Cloud) -> dict[str, Owned]:
    """The node set's networks and image given by name, each found among what the user may use (filter -2 of
    one.vnpool.info and one.imagepool.info); ConfigError naming the key, the user and the fix when a name is
    not there, or there under several ids."""
    wanted = named(config, index, nodeset)
    if not wanted:
        return {}
    user = cloud.rights()
    pools = UsablePools(cloud)
    found: dict[str, Owned] = {}
    for key, (kind, name) in wanted.items():
        hit = by_name(kind, key, name, pools.of(kind), user)
        if isinstance(hit, Unresolved):
            raise ConfigError(f"{config.path}: nodeset[{index}].{key}: {hit.text}", hit.fix)
        found[key] = hit
    return found


def _reference(kind: Kind, key: str, value: str, refs: Mapping[str, Owned]) -> tuple[list[str], tuple[str, str]]:
    """The comment and the vector member naming a network or image: by id when resolved (or given as a number),
    else by name as the node set gives it (no oned asked)."""
    attr = kind.attribute
    ref = refs.get(key)
    if ref is not None:
        note = (f'# {key} "{ref.name}": {kind.noun} {ref.id}, owned by {ref.uname}; by id, as oned looks a name up '
                f"only among one owner's ({attr}_UNAME, else the user's own)")
        return [note], (f"{attr}_ID", str(ref.id))
    return [], ((f"{attr}_ID", value) if numeric(value) else (attr, value))


def render(config: Config, index: int, nodeset: NodeSet, munge_key: bytes | None = None,
           script: bytes | None = None, refs: Mapping[str, Owned] | None = None) -> str:
    """The VM template of a node set, in OpenNebula template syntax. `refs`: its networks and image given by name,
    as resolve_names found them (written by id); without them a name is written as given."""
    opts = _Options(config, index, nodeset)
    refs = refs or {}
    needed = {"vcpu": "VCPU", "memory_mb": "MEMORY", "network": "the NIC",
              "controller": "SLURM_CONTROLLER (slurmctld's host[:port])"}
    if munge_key is None:
        needed["munge_key_file"] = "MUNGE_KEY_BASE64"
    missing = [key for key in needed if key not in opts.opts]
    if len(missing) > 1:  # all of them in one line, not one a run
        raise ConfigError(f"{config.path}: {opts.prefix}: missing {', '.join(missing)}; `template` needs them "
                          f"for {', '.join(needed[key] for key in missing)} (see `slurm-nebula-power example-config`)")
    vcpu = int(opts.required("vcpu", "VCPU"))
    memory = int(opts.required("memory_mb", "MEMORY"))
    cpu = float(opts.opts.get("cpu", vcpu))
    network = opts.required("network", "the NIC")
    controller = opts.required("controller", "SLURM_CONTROLLER (slurmctld's host[:port])")
    key = munge_key if munge_key is not None else read_munge_key(opts)
    bootstrap = script if script is not None else worker_script()
    gpus = gpus_of(nodeset)
    if gpus < 0:
        raise opts.fail("gpus", f"{gpus} is negative")
    name = nodeset.template if isinstance(nodeset.template, str) else \
        "slurm-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", nodeset.nodes_expr).strip("-")
    if any(c in name for c in '"\\\n'):
        raise opts.fail("template", f"{name!r} cannot be a template NAME")

    lines = [
        f"# OpenNebula VM template for the Slurm nodes {nodeset.nodes_expr}, from {config.path}",
        f"# by slurm-nebula-power {__version__} template. Create it as the user resume acts as, so that it is that",
        f"# user's:  ONE_AUTH={config.opennebula.auth_file} onetemplate create FILE",
        "#",
        "# SECRET: CONTEXT/MUNGE_KEY_BASE64 is the cluster's munge key. Whoever can read this file or the",
        "# template can act as any Slurm user on the cluster: keep the file mode 600, delete it once the",
        "# template exists, and restrict the template to its owner:  onetemplate chmod <ID> 600",
    ]
    if not isinstance(nodeset.template, str):
        lines.append(f"# The node set names template id {nodeset.template}: set `template` to the new id.")
    lines += [
        "",
        f"NAME = {_quote(name)}",
        f"CPU = {_quote(f'{cpu:g}')}",
        f"VCPU = {_quote(vcpu)}",
        f"MEMORY = {_quote(memory)}",
    ]
    if gpus:
        gpu: list[tuple[str, object]] = [("VENDOR", opts.hex4("gpu_vendor", DEFAULT_GPU_VENDOR)),
                                         ("CLASS", opts.hex4("gpu_class", DEFAULT_GPU_CLASS))]
        if opts.hex4("gpu_device"):
            gpu.append(("DEVICE", opts.hex4("gpu_device")))
        if opts.text("gpu_profile"):
            gpu.append(("PROFILE", str(opts.text("gpu_profile"))))
        profile = opts.text("gpu_profile")
        lines.append(f"# {gpus} GPU(s) by PCI passthrough" + (f", profile {profile}" if profile else ""))
        lines += [_vector("PCI", gpu)] * gpus
    if "ib_vendor" in opts.opts or "ib_device" in opts.opts:
        ib_network = opts.required("ib_network", "the InfiniBand SR-IOV NIC (PCI TYPE = \"NIC\")")
        ib: list[tuple[str, object]] = [("TYPE", "NIC")]
        for option, attr in (("ib_vendor", "VENDOR"), ("ib_device", "DEVICE")):
            if opts.hex4(option):
                ib.append((attr, opts.hex4(option)))
        note, member = _reference(NETWORK, "ib_network", ib_network, refs)
        lines += ["# InfiniBand: an SR-IOV virtual function as a PCI NIC", *note, _vector("PCI", [*ib, member])]
    note, member = _reference(NETWORK, "network", network, refs)
    lines += [*note, _vector("NIC", [member])]
    image = opts.text("image")
    if image:
        note, member = _reference(IMAGE, "image", image, refs)
        lines += [*note, _vector("DISK", [member])]
    else:
        lines.append("# No `image` in the node set: add the worker image, e.g. DISK = [ IMAGE = \"...\" ]")
    context: list[tuple[str, object]] = [
        ("NETWORK", "YES"),
        ("TOKEN", "YES"),
        ("REPORT_READY", REPORT_READY),
        ("SET_HOSTNAME", "$NAME"),
        ("SSH_PUBLIC_KEY", "$USER[SSH_PUBLIC_KEY]"),
        ("SLURM_NODENAME", "$NAME"),
        ("SLURM_CONTROLLER", controller),
        ("MUNGE_KEY_BASE64", base64.b64encode(key).decode()),
        ("START_SCRIPT_BASE64", base64.b64encode(bootstrap).decode()),
    ]
    lines += [
        "# SLURM_NODENAME is the VM's name, which resume sets to the node's; START_SCRIPT_BASE64 is",
        "# slurm-nebula-worker.sh (etc/worker/), run by the context packages at every boot. It reports",
        "# READY=YES itself once slurmd runs: REPORT_READY = \"NO\" keeps one-context's net-99 from reporting",
        "# it too (before one-context 6.10.0 even when the worker refused; READY_SCRIPT_PATH needs 6.10.0",
        "# and an executable path, and /run is noexec on Debian and Ubuntu).",
        "CONTEXT = [",
        ",\n".join(f"  {k} = {_quote(v)}" for k, v in context),
        "]",
    ]
    return "\n".join(lines) + "\n"
