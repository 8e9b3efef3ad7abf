"""The installed programs against a real oned (7.0.2 and 7.4.0, tests/oned): resume, suspend, resume-fail,
reconcile, status and check of several nodes, a GPU shortage, a failed boot and a foreign VM.

Slurm is the recording fake scontrol here (tests/support.py); real Slurm with real oned is in
test_real_oned_e2e.py. Each test leaves the shared instance as it found it: no VM, every GPU free.
"""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
import xmlrpc.client
from collections.abc import Iterator

import pyone
import pytest
from opsupport import show
from reliability_support import run_program
from support import Setup, make_setup

from slurm_nebula_power.cli import check, status, unprotect
from slurm_nebula_power.cloud import OneCloud
from slurm_nebula_power.config import load_config
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK
from slurm_nebula_power.gres import generate_gres
from slurm_nebula_power.model import DONE, Vm, vms_from_xml
from slurm_nebula_power.shapes import generate, read_shapes

GPU_NODES = "gpu[01-05]"


def pool(oned) -> list[Vm]:
    """Every live VM, whoever's (oneadmin sees them all), through the product's own parser."""
    text = xmlrpc.client.ServerProxy(oned.endpoint).one.vmpool.infoextended(oned.admin, -2, -1, -1, -1)[1]
    return vms_from_xml(text)


def gpu_holders(oned) -> dict[str, int]:
    """Host name -> VM id for every GPU (class 0302) a VM holds."""
    text = xmlrpc.client.ServerProxy(oned.endpoint).one.hostpool.info(oned.auth)[1]
    held = {}
    for host in ET.fromstring(text).iterfind("HOST"):
        for pci in host.iterfind("HOST_SHARE/PCI_DEVICES/PCI"):
            if pci.findtext("CLASS") == "0302" and int(pci.findtext("VMID") or -1) >= 0:
                held[f"{host.findtext('NAME')} {pci.findtext('SHORT_ADDRESS')}"] = int(pci.findtext("VMID"))
    return held


def wait(predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s: {what}")


def wipe(oned) -> None:
    """Every VM gone (terminate-hard, retried while a transient state refuses it; never recover --delete, which
    stalls the shared oned's scheduler for 300 s when the VM is being deployed), every GPU free."""
    one = pyone.OneServer(oned.endpoint, session=oned.admin)

    def gone() -> bool:
        for vm in pool(oned):
            try:
                one.vm.action("terminate-hard", vm.id)
            except pyone.OneException:
                pass  # BOOT, PROLOG...: ends by itself, tried again
        return not pool(oned) and not gpu_holders(oned)

    wait(gone, 60, "no VM and every GPU free")


@pytest.fixture
def site(oned, tmp_path) -> Iterator[Setup]:
    wipe(oned)
    (oned.dummy_actions / "deploy").unlink(missing_ok=True)
    nodesets = (f'[[nodeset]]\nnodes = "{GPU_NODES}"\ntemplate = "slurm-gpu-worker"\nboot_timeout = 20\n\n'
                '[[nodeset]]\nnodes = "cpu[01-02]"\ntemplate = "slurm-cpu-worker"\nboot_timeout = 20\n'
                'suspend_action = "undeploy"\ngpus = 0\n')
    setup = make_setup(tmp_path / "site", oned.endpoint, oned.auth, nodesets=nodesets,
                       extra="reconcile_grace = 0")
    yield setup
    (oned.dummy_actions / "deploy").unlink(missing_ok=True)
    wipe(oned)


def ours(oned, node: str) -> list[Vm]:
    return [vm for vm in pool(oned) if vm.is_ours("testcluster", node)]


def test_resume_and_suspend_of_several_nodes(oned, site) -> None:
    done = run_program(site, "resume", "gpu[01-03],cpu01", guard=120)
    assert done.returncode == EXIT_OK, site.log_text()[-3000:]
    vms = {node: ours(oned, node) for node in ("gpu01", "gpu02", "gpu03", "cpu01")}
    assert all(len(v) == 1 and v[0].running for v in vms.values()), vms
    told = {}  # node -> the NodeAddr resume gave slurmctld (in one or more batched updates)
    for update in (u for u in site.updates() if any(s.startswith("NodeAddr=") for s in u)):
        names, addrs = update[0].removeprefix("NodeName=").split(","), update[1].removeprefix("NodeAddr=").split(",")
        told.update(zip(names, addrs, strict=True))
    assert told == {node: vm[0].ip for node, vm in vms.items()}
    assert sorted(gpu_holders(oned).values()) == sorted(vms[n][0].id for n in ("gpu01", "gpu02", "gpu03"))
    # The VMs carry the identity where a guest cannot write it, and the tags.
    assert vms["gpu01"][0].context["SLURM_CLUSTER"] == "testcluster"
    assert run_program(site, "suspend", "gpu[01-03],cpu01", guard=120).returncode == EXIT_OK
    assert gpu_holders(oned) == {}, "terminate frees the GPUs"
    [cpu] = ours(oned, "cpu01")
    assert cpu.state_name == "UNDEPLOYED", "the cpu node set's suspend_action"


def test_a_gpu_shortage_hands_the_node_without_one_back_before_any_vm(oned, site) -> None:
    # 4 hosts x 1 GPU, 5 nodes: the GPU count from the host pool hands the fifth back at once, no VM made.
    done = run_program(site, "resume", GPU_NODES, guard=180)
    assert done.returncode == EXIT_NODES_FAILED
    handbacks = [u for u in site.updates() if "State=POWER_DOWN_FORCE" in u]
    assert len(handbacks) == 1 and len(handbacks[0][0].removeprefix("NodeName=").split(",")) == 1
    assert "GPUs 10de:0302, 4 free" in handbacks[0][2], handbacks
    assert len(pool(oned)) == 4 and all(vm.running for vm in pool(oned)) and len(gpu_holders(oned)) == 4


def test_a_vm_oned_cannot_place_is_handed_back_at_pending_timeout(oned, site) -> None:
    # The GPU count says yes (4 free), but no host has the memory: the VM stays PENDING with oned's
    # SCHED_MESSAGE, and pending_timeout hands the node back long before boot_timeout.
    one = pyone.OneServer(oned.endpoint, session=oned.auth)
    huge = one.template.allocate('NAME="too-big-gpu"\nCPU="1"\nVCPU="1"\nMEMORY="100000000"\n'
                                 'PCI=[VENDOR="10de",CLASS="0302"]\nNIC=[NETWORK="slurm-net",NETWORK_UNAME="oneadmin"]\n')
    try:
        text = site.config.read_text().replace('template = "slurm-gpu-worker"\nboot_timeout = 20\n',
                                               'template = "too-big-gpu"\nboot_timeout = 300\npending_timeout = 8\n')
        site.config.write_text(text)
        done = run_program(site, "resume", "gpu01", guard=120)
        assert done.returncode == EXIT_NODES_FAILED
        [handback] = [u for u in site.updates() if "State=POWER_DOWN_FORCE" in u]
        assert handback[0] == "NodeName=gpu01"
        assert "not placed within pending_timeout 8s although 4 free" in handback[2], handback
        wait(lambda: not pool(oned), 30, "the PENDING VM removed")
    finally:
        wipe(oned)
        one.template.delete(huge, False)


def test_a_failed_boot_is_recreated_then_handed_back_and_nothing_is_left(oned, site) -> None:
    (oned.dummy_actions / "deploy").write_text("failure")  # the dummy driver fails every deploy
    done = run_program(site, "resume", "gpu01", guard=120)
    assert done.returncode == EXIT_NODES_FAILED
    log = site.log_text()
    assert "recreating it" in log and "VM failed to boot" in log
    [handback] = [u for u in site.updates() if "State=POWER_DOWN_FORCE" in u]
    assert handback[0] == "NodeName=gpu01"
    wait(lambda: not pool(oned), 30, "the failed VMs removed")
    assert gpu_holders(oned) == {}


def test_a_vm_given_up_in_boot_is_terminated_once_booted_and_oned_goes_on_placing(oned, site, tmp_path) -> None:
    # boot_timeout (10 s) passes while the VM is in BOOT: oned places it within ~3.5 s here and the dummy deploy
    # is slowed to 14 s. resume hands the node back and removes the VM with terminate-hard once BOOT ends.
    # recover --delete in BOOT would leave oned placing nothing for ACTION_TIMEOUT (300 s): the next VM would
    # stay PENDING past the 60 s bound below.
    setup = make_setup(tmp_path / "short", oned.endpoint, oned.auth, nodesets=(
        f'[[nodeset]]\nnodes = "{GPU_NODES}"\ntemplate = "slurm-gpu-worker"\nboot_timeout = 10\n'))
    (oned.dummy_actions / "deploy").write_text("success 14\n")
    done = run_program(setup, "resume", "gpu01", guard=120)
    (oned.dummy_actions / "deploy").unlink()
    assert done.returncode == EXIT_NODES_FAILED
    assert "not up after boot_timeout 10s (ACTIVE/BOOT)" in setup.log_text()
    [removed] = [r for r in setup.records() if r["event"] == "removed"]
    assert removed["action"] == "terminate-hard", removed
    wait(lambda: not pool(oned) and not gpu_holders(oned), 30, "the VM removed and its GPU free")
    one = pyone.OneServer(oned.endpoint, session=oned.auth)
    [cpu] = [t.ID for t in one.templatepool.info(-2, -1, -1).VMTEMPLATE if t.NAME == "slurm-cpu-worker"]
    vm_id = one.template.instantiate(cpu, "next", False, "", False)
    wait(lambda: one.vm.info(vm_id).STATE == 3, 60, "the next VM placed")


def test_resume_fail_and_reconcile_remove_what_should_not_run(oned, site) -> None:
    assert run_program(site, "resume", "gpu[01-02]", guard=120).returncode == EXIT_OK
    assert run_program(site, "resume-fail", "gpu01", guard=120).returncode == EXIT_OK
    assert ours(oned, "gpu01") == []
    # gpu02 is powered down in Slurm but its VM runs: reconcile terminates it.
    site.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN", "gpu02 State=IDLE+CLOUD+POWERED_DOWN"))
    done = run_program(site, "reconcile", guard=120)
    assert done.returncode == EXIT_OK, done.stderr
    assert "gpu02: VM ACTIVE/RUNNING but node powered down -> terminate VM" in done.stdout
    wait(lambda: not pool(oned), 30, "gpu02's VM gone")


def test_a_foreign_vm_named_like_a_node_is_reported_never_touched(oned, site, capsys) -> None:
    one = pyone.OneServer(oned.endpoint, session=oned.auth)
    template = next(t.ID for t in one.templatepool.info(-2, -1, -1).VMTEMPLATE if t.NAME == "slurm-cpu-worker")
    foreign = one.template.instantiate(template, "gpu01", False, "", False)  # someone's, by hand
    wait(lambda: [vm for vm in pool(oned) if vm.id == foreign and vm.running], 60, "the foreign VM runs")
    assert run_program(site, "resume", "gpu01", guard=120).returncode == EXIT_OK
    [mine] = ours(oned, "gpu01")
    assert mine.id != foreign
    site.set_nodes(show("gpu01 State=IDLE+CLOUD"))
    assert status.main(["--json", "gpu01"], site.env) == EXIT_NODES_FAILED
    [row] = json.loads(capsys.readouterr().out)
    assert row["vm_id"] == mine.id and f"VM {foreign} (ACTIVE/RUNNING) is named gpu01" in row["problems"][0]
    assert run_program(site, "suspend", "gpu01", guard=120).returncode == EXIT_OK
    site.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN"))
    done = run_program(site, "reconcile", guard=120)
    assert done.returncode == EXIT_OK and f"VM {foreign} (ACTIVE/RUNNING) is named gpu01" in done.stdout
    [left] = pool(oned)
    assert left.id == foreign and left.running and left.state != DONE, "never touched"


def test_check_passes_against_the_real_oned(oned, site, capsys) -> None:
    config = load_config(site.config, site.env)
    shapes = [(ns, shape) for ns, shape, _ in read_shapes(config, OneCloud(config.opennebula))]
    assert [shape.gpus for _, shape in shapes] == [1, 0], "the template's PCI GPU is seen"
    conf = ["ClusterName=testcluster", "SlurmUser=root", *generate(config, shapes, (22, 5))]
    (site.root / "slurm.conf").write_text("\n".join(conf) + "\n")
    (site.root / "gres.conf").write_text("\n".join(generate_gres(config, shapes)) + "\n")
    code = check.main(["--json"], site.env)
    found = json.loads(capsys.readouterr().out)
    problems = [f for f in found if f["level"] == "problem"]
    assert code == EXIT_OK and problems == [], problems
    assert any(f["subject"].startswith(f"OpenNebula {oned.endpoint}") and f"oned {oned.version}" in f["text"]
               for f in found)


def test_a_template_that_boots_nothing_costs_three_vms_then_none_until_a_good_boot(oned, site, capsys) -> None:
    # Protected mode (issue 26): Slurm resumes the requeued job's node again and again; the dummy driver fails
    # every deploy. The first resume fails 2 VMs (recreate_attempts 1), the third failure protects the node set.
    (oned.dummy_actions / "deploy").write_text("failure")
    codes = [run_program(site, "resume", "gpu01", guard=120).returncode for _ in range(4)]
    assert codes == [EXIT_NODES_FAILED] * 4
    assert len([r for r in site.records() if r["event"] == "created"]) == 3, "3 VMs, then none"
    reasons = [u[2] for u in site.updates() if "State=POWER_DOWN_FORCE" in u]
    assert reasons[0] == "Reason=nebula: VM failed to boot (ACTIVE/BOOT_FAILURE)"
    assert all("protected after 3 boot failures" in r and "slurm-nebula-power unprotect gpu[01-05]" in r
               for r in reasons[1:]), reasons
    wait(lambda: not pool(oned), 60, "the failed VMs removed")
    # The template fixed: the operator clears it, and the next boot works and leaves no state behind.
    (oned.dummy_actions / "deploy").unlink()
    assert unprotect.main(["gpu01"], site.env) == EXIT_OK
    assert "protected mode cleared" in capsys.readouterr().out
    assert run_program(site, "resume", "gpu01", guard=120).returncode == EXIT_OK
    assert not list((site.root / "locks").glob("protect-*.json"))
