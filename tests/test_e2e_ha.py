"""A backup controller takes over while a resume is in flight (issue 14), through the installed programs.

slurm.conf names two controllers (tests/slurmharness.py `backup_controller`): the primary, host ctl1 at
127.0.0.1, and the backup, host ctl2 in a network namespace of its own at 127.0.0.3, sharing
StateSaveLocation, the programs' configuration and [power] lock_dir. A 2-node job on a 3-node partition
starts a resume; while its VMs boot (the simulator's boot phase is slowed down), the primary is killed
with SIGKILL. The backup takes over after SlurmctldTimeout, the guests register with it, the job runs, and
then there is exactly one VM per powered-up node and none for the powered-down node, also after idle.
What the backup did with the resume in flight is printed (run with -s). Two kill points:

- after-state-save: the primary has written node_state since resume told it the addresses. Seen on 26.05.5
  (and 24.11.5): the backup takes over ~6 s after the kill with the nodes POWERING_UP at their VM
  addresses and the job CONFIGURING; it does not run ResumeProgram again, the guests register with it and
  the job completes on the first resume's VMs (ResumeTimeout is not reached). reconcile: nothing to repair.
- before-state-save: killed the moment resume's NodeAddr update was taken. The backup's state is older:
  nodes powered down (idle~), the job PENDING. The first resume's VMs boot and register; the backup powers
  the idle nodes down (our SuspendProgram terminates those VMs, under the same per-node locks), schedules
  the job again and runs ResumeProgram for it: new VMs, and the job completes (~50 s after the kill). Still
  one VM per node at the end, none for the third; reconcile: nothing to repair.

Between the two, under load (1 run in 6 with two CPU-bound processes beside it): the primary saved the job
allocated and the nodes powering up, but not yet resume's NodeAddr update. The backup recovers the nodes at
NodeAddr=<name> and runs no ResumeProgram again; 22.05 takes no address from slurmd's registration, so
the job's launch finds no address and the job stays COMPLETING. Resume therefore reads the nodes' NodeAddr
once at its end and sets again what slurmctld lost: the last test here makes that case deterministic.

On Slurm 22.05 the job may end FAILED (seen after-state-save): the backup has the nodes at their VM addresses
and starts the job on the first resume's VMs, but the job it recovered has no node alias list (its batch
step sees SLURM_NODE_ALIASES=(null), where a job that did not go through a takeover sees
`gpu01:[127.0.1.1]:gpu01,...`), so srun looks the node names up by DNS, which finds none here: "Can't find
an address, check slurm.conf". The test checks that this is the failure, and then what the programs
guarantee: no VM twice for a node, none left once the nodes idle.
"""

from __future__ import annotations

import re
import struct
import time

import pytest
from e2e_support import E2E, Durations, Stopwatch, job_script, reconcile
from slurm_findings import finding
from slurmharness import BACKUP_HOST, PRIMARY_HOST

pytestmark = pytest.mark.slurm

NODES = ("gpu01", "gpu02", "gpu03")
SLOW_BOOT = Durations(prolog=0.3, boot=12.0, shutdown=0.2, epilog=0.2)  # long enough to kill the primary in
SLURMCTLD_TIMEOUT = 5


def measure(what: str, value: object) -> None:
    print(f"\nHA {what}: {value}")
    finding(f"backup controller: {what}", value)



@pytest.mark.parametrize("kill_point", ["after-state-save", "before-state-save"])
def test_backup_controller_takes_over_a_resume_in_flight_one_vm_per_node(e2e, kill_point) -> None:
    env: E2E = e2e(nodes=NODES, hosts=3, boot_timeout=40, durations=SLOW_BOOT, backup_controller=True,
                   slurmctld_timeout=SLURMCTLD_TIMEOUT, resume_timeout=90)
    c = env.cluster
    assert f"Slurmctld(primary) at {PRIMARY_HOST} is UP" in c.scontrol("ping")
    clock = Stopwatch()
    aliases = c.base / "job-aliases"  # what the batch step was told of its nodes' addresses (22.05)
    job = c.sbatch(script=job_script(first=f'echo "${{SLURM_NODE_ALIASES-unset}}" > {aliases}'), nodes=2)
    # The resume in flight: both VMs made, their addresses told to the primary, neither VM running yet.
    def booting() -> list:
        vms = env.live_vms()
        told = len(vms) == 2 and all(c.node_info(vm.name).get("NodeAddr") == vm.ip for vm in vms)
        return vms if told and not any(vm.state_str == "RUNNING" for vm in vms) else []
    booted = env.wait(booting, 30, "two VMs booting, their addresses in slurmctld")
    told_at = time.time()
    if kill_point == "after-state-save":
        # slurmctld writes node_state within a few seconds of a change; the VMs still boot meanwhile. The
        # file, not its mtime, says whether the addresses are in it: under load the save can come before this
        # poll saw the addresses, and then no later change makes another (a CI run waited 10 s in vain).
        saved = c.base / "state" / "node_state"
        packed = [struct.pack(">I", len(vm.ip) + 1) + vm.ip.encode() + b"\0" for vm in booted]  # packstr()

        def saved_both() -> bool:
            data = saved.read_bytes() if saved.exists() else b""
            return all(p in data for p in packed)
        env.wait(saved_both, 10, "node_state saved with both addresses")
        assert not any(vm.state_str == "RUNNING" for vm in env.live_vms()), "killed after the boot, not during"
    nodes = sorted(vm.name for vm in booted)
    down = sorted(set(NODES) - set(nodes))
    killed_at = clock()
    c.kill_primary()
    measure(f"{kill_point}: primary killed (s after sbatch)",
            f"{killed_at:.1f}, {time.time() - told_at:.1f} s after the addresses, VMs "
            f"{[vm.state_str for vm in env.live_vms()]}")
    c.wait_for(lambda: f"Slurmctld(backup) at {BACKUP_HOST} is UP" in c.scontrol("ping", check=False) and
               "Slurmctld(primary)" in c.scontrol("ping", check=False), 10, "ping through the backup")
    c.wait_for(lambda: re.search(r"taking over|Running as primary controller", c.log_tail("slurmctld-backup.log",
                                                                                           400)),
               SLURMCTLD_TIMEOUT * 6, "the backup taking over")
    measure("backup took over (s after the kill)", f"{clock() - killed_at:.1f}, nodes "
            f"{[c.sinfo_state(n) for n in NODES]} at {[c.node_info(n).get('NodeAddr') for n in NODES]}, "
            f"job {c.job_state(job)}")
    end = c.wait_job(job, ["COMPLETED", "FAILED", "NODE_FAIL", "CANCELLED", "TIMEOUT"], timeout=120)
    told = aliases.read_text().strip() if aliases.exists() else "(the batch step did not run)"
    measure("job end", f"{end}, nodes at {[c.node_info(n).get('NodeAddr') for n in NODES]}, "
            f"SLURM_NODE_ALIASES {told}")
    if end != "COMPLETED" and c.version < (23, 2):
        # Seen on 22.05.8 in most after-state-save runs: the recovered job lost its alias list, srun cannot
        # find the nodes' addresses and the job ends FAILED. Nothing outside slurmctld can give a job its alias
        # list; what the programs guarantee still holds: no VM twice for a node, every VM gone once idle.
        assert told == "(null)" and "Can't find an address" in c.job_output(job), (told, c.job_output(job))
        live = env.live_vms()
        assert len({vm.name for vm in live}) == len(live) and not set(down) & {vm.name for vm in live}, live
        env.wait_nodes(nodes, "idle~", 60)
        env.wait_no_live_vms(30)
        assert reconcile(env, "--dry-run")[-1] == "nothing to repair"
        return
    assert end == "COMPLETED", c.job_output(job)
    measure("job COMPLETED (s after the kill)", f"{clock() - killed_at:.1f}")
    assert sorted(c.job_output(job).split()) == nodes
    measure("resume runs (the first by the primary, any other by the backup)",
            re.findall(r"summary: slurm-nebula-resume (.*?) in", env.program_log_text()))
    # Exactly one VM per powered-up node, none for the powered-down one.
    live = env.live_vms()
    assert sorted(vm.name for vm in live) == nodes, [(vm.id, vm.name, vm.state_str) for vm in live]
    measure("suspend runs", re.findall(r"summary: slurm-nebula-suspend (.*?) in", env.program_log_text()))
    measure("the job ran on the VMs the first resume made", {vm.id for vm in live} == {vm.id for vm in booted})
    measure("VMs made in all", sorted((vm.id, vm.name) for vm in env.sim.vms()))
    for vm in live:
        assert c.node_info(vm.name)["NodeAddr"] == vm.ip
    assert all(c.sinfo_state(n).endswith("~") for n in down)
    measure("reconcile --dry-run after the job", reconcile(env, "--dry-run"))
    # Idle: the backup runs our SuspendProgram; every VM goes.
    env.wait_nodes(nodes, "idle~", 60)
    env.wait_no_live_vms(30)
    assert reconcile(env, "--dry-run")[-1] == "nothing to repair"


def test_a_controller_that_lost_the_addresses_mid_resume_is_told_them_again(e2e) -> None:
    # What the backup recovered in a takeover under load (seen 1 run in 6 with two CPU-bound processes
    # beside the test above): the job allocated and the nodes powering up, from a state saved after the
    # POWER_UP but before resume's NodeAddr update. The backup runs no ResumeProgram again and 22.05 takes
    # no address from slurmd's registration, so the batch launch found no address for gpu01 and the job
    # stayed COMPLETING. Here, deterministically: one controller forgets the addresses while the VMs boot.
    env: E2E = e2e(nodes=NODES[:2], hosts=2, boot_timeout=40, durations=SLOW_BOOT, resume_timeout=90)
    c = env.cluster
    job = c.sbatch(script=job_script(), nodes=2)

    def booting() -> list:
        vms = env.live_vms()
        told = len(vms) == 2 and all(c.node_info(vm.name).get("NodeAddr") == vm.ip for vm in vms)
        return vms if told and not any(vm.state_str == "RUNNING" for vm in vms) else []
    booted = env.wait(booting, 30, "two VMs booting, their addresses in slurmctld")
    names = ",".join(sorted(vm.name for vm in booted))
    c.scontrol("update", f"NodeName={names}", f"NodeAddr={names}")  # the state a takeover recovered
    assert {c.node_info(vm.name).get("NodeAddr") for vm in booted} == {vm.name for vm in booted}
    end = c.wait_job(job, ["COMPLETED", "FAILED", "NODE_FAIL", "CANCELLED", "TIMEOUT"], timeout=120)
    assert end == "COMPLETED", (end, c.job_output(job), c.log_tail("slurmctld.log", 30))
    told = "slurmctld lost the addresses of gpu[01-02] (a controller took over?): told again" \
        in env.program_log_text()
    if c.version >= (23, 11):
        # From 23.11 slurmctld also takes the address a registration comes from (test_slurm_harness.py): a
        # guest whose slurmd registered before resume's last look had its address back already (24.11 under
        # load in CI), and nothing was left to tell.
        log = c.log_text("slurmctld.log")
        registered = all(re.search(rf"Node {vm.name}/\S+/{re.escape(vm.ip)} powered up", log) for vm in booted)
        assert told or registered, log
    else:
        assert told  # 22.05 takes no address from a registration: only resume's telling again gives it back
    measure("lost addresses told again at the end of resume: job",
            f"{end} ({'told again' if told else 'addresses from the registrations'})")
