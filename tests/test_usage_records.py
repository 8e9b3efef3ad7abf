"""The programs write usage records and metrics (issue 17): resume, suspend, resume-fail and reconcile
against the simulator, the records checked against what the simulator did, the metrics file parsed with
prometheus_client's own parser."""

from __future__ import annotations

import json

from opsupport import ours_vm, show
from prometheus_client.parser import text_string_to_metric_families
from simfixtures import AUTH, fast_config, vms_of
from support import make_setup

from opennebula_sim import running_simulator
from slurm_nebula_power.cli import reconcile
from slurm_nebula_power.cli.main import resume_fail_main, resume_main, suspend_main
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK


def resume_file(tmp_path, jobs: dict[int, str]) -> str:
    """A 22.05 SLURM_RESUME_FILE naming these jobs and their nodes."""
    path = tmp_path / "resume.json"
    path.write_text(json.dumps({"all_nodes_resume": ",".join(jobs.values()),
                                "jobs": [{"job_id": job, "nodes": nodes} for job, nodes in jobs.items()]}))
    return str(path)


def samples(setup) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the metrics file: (name, sorted labels) -> value."""
    found = {}
    for family in text_string_to_metric_families(setup.metrics.read_text()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(found, name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def test_resume_and_suspend_record_each_vm_s_life_with_its_host_gpus_and_jobs(tmp_path, sim, setup) -> None:
    env = dict(setup.env, SLURM_RESUME_FILE=resume_file(tmp_path, {41: "gpu01", 42: "gpu[01-02]"}))
    assert resume_main(["gpu[01-02]"], env) == EXIT_OK
    vms = {node: vms_of(sim, node)[0] for node in ("gpu01", "gpu02")}
    assert suspend_main(["gpu[01-02]"], setup.env) == EXIT_OK
    records = setup.records()
    for node, vm in vms.items():
        mine = [r for r in records if r["node"] == node]
        assert [r["event"] for r in mine] == ["created", "running", "removed"]
        created, running, removed = mine
        assert {r["vm"] for r in mine} == {vm.id}
        assert running["host"] == vm.host and [g["address"] for g in running["gpus"]] == list(vm.pci)
        assert removed["host"] == vm.host and removed["gpus"] == running["gpus"]  # known at removal too
        assert created["jobs"] == running["jobs"] == removed["jobs"] == ([41, 42] if node == "gpu01" else [42])
        assert [r["program"] for r in mine] == ["resume", "resume", "suspend"]
        assert removed["state"] == "DONE" and removed["action"] == "terminate"
    assert all(set(r) >= {"v", "time", "event", "node", "vm", "host", "gpus", "jobs", "cluster"} for r in records)


def test_the_metrics_file_adds_up_over_runs(tmp_path, sim, setup) -> None:
    assert resume_main(["gpu[01-02]"], setup.env) == EXIT_OK
    assert suspend_main(["gpu01"], setup.env) == EXIT_OK
    assert resume_main(["gpu[01-03]"], setup.env) == EXIT_OK
    found = samples(setup)
    assert value(found, "slurm_nebula_power_runs_total", program="resume", result="ok") == 2
    assert value(found, "slurm_nebula_power_nodes_done_total", program="resume", nodeset="gpu[01-08]") == 5
    assert value(found, "slurm_nebula_power_vm_events_total", program="resume", event="created") == 4
    assert value(found, "slurm_nebula_power_vm_events_total", program="suspend", event="removed") == 1
    assert value(found, "slurm_nebula_power_run_duration_seconds_count", program="resume") == 2
    assert value(found, "slurm_nebula_power_run_duration_seconds_bucket", program="resume", le="+Inf") == 2
    calls = sum(sim.stats()["calls"].values())
    ours_calls = sum(v for (name, _), v in found.items() if name == "slurm_nebula_power_api_calls_total")
    assert ours_calls == calls  # every call the simulator answered, counted once
    assert value(found, "slurm_nebula_power_gpus_held") == 3  # as the last run saw: three VMs, one GPU each
    assert value(found, "slurm_nebula_power_vms") == 3
    assert not [name for name, _ in found if name.endswith("_created")]


def test_a_node_without_a_free_gpu_is_recorded_failed_and_handed_back(tmp_path) -> None:
    with running_simulator(fast_config(hosts=1, gpus=1), auth=AUTH) as sim:
        setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=(
            '[[nodeset]]\nnodes = "gpu[01-02]"\ntemplate = "slurm-gpu-worker"\nboot_timeout = 1\n'))
        assert resume_main(["gpu[01-02]"], setup.env) == EXIT_NODES_FAILED
        # The GPU count before any instantiate (issue 16) refuses the second node: no VM is made for it.
        assert len(sim.vms()) == 1
        [refused] = {r["node"] for r in setup.records()} - {sim.vms()[0].name}
        events = [(r["event"], r.get("category")) for r in setup.records() if r["node"] == refused]
        assert events == [("failed", "no_capacity"), ("handed_back", "no_capacity")]
        found = samples(setup)
        assert value(found, "slurm_nebula_power_nodes_failed_total", program="resume", nodeset="gpu[01-02]",
                     reason="no_capacity") == 1
        assert value(found, "slurm_nebula_power_handbacks_total", program="resume", reason="no_capacity") == 1
        assert value(found, "slurm_nebula_power_runs_total", program="resume", result="failed") == 1


def test_resume_fail_and_reconcile_record_what_they_remove(tmp_path, sim) -> None:
    setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, extra="reconcile_grace = 0")
    assert resume_main(["gpu[01-02]"], setup.env) == EXIT_OK
    [first] = vms_of(sim, "gpu01")
    assert resume_fail_main(["gpu01"], setup.env) == EXIT_OK
    leaked = sim.add_vm("gpu03", **ours_vm("gpu03"))
    setup.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN", "gpu02 State=IDLE+CLOUD",
                         "gpu03 State=IDLE+CLOUD+POWERED_DOWN"))
    assert reconcile.main([], setup.env) == EXIT_OK
    removed = {r["vm"]: r for r in setup.records() if r["event"] == "removed"}
    assert removed[first.id]["program"] == "resume-fail" and removed[first.id]["host"] == first.host
    assert removed[leaked]["program"] == "reconcile"
    found = samples(setup)
    assert value(found, "slurm_nebula_power_drift_found_total", kind="orphan_vm") >= 1
    assert value(found, "slurm_nebula_power_gpus_held_by_slurm_state", state="idle") == 1  # gpu02's VM
    hosts = sim.hosts()
    assert value(found, "slurm_nebula_power_gpus_total") == sum(h.gpus_total for h in hosts)
    assert value(found, "slurm_nebula_power_gpus_free") == sum(h.gpus_free for h in hosts)


def test_a_powered_off_vm_resumed_later_is_recorded_off_then_resumed(sim, setup) -> None:
    assert resume_main(["cpu01"], setup.env) == EXIT_OK  # cpu[01-04]: suspend_action poweroff
    assert suspend_main(["cpu01"], setup.env) == EXIT_OK
    assert resume_main(["cpu01"], setup.env) == EXIT_OK
    [vm] = vms_of(sim, "cpu01")
    events = [(r["event"], r["vm"], r.get("action")) for r in setup.records()]
    assert events == [("created", vm.id, "instantiate"), ("running", vm.id, None), ("off", vm.id, "poweroff"),
                      ("resumed", vm.id, "resume"), ("running", vm.id, None)]


def test_a_reconcile_dry_run_writes_neither_records_nor_metrics(tmp_path, sim) -> None:
    setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, extra="reconcile_grace = 0")
    sim.add_vm("gpu03", **ours_vm("gpu03"))
    setup.set_nodes(show("gpu03 State=IDLE+CLOUD+POWERED_DOWN"))
    assert reconcile.main(["--dry-run"], setup.env) == EXIT_OK
    assert not setup.audit.exists() and not setup.metrics.exists()
    assert reconcile.main([], setup.env) == EXIT_OK
    assert [r["event"] for r in setup.records()] == ["removed"] and setup.metrics.exists()


def test_the_gauges_count_every_vm_of_a_resume_that_read_only_its_last_waves(sim, setup) -> None:
    """After its first waves resume reads only the VMs still in flight (an id range); the gauges still
    count every VM of the cluster, the earlier ones as last seen."""
    setup.config.write_text(setup.config.read_text().replace("max_parallel = 8\n",
                                                             "max_parallel = 8\nmax_pending = 2\n"))
    assert resume_main(["gpu[01-08]"], setup.env) == EXIT_OK
    assert "sent 2, 6 waiting" in setup.log_text(), "resume sent the 8 in waves"
    found = samples(setup)
    assert value(found, "slurm_nebula_power_vms") == 8
    assert value(found, "slurm_nebula_power_gpus_held") == 8
