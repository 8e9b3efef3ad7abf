"""Prometheus metrics in node_exporter's textfile format, through prometheus_client.

Each program is a short-lived process, so counters must outlive it: `[log] metrics_file` names one
`.prom` file that every run (resume, suspend, resume-fail, reconcile) rewrites under a lock
(`<metrics_file>.lock`, flock): it reads the file back with prometheus_client's parser, adds this run's
counts to the counters and histogram buckets, sets the gauges it measured (the others keep their last
value) and writes the whole through a temporary file renamed over the old one (the collector never reads
half a file). The metrics of one run are built in a CollectorRegistry of its own.

The directory may be node_exporter's textfile directory, which others can write: the file and its lock
are opened without following links, must be regular files of ours, the file is read with a size cap, and a
file that is not in the textfile format is started again without quoting it (files.py). What a root run
creates is made for SlurmUser.

prometheus_client costs ~0.1 s to import: only `write_metrics` imports it, and only when metrics_file is
set. Writing never fails a run: a problem is logged and the run's figures are lost.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .files import Owner, UnsafeFile, flocked, read_capped, replace

log = logging.getLogger(__name__)
PREFIX = "slurm_nebula_power_"
# Run durations: a suspend takes seconds, a resume up to boot_timeout (minutes).
BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0)
LOCK_WAIT = 5.0  # seconds a run waits for another run's metrics write
MOST_BYTES = 8 << 20  # a metrics file's size at most (ours are a few KiB: a few labels per node set)


@dataclass
class RunFigures:
    """What one run measured; write_metrics turns it into metrics."""

    program: str  # resume | suspend | resume-fail | reconcile
    seconds: float = 0.0
    result: str = "ok"  # ok | failed (some nodes) | error (the run itself failed)
    done: Counter[str] = field(default_factory=Counter)  # node set -> nodes done
    failed: Counter[tuple[str, str]] = field(default_factory=Counter)  # (node set, reason category) -> nodes
    handbacks: Counter[str] = field(default_factory=Counter)  # reason category -> nodes
    events: Counter[str] = field(default_factory=Counter)  # usage record event -> records
    api_calls: int = 0
    retries: int = 0
    drift: Counter[str] = field(default_factory=Counter)  # reconcile: repair category -> nodes
    gauges: dict[str, float] = field(default_factory=dict)  # unlabelled gauge name (no prefix) -> value
    labelled: dict[tuple[str, str], float] = field(default_factory=dict)  # (gauge, label value) -> value


GAUGES = {
    "gpus_held": "GPUs (PCI devices assigned by OpenNebula) held by this cluster's live VMs, as last seen",
    "vms": "this cluster's live VMs (not DONE), as last seen",
    "gpus_free": "GPUs free on the cloud's hosts (one.hostpool.info, by reconcile)",
    "gpus_total": "GPUs on the cloud's hosts (one.hostpool.info, by reconcile)",
    "drift_nodes": "nodes the last reconcile found drifting (a repair was due)",
    "nodesets_out": "node sets stepped out of Slurm's way for a GPU shortage (their nodes drained), by reconcile",
}
LABELLED_GAUGES = {
    "gpus_held_by_slurm_state": ("state", "GPUs held by our live VMs by their node's Slurm state "
                                 "(idle, busy, powered_down, starting, stopping, other, unknown), by reconcile"),
    "nodeset_protected": ("nodeset", "1 while the node set is in protected mode (resume creates none of its VMs "
                          "after boot failures in a row), else 0; by reconcile and resume"),
}


def _build(run: RunFigures, now: float) -> Any:
    """This run's metrics in a registry of their own."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry(auto_describe=True)
    program = run.program

    def counter(name: str, doc: str, labels: tuple[str, ...]) -> Any:
        return Counter(PREFIX + name, doc, labels, registry=registry)

    Histogram(PREFIX + "run_duration_seconds", "seconds one run of a program took", ["program"],
              buckets=BUCKETS, registry=registry).labels(program).observe(run.seconds)
    counter("runs_total", "runs by program and result (ok, failed: some nodes, error: the run)",
            ("program", "result")).labels(program, run.result).inc()
    done = counter("nodes_done_total", "nodes a run brought up or down as asked", ("program", "nodeset"))
    for nodeset, count in run.done.items():
        done.labels(program, nodeset).inc(count)
    failed = counter("nodes_failed_total", "nodes a run failed, by reason category",
                     ("program", "nodeset", "reason"))
    for (nodeset, reason), count in run.failed.items():
        failed.labels(program, nodeset, reason).inc(count)
    handbacks = counter("handbacks_total", "nodes handed back to Slurm, by reason category", ("program", "reason"))
    for reason, count in run.handbacks.items():
        handbacks.labels(program, reason).inc(count)
    events = counter("vm_events_total", "usage records written, by event", ("program", "event"))
    for event, count in run.events.items():
        events.labels(program, event).inc(count)
    counter("api_calls_total", "OpenNebula API calls (attempts)", ("program",)).labels(program).inc(run.api_calls)
    counter("api_retries_total", "OpenNebula API calls retried after a transient error",
            ("program",)).labels(program).inc(run.retries)
    if program == "reconcile":
        drift = counter("drift_found_total", "drift reconcile found, by kind", ("kind",))
        for kind, count in run.drift.items():
            drift.labels(kind).inc(count)
    Gauge(PREFIX + "last_run_timestamp_seconds", "when a program's last run ended", ["program"],
          registry=registry).labels(program).set(now)
    for name, value in run.gauges.items():
        Gauge(PREFIX + name, GAUGES[name], registry=registry).set(value)
    made: dict[str, Any] = {}
    for (name, key), value in run.labelled.items():
        if name not in made:
            made[name] = Gauge(PREFIX + name, LABELLED_GAUGES[name][1], [LABELLED_GAUGES[name][0]],
                               registry=registry)
        made[name].labels(key).set(value)
    return registry


Key = tuple[str, tuple[tuple[str, str], ...]]  # sample name, sorted labels


@dataclass
class _Family:
    name: str
    type: str
    documentation: str
    samples: dict[Key, float] = field(default_factory=dict)


def _families(metric_families: Any) -> dict[str, _Family]:
    out: dict[str, _Family] = {}
    for family in metric_families:
        kept = out.setdefault(family.name, _Family(family.name, family.type, family.documentation))
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # a short-lived process's creation time means nothing to a counter kept in a file
            kept.samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def merge(previous: dict[str, _Family], run: dict[str, _Family]) -> dict[str, _Family]:
    """Counters and histograms add up across runs; a gauge takes this run's value where it has one."""
    merged = {name: _Family(f.name, f.type, f.documentation, dict(f.samples)) for name, f in previous.items()}
    for name, family in run.items():
        old = merged.get(name)
        if old is None or old.type != family.type:
            merged[name] = family
            continue
        old.documentation = family.documentation
        for key, value in family.samples.items():
            additive = family.type in ("counter", "histogram")
            old.samples[key] = old.samples.get(key, 0.0) + value if additive else value
    return merged


class _Merged:
    """A collector yielding the merged families (prometheus_client renders them)."""

    def __init__(self, families: dict[str, _Family]) -> None:
        self.families = families

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import Metric

        for family in sorted(self.families.values(), key=lambda f: f.name):
            metric = Metric(family.name, family.documentation, family.type)
            for (sample, labels), value in family.samples.items():
                metric.add_sample(sample, dict(labels), value)
            yield metric


class Unreadable(ValueError):
    """A metrics file that is not in the textfile format (its content is never quoted: it may be anything)."""


def read_metrics(path: Path, owner: Owner | None = None) -> dict[str, _Family]:
    """The families in a metrics file ({} when it does not exist); UnsafeFile or Unreadable otherwise."""
    from prometheus_client.parser import text_string_to_metric_families

    data = read_capped(path, MOST_BYTES, owner)
    if data is None:
        return {}
    try:
        return _families(text_string_to_metric_families(data.decode("utf-8")))
    except (ValueError, TypeError, UnicodeDecodeError, IndexError, KeyError) as exc:
        raise Unreadable(f"not in the textfile format ({type(exc).__name__})") from None


def write_metrics(path: Path, run: RunFigures, now: float | None = None, lock_wait: float = LOCK_WAIT,
                  owner: Owner | None = None) -> bool:
    """Merge one run's figures into the metrics file, atomically; False (and logged) when it could not.
    `owner`: who gets the file and its lock (SlurmUser when root runs this)."""
    from prometheus_client import CollectorRegistry, generate_latest

    try:
        with flocked(path.with_name(path.name + ".lock"), lock_wait, owner):
            try:
                previous = read_metrics(path, owner)
            except (Unreadable, UnsafeFile) as exc:
                log.warning("metrics_file %s unusable (%s): starting it again", path, exc.args[-1])
                previous = {}
            registry = _build(run, time.time() if now is None else now)
            merged = merge(previous, _families(registry.collect()))
            out = CollectorRegistry(auto_describe=False)
            out.register(_Merged(merged))
            # 0644: node_exporter runs as another user; counters are no secret
            replace(path, generate_latest(out), 0o644, owner)
    except (OSError, TimeoutError) as exc:
        log.error("metrics_file %s: cannot write this run's metrics: %s", path,
                  exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)
        return False
    return True
