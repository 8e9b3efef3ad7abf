"""The shortage cooldown's state, kept across resume processes: one small JSON file per node set in
[power] lock_dir (`shortage-<hash of the node set's nodes>.json`), replaced atomically (write a temporary
file beside it, then rename), read at the start of each resume. A missing, unreadable or malformed file
is no cooldown: the state only ever saves API calls, so losing it is safe. lock_dir may be shared by two
controllers: a state file is read without following a link, only as a regular file of ours, and with a
size cap, and a root run writes it for SlurmUser (files.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

from .admission import Shortage
from .files import PRIVATE_DIRECTORY, Owner, flocked, make_directory, read_capped, replace

if TYPE_CHECKING:
    from .config import Config

log = logging.getLogger(__name__)

MOST_BYTES = 64 << 10  # a state file's size at most (ours are a few hundred bytes)
T = TypeVar("T")


def _state_key(cluster: str, nodes: str) -> str:
    """The name part of a node set's state and lock files: a hash of its cluster and nodes (a hostlist can be
    long; two configurations sharing a lock_dir must not share a node set's state)."""
    return hashlib.sha256(f"{cluster}\n{nodes}".encode()).hexdigest()[:16]


class NodeSetFiles(Generic[T]):
    """One small JSON state file per node set and cluster in a directory (lock_dir), `<KIND>-<_state_key>.json`,
    read without following a link, as a regular file of ours, with a size cap; a subclass parses it."""

    KIND = "state"
    WHAT = "state"  # for the log: "shortage state", "protected-mode state"

    def __init__(self, directory: Path, clock: Callable[[], float] = time.time, owner: Owner | None = None,
                 cluster: str = "") -> None:
        self.directory = directory
        self.clock = clock
        self.owner = owner  # who gets the files a root run writes (SlurmUser)
        self.cluster = cluster  # [slurm] cluster: part of every file's name

    @classmethod
    def of(cls, config: Config, owner: Owner | None = None, clock: Callable[[], float] = time.time) -> Self:
        """The state of this configuration's node sets: in its lock_dir, keyed by its cluster."""
        return cls(config.power.lock_dir, clock, owner, config.slurm.cluster)

    def path(self, nodes: str) -> Path:
        """The state file of a node set."""
        return self.directory / f"{self.KIND}-{_state_key(self.cluster, nodes)}.json"

    def locked(self, nodes: str, wait: float) -> contextlib.AbstractContextManager[None]:
        """An flock of the node set's own (`<KIND>-<key>.lock` beside its state file, 0600 SlurmUser's), held by
        whoever changes the state: TimeoutError past `wait` seconds, OSError when it cannot be made."""
        make_directory(self.directory, self.owner, PRIVATE_DIRECTORY)  # a root run makes it for SlurmUser
        return flocked(self.path(nodes).with_suffix(".lock"), wait, self.owner)

    def read(self, nodes: str) -> T | None:
        """The node set's state, or None (none, or the file is unusable: logged, never quoted)."""
        path = self.path(nodes)
        try:
            raw = read_capped(path, MOST_BYTES, self.owner)
            if raw is None:
                return None
            data: Any = json.loads(raw)
            if not isinstance(data, dict) or data.get("nodes") != nodes or data.get("cluster", "") != self.cluster:
                return None
            return self.parse(nodes, data)
        except OSError as exc:
            log.warning("ignoring unreadable %s %s: %s", self.WHAT, path, exc.strerror or exc)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            log.warning("ignoring malformed %s %s (%s)", self.WHAT, path, type(exc).__name__)
        return None

    def parse(self, nodes: str, data: dict[str, Any]) -> T:
        """The state in a file's JSON object (ValueError, TypeError, KeyError when it is not one)."""
        raise NotImplementedError


class ShortageLog(NodeSetFiles[Shortage]):
    """Where resume records shortages and reads them back, per node set."""

    KIND, WHAT = "shortage", "shortage state"

    def parse(self, nodes: str, data: dict[str, Any]) -> Shortage:
        """A shortage from its file."""
        free = data.get("free")
        return Shortage(nodes=nodes, at=float(data["at"]), kind=str(data["kind"]),
                        free=None if free is None else int(free), reason=str(data.get("reason", ""))[:200],
                        requests=tuple({str(k): str(v) for k, v in r.items()} for r in data.get("requests", [])),
                        wanted=max(0, int(data.get("wanted", 0))))

    def record(self, nodes: str, kind: str, free: int | None, reason: str,
               requests: Sequence[Mapping[str, str]], wanted: int = 0) -> Shortage:
        """Write a node set's shortage (atomically); errors are logged, never raised."""
        shortage = Shortage(nodes, self.clock(), kind, free, reason, tuple(requests), wanted)
        body = {"nodes": nodes, "cluster": self.cluster, "at": shortage.at, "kind": kind, "free": free,
                "reason": reason, "requests": [dict(r) for r in requests], "wanted": wanted}
        path = self.path(nodes)
        try:
            make_directory(self.directory, self.owner, PRIVATE_DIRECTORY)
            replace(path, json.dumps(body).encode(), 0o640, self.owner)
        except OSError as exc:
            log.error("could not record the shortage of %s in %s: %s", nodes, path, exc)
        return shortage

    def clear(self, nodes: str) -> None:
        """Forget a node set's shortage (capacity came back)."""
        try:
            self.path(nodes).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove %s: %s", self.path(nodes), exc)
