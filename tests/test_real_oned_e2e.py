"""sbatch -> GPU VMs on a real oned -> the job runs -> suspend -> the GPUs are free, with a real slurmctld.

The real-controller scenario of test_worker.py with OpenNebula's own oned (7.0.2 and 7.4.0, tests/oned)
instead of the simulator. The dummy hypervisor boots nothing, so the harness plays the hypervisor: it
watches oned's pool, and when one of our VMs is RUNNING it boots the "VM" the way test_worker.py does, the
SHIPPED worker bootstrap in a private mount namespace with the CONTEXT oned gave the VM (and its OneGate
token, oned's var/vms/<id>/token.txt, as the context packages' TOKENTXT): munge, `slurmd -N <node>
--conf-server <controller>`, and READY=YES through the real OneGate. When the VM leaves RUNNING its daemons
stop. The node set waits for READY (wait_for = "ready").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import xml.etree.ElementTree as ET
import xmlrpc.client
from collections.abc import Iterator
from pathlib import Path

import pyone
import pytest
from test_real_oned_programs import gpu_holders, pool, wipe
from test_worker import stop_vm_daemons, vm_scripts, write_config

from slurm_nebula_power.model import DONE
from slurm_nebula_power.shapes import program_path

pytestmark = pytest.mark.slurm


def context_file(oned, vm_id: int, path: Path) -> None:
    """The VM's TEMPLATE/CONTEXT as the context packages give it to the guest: KEY='value' lines."""
    text = xmlrpc.client.ServerProxy(oned.endpoint).one.vm.info(oned.auth, vm_id)[1]
    context = {item.tag: item.text or "" for item in ET.fromstring(text).find("TEMPLATE/CONTEXT")}
    token = oned.root / "var" / "vms" / str(vm_id) / "token.txt"
    if token.exists():
        context["TOKENTXT"] = token.read_text().strip()
    path.write_text("".join(f"{k}='" + v.replace("'", "'\"'\"'") + "'\n" for k, v in sorted(context.items())))
    path.chmod(0o600)


class Hypervisor:
    """Watches oned; boots a RUNNING VM of ours (vm-boot) once, halts it (vm-halt) when it leaves RUNNING.
    A subclass boots and halts otherwise (start_guest, stop_guest: test_real_oned_fleet.py)."""

    def __init__(self, oned, boot: Path | None = None, halt: Path | None = None, vms: Path | None = None) -> None:
        self.oned, self.boot, self.halt, self.vms = oned, boot, halt, vms
        self.booted: dict[int, str] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="dummy-hypervisor", daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stopping.wait(0.2):
            try:
                vms = {vm.id: vm for vm in pool(self.oned)}
            except Exception:  # oned stopping or busy: look again
                continue
            for vm in vms.values():
                if vm.running and vm.id not in self.booted and vm.context.get("SLURM_NODENAME") == vm.name:
                    self.booted[vm.id] = vm.name
                    self.start_guest(vm)
            for vm_id, name in list(self.booted.items()):
                vm = vms.get(vm_id)
                if vm is None or not vm.running:
                    del self.booted[vm_id]
                    self.stop_guest(vm_id, name)

    def start_guest(self, vm) -> None:
        """The shipped worker bootstrap, with the CONTEXT oned gave the VM."""
        assert self.vms is not None and self.boot is not None
        context = self.vms / f"context-{vm.id}"
        context_file(self.oned, vm.id, context)
        env = {**os.environ, "ONE_VM_ID": str(vm.id), "ONE_VM_NAME": vm.name,
               "ONE_VM_IP": vm.ip or "", "ONE_VM_CONTEXT": str(context)}
        subprocess.Popen(["/bin/sh", str(self.boot)], env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop_guest(self, vm_id: int, name: str) -> None:
        """Its daemons stop."""
        env = {**os.environ, "ONE_VM_ID": str(vm_id), "ONE_VM_NAME": name}
        subprocess.run(["/bin/sh", str(self.halt)], env=env, timeout=30)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)


@pytest.fixture
def real_site(oned, slurm_factory, tmp_path) -> Iterator:
    if shutil.which("curl") is None or shutil.which("unshare") is None:
        pytest.skip("needs curl and unshare (util-linux)")
    if os.geteuid() != 0:
        pytest.skip("needs root: mount namespaces and the munge user")
    wipe(oned)
    resume, suspend, fail = (program_path(name)[0] for name in
                             ("slurm-nebula-resume", "slurm-nebula-suspend", "slurm-nebula-resume-fail"))
    cluster = slurm_factory(nodes=("gpu01", "gpu02"), resume_program=resume, suspend_program=suspend,
                            resume_fail_program=fail, slurmctld_parameters=("enable_configless",),
                            suspend_time=20, suspend_timeout=15, resume_timeout=90)
    config_path = write_config(cluster, oned.endpoint, boot_timeout=60)
    text = config_path.read_text().replace('memory_mb = 256\n', 'memory_mb = 256\ngpus = 1\n')
    (cluster.base / "one_auth").write_text(oned.auth + "\n")
    name = f"slurm-worker-{cluster.base.name}"
    config_path.write_text(text.replace('template = "slurm-worker"', f'template = "{name}"'))
    # what `template` prints, as is (the network by id, as the Slurm user sees it), created as that user
    printed = subprocess.run([str(program_path("slurm-nebula-power")[0]), "template"], env=cluster.env,
                             capture_output=True, text=True, timeout=120, check=False)
    assert printed.returncode == 0, printed.stderr
    one = pyone.OneServer(oned.endpoint, session=oned.auth)
    template_id = one.template.allocate(printed.stdout)
    vms, boot, halt = vm_scripts(cluster)
    hypervisor = Hypervisor(oned, boot, halt, vms)
    yield cluster, oned, vms
    hypervisor.stop()
    cluster.stop()
    wipe(oned)
    one.template.delete(template_id, False)
    stop_vm_daemons(vms)


def test_sbatch_boots_gpu_vms_on_a_real_oned_the_job_runs_and_suspend_frees_the_gpus(real_site) -> None:
    cluster, oned, _ = real_site
    job = cluster.sbatch(nodes=2)
    cluster.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 150)
    assert cluster.job_state(job) == "COMPLETED", cluster.job_info(job)
    assert sorted(cluster.job_output(job).split()) == ["gpu01", "gpu02"]
    def ours() -> dict:
        return {vm.name: vm for vm in pool(oned) if vm.is_ours(cluster.cluster_name, vm.name)}

    # Checked now, while the nodes are certainly up (SuspendTime 20 s; 23.11+ reset NodeAddr at power-down).
    vms = ours()
    assert sorted(vms) == ["gpu01", "gpu02"]
    for node, vm in vms.items():
        assert [gpu.address for gpu in vm.gpus if gpu.address], "oned assigned the VM a GPU"
        assert cluster.node_info(node)["NodeAddr"] == vm.ip
    assert sorted(gpu_holders(oned).values()) == sorted(vm.id for vm in vms.values())
    # The job may start as soon as slurmd registers; the worker's READY follows through the real OneGate,
    # which answered a PUT only after the worker's 10 s curl timeout, four times over, on a loaded machine.
    cluster.wait_for(lambda: all(vm.ready for vm in ours().values()), 60, "READY=YES from both guests")
    # Idle: slurmctld runs our SuspendProgram; the VMs are terminated and the GPUs free again.
    cluster.wait_for(lambda: not [vm for vm in pool(oned) if vm.state != DONE], 120, "every VM terminated")
    assert gpu_holders(oned) == {}
