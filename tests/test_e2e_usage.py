"""Usage records and metrics end to end (issue 17): jobs through the real slurmctld, our programs and the
simulator; then `slurm-nebula-power usage` is checked against what happened (which job, which VMs, which
GPUs, durations within a second of the VMs' RUNNING -> DONE as the simulator went through them) and the
metrics file, parsed with prometheus_client's parser, against the programs' own summary lines."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_support import E2E, job_script
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slurm

POWER = Path(sys.executable).parent / "slurm-nebula-power"
NODES = ("gpu01", "gpu02")



def summaries(env: E2E) -> list[tuple[str, int, int, int]]:
    """(program, nodes done, API calls, retries) of every summary line our programs logged."""
    return [(program, int(done), int(calls), int(retries)) for program, done, calls, retries in re.findall(
        r"summary: slurm-nebula-(\S+) \S+: (\d+) done, \d+ failed.*? in [\d.]+s, (\d+) API calls, (\d+) retries",
        env.program_log_text())]


def usage(env: E2E, *args: str) -> dict:
    done = subprocess.run([str(POWER), "usage", "--json", *args], env={"SLURM_CONF": str(env.cluster.conf)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def run_job(env: E2E, *args: str, nodes: int) -> int:
    """sbatch a job, wait until it completed and its nodes are powered down again (VMs DONE)."""
    c = env.cluster
    job = c.sbatch(*args, script=job_script(sleep=1), nodes=nodes)
    c.wait_job(job, ["COMPLETED"], timeout=40)
    env.wait_no_live_vms(timeout=40)
    env.wait_nodes(NODES, "idle~", timeout=30)
    return job


def test_usage_and_metrics_tell_what_the_jobs_used(e2e) -> None:
    env = e2e()
    both = run_job(env, nodes=2)
    one = run_job(env, "--nodelist=gpu01", nodes=1)
    env.wait(lambda: len([s for s in summaries(env) if s[0] == "suspend"]) >= 2, 15, "suspends logged")
    vms = {vm.id: vm for vm in env.sim.vms()}
    assert len(vms) == 3  # two for the first job, one for the second
    truth = {vm_id: env.seen_in(vm_id, "DONE")[0] - env.seen_in(vm_id, "RUNNING")[0] for vm_id in vms}

    report = usage(env)
    assert report["disagreements"] == [] and report["unreadable_lines"] == []
    jobs = {row["job"]: row for row in report["rows"]}
    assert set(jobs) == {str(both), str(one)}
    ids_of = {job: sorted(vm.id for vm in vms.values() if vm.user_template.get("SLURM_JOB_IDS") == str(job))
              for job in (both, one)}
    assert jobs[str(both)]["vms"] == ids_of[both] and len(ids_of[both]) == 2
    assert jobs[str(one)]["vms"] == ids_of[one] and jobs[str(one)]["nodes"] == ["gpu01"]
    # The GPUs: the host devices the simulator gave each VM, on its host (the hosts have one GPU each).
    hosts = {h.name: h for h in env.sim.hosts()}
    for job in (both, one):
        gpus = sorted((g["vm"], g["host"], g["address"]) for g in jobs[str(job)]["gpus"])
        assert len(gpus) == len(ids_of[job])
        for vm_id, host, address in gpus:
            assert host == env.seen_in(vm_id, "RUNNING")[1]
            assert hosts[host].gpu_holders.keys() == {address}, (host, address)
    per_vm = {int(row["vm"]): row for row in usage(env, "--by", "vm")["rows"]}
    assert set(per_vm) == set(vms)
    for vm_id, seconds in truth.items():
        assert per_vm[vm_id]["vm_seconds"] == pytest.approx(seconds, abs=1.0), (vm_id, per_vm[vm_id], seconds)
        assert per_vm[vm_id]["gpu_seconds"] == pytest.approx(per_vm[vm_id]["vm_seconds"])  # one GPU each

    # Metrics: the counters match what the programs' summary lines say they did.
    samples = {}
    for family in text_string_to_metric_families(env.metrics_file.read_text()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def total(name: str, **labels: str) -> float:
        return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())

    logged = summaries(env)
    for program in ("resume", "suspend"):
        mine = [s for s in logged if s[0] == program]
        assert total("slurm_nebula_power_runs_total", program=program) == len(mine)
        assert total("slurm_nebula_power_run_duration_seconds_count", program=program) == len(mine)
        assert total("slurm_nebula_power_nodes_done_total", program=program) == sum(s[1] for s in mine)
        assert total("slurm_nebula_power_api_calls_total", program=program) == sum(s[2] for s in mine)
        assert total("slurm_nebula_power_api_retries_total", program=program) == sum(s[3] for s in mine)
    assert total("slurm_nebula_power_nodes_done_total", program="resume") == 3
    assert total("slurm_nebula_power_vm_events_total", program="resume", event="created") == 3
    assert total("slurm_nebula_power_vm_events_total", program="resume", event="running") == 3
    assert total("slurm_nebula_power_vm_events_total", program="suspend", event="removed") == 3
    assert total("slurm_nebula_power_nodes_failed_total") == 0 and total("slurm_nebula_power_handbacks_total") == 0
    records = [json.loads(line) for line in env.audit_file.read_text().splitlines()]
    assert sorted(r["event"] for r in records) == sorted(["created", "running", "removed"] * 3)

