"""GPU-hours and VM-hours from the usage records, and where the records and OpenNebula disagree.

A VM's interval runs from its `running` record (first seen RUNNING, with host and GPUs: before that it
holds no GPU, or only for the seconds of PROLOG and BOOT) to its `removed` or `off` record; a VM resumed
later opens a new interval at its next `running`. An interval with no end yet is counted until --until
(or now) and flagged open. GPU-hours are an interval's hours times the GPUs oned assigned the VM.

Jobs: a VM is attributed to every job id its resume was given (SLURM_RESUME_FILE), whole, not split:
a VM started for jobs 7 and 8 counts in full for both, so per-job totals may add up to more than the
VMs' total (the by-nodeset, by-host and by-day views count each VM once). Jobs Slurm later ran on a node
already up never reach a ResumeProgram and are not in the records (sacct knows them).
"""

from __future__ import annotations

import gzip
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

from .errors import UsageError
from .files import Owner, UnsafeFile, open_file
from .hostlists import fold
from .model import DONE, Vm, cell, printable
from .records import Record, read_records

GROUPS = ("job", "nodeset", "host", "day", "vm")
NO_JOB = "-"  # the key of VMs started without job ids (by hand, or 22.05 without a resume file)


@dataclass
class Interval:
    """One stretch of a VM running, from the records."""

    vm: int
    node: str
    start: float
    end: float | None = None  # None: no removed/off record yet
    host: str | None = None
    gpus: tuple[Mapping[str, str], ...] = ()
    jobs: tuple[int, ...] = ()

    def clipped(self, since: float | None, until: float) -> tuple[float, float] | None:
        """The part inside [since, until], or None."""
        start = self.start if since is None else max(self.start, since)
        end = min(self.end if self.end is not None else until, until)
        return (start, end) if end > start else None


@dataclass
class Row:
    """One line of the usage table."""

    key: str
    vms: set[int] = field(default_factory=set)
    nodes: set[str] = field(default_factory=set)
    gpus: dict[str, dict[str, Any]] = field(default_factory=dict)  # "host address" -> GPU
    vm_seconds: float = 0.0
    gpu_seconds: float = 0.0
    first: float | None = None
    last: float | None = None
    open: bool = False

    def add(self, interval: Interval, start: float, end: float) -> None:
        """Count the part [start, end] of an interval."""
        seconds = end - start
        self.vms.add(interval.vm)
        self.nodes.add(interval.node)
        for gpu in interval.gpus:
            name = f"{cell(interval.host or '?')} {cell(gpu.get('address') or gpu.get('short_address') or '?')}"
            self.gpus[name] = {"vm": interval.vm, "node": interval.node, "host": interval.host, **gpu}
        self.vm_seconds += seconds
        self.gpu_seconds += seconds * len(interval.gpus)
        self.first = start if self.first is None else min(self.first, start)
        self.last = end if self.last is None else max(self.last, end)
        self.open = self.open or interval.end is None

    def as_dict(self, group: str) -> dict[str, Any]:
        """The row for --json."""
        return {group: self.key, "vms": sorted(self.vms), "nodes": sorted(self.nodes),
                "gpus": list(self.gpus.values()), "vm_seconds": round(self.vm_seconds, 3),
                "gpu_seconds": round(self.gpu_seconds, 3), "vm_hours": round(self.vm_seconds / 3600, 6),
                "gpu_hours": round(self.gpu_seconds / 3600, 6), "from": iso(self.first), "to": iso(self.last),
                "still_running": self.open}


def iso(moment: float | None) -> str | None:
    """Seconds since the epoch -> ISO 8601 UTC, to the second."""
    return None if moment is None else datetime.fromtimestamp(moment, UTC).isoformat(timespec="seconds")


# ---- reading ----------------------------------------------------------------------------------------


def audit_files(path: Path) -> list[Path]:
    """The audit file and what logrotate left beside it (name.1, name.2.gz, name-20260101[.gz]), oldest
    first."""
    rotated = re.compile(re.escape(path.name) + r"(?:\.(\d+)|-(\d{8,10}))(?:\.gz)?$")
    found = []
    if path.parent.is_dir():
        for other in path.parent.iterdir():
            match = rotated.fullmatch(other.name)
            if match:
                number, date = match.groups()
                found.append(((0, -int(number)) if number else (-1, int(date)), other))
    files = [other for _, other in sorted(found)]
    return files + ([path] if path.exists() else [])


_ID = re.compile(r"[0-9]{1,19}")  # a job or VM id as a row's key, sorted as a number
LINE_BYTES = 16 << 10  # a record is under 4 KiB; a longer line is not one, and is skipped unread
FILE_BYTES = 4 << 30  # bytes read of one file at most, after decompression (a .gz may be a bomb)


def _lines(handle: BinaryIO, problems: list[str], path: Path) -> Iterator[str]:
    """The lines of a file, streamed: a line over LINE_BYTES is a problem (and skipped), and reading
    stops at FILE_BYTES."""
    total, number = 0, 0
    while True:
        line = handle.readline(LINE_BYTES + 1)
        if not line:
            return
        number += 1
        total += len(line)
        if len(line) > LINE_BYTES and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n") and total <= FILE_BYTES:  # the rest of the long line
                line = handle.readline(1 << 20)
                total += len(line)
            problems.append(f"{path}:{number}: longer than {LINE_BYTES} bytes: not a usage record")
            yield ""
        else:
            yield line.decode("utf-8", errors="replace")
        if total > FILE_BYTES:
            problems.append(f"{path}: more than {FILE_BYTES >> 20} MiB: the rest is not read")
            return


def read_audit(paths: Sequence[Path], found: Sequence[Path] = (), owner: Owner | None = None,
               ) -> tuple[list[Record], list[str]]:
    """Every record of these files, and one line per line that is not a record (file:line: problem).
    Files are streamed (a .gz through gzip), opened without following a link, regular files only. `found`:
    files the program found itself (audit_file and the rotated copies beside it): read only when they are
    regular files of root, this user or `owner` (SlurmUser) with one link; any other is a problem line and
    skipped (another user's planted copy billed 65,417 GPU-hours; a FIFO failed the command). A path the
    operator named (--file) is read whoever owns it, and one that cannot be read is an error."""
    records: list[Record] = []
    problems: list[str] = []
    for path in [*found, *paths]:
        try:
            fd = open_file(path, os.O_RDONLY, owner=owner, any_owner=path not in found)
            with os.fdopen(fd, "rb") as raw, (gzip.open(raw) if path.suffix == ".gz" else raw) as handle:
                got, bad = read_records(_lines(handle, problems, path))  # type: ignore[arg-type]
        except UnsafeFile as exc:
            if path in found:
                why = str(exc.strerror).removesuffix(": remove it")
                problems.append(f"{path}: skipped, not a record file of ours: {why}")
                continue
            # not "remove it" (files.py's fix for a file planted where a program writes): the path may be
            # what the operator typed, /dev/null or a directory
            why = str(exc.strerror).removeprefix(f"{path} ").removesuffix(": remove it")
            raise UsageError(f"{path}: cannot read the usage records: it {why}; name the record file itself "
                             "(log.audit_file or a rotated copy of it)") from None
        except (OSError, EOFError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
            raise UsageError(f"{path}: cannot read the usage records: {why}; check the path and that you may "
                             "read it (SlurmUser or root)") from None
        records.extend(got)
        problems.extend(f"{path}:{number}: {problem}" for number, problem in bad)
    records.sort(key=lambda r: r.time)
    return records, problems


# ---- intervals ----------------------------------------------------------------------------------------


def intervals(records: Iterable[Record]) -> list[Interval]:
    """Every VM's running intervals, in order of start."""
    by_vm: dict[int, list[Record]] = {}
    for record in records:
        if record.vm is not None:
            by_vm.setdefault(record.vm, []).append(record)
    out: list[Interval] = []
    for vm_id, events in by_vm.items():
        jobs: set[int] = set()
        current: Interval | None = None
        for record in sorted(events, key=lambda r: r.time):
            if record.event in ("created", "resumed"):
                if current is None:
                    jobs = set(record.jobs) if record.event == "resumed" else jobs | set(record.jobs)
            elif record.event == "running":
                if current is None:
                    current = Interval(vm_id, record.node, record.time, host=record.host, gpus=record.gpus,
                                       jobs=tuple(sorted(jobs | set(record.jobs))))
                else:  # seen running again by a later resume: the same stretch
                    current.jobs = tuple(sorted(set(current.jobs) | set(record.jobs)))
            elif record.event in ("removed", "off") and current is not None:
                current.end = record.time
                out.append(current)
                current, jobs = None, set()
        if current is not None:
            out.append(current)
    return sorted(out, key=lambda i: (i.start, i.vm))


def _days(start: float, end: float) -> Iterable[tuple[str, float, float]]:
    """Split [start, end] at UTC midnights."""
    moment = datetime.fromtimestamp(start, UTC)
    while start < end:
        midnight = (moment + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
        stop = min(end, midnight.timestamp())
        yield moment.date().isoformat(), start, stop
        start, moment = stop, midnight


def summarize(found: Sequence[Interval], group: str, since: float | None, until: float,
              nodeset_of: Callable[[str], str]) -> list[Row]:
    """Rows of the usage table grouped by job, nodeset, host, day or vm, over [since, until]."""
    rows: dict[str, Row] = {}

    def row(key: str) -> Row:
        return rows.setdefault(key, Row(key))

    for interval in found:
        part = interval.clipped(since, until)
        if part is None:
            continue
        start, end = part
        if group == "job":
            for job in interval.jobs or (NO_JOB,):
                row(str(job)).add(interval, start, end)
        elif group == "nodeset":
            row(nodeset_of(interval.node)).add(interval, start, end)
        elif group == "host":
            row(interval.host or "?").add(interval, start, end)
        elif group == "day":
            for day, day_start, day_end in _days(start, end):
                row(day).add(interval, day_start, day_end)
        else:
            row(str(interval.vm)).add(interval, start, end)

    def order(item: Row) -> tuple[int, int, str]:
        # ASCII digits only: a host named "²" is a digit to str.isdigit() and not to int()
        return (0, int(item.key), "") if _ID.fullmatch(item.key) else (1, 0, item.key)

    return sorted(rows.values(), key=order)


# ---- the records against OpenNebula ---------------------------------------------------------------------


def disagreements(records: Sequence[Record], live: Sequence[Vm], cluster: str, until: float) -> list[str]:
    """Where the records and OpenNebula's live VMs of ours disagree, one sentence each."""
    last: dict[int, Record] = {}
    for record in records:
        if record.vm is not None:
            last[record.vm] = record
    ours = {vm.id: vm for vm in live if vm.state != DONE and vm.is_ours(cluster, vm.name)}
    found = []
    for vm_id, vm in sorted(ours.items()):
        latest = last.get(vm_id)
        if latest is None:
            found.append(f"VM {vm_id} ({vm.name}) is live in OpenNebula ({vm.state_name}) but no usage record "
                         "names it: its usage is not counted")
        elif latest.event == "removed":
            found.append(f"VM {vm_id} ({vm.name}): the records say removed at {iso(latest.time)}, but "
                         f"OpenNebula still has it {vm.state_name}: its usage after that is not counted")
        elif latest.event == "failed":
            found.append(f"VM {vm_id} ({vm.name}): the records say it failed at {iso(latest.time)} and was not "
                         f"removed, and OpenNebula has it {vm.state_name}: reconcile removes it")
        elif latest.event == "off" and vm.running:
            found.append(f"VM {vm_id} ({vm.name}): the records say off at {iso(latest.time)}, but OpenNebula "
                         f"has it {vm.state_name}: its usage after that is not counted")
    for interval in intervals(records):
        if interval.end is None and interval.vm not in ours:
            found.append(f"VM {interval.vm} ({interval.node}): the records say running since "
                         f"{iso(interval.start)} and never removed, but OpenNebula has no live VM "
                         f"{interval.vm}: counted until {iso(until)}, an overestimate")
    return found


# ---- output --------------------------------------------------------------------------------------------

HEADERS = {"job": "JOB", "nodeset": "NODESET", "host": "HOST", "day": "DAY (UTC)", "vm": "VM"}


def _short(moment: float | None) -> str:
    return "-" if moment is None else datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _duration(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m{whole % 60:02d}s"


def table_lines(rows: Sequence[Row], group: str) -> list[list[str]]:
    """Header and cells of the table (and of --csv)."""
    lines = [[HEADERS[group], "VMS", "NODES", "GPUS", "VM-TIME", "VM-HOURS", "GPU-HOURS", "FROM (UTC)", "TO",
              "NOTE"]]
    for row in rows:
        lines.append([cell(row.key), ",".join(str(v) for v in sorted(row.vms)), printable(fold(sorted(row.nodes))),
                      ", ".join(sorted(row.gpus)) or "-", _duration(row.vm_seconds), f"{row.vm_seconds / 3600:.4f}",
                      f"{row.gpu_seconds / 3600:.4f}", _short(row.first), _short(row.last),
                      "still running" if row.open else ""])
    return lines


def render(rows: Sequence[Row], group: str) -> str:
    """The aligned table."""
    lines = table_lines(rows, group)
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


def parse_when(text: str, now: float) -> float:
    """--since/--until: an ISO date or time (UTC unless an offset is given), or an age such as 7d, 12h, 30m."""
    age = re.fullmatch(r"(\d+(?:\.\d+)?)([dhms])", text.strip())
    if age:
        return now - float(age.group(1)) * {"d": 86400, "h": 3600, "m": 60, "s": 1}[age.group(2)]
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(f"{text!r} is not a time: give an ISO date or time (2026-12-01, 2026-12-01T08:00, "
                         "2026-12-01T08:00+01:00) or an age (7d, 12h, 30m)") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()
