"""`check` of the fleet: node sets in protected mode, and the domains (hosts by their domain attribute)
against the node sets and slurm.conf's topology."""

from __future__ import annotations

import time

from .config import Config
from .findings import Report
from .protectlog import ProtectLog


def check_protected(report: Report, config: Config, now: float | None = None) -> None:
    """A node set in protected mode is a problem until its template is fixed and it is cleared."""
    store, period = ProtectLog(config.power.lock_dir), config.power.protect_for
    when = time.time() if now is None else now
    for nodeset in config.nodesets:
        state = store.read(nodeset.nodes_expr)
        if state is not None and state.active(when, period):
            report.problem(f"node set {nodeset.nodes_expr}", state.summary(when, period), state.fix)
