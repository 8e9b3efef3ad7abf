"""Protected mode's state, kept across resume processes: one small JSON file per node set in [power] lock_dir
(`protect-<hash of the node set's nodes>.json`): the boot failures since the node set last booted a VM
well, the last one's reason, and since when the node set is protected. Updated under an flock of its own
(`protect-<hash>.lock`: two resumes of one node set may end at once), replaced atomically, read at the
start of each resume. A missing file is a node set in good standing; an unreadable or malformed one is
too (logged): the state only ever saves VMs, so losing it costs at most `protect_after` boots more.
lock_dir may be shared by two controllers: the files are opened without following a link, only as
regular files of ours, with a size cap, and a root run makes them for SlurmUser (files.py).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from .cooldown import NodeSetFiles
from .files import replace

log = logging.getLogger(__name__)

LOCK_WAIT = 5.0  # seconds a resume waits for another's update of the same node set
UNPROTECT = "slurm-nebula-power unprotect"  # the operator command that clears it (cli/unprotect.py)


@dataclass(frozen=True)
class Protection:
    """A node set's boot failures since its last good boot, and whether they made it protected."""

    nodes: str
    failures: int  # VMs that failed to boot (failed, never RUNNING, never READY) since the last good boot
    reason: str  # the last failure's
    since: float | None = None  # wall clock (time.time) when protected mode began; None: not (yet) protected

    def active(self, now: float, period: float) -> bool:
        """Protected now: resume creates no VM for the node set (until `period` after it began)."""
        return self.since is not None and now - self.since < period

    def hand_back_reason(self, now: float, period: float, name: str) -> str:
        """The Slurm Reason of a node handed back while protected: what happened, and how to clear it
        (`name`: what to give unprotect, the node set or one of its nodes). Short: slurm.py cuts a Reason
        at 200 characters, with "nebula: " before it."""
        left = 0 if self.since is None else max(0.0, self.since + period - now)
        return (f"protected after {self.failures} boot failures ({self.reason[:60]}): fix the template, then "
                f"`{UNPROTECT} {name}` (or wait {left / 60:.0f} min)")


    def summary(self, now: float, period: float) -> str:
        """What status and check say of a protected node set."""
        left = 0 if self.since is None else max(0.0, self.since + period - now)
        return (f"protected mode: {self.failures} boot failures in a row (last: {self.reason[:100]}); resume "
                f"creates none of its VMs for {left / 60:.0f} more min")

    @property
    def fix(self) -> str:
        """How to clear it."""
        return f"fix the template (onevm show of a failed VM says why), then `{UNPROTECT} {self.nodes}`"


def after_failures(old: Protection | None, nodes: str, count: int, reason: str, now: float, threshold: int,
                   period: float) -> Protection:
    """The state after `count` more boot failures: protected once `threshold` are reached (threshold 0:
    never). Once protection has lapsed (`period`), the failures stay counted, so the next one protects the
    node set again at once: one VM per period, not `threshold`, while the template stays broken."""
    failures = (old.failures if old is not None else 0) + count
    since = old.since if old is not None else None
    if threshold > 0 and failures >= threshold and (since is None or now - since >= period):
        since = now
    return Protection(nodes, failures, reason, since)


class ProtectLog(NodeSetFiles[Protection]):
    """Where resume records boot failures and good boots, per node set, and reads protected mode back."""

    KIND, WHAT = "protect", "protected-mode state"

    def parse(self, nodes: str, data: dict[str, Any]) -> Protection:
        """The state from its file."""
        since = data.get("since")
        failures = int(data["failures"])
        if failures < 0:
            raise ValueError("negative count")
        return Protection(nodes, failures, str(data.get("reason", ""))[:200], None if since is None else float(since))

    def failed(self, nodes: str, count: int, reason: str, threshold: int, period: float) -> Protection:
        """Add `count` boot failures to the node set's state (under its lock); errors are logged, never raised."""
        now = self.clock()
        state = after_failures(None, nodes, count, reason, now, threshold, period)
        try:
            with self.locked(nodes, LOCK_WAIT):
                state = after_failures(self.read(nodes), nodes, count, reason, now, threshold, period)
                body = {"nodes": nodes, "cluster": self.cluster, "failures": state.failures, "reason": reason[:200],
                        "since": state.since, "at": now}
                replace(self.path(nodes), json.dumps(body).encode(), 0o640, self.owner)
        except (OSError, TimeoutError) as exc:
            log.error("could not record the boot failures of %s in %s: %s", nodes, self.directory, exc)
        return state

    def clear(self, nodes: str) -> Protection | None:
        """Forget the node set's failures (a good boot, the operator's unprotect); what was there, if anything.
        A node set with no state costs one stat."""
        if not self.path(nodes).exists():
            return None
        old = self.read(nodes)
        try:
            with self.locked(nodes, LOCK_WAIT):
                self.path(nodes).unlink()
        except FileNotFoundError:
            pass
        except (OSError, TimeoutError) as exc:
            log.error("could not clear the protected-mode state of %s in %s: %s", nodes, self.directory, exc)
        return old
