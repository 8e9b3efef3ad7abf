"""Direct placement (`placement = "direct"`) against a real oned (7.0.2 and 7.4.0, tests/oned: 4 hosts x 1 GPU):
resume deploys each VM to a host it chose, and what happens between its host pool read and its deploy (another
user takes the GPU, the host is disabled, every GPU goes) ends with the node placed elsewhere or handed
back: never a VM left on hold, never a failed node while a GPU is free.

The race is made exact: the cloud resume talks to is the real one, but the first host pool read does the other
party's act against the real oned before it answers (the read's document is the one from before).
"""

from __future__ import annotations

import dataclasses
import logging
import xml.etree.ElementTree as ET
import xmlrpc.client
from collections.abc import Callable, Iterator

import pytest
from reliability_support import run_program
from support import Setup, make_setup
from test_real_oned_programs import gpu_holders, pool, wait, wipe

from slurm_nebula_power.cli.common import build_context
from slurm_nebula_power.config import load_config
from slurm_nebula_power.errors import EXIT_OK
from slurm_nebula_power.model import HOLD, Vm
from slurm_nebula_power.resume import resume

NODESET = ('[[nodeset]]\nnodes = "gpu[01-04]"\ntemplate = "slurm-gpu-worker"\nboot_timeout = 60\n'
           'pending_timeout = 8\nplacement = "direct"\n')
OTHER = ("contract-racer", "Racer-Pass-1")


@pytest.fixture
def site(oned, tmp_path) -> Iterator[Setup]:
    wipe(oned)
    yield make_setup(tmp_path / "site", oned.endpoint, oned.auth, nodesets=NODESET)
    proxy = xmlrpc.client.ServerProxy(oned.endpoint)

    def states() -> dict[int, str]:
        root = ET.fromstring(proxy.one.hostpool.info(oned.admin)[1])
        return {int(h.findtext("ID") or -1): h.findtext("STATE") or "" for h in root.iterfind("HOST")}

    for host, state in states().items():
        if state in ("4", "8"):  # enable only what a test disabled: enabling a MONITORED host re-monitors it
            proxy.one.host.status(oned.admin, host, 0)
    wait(lambda: set(states().values()) == {"2"}, 60, "every host MONITORED again")
    wipe(oned)


@pytest.fixture
def other(oned) -> Iterator[Callable[[int], int]]:
    """Another user (of group oneadmin, so it may deploy); take(host) deploys a GPU VM of its own there and
    waits until the host's GPU is held by it."""
    proxy = xmlrpc.client.ServerProxy(oned.endpoint)
    ok, uid, *_ = proxy.one.user.allocate(oned.admin, OTHER[0], OTHER[1], "core", [0])
    assert ok, uid
    session = ":".join(OTHER)
    templates = ET.fromstring(proxy.one.templatepool.info(session, -2, -1, -1)[1]).iterfind("VMTEMPLATE")
    [tid] = [int(t.findtext("ID") or -1) for t in templates if t.findtext("NAME") == "slurm-gpu-worker"]

    def take(host: int) -> int:
        ok, vm_id, *_ = proxy.one.template.instantiate(session, tid, f"theirs{host}", True, "", False)
        assert ok, vm_id
        answer = proxy.one.vm.deploy(session, vm_id, host, True, -1)
        assert answer[0], answer
        wait(lambda: vm_id in gpu_holders(oned).values(), 30, f"their VM {vm_id} holding host {host}'s GPU")
        return int(vm_id)

    yield take
    wipe(oned)
    proxy.one.user.delete(oned.admin, uid)


@dataclasses.dataclass
class Meanwhile:
    """The real cloud; its first host pool read acts `act` before it answers with what it read."""

    cloud: object
    act: Callable[[], object]
    done: bool = False

    def __getattr__(self, name: str):
        return getattr(self.cloud, name)

    def hosts(self):
        hosts = self.cloud.hosts()  # type: ignore[attr-defined]
        if not self.done:
            self.done = True
            self.act()
        return hosts


def raced(site: Setup, nodes: list[str], act: Callable[[], object], caplog: pytest.LogCaptureFixture):
    """Resume in this process (its log in caplog, from INFO), the first host pool read acting `act`."""
    caplog.set_level(logging.INFO, logger="slurm_nebula_power")
    config = load_config(site.config, site.env)
    ctx = build_context(config, site.env)
    return resume(dataclasses.replace(ctx, cloud=Meanwhile(ctx.cloud, act)), nodes, {})


def ours(oned, node: str) -> list[Vm]:
    return [vm for vm in pool(oned) if vm.is_ours("testcluster", node)]


def test_direct_resume_deploys_each_vm_to_a_host_of_its_own(oned, site) -> None:
    done = run_program(site, "resume", "gpu[01-04]", guard=120)
    assert done.returncode == EXIT_OK, site.log_text()[-3000:]
    vms = [ours(oned, f"gpu0{i}")[0] for i in range(1, 5)]
    assert all(vm.running and not vm.without_devices for vm in vms)
    assert sorted(vm.host or "" for vm in vms) == [f"gpu-host-0{i}" for i in range(1, 5)]
    log = site.log_text()
    assert log.count("action=deploy host=") == 4 and "released to oned's scheduler" not in log
    assert sorted(gpu_holders(oned).values()) == sorted(vm.id for vm in vms)


def test_a_gpu_another_user_takes_after_the_read_sends_the_vm_to_another_host(oned, site, other, caplog) -> None:
    outcome = raced(site, ["gpu01"], lambda: other(0), caplog)  # resume's first choice: host 0 (all alike, lowest id)
    assert outcome.done == ["gpu01"] and not outcome.failed
    [vm] = ours(oned, "gpu01")
    assert vm.running and vm.host != "gpu-host-01" and not vm.without_devices
    assert "does not fit in host [0]. Unavailable PCI device." in caplog.text
    assert not [v for v in pool(oned) if v.state == HOLD]


def test_a_host_disabled_after_the_read_gets_the_vm_and_resume_places_it_again(oned, site, caplog) -> None:
    proxy = xmlrpc.client.ServerProxy(oned.endpoint)
    outcome = raced(site, ["gpu01"], lambda: proxy.one.host.status(oned.admin, 0, 1), caplog)  # oned accepts DISABLED
    assert outcome.done == ["gpu01"] and not outcome.failed
    [vm] = ours(oned, "gpu01")
    assert vm.running and vm.host != "gpu-host-01"
    assert "its host left service after we placed it there" in caplog.text
    wait(lambda: not [v for v in pool(oned) if v.host == "gpu-host-01"], 60, "the VM on the disabled host gone")
    assert not [v for v in pool(oned) if v.state == HOLD]


def test_every_gpu_taken_after_the_read_hands_the_node_back_and_leaves_nothing(oned, site, other,
                                                                              caplog) -> None:
    outcome = raced(site, ["gpu01"], lambda: [other(host) for host in range(4)], caplog)
    assert outcome.failed_nodes == ["gpu01"] and not outcome.done
    [reason] = outcome.failed
    assert reason.startswith("no free GPU 10de:0302: PENDING 8s, 0 free"), reason
    log = caplog.text
    assert log.count("refused ([one.vm.deploy] virtual machine") == 4  # each host refused it in turn
    assert "released to oned's scheduler: no host in the host pool read has room" in log
    wait(lambda: not ours(oned, "gpu01"), 60, "our VM removed")
    assert not [v for v in pool(oned) if v.state == HOLD]
