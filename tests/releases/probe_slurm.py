"""Probes of Slurm behaviour the project depends on, run against each release (not part of the test suite).

Not collected by a plain `pytest` run (the file name does not match test_*.py); run it explicitly, with -s to
see the timelines it prints:

    bash tests/releases/run-in-root.sh trixie -s -q tests/releases/probe_slurm.py       # Slurm 24.11
    bash tests/releases/run-in-root.sh sid    -s -q tests/releases/probe_slurm.py       # Slurm 26.05
    python -m pytest -m slurm -s -q tests/releases/probe_slurm.py                        # the host (22.05)

Each probe prints `PROBE <name> <json>` lines: what the controller did, with times in seconds from the
moment of interest. They assert only what must hold for the probe to mean anything; the observations are
the output. See tests/releases/README.md for what was seen on 22.05, 24.11 and 26.05.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from slurmharness import SlurmCluster, python_program, recording_program, wait_for

pytestmark = pytest.mark.slurm


def report(name: str, **fields: Any) -> None:
    line = f"PROBE {name} {json.dumps(fields, sort_keys=True)}"
    print("\n" + line, flush=True)
    if os.environ.get("PROBE_OUT"):  # a file too: pytest-xdist does not pass a worker's output on
        with open(os.environ["PROBE_OUT"], "a", encoding="utf-8") as out:
            out.write(line + "\n")


def version(cluster: SlurmCluster | dict[str, str]) -> tuple[int, int]:
    """(major, minor) of the Slurm these binaries (or this cluster's) belong to."""
    binaries = cluster if isinstance(cluster, dict) else cluster.binaries
    # slurmctld -V needs no slurm.conf (scontrol --version without SLURM_CONF looks for a config server).
    out = subprocess.run([binaries["slurmctld"], "-V"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"(\d+)\.(\d+)", out)
    assert match, out
    return int(match.group(1)), int(match.group(2))


def snapshot(cluster: SlurmCluster, job: int | None, node: str) -> dict[str, str]:
    n = cluster.node_info(node)
    out = {"node": n.get("State", "?"), "node_reason": re.sub(r" \[.*\]$", "", n.get("Reason", "")),
           "addr": n.get("NodeAddr", ""), "sinfo": cluster.sinfo_state(node)}
    if job is not None:
        j = cluster.job_info(job)
        out.update(job=j.get("JobState", "?"), job_reason=j.get("Reason", ""), restarts=j.get("Restarts", ""))
    return out


def timeline(cluster: SlurmCluster, job: int | None, node: str, seconds: float, t0: float,
             stop: Any = None, interval: float = 0.5) -> list[dict[str, Any]]:
    """Poll the node (and job) for `seconds`; keep only the changes, each with its time since t0."""
    seen: list[dict[str, Any]] = []
    last: dict[str, str] | None = None
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            now = snapshot(cluster, job, node)
        except (subprocess.SubprocessError, OSError, AssertionError) as exc:
            now = {"error": str(exc)[:120]}
        if now != last:
            seen.append({"t": round(time.monotonic() - t0, 1), **now})
            last = now
        if stop is not None and stop(now):
            break
        time.sleep(interval)
    return seen


def calls(cluster: SlurmCluster, record: Path, t0_wall: float) -> list[dict[str, Any]]:
    return [{"t": round(r["t"] - t0_wall, 1), "argv": r["argv"]}
            for r in cluster.read_jsonl(record) if r["event"] == "call"]


# ---- 1. The hand-back: State=DOWN Reason=... ResumeAfter=60 from inside ResumeProgram ------------------

# First call: hand the node back as slurm-nebula-resume does on 23.02+; later calls: boot the node.
HAND_BACK_FIRST = """
import pathlib
flag = pathlib.Path(RECORD + ".handed-back")
if not flag.exists():
    flag.touch()
    note(event="handback", t_mono=time.monotonic())
    scontrol("update", "NodeName=" + ",".join(HOSTS), *HANDBACK)
elif BOOT_LATER:
    boot(HOSTS, ["127.0.1.1"])
"""


def _hand_back_cluster(slurm_factory, tmp_path: Path, handback: list[str], boot_later: bool,
                       resume_timeout: int = 90) -> tuple[SlurmCluster, Path, Path, Path]:
    rec = tmp_path / "resume.jsonl"
    action = f"HANDBACK = {handback!r}\nBOOT_LATER = {boot_later!r}\n" + HAND_BACK_FIRST
    resume = recording_program(tmp_path / "resume", rec, action=action)
    suspend = recording_program(tmp_path / "suspend", tmp_path / "suspend.jsonl")
    fail = recording_program(tmp_path / "resume-fail", tmp_path / "fail.jsonl")
    cluster = slurm_factory(nodes=["cloud1"], resume_program=resume, suspend_program=suspend,
                            resume_fail_program=fail, resume_timeout=resume_timeout)
    return cluster, rec, tmp_path / "suspend.jsonl", tmp_path / "fail.jsonl"


def _handback_run(cluster: SlurmCluster, rec: Path, srec: Path, frec: Path, name: str, seconds: float,
                  cancel: bool) -> None:
    job = cluster.sbatch(nodes=1)
    handed = cluster.wait_for(lambda: [r for r in cluster.read_jsonl(rec) if r["event"] == "handback"], 30,
                              "the hand-back")[0]
    t0, t0_wall = handed["t_mono"], handed["t"]
    if cancel:
        cluster.wait_for(lambda: cluster.job_info(job).get("Restarts") == "1", 10, "requeue")
        cluster.run("scancel", str(job))
    seen = timeline(cluster, None if cancel else job, "cloud1", seconds, t0,
                    stop=lambda s: s.get("job") == "COMPLETED")
    scontrol_out = [{k: r[k] for k in ("args", "rc", "out")} for r in cluster.read_jsonl(rec)
                    if r["event"] == "scontrol"][:2]
    ctld = [line for line in cluster.log_tail("slurmctld.log", 400).splitlines()
            if re.search(r"requeue|Requeu|update_node|resum|POWER|power|not resumed|cloud1", line)
            and "Power save mode" not in line]
    report(name, version="{}.{:02d}".format(*version(cluster)), scontrol=scontrol_out,
           timeline=seen, resume_calls=calls(cluster, rec, t0_wall), suspend_calls=calls(cluster, srec, t0_wall),
           resume_fail_calls=calls(cluster, frec, t0_wall), slurmctld_log=ctld[-40:])


def test_probe_down_resume_after_then_boot(slurm_factory, tmp_path) -> None:
    """DOWN + ResumeAfter=60 on a POWERING_UP node: when is the job requeued, what becomes of the node,
    and does the requeued job get the node (a second ResumeProgram call, which boots it) after 60 s?"""
    cluster, rec, srec, frec = _hand_back_cluster(
        slurm_factory, tmp_path, ["State=DOWN", "Reason=probe: no GPU", "ResumeAfter=60"], boot_later=True)
    if version(cluster) < (23, 2):
        pytest.skip("ResumeAfter is 23.02+")
    _handback_run(cluster, rec, srec, frec, "down_resume_after_then_boot", 120, cancel=False)


def test_probe_down_resume_after_long_resume_timeout(slurm_factory, tmp_path) -> None:
    """As the first probe with ResumeTimeout 150 s (sites use 900): once ResumeAfter has fired, the node is
    IDLE but still POWERING_UP; is the requeued job allocated to it, is ResumeProgram called again, or does
    everything wait for ResumeTimeout?"""
    cluster, rec, srec, frec = _hand_back_cluster(
        slurm_factory, tmp_path, ["State=DOWN", "Reason=probe: no GPU", "ResumeAfter=60"], boot_later=True,
        resume_timeout=150)
    if version(cluster) < (23, 2):
        pytest.skip("ResumeAfter is 23.02+")
    _handback_run(cluster, rec, srec, frec, "down_resume_after_long_resume_timeout", 175, cancel=False)


def test_probe_down_resume_after_job_cancelled(slurm_factory, tmp_path) -> None:
    """The same hand-back, the job then cancelled: does the node go back to idle~ by itself, when, and is
    SuspendProgram or ResumeFailProgram called for it?"""
    cluster, rec, srec, frec = _hand_back_cluster(
        slurm_factory, tmp_path, ["State=DOWN", "Reason=probe: no GPU", "ResumeAfter=60"], boot_later=False)
    if version(cluster) < (23, 2):
        pytest.skip("ResumeAfter is 23.02+")
    _handback_run(cluster, rec, srec, frec, "down_resume_after_job_cancelled", 110, cancel=True)


def test_probe_power_down_force_then_boot(slurm_factory, tmp_path) -> None:
    """The 22.05 hand-back (State=POWER_DOWN_FORCE Reason=...), on every release, for comparison."""
    cluster, rec, srec, frec = _hand_back_cluster(
        slurm_factory, tmp_path, ["State=POWER_DOWN_FORCE", "Reason=probe: no GPU"], boot_later=True)
    _handback_run(cluster, rec, srec, frec, "power_down_force_then_boot", 60, cancel=False)


# Two updates in a row: the 22.05-style hand-back (the job requeued at once, the node powered down through
# SuspendProgram) followed or preceded by a DOWN with ResumeAfter (a cooldown before Slurm may use the node
# again). Does the job still requeue at once, is the node powered down, kept out for the cooldown, back
# by itself afterwards, and does the requeued job then run?
COMBINED = {
    "force_then_down": [["State=POWER_DOWN_FORCE", "Reason=probe: no GPU"],
                        ["State=DOWN", "Reason=probe: no GPU", "ResumeAfter=60"]],
    "down_then_force": [["State=DOWN", "Reason=probe: no GPU", "ResumeAfter=60"],
                        ["State=POWER_DOWN_FORCE", "Reason=probe: no GPU"]],
}

HAND_BACK_TWICE = """
import pathlib
flag = pathlib.Path(RECORD + ".handed-back")
if not flag.exists():
    flag.touch()
    note(event="handback", t_mono=time.monotonic())
    for settings in UPDATES:
        scontrol("update", "NodeName=" + ",".join(HOSTS), *settings)
else:
    boot(HOSTS, ["127.0.1.1"])
"""


@pytest.mark.parametrize("variant", sorted(COMBINED))
def test_probe_combined_hand_back_then_boot(slurm_factory, slurm_binaries, tmp_path, variant) -> None:
    if version(slurm_binaries) < (23, 2):
        pytest.skip("ResumeAfter is 23.02+")
    rec = tmp_path / "resume.jsonl"
    resume = recording_program(tmp_path / "resume", rec, binaries=slurm_binaries,
                               action=f"UPDATES = {COMBINED[variant]!r}\n" + HAND_BACK_TWICE)
    suspend = recording_program(tmp_path / "suspend", tmp_path / "suspend.jsonl", binaries=slurm_binaries)
    fail = recording_program(tmp_path / "resume-fail", tmp_path / "fail.jsonl", binaries=slurm_binaries)
    cluster = slurm_factory(nodes=["cloud1"], resume_program=resume, suspend_program=suspend,
                            resume_fail_program=fail, resume_timeout=90)
    _handback_run(cluster, rec, tmp_path / "suspend.jsonl", tmp_path / "fail.jsonl", f"combined_{variant}",
                  130, cancel=False)


# ---- 2. InstanceId / InstanceType, NodeAddr / NodeHostName across registration ------------------------

SET_AND_BOOT = """
for i, node in enumerate(HOSTS):
    scontrol("update", "NodeName=" + node, "NodeAddr=127.0.1.%d" % (i + 1), "NodeHostname=" + node)
    if INSTANCE:
        scontrol("update", "NodeName=" + node, "InstanceId=10%d" % (i + 1), "InstanceType=opennebula")
    shown = subprocess.run([SCONTROL, "show", "node", "-o", node], capture_output=True, text=True).stdout
    note(event="before", node=node, show=shown)
    extra = SLURMD_EXTRA.get(node, [])
    p = subprocess.run([SLURMD, "-b", "-N", node, "-f", CONF, *extra], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=30)
    note(event="slurmd", node=node, rc=p.returncode, err=p.stderr[-300:])
"""


def test_probe_instance_id_and_address_across_registration(slurm_factory, slurm_binaries, tmp_path) -> None:
    """Resume sets NodeAddr and InstanceId (23.11+), then starts slurmd: cloud1 plain, cloud2 with
    `--instance-id 202 --instance-type probe`. What does `scontrol show node` say before and after?"""
    rec = tmp_path / "resume.jsonl"
    v = version(slurm_binaries)
    instance = v >= (23, 11)
    extra = {"cloud2": ["--instance-id", "202", "--instance-type", "probe"]} if instance else {}
    resume = recording_program(tmp_path / "resume", rec, binaries=slurm_binaries, action=(
        f"INSTANCE = {instance!r}\nSLURMD_EXTRA = {extra!r}\n" + SET_AND_BOOT))
    cluster = slurm_factory(nodes=["cloud1", "cloud2"], resume_program=resume)
    job = cluster.sbatch(nodes=2)
    cluster.wait_job(job, ["COMPLETED", "FAILED"], timeout=60)
    keys = ("NodeAddr", "NodeHostName", "InstanceId", "InstanceType", "State")
    after = {n: {k: cluster.node_info(n).get(k) for k in keys} for n in ("cloud1", "cloud2")}
    before = {}
    for r in cluster.read_jsonl(rec):
        if r["event"] == "before":
            fields = dict(kv.split("=", 1) for kv in r["show"].split() if "=" in kv)
            before[r["node"]] = {k: fields.get(k) for k in keys}
    slurmd = {r["node"]: {"rc": r["rc"], "stderr": r["err"]} for r in cluster.read_jsonl(rec)
              if r["event"] == "slurmd"}
    ctld = [line for line in cluster.log_tail("slurmctld.log", 300).splitlines() if "powered up with" in line]
    report("instance_id_and_address", version="{}.{:02d}".format(*v), job=cluster.job_state(job),
           before_registration=before, after_job=after, slurmd=slurmd, slurmctld_log=ctld)


def test_probe_slurmd_accepts_instance_id_option(slurm_binaries) -> None:
    """Does this slurmd accept --instance-id / --instance-type (23.11+)? (-V: print the version and exit.)"""
    slurmd = slurm_binaries["slurmd"]
    out = {}
    for argv in ([slurmd, "-V"], [slurmd, "--instance-id", "x", "-V"], [slurmd, "--instance-type", "y", "-V"]):
        p = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        out[" ".join(argv[1:])] = {"rc": p.returncode, "out": (p.stdout + p.stderr).strip()[-200:]}
    usage = subprocess.run([slurmd, "--help"], capture_output=True, text=True, timeout=10, check=False)
    out["--help mentions instance-id"] = "instance-id" in (usage.stdout + usage.stderr)
    report("slurmd_instance_id_option", **out)


# ---- 3. A job requeued while its node powers up: when does it get a node again? ---------------------

PROLOG = """
import os, subprocess, sys, time
env = dict(os.environ, SLURM_CONF={conf!r})
job = os.environ.get("SLURM_JOB_ID", "")
with open({log!r}, "a") as f:
    f.write("start %s %.2f\\n" % (job, time.time()))
deadline = time.monotonic() + 90
while time.monotonic() < deadline:
    st = subprocess.run([{squeue!r}, "-h", "-j", job, "-o", "%T"], env=env, capture_output=True,
                        text=True).stdout.strip()
    if st != "CONFIGURING":
        break
    time.sleep(0.2)
with open({log!r}, "a") as f:
    f.write("end %s %.2f %s\\n" % (job, time.time(), st))
sys.exit({code})
"""


@pytest.mark.parametrize("prolog_exit", [0, 1])
def test_probe_requeue_while_powering_up(slurm_factory, tmp_path, prolog_exit) -> None:
    """ResumeProgram /bin/true (the node stays POWERING_UP), a PrologSlurmctld that waits while the job is
    CONFIGURING and then exits `prolog_exit`; `scontrol requeue` the job. When is it allocated again?"""
    cluster = slurm_factory(nodes=["cloud1"], prolog_slurmctld=False)
    plog = cluster.base / "prolog.log"
    prolog = python_program(cluster.base / "bin" / "probe-prolog", PROLOG.format(
        conf=str(cluster.conf), log=str(plog), squeue=cluster.binaries["squeue"], code=prolog_exit))
    cluster.prolog_slurmctld = str(prolog)
    cluster.write_conf()
    cluster.restart_slurmctld()
    job = cluster.sbatch(nodes=1)
    wait_for(lambda: plog.exists() and "start" in plog.read_text(), 20, "prolog started")
    cluster.wait_until(lambda: cluster.node_state("cloud1"), lambda s: "POWERING_UP" in s, 10, "powering up")
    t0 = time.monotonic()
    t0_wall = time.time()
    cluster.scontrol("requeue", str(job))
    seen = timeline(cluster, job, "cloud1", 40, t0,
                    stop=lambda s: plog.read_text().count("start") >= 2 and s.get("job") == "CONFIGURING")
    starts = [(line.split()[0], round(float(line.split()[2]) - t0_wall, 1), *line.split()[3:])
              for line in plog.read_text().splitlines()]
    jinfo = cluster.job_info(job)
    ctld = [line for line in cluster.log_tail("slurmctld.log", 200).splitlines()
            if re.search(rf"JobId={job}|Requeu|requeue|prolog", line)]
    major, minor = version(cluster)
    report(f"requeue_while_powering_up_prolog_exit_{prolog_exit}", version=f"{major}.{minor:02d}",
           timeline=seen, prolog=starts, job_fields={k: jinfo.get(k) for k in (
               "JobState", "Reason", "Restarts", "BeginTime", "EligibleTime", "NodeList", "SchedNodeList")},
           slurmctld_log=ctld[-20:])


# ---- 4. a slurmd -b started in its power-up's own second (tests/vmnet.py's boot wait) ------------------

def _uptime_turns_at() -> float:
    """The fraction of each wall-clock second at which the system's uptime (sysinfo) turns."""
    return (1 - (time.clock_gettime(time.CLOCK_BOOTTIME) - time.clock_gettime(time.CLOCK_REALTIME)) % 1) % 1


@pytest.mark.parametrize("start", ["in the request's second", "as test VMs do"])
def test_probe_slurmd_b_started_in_the_power_up_second(slurm_factory, monkeypatch, start) -> None:
    """16 power-ups, each with slurmctld restarted so that its power-save pass falls early in a second, and
    `slurmd -b` started just before the uptime's second turns (2 ms later each time): how many stay
    POWERING_UP, and their Uptime= lines. "in the request's second" tells vmnet the boot was asked a second
    earlier (no wait: what the harness did before); "as test VMs do" keeps vmnet's wait."""
    nodes = [f"cloud{i}" for i in range(1, 17)]
    cluster: SlurmCluster = slurm_factory(nodes=nodes)
    turns, results = _uptime_turns_at(), []
    for i, node in enumerate(nodes, 1):
        addr = f"127.0.1.{i}"
        time.sleep((int(time.time()) + 1.55) - time.time())  # slurmctld's pass then lands early in a second
        cluster.restart_slurmctld(clear_state=True)
        cluster.scontrol("update", f"NodeName={node}", f"NodeAddr={addr}")
        cluster.scontrol("update", f"NodeName={node}", "State=POWER_UP")
        seen = cluster.wait_until(lambda n=node: (time.time(), cluster.node_state(n)),
                                  lambda s: "POWERING_UP" in s[1], 30, f"{node} powering up")[0]
        time.sleep(max(0.0, int(seen) + turns - 0.165 + i * 0.002 - time.time()))
        if start == "in the request's second":
            monkeypatch.setenv("VMNET_BOOT_ASKED_AT", repr(time.time() - 1))
        cluster.start_slurmd(node, addr)
        time.sleep(2.5)
        uptime = re.findall(r"Uptime=(\d+)", cluster.log_text(f"slurmd-{node}.log"))
        results.append({"node": node, "state": cluster.node_state(node), "uptime": uptime})
    stuck = [r for r in results if "POWERING_UP" in r["state"]]
    report("slurmd_b_in_the_power_up_second", start=start, stuck=len(stuck), of=len(results),
           uptime_of_stuck=[r["uptime"] for r in stuck], uptime_turns_at=round(turns, 3))


# ---- Stepping a short node set out of Slurm's way (issue 33) --------------------------------------------
# Nodes gpa[1-2] (listed first: slurmctld allocates them first at equal weight) and gpb[1-2] in one partition.
# ResumeProgram hands gpa back (POWER_DOWN_FORCE) and applies STEP to them; gpb boots. Where does the
# requeued 2-node job run, after how long, how often is gpa resumed, and does the step-out survive the
# power-down (idle_on_node_suspend)? Then: undrain (STEP_BACK), and does the next job run on gpa?
STEP_OUT = """
if HOSTS[0].startswith("gpa"):
    note(event="handback", t_mono=time.monotonic())
    for settings in UPDATES:
        scontrol("update", "NodeName=" + ",".join(HOSTS), *settings)
else:
    boot(HOSTS, ["127.0.1.%d" % (int(h[-1]) + 4) for h in HOSTS])
"""

STEP_VARIANTS = {
    "force_then_drain": [["State=POWER_DOWN_FORCE", "Reason=nebula: no GPU"],
                         ["State=DRAIN", "Reason=nebula: out of service: no GPU"]],
    "drain_then_force": [["State=DRAIN", "Reason=nebula: out of service: no GPU"],
                         ["State=POWER_DOWN_FORCE", "Reason=nebula: no GPU"]],
    "force_only": [["State=POWER_DOWN_FORCE", "Reason=nebula: no GPU"]],
}


@pytest.mark.parametrize("variant", sorted(STEP_VARIANTS))
def test_probe_step_out(slurm_factory, slurm_binaries, tmp_path, variant) -> None:
    rec = tmp_path / "resume.jsonl"
    resume = recording_program(tmp_path / "resume", rec, binaries=slurm_binaries,
                               action=f"UPDATES = {STEP_VARIANTS[variant]!r}\n" + STEP_OUT)
    suspend = recording_program(tmp_path / "suspend", tmp_path / "suspend.jsonl", binaries=slurm_binaries)
    cluster = slurm_factory(nodes=["gpa1", "gpa2", "gpb1", "gpb2"], resume_program=resume,
                            suspend_program=suspend, resume_timeout=60, cred_expire=None)
    t0 = time.monotonic()
    job = cluster.sbatch(nodes=2)
    seen: list[dict[str, Any]] = []
    last = None
    while time.monotonic() - t0 < 200:
        j = cluster.job_info(job)
        now = {"job": j.get("JobState"), "nodes": j.get("NodeList"), "restarts": j.get("Restarts"),
               "reason": j.get("Reason"),
               **{n: cluster.node_info(n).get("State", "?") + " " + re.sub(r" \[.*\]$", "",
                                                                         cluster.node_info(n).get("Reason", ""))
                  for n in ("gpa1", "gpb1")}}
        if now != last:
            seen.append({"t": round(time.monotonic() - t0, 1), **now})
            last = now
        if now["job"] in ("COMPLETED", "FAILED"):
            break
        time.sleep(0.5)
    resumes = [r["argv"] for r in cluster.read_jsonl(rec) if r["event"] == "call"]
    after: dict[str, Any] = {}
    for node, how in (("gpa1", "State=UNDRAIN"), ("gpa2", "State=RESUME")):
        done = cluster.run("scontrol", "update", f"NodeName={node}", how, check=False)
        said = done.stdout + done.stderr
        time.sleep(2)
        after[how] = [said.strip(), cluster.node_info(node).get("State")]
    report(f"step_out_{variant}", version="{}.{:02d}".format(*version(cluster)), timeline=seen,
           resumes=resumes, after=after)


def test_probe_down_after_resume_timeout_returned(slurm_factory, slurm_binaries, tmp_path) -> None:
    """A node left down~ by ResumeTimeout (no slurmd ever registers): what do UNDRAIN, RESUME, IDLE and
    POWER_DOWN_FORCE make of it, and is it allocated again afterwards?"""
    rec = tmp_path / "resume.jsonl"
    resume = recording_program(tmp_path / "resume", rec, binaries=slurm_binaries)
    cluster = slurm_factory(nodes=["cloud1", "cloud2", "cloud3", "cloud4"], resume_program=resume,
                            resume_timeout=8, cred_expire=None)
    job = cluster.sbatch(nodes=4)
    t0 = time.monotonic()
    series0 = timeline(cluster, job, "cloud1", 40, t0, stop=lambda s: s.get("node", "").startswith("DOWN"))
    cluster.run("scancel", str(job))
    series0 += timeline(cluster, None, "cloud1", 25, t0, stop=None)
    before = {n: cluster.node_info(n).get("State") + " " + cluster.node_info(n).get("Reason", "")
              for n in ("cloud1",)}
    out: dict[str, Any] = {}
    for node, how in (("cloud1", ["State=UNDRAIN"]), ("cloud2", ["State=RESUME"]), ("cloud3", ["State=IDLE"]),
                      ("cloud4", ["State=POWER_DOWN_FORCE", "Reason=nebula: x"])):
        done = cluster.run("scontrol", "update", f"NodeName={node}", *how, check=False)
        said = done.stdout + done.stderr
        series = []
        for _ in range(12):
            series.append(cluster.node_info(node).get("State"))
            time.sleep(1)
        out[" ".join(how)] = {"said": said.strip(), "states": sorted(set(series), key=series.index),
                              "reason": cluster.node_info(node).get("Reason", "")}
    report("down_after_resume_timeout", version="{}.{:02d}".format(*version(cluster)), before=before, series=series0,
           updates=out)


# The hand-back's drain is gone once the power-down starts (idle_on_node_suspend, seen above). A drain set
# by SuspendProgram (the node POWERING_DOWN) or on a POWERED_DOWN node: does it last, does the job go to
# gpb, and which update lets the node take jobs again?
SUSPEND_DRAINS = """
if HOSTS and HOSTS[0].startswith("gpa"):
    scontrol("update", "NodeName=" + ",".join(HOSTS), "State=DRAIN", "Reason=nebula: out of service: no GPU")
"""


def _nodes_row(cluster: SlurmCluster, job: int | None) -> dict[str, Any]:
    row: dict[str, Any] = {}
    if job is not None:
        j = cluster.job_info(job)
        row.update(job=j.get("JobState"), nodes=j.get("NodeList"), restarts=j.get("Restarts"))
    for n in ("gpa1", "gpb1"):
        info = cluster.node_info(n)
        row[n] = info.get("State", "?") + " " + re.sub(r" \[.*\]$", "", info.get("Reason", ""))
    return row


def _watch(cluster: SlurmCluster, job: int | None, seconds: float, done: Any) -> list[dict[str, Any]]:
    t0, seen, last = time.monotonic(), [], None
    while time.monotonic() - t0 < seconds:
        row = _nodes_row(cluster, job)
        if row != last:
            seen.append({"t": round(time.monotonic() - t0, 1), **row})
            last = row
        if done(row):
            break
        time.sleep(0.3)
    return seen


@pytest.mark.parametrize("back", ["State=UNDRAIN", "State=IDLE", "State=RESUME"])
def test_probe_step_out_by_suspend_then_back(slurm_factory, slurm_binaries, tmp_path, back) -> None:
    rec = tmp_path / "resume.jsonl"
    resume = recording_program(tmp_path / "resume", rec, binaries=slurm_binaries,
                               action=f"UPDATES = {STEP_VARIANTS['force_only']!r}\n" + STEP_OUT)
    suspend = recording_program(tmp_path / "suspend", tmp_path / "suspend.jsonl", binaries=slurm_binaries,
                                action=SUSPEND_DRAINS)
    cluster = slurm_factory(nodes=["gpa1", "gpa2", "gpb1", "gpb2"], resume_program=resume,
                            suspend_program=suspend, resume_timeout=60, cred_expire=10)
    job = cluster.sbatch(nodes=2, script="#!/bin/sh\nsleep 5\n")
    first = _watch(cluster, job, 150, lambda r: r["job"] in ("COMPLETED", "FAILED"))
    second_job = cluster.sbatch(nodes=2, script="#!/bin/sh\nsleep 1\n")
    second = _watch(cluster, second_job, 40, lambda r: r["job"] in ("RUNNING", "COMPLETED", "FAILED"))
    done = cluster.run("scontrol", "update", "NodeName=gpa[1-2]", back, check=False)
    after_back = _watch(cluster, None, 4, lambda r: False)
    third_job = cluster.sbatch("-w", "gpa[1-2]", nodes=2, script="#!/bin/sh\nsleep 1\n")
    third = _watch(cluster, third_job, 30, lambda r: int(r.get("restarts") or 0) > 0 or r["job"] == "RUNNING")
    resumes = [r["argv"] for r in cluster.read_jsonl(rec) if r["event"] == "call"]
    report(f"step_out_by_suspend_back_{back}", version="{}.{:02d}".format(*version(cluster)), first=first,
           second=second, back=(done.stdout + done.stderr).strip(), after_back=after_back, third=third,
           resumes=resumes)
