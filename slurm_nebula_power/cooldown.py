"""The shortage cooldown's state, kept across resume processes: one small JSON file per node set in
[power] lock_dir (`shortage-<hash of the node set's nodes>.json`), replaced atomically (write a temporary
file beside it, then rename), read at the start of each resume. A missing, unreadable or malformed file
is no cooldown: the state only ever saves API calls, so losing it is safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .admission import Shortage

log = logging.getLogger(__name__)


class ShortageLog:
    """Where resume records shortages and reads them back, per node set."""

    def __init__(self, directory: Path, clock: Callable[[], float] = time.time) -> None:
        self.directory = directory
        self.clock = clock

    def path(self, nodes: str) -> Path:
        """The state file of a node set (named by a hash: a hostlist expression can be long)."""
        digest = hashlib.sha256(nodes.encode()).hexdigest()[:16]
        return self.directory / f"shortage-{digest}.json"

    def read(self, nodes: str) -> Shortage | None:
        """The node set's last shortage, or None."""
        try:
            data: Any = json.loads(self.path(nodes).read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("nodes") != nodes:
                return None
            free = data.get("free")
            return Shortage(nodes=nodes, at=float(data["at"]), kind=str(data["kind"]),
                            free=None if free is None else int(free), reason=str(data.get("reason", "")),
                            requests=tuple({str(k): str(v) for k, v in r.items()} for r in data.get("requests", [])))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("ignoring unreadable shortage state %s: %s", self.path(nodes), exc)
            return None

    def record(self, nodes: str, kind: str, free: int | None, reason: str,
               requests: Sequence[Mapping[str, str]]) -> Shortage:
        """Write a node set's shortage (atomically); errors are logged, never raised."""
        shortage = Shortage(nodes, self.clock(), kind, free, reason, tuple(requests))
        body = {"nodes": nodes, "at": shortage.at, "kind": kind, "free": free, "reason": reason,
                "requests": [dict(r) for r in requests]}
        path = self.path(nodes)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".shortage-", dir=self.directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    json.dump(body, handle)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
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
