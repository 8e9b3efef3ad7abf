"""The Slurm harness itself works: isolation, controller, a CLOUD node booted by a trivial ResumeProgram."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import vmnet
from slurm_findings import finding
from slurmharness import (
    SlurmCluster,
    SlurmCommandError,
    as_power_actions,
    parse_oneliner,
    recording_program,
    rewrite_lines,
    wait_for,
)

from slurm_nebula_power.slurm import jobs_from_resume_file


def test_session_runs_in_a_network_namespace_with_only_loopback_and_guest_veths(netns) -> None:
    if not netns.isolated:
        pytest.skip(f"not isolated: {netns.detail}")
    # /proc/self/net/dev lists this process's namespace (/sys/class/net shows the mount's namespace).
    lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    names = [line.split(":")[0].strip() for line in lines]
    assert names[0] == "lo" and all(n.startswith(vmnet.VETH_PREFIX) for n in names[1:]), names
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(OSError):
        s.settimeout(2)
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: no route exists inside the namespace


SERVER = """
import socket
s = socket.create_server(("0.0.0.0", 7000))
print(socket.gethostname(), flush=True)
conn, peer = s.accept()
print(peer[0], flush=True)
"""
CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], 7000), timeout=10) as c:
    print(c.getsockname()[0])
"""


def test_guests_have_their_own_address_and_reach_each_other_and_the_session(netns) -> None:
    """tests/vmnet.py: a guest at 127.0.1.201 sees a connection from a guest at 127.0.1.202 come from
    127.0.1.202, the session reaches a guest from 127.0.0.1, and a guest reaches the session's 127.0.0.1."""
    if not netns.isolated:
        pytest.skip(f"not isolated: {netns.detail}")
    for client_addr, server_addr in (("127.0.1.202", "127.0.1.201"), (None, "127.0.1.203"),
                                     ("127.0.1.204", "127.0.0.1")):
        argv = [sys.executable, "-c", SERVER]
        server = subprocess.Popen(vmnet.guest_argv(server_addr, argv, hostname="vm-a") if server_addr != "127.0.0.1"
                                  else argv, stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            hostname = server.stdout.readline().strip()
            client = [sys.executable, "-c", CLIENT, server_addr]
            out = subprocess.run(vmnet.guest_argv(client_addr, client, hostname="vm-b") if client_addr else client,
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
            peer = server.stdout.readline().strip()
        finally:
            server.kill()
            server.wait()
        assert peer == out == (client_addr or "127.0.0.1")
        assert hostname == ("vm-a" if server_addr != "127.0.0.1" else socket.gethostname())


GUEST_CLOCK = "import time; print(repr(time.time()))"


def test_a_guest_starts_no_earlier_than_the_second_after_its_boot_was_asked_for(netns) -> None:
    """tests/vmnet.py: a guest's program starts in a later second of the wall clock than the one its boot
    was asked in (VMNET_BOOT_ASKED_AT, else vmnet's start), as a VM's would; a value that is not a past
    moment is refused before any guest runs. (Why: the module's doc, and the next test.)"""
    if not netns.isolated:
        pytest.skip(f"not isolated: {netns.detail}")

    def boot(asked: str | None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != vmnet.ASKED_AT_ENV}
        if asked is not None:
            env[vmnet.ASKED_AT_ENV] = asked
        argv = vmnet.guest_argv("127.0.1.205", [sys.executable, "-c", GUEST_CLOCK], hostname="vm-c")
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)

    for told in (False, True):
        before = time.time()
        started = boot(repr(before) if told else None)
        assert started.returncode == 0, started.stderr
        assert float(started.stdout) >= math.floor(before) + 1
    for bad in ("soon", "nan", repr(time.time() + 3600)):
        refused = boot(bad)
        assert (refused.returncode, refused.stdout) == (70, ""), refused
        assert f"{vmnet.ASKED_AT_ENV}=" in refused.stderr and "when the boot was asked for" in refused.stderr


@pytest.mark.slurm
def test_a_registration_that_reports_a_boot_before_the_power_up_is_not_the_boot(slurm_factory) -> None:
    """The rule the guests' timing keeps to (tests/vmnet.py): slurmctld takes a node's boot time as its own
    clock less the uptime slurmd reports, and a powering-up node whose slurmd says it booted before the
    power-up was asked for is not up: its registration is taken (BootTime changes) and the node stays
    POWERING_UP (slurmd then sends no other: 22.05's and 24.11's source). Here slurmd runs without -b, so
    its uptime is the machine's, as in a guest whose uptime is not its own (a container on the host's
    kernel, a VM restored with slurmd running).
    The same node then registers from a slurmd -b started after the request."""
    cluster: SlurmCluster = slurm_factory(nodes=["cloud1"])
    cluster.scontrol("update", "NodeName=cloud1", "NodeAddr=127.0.1.1")
    asked = time.time()
    cluster.scontrol("update", "NodeName=cloud1", "State=POWER_UP")
    cluster.wait_until(lambda: cluster.node_state("cloud1"), lambda s: "POWERING_UP" in s.split("+"), 30,
                       "cloud1 powering up")
    not_booted = [a for a in cluster.slurmd_argv("cloud1") if a != "-b"]
    cluster.run(*vmnet.guest_argv("127.0.1.1", not_booted, hostname="cloud1"), timeout=60)
    info = cluster.wait_until(lambda: cluster.node_info("cloud1"), lambda i: i.get("BootTime", "None") != "None",
                              30, "cloud1's registration taken (BootTime)")
    boot_time = time.mktime(time.strptime(info["BootTime"], "%Y-%m-%dT%H:%M:%S"))
    machine_boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    finding("registration of a powering-up node whose slurmd reports the machine's uptime: State; BootTime",
            f"{info['State']}; {'the machine boot' if abs(boot_time - machine_boot) < 3 else info['BootTime']}")
    assert boot_time < asked and "POWERING_UP" in info["State"].split("+"), info
    cluster.stop_slurmd("cloud1")
    cluster.start_slurmd("cloud1", "127.0.1.1")
    cluster.wait_until(lambda: cluster.node_state("cloud1"), lambda s: s == "IDLE+CLOUD", 30, "cloud1 registered")


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
@pytest.mark.parametrize("named", ["by path", "by PowerAction"])
def test_job_boots_cloud_nodes_through_resume_program_and_completes(slurm_factory, tmp_path, named) -> None:
    """Also with the programs named through Slurm 26.05's PowerAction lines (Location=slurmctld): they get the
    same arguments and environment, so check accepts that form on 26.05 (earlier releases refuse it)."""
    record = tmp_path / "resume.jsonl"
    resume = recording_program(tmp_path / "resume", record, action=(
        'boot(HOSTS, ["127.0.1.%d" % (i + 1) for i in range(len(HOSTS))])'))
    cluster: SlurmCluster = slurm_factory(nodes=["cloud1", "cloud2"], resume_program=resume)
    if named == "by PowerAction":
        rewrite_lines(cluster.conf, as_power_actions)
        if cluster.version < (26, 5):
            with pytest.raises(SlurmCommandError, match="unrecognized key: PowerAction"):
                cluster.restart_slurmctld(clear_state=True)
            return
        cluster.restart_slurmctld(clear_state=True)
        assert "ResumeProgram           = nebula_resumeprogram" in cluster.scontrol("show", "config")
    job = cluster.sbatch(nodes=2)
    cluster.wait_job(job, ["COMPLETED"], timeout=40)
    calls = [r for r in cluster.read_jsonl(record) if r["event"] == "call"]
    assert [c["argv"] for c in calls] == [["cloud[1-2]"]]
    # Exactly what slurmctld passes (Python's C-locale coercion adds LC_CTYPE in the program itself).
    assert set(calls[0]["env"]) - {"LC_CTYPE"} == {"SLURM_CONF", "SLURM_RESUME_FILE"}, calls[0]["env"]
    # The resume file of this release, as our resume reads it: the job's id for both nodes.
    content = calls[0]["resume_file"]
    (tmp_path / "resume-file.json").write_text(content)
    assert jobs_from_resume_file({"SLURM_RESUME_FILE": str(tmp_path / "resume-file.json")}) == {
        "cloud1": [job], "cloud2": [job]}
    data = json.loads(content)
    finding("SLURM_RESUME_FILE keys (top level; per job)",
            f"{sorted(data)}; {sorted(data['jobs'][0])}")
    assert sorted(cluster.job_output(job).split()) == ["cloud1", "cloud2"]
    [update] = [r for r in cluster.read_jsonl(record) if r["event"] == "scontrol"]
    assert update["rc"] == 0 and "NodeAddr=127.0.1.1,127.0.1.2" in update["args"]
    assert cluster.node_info("cloud2")["NodeAddr"] == "127.0.1.2"


@pytest.mark.slurm
def test_a_node_registers_from_its_own_address(slurm_factory, tmp_path) -> None:
    """Every guest connects from its VM's address, as on a real cluster (tests/vmnet.py). Here resume tells
    Slurm 127.0.1.9 but the guest is at 127.0.1.1: from 23.11 (cloud_reg_addrs, the default) slurmctld
    takes the address the registration came from, and the hostname slurmd reports; 22.05 keeps resume's."""
    resume = recording_program(tmp_path / "resume", tmp_path / "resume.jsonl",
                               action='boot(HOSTS, ["127.0.1.9"], guest_addrs=["127.0.1.1"])')
    cluster: SlurmCluster = slurm_factory(nodes=["cloud1"], resume_program=resume)
    cluster.scontrol("update", "NodeName=cloud1", "State=POWER_UP")
    cluster.wait_until(lambda: cluster.node_state("cloud1"), lambda s: s == "IDLE+CLOUD", 30, "cloud1 registered")
    info = cluster.node_info("cloud1")
    finding("NodeAddr after registration, resume said 127.0.1.9, slurmd at 127.0.1.1",
            f"{info['NodeAddr']} (NodeHostName {info['NodeHostName']})")
    if cluster.version >= (23, 11):
        assert (info["NodeAddr"], info["NodeHostName"]) == ("127.0.1.1", "cloud1")
        assert "Node cloud1/cloud1/127.0.1.1 powered up" in cluster.log_text("slurmctld.log")
    else:
        assert (info["NodeAddr"], info["NodeHostName"]) == ("127.0.1.9", "cloud1")


@pytest.mark.slurm
def test_stop_ends_every_process_it_started(slurm_factory) -> None:
    cluster: SlurmCluster = slurm_factory(nodes=["cloud1"])
    cluster.scontrol("update", "NodeName=cloud1", "NodeAddr=127.0.1.1")
    pids = [cluster.start_slurmd("cloud1", "127.0.1.1")] + [
        int((cluster.run_dir / f).read_text()) for f in ("slurmctld.pid", "munged.pid")]
    cluster.stop()
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 10, "daemons gone")


FAIL_FIRST_THEN_BOOT = """
if not os.path.exists(RECORD + ".failed"):
    open(RECORD + ".failed", "w").close()
    scontrol("update", "NodeName=" + ",".join(HOSTS), *HANDBACK)
else:
    boot(HOSTS, ["127.0.1.1"])
"""


def hand_back_first(settings: list[str]) -> str:
    """A recording program's action: hand the nodes back with `scontrol update NodeName=... SETTINGS` on the
    first call (as our resume does when it cannot boot them), boot them on any later call."""
    return f"HANDBACK = {settings!r}\n" + FAIL_FIRST_THEN_BOOT


@pytest.mark.slurm
def test_power_down_force_with_reason_hands_a_node_back_at_once(slurm_factory, tmp_path) -> None:
    """The fail-fast hand-back our resume relies on (Slurm 22.05; see docs/SLURM-FINDINGS.md)."""
    resume = recording_program(tmp_path / "resume", tmp_path / "resume.jsonl",
                               action=hand_back_first(["State=POWER_DOWN_FORCE", "Reason=test: no GPU"]))
    suspend = recording_program(tmp_path / "suspend", tmp_path / "suspend.jsonl")
    cluster: SlurmCluster = slurm_factory(nodes=["cloud1"], resume_program=resume, suspend_program=suspend,
                                          resume_timeout=120)
    job = cluster.sbatch(nodes=1)
    # Requeued now, not at ResumeTimeout; the reason stays visible; SuspendProgram runs for the node.
    cluster.wait_for(lambda: cluster.job_info(job).get("Restarts") == "1", 15, "job requeued")
    requeued = time.time()
    # slurmctld may requeue the job before the scontrol that caused it has returned and been recorded.
    [hand_back] = cluster.wait_for(lambda: [r for r in cluster.read_jsonl(tmp_path / "resume.jsonl")
                                            if r["event"] == "scontrol"], 30, "the hand-back recorded")
    info = cluster.node_info("cloud1")
    assert info["Reason"].startswith("test: no GPU [")
    [called] = cluster.wait_for(lambda: cluster.read_jsonl(tmp_path / "suspend.jsonl"), 10,
                                "SuspendProgram called")
    finding("hand-back State=POWER_DOWN_FORCE: job requeued, node state then",
            f"{requeued - hand_back['started']:.1f} s after the command (polled every 0.2 s); {info['State']}")
    finding("hand-back: SuspendProgram called for the node", f"{called['t'] - hand_back['started']:.1f} s after")
    # After SuspendTimeout the node is resumed again for the requeued job, which then completes.
    cluster.wait_job(job, ["COMPLETED"], timeout=40)
    finding("hand-back: the requeued job completed (SuspendTimeout 10, cred_expire 10)",
            f"{time.time() - hand_back['started']:.1f} s after the hand-back")
    assert "Reason" not in cluster.node_info("cloud1")  # cleared when the node registered


@pytest.mark.slurm
def test_down_with_resume_after_is_no_hand_back(slurm_factory, tmp_path) -> None:
    """Why the hand-back is not `State=DOWN Reason=... ResumeAfter=N` on 23.02+ (0.1.0 sent it there): the
    job is requeued at once, but the powering-up node stays unusable until ResumeTimeout and is then DOWN
    for good (until an administrator's State=RESUME); SuspendProgram never runs for it. 22.05 refuses it."""
    resume_timeout = 60  # ResumeAfter fires 20-30 s late (on a periodic pass): well before ResumeTimeout here
    resume = recording_program(tmp_path / "resume", tmp_path / "resume.jsonl",
                               action=hand_back_first(["State=DOWN", "Reason=test: no GPU", "ResumeAfter=5"]))
    suspend = recording_program(tmp_path / "suspend", tmp_path / "suspend.jsonl")
    fail = recording_program(tmp_path / "resume-fail", tmp_path / "fail.jsonl")
    cluster: SlurmCluster = slurm_factory(nodes=["cloud1"], resume_program=resume, suspend_program=suspend,
                                          resume_fail_program=fail, resume_timeout=resume_timeout)
    job = cluster.sbatch(nodes=1)
    [hand_back] = cluster.wait_for(lambda: [r for r in cluster.read_jsonl(tmp_path / "resume.jsonl")
                                            if r["event"] == "scontrol"], 30, "the hand-back recorded")
    if cluster.version < (23, 2):
        assert hand_back["rc"] != 0 and "ResumeAfter" in hand_back["out"], hand_back
        finding("hand-back State=DOWN Reason=... ResumeAfter=5",
                f"refused by scontrol: {hand_back['out'].splitlines()[0]}")
        return
    assert hand_back["rc"] == 0, hand_back
    cluster.wait_for(lambda: cluster.job_info(job).get("Restarts") == "1", 10, "job requeued")
    requeued = time.time() - hand_back["started"]
    # Watch until ResumeTimeout and 8 s past it: the requeued job never gets the node.
    seen: list[str] = []
    deadline = hand_back["started"] + resume_timeout + 8
    while time.time() < deadline:
        state, job_state = cluster.node_state("cloud1"), cluster.job_state(job)
        assert job_state == "PENDING", (job_state, seen)
        if not seen or seen[-1].split(" ", 1)[1] != state:
            seen.append(f"{time.time() - hand_back['started']:.0f}s {state}")
        time.sleep(0.5)
    info = cluster.node_info("cloud1")
    assert {"DOWN", "POWERED_DOWN"} <= set(info["State"].split("+")), seen
    assert "ResumeTimeout reached" in info["Reason"], info
    assert not cluster.read_jsonl(tmp_path / "suspend.jsonl"), "SuspendProgram ran for the node"
    assert cluster.read_jsonl(tmp_path / "fail.jsonl"), "ResumeFailProgram did not run at ResumeTimeout"
    finding(f"hand-back State=DOWN Reason=... ResumeAfter=5 (ResumeTimeout {resume_timeout})",
            f"job requeued {requeued:.1f} s after, then PENDING; node {' -> '.join(seen)}; "
            f"Reason={info['Reason'].split(' [')[0]}; no SuspendProgram, ResumeFailProgram at ResumeTimeout")
