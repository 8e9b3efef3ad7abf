"""slurm-nebula-power template: the VM template of a node set, parsed as oned parses it, and instantiated."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pyone
import pytest
from simfixtures import AUTH
from support import make_setup

from opennebula_sim import Durations, SimConfig, Simulator, default_hosts, running_simulator
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

# The same node set with numeric ids: `template` then prints without asking OpenNebula anything.
GPU_SET_IDS = GPU_SET.replace('"slurm-compute"', '"1"').replace('"debian-12-slurm"', '"1"').replace('"ib-vfs"', '"2"')

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


PLAIN = "slurm:Plain-pass-1"  # the unprivileged user a site makes for Slurm (uid 2, group users 1, in the simulator)


def site(tmp_path: Path, sets: str, key: bytes = KEY, endpoint: str = "http://127.0.0.1:9/RPC2", auth: str = AUTH):
    key_file = tmp_path / "munge.key"
    key_file.write_bytes(key)
    key_file.chmod(0o400)
    return make_setup(tmp_path / "site", endpoint, auth, nodesets=sets.format(key=key_file, extra=""))


@pytest.fixture
def cloud() -> Iterator[Simulator]:
    """The node set's networks and image, oneadmin's and usable by others, as the Slurm user sees them."""
    with running_simulator(SimConfig(hosts=default_hosts(2, 4, nics=1), durations=Durations(0, 0, 0, 0)),
                           auth=PLAIN) as sim:
        ids = (sim.add_network("slurm-compute"), sim.add_network("ib-vfs"), sim.add_image("debian-12-slurm"))
        assert ids == (1, 2, 1)  # slurm-net 0 and slurm-worker 0 come with the simulator
        yield sim


def online(tmp_path: Path, sim: Simulator, sets: str = GPU_SET):
    """The site, its OpenNebula the simulator, acting as the Slurm user."""
    return site(tmp_path, sets, endpoint=sim.endpoint, auth=PLAIN)


def run(capsys, setup, *args: str) -> tuple[int, str, str]:
    code = template_cmd.main(list(args), setup.env)
    out, err = capsys.readouterr()
    return code, out, err


def test_gpu_node_set_template_has_what_onetemplate_create_needs(tmp_path, capsys, cloud) -> None:
    setup = online(tmp_path, cloud)
    code, out, err = run(capsys, setup)
    assert code == EXIT_OK, err
    tmpl = parse_template(out)  # oned's grammar: KEY = "value", KEY = [ A = "b", ... ], # comments
    assert tmpl["NAME"] == ["slurm-h100"]
    assert (tmpl["CPU"], tmpl["VCPU"], tmpl["MEMORY"]) == (["4"], ["16"], ["131072"])
    pci = vectors(tmpl, "PCI")
    assert pci == [{"VENDOR": "10de", "CLASS": "0302", "DEVICE": "2330"}] * 2 + [
        {"TYPE": "NIC", "VENDOR": "15b3", "DEVICE": "101d", "NETWORK_ID": "2"}]
    assert vectors(tmpl, "NIC") == [{"NETWORK_ID": "1"}]  # by id: see the tests of names below
    assert vectors(tmpl, "DISK") == [{"IMAGE_ID": "1"}]
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


def test_gpu_profile_and_defaults(tmp_path, capsys, cloud) -> None:
    sets = GPU_SET.replace('gpus = 2\ngpu_device = "2330"\n', 'gpu_profile = "nvidia-h100-1g.10gb"\n')
    sets = sets.replace('ib_vendor = "15b3"\nib_device = "101d"\nib_network = "ib-vfs"\n', "")
    setup = online(tmp_path, cloud, sets.replace('image = "debian-12-slurm"\n', ""))
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


def test_node_set_by_its_expression(tmp_path, capsys, cloud) -> None:
    setup = online(tmp_path, cloud, GPU_SET + CPU_SET)
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


def test_the_template_works_as_printed_for_the_slurm_user(tmp_path, capsys, cloud) -> None:
    # issue 32: NETWORK = "slurm-compute" as printed before failed every resume of an unprivileged user
    setup = online(tmp_path, cloud)
    code, out, _ = run(capsys, setup)
    assert code == EXIT_OK
    one = pyone.OneServer(cloud.endpoint, session=PLAIN)
    template_id = one.template.allocate(out)  # created as the Slurm user, as the header says
    assert one.templatepool.info(-2, -1, -1).VMTEMPLATE[0].NAME == "slurm-h100"
    vm_id = one.template.instantiate(template_id, "gpu01", False, "", False)
    vm = cloud.wait_for(lambda: cloud.vm(vm_id).state_str == "RUNNING" and cloud.vm(vm_id), 5)
    assert vm.uid == 2 and len(vm.pci) == 3  # two GPUs and the InfiniBand VF
    assert (vm.template["NIC"]["NETWORK"], vm.template["NIC"]["NETWORK_ID"]) == ("slurm-compute", "1")
    context = vm.template["CONTEXT"]
    assert context["SLURM_NODENAME"] == "gpu01" and context["SET_HOSTNAME"] == "gpu01"
    assert context["ETH0_IP"] == vm.ip and context["ONEGATE_ENDPOINT"].startswith("http://127.0.0.1:")
    assert base64.b64decode(context["MUNGE_KEY_BASE64"]) == KEY
    # the same template with the names as the node set gives them is what oned refuses this user
    by_name = out.replace('NETWORK_ID = "1"', 'NETWORK = "slurm-compute"').replace("slurm-h100", "by-name")
    with pytest.raises(pyone.OneException, match=r"User 2 does not own a network with name: slurm-compute \. Set "
                       r"NETWORK_UNAME or NETWORK_UID of owner in NIC\.$"):
        one.template.instantiate(one.template.allocate(by_name), "gpu02", False, "", False)


def test_names_become_ids_with_a_comment_naming_the_name_and_its_owner(tmp_path, capsys, cloud) -> None:
    setup = online(tmp_path, cloud)
    code, out, err = run(capsys, setup)
    assert code == EXIT_OK, err
    lines = out.splitlines()
    nic = lines.index('NIC = [ NETWORK_ID = "1" ]')
    assert lines[nic - 1].startswith('# network "slurm-compute": network 1, owned by oneadmin; by id')
    disk = lines.index('DISK = [ IMAGE_ID = "1" ]')
    assert lines[disk - 1].startswith('# image "debian-12-slurm": image 1, owned by oneadmin; by id')
    assert '# ib_network "ib-vfs": network 2, owned by oneadmin' in out
    assert f"ONE_AUTH={setup.root / 'one_auth'} onetemplate create FILE" in out


def test_a_name_under_several_ids_is_refused_naming_them(tmp_path, capsys, cloud) -> None:
    cloud.add_network("slurm-compute", uid=2)  # the Slurm user's own, beside oneadmin's 1
    code, out, err = run(capsys, online(tmp_path, cloud))
    assert code == EXIT_CONFIG and out == ""
    assert 'nodeset[0].network: user slurm sees several networks named "slurm-compute": ids 1 (oneadmin\'s), ' \
           "3 (slurm's); set network to the numeric id of the one to use" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("kind", "key", "acl"), [("network", "network", "NET"), ("image", "image", "IMAGE")])
def test_a_name_the_user_may_not_use_is_refused_with_the_grant(tmp_path, capsys, cloud, kind, key, acl) -> None:
    cloud.set_use(kind, 1, other_use=False)  # oneadmin's, not shared
    setup = online(tmp_path, cloud)
    code, out, err = run(capsys, setup)
    assert code == EXIT_CONFIG and out == ""
    [line] = err.strip().splitlines()
    name = "slurm-compute" if kind == "network" else "debian-12-slurm"
    assert f'nodeset[0].{key}: user slurm sees no {kind} named "{name}"' in line
    assert f'as oneadmin grant USE of it: oneacl create "@1 {acl}/#<id> USE"' in line
    assert line.endswith(f"or set {key} to its numeric id")
    cloud.set_use(kind, 1, grant_gid=1)  # that rule, for the user's group
    assert run(capsys, setup)[0] == EXIT_OK


def test_names_with_oned_unreachable_exit_4_and_ids_need_no_oned(tmp_path, capsys) -> None:
    code, out, err = run(capsys, site(tmp_path, GPU_SET))  # names, endpoint http://127.0.0.1:9
    assert code == 4 and out == "" and "cannot reach OpenNebula at http://127.0.0.1:9/RPC2" in err
    (tmp_path / "ids").mkdir()
    code, out, err = run(capsys, site(tmp_path / "ids", GPU_SET_IDS))
    assert code == EXIT_OK and 'NIC = [ NETWORK_ID = "1" ]' in out and "owned by" not in out


def test_gpu_type_alone_gives_the_node_set_a_gpu(tmp_path, capsys, cloud) -> None:
    # issue 32: docs/configuration.md says gpus defaults to 1 with any gpu_* key; gpu_type gave none
    sets = GPU_SET.replace('gpus = 2\ngpu_device = "2330"\n', 'gpu_type = "h100"\n')
    setup = online(tmp_path, cloud, sets)
    code, out, _ = run(capsys, setup)
    assert code == EXIT_OK
    assert [p for p in vectors(parse_template(out), "PCI") if "TYPE" not in p] == [{"VENDOR": "10de", "CLASS": "0302"}]
    from slurm_nebula_power.config import load_config

    nodeset = load_config(setup.config, setup.env).nodesets[0]
    assert template.gpus_of(nodeset) == 1 and template.gpus_wanted(nodeset) == 1
    assert shapes.options_shape(nodeset) == shapes.Shape(16, 131072, 1, "node set options", "10de", "")
    assert shapes.node_line(nodeset, shapes.options_shape(nodeset)).split()[4] == "Gres=gpu:h100:1"


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
def test_a_template_whose_gpus_differ_from_slurm_conf_is_warned_about(tmp_path, capsys, cloud, gres, warned) -> None:
    # issue 25: a GPU node set with no PCI line printed a template without a word; check then said
    # "remove gpu from Gres" when the template was what lacked the GPU
    setup = online(tmp_path, cloud)
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
