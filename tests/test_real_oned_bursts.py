"""A burst bigger than oned's scheduler places at once, against a real oned (7.0.2 and 7.4.0, tests/oned):
resume paces it by max_pending and brings every node to RUNNING, none handed back.

Hundreds of instantiates at once stall both releases' scheduler (../shared/reference/real-oned.md,
"Bursts"); here 48 nodes on 8 hosts, whose scheduler places at most one VM per host per plan (MAX_HOST 1),
so the VMs wait several plans and oned 7.4 marks the waiting ones "Dispatch limit reached": no shortage.
"""

from __future__ import annotations

import xmlrpc.client
from collections.abc import Iterator

import onedfix
import pytest
from reliability_support import run_program
from support import make_setup

from slurm_nebula_power.errors import EXIT_OK
from slurm_nebula_power.model import vms_from_xml

NODES, HOSTS, GPUS, MAX_PENDING = 48, 8, 6, 10


@pytest.fixture(scope="module", params=onedfix.VERSIONS, ids=[f"oned-{v}" for v in onedfix.VERSIONS])
def oned(request) -> Iterator[onedfix.RealOned]:
    """Its own oned of each release (8 hosts of 6 GPUs), once per release for this module."""
    try:
        instance = onedfix.start(request.param, hosts=HOSTS, gpus=GPUS, net_ip="127.4.0.1", ONED_DS_INTERVAL="4")
    except onedfix.OnedUnavailable as exc:
        pytest.skip(str(exc))
    yield instance
    instance.stop()


def test_a_burst_is_paced_and_every_node_comes_up(oned, tmp_path) -> None:
    nodes = f"gpu[01-{NODES}]"
    setup = make_setup(tmp_path / "site", oned.endpoint, oned.auth,
                       nodesets=f'[[nodeset]]\nnodes = "{nodes}"\ntemplate = "slurm-gpu-worker"\n'
                                'boot_timeout = 600\n')
    # The product's default timeouts, not make_setup's short ones: on a loaded machine oned took over 5 s
    # to answer an instantiate, and a retried instantiate whose first answer was lost leaves a duplicate
    # VM holding a GPU until the watch removes it.
    text = setup.config.read_text().replace("timeout = 5\n", "timeout = 30\n").replace(
        "retry_seconds = 10\n", "retry_seconds = 60\n")
    setup.config.write_text(text.replace("max_parallel = 8\n", f"max_parallel = 8\nmax_pending = {MAX_PENDING}\n"))
    done = run_program(setup, "resume", nodes, guard=900)  # a guard against a hang, not a time bound
    log = setup.log_text()
    assert done.returncode == EXIT_OK, log[-4000:]
    answer = xmlrpc.client.ServerProxy(oned.endpoint).one.vmpool.infoextended(oned.auth, -2, -1, -1, -1)
    vms = vms_from_xml(answer[1])
    by_node = {f"gpu{i:02d}": [vm for vm in vms if vm.is_ours("testcluster", f"gpu{i:02d}")]
               for i in range(1, NODES + 1)}
    assert all(len(v) == 1 and v[0].running for v in by_node.values()), {n: v for n, v in by_node.items()
                                                                         if len(v) != 1 or not v[0].running}
    handed_back = [u for u in setup.updates() if any(a.startswith("State=") for a in u)]
    assert handed_back == [], "no node handed back"
    assert "max_pending 10)" in log, "the burst was paced"
