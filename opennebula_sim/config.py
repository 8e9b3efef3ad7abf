"""The simulated cloud's shape: hosts, PCI devices, templates, network, phase durations, faults (sim.toml)."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opennebula_sim.templates import TemplateSyntaxError, parse_template


class ConfigError(ValueError):
    """A simulator configuration that cannot be used; the message names the file and the key."""

GPU_VENDOR, GPU_DEVICE, GPU_CLASS = "10de", "2330", "0302"
NIC_VENDOR, NIC_DEVICE, NIC_CLASS = "15b3", "101d", "0200"
TRANSIENT_KINDS = ("internal", "http503", "drop")
# oned's host states (include/Host.h, HostState) that a simulated host can be in.
HOST_STATES = {"INIT": 0, "MONITORED": 2, "ERROR": 3, "DISABLED": 4, "OFFLINE": 8}


@dataclass(frozen=True)
class PciDevice:
    """One PCI device of a host (HOST_SHARE/PCI_DEVICES/PCI)."""

    short_address: str
    vendor: str = GPU_VENDOR
    device: str = GPU_DEVICE
    klass: str = GPU_CLASS
    vendor_name: str = "NVIDIA Corporation"
    device_name: str = "GH100 [H100 SXM5 80GB]"
    class_name: str = "3D controller"
    numa_node: int = 0
    profiles: tuple[str, ...] = ()  # vGPU/MIG profiles the device offers (HOST_SHARE PCI PROFILES)


@dataclass(frozen=True)
class HostSpec:
    """A hypervisor: CPU in oned's percent units (100 per core), memory in KiB as HOST_SHARE reports it."""

    name: str
    cpu: int = 6400
    memory_kb: int = 512 * 1024 * 1024
    pci: tuple[PciDevice, ...] = ()
    state: str = "MONITORED"  # a HOST_STATES name: only MONITORED hosts take new VMs, as in oned 7.x
    attributes: tuple[tuple[str, str], ...] = ()  # HOST/TEMPLATE attributes, as `onehost update` sets them


@dataclass(frozen=True)
class TemplateSpec:
    """A VM template: id, name and its body in OpenNebula template syntax."""

    id: int
    name: str
    body: str


@dataclass(frozen=True)
class NetworkSpec:
    """The one virtual network every NIC leases from; its owner (uid 0: oneadmin) and whether others may USE it
    (OTHER_U, as `onevnet chmod` sets it)."""

    id: int = 0
    name: str = "slurm-net"
    cidr: str = "127.0.1.0/24"
    gateway: str = ""
    dns: str = ""
    uid: int = 0
    other_use: bool = True


@dataclass(frozen=True)
class ImageSpec:
    """An image of the image datastore (READY): its owner (uid 0: oneadmin) and whether others may USE it."""

    id: int
    name: str
    uid: int = 0
    other_use: bool = True


def default_images() -> tuple[ImageSpec, ...]:
    """`slurm-worker` (id 0), oneadmin's."""
    return (ImageSpec(0, "slurm-worker"),)


@dataclass(frozen=True)
class Durations:
    """Seconds each kind of LCM phase lasts (0 = next tick)."""

    prolog: float = 1.0
    boot: float = 1.0
    shutdown: float = 1.0
    epilog: float = 1.0


@dataclass(frozen=True)
class Faults:
    """Injected misbehaviour; every random draw comes from the seeded generator."""

    latency_ms: float = 0.0
    latency_jitter_ms: float = 0.0
    transient_rate: float = 0.0
    transient_kinds: tuple[str, ...] = TRANSIENT_KINDS
    boot_failure_rate: float = 0.0
    stuck_pending_rate: float = 0.0
    hang: bool = False
    quota_exceeded: bool = False
    allocate_failure: bool = False


def default_pci(gpus: int, nics: int) -> tuple[PciDevice, ...]:
    """GPUs at buses 41, 42, ... and NICs at buses 21, 22, ...: the usual layout of a GPU server."""
    gpu = tuple(PciDevice(short_address=f"{0x41 + i:02x}:00.0", numa_node=i * 2 // max(gpus, 1))
                for i in range(gpus))
    nic = tuple(
        PciDevice(short_address=f"{0x21 + i:02x}:00.0", vendor=NIC_VENDOR, device=NIC_DEVICE, klass=NIC_CLASS,
                  vendor_name="Mellanox Technologies", device_name="MT2892 Family [ConnectX-6 Dx]",
                  class_name="Ethernet controller")
        for i in range(nics)
    )
    return gpu + nic


def default_hosts(count: int = 4, gpus: int = 4, nics: int = 1) -> tuple[HostSpec, ...]:
    """`count` identical GPU hosts named gpu-host-01, gpu-host-02, ..."""
    return tuple(HostSpec(name=f"gpu-host-{i + 1:02d}", pci=default_pci(gpus, nics)) for i in range(count))


GPU_WORKER = """NAME = "slurm-gpu-worker"
CPU = "8"
VCPU = "8"
MEMORY = "65536"
PCI = [ VENDOR = "10de", CLASS = "0302" ]
NIC = [ NETWORK = "slurm-net", NETWORK_UNAME = "oneadmin" ]
OS = [ ARCH = "x86_64" ]
GRAPHICS = [ LISTEN = "0.0.0.0", TYPE = "VNC" ]
CONTEXT = [ NETWORK = "YES", SET_HOSTNAME = "$NAME", TOKEN = "YES" ]
LOGO = "images/logos/ubuntu.png"
"""

CPU_WORKER = """NAME = "slurm-cpu-worker"
CPU = "4"
VCPU = "4"
MEMORY = "8192"
NIC = [ NETWORK = "slurm-net", NETWORK_UNAME = "oneadmin" ]
OS = [ ARCH = "x86_64" ]
GRAPHICS = [ LISTEN = "0.0.0.0", TYPE = "VNC" ]
CONTEXT = [ NETWORK = "YES", SET_HOSTNAME = "$NAME", TOKEN = "YES" ]
LOGO = "images/logos/ubuntu.png"
"""


def default_templates() -> tuple[TemplateSpec, ...]:
    """`slurm-gpu-worker` (id 0, one GPU) and `slurm-cpu-worker` (id 1)."""
    return (TemplateSpec(0, "slurm-gpu-worker", GPU_WORKER), TemplateSpec(1, "slurm-cpu-worker", CPU_WORKER))


@dataclass(frozen=True)
class SimConfig:
    """Everything the simulator needs to start; the defaults make a 4 x 4-GPU cloud with short phases."""

    hosts: tuple[HostSpec, ...] = field(default_factory=default_hosts)
    templates: tuple[TemplateSpec, ...] = field(default_factory=default_templates)
    network: NetworkSpec = NetworkSpec()
    images: tuple[ImageSpec, ...] = field(default_factory=default_images)
    durations: Durations = Durations()
    faults: Faults = Faults()
    seed: int = 0
    version: str = "6.10.0"
    tick_seconds: float = 0.01
    # oned.conf's ACTION_TIMEOUT (stock 300): how long the scheduler places nothing after a VM it was deploying
    # is deleted (recover --delete in LCM_INIT, PROLOG, BOOT...), as real oned 7.0.2 and 7.4.0 do; 0: never.
    action_timeout: float = 300.0
    # oned.conf's ONEGATE_ENDPOINT: set (to where the server serves PUT /vm) or not; without it oned refuses to
    # instantiate a template whose CONTEXT has TOKEN = "YES", and one.system.config shows no ONEGATE_ENDPOINT.
    onegate: bool = True
    on_running: tuple[str, ...] = ()
    on_stopped: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _validate(self, "SimConfig")


def _validate(cfg: SimConfig, where: str) -> None:
    try:
        net = ipaddress.ip_network(cfg.network.cidr, strict=False)
    except ValueError as exc:
        raise ConfigError(f"{where}: network.cidr {cfg.network.cidr!r} is not an IPv4 network: {exc}") \
            from None
    if net.version != 4 or net.num_addresses < 4:
        raise ConfigError(f"{where}: network.cidr {cfg.network.cidr!r} must be IPv4 with 4+ addresses")
    for name, value in dataclasses.asdict(cfg.durations).items():
        if value < 0:
            raise ConfigError(f"{where}: durations.{name} must be >= 0 seconds, not {value}")
    for name in ("transient_rate", "boot_failure_rate", "stuck_pending_rate"):
        rate = getattr(cfg.faults, name)
        if not 0.0 <= rate <= 1.0:
            raise ConfigError(f"{where}: faults.{name} must be between 0 and 1, not {rate}")
    bad_kinds = set(cfg.faults.transient_kinds) - set(TRANSIENT_KINDS)
    if bad_kinds or not cfg.faults.transient_kinds:
        raise ConfigError(
            f"{where}: faults.transient_kinds must be a non-empty subset of {list(TRANSIENT_KINDS)}")
    if cfg.tick_seconds <= 0:
        raise ConfigError(f"{where}: tick_seconds must be > 0")
    if cfg.action_timeout < 0:
        raise ConfigError(f"{where}: action_timeout must be >= 0 seconds")
    if not isinstance(cfg.onegate, bool):
        raise ConfigError(f"{where}: onegate must be true or false (oned.conf sets ONEGATE_ENDPOINT or not)")
    if len({h.name for h in cfg.hosts}) != len(cfg.hosts):
        raise ConfigError(f"{where}: host names must be unique")
    for host in cfg.hosts:
        if host.state not in HOST_STATES:
            raise ConfigError(f"{where}: host {host.name!r}: state must be one of {', '.join(HOST_STATES)}")
    if len({i.id for i in cfg.images}) != len(cfg.images) or any(i.id < 0 or i.uid < 0 for i in cfg.images):
        raise ConfigError(f"{where}: image ids must be unique, ids and uids not negative")
    if len({(i.name, i.uid) for i in cfg.images}) != len(cfg.images):
        raise ConfigError(f"{where}: an owner's image names must be unique (oned: NAME is already taken)")
    if len({t.id for t in cfg.templates}) != len(cfg.templates):
        raise ConfigError(f"{where}: template ids must be unique")
    for spec in cfg.templates:
        try:
            parse_template(spec.body)
        except TemplateSyntaxError as exc:
            raise ConfigError(f"{where}: template {spec.name!r}: {exc}") from None


_TOP_KEYS = {"seed", "version", "tick_seconds", "action_timeout", "onegate", "on_running", "on_stopped", "durations",
             "faults", "network", "hosts", "host", "template", "image"}
_HOSTS_KEYS = {"count", "gpus_per_host", "nics_per_host", "cpu", "memory_mb"}
_HOST_KEYS = {"name", "cpu", "memory_mb", "gpus", "nics", "pci", "state", "attributes"}
_PCI_KEYS = {"short_address", "vendor", "device", "class", "vendor_name", "device_name", "class_name",
             "numa_node", "profiles"}
_TEMPLATE_KEYS = {"id", "name", "body"}


def load_sim_config(path: str | Path) -> SimConfig:
    """Read sim.toml into a SimConfig; unknown keys and bad values raise ConfigError naming file and key."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read simulator configuration: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    where = str(path)
    _known(data, _TOP_KEYS, where, "")
    kwargs: dict[str, Any] = {}
    for key in ("seed", "version", "tick_seconds", "action_timeout", "onegate"):
        if key in data:
            kwargs[key] = data[key]
    for key in ("on_running", "on_stopped"):
        if key in data:
            kwargs[key] = _argv(data[key], where, key)
    if "durations" in data:
        kwargs["durations"] = _section(Durations, data["durations"], where, "durations")
    if "faults" in data:
        faults = dict(_table(data["faults"], where, "faults"))
        if "transient_kinds" in faults:
            faults["transient_kinds"] = tuple(faults["transient_kinds"])
        kwargs["faults"] = _section(Faults, faults, where, "faults")
    if "network" in data:
        kwargs["network"] = _section(NetworkSpec, data["network"], where, "network")
    if "hosts" in data and "host" in data:
        raise ConfigError(f"{where}: use either [hosts] (identical hosts) or [[host]] entries, not both")
    if "hosts" in data:
        table = _table(data["hosts"], where, "hosts")
        _known(table, _HOSTS_KEYS, where, "hosts.")
        pci = default_pci(int(table.get("gpus_per_host", 4)), int(table.get("nics_per_host", 1)))
        kwargs["hosts"] = tuple(
            HostSpec(name=f"gpu-host-{i + 1:02d}", cpu=int(table.get("cpu", 6400)),
                     memory_kb=int(table.get("memory_mb", 512 * 1024)) * 1024, pci=pci)
            for i in range(int(table.get("count", 4)))
        )
    if "host" in data:
        kwargs["hosts"] = tuple(_host(entry, where, i) for i, entry in enumerate(data["host"]))
    if "template" in data:
        kwargs["templates"] = tuple(_template(entry, where, i) for i, entry in enumerate(data["template"]))
    if "image" in data:
        kwargs["images"] = tuple(_section(ImageSpec, entry, where, f"image[{i}]")
                                 for i, entry in enumerate(data["image"]))
    try:
        return SimConfig(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except ConfigError as exc:  # SimConfig's own checks name the object; name the file instead
        raise ConfigError(str(exc).replace("SimConfig:", f"{where}:", 1)) from None


def _host(entry: Any, where: str, index: int) -> HostSpec:
    table = _table(entry, where, f"host[{index}]")
    _known(table, _HOST_KEYS, where, f"host[{index}].")
    if "name" not in table:
        raise ConfigError(f"{where}: host[{index}] needs a name")
    if "pci" in table:
        pci = tuple(_pci(p, where, f"host[{index}].pci[{j}]") for j, p in enumerate(table["pci"]))
    else:
        pci = default_pci(int(table.get("gpus", 4)), int(table.get("nics", 1)))
    attributes = _table(table.get("attributes", {}), where, f"host[{index}].attributes")
    for key, value in attributes.items():
        if not re.fullmatch(r"[A-Za-z][0-9A-Za-z_]*", key) or not isinstance(value, str):
            raise ConfigError(f"{where}: host[{index}].attributes.{key}: a name such as NVLINK_DOMAIN, and a string")
    return HostSpec(name=str(table["name"]), cpu=int(table.get("cpu", 6400)),
                    memory_kb=int(table.get("memory_mb", 512 * 1024)) * 1024, pci=pci,
                    state=str(table.get("state", "MONITORED")), attributes=tuple(sorted(attributes.items())))


def _pci(entry: Any, where: str, label: str) -> PciDevice:
    table = dict(_table(entry, where, label))
    _known(table, _PCI_KEYS, where, label + ".")
    if "short_address" not in table:
        raise ConfigError(f"{where}: {label} needs a short_address such as \"41:00.0\"")
    if "class" in table:
        table["klass"] = table.pop("class")
    if "profiles" in table:
        table["profiles"] = tuple(str(p) for p in table["profiles"])
    device: PciDevice = _section(PciDevice, table, where, label)
    return device


def _template(entry: Any, where: str, index: int) -> TemplateSpec:
    table = _table(entry, where, f"template[{index}]")
    _known(table, _TEMPLATE_KEYS, where, f"template[{index}].")
    missing = _TEMPLATE_KEYS - set(table)
    if missing:
        raise ConfigError(f"{where}: template[{index}] needs {', '.join(sorted(missing))}")
    return TemplateSpec(id=int(table["id"]), name=str(table["name"]), body=str(table["body"]))


def _section(cls: Any, value: Any, where: str, label: str) -> Any:
    table = _table(value, where, label)
    _known(table, {f.name for f in dataclasses.fields(cls)}, where, label + ".")
    try:
        return cls(**table)
    except TypeError as exc:
        raise ConfigError(f"{where}: [{label}]: {exc}") from None


def _table(value: Any, where: str, label: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {label} must be a table")
    return value


def _argv(value: Any, where: str, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: {key} must be a non-empty list of strings (an argument list, no shell)")
    return tuple(value)


def _known(table: dict[str, Any], allowed: set[str], where: str, prefix: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {prefix}{unknown[0]}; allowed here: {', '.join(sorted(allowed))}"
        )
