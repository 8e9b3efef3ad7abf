"""The Slurm harness itself works: isolation, controller, a CLOUD node booted by a trivial ResumeProgram."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from slurmharness import SlurmCluster, parse_oneliner, recording_program, wait_for


def test_session_runs_in_a_network_namespace_with_only_loopback(netns) -> None:
    if not netns.isolated:
        pytest.skip(f"not isolated: {netns.detail}")
    # /proc/self/net/dev lists this process's namespace (/sys/class/net shows the mount's namespace).
    lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    assert [line.split(":")[0].strip() for line in lines] == ["lo"]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(OSError):
        s.settimeout(2)
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: no route exists inside the namespace


def test_parse_oneliner_keeps_spaces_inside_values() -> None:
    rec = parse_oneliner("NodeName=c1 State=DOWN+CLOUD Reason=ResumeTimeout reached [slurm@now] Comment=x")
    assert rec["State"] == "DOWN+CLOUD"
    assert rec["Reason"] == "ResumeTimeout reached [slurm@now]"


@pytest.mark.slurm
def test_controller_answers_and_shows_powered_down_cloud_nodes(slurm_factory) -> None:
    cluster: SlurmCluster = slurm_factory(nodes=["cloud1"])
    assert "UP" in cluster.scontrol("ping")
    assert cluster.node_state("cloud1") == "IDLE+CLOUD+POWERED_DOWN"
    assert cluster.sinfo_state("cloud1") == "idle~"


@pytest.mark.slurm
def test_job_boots_cloud_nodes_through_resume_program_and_completes(slurm_factory, tmp_path) -> None:
    record = tmp_path / "resume.jsonl"
    resume = recording_program(tmp_path / "resume", record, action=(
        'boot(HOSTS, ["127.0.1.%d" % (i + 1) for i in range(len(HOSTS))])'))
    cluster: SlurmCluster = slurm_factory(nodes=["cloud1", "cloud2"], resume_program=resume)
    job = cluster.sbatch(nodes=2)
    cluster.wait_job(job, ["COMPLETED"], timeout=40)
    calls = [r for r in cluster.read_jsonl(record) if r["event"] == "call"]
    assert [c["argv"] for c in calls] == [["cloud[1-2]"]]
    assert sorted(cluster.job_output(job).split()) == ["cloud1", "cloud2"]
    [update] = [r for r in cluster.read_jsonl(record) if r["event"] == "scontrol"]
    assert update["rc"] == 0 and "NodeAddr=127.0.1.1,127.0.1.2" in update["args"]
    assert cluster.node_info("cloud2")["NodeAddr"] == cluster.registered_addr("127.0.1.2")


@pytest.mark.slurm
def test_stop_ends_every_process_it_started(slurm_factory) -> None:
    cluster: SlurmCluster = slurm_factory(nodes=["cloud1"])
    cluster.scontrol("update", "NodeName=cloud1", "NodeAddr=127.0.1.1")
    pids = [cluster.start_slurmd("cloud1")] + [
        int((cluster.run_dir / f).read_text()) for f in ("slurmctld.pid", "munged.pid")]
    cluster.stop()
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 10, "daemons gone")


FAIL_FIRST_THEN_BOOT = """
if not os.path.exists(RECORD + ".failed"):
    open(RECORD + ".failed", "w").close()
    scontrol("update", "NodeName=" + ",".join(HOSTS), "State=POWER_DOWN_FORCE", "Reason=test: no GPU")
else:
    boot(HOSTS, ["127.0.1.1"])
"""


@pytest.mark.slurm
def test_power_down_force_with_reason_hands_a_node_back_at_once(slurm_factory, tmp_path) -> None:
    """The fail-fast hand-back our resume relies on (Slurm 22.05; see docs/SLURM-FINDINGS.md)."""
    resume = recording_program(tmp_path / "resume", tmp_path / "resume.jsonl", action=FAIL_FIRST_THEN_BOOT)
    suspend = recording_program(tmp_path / "suspend", tmp_path / "suspend.jsonl")
    cluster: SlurmCluster = slurm_factory(nodes=["cloud1"], resume_program=resume, suspend_program=suspend,
                                          resume_timeout=120)
    job = cluster.sbatch(nodes=1)
    # Requeued now, not at ResumeTimeout; the reason stays visible; SuspendProgram runs for the node.
    cluster.wait_for(lambda: cluster.job_info(job).get("Restarts") == "1", 15, "job requeued")
    assert cluster.node_info("cloud1")["Reason"].startswith("test: no GPU [")
    cluster.wait_for(lambda: cluster.read_jsonl(tmp_path / "suspend.jsonl"), 10, "SuspendProgram called")
    # After SuspendTimeout the node is resumed again for the requeued job, which then completes.
    cluster.wait_job(job, ["COMPLETED"], timeout=40)
    assert "Reason" not in cluster.node_info("cloud1")  # cleared when the node registered
