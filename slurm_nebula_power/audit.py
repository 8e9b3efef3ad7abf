"""The audit file: usage records appended as JSON lines, safe with concurrent runs.

Each record is one `os.write` of one line to a file opened with O_APPEND: the kernel appends each write
whole at the end of the file, so lines of concurrent runs (and of one run's threads) never interleave on
a local filesystem. Records stay far below 4 KiB (reasons and device lists are bounded). The file is
created mode 0640; logrotate may move it at any time: each run opens it anew. A write that fails (disk
full, permissions) is logged once and never fails the run: accounting must not cost a job its nodes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from .model import Vm
from .records import Record, gpu_fields

log = logging.getLogger(__name__)
MAX_LINE = 4000  # bytes; one write of a line this short is appended whole
MODE = 0o640


class AuditLog:
    """One run's recorder: writes each event to the audit file (when configured) and counts it."""

    def __init__(self, path: Path | None, program: str, cluster: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.program = program
        self.cluster = cluster
        self.clock = clock
        self.counts: Counter[tuple[str, str]] = Counter()  # (event, reason category or "") -> records
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._broken = False

    def record(self, event: str, node: str, vm: Vm | None = None, vm_id: int | None = None,
               jobs: Sequence[int] = (), reason: str | None = None, action: str | None = None) -> None:
        """Record one VM event of a node (host, GPUs and job ids are taken from the VM when it is given)."""
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
        if len(line) >= MAX_LINE:  # only a pathological reason or device list gets here
            line = Record(**{**record.__dict__, "reason": (record.reason or "")[:80] or None,
                             "gpus": record.gpus[:4]}).to_json()
        data = (line + "\n").encode("ascii")
        try:
            if self._fd is None:
                if self._broken:
                    return
                assert self.path is not None
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, MODE)
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(f"short write ({written} of {len(data)} bytes)")
        except OSError as exc:
            if not self._broken:
                log.error("audit_file %s: cannot append usage records: %s; fix its directory's permissions "
                          "(usage records of this run are lost)", self.path, exc)
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
