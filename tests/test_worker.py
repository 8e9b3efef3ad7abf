"""Nodes booted by the shipped worker bootstrap, against a real slurmctld in configless mode.

Real slurmctld (tests/slurmharness.py) with SlurmctldParameters=enable_configless runs our ResumeProgram,
SuspendProgram and ResumeFailProgram; the simulator's VMs are made from the template that
`slurm-nebula-power template` prints, and its on-running hook boots a "VM": a private mount namespace
(its own /run, /etc/munge, /var/lib/munge, /var/log/munge, as a VM has) in which the SHIPPED
slurm-nebula-worker.sh runs with the VM's CONTEXT file, with its real defaults: it installs the munge
key from CONTEXT into /etc/munge, starts munged as the munge user, starts `slurmd -N <node>
--conf-server <controller>` (no slurm.conf anywhere: configless), and reports READY=YES to the
simulator's OneGate with curl. The node sets wait for READY (wait_for = "ready"). A VM of a GPU node set
gets its GPUs' device files, /dev/nvidia0..., in a /dev of its own (tests/vm-devices.sh).
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import shutil
import stat
import subprocess
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import vmnet
from slurm_findings import finding
from slurmharness import VM_DEVICES, SlurmCluster, rewrite_lines, stop_pid

from opennebula_sim import Durations, SimConfig, Simulator, TemplateSpec, running_simulator
from opennebula_sim.config import default_hosts
from slurm_nebula_power.cli import slurm_conf
from slurm_nebula_power.config import load_config
from slurm_nebula_power.shapes import program_path
from slurm_nebula_power.template import gpus_of, pick_nodeset, render

pytestmark = pytest.mark.slurm

GUEST = " ".join(vmnet.guest_argv("", [])[:2])  # then: ADDR HOSTNAME -- ARGV (paths without blanks)
WORKER = Path(__file__).resolve().parent.parent / "slurm_nebula_power" / "worker" / "slurm-nebula-worker.sh"
AUTH = "oneadmin:Worker-Test-pass"
TEMPLATE = "slurm-worker"
DONE = 6

# One VM's boot on this machine: a network namespace of its own at the VM's IP, with the VM's hostname
# (tests/vmnet.py), and in it a mount namespace. Both last as long as the daemons started in them;
# nothing outside /tmp is changed. The worker gets the CONTEXT file the way the
# context packages give a guest its variables; only its log, its console and SLURMD_OPTIONS=-b (slurmd
# reports a fresh boot, as a real VM's would) are set for the test.
BOOT = """\
#!/bin/sh
vm="{root}/vm-$ONE_VM_ID"
mkdir -p "$vm/run" "$vm/etc-munge" "$vm/lib-munge" "$vm/log-munge"
chown munge:munge "$vm/lib-munge" "$vm/log-munge"
chmod 0755 "$vm" "$vm/run" "$vm/etc-munge"
echo "$ONE_VM_NAME" >"$vm/name"
: >"$vm/console"  # the VM's console
gpus=$(cat "{root}/gpus" 2>/dev/null || echo 0)  # the GPUs the node set's template gives a VM
if [ "$gpus" -gt 0 ]; then set -- "{vm_devices}" "$gpus"; else set --; fi
exec {guest} "$ONE_VM_IP" "$ONE_VM_NAME" -- "$@" unshare --mount --propagation private /bin/sh -c '
    mount --bind "$1/run" /run &&
    mount --bind "$1/etc-munge" /etc/munge &&
    mount --bind "$1/lib-munge" /var/lib/munge &&
    mount --bind "$1/log-munge" /var/log/munge || exit 99
    exec env WORKER_LOG="$1/worker.log" WORKER_CONSOLE="$1/console" SLURMD_OPTIONS=-b \\
        /bin/sh "$2" "$ONE_VM_CONTEXT"' vm-boot "$vm" "{worker}"
"""

# The VM's power-off: its daemons go.
HALT = """\
#!/bin/sh
vm="{root}/vm-$ONE_VM_ID"
for pidfile in "{slurm_run}/slurmd-$ONE_VM_NAME.pid" "$vm/run/munge/munged.pid"; do
    [ -r "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null
done
exit 0
"""


@dataclass
class Site:
    """A real controller, the simulator and our programs, wired as in production."""

    cluster: SlurmCluster
    sim: Simulator
    vms: Path  # one directory per booted VM: vm-<id>/{worker.log,console,etc-munge,run,...}

    def vm_dir(self, node: str) -> Path:
        for path in sorted(self.vms.glob("vm-*")):
            if (path / "name").exists() and (path / "name").read_text().strip() == node:
                return path
        raise AssertionError(f"no VM booted for {node}")


def vm_scripts(cluster: SlurmCluster) -> tuple[Path, Path, Path]:
    """The VMs' directory and the on-running/on-stopped hooks that boot and halt a "VM" there."""
    vms = cluster.base / "vms"
    vms.mkdir()
    vms.chmod(0o755)
    boot, halt = cluster.base / "bin" / "vm-boot", cluster.base / "bin" / "vm-halt"
    boot.write_text(BOOT.format(root=vms, worker=WORKER, guest=GUEST, vm_devices=VM_DEVICES))
    halt.write_text(HALT.format(root=vms, slurm_run=cluster.run_dir))
    return vms, boot, halt


def controller_address(cluster: SlurmCluster) -> str:
    port = next(line.split("=", 1)[1] for line in cluster.conf.read_text().splitlines()
                if line.startswith("SlurmctldPort="))
    return f"127.0.0.1:{port}"


def write_config(cluster: SlurmCluster, endpoint: str, boot_timeout: float, nodeset_extra: str = "") -> Path:
    base = cluster.base
    auth = base / "one_auth"
    auth.write_text(AUTH + "\n")
    auth.chmod(0o600)
    config = base / "nebula-power.toml"  # beside slurm.conf: found through the SLURM_CONF slurmctld passes
    config.write_text(textwrap.dedent(f"""\
        [opennebula]
        endpoint = "{endpoint}"
        auth_file = "one_auth"
        timeout = 5
        retry_seconds = 10

        [slurm]
        scontrol = "{cluster.binaries['scontrol']}"

        [log]
        file = "{cluster.log_dir / 'nebula-power.log'}"
        level = "debug"

        [power]
        lock_dir = "{base / 'locks'}"
        suspend_timeout = 8
        poll_max = 0.5

        [[nodeset]]
        nodes = "{','.join(cluster.nodes)}"
        template = "{TEMPLATE}"
        boot_timeout = {boot_timeout}
        wait_for = "ready"
        vcpu = 1
        memory_mb = 256
        network = "slurm-net"
        controller = "{controller_address(cluster)}"
        munge_key_file = "{base / 'munge' / 'munge.key'}"
        """) + nodeset_extra)
    cluster.add_log("nebula-power.log", cluster.log_dir / "nebula-power.log")
    return config


@pytest.fixture
def site_factory(slurm_factory, tmp_path) -> Iterator:
    if shutil.which("curl") is None or shutil.which("unshare") is None:
        pytest.skip("needs curl and unshare (util-linux)")
    if os.geteuid() != 0:
        pytest.skip("needs root: mount namespaces and the munge user")
    sims: list = []

    def make(nodes: tuple[str, ...], boot_timeout: float, edit=lambda text: text, nodeset_extra: str = "") -> Site:
        resume, suspend, fail = (program_path(name)[0] for name in
                                 ("slurm-nebula-resume", "slurm-nebula-suspend", "slurm-nebula-resume-fail"))
        cluster = slurm_factory(nodes=nodes, resume_program=resume, suspend_program=suspend,
                                resume_fail_program=fail, slurmctld_parameters=("enable_configless",),
                                suspend_time=60, resume_timeout=60)
        # The template our command prints for the node set (the endpoint is not part of it).
        config = load_config(write_config(cluster, "http://127.0.0.1:9/RPC2", boot_timeout, nodeset_extra),
                             cluster.env)
        index, nodeset = pick_nodeset(config, None)
        body = edit(render(config, index, nodeset))
        vms, boot, halt = vm_scripts(cluster)
        (vms / "gpus").write_text(f"{gpus_of(nodeset)}\n")
        sim_config = SimConfig(hosts=default_hosts(2, 2), durations=Durations(0.2, 0.5, 0.2, 0.2),
                               templates=(TemplateSpec(id=0, name=TEMPLATE, body=body),),
                               on_running=("/bin/sh", str(boot)), on_stopped=("/bin/sh", str(halt)))
        context = running_simulator(sim_config, auth=AUTH)
        sim = context.__enter__()
        sims.append((context, vms))
        write_config(cluster, sim.endpoint, boot_timeout, nodeset_extra)
        return Site(cluster, sim, vms)

    yield make
    for context, vms in sims:
        context.__exit__(None, None, None)
        stop_vm_daemons(vms)


def stop_vm_daemons(vms: Path) -> None:
    """Stop the booted VMs' munged (their slurmd belong to the harness, which stops them)."""
    for pidfile in vms.glob("vm-*/run/munge/munged.pid"):
        try:
            pid = int(pidfile.read_text())
            if Path(f"/proc/{pid}/comm").read_text().strip() == "munged":
                stop_pid(pid)
        except (OSError, ValueError):
            pass


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def test_nodes_boot_through_the_worker_and_a_job_runs(site_factory) -> None:
    site = site_factory(("cloud1", "cloud2"), boot_timeout=40)
    cluster = site.cluster
    job = cluster.sbatch(nodes=2)
    cluster.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 90)
    assert cluster.job_state(job) == "COMPLETED", cluster.job_info(job)
    assert sorted(cluster.job_output(job).split()) == ["cloud1", "cloud2"]
    key = (cluster.base / "munge" / "munge.key").read_bytes()
    for node in ("cloud1", "cloud2"):
        vm_dir = site.vm_dir(node)
        log = (vm_dir / "worker.log").read_text()
        assert "slurmd started as node " + node in log and "READY=YES reported to OneGate" in log
        assert "REFUSED" not in log and base64.b64encode(key).decode() not in log
        assert not (vm_dir / "run" / "slurm-nebula-worker" / "ready").exists()  # READY: the worker's only
        installed = vm_dir / "etc-munge" / "munge.key"  # the VM's /etc/munge/munge.key
        info = installed.stat()
        assert installed.read_bytes() == key and stat.S_IMODE(info.st_mode) == 0o400
        assert info.st_uid == int(subprocess.run(["id", "-u", "munge"], capture_output=True, text=True,
                                                 check=True).stdout)
        [vm] = [v for v in site.sim.vms() if v.name == node and v.state != DONE]
        assert vm.user_template["READY"] == "YES"  # through the simulator's OneGate
        pid = int(cluster.slurmd_pidfile(node).read_text())
        argv = cmdline(pid)  # configless: the node name from CONTEXT, the controller, no slurm.conf
        instance = ["--instance-id", str(vm.id), "--instance-type", "opennebula"] if cluster.version >= (23, 11) \
            else []
        assert argv[1:] == ["-N", node, "--conf-server", controller_address(cluster), *instance, "-b"]
        info = cluster.node_info(node)
        finding("after the worker's slurmd registered: NodeAddr; InstanceId/InstanceType",
                f"{'the VM IP' if info['NodeAddr'] == vm.ip else info['NodeAddr']}; "
                f"{info.get('InstanceId', '(none)')}/{info.get('InstanceType', '(none)')} (VM {vm.id})")
        assert info["NodeAddr"] == vm.ip
        if instance:  # 23.11 to 25.11 take slurmd's, 26.05 keeps resume's: the VM's id either way
            assert (info.get("InstanceId"), info.get("InstanceType")) == (str(vm.id), "opennebula"), info


def test_a_missing_munge_key_fails_visibly_and_the_node_is_handed_back(site_factory) -> None:
    def without_key(text: str) -> str:
        return "\n".join(line for line in text.splitlines() if "MUNGE_KEY_BASE64" not in line) + "\n"

    site = site_factory(("cloud1",), boot_timeout=6, edit=without_key)
    cluster = site.cluster
    job = cluster.sbatch(nodes=1)
    # The guest refuses; it never reports READY, so resume hands the node back at boot_timeout.
    reason = "Reason=nebula: guest did not report READY=YES within boot_timeout 6s (RUNNING)"
    cluster.wait_for(lambda: reason in cluster.scontrol("show", "node", "cloud1"), 60,
                     "cloud1 handed back with the reason")
    vm_dir = site.vm_dir("cloud1")
    refusal = "REFUSED: CONTEXT lacks MUNGE_KEY_BASE64(or ONEAPP_MUNGE_KEY_BASE64)"
    # The guest may still be starting when boot_timeout (6 s) runs out on a loaded machine.
    cluster.wait_for(lambda: refusal in (vm_dir / "worker.log").read_text(), 30, "the worker's refusal")
    assert refusal in (vm_dir / "console").read_text()
    assert not (vm_dir / "etc-munge" / "munge.key").exists()
    assert not cluster.slurmd_pidfile("cloud1").exists()  # no slurmd was ever started
    site.sim.wait_for(lambda: all(v.state == DONE for v in site.sim.vms()), 30)  # no VM, no GPU held
    cluster.wait_for(lambda: cluster.job_info(job).get("Restarts", "0") != "0" or
                     cluster.job_state(job) == "PENDING", 30, "the job requeued")
    cluster.run("scancel", str(job), check=False)
    log = (cluster.log_dir / "nebula-power.log").read_text()
    assert "guest did not report READY=YES" in log


def slurm_conf_output(cluster: SlurmCluster, *argv: str) -> list[str]:
    """What `slurm-nebula-power slurm-conf ARGV` prints for the site (its configuration beside slurm.conf)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert slurm_conf.main(list(argv), cluster.env) == 0
    return out.getvalue().splitlines()


GPU_JOB = """\
#!/bin/sh
echo "batch ${CUDA_VISIBLE_DEVICES-unset}"
/usr/bin/srun /bin/sh -c 'echo "step ${CUDA_VISIBLE_DEVICES-unset} of $(ls /dev | grep -c "^nvidia[0-9]")"'
"""


def test_gpu_nodes_get_gres_conf_through_configless_and_a_job_sees_its_gpus(site_factory) -> None:
    site = site_factory(("cloud1", "cloud2"), boot_timeout=40, nodeset_extra='gpus = 2\ngpu_type = "h100"\n')
    cluster = site.cluster
    # slurm.conf: the harness's lines with our Gres= and GresTypes; gres.conf: as slurm-conf printed it.
    lines = slurm_conf_output(cluster)
    [gres] = {token for line in lines if line.startswith("NodeName=") for token in line.split()
              if token.startswith("Gres=")}
    assert gres == "Gres=gpu:h100:2" and "GresTypes=gpu" in lines
    rewrite_lines(cluster.conf, lambda conf: [f"{line} {gres}" if line.startswith("NodeName=") else line
                                              for line in conf] + ["GresTypes=gpu"])
    printed = "\n".join(slurm_conf_output(cluster, "--gres-conf")) + "\n"
    assert "NodeName=cloud[1-2] AutoDetect=off Name=gpu Type=h100 Count=2 File=/dev/nvidia[0-1]" in printed
    (cluster.base / "gres.conf").write_text(printed)
    cluster.restart_slurmctld(clear_state=True)
    one = cluster.sbatch("--gres=gpu:1", "-w", "cloud1", script=GPU_JOB)
    both = cluster.sbatch("--gres=gpu:2", "-w", "cloud2", script=GPU_JOB)
    for job in (one, both):
        cluster.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 120)
        assert cluster.job_state(job) == "COMPLETED", cluster.job_info(job)
    # The batch step and a job step see the GPUs the job got, among the VM's two.
    outputs = [cluster.job_output(job).split("\n")[:2] for job in (one, both)]
    finding("--gres=gpu:1 and --gres=gpu:2 jobs on configless 2-GPU cloud nodes (gres.conf as slurm-conf "
            "printed it): CUDA_VISIBLE_DEVICES of the batch step, of an srun step", outputs)
    assert outputs == [["batch 0", "step 0 of 2"], ["batch 0,1", "step 0,1 of 2"]], outputs
    places = set()
    for node in ("cloud1", "cloud2"):
        assert cluster.node_info(node)["Gres"] == "gpu:h100:2"
        # configless: slurmd fetched gres.conf with slurm.conf (the VM has none of its own)
        fetched = {place: path for place, path in fetched_configs(site, node) if path.name == "gres.conf"}
        assert fetched and all(path.read_text() == printed for path in fetched.values()), fetched
        places |= set(fetched)
    finding("configless slurmd: where it keeps the gres.conf it fetched", ", ".join(sorted(places)))


def fetched_configs(site: Site, node: str) -> list[tuple[str, Path]]:
    """The configuration files a configless slurmd of `node` fetched, each with where it is: a conf-cache in
    SlurmdSpoolDir, or /run/slurm/conf in the VM."""
    places = {"SlurmdSpoolDir/conf-cache": site.cluster.base / "spool" / node / "conf-cache",
              "/run/slurm/conf": site.vm_dir(node) / "run" / "slurm" / "conf"}
    return sorted((place, path) for place, directory in places.items() if directory.is_dir()
                  for path in directory.iterdir())
