"""Per-node locks that survive a crash: flock(2) on one file per node, released by the kernel at exit."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

from .backoff import Backoff
from .errors import ConfigError


class NodeLocks:
    """Hold the locks of a set of nodes; nodes whose lock stays busy past the wait are reported, not held.

    A lock is an flock on <lock_dir>/<node>.lock.  A process that dies (even by SIGKILL) loses its
    flocks at once, so no stale lock ever blocks a later run.  Locks are taken in node-name order.
    """

    def __init__(self, lock_dir: Path, nodes: Iterable[str], wait: float,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.lock_dir = lock_dir
        self.nodes = sorted(set(nodes))
        self.wait = wait
        self.clock = clock
        self.sleep = sleep
        self.held: list[str] = []
        self.busy: list[str] = []
        self._fds: list[int] = []

    def __enter__(self) -> NodeLocks:
        try:
            self.lock_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"power.lock_dir: cannot create {self.lock_dir}: {exc.strerror}; "
                              "create it writable by SlurmUser or set lock_dir") from None
        pending = list(self.nodes)
        deadline = self.clock() + self.wait
        delay = Backoff(0.02, 0.5)
        while True:
            # In name order, stopping at the first busy node: a run waits only while holding locks that
            # sort before the one it waits for, so two runs never wait for each other (taking every free
            # lock at once let overlapping resumes each hold a node the other waited for, until the wait).
            while pending and self._try(pending[0]):
                pending.pop(0)
            if not pending or self.clock() >= deadline:
                break
            self.sleep(delay.next())
        # Done waiting: take whatever else is free now and leave the busy rest.
        self.busy = [node for node in pending if not self._try(node)]
        return self

    def _try(self, node: str) -> bool:
        path = self.lock_dir / f"{node}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(f"power.lock_dir: cannot open {path}: {exc.strerror}; make {self.lock_dir} "
                              "writable by SlurmUser") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fds.append(fd)
        self.held.append(node)
        return True

    def release(self) -> None:
        """Release every lock held."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
