"""Host maintenance and host failure with a real slurmctld (22.05 here, 24.11 and 26.05 in the release roots)
and the simulator: what reconcile's updates make Slurm do (drift.py, slurm.Scontrol.set_drain / hand_back).

- A host OpenNebula marks DISABLED (or OFFLINE) under a running job: reconcile drains the node, the Reason
  names the host, the job runs to its end, the idle node is powered down as usual (its VM terminated), and its
  next VM goes to another host.
- A VM forced to UNKNOWN (host failure) or POWEROFF (a killed hypervisor process) under a running job:
  reconcile removes it and hands the node back; the job goes back to the queue and runs again on a new VM.
The measured figures are printed (-s) and recorded as Slurm findings.
"""

from __future__ import annotations

import pyone
import pytest
from e2e_support import DONE, E2E, Stopwatch, job_script, reconcile
from slurm_findings import finding

pytestmark = pytest.mark.slurm

NODES = ("gpu01", "gpu02")



def measure(what: str, value: object) -> None:
    print(f"\nFLEET {what}: {value}")
    finding(what, value)


def running_vm(env: E2E, node: str):
    return env.wait(lambda: next((v for v in env.vms_of(node, live=True) if v.state_str == "RUNNING"), None), 60,
                    f"{node}'s VM running")


@pytest.mark.parametrize("host_state", ["DISABLED", "OFFLINE"])
def test_a_host_in_maintenance_drains_its_node_the_job_finishes_and_the_node_powers_down(e2e, host_state) -> None:
    env: E2E = e2e(nodes=NODES, hosts=2, boot_timeout=20)
    c = env.cluster
    stop = c.base / "stop-job"
    job = c.sbatch(script=job_script(first=f"while [ ! -e {stop} ]; do sleep 0.2; done"), nodes=1)
    env.wait(lambda: c.job_state(job) == "RUNNING", 60, f"job {job} running")
    node = c.job_info(job)["NodeList"]
    vm = running_vm(env, node)
    env.sim.set_host_state(vm.host, host_state)  # onehost disable / onehost offline
    clock = Stopwatch()
    out = reconcile(env)
    assert out == [f"{node}: VM runs on host {vm.host}, {host_state} in OpenNebula -> drain in Slurm: done"]
    info = c.node_info(node)
    assert "DRAIN" in info["State"] and c.job_state(job) == "RUNNING", (info, c.job_info(job))
    assert info["Reason"].startswith(f"nebula: host {vm.host} {host_state} in OpenNebula: drained for maintenance")
    measure(f"host {host_state}: node under a running job after reconcile's drain", info["State"])
    measure("reconcile: host disabled -> node drained (s)", f"{clock():.1f}")
    assert reconcile(env) == ["nothing to repair"], "drained once"
    stop.touch()
    c.wait_job(job, ("COMPLETED",), 60)
    clock = Stopwatch()
    # Idle and drained: SuspendTime (4 s) powers it down as any idle node; its VM is terminated.
    env.wait(lambda: env.sim.vm(vm.id).state == DONE, 60, "the VM on the host in maintenance terminated")
    env.wait(lambda: "POWERED_DOWN" in c.node_state(node), 60, f"{node} powered down")
    measure("drained node: job end -> VM terminated, node powered down (s)", f"{clock():.1f}")
    measure("drained node once powered down (idle_on_node_suspend)", c.node_state(node))
    reconcile(env)  # undrains it if Slurm kept the drain (it does not with idle_on_node_suspend)
    assert "DRAIN" not in c.node_state(node), c.node_info(node)
    # The next job on that node gets a VM on a host that takes VMs.
    again = c.sbatch(f"--nodelist={node}", script=job_script(), nodes=1)
    c.wait_job(again, ("COMPLETED",), 90)
    [new] = [v for v in env.vms_of(node) if v.id != vm.id]
    assert new.host != vm.host


@pytest.mark.parametrize("lost", ["UNKNOWN", "POWEROFF"])
def test_a_vm_lost_under_a_job_sends_the_job_back_to_the_queue_and_is_removed(e2e, lost) -> None:
    env: E2E = e2e(nodes=NODES, hosts=2, boot_timeout=20)
    c = env.cluster
    marker = c.base / "runs"
    # The job counts its runs; the first run waits for the test, a later one ends at once, before any srun:
    # 22.05.8's slurmctld segfaulted once here (dmesg: an srvcn thread, a NULL write) as the rerun's srun asked
    # for its step, once the requeue was done and the node up again (a second failed run's cause was not read).
    script = job_script(first=f"echo run >> {marker}; [ $(wc -l < {marker}) -gt 1 ] && exit 0; sleep 600")
    job = c.sbatch(script=script, nodes=1)
    env.wait(lambda: marker.exists(), 60, f"job {job} running")
    node = c.job_info(job)["NodeList"]
    vm = running_vm(env, node)
    if lost == "UNKNOWN":
        env.sim.fail_vm(vm.id, lcm="UNKNOWN")  # its host failed: oned lost the VM (the guest's slurmd stops)
    else:
        pyone.OneServer(env.sim.endpoint, session=(c.base / "one_auth").read_text().strip()).vm.action(
            "poweroff-hard", vm.id)  # a killed hypervisor process ends in POWEROFF
        env.wait(lambda: env.sim.vm(vm.id).state_str == "POWEROFF", 30, "the VM POWEROFF")
    clock = Stopwatch()
    out = reconcile(env)
    name = "ACTIVE/UNKNOWN" if lost == "UNKNOWN" else "POWEROFF"
    assert out == [f"{node}: node up but VM {name} -> terminate VM {vm.id} and hand back to Slurm: done"]
    env.wait(lambda: c.job_info(job).get("Restarts") == "1", 30, f"job {job} requeued")
    measure(f"VM {name} under a job: reconcile -> job requeued (s)", f"{clock():.1f}")
    env.wait(lambda: env.sim.vm(vm.id).state == DONE, 30, "the lost VM removed")
    # The guest went with its job: no slurmstepd of the first run is left to meet the rerun.
    env.wait(lambda: [e for e in env.hook_events() if e["vm_id"] == vm.id
                      and e.get("action") == "stopped slurmd" and e.get("killed")], 10, "the lost guest gone")
    info = c.node_info(node)
    measure(f"VM {name} under a job: node after reconcile's hand-back", f"{info['State']} Reason="
            f"{info.get('Reason', '').split(' [')[0]}")
    c.wait_job(job, ("COMPLETED",), 120)
    assert marker.read_text().count("run") == 2, "it ran again, on a new VM"
    # The node is back in the cloud pool, not left DOWN for an administrator.
    env.wait(lambda: c.sinfo_state(node) == "idle~", 60, f"{node} idle~ (powered down, usable)")
    measure(f"VM {name} under a job: reconcile -> node idle~ again (s)", f"{clock():.1f}")
