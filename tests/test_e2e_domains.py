"""Domains as Slurm topology with a real slurmctld (22.05 here, 24.11 and 26.05 in the release roots) and the
simulator's scheduler (SCHED_REQUIREMENTS on host attributes):

- the topology `slurm-conf` writes (TopologyPlugin, and topology.conf from `slurm-conf --topology`) is what
  each release's slurmctld accepts, and `scontrol show topology` shows one block (switch on 22.05) per
  domain;
- two domains of two nodes each on hosts whose NVLINK_DOMAIN attribute names them: two 2-node jobs each run
  inside one block, and every VM on a host of its node's domain.
The real-oned counterpart is tests/test_real_oned_fleet.py.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_support import E2E, gpu_hosts, job_script
from slurm_findings import finding

from slurm_nebula_power.hostlists import expand

pytestmark = pytest.mark.slurm

POWER = Path(sys.executable).parent / "slurm-nebula-power"
NODES = ("gpu01", "gpu02", "gpu03", "gpu04")
HOST_DOMAIN = {"gpu-host-01": "nvl-a", "gpu-host-02": "nvl-b", "gpu-host-03": "nvl-a", "gpu-host-04": "nvl-b"}
NODE_DOMAIN = {"gpu01": "nvl-a", "gpu02": "nvl-a", "gpu03": "nvl-b", "gpu04": "nvl-b"}


def nodesets(boot_timeout: float) -> str:
    return "".join(f'[[nodeset]]\nnodes = "{nodes}"\ntemplate = "slurm-gpu-worker"\nboot_timeout = {boot_timeout}\n'
                   f'domain = "{domain}"\n\n' for nodes, domain in (("gpu[01-02]", "nvl-a"), ("gpu[03-04]", "nvl-b")))


def with_domains(config: Path, boot_timeout: float) -> None:
    """The deployment's configuration with the two node sets of a domain each, and the host attribute."""
    text = config.read_text()
    text = text[:text.index("[[nodeset]]")] + nodesets(boot_timeout)
    config.write_text(text.replace("max_parallel = 8\n", 'max_parallel = 8\ndomain_attribute = "NVLINK_DOMAIN"\n'))


def slurm_conf_topology(env: E2E) -> tuple[str, str]:
    """(TopologyPlugin= line of `slurm-conf`, topology.conf of `slurm-conf --topology`), as an admin runs them."""
    def run(*args: str) -> str:
        proc = subprocess.run([str(POWER), "slurm-conf", *args], env=env.cluster.env, capture_output=True, text=True,
                              timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout
    [plugin] = [line for line in run().splitlines() if line.startswith("TopologyPlugin=")]
    return plugin, run("--topology")


def install_topology(env: E2E) -> str:
    """Write what slurm-conf says into slurm.conf and topology.conf, restart slurmctld; its TopologyPlugin."""
    c = env.cluster
    plugin, conf = slurm_conf_topology(env)
    (c.base / "topology.conf").write_text(conf)
    c.extra_conf = plugin
    c.write_conf()
    c.restart_slurmctld(clear_state=True)
    return plugin


def shown_topology(env: E2E) -> dict[str, list[str]]:
    """`scontrol show topology`: each block's (switch's) name -> its nodes."""
    out = env.cluster.scontrol("show", "topology")
    groups = {}
    for line in out.splitlines():
        name = re.search(r"\b(?:BlockName|SwitchName)=(\S+)", line)
        nodes = re.search(r"\bNodes=(\S+)", line)
        if name and nodes and nodes.group(1) != "(null)":
            groups[name.group(1)] = expand(nodes.group(1))
    return groups


def test_the_topology_slurm_conf_writes_is_accepted_by_slurmctld(e2e) -> None:
    env: E2E = e2e(nodes=(*NODES, "cpu01", "cpu02"), hosts=4)
    with_domains(env.config, env.boot_timeout)
    env.config.write_text(env.config.read_text() + '[[nodeset]]\nnodes = "cpu[01-02]"\ntemplate = "slurm-cpu-worker"\n')
    plugin = install_topology(env)
    version = env.cluster.version
    assert plugin == ("TopologyPlugin=topology/block" if version >= (23, 11) else "TopologyPlugin=topology/tree")
    shown = shown_topology(env)
    assert shown["nvl-a"] == ["gpu01", "gpu02"] and shown["nvl-b"] == ["gpu03", "gpu04"], shown
    assert shown["nebula-other"] == ["cpu01", "cpu02"], "a node set without a domain is in the topology too"
    complaints = [line for line in env.cluster.log_text("slurmctld.log").splitlines()
                  if "topolog" in line.lower() and ("error" in line.lower() or "warning" in line.lower())]
    assert complaints == [], "slurmctld took the topology without a complaint"
    finding("topology slurm-conf writes: accepted, `scontrol show topology`",
            f"{plugin.split('=')[1]}: " + "; ".join(f"{k}={','.join(v)}" for k, v in sorted(shown.items())))


def test_a_two_node_job_runs_inside_one_domain(e2e) -> None:
    hosts = tuple(dataclasses.replace(h, attributes=(("NVLINK_DOMAIN", HOST_DOMAIN[h.name]),))
                  for h in gpu_hosts(4, 1))
    env: E2E = e2e(nodes=NODES, sim_hosts=hosts, boot_timeout=20)
    with_domains(env.config, 20)
    install_topology(env)
    c = env.cluster
    blocks = shown_topology(env)
    jobs = [c.sbatch(script=job_script(sleep=2), nodes=2) for _ in range(2)]
    for job in jobs:
        c.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 120)
        assert c.job_state(job) == "COMPLETED", c.job_info(job)
    placed = {}
    for job in jobs:
        nodes = expand(c.job_info(job)["NodeList"])
        # the leaf block (switch) holding them all: on 22.05 the switch above the leaves holds every node
        block = min((name for name, members in blocks.items() if set(nodes) <= set(members)),
                    key=lambda name: len(blocks[name]))
        placed[job] = (block, nodes)
        for node in nodes:
            [vm] = env.vms_of(node)
            assert HOST_DOMAIN[vm.host] == NODE_DOMAIN[node] == block, (job, node, vm.host)
            assert vm.user_template["SCHED_REQUIREMENTS"] == f'NVLINK_DOMAIN = "{block}"'
    assert {block for block, _ in placed.values()} == {"nvl-a", "nvl-b"}, placed
    finding("domains: two 2-node jobs on 2 blocks of 2 nodes", "; ".join(
        f"job {job}: {','.join(nodes)} in {block}" for job, (block, nodes) in placed.items()))


def test_with_one_free_node_in_each_domain_a_two_node_job_waits_for_one_domain(e2e) -> None:
    """What topology/block buys (23.11+): BlockSizes, the domain's node count, keeps a job inside one domain;
    it waits rather than spanning two. topology/tree (22.05) prefers one switch but spans when it must."""
    hosts = tuple(dataclasses.replace(h, attributes=(("NVLINK_DOMAIN", HOST_DOMAIN[h.name]),))
                  for h in gpu_hosts(4, 1))
    env: E2E = e2e(nodes=NODES, sim_hosts=hosts, boot_timeout=20)
    with_domains(env.config, 20)
    plugin = install_topology(env)
    c = env.cluster
    release = c.base / "release-holds"
    holds = [c.sbatch(f"--nodelist={node}", script=job_script(first=f"while [ ! -e {release} ]; do sleep 0.2; done"),
                      nodes=1) for node in ("gpu01", "gpu03")]
    for job in holds:
        env.wait(lambda job=job: c.job_state(job) == "RUNNING", 90, f"job {job} running")
    two = c.sbatch(script=job_script(), nodes=2)
    if plugin.endswith("block"):
        # 24.11: Reason=Resources; 26.05: No_suitable_topology_unit_found
        info = c.wait_until(lambda: c.job_info(two), lambda info: info.get("Reason") in (
            "Resources", "No_suitable_topology_unit_found"), 30, "the 2-node job waiting")
        assert info["JobState"] == "PENDING", "a node of each domain is free: it waits for one domain"
        finding("domains: the waiting 2-node job's Reason", info["Reason"])
        release.touch()
    c.wait_job(two, ("COMPLETED",), 120)
    release.touch()
    nodes = expand(c.job_info(two)["NodeList"])
    spans = {NODE_DOMAIN[n] for n in nodes}
    if plugin.endswith("block"):
        assert len(spans) == 1, nodes
    finding("domains: 2-node job while each domain has one node free", f"{plugin.split('=')[1]}: ran on "
            f"{','.join(nodes)} ({'one domain, after waiting' if len(spans) == 1 else 'spanning domains'})")
