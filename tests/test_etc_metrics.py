"""etc/: the Grafana dashboard and the alert rules ask only for metrics and label values the programs write;
the logrotate file covers the log and the usage records without copytruncate."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from slurm_nebula_power.metrics import RunFigures, write_metrics
from slurm_nebula_power.records import CATEGORIES

ETC = Path(__file__).resolve().parent.parent / "etc"
DASHBOARD = ETC / "grafana" / "slurm-nebula-power-dashboard.json"
ALERTS = ETC / "prometheus" / "slurm-nebula-power-alerts.yml"
STATES = {"idle", "busy", "powered_down", "starting", "stopping", "other", "unknown"}


def written_names(tmp_path) -> set[str]:
    """Every sample name a resume and a reconcile run write."""
    path = tmp_path / "m.prom"
    write_metrics(path, RunFigures("resume", 3.0, done=Counter({"gpu[01-02]": 1}),
                                   failed=Counter({("gpu[01-02]", "no_capacity"): 1}),
                                   handbacks=Counter({"no_capacity": 1}), events=Counter({"created": 1}),
                                   gauges={"gpus_held": 1, "vms": 1}))
    write_metrics(path, RunFigures("reconcile", 1.0, drift=Counter({"orphan_vm": 1}),
                                   gauges={"gpus_free": 3, "gpus_total": 4, "drift_nodes": 1},
                                   labelled={("gpus_held_by_slurm_state", "idle"): 1,
                                             ("nodeset_protected", "gpu[01-02]"): 0}))
    return {s.name for f in text_string_to_metric_families(path.read_text()) for s in f.samples}


def expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    text = ALERTS.read_text()
    exprs += re.findall(r"expr: \|\n((?:\s{10}.*\n)+)", text) + re.findall(r"expr: (?!\|)(.+)", text)
    return exprs


def test_dashboard_and_alerts_use_only_metrics_the_programs_write(tmp_path) -> None:
    names = written_names(tmp_path)
    exprs = expressions()
    assert len(exprs) >= 15
    used = {name for expr in exprs for name in re.findall(r"slurm_nebula_power_\w+", expr)}
    assert used and used <= names, used - names


def test_label_values_in_the_rules_are_ones_the_programs_use() -> None:
    text = "\n".join(expressions())
    for values in re.findall(r'state=~"([^"]+)"', text):
        assert set(values.split("|")) <= STATES
    for values in re.findall(r'(?:kind|reason)=~"([^"]+)"', text):
        assert set(values.split("|")) <= set(CATEGORIES)
    assert set(re.findall(r'program="([^"]+)"', text)) <= {"resume", "suspend", "resume-fail", "reconcile"}


def test_every_alert_has_an_expression_and_a_summary() -> None:
    blocks = ALERTS.read_text().split("- alert: ")[1:]
    assert {b.split()[0] for b in blocks} >= {"SlurmNebulaNodeSetFailingEveryResume", "SlurmNebulaGpusHeldByIdleNodes",
                                                "SlurmNebulaReconcileFindsLeaks"}
    assert all("expr:" in b and "summary:" in b for b in blocks)


def test_logrotate_covers_log_and_records_and_creates_them_0640_for_slurm() -> None:
    text = (ETC / "logrotate.d" / "slurm-nebula-power").read_text()
    stanzas = re.findall(r"^(/\S+) \{\n(.*?)^\}", text, re.M | re.S)
    assert [path for path, _ in stanzas] == ["/var/log/slurm/nebula-power.log",
                                             "/var/log/slurm/nebula-power-audit.jsonl"]
    for _, body in stanzas:
        assert "create 0640 slurm slurm" in body and "copytruncate" not in body
    example = (ETC / "nebula-power.toml").read_text()
    assert '# audit_file = "/var/log/slurm/nebula-power-audit.jsonl"' in example
