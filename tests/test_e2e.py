"""End to end (issue 4): a real slurmctld runs our installed programs against the OpenNebula simulator.

slurmctld's ResumeProgram, SuspendProgram and ResumeFailProgram are the console scripts installed beside
this Python (`slurm-nebula-resume`, ...), configured by the nebula-power.toml beside slurm.conf; they run
the real scontrol. Each simulated VM's guest is its slurmd, started and stopped by the simulator's hooks;
slurm.conf has no NodeAddr, so the job reaches a VM only through the address our resume tells slurmctld.
See tests/e2e_support.py for the wiring and docs/SLURM-FINDINGS.md for what Slurm 22.05 does.

Timings (short on purpose): SuspendTime 4 s, SuspendTimeout 6 s, ResumeTimeout 60 s, boot_timeout 6 s,
cred_expire 5 s, simulated VM phases 0.2-0.4 s. The measured times are printed (run with -s to see them).
"""

from __future__ import annotations

import re
import subprocess

import pytest
from e2e_support import (
    DONE,
    E2E,
    HAND_BACK_LINE,
    RESUME,
    SUSPEND,
    Durations,
    Stopwatch,
    hand_back_line,
    job_script,
)
from slurm_findings import finding

pytestmark = pytest.mark.slurm

NODES = ("gpu01", "gpu02")
GPU_TEMPLATE_ID = "0"  # the simulator's slurm-gpu-worker



def measure(what: str, seconds: float) -> None:
    print(f"\nE2E-TIME {what}: {seconds:.1f} s")


def summaries(env: E2E, program: str) -> list[str]:
    """The outcome in each summary line one of our programs logged: 'gpu[01-02]: 2 done, 0 failed', or
    'gpu01: 0 done, 1 failed (<reason>: gpu01)'. Tests check these, the scontrol commands and the cloud,
    not the wording of the other log lines."""
    return re.findall(rf"summary: {program} (\S+: \d+ done, \d+ failed.*?) in [\d.]+s, ",
                      env.program_log_text())


def wait_running(env: E2E, job: int, timeout: float = 90) -> str:
    """Wait until the job has started (RUNNING, or already past it)."""
    return env.wait(lambda: env.cluster.job_state(job) in ("RUNNING", "COMPLETING", "COMPLETED")
                    and env.cluster.job_state(job), timeout, f"job {job} running")


def run_full_cycle(env: E2E, label: str) -> tuple[int, dict[str, object]]:
    """sbatch -N 2, check it ran on VMs whose IPs are the NodeAddrs, then wait for the power-down.

    Returns the job id and each node's VM (as it was while the job ran).
    """
    c = env.cluster
    clock = Stopwatch()
    job = c.sbatch(script=job_script(sleep=2), nodes=2)
    wait_running(env, job)
    measure(f"{label} sbatch -> job RUNNING", clock())
    vms = {}
    for node in NODES:
        [vm] = env.vms_of(node, live=True)
        assert vm.state_str == "RUNNING"
        assert vm.template["TEMPLATE_ID"] == GPU_TEMPLATE_ID, "a VM of the GPU template"
        assert vm.pci, "holding a GPU"
        assert vm.ip and vm.ip.startswith("127.0.1.")
        assert env.addr_at_boot(node) == vm.ip  # before slurmd registered: only our update can have put it there
        assert (c.node_info(node)["NodeAddr"], c.node_info(node)["NodeHostName"]) == (vm.ip, node)
        vms[node] = vm
    assert env.gpus_free() == env.gpus_total() - 2
    c.wait_job(job, ["COMPLETED"], timeout=30)
    assert sorted(c.job_output(job).split()) == list(NODES)
    # Idle -> SuspendTime -> our SuspendProgram terminates the VMs -> SuspendTimeout -> idle~.
    env.wait(lambda: all(c.sinfo_state(n) == "idle" for n in NODES) or not env.live_vms(), 10, "nodes idle")
    idle = Stopwatch()
    env.wait_no_live_vms(timeout=30)
    measure(f"{label} idle -> VMs terminated (DONE)", idle())
    env.wait_nodes(NODES, "idle~", timeout=30)
    measure(f"{label} idle -> nodes idle~", idle())
    assert env.gpus_free() == env.gpus_total()
    return job, vms


# ---- 1 ------------------------------------------------------------------------------------------------

def test_1_sbatch_two_nodes_boots_gpu_vms_runs_and_powers_them_down(e2e) -> None:
    env = e2e()
    job, vms = run_full_cycle(env, "scenario 1")
    assert summaries(env, "slurm-nebula-resume") == ["gpu[01-02]: 2 done, 0 failed"]  # one call, both nodes
    assert summaries(env, "slurm-nebula-suspend") == ["gpu[01-02]: 2 done, 0 failed"]
    assert re.search(r"scontrol update NodeName=gpu01,gpu02 NodeAddr=127\.0\.1\.\d+,127\.0\.1\.\d+ "
                     r"NodeHostname=gpu01,gpu02", env.program_log_text())
    for node, vm in vms.items():
        assert vm.user_template["SLURM_JOB_IDS"] == str(job)  # both VMs carry the job's id
        assert env.vms_of(node) == [env.sim.vm(vm.id)] and env.sim.vm(vm.id).state == DONE
    # The guests were the VMs: each slurmd was started for its VM's IP and stopped when the VM was (the
    # on_stopped hook records that once slurmd has exited, which can trail the VM's DONE on a busy machine).
    def events() -> list[tuple[str, str, str]]:
        return [(e["event"], e["node"], e["action"]) for e in env.hook_events()]
    env.wait(lambda: sum(e[0] == "stopped" for e in events()) >= len(NODES), 20, "both guests' halt recorded")
    assert sorted(events()) == sorted([("running", n, "slurmd") for n in NODES]
                                    + [("stopped", n, "stopped slurmd") for n in NODES])
    assert "Reason" not in env.cluster.node_info("gpu01")


# ---- 2 ------------------------------------------------------------------------------------------------

def test_2_job_ids_from_the_resume_file_reach_the_vms(e2e) -> None:
    env = e2e()
    c = env.cluster
    # Two jobs, one node each, submitted together: each VM records the job it was created for.
    jobs = {node: c.sbatch(f"--nodelist={node}", script=job_script(), nodes=1) for node in NODES}
    for node, job in jobs.items():
        c.wait_job(job, ["COMPLETED"], timeout=40)
        assert c.job_output(job).split() == [node]
        [vm] = env.vms_of(node)
        assert vm.user_template["SLURM_JOB_IDS"] == str(job), vm.user_template
        assert vm.user_template["SLURM_NODENAME"] == node and vm.user_template["SLURM_CLUSTER"] == "cloudtest"
    print(f"\nE2E-RESUME-CALLS scenario 2: {summaries(env, 'slurm-nebula-resume')}")


# ---- 3 ------------------------------------------------------------------------------------------------

def test_3_node_without_a_free_gpu_is_handed_back_at_once_best_effort_keeps_the_other(e2e) -> None:
    # One GPU in the whole cloud; the job needs two. Best-effort: the node that fits starts, the other is
    # handed back before any VM is made for it (the count), so the job requeues in seconds.
    env = e2e(hosts=1, gpus_per_host=1, nodeset_extra='job_policy = "best-effort"\n')
    c = env.cluster
    job = c.sbatch(script=job_script(), nodes=2)
    submitted = Stopwatch()
    env.wait(lambda: c.job_info(job).get("Restarts") == "1", 30, "job requeued")
    measure("scenario 3 sbatch -> hand-back (job requeued)", submitted())
    # Read now: after cred_expire the requeued job may resume gpu02 again, which clears the reason.
    info = c.node_info("gpu02")
    why = f"job {job}: needs 2 GPUs 10de:0302, 1 free"
    # This resume's summary, not the first one logged: cred_expire (5 s) after the requeue the job may be
    # scheduled again, and that resume of gpu02 alone (handed back at once: gpu01's VM holds the GPU) can end
    # before this one, which waits for gpu01's VM.
    def this_resume() -> list[str]:
        return [line for line in summaries(env, "slurm-nebula-resume") if line.startswith("gpu[01-02]: ")]

    env.wait(this_resume, 10 + env.boot_timeout, "resume of gpu[01-02] finished")
    # "At once" is an order, not a time: the hand-back (whose scontrol returns after slurmctld requeued the
    # job) is done before resume even asks oned for gpu01's VM, so nothing waits on a boot or a timeout.
    lines = env.program_log_text().splitlines()
    handed = next(i for i, line in enumerate(lines) if "handed gpu02 back to Slurm" in line)
    created = next(i for i, line in enumerate(lines) if "node=gpu01 vm=0 action=instantiate" in line)
    assert handed < created, lines
    assert this_resume() == [f"gpu[01-02]: 1 done, 1 failed ({why}: gpu02)"]
    assert len(env.vms_of("gpu01")) == 1 and env.vms_of("gpu02") == [], "no VM for the node the count refused"
    # The simulated guest's boot (the hook: a scontrol, then slurmd) took 10.3 s once with all three releases'
    # suites on 2 cores: this is about which node best-effort kept, not how fast a guest boots, so the bound
    # is Slurm's own for a boot, ResumeTimeout (60).
    env.wait(lambda: ("running", "gpu01", "slurmd") in [(e["event"], e["node"], e["action"])
                                                          for e in env.hook_events()],
             60, "best-effort kept gpu01: its VM ran and its slurmd started")
    log = env.program_log_text()
    hand_back = re.findall(HAND_BACK_LINE, log)[0]
    print(f"\nE2E-HANDBACK {hand_back}")
    assert hand_back == hand_back_line(env, "gpu02", f"nebula: {why}")
    # the hand-back's Reason, or the step-out's that quotes it (SuspendProgram drains the node: stepout.py)
    assert info["Reason"].startswith((f"nebula: {why} [", "nebula: out of service since ")), info
    assert why in info["Reason"], info
    assert "POWER" in info["State"], info  # POWER_DOWN, POWERING_DOWN or POWERED_DOWN: back in the pool
    assert f"requeue job JobId={job} due to failure of node gpu02" in c.log_text("slurmctld.log")
    # SuspendProgram is called for the handed-back node (it finds no VM); the cause lasts, so cancel the
    # job: afterwards nothing may stay behind. slurmctld's own power-save pass starts it: 1-2 s after the
    # hand-back idle, 10-11 s in full runs of 24.11 and 26.05 under load (their logs: lookups of the powered-
    # down node's name failing first; 26.05 retries one ten times a second apart), and the program then asks
    # slurmctld about the node set's nodes (stepout.py). 26.05 logs "power action __suspendprog__ on nodes".
    env.wait(lambda: re.search(r"(suspending nodes|power action __suspendprog__ on nodes) gpu02\b",
                               c.log_text("slurmctld.log")), 30,
             "slurmctld's power-save pass suspending the handed-back node")
    env.wait(lambda: "gpu02: 1 done, 0 failed" in summaries(env, "slurm-nebula-suspend"), 20,
             "SuspendProgram for the handed-back node")
    c.run("scancel", str(job))
    env.wait_no_live_vms(timeout=env.boot_timeout + 30)
    env.wait_powered_down(NODES, timeout=30)  # drain~ while the node set is short (stepout.py)
    assert env.gpus_free() == env.gpus_total()


# ---- 4 ------------------------------------------------------------------------------------------------

def test_4a_boot_failure_is_recreated_and_the_job_runs(e2e) -> None:
    env = e2e(durations=Durations(prolog=0.3, boot=1.0, shutdown=0.2, epilog=0.2))
    c = env.cluster
    job = c.sbatch(script=job_script(), nodes=2)
    first = env.wait(lambda: next((vm for vm in env.vms_of("gpu01") if vm.lcm_name == "BOOT"), None), 30,
                     "gpu01's VM booting")
    env.sim.fail_vm(first.id, "BOOT_FAILURE")  # the simulator fails this boot
    c.wait_job(job, ["COMPLETED"], timeout=40)
    assert sorted(c.job_output(job).split()) == list(NODES)
    assert c.job_info(job)["Restarts"] == "0"  # recovered inside the resume: no requeue
    old, new = env.vms_of("gpu01")
    assert old.id == first.id and old.state == DONE and not old.pci  # terminated, its GPU freed
    assert new.state_str == "RUNNING" and env.addr_at_boot("gpu01") == new.ip
    assert c.node_info("gpu01")["NodeAddr"] == new.ip
    assert "recreating" in env.program_log_text()
    # The job may finish before resume's next look at the recreated VM: wait for its summary.
    env.wait(lambda: summaries(env, "slurm-nebula-resume"), 10, "resume finished")
    assert summaries(env, "slurm-nebula-resume") == ["gpu[01-02]: 2 done, 0 failed"]
    assert len(env.vms_of("gpu02")) == 1
    env.wait_no_live_vms(timeout=30)
    env.wait_nodes(NODES, "idle~", timeout=30)
    assert env.gpus_free() == env.gpus_total()


def test_4b_boot_failing_again_is_handed_back_and_leaks_nothing(e2e) -> None:
    env = e2e(nodes=("gpu01",), hosts=1)
    c = env.cluster
    env.sim.set_faults(boot_failure_rate=1.0)  # every boot fails
    job = c.sbatch(script=job_script(), nodes=1)
    env.wait(lambda: c.job_info(job).get("Restarts") == "1", 30 + env.boot_timeout, "job requeued")
    info = c.node_info("gpu01")
    assert info["Reason"].startswith("nebula: VM failed to boot (ACTIVE/BOOT_FAILURE) ["), info
    env.wait(lambda: summaries(env, "slurm-nebula-resume"), 5, "resume finished")
    log = env.program_log_text()
    assert "recreating" in log  # one recreation (recreate_attempts = 1), then the hand-back
    assert hand_back_line(env, "gpu01", "nebula: VM failed to boot") in log
    assert summaries(env, "slurm-nebula-resume")[0] == \
        "gpu01: 0 done, 1 failed (VM failed to boot (ACTIVE/BOOT_FAILURE): gpu01)"
    c.run("scancel", str(job))
    env.wait_no_live_vms(timeout=30)  # both failed VMs terminated (through CLEANUP_DELETE)
    assert len(env.vms_of("gpu01")) >= 2
    env.wait_nodes(["gpu01"], "idle~", timeout=30)
    assert env.gpus_free() == env.gpus_total()
    assert not [e for e in env.hook_events() if e["event"] == "running"]  # no VM ever ran


# ---- 5 ------------------------------------------------------------------------------------------------

def test_5_vm_whose_slurmd_never_registers_is_terminated_by_resume_fail(e2e) -> None:
    env = e2e(nodes=("gpu01",), resume_timeout=12, boot_timeout=4)
    c = env.cluster
    env.no_slurmd("gpu01")  # the VM runs, its guest never registers
    job = c.sbatch(script=job_script(), nodes=1)
    vm = env.wait(lambda: next((v for v in env.vms_of("gpu01") if v.state_str == "RUNNING"), None), 30,
                  "gpu01's VM running")
    env.wait(lambda: summaries(env, "slurm-nebula-resume"), 5, "resume finished")
    assert summaries(env, "slurm-nebula-resume") == ["gpu01: 1 done, 0 failed"]  # for Slurm, a success
    assert c.sinfo_state("gpu01") == "allocated#"  # slurmctld waits for slurmd until ResumeTimeout
    env.wait(lambda: summaries(env, "slurm-nebula-resume-fail"), c.resume_timeout + 15,
             "ResumeFailProgram run")
    assert summaries(env, "slurm-nebula-resume-fail") == ["gpu01: 1 done, 0 failed"]
    assert env.sim.vm(vm.id).state == DONE
    assert "never registered" in env.program_log_text()
    assert env.gpus_free() == env.gpus_total()
    info = c.node_info("gpu01")
    finding("ResumeTimeout (slurmd never registers): node afterwards; job",
            f"{info['State']} Reason={info.get('Reason', '').split(' [')[0]}; "
            f"{c.job_info(job)['JobState']} Restarts={c.job_info(job)['Restarts']}")
    assert info["State"].startswith("DOWN") and info["Reason"].startswith("ResumeTimeout reached"), info
    assert c.job_info(job)["Restarts"] == "1"
    assert summaries(env, "slurm-nebula-suspend") == []  # Slurm calls only ResumeFailProgram here
    c.run("scancel", str(job))


# ---- 6 ------------------------------------------------------------------------------------------------

def test_6_second_job_after_suspend_resumes_the_same_nodes_with_new_vms(e2e) -> None:
    env = e2e()
    _, first = run_full_cycle(env, "scenario 6, first job")
    _, second = run_full_cycle(env, "scenario 6, second job")
    for node in NODES:
        assert second[node].id != first[node].id
        assert [vm.id for vm in env.vms_of(node)] == [first[node].id, second[node].id]
    assert summaries(env, "slurm-nebula-resume") == ["gpu[01-02]: 2 done, 0 failed"] * 2


# ---- 7 ------------------------------------------------------------------------------------------------

def test_7_by_hand_resume_brings_the_node_up_and_suspend_takes_it_down(e2e) -> None:
    """An administrator types the programs with the controller running (environment: SLURM_CONF only).

    `slurm-nebula-resume gpu01` on a powered-down node is refused (exit 2, nothing done): slurmctld is not
    powering it up, and the way to bring it up is `scontrol update NodeName=gpu01 State=POWER_UP`. With
    `--force` it has that command's effect: the VM runs, NodeAddr is its IP, its slurmd registers, and
    slurmctld takes the node out of power saving (`idle~` -> `idle`, IDLE+CLOUD): a job then runs there at once, without
    slurmctld calling ResumeProgram. `slurm-nebula-suspend gpu01` terminates the VM (GPU freed, slurmd
    gone) but, like every SuspendProgram, does not tell slurmctld: the node still shows `idle` until the
    administrator runs `scontrol update NodeName=gpu01 State=POWER_DOWN_FORCE` (or uses `scontrol update
    State=POWER_DOWN` instead of typing the program, which calls it), then `idle~` after SuspendTimeout.
    """
    env = e2e(nodes=("gpu01",), suspend_time=60)  # Slurm's own idle timer stays out of the way
    c = env.cluster
    admin_env = {"SLURM_CONF": str(c.conf), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    assert c.sinfo_state("gpu01") == "idle~"
    refused = subprocess.run([str(RESUME), "gpu01"], env=admin_env, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and "State=POWER_UP (or --force)" in refused.stderr, refused.stderr
    assert not env.vms_of("gpu01")
    up = subprocess.run([str(RESUME), "--force", "gpu01"], env=admin_env, capture_output=True, text=True,
                        timeout=60)
    assert up.returncode == 0, up.stderr
    [vm] = env.vms_of("gpu01", live=True)
    assert vm.state_str == "RUNNING" and vm.user_template["SLURM_NODENAME"] == "gpu01"
    assert "SLURM_JOB_IDS" not in vm.user_template  # no SLURM_RESUME_FILE by hand
    env.wait(lambda: c.node_state("gpu01") == "IDLE+CLOUD", 15, "gpu01 registered and powered up")
    assert env.addr_at_boot("gpu01") == vm.ip
    assert c.node_info("gpu01")["NodeAddr"] == vm.ip
    job = c.sbatch(script=job_script(), nodes=1)
    c.wait_job(job, ["COMPLETED"], timeout=30)
    assert c.job_output(job).split() == ["gpu01"]
    assert summaries(env, "slurm-nebula-resume") == ["gpu01: 1 done, 0 failed"]  # slurmctld called none

    down = subprocess.run([str(SUSPEND), "gpu01"], env=admin_env, capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    assert env.sim.vm(vm.id).state == DONE and env.gpus_free() == env.gpus_total()
    env.wait(lambda: [e["action"] for e in env.hook_events() if e["event"] == "stopped"]
             == ["stopped slurmd"], 10, "slurmd stopped with its VM")
    assert c.sinfo_state("gpu01") in ("idle", "idle*")  # slurmctld was not told: not powered down
    c.scontrol("update", "NodeName=gpu01", "State=POWER_DOWN_FORCE", "Reason=admin: powered down by hand")
    env.wait_nodes(["gpu01"], "idle~", timeout=c.suspend_timeout + 10)
    assert summaries(env, "slurm-nebula-suspend")[-1] == "gpu01: 1 done, 0 failed"  # called, found no VM
    assert "no VM of ours" in env.program_log_text()
    assert not env.live_vms()
