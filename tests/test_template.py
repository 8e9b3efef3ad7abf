"""slurm-nebula-power template: the VM template of a node set, parsed as oned parses it, and instantiated."""

from __future__ import annotations

import base64
from pathlib import Path

import pyone
import pytest
from simfixtures import AUTH
from support import make_setup

from opennebula_sim import Durations, SimConfig, TemplateSpec, default_hosts, running_simulator
from opennebula_sim.templates import parse_template, vectors
from slurm_nebula_power import shapes, template
from slurm_nebula_power.cli import template as template_cmd
from slurm_nebula_power.cli.main import power_main
from slurm_nebula_power.errors import EXIT_CONFIG, EXIT_OK, EXIT_USAGE

SCRIPT = Path(template.__file__).parent / "worker" / "slurm-nebula-worker.sh"
KEY = bytes(range(128))

GPU_SET = """
[[nodeset]]
nodes = "gpu[01-04]"
template = "slurm-h100"
vcpu = 16
cpu = 4
memory_mb = 131072
gpus = 2
gpu_device = "2330"
ib_vendor = "15b3"
ib_device = "101d"
ib_network = "ib-vfs"
network = "slurm-compute"
image = "debian-12-slurm"
controller = "slurmctld.example.org:6817"
munge_key_file = "{key}"
{extra}
"""

CPU_SET = """
[[nodeset]]
nodes = "cpu[01-02]"
template = 7
vcpu = 4
memory_mb = 8192
network = "3"
image = "12"
controller = "10.0.0.1"
munge_key_file = "{key}"
"""


def site(tmp_path: Path, sets: str, key: bytes = KEY):
    key_file = tmp_path / "munge.key"
    key_file.write_bytes(key)
    key_file.chmod(0o400)
    return make_setup(tmp_path / "site", "http://127.0.0.1:9/RPC2", AUTH,
                      nodesets=sets.format(key=key_file, extra=""))


def run(capsys, setup, *args: str) -> tuple[int, str, str]:
    code = template_cmd.main(list(args), setup.env)
    out, err = capsys.readouterr()
    return code, out, err


def test_gpu_node_set_template_has_what_onetemplate_create_needs(tmp_path, capsys) -> None:
    setup = site(tmp_path, GPU_SET)
    code, out, err = run(capsys, setup)
    assert code == EXIT_OK, err
    tmpl = parse_template(out)  # oned's grammar: KEY = "value", KEY = [ A = "b", ... ], # comments
    assert tmpl["NAME"] == ["slurm-h100"]
    assert (tmpl["CPU"], tmpl["VCPU"], tmpl["MEMORY"]) == (["4"], ["16"], ["131072"])
    pci = vectors(tmpl, "PCI")
    assert pci == [{"VENDOR": "10de", "CLASS": "0302", "DEVICE": "2330"}] * 2 + [
        {"TYPE": "NIC", "VENDOR": "15b3", "DEVICE": "101d", "NETWORK": "ib-vfs"}]
    assert vectors(tmpl, "NIC") == [{"NETWORK": "slurm-compute"}]
    assert vectors(tmpl, "DISK") == [{"IMAGE": "debian-12-slurm"}]
    [context] = vectors(tmpl, "CONTEXT")
    assert {k: v for k, v in context.items() if not k.endswith("_BASE64")} == {
        "NETWORK": "YES", "TOKEN": "YES", "REPORT_READY": "NO", "SET_HOSTNAME": "$NAME",
        "SSH_PUBLIC_KEY": "$USER[SSH_PUBLIC_KEY]", "SLURM_NODENAME": "$NAME",
        "SLURM_CONTROLLER": "slurmctld.example.org:6817"}
    assert base64.b64decode(context["MUNGE_KEY_BASE64"]) == KEY
    assert base64.b64decode(context["START_SCRIPT_BASE64"]) == SCRIPT.read_bytes()  # the shipped script
    assert "# SECRET: CONTEXT/MUNGE_KEY_BASE64 is the cluster's munge key" in out
    assert "onetemplate chmod <ID> 600" in out
    assert set(tmpl) == {"NAME", "CPU", "VCPU", "MEMORY", "PCI", "NIC", "DISK", "CONTEXT"}


def test_numeric_ids_and_a_cpu_only_node_set(tmp_path, capsys) -> None:
    setup = site(tmp_path, GPU_SET + CPU_SET)
    code, out, _ = run(capsys, setup, "--nodeset", "cpu01")
    assert code == EXIT_OK
    tmpl = parse_template(out)
    assert tmpl["NAME"] == ["slurm-cpu-01-02"] and "set `template` to the new id" in out
    assert tmpl["CPU"] == ["4"] and "PCI" not in tmpl  # no GPU key: no GPU
    assert vectors(tmpl, "NIC") == [{"NETWORK_ID": "3"}] and vectors(tmpl, "DISK") == [{"IMAGE_ID": "12"}]
    assert vectors(tmpl, "CONTEXT")[0]["SLURM_CONTROLLER"] == "10.0.0.1"


def test_gpu_profile_and_defaults(tmp_path, capsys) -> None:
    sets = GPU_SET.replace('gpus = 2\ngpu_device = "2330"\n', 'gpu_profile = "nvidia-h100-1g.10gb"\n')
    sets = sets.replace('ib_vendor = "15b3"\nib_device = "101d"\nib_network = "ib-vfs"\n', "")
    setup = site(tmp_path, sets.replace('image = "debian-12-slurm"\n', ""))
    code, out, _ = run(capsys, setup)
    assert code == EXIT_OK
    tmpl = parse_template(out)
    assert vectors(tmpl, "PCI") == [{"VENDOR": "10de", "CLASS": "0302", "PROFILE": "nvidia-h100-1g.10gb"}]
    assert "DISK" not in tmpl and "# No `image` in the node set" in out


@pytest.mark.parametrize(("args", "message"), [
    ([], "several node sets: choose one with --nodeset (gpu[01-04], cpu[01-02])"),
    (["--nodeset", "gpu[04-05]"], "--nodeset gpu[04-05]: not the nodes of one node set"),
    (["--nodeset", "gpu[01-0"], ""),
])
def test_node_set_choice_errors_exit_2(tmp_path, capsys, args, message) -> None:
    setup = site(tmp_path, GPU_SET + CPU_SET)
    code, out, err = run(capsys, setup, *args)
    assert code == EXIT_USAGE and out == "" and message in err


def test_node_set_by_its_expression(tmp_path, capsys) -> None:
    setup = site(tmp_path, GPU_SET + CPU_SET)
    code, out, _ = run(capsys, setup, "--nodeset", "gpu[01-04]")
    assert code == EXIT_OK and parse_template(out)["NAME"] == ["slurm-h100"]


@pytest.mark.parametrize(("change", "message"), [
    (("vcpu = 16\n", ""), "nodeset[0].vcpu: missing; `template` needs it for VCPU"),
    (("memory_mb = 131072\n", ""), "nodeset[0].memory_mb: missing"),
    (('network = "slurm-compute"\n', ""), "nodeset[0].network: missing; `template` needs it for the NIC"),
    (('controller = "slurmctld.example.org:6817"\n', ""), "nodeset[0].controller: missing"),
    (('munge_key_file = "{key}"\n', ""), "nodeset[0].munge_key_file: missing"),
    (('ib_network = "ib-vfs"\n', ""),
     "nodeset[0].ib_network: missing; `template` needs it for the InfiniBand"),
    (('gpu_device = "2330"', 'gpu_device = "23g0"'), "nodeset[0].gpu_device: '23g0' is not a PCI id"),
    (('image = "debian-12-slurm"', 'image = "a\\"b"'), "nodeset[0].image: 'a\"b' cannot go into a template"),
])
def test_configuration_errors_exit_3_naming_the_key(tmp_path, capsys, change, message) -> None:
    key_file = tmp_path / "munge.key"
    key_file.write_bytes(KEY)
    sets = GPU_SET.replace(*change).format(key=key_file, extra="")
    setup = make_setup(tmp_path / "site", "http://127.0.0.1:9/RPC2", AUTH, nodesets=sets)
    code, out, err = run(capsys, setup)
    assert code == EXIT_CONFIG and out == "" and f"{setup.config}: {message}" in err


def test_munge_key_problems_never_show_the_key(tmp_path, capsys) -> None:
    setup = site(tmp_path, GPU_SET, key=b"short-key")
    code, out, err = run(capsys, setup)
    assert code == EXIT_CONFIG and "holds 9 bytes, not a munge key" in err and "short-key" not in err + out
    (tmp_path / "munge.key").unlink()
    code, out, err = run(capsys, setup)
    assert code == EXIT_CONFIG and "cannot read" in err and "No such file or directory" in err


def test_dispatched_by_slurm_nebula_power(capsys) -> None:
    assert power_main(["template", "--help"]) == EXIT_OK
    assert "--nodeset" in capsys.readouterr().out


def test_slurm_conf_enables_configless_for_worker_node_sets(tmp_path, capsys) -> None:
    setup = site(tmp_path, GPU_SET)
    from slurm_nebula_power.config import load_config

    config = load_config(setup.config, setup.env)
    shape = shapes.Shape(16, 131072, 2, "test")
    lines = shapes.generate(config, [(config.nodesets[0], shape)], (22, 5))
    assert "SlurmctldParameters=idle_on_node_suspend,enable_configless" in lines


def test_the_simulator_accepts_the_template_and_its_vms_run(tmp_path, capsys) -> None:
    setup = site(tmp_path, GPU_SET)
    code, out, _ = run(capsys, setup)
    assert code == EXIT_OK
    # one network serves every NIC in the simulator; its hosts have 4 GPUs 10de:2330 and a NIC 15b3:101d
    config = SimConfig(hosts=default_hosts(2, 4, nics=1), durations=Durations(0, 0, 0, 0),
                       templates=(TemplateSpec(id=0, name="slurm-h100", body=out),))
    with running_simulator(config, auth=AUTH) as sim:
        one = pyone.OneServer(sim.endpoint, session=sim.auth)
        [listed] = one.templatepool.info(-2, -1, -1).VMTEMPLATE
        assert listed.NAME == "slurm-h100"
        vm_id = one.template.instantiate(0, "gpu01", False, "", False)
        vm = sim.wait_for(lambda: sim.vm(vm_id).state_str == "RUNNING" and sim.vm(vm_id), 5)
        assert len(vm.pci) == 3  # two GPUs and the InfiniBand VF
        context = vm.template["CONTEXT"]
        assert context["SLURM_NODENAME"] == "gpu01" and context["SET_HOSTNAME"] == "gpu01"
        assert context["ETH0_IP"] == vm.ip and context["ONEGATE_ENDPOINT"].startswith("http://127.0.0.1:")
        assert base64.b64decode(context["MUNGE_KEY_BASE64"]) == KEY


def test_every_missing_key_is_named_in_one_run(tmp_path, capsys) -> None:
    # issue 25: one missing key a run meant six runs to find five keys
    setup = make_setup(tmp_path / "site", "http://127.0.0.1:9/RPC2", AUTH,
                       nodesets='[[nodeset]]\nnodes = "gpu[01-04]"\ntemplate = "t"\n')
    code, out, err = run(capsys, setup)
    assert code == EXIT_CONFIG and out == ""
    assert f"{setup.config}: nodeset[0]: missing vcpu, memory_mb, network, controller, munge_key_file; " \
           "`template` needs them for VCPU, MEMORY, the NIC, SLURM_CONTROLLER" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("gres", "warned"), [("gpu:1", "Gres=gpu:1, but nodeset[0]"), ("gpu:2", None),
                                              ("gpu:h100:4", "Gres=gpu:4")])
def test_a_template_whose_gpus_differ_from_slurm_conf_is_warned_about(tmp_path, capsys, gres, warned) -> None:
    # issue 25: a GPU node set with no PCI line printed a template without a word; check then said
    # "remove gpu from Gres" when the template was what lacked the GPU
    setup = site(tmp_path, GPU_SET)
    (setup.root / "slurm.conf").write_text(f"ClusterName=testcluster\nNodeName=gpu[01-04] State=CLOUD CPUs=16 "
                                           f"Gres={gres}\n")
    code, out, err = run(capsys, setup)
    assert code == EXIT_OK and "PCI = [" in out
    if warned is None:
        assert err == ""
    else:
        assert warned in err and "gives the template 2 GPU(s); set gpus = " in err
    setup.config.write_text(setup.config.read_text().replace("gpus = 2\n", "gpus = 0\n"))
    code, out, err = run(capsys, setup)
    assert code == EXIT_OK and "(no PCI line: its VMs get no GPU)" in err
