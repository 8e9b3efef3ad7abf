"""The metrics file (metrics.py): runs merge into one .prom file that prometheus_client's parser reads back;
counters and histograms add up across runs and processes, gauges keep the latest value."""

from __future__ import annotations

import multiprocessing
from collections import Counter
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from slurm_nebula_power.metrics import RunFigures, write_metrics


def parsed(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(path.read_text()) for s in f.samples}


def test_counters_add_up_histograms_bucket_and_gauges_take_the_latest(tmp_path) -> None:
    path = tmp_path / "m.prom"
    write_metrics(path, RunFigures("resume", 4.0, api_calls=10, gauges={"gpus_held": 3}))
    write_metrics(path, RunFigures("resume", 40.0, api_calls=5, retries=2, gauges={"gpus_held": 1}))
    write_metrics(path, RunFigures("suspend", 1.5, api_calls=3))  # no gauge: gpus_held keeps 1
    found = parsed(path)
    assert found[("slurm_nebula_power_api_calls_total", (("program", "resume"),))] == 15
    assert found[("slurm_nebula_power_api_retries_total", (("program", "resume"),))] == 2
    assert found[("slurm_nebula_power_gpus_held", ())] == 1
    bucket = "slurm_nebula_power_run_duration_seconds_bucket"
    assert found[(bucket, (("le", "5.0"), ("program", "resume")))] == 1
    assert found[(bucket, (("le", "60.0"), ("program", "resume")))] == 2
    assert found[("slurm_nebula_power_run_duration_seconds_sum", (("program", "resume"),))] == 44.0
    assert found[("slurm_nebula_power_run_duration_seconds_count", (("program", "suspend"),))] == 1


def _runs(path: str, count: int) -> None:
    for _ in range(count):
        assert write_metrics(Path(path), RunFigures("suspend", 0.5, done=Counter({"gpu[01-04]": 2}), api_calls=3),
                             lock_wait=60)


def test_concurrent_runs_lose_no_count(tmp_path) -> None:
    path = tmp_path / "m.prom"
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_runs, args=(str(path), 10)) for _ in range(4)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(120)
        assert process.exitcode == 0
    found = parsed(path)
    assert found[("slurm_nebula_power_runs_total", (("program", "suspend"), ("result", "ok")))] == 40
    assert found[("slurm_nebula_power_nodes_done_total", (("nodeset", "gpu[01-04]"), ("program", "suspend")))] == 80
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.prom", "m.prom.lock"]  # no temporary file left


def test_an_unreadable_metrics_file_starts_again_and_a_missing_directory_fails_softly(tmp_path, caplog) -> None:
    path = tmp_path / "m.prom"
    path.write_text("this is { not prometheus\n")
    assert write_metrics(path, RunFigures("reconcile", 1.0))
    assert parsed(path)[("slurm_nebula_power_runs_total", (("program", "reconcile"), ("result", "ok")))] == 1
    assert "unreadable" in caplog.text
    assert not write_metrics(tmp_path / "nowhere" / "m.prom", RunFigures("resume", 1.0))
    assert "cannot write this run's metrics" in caplog.text
