"""The fleet on a real oned (7.0.2 and 7.4.0, tests/oned) with a real slurmctld (22.05 here, 24.11 and 26.05 in
the release roots): domains, host maintenance, host failure (issue 26).

Four dummy hosts of one GPU carry NVLINK_DOMAIN (`onehost update`): gpu-host-01 and -03 nvl-a, -02 and -04
nvl-b, interleaved so that oned's own first fit would mix them; node sets gpu[01-02] and gpu[03-04] have a
domain each, and slurm.conf the topology `slurm-conf` writes. The dummy hypervisor boots nothing, so the test
plays it: when one of our VMs is RUNNING its node's slurmd starts at the VM's address, when it leaves RUNNING
the slurmd stops. Host failure and a killed qemu are what the dummy monitor reports for a VM (onedfix
force_vm_state: FAILURE, oned's UNKNOWN; POWEROFF), as a real hypervisor's monitor would.

The shared instance is left with no VM, every host enabled and no forced state; the NVLINK_DOMAIN attributes
stay (nothing else reads them).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
import xmlrpc.client
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from slurm_findings import finding
from slurmharness import SlurmCluster
from test_e2e_domains import shown_topology
from test_real_oned_e2e import Hypervisor
from test_real_oned_programs import pool, wipe
from test_worker import write_config

from slurm_nebula_power.hostlists import expand
from slurm_nebula_power.model import DONE
from slurm_nebula_power.shapes import program_path

pytestmark = pytest.mark.slurm

POWER = Path(sys.executable).parent / "slurm-nebula-power"
NODES = ("gpu01", "gpu02", "gpu03", "gpu04")
HOST_DOMAIN = {"gpu-host-01": "nvl-a", "gpu-host-02": "nvl-b", "gpu-host-03": "nvl-a", "gpu-host-04": "nvl-b"}
NODE_DOMAIN = {"gpu01": "nvl-a", "gpu02": "nvl-a", "gpu03": "nvl-b", "gpu04": "nvl-b"}
CLUSTER = "cloudtest"


class Guests(Hypervisor):
    """Plays the hypervisor without the worker bootstrap: a RUNNING VM of ours starts its node's slurmd at the
    VM's address (SlurmCluster.start_slurmd); a VM that leaves RUNNING stops it."""

    def __init__(self, oned, cluster: SlurmCluster) -> None:
        self.cluster = cluster
        super().__init__(oned)

    def start_guest(self, vm) -> None:
        threading.Thread(target=self._boot, args=(vm.name, vm.ip), daemon=True).start()

    def stop_guest(self, vm_id: int, name: str) -> None:
        self.cluster.stop_slurmd(name)

    def _boot(self, node: str, addr: str) -> None:
        try:
            self.cluster.start_slurmd(node, addr)
        except Exception as exc:  # the node then never registers: the test says so
            print(f"guest {node} at {addr} did not start: {exc}")


@dataclass
class Fleet:
    oned: object
    cluster: SlurmCluster
    config: Path

    def power(self, *args: str) -> list[str]:
        """`slurm-nebula-power ARGS` as the admin (or the reconcile timer) runs it."""
        proc = subprocess.run([str(POWER), *args], env=self.cluster.env, capture_output=True, text=True,
                              timeout=120, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout.splitlines()

    def ours(self, node: str) -> list:
        return [vm for vm in pool(self.oned) if vm.is_ours(CLUSTER, vm.name) and vm.name == node]

    def running_vm(self, node: str):
        return self.cluster.wait_for(lambda: next((v for v in self.ours(node) if v.running), None), 90,
                                     f"{node}'s VM running")

    def host_attribute(self, name: str) -> str | None:
        """A host's NVLINK_DOMAIN as oned's host pool shows it now."""
        text = xmlrpc.client.ServerProxy(self.oned.endpoint).one.hostpool.info(self.oned.auth)[1]
        host = next(h for h in ET.fromstring(text).iterfind("HOST") if h.findtext("NAME") == name)
        return host.findtext("TEMPLATE/NVLINK_DOMAIN")


def restore(oned) -> None:
    oned.unforce()
    oned.enable_hosts()


@pytest.fixture
def fleet(oned, slurm_factory) -> Iterator[Fleet]:
    wipe(oned)
    restore(oned)
    for host, domain in HOST_DOMAIN.items():
        oned.host_update(host, f'NVLINK_DOMAIN = "{domain}"')
    resume, suspend, fail = (program_path(name)[0] for name in
                             ("slurm-nebula-resume", "slurm-nebula-suspend", "slurm-nebula-resume-fail"))
    cluster = slurm_factory(nodes=NODES, partition="gpu", cluster_name=CLUSTER, resume_program=resume,
                            suspend_program=suspend, resume_fail_program=fail, suspend_time=10, suspend_timeout=15,
                            resume_timeout=120, cred_expire=5)
    base = cluster.base
    config = write_config(cluster, oned.endpoint, boot_timeout=90)  # found beside slurm.conf
    (base / "one_auth").write_text(oned.auth + "\n")
    text = config.read_text()
    text = text[:text.index("[[nodeset]]")].replace("retry_seconds = 10\n", 'retry_seconds = 10\ndomain_attribute = '
                                                    '"NVLINK_DOMAIN"\n').replace("poll_max = 0.5\n", "poll_max = 0.5\n"
                                                                                  "reconcile_grace = 0\n")
    config.write_text(text + "".join(
        f'[[nodeset]]\nnodes = "{nodes}"\ntemplate = "slurm-gpu-worker"\nboot_timeout = 90\ndomain = "{domain}"\n\n'
        for nodes, domain in (("gpu[01-02]", "nvl-a"), ("gpu[03-04]", "nvl-b"))))
    site = Fleet(oned, cluster, config)
    [plugin] = [line for line in site.power("slurm-conf") if line.startswith("TopologyPlugin=")]
    (base / "topology.conf").write_text("\n".join(site.power("slurm-conf", "--topology")) + "\n")
    cluster.extra_conf = plugin
    cluster.write_conf()
    cluster.restart_slurmctld(clear_state=True)
    guests = Guests(oned, cluster)
    yield site
    guests.stop()
    cluster.stop()
    wipe(oned)
    restore(oned)


class Env:
    """What test_e2e_domains.shown_topology needs of a deployment."""

    def __init__(self, cluster: SlurmCluster) -> None:
        self.cluster = cluster


def test_two_2_node_jobs_each_run_inside_one_domain(fleet) -> None:
    c = fleet.cluster
    blocks = shown_topology(Env(c))
    assert blocks["nvl-a"] == ["gpu01", "gpu02"] and blocks["nvl-b"] == ["gpu03", "gpu04"], blocks
    jobs = [c.sbatch(nodes=2) for _ in range(2)]
    for job in jobs:
        c.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 240)
        assert c.job_state(job) == "COMPLETED", c.job_info(job)
    placed = []
    for job in jobs:
        nodes = expand(c.job_info(job)["NodeList"])
        block = min((name for name, members in blocks.items() if set(nodes) <= set(members)),
                    key=lambda name: len(blocks[name]))
        for node in nodes:
            # the VM that ran the job (still up, or DONE once suspended): the last of the node's
            vm = max(fleet.ours(node) or [v for v in pool_all(fleet.oned) if v.name == node], key=lambda v: v.id)
            assert fleet.host_attribute(vm.host) == NODE_DOMAIN[node] == block, (job, node, vm.host)
        placed.append(f"job {job}: {','.join(nodes)} in {block}")
    assert {p.rsplit(" ", 1)[1] for p in placed} == {"nvl-a", "nvl-b"}, placed
    finding(f"domains on a real oned {fleet.oned.version}", "; ".join(placed))


def pool_all(oned) -> list:
    """Every VM, DONE ones included (a suspended node's VM)."""
    from slurm_nebula_power.model import vms_from_xml

    text = xmlrpc.client.ServerProxy(oned.endpoint).one.vmpool.infoextended(oned.auth, -2, -1, -1, -2)[1]
    return [vm for vm in vms_from_xml(text) if vm.is_ours(CLUSTER, vm.name)]


@pytest.mark.parametrize("status", ["disable", "offline"])
def test_a_host_disabled_or_offline_drains_the_node_of_its_vm(fleet, status) -> None:
    c = fleet.cluster
    stop = c.base / "stop-job"
    job = c.sbatch(script=f"#!/bin/sh\nwhile [ ! -e {stop} ]; do sleep 0.2; done\n", nodes=1)
    c.wait_job(job, ("RUNNING",), 180)
    node = c.job_info(job)["NodeList"]
    vm = fleet.running_vm(node)
    fleet.oned.host_status(vm.host, status)  # onehost disable|offline
    state = {"disable": "DISABLED", "offline": "OFFLINE"}[status]
    assert fleet.power("reconcile") == [f"{node}: VM runs on host {vm.host}, {state} in OpenNebula -> drain in "
                                        "Slurm: done"]
    info = c.node_info(node)
    assert "DRAIN" in info["State"] and c.job_state(job) == "RUNNING", (info, c.job_info(job))
    assert info["Reason"].startswith(f"nebula: host {vm.host} {state} in OpenNebula: drained for maintenance")
    stop.touch()
    c.wait_job(job, ("COMPLETED",), 60)
    start = time.monotonic()
    c.wait_for(lambda: "POWERED_DOWN" in c.node_state(node), 90, f"{node} powered down")
    c.wait_for(lambda: not fleet.ours(node), 60, f"{node}'s VM terminated")
    finding(f"real oned {fleet.oned.version}: host {state}, job end -> node powered down, VM gone",
            f"{time.monotonic() - start:.1f} s (SuspendTime 10)")
    fleet.power("reconcile")
    assert "DRAIN" not in c.node_state(node), c.node_info(node)


@pytest.mark.parametrize(("forced", "seen"), [("FAILURE", "ACTIVE/UNKNOWN"), ("POWEROFF", "POWEROFF")])
def test_a_vm_lost_under_a_job_sends_the_job_back_to_the_queue_and_is_removed(fleet, forced, seen) -> None:
    c = fleet.cluster
    runs = c.base / "runs"
    job = c.sbatch(script=f"#!/bin/sh\necho run >> {runs}\n[ $(wc -l < {runs}) -gt 1 ] || sleep 600\n", nodes=1)
    c.wait_for(lambda: runs.exists(), 180, f"job {job} running")
    node = c.job_info(job)["NodeList"]
    vm = fleet.running_vm(node)
    # oned takes a monitor's report only 30 s after the VM's last state change
    time.sleep(max(0.0, vm.stime + 32 - time.time()))
    fleet.oned.force_vm_state(vm.id, forced)
    lost = c.wait_for(lambda: next((v for v in fleet.ours(node) if v.id == vm.id and v.state_name == seen), None),
                      60, f"oned sees VM {vm.id} {seen}")
    assert lost.id == vm.id
    start = time.monotonic()
    assert fleet.power("reconcile") == [f"{node}: node up but VM {seen} -> terminate VM {vm.id} and hand back to "
                                        "Slurm: done"]
    c.wait_for(lambda: c.job_info(job).get("Restarts") == "1", 30, f"job {job} requeued")
    finding(f"real oned {fleet.oned.version}: VM {seen} under a job, reconcile -> job requeued",
            f"{time.monotonic() - start:.1f} s")
    c.wait_for(lambda: all(v.state == DONE for v in pool_all(fleet.oned) if v.id == vm.id), 60, "the lost VM gone")
    c.wait_job(job, ("COMPLETED",), 240)
    assert runs.read_text().count("run") == 2, "it ran again, on a new VM"
