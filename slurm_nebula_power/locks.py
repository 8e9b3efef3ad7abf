"""Per-node locks that survive a crash: flock(2) on one file per node, released by the kernel at exit."""

from __future__ import annotations

import fcntl
import os
import resource
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

from .backoff import Backoff
from .errors import ConfigError
from .files import LOCK_MODE, PRIVATE_DIRECTORY, UnsafeFile, make_directory, open_file, private_lock

SPARE_FDS = 256  # descriptors kept free beyond one per lock: sockets of the thread pool, logs, scontrol


class NodeLocks:
    """Hold the locks of a set of nodes; nodes whose lock stays busy past the wait are reported, not held.

    A lock is an flock on <lock_dir>/<node>.lock, opened read-only and never through a symlink.  A process
    that dies (even by SIGKILL) loses its flocks at once, so no stale lock ever blocks a later run.  Locks
    are taken in node-name order.  `owner` (uid, gid): who gets a lock directory this run creates (root
    running a command by hand creates it for SlurmUser).  A node whose lock file cannot be opened is in
    `unavailable` with the reason.
    """

    def __init__(self, lock_dir: Path, nodes: Iterable[str], wait: float,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 owner: tuple[int, int] | None = None) -> None:
        self.lock_dir = lock_dir
        self.nodes = sorted(set(nodes))
        self.wait = wait
        self.clock = clock
        self.sleep = sleep
        self.owner = owner
        self.held: list[str] = []
        self.busy: list[str] = []
        self.unavailable: dict[str, str] = {}
        self._fds: list[int] = []
        self._dir_fd = -1

    def __enter__(self) -> NodeLocks:
        self._open_dir()
        room = _room_for(len(self.nodes))
        if room < len(self.nodes):
            # Beyond the hard limit of open files: lock what fits and leave the API its descriptors; the
            # rest are handed back (a 5,000-node suspend under `ulimit -Hn 1024` once took every descriptor
            # for locks and then reached OpenNebula for none).
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            for node in self.nodes[room:]:
                self.unavailable[node] = (f"no descriptor left for its lock: the hard limit of open files "
                                          f"({limit}) fits {room} of this run's {len(self.nodes)} nodes; raise "
                                          "LimitNOFILE of slurmctld")
        pending = self.nodes[:room]
        deadline = self.clock() + self.wait
        delay = Backoff(0.02, 0.5)
        while True:
            # In name order, stopping at the first busy node: a run waits only while holding locks that
            # sort before the one it waits for, so two runs never wait for each other (taking every free
            # lock at once let overlapping resumes each hold a node the other waited for, until the wait).
            while pending and self._try(pending[0]) is not False:
                pending.pop(0)
            if not pending or self.clock() >= deadline:
                break
            self.sleep(delay.next())
        # Done waiting: take whatever else is free now and leave the busy rest.
        self.busy = [node for node in pending if self._try(node) is False]
        return self

    def _open_dir(self) -> None:
        try:
            make_directory(self.lock_dir, self.owner, PRIVATE_DIRECTORY)
            self._dir_fd = os.open(self.lock_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(f"power.lock_dir: cannot create {self.lock_dir}: {exc.strerror}; "
                              "create it writable by SlurmUser or set lock_dir") from None

    def _try(self, node: str) -> bool | None:
        """True: held now; False: busy; None: unavailable (why in self.unavailable)."""
        name = f"{node}.lock"
        path = self.lock_dir / name
        try:
            # Without following a link, non-blocking (a FIFO would hang the open), a regular file of ours
            # with one link; made for SlurmUser when root runs this.
            fd = open_file(name, os.O_RDONLY | os.O_CREAT, LOCK_MODE, self.owner, dir_fd=self._dir_fd,
                           exact_mode=True, shown=path)
        except OSError as exc:
            self.unavailable[node] = f"cannot open {path}: {exc.strerror}" if not isinstance(exc, UnsafeFile) \
                else str(exc.strerror)
            return None
        try:
            private_lock(fd, self.owner)  # 0644 or root's, left by an older version
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError as exc:
            os.close(fd)
            self.unavailable[node] = f"cannot lock {self.lock_dir / name}: {exc.strerror}"
            return None
        self._fds.append(fd)
        self.held.append(node)
        return True

    def release(self) -> None:
        """Release every lock held."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def _open_now() -> int:
    """How many descriptors this process has open."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself holds
    except OSError:
        return 64  # no /proc: a generous guess


def _room_for(locks: int) -> int:
    """Raise the soft limit of open files so one run can hold `locks` locks (5,000 nodes under the usual
    `ulimit -n 1024`), up to the hard limit; how many locks fit, keeping SPARE_FDS free for the API's
    sockets, the logs and scontrol."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = locks + SPARE_FDS + _open_now()
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft == resource.RLIM_INFINITY:
        return locks
    return max(0, min(locks, soft - SPARE_FDS - _open_now()))
