"""Usage records: one JSON line per VM event a program caused or observed (the audit file's lines).

A record names the node, the VM, its host and GPUs (PCI addresses, vGPU/MIG profile as oned assigned
them), the job ids the VM was started for, the event and its time. Never a credential, a template or a
CONTEXT: nothing here can carry the munge key or the OpenNebula session.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .model import Pci

SCHEMA = 1
# created: instantiate returned an id; resumed: an off (or held) VM was resumed (released);
# running: first seen RUNNING, with its host and GPUs; failed: the VM (or its node) could not start;
# handed_back: the node was given back to Slurm; off: powered off or undeployed (suspend_action);
# removed: terminated (seen DONE, or the removal call succeeded where no confirmation is awaited);
# stepped_out / stepped_in: the node was drained as its node set stepped out of Slurm's way, or undrained
# as it stepped back in (stepout.py); returned: reconcile returned a down~ node with no VM to service.
EVENTS = ("created", "resumed", "running", "failed", "handed_back", "off", "removed", "stepped_out", "stepped_in",
          "returned")
REASON_LENGTH = 200  # characters of a reason kept in a record (a record stays far below 4 KiB)
MOST_GPUS = 16  # PCI devices kept per record
FIELD_LENGTH = 80  # characters kept of any other text field (host, state, a GPU's address...): oned's
MOST_JOBS = 32  # answers are not trusted to be short (a 4 MB HOSTNAME once made a 4 MB record)


def _cut(text: str | None, length: int = FIELD_LENGTH) -> str | None:
    return None if text is None else text[:length]

# Failure reasons -> a small, bounded set of categories (metric label values, usage summaries).
# The reasons are the texts resume, suspend and reconcile give Slurm; first match wins.
REASON_CATEGORIES: tuple[tuple[str, str], ...] = (
    ("protected after", "protected"),  # protected mode: boot failures in a row (it quotes the last one)
    ("hypervisor process was killed", "host_failure"),  # reconcile: VM UNKNOWN or POWEROFF under a node
    ("drained for maintenance", "host_maintenance"),  # reconcile: its VM's host DISABLED or OFFLINE
    ("back in service", "host_maintenance"),  # reconcile: that drain is over
    ("no host with a free gpu", "no_capacity"),  # before 0.x: any SCHED_MESSAGE past boot_timeout
    ("no host can take the vm", "no_capacity"),  # oned cannot place it, the resource unnamed (7.0)
    ("gpu shortage", "no_capacity"),  # the cooldown after one
    ("no free ", "no_capacity"),  # pending_timeout with the host pool showing none free
    ("cooldown", "no_capacity"),
    ("all-or-nothing", "job_policy"),  # a node of a job that cannot start whole
    ("not placed within pending_timeout", "unplaced"),  # PENDING although the host pool had room
    ("not in any nodeset", "not_in_nodeset"),
    ("busy", "busy"),
    ("internal error", "internal"),
    ("failed to boot", "boot_failed"),
    ("vm failed", "boot_failed"),
    ("vanished", "vm_lost"),
    ("its vm is gone", "vm_lost"),
    ("boot_timeout", "timeout"),
    ("did not answer in time", "timeout"),
    ("still ", "timeout"),  # suspend: "VM 12 still ACTIVE/SHUTDOWN after 90s"
    ("template ", "template"),
    ("opennebula", "api_error"),
    ("hand back failed", "slurm_error"),
    ("slurmctld unreachable", "slurm_error"),
    ("node address update", "slurm_error"),  # slurmctld refused it
    ("alive while its node is powered down", "orphan_vm"),
    ("poweroff", "vm_off"),
    ("undeployed", "vm_off"),
)
CATEGORIES = (*dict.fromkeys(c for _, c in REASON_CATEGORIES), "other")


_NEEDS_GPUS = re.compile(r"needs \d+ gpus? ")  # the GPU count before instantiating: "needs 4 GPUs 10de:0302, 3 free"


def reason_category(reason: str) -> str:
    """A failure reason's category, one of CATEGORIES."""
    text = reason.lower()
    if _NEEDS_GPUS.search(text):
        return "no_capacity"
    return next((category for needle, category in REASON_CATEGORIES if needle in text), "other")


def gpu_fields(pci: Pci) -> dict[str, str]:
    """A GPU as a record holds it: only the fields oned set."""
    values = {"address": pci.address, "short_address": pci.short_address, "vendor": pci.vendor,
              "device": pci.device, "class": pci.klass, "profile": pci.profile}
    return {key: value for key, value in values.items() if value}


@dataclass(frozen=True)
class Record:
    """One usage record."""

    time: float  # seconds since the epoch (UTC)
    event: str
    node: str
    vm: int | None = None
    host: str | None = None
    gpus: tuple[Mapping[str, str], ...] = ()
    jobs: tuple[int, ...] = ()
    reason: str | None = None
    program: str = ""
    cluster: str = ""
    state: str | None = None  # the VM's state when the event was seen
    action: str | None = None  # the OpenNebula action behind the event (terminate, recover-delete, ...)
    pid: int | None = None

    @property
    def category(self) -> str | None:
        """The reason's category, when there is a reason."""
        return None if self.reason is None else reason_category(self.reason)

    def to_json(self) -> str:
        """The record as one line of JSON (no newline)."""
        data: dict[str, Any] = {
            "v": SCHEMA,
            "time": datetime.fromtimestamp(self.time, UTC).isoformat(timespec="milliseconds"),
            "event": self.event, "node": _cut(self.node), "vm": self.vm, "host": _cut(self.host),
            "gpus": [{_cut(k, 16): _cut(v) for k, v in g.items()} for g in self.gpus[:MOST_GPUS]],
            "jobs": list(self.jobs[:MOST_JOBS]),
        }
        if self.reason is not None:
            data["reason"] = self.reason[:REASON_LENGTH]
            data["category"] = reason_category(self.reason)
        for key in ("state", "action"):
            if getattr(self, key) is not None:
                data[key] = _cut(getattr(self, key))
        data.update(program=_cut(self.program), cluster=_cut(self.cluster), pid=self.pid)
        return json.dumps(data, separators=(",", ":"), ensure_ascii=True, sort_keys=False)


def parse_time(text: str) -> float:
    """An ISO 8601 time (with offset; UTC when none) -> seconds since the epoch."""
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def from_json(line: str) -> Record:
    """Parse one audit line; ValueError when it is not a record of ours. Every field is checked for its
    type and bounds: the file sits in a directory others may write, and a record of 1e400 or {} as its VM
    or host once crashed `usage` with a traceback."""
    try:
        data = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not JSON: {getattr(exc, 'msg', type(exc).__name__)}") from None
    if not isinstance(data, dict) or data.get("event") not in EVENTS or not isinstance(data.get("node"), str):
        raise ValueError("not a usage record (event and node missing)")
    try:
        gpus = data.get("gpus") or []
        if not isinstance(gpus, list) or not all(isinstance(g, dict) for g in gpus):
            raise ValueError("gpus is not a list of objects")
        jobs = data.get("jobs") or []
        if not isinstance(jobs, list):
            raise ValueError("jobs is not a list")
        return Record(
            time=parse_time(_text(data, "time", required=True)), event=data["event"], node=data["node"],
            vm=_whole(data.get("vm"), "vm"), host=_text(data, "host"),
            gpus=tuple({str(k): str(v) for k, v in g.items()} for g in gpus[:MOST_GPUS]),
            jobs=tuple(_whole(j, "a job id") for j in jobs[:MOST_JOBS]), reason=_text(data, "reason"),
            program=_text(data, "program") or "", cluster=_text(data, "cluster") or "",
            state=_text(data, "state"), action=_text(data, "action"), pid=_whole(data.get("pid"), "pid"),
        )
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ValueError(f"malformed usage record: {exc}") from None


def _whole(value: Any, what: str) -> Any:
    """A record's whole number (a VM id, a job id, a pid): a JSON integer of at most 2**63, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not -(1 << 63) <= value < 1 << 63:
        raise ValueError(f"{what} is not a whole number")
    return value


def _text(data: Mapping[str, Any], key: str, required: bool = False) -> Any:
    """A record's text field: a string (cut to its bound) or, unless required, absent."""
    value = data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{key} is not text")
    return value[:REASON_LENGTH if key == "reason" else FIELD_LENGTH]


def read_records(lines: Iterable[str]) -> tuple[list[Record], list[tuple[int, str]]]:
    """Records from audit lines, and (line number, problem) for each line that is not one."""
    records, bad = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(from_json(line))
        except ValueError as exc:
            bad.append((number, str(exc)))
    return records, bad
