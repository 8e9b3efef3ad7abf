"""TOML configuration -> frozen, validated dataclasses; every error names the file, the key and the fix."""

from __future__ import annotations

import os
import re
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from . import hostlists
from .errors import ConfigError, HostlistError
from .schema import Key, Reader, absolute, ca_bundle, one_of, positive
from .slurmconf import read_slurm_conf

ENV_CONFIG = "SLURM_NEBULA_POWER_CONFIG"
CONFIG_NAME = "nebula-power.toml"
SYSTEM_CONFIG = Path("/etc/slurm") / CONFIG_NAME
SUSPEND_ACTIONS = ("terminate", "undeploy", "poweroff")
WAIT_FOR = ("running", "ready")
LOG_LEVELS = ("debug", "info", "warning", "error")
JOB_POLICIES = ("all-or-nothing", "best-effort")
# Who places a node set's VMs: oned's scheduler, or resume itself (instantiate on hold, deploy with enforce),
# which needs the deploy right a stock user lacks (docs/installation.md), hence not the default.
PLACEMENTS = ("scheduler", "direct")
# Seconds a node set is not started again after a GPU shortage (the requeued jobs' resumes within it are
# handed back after one host pool read), on every Slurm release.
SHORTAGE_COOLDOWN = 60
# VMs at most waiting for oned to place them: resume's waves (pacing.py).  A burst of hundreds stalls
# oned 7.0.2's and 7.4.0's scheduler (bench/README.md, "Real oned").
MAX_PENDING = 30
# API calls in flight at once.  oned serves MAX_CONN (stock 15) XML-RPC connections at once and keeps each
# alive: with more threads than that, calls waited for a kept-alive connection to idle out and timed out
# (oned 7.0.2, bench/README.md "Real oned").  12 leaves room for the poll and other clients.
MAX_PARALLEL = 12
# Boot failures in a row (VMs that failed, were never RUNNING or never READY) after which a node set is
# protected: resume creates none of its VMs and hands its nodes back at once.  3: with the default
# recreate_attempts (1) one node's resume fails 2 VMs, so a template that boots nothing costs 3 VMs (one
# and a half resumes) where a flaky boot (a VM in ten) almost never gets there (docs/behaviour.md).
PROTECT_AFTER = 3
# Seconds protected mode lasts without an operator; then one more failure protects the node set again.
PROTECT_FOR = 1800


@dataclass(frozen=True)
class OneConfig:
    """How to reach OpenNebula."""

    endpoint: str
    auth_file: Path
    session: str = field(repr=False)
    timeout: float = 30.0
    max_parallel: int = MAX_PARALLEL
    max_pending: int = MAX_PENDING
    retry_seconds: float = 60.0
    retry_backoff: float = 0.2
    https_verify: bool = True
    ca_file: Path | None = None  # the CAs trusted for an https:// endpoint, instead of the system's and certifi's
    max_answer_mb: float = 128.0
    domain_attribute: str | None = None  # the host TEMPLATE attribute naming a host's domain (NVLINK_DOMAIN)

    @property
    def user(self) -> str:
        """The OpenNebula user name (never the secret)."""
        return self.session.split(":", 1)[0]


@dataclass(frozen=True)
class SlurmConfig:
    """How to reach Slurm."""

    cluster: str
    scontrol: Path | None = None
    slurm_conf: Path | None = None
    prolog_chain: Path | None = None


@dataclass(frozen=True)
class LogConfig:
    """Where the programs log."""

    file: Path | None = None
    level: str = "info"
    audit_file: Path | None = None  # usage records, one JSON line per VM event
    metrics_file: Path | None = None  # Prometheus text file (node_exporter's textfile collector)


@dataclass(frozen=True)
class PowerConfig:
    """Behaviour of the power-saving programs."""

    detach: bool = False
    lock_dir: Path = Path("/var/lib/slurm/nebula-power/locks")
    suspend_timeout: float = 90.0
    recreate_attempts: int = 1
    poll_max: float = 2.0
    reconcile_grace: float = 300.0
    shortage_cooldown: int = SHORTAGE_COOLDOWN
    protect_after: int = PROTECT_AFTER  # 0: never protected
    protect_for: float = float(PROTECT_FOR)
    return_any_down: bool = False  # reconcile returns down~ nodes whatever their Reason (default: ours only)


@dataclass(frozen=True)
class NodeSet:
    """A group of nodes built from one VM template."""

    nodes_expr: str
    nodes: tuple[str, ...]
    template: str | int
    suspend_action: str = "terminate"
    boot_timeout: float = 600.0
    wait_for: str = "running"
    options: Mapping[str, Any] = field(default_factory=dict)
    pending_timeout: float = 60.0  # a VM PENDING with a SCHED_MESSAGE this long cannot be placed
    job_policy: str | None = None  # None: all-or-nothing when the template has GPUs, else best-effort
    placement: str = "scheduler"  # PLACEMENTS
    domain: str | None = None  # its VMs run only on hosts whose [opennebula] domain_attribute has this value


@dataclass(frozen=True)
class Config:
    """The whole configuration, loaded once."""

    path: Path
    opennebula: OneConfig
    slurm: SlurmConfig
    log: LogConfig
    power: PowerConfig
    nodesets: tuple[NodeSet, ...]

    def nodeset_for(self, node: str) -> NodeSet | None:
        """The node set a node belongs to, or None (one dict look-up: 20,000 nodes of a 65,536-node set)."""
        return self._by_node.get(node)

    @cached_property
    def _by_node(self) -> dict[str, NodeSet]:
        return {node: nodeset for nodeset in self.nodesets for node in nodeset.nodes}

    @property
    def all_nodes(self) -> list[str]:
        """Every configured node, in node-set order."""
        return [node for nodeset in self.nodesets for node in nodeset.nodes]


# ---- locating the file ---------------------------------------------------------------------------


def find_config(explicit: str | None, environ: Mapping[str, str]) -> Path:
    """Locate the configuration: --config, $SLURM_NEBULA_POWER_CONFIG, beside $SLURM_CONF, /etc/slurm."""
    if explicit:
        return Path(explicit)
    if environ.get(ENV_CONFIG):
        return Path(environ[ENV_CONFIG])
    if environ.get("SLURM_CONF"):
        beside = Path(environ["SLURM_CONF"]).parent / CONFIG_NAME
        if beside.exists():
            return beside
    if SYSTEM_CONFIG.exists():
        return SYSTEM_CONFIG
    raise ConfigError(
        f"no configuration found: pass --config PATH, set {ENV_CONFIG}, or create {CONFIG_NAME} "
        f"beside slurm.conf or at {SYSTEM_CONFIG} (see `slurm-nebula-power example-config`)"
    )


# ---- schema (the keys; schema.py reads a table against them) -------------------------------------


def _http(value: Any) -> str | None:
    if value.startswith(("http://", "https://")):
        return None
    return "must be an http:// or https:// XML-RPC URL such as http://frontend:2633/RPC2 (pyone's gRPC is unusable)"


_ATTRIBUTE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_DOMAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def _attribute(value: Any) -> str | None:
    return None if _ATTRIBUTE.fullmatch(value) else "must be a host template attribute name such as NVLINK_DOMAIN"


def _domain(value: Any) -> str | None:
    if _DOMAIN.fullmatch(value):
        return None
    return "must be a plain value (letters, digits, . _ -, at most 63) such as nvl72-a"


def _not_negative(value: Any) -> str | None:
    return None if value >= 0 else "must be 0 (never) or more"


def _prom(value: Any) -> str | None:
    return None if value.endswith(".prom") else "must end in .prom (node_exporter's textfile collector reads *.prom)"


NUMBER = (int, float)
SCHEMA: dict[str, dict[str, Key]] = {
    "opennebula": {
        "endpoint": Key((str,), check=_http),
        "auth_file": Key((str,)),
        "timeout": Key(NUMBER, 30.0, positive),
        "max_parallel": Key((int,), MAX_PARALLEL, positive),
        "max_pending": Key((int,), MAX_PENDING, positive),
        "retry_seconds": Key(NUMBER, 60.0, positive),
        "retry_backoff": Key(NUMBER, 0.2, positive),
        "https_verify": Key((bool,), True),
        "ca_file": Key((str,), None),
        # A 10,000-VM pool answer of full VM bodies is ~60 MB (about 6 KB a VM, escaped in XML-RPC).
        "max_answer_mb": Key(NUMBER, 128.0, positive),
        "domain_attribute": Key((str,), None, _attribute),
    },
    "slurm": {
        "cluster": Key((str,), None),
        "scontrol": Key((str,), None, absolute),
        "slurm_conf": Key((str,), None),
        "prolog_chain": Key((str,), None, absolute),
    },
    "log": {
        "file": Key((str,), None),
        "level": Key((str,), "info", one_of(LOG_LEVELS)),
        "audit_file": Key((str,), None),
        "metrics_file": Key((str,), None, _prom),
    },
    "power": {
        "detach": Key((bool,), False),
        "lock_dir": Key((str,), str(PowerConfig.lock_dir)),
        "suspend_timeout": Key(NUMBER, 90.0, positive),
        "recreate_attempts": Key((int,), 1),
        "poll_max": Key(NUMBER, 2.0, positive),
        "reconcile_grace": Key(NUMBER, 300.0),
        "shortage_cooldown": Key((int,), SHORTAGE_COOLDOWN, positive),
        "protect_after": Key((int,), PROTECT_AFTER, _not_negative),
        "protect_for": Key(NUMBER, float(PROTECT_FOR), positive),
        "return_any_down": Key((bool,), False),
    },
    "nodeset": {
        "nodes": Key((str,)),
        "template": Key((str, int)),
        "suspend_action": Key((str,), "terminate", one_of(SUSPEND_ACTIONS)),
        "boot_timeout": Key(NUMBER, 600.0, positive),
        "wait_for": Key((str,), "running", one_of(WAIT_FOR)),
        "pending_timeout": Key(NUMBER, 60.0, positive),
        "job_policy": Key((str,), None, one_of(JOB_POLICIES)),
        "placement": Key((str,), "scheduler", one_of(PLACEMENTS)),
        "domain": Key((str,), None, _domain),
    },
}
# Keys a node set may carry for `slurm-nebula-power template` and `slurm-conf`; validated by those commands.
# `template` needs vcpu, memory_mb, network, controller and munge_key_file; the GPU keys default to one
# NVIDIA GPU (10de, class 0302) once any of them is given; ib_network is needed with ib_vendor/ib_device.
NODESET_OPTIONS: dict[str, Key] = {
    "cpu": Key(NUMBER, None, positive),
    "vcpu": Key((int,), None, positive),
    "memory_mb": Key((int,), None, positive),
    "gpus": Key((int,), None),
    "gpu_vendor": Key((str,), None),
    "gpu_class": Key((str,), None),
    "gpu_device": Key((str,), None),
    "gpu_profile": Key((str,), None),
    "gpu_type": Key((str,), None),
    "ib_vendor": Key((str,), None),
    "ib_device": Key((str,), None),
    "ib_network": Key((str,), None),  # the virtual network of the InfiniBand SR-IOV NIC (PCI TYPE=NIC)
    "network": Key((str,), None),
    "image": Key((str,), None),
    "features": Key((str,), None),
    "partition": Key((str,), None),
    "controller": Key((str,), None),
    "munge_key_file": Key((str,), None),
}


def _relative_to(base: Path, value: str) -> Path:
    path = Path(value)
    return path if path.is_absolute() else base / path


def read_session(path: Path, config_path: Path) -> str:
    """Read the one-line OpenNebula credentials file, refusing one readable by group or others."""
    key = f"{config_path}: opennebula.auth_file"
    try:
        info = path.stat()
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror}; create it with one line user:password "
                          "readable by SlurmUser") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{key}: {path} is accessible by group or others (mode {stat.S_IMODE(info.st_mode):04o})",
                          f"chmod 600 {path} and chown it to SlurmUser")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) != 1 or ":" not in lines[0] or lines[0].startswith(":") or lines[0].endswith(":"):
        raise ConfigError(f"{key}: {path} must hold exactly one line user:password or user:token")
    return lines[0]


def cluster_from_slurm_conf(path: Path) -> str | None:
    """ClusterName from slurm.conf (Include files too), or None when the file or key is missing."""
    try:
        return read_slurm_conf(path).params.get("clustername") or None
    except ConfigError:
        return None


def load_config(path: Path, environ: Mapping[str, str] | None = None) -> Config:
    """Load and validate a configuration file."""
    env = os.environ if environ is None else environ
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such configuration file; create it: slurm-nebula-power example-config "
                          f"> {path}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}; make it readable by SlurmUser") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}; fix the syntax") from None
    reader = Reader(path)
    base = path.parent
    for section in data:
        if section not in SCHEMA:
            raise reader.fail(section, "unknown section; known: " + ", ".join(f"[{s}]" for s in SCHEMA))
    for required in ("opennebula", "nodeset"):
        if required not in data:
            raise reader.fail(f"[{required}]", "missing section; add it (see `slurm-nebula-power example-config`)")
    one = reader.table(data["opennebula"], "opennebula", SCHEMA["opennebula"])
    auth_file = _relative_to(base, one.pop("auth_file"))
    if one["ca_file"] is not None:  # relative to this file, as auth_file
        one["ca_file"] = ca_bundle(reader, _relative_to(base, one["ca_file"]), one["https_verify"])
    opennebula = OneConfig(auth_file=auth_file, session=read_session(auth_file, path), **one)

    slurm = reader.table(data.get("slurm", {}), "slurm", SCHEMA["slurm"])
    slurm_conf = _relative_to(base, slurm["slurm_conf"]) if slurm["slurm_conf"] else (
        Path(env["SLURM_CONF"]) if env.get("SLURM_CONF") else Path("/etc/slurm/slurm.conf"))
    cluster = slurm["cluster"] or cluster_from_slurm_conf(slurm_conf)
    if not cluster:
        raise reader.fail("slurm.cluster", f"not set and no ClusterName in {slurm_conf}; set cluster = "
                          "\"<ClusterName from slurm.conf>\"")
    try:
        hostlists.validate_name(cluster)
    except HostlistError:
        raise reader.fail("slurm.cluster", f"{cluster!r} is not a plain name (letters, digits, . _ -)") from None

    log = reader.table(data.get("log", {}), "log", SCHEMA["log"])
    power = reader.table(data.get("power", {}), "power", SCHEMA["power"])
    power["lock_dir"] = _relative_to(base, power["lock_dir"])

    raw_sets = data["nodeset"]
    if not isinstance(raw_sets, list) or not raw_sets:
        raise reader.fail("nodeset", "add at least one [[nodeset]] table with nodes and template")
    nodesets = tuple(_nodeset(reader, index, raw) for index, raw in enumerate(raw_sets))
    for index, nodeset in enumerate(nodesets):
        if nodeset.domain is not None and opennebula.domain_attribute is None:
            raise reader.fail(f"nodeset[{index}].domain", "needs the host attribute that names domains: set "
                              "[opennebula] domain_attribute (e.g. \"NVLINK_DOMAIN\", as `onehost update` wrote it)")
    seen: dict[str, str] = {}
    for nodeset in nodesets:
        for node in nodeset.nodes:
            if node in seen:
                raise reader.fail("nodeset.nodes", f"node {node} is in both {seen[node]!r} and "
                                  f"{nodeset.nodes_expr!r}; node sets must not overlap")
            seen[node] = nodeset.nodes_expr

    return Config(
        path=path,
        opennebula=opennebula,
        slurm=SlurmConfig(
            cluster=cluster,
            scontrol=Path(slurm["scontrol"]) if slurm["scontrol"] else None,
            slurm_conf=slurm_conf,
            prolog_chain=Path(slurm["prolog_chain"]) if slurm["prolog_chain"] else None,
        ),
        log=LogConfig(file=_relative_to(base, log["file"]) if log["file"] else None, level=log["level"],
                      audit_file=_relative_to(base, log["audit_file"]) if log["audit_file"] else None,
                      metrics_file=_relative_to(base, log["metrics_file"]) if log["metrics_file"] else None),
        power=PowerConfig(**power),
        nodesets=nodesets,
    )


def _nodeset(reader: Reader, index: int, raw: Any) -> NodeSet:
    name = f"nodeset[{index}]"
    values = reader.table(raw, name, SCHEMA["nodeset"], NODESET_OPTIONS)
    try:
        nodes = tuple(hostlists.expand(values["nodes"]))
    except HostlistError as exc:
        raise reader.fail(f"{name}.nodes", f"{exc}") from None
    template = values["template"]
    if isinstance(template, str) and not template.strip():
        raise reader.fail(f"{name}.template", "empty; give the VM template's name or numeric id")
    options = {k: v for k, v in values.items() if k in NODESET_OPTIONS and v is not None}
    return NodeSet(nodes_expr=values["nodes"], nodes=nodes, template=template, options=options,
                   **{key: values[key] for key in ("suspend_action", "boot_timeout", "wait_for", "pending_timeout",
                                                   "job_policy", "placement", "domain")})
