"""Domains (domains.py, hosts.py, plan.extra_template, gate): hosts named by an attribute, node sets placed on
their domain's hosts through SCHED_REQUIREMENTS (against the simulator's scheduler), the GPU count per domain,
and the Slurm topology for each release's plugin."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pyone
import pytest
from simfixtures import AUTH, fast_config, vms_of
from support import make_setup

from opennebula_sim import running_simulator
from slurm_nebula_power.cli import check, slurm_conf
from slurm_nebula_power.cli.main import resume_main
from slurm_nebula_power.config import load_config
from slurm_nebula_power.domains import hosts_of_domain, parse_topology, requirement, topology
from slurm_nebula_power.errors import EXIT_CONFIG, EXIT_NODES_FAILED, EXIT_OK, EXIT_USAGE
from slurm_nebula_power.hosts import ATTRIBUTE_LENGTH, Host, hosts_from_xml
from slurm_nebula_power.plan import extra_template

RECORDED = Path("/work/shared/reference/opennebula-xml/host_01.xml")
DOMAINS = {"gpu-host-01": "nvl-a", "gpu-host-02": "nvl-b", "gpu-host-03": "nvl-a", "gpu-host-04": "nvl-b"}
NODESETS = ('[[nodeset]]\nnodes = "gpu[01-02]"\ntemplate = "slurm-gpu-worker"\nboot_timeout = 20\n'
            'domain = "nvl-a"\n\n'
            '[[nodeset]]\nnodes = "gpu[03-04]"\ntemplate = "slurm-gpu-worker"\nboot_timeout = 20\n'
            'domain = "nvl-b"\n')


def domain_sim(gpus: int = 1):
    """Four hosts, the domains interleaved (01, 03: nvl-a; 02, 04: nvl-b): first fit alone would mix them."""
    cfg = fast_config(hosts=4, gpus=gpus)
    hosts = tuple(dataclasses.replace(h, attributes=(("NVLINK_DOMAIN", DOMAINS[h.name]),)) for h in cfg.hosts)
    return running_simulator(dataclasses.replace(cfg, hosts=hosts), auth=AUTH)


def domain_site(tmp_path, sim, nodesets: str = NODESETS):
    setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=nodesets)
    text = setup.config.read_text().replace("max_parallel = 8", 'max_parallel = 8\ndomain_attribute = "NVLINK_DOMAIN"')
    setup.config.write_text(text)
    return setup


# ---- pure ---------------------------------------------------------------------------------------------

def test_the_hosts_of_a_domain_are_those_whose_attribute_is_the_value() -> None:
    hosts = [Host(i, f"h{i}", 2 if i != 3 else 4, attributes={"RACK": r}) for i, r in enumerate(["a", "b", "a", "a"])]
    assert [h.id for h in hosts_of_domain(hosts, "RACK", "a")] == [0, 2, 3], "placeable or not: the caller filters"
    assert hosts_of_domain(hosts, "RACK", "c") == () and hosts_of_domain(hosts, "ROW", "a") == ()


@pytest.mark.parametrize(("theirs", "expected"), [
    ("", 'NVLINK_DOMAIN = "nvl-a"'),
    ('VM_MAD = "qemu"', '(VM_MAD = "qemu") & (NVLINK_DOMAIN = "nvl-a")'),
    ("  ", 'NVLINK_DOMAIN = "nvl-a"'),
])
def test_the_requirement_keeps_the_templates_own(theirs: str, expected: str) -> None:
    assert requirement("NVLINK_DOMAIN", "nvl-a", theirs) == expected


def test_the_extra_template_carries_the_requirement_escaped() -> None:
    extra = extra_template("c1", "gpu01", [], {}, '(A = "x<y") & (NVLINK_DOMAIN = "nvl-a")')
    assert ET.fromstring(extra).findtext("SCHED_REQUIREMENTS") == '(A = "x<y") & (NVLINK_DOMAIN = "nvl-a")'
    assert ET.fromstring(extra_template("c1", "gpu01", [], {})).find("SCHED_REQUIREMENTS") is None


@pytest.mark.parametrize(("version", "plugin", "lines"), [
    ((22, 5), "topology/tree", ["SwitchName=nvl-a Nodes=gpu[01-02]", "SwitchName=nvl-b Nodes=gpu[03-04]",
                                "SwitchName=nebula-other Nodes=cpu[01-04]",
                                "SwitchName=nebula-top Switches=nvl-a,nvl-b,nebula-other"]),
    (None, "topology/tree", None),
    ((23, 11), "topology/block", ["BlockName=nvl-a Nodes=gpu[01-02]", "BlockName=nvl-b Nodes=gpu[03-04]",
                                  "BlockName=nebula-other Nodes=cpu[01-04]"]),
    ((24, 11), "topology/block", ["BlockName=nvl-a Nodes=gpu[01-02]", "BlockName=nvl-b Nodes=gpu[03-04]",
                                  "BlockName=nebula-other Nodes=cpu[01-04]", "BlockSizes=2"]),
    ((26, 5), "topology/block", None),
])
def test_each_domain_is_one_block_or_switch(version, plugin, lines) -> None:
    found = topology({"nvl-a": ["gpu01", "gpu02"], "nvl-b": ["gpu03", "gpu04"]},
                     ["cpu01", "cpu02", "cpu03", "cpu04"], version)
    assert (found.plugin, found.note) == (plugin, "")
    if lines is not None:
        assert list(found.lines) == lines
    shown = parse_topology("\n".join(found.lines))
    assert {name: nodes for name, nodes in shown.items() if name != "nebula-top"} == {
        "nvl-a": ("gpu[01-02]",), "nvl-b": ("gpu[03-04]",), "nebula-other": ("cpu[01-04]",)}


def test_blocksizes_is_the_smallest_domain_and_fewer_nodes_without_one_mean_tree() -> None:
    # every block needs BlockSizes nodes (slurmctld refuses to start otherwise, 24.11): 1 node without a
    # domain cannot be a block beside domains of 2
    found = topology({"nvl-a": ["gpu01", "gpu02"], "nvl-b": ["gpu03", "gpu04", "gpu05"]}, ["cpu01"], (24, 11))
    assert found.plugin == "topology/tree" and "the 1 nodes without a domain are fewer" in found.note
    found = topology({"nvl-a": ["gpu01", "gpu02"], "nvl-b": ["gpu03", "gpu04", "gpu05"]}, [], (24, 11))
    assert found.lines[-1] == "BlockSizes=2" and found.note == ""


def test_the_nodes_without_a_domain_never_take_a_domains_name() -> None:
    found = topology({"nebula-other": ["gpu01"]}, ["cpu01"], (22, 5))
    assert [name for name, _ in found.groups] == ["nebula-other", "nebula-other_"]
    assert found.lines[-1] == "SwitchName=nebula-top Switches=nebula-other,nebula-other_"


def test_the_host_parser_keeps_the_templates_single_values_bounded() -> None:
    # a recorded oned 5.4 host (oned's XML-RPC answers carry no namespace; the file does)
    [host] = hosts_from_xml(RECORDED.read_text().replace(' xmlns="http://opennebula.org/XMLSchema"', ""))
    assert host.attributes["LABELS"] == "HD,LOWPOWER" and host.attributes["HYPERVISOR"] == "kvm"
    long = "x" * 5000
    text = (f"<HOST_POOL><HOST><ID>1</ID><NAME>h</NAME><STATE>2</STATE><TEMPLATE><RACK>{long}</RACK>"
            "<PCI><ADDRESS>1</ADDRESS></PCI></TEMPLATE></HOST></HOST_POOL>")
    [host] = hosts_from_xml(text)
    assert host.attributes == {"RACK": "x" * ATTRIBUTE_LENGTH}, "vectors left out, values cut"


# ---- configuration --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("nodesets", "extra", "says"), [
    ('[[nodeset]]\nnodes = "gpu01"\ntemplate = "t"\ndomain = "a"\n', "",
     "nodeset[0].domain: needs the host attribute that names domains: set [opennebula] domain_attribute"),
    ('[[nodeset]]\nnodes = "gpu01"\ntemplate = "t"\ndomain = "a*"\n', 'domain_attribute = "RACK"',
     "nodeset[0].domain: must be a plain value"),
    ('[[nodeset]]\nnodes = "gpu01"\ntemplate = "t"\n', 'domain_attribute = "RACK = 1"',
     "opennebula.domain_attribute: must be a host template attribute name"),
])
def test_a_bad_domain_is_a_configuration_error(tmp_path, nodesets, extra, says, capsys) -> None:
    setup = make_setup(tmp_path / "site", "http://127.0.0.1:9/RPC2", AUTH, nodesets=nodesets)
    setup.config.write_text(setup.config.read_text().replace("max_parallel = 8", f"max_parallel = 8\n{extra}"))
    assert resume_main(["gpu01"], setup.env) == EXIT_CONFIG
    assert says in capsys.readouterr().err


# ---- resume places each node's VM on its domain's hosts (the simulator's scheduler) -------------------------

def test_resume_places_each_nodes_vm_only_on_hosts_of_its_domain(tmp_path) -> None:
    with domain_sim() as sim:
        setup = domain_site(tmp_path, sim)
        assert resume_main(["gpu[01-04]"], setup.env) == EXIT_OK
        for node, domain in (("gpu01", "nvl-a"), ("gpu02", "nvl-a"), ("gpu03", "nvl-b"), ("gpu04", "nvl-b")):
            [vm] = vms_of(sim, node)
            assert DOMAINS[vm.host] == domain, (node, vm.host)
            assert vm.user_template["SCHED_REQUIREMENTS"] == f'NVLINK_DOMAIN = "{domain}"'


def test_direct_placement_deploys_each_nodes_vm_only_to_hosts_of_its_domain(tmp_path) -> None:
    # pack alone would put all four on gpu-host-01 (4 GPUs): the domain decides
    with domain_sim(gpus=4) as sim:
        direct = NODESETS.replace("boot_timeout = 20\n", 'boot_timeout = 20\nplacement = "direct"\n')
        setup = domain_site(tmp_path, sim, direct)
        assert resume_main(["gpu[01-04]"], setup.env) == EXIT_OK
        assert sim.stats()["calls"]["one.vm.deploy"] == 4, "each VM deployed where resume chose, none by the scheduler"
        for node, domain in (("gpu01", "nvl-a"), ("gpu02", "nvl-a"), ("gpu03", "nvl-b"), ("gpu04", "nvl-b")):
            [vm] = vms_of(sim, node)
            assert DOMAINS[vm.host] == domain, (node, vm.host)


def test_the_templates_own_requirements_are_kept(tmp_path) -> None:
    with domain_sim(gpus=2) as sim:
        one = pyone.OneServer(sim.endpoint, session=AUTH)
        body = one.template.info(0).TEMPLATE
        text = ('NAME="pinned"\nCPU="1"\nMEMORY="1024"\nPCI=[VENDOR="10de",CLASS="0302"]\nNIC=[NETWORK="slurm-net"]\n'
                'SCHED_REQUIREMENTS="NAME != \\"gpu-host-01\\""\n')
        assert body
        tid = one.template.allocate(text)
        setup = domain_site(tmp_path, sim, NODESETS.replace('template = "slurm-gpu-worker"', f"template = {tid}", 1))
        assert resume_main(["gpu01"], setup.env) == EXIT_OK
        [vm] = vms_of(sim, "gpu01")
        assert vm.host == "gpu-host-03", "its domain's other host: gpu-host-01 is excluded by the template"
        assert vm.user_template["SCHED_REQUIREMENTS"] == '(NAME != "gpu-host-01") & (NVLINK_DOMAIN = "nvl-a")'


def test_the_gpu_count_is_per_domain(tmp_path) -> None:
    with domain_sim() as sim:
        setup = domain_site(tmp_path, sim, NODESETS.replace('nodes = "gpu[01-02]"', 'nodes = "gpu[01-03]"')
                            .replace('nodes = "gpu[03-04]"', 'nodes = "gpu[04-05]"'))
        resume_file = tmp_path / "resume.json"
        resume_file.write_text(json.dumps({"jobs": [{"job_id": 7, "nodes": "gpu[01-03]"}]}))
        env = {**setup.env, "SLURM_RESUME_FILE": str(resume_file)}
        # 4 GPUs free in all, 2 in nvl-a: the 3-node job of nvl-a cannot start whole, no VM is made
        assert resume_main(["gpu[01-03]"], env) == EXIT_NODES_FAILED
        assert sim.vms() == []
        [update] = [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
        assert update[2] == "Reason=nebula: job 7: needs 3 GPUs 10de:0302, 2 free"


def test_a_domain_no_host_has_gets_no_vm(tmp_path) -> None:
    with domain_sim() as sim:
        nodesets = NODESETS.replace('domain = "nvl-a"', 'domain = "nvl-z"\npending_timeout = 1') + (
            '\n[[nodeset]]\nnodes = "cpu01"\ntemplate = "slurm-cpu-worker"\ndomain = "nvl-z"\npending_timeout = 1\n')
        setup = domain_site(tmp_path, sim, nodesets)
        # With GPUs, the count of the domain's hosts hands the node back before any VM is made.
        assert resume_main(["gpu01"], setup.env) == EXIT_NODES_FAILED
        assert [u[2] for u in setup.updates() if "State=POWER_DOWN_FORCE" in u] == [
            "Reason=nebula: needs 1 GPU 10de:0302, 0 free"]
        assert sim.vms() == []
        # Without: oned's scheduler says so, and pending_timeout hands it back.
        assert resume_main(["cpu01"], setup.env) == EXIT_NODES_FAILED
        [update] = [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u and u[0] == "NodeName=cpu01"]
        assert "(oned: Cannot dispatch VM: No host meets SCHED_REQUIREMENTS)" in update[2], update
        assert not vms_of(sim, "cpu01")


def test_the_placeable_config_reads_back(tmp_path) -> None:
    with domain_sim() as sim:
        setup = domain_site(tmp_path, sim)
        config = load_config(setup.config, setup.env)
        assert [ns.domain for ns in config.nodesets] == ["nvl-a", "nvl-b"]
        assert config.opennebula.domain_attribute == "NVLINK_DOMAIN"


# ---- slurm-conf and check ----------------------------------------------------------------------------

def findings(setup, capsys) -> dict[str, tuple[str, str]]:
    check.main(["--json"], setup.env)
    return {f["subject"]: (f["level"], f["text"]) for f in json.loads(capsys.readouterr().out)}


@pytest.mark.parametrize(("release", "plugin", "first"), [
    ("slurm 22.05.8", "topology/tree", "SwitchName=nvl-a Nodes=gpu[01-02]"),
    ("slurm 24.11.5", "topology/block", "BlockName=nvl-a Nodes=gpu[01-02]"),
])
def test_slurm_conf_writes_the_topology_of_the_slurmctlds_release(tmp_path, capsys, release, plugin, first) -> None:
    with domain_sim() as sim:
        setup = domain_site(tmp_path, sim)
        setup.set_version(release)
        assert slurm_conf.main(["--topology"], setup.env) == EXIT_OK
        lines = capsys.readouterr().out.splitlines()
        assert lines[2] == first and lines[0].startswith("# topology.conf from slurm-nebula-power")
        assert slurm_conf.main([], setup.env) == EXIT_OK
        assert f"TopologyPlugin={plugin}" in capsys.readouterr().out.splitlines()


def test_slurm_conf_topology_without_a_domain_is_a_usage_error(setup, capsys) -> None:
    assert slurm_conf.main(["--topology"], setup.env) == EXIT_USAGE
    assert "no node set of" in capsys.readouterr().err


def test_check_verifies_the_domains_against_the_host_pool_and_the_topology(tmp_path, capsys) -> None:
    with domain_sim() as sim:
        setup = domain_site(tmp_path, sim, NODESETS + '\n[[nodeset]]\nnodes = "gpu[05-07]"\ntemplate = '
                            '"slurm-gpu-worker"\ndomain = "nvl-c"\n')
        sim.set_host_attributes("gpu-host-04", NVLINK_DOMAIN="nvl-c")  # nvl-b keeps one host for two nodes
        setup.set_version("slurm 24.11.5")
        found = findings(setup, capsys)
        assert found["domain NVLINK_DOMAIN=nvl-a"][0] == "ok"
        assert found["domain NVLINK_DOMAIN=nvl-b"] == ("warning", "1 of its hosts take VMs (gpu-host-02), but "
                                                       "gpu[03-04] needs 2 GPUs 10de:0302, its hosts have 1: the rest "
                                                       "of its nodes are handed back when they are resumed")
        assert found["domain NVLINK_DOMAIN=nvl-c"][0] == "warning"
        assert found["slurm.conf TopologyPlugin"] == ("problem", "not set: Slurm may give a job nodes of several "
                                                      "domains")
        slurm = setup.root / "slurm.conf"
        slurm.write_text(slurm.read_text() + "TopologyPlugin=topology/block\n")
        slurm_conf.main(["--topology"], setup.env)
        (setup.root / "topology.conf").write_text(capsys.readouterr().out)
        found = findings(setup, capsys)
        assert found["topology.conf nvl-a"] == ("ok", "gpu[01-02] in nvl-a")
        assert "slurm.conf TopologyPlugin" not in found
        (setup.root / "topology.conf").write_text("BlockName=b1 Nodes=gpu[01-04]\nBlockName=b2 Nodes=gpu[05-07]\n")
        found = findings(setup, capsys)
        assert found["topology.conf nvl-a"] == ("problem", "gpu[01-02] (domain nvl-a) are not one block of their "
                                                "own: a job can span domains")
        assert found["topology.conf nvl-c"][0] == "ok"
        sim.set_host_attributes("gpu-host-04", NVLINK_DOMAIN="nvl-b")
        assert found and findings(setup, capsys)["domain NVLINK_DOMAIN=nvl-c"][0] == "problem"
