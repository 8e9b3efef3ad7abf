"""Measured Slurm behaviour, collected per test run and printed at its end (docs/SLURM-FINDINGS.md).

A real-controller test calls `finding(what, value)` for a behaviour that differs between Slurm releases (the
hand-back, NodeAddr after registration, InstanceId, the resume file's form, the job-start wait, a takeover).
The value travels in the test's report (`user_properties`, which pytest-xdist hands to the controller), and
the session's terminal summary lists every finding with the Slurm release and the test that measured it:
the cells of the table in docs/SLURM-FINDINGS.md are copied from these lines, on each release.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import pytest

KEY = "slurm-finding"
_current: list[pytest.Item] = []  # the test running in this process (set by conftest's setup hook)


def running(item: pytest.Item | None) -> None:
    """Remember (None: forget) the test in progress, whose report carries the findings."""
    _current[:] = [item] if item is not None else []


def finding(what: str, value: object) -> None:
    """Record that the test in progress measured `what` = `value` on this Slurm release."""
    if not _current:
        raise RuntimeError("finding() outside a test")
    _current[0].user_properties.append((KEY, json.dumps({"what": what, "value": str(value)})))


def lines(reports: Iterable[pytest.TestReport], release: str) -> list[str]:
    """One summary line per finding: release, what, value, and the test that measured it."""
    out = []
    for report in reports:
        if report.when != "call":
            continue
        for key, raw in report.user_properties:
            if key == KEY:
                item = json.loads(str(raw))
                out.append(f"{release} | {item['what']} | {item['value']} | {report.nodeid}")
    return sorted(out)
