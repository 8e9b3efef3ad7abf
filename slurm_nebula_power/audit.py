"""The audit file: usage records appended as JSON lines, safe with concurrent runs.

Each record is one `os.write` of one line to a file opened with O_APPEND: the kernel appends each write
whole at the end of the file, so lines of concurrent runs (and of one run's threads) never interleave on
a local filesystem. Records stay far below 4 KiB (every field is bounded). The file is created mode 0640,
for SlurmUser when root runs a program by hand; it is opened without following a link and must be a
regular file of ours (files.open_file); logrotate may move it at any time: each run opens it anew. A
record that cannot be made or written (disk full, permissions, anything) is logged once and never fails
the run: accounting must not cost a job its nodes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from .files import Owner, open_file
from .model import Vm
from .records import Record, gpu_fields

log = logging.getLogger(__name__)
MAX_LINE = 4000  # bytes; one write of a line this short is appended whole
MODE = 0o640


class AuditLog:
    """One run's recorder: writes each event to the audit file (when configured) and counts it."""

    def __init__(self, path: Path | None, program: str, cluster: str,
                 clock: Callable[[], float] = time.time, owner: Owner | None = None) -> None:
        self.path = path
        self.owner = owner  # who gets the file when this run creates it (SlurmUser, for a root run)
        self.program = program
        self.cluster = cluster
        self.clock = clock
        self.counts: Counter[tuple[str, str]] = Counter()  # (event, reason category or "") -> records
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._broken = False
        self.unmade = 0  # records that could not be made (logged once)

    def record(self, event: str, node: str, vm: Vm | None = None, vm_id: int | None = None,
               jobs: Sequence[int] = (), reason: str | None = None, action: str | None = None) -> None:
        """Record one VM event of a node (host, GPUs and job ids are taken from the VM when it is given).
        Never raises: a record that cannot be made is logged once and lost."""
        try:
            self._record(event, node, vm, vm_id, jobs, reason, action)
        except Exception:
            self.unmade += 1
            if self.unmade == 1:
                log.exception("audit_file %s: cannot make a usage record of node %s (it is lost, the run goes on)",
                              self.path, node)

    def _record(self, event: str, node: str, vm: Vm | None, vm_id: int | None, jobs: Sequence[int],
                reason: str | None, action: str | None) -> None:
        record = Record(
            time=self.clock(), event=event, node=node, vm=vm.id if vm is not None else vm_id,
            host=vm.host if vm is not None else None,
            gpus=tuple(gpu_fields(g) for g in vm.gpus if g.assigned) if vm is not None else (),
            jobs=tuple(sorted(set(jobs or (vm.job_ids if vm is not None else ())))), reason=reason,
            program=self.program, cluster=self.cluster, state=vm.state_name if vm is not None else None,
            action=action, pid=os.getpid())
        with self._lock:
            self.counts[(event, record.category or "")] += 1
            if self.path is not None:
                self._write(record)

    def _write(self, record: Record) -> None:
        line = record.to_json()
        if len(line) >= MAX_LINE:  # only pathological values from OpenNebula get here (non-ASCII is 6 bytes)
            short = {**record.__dict__, "reason": (record.reason or "")[:80] or None}
            line = Record(**{**short, "gpus": record.gpus[:4]}).to_json()
            if len(line) >= MAX_LINE:
                line = Record(**{**short, "gpus": (), "host": (record.host or "")[:40] or None}).to_json()
        data = (line + "\n").encode("ascii")
        try:
            if self._fd is None:
                if self._broken:
                    return
                assert self.path is not None
                self._fd = open_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, MODE, self.owner)
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(f"short write ({written} of {len(data)} bytes)")
        except OSError as exc:
            if not self._broken:
                log.error("audit_file %s: cannot append usage records (those of this run are lost): %s",
                          self.path, exc.strerror or exc)
            self._broken = True

    def close(self) -> None:
        """Close the file (the next run opens it again, wherever logrotate left it)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def count(self, event: str) -> int:
        """How many records of this event the run made."""
        return sum(n for (kind, _), n in self.counts.items() if kind == event)
