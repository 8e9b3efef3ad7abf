"""slurm-nebula-power slurm-conf, and the slurm.conf reader check uses."""

from __future__ import annotations

import os
import re
import textwrap

import pyone
import pytest
from simfixtures import AUTH
from slurm_findings import finding
from support import make_setup

from slurm_nebula_power.cli import slurm_conf as slurmconf
from slurm_nebula_power.config import load_config
from slurm_nebula_power.errors import EXIT_CONFIG, EXIT_OK
from slurm_nebula_power.shapes import model_feature, options_shape, pci_gpus, template_shape
from slurm_nebula_power.slurmconf import gres_gpu_types, gres_gpus, node_cpus, read_gres_conf, read_slurm_conf

GPU_SETS = """\
[[nodeset]]
nodes = "gpu[01-04]"
template = "slurm-gpu-worker"
boot_timeout = 600
gpu_type = "h100"
partition = "a100s"
features = "cloud,h100,ib"

[[nodeset]]
nodes = "cpu[01-02]"
template = "slurm-cpu-worker"
gpus = 0
"""

# Two GPU models in one partition (issue 33): the first node set is preferred, the second the fallback; a
# third names its Feature itself; the CPU node set is alone in its partition.
MODEL_TEMPLATES = {
    "slurm-a100": 'CPU = "8"\nVCPU = "8"\nMEMORY = "65536"\n'
                  'PCI = [ VENDOR = "10de", DEVICE = "20b5", CLASS = "0302" ]\nNIC = [ NETWORK = "slurm-net" ]\n',
    "slurm-h100": 'CPU = "8"\nVCPU = "8"\nMEMORY = "65536"\n'
                  + 'PCI = [ VENDOR = "10de", DEVICE = "2330", CLASS = "0302" ]\n' * 2
                  + 'NIC = [ NETWORK = "slurm-net" ]\n',
}
FALLBACK_SETS = """\
[[nodeset]]
nodes = "gpa[1-2]"
template = "slurm-a100"

[[nodeset]]
nodes = "gpb[1-2]"
template = "slurm-h100"

[[nodeset]]
nodes = "cpu[01-02]"
template = "slurm-cpu-worker"
gpus = 0

[[nodeset]]
nodes = "gpc[1-2]"
template = "slurm-gpu-worker"
features = "cloud,spare"
"""


def model_site(sim, root, nodesets: str = FALLBACK_SETS):
    """A deployment whose templates name their GPU model (PCI DEVICE), made in the simulator as its user."""
    one = pyone.OneServer(sim.endpoint, session=AUTH)
    known = {t.NAME for t in one.templatepool.info(-2, -1, -1).VMTEMPLATE}
    for name, body in MODEL_TEMPLATES.items():
        if name not in known:
            one.template.allocate(f'NAME = "{name}"\n{body}')
    return make_setup(root, sim.endpoint, AUTH, nodesets=nodesets)


def generated(capsys, env) -> list[str]:
    assert slurmconf.main([], env) == EXIT_OK
    return [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]


# ---- reading -----------------------------------------------------------------------------------------


def test_reader_keeps_power_actions_apart_from_the_parameters(tmp_path) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text('ResumeProgram=nres\nPowerAction=nres Location=slurmctld Program="/opt/snp/bin/r"\n'
                    "PowerAction=nsus Location=slurmd Program=/opt/snp/bin/s\nSuspendProgram=nsus\n")
    parsed = read_slurm_conf(conf)
    assert parsed.params == {"resumeprogram": "nres", "suspendprogram": "nsus"}
    assert parsed.actions == {"nres": {"location": "slurmctld", "program": "/opt/snp/bin/r"},
                              "nsus": {"location": "slurmd", "program": "/opt/snp/bin/s"}}


def test_reader_skips_node_partition_and_action_lines_without_a_value(tmp_path) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text("NodeName gpu01\nPartitionName gpu Nodes=gpu01\nPowerAction\nSuspendTime=600\n")
    parsed = read_slurm_conf(conf)
    assert (parsed.nodes, parsed.partitions, parsed.actions, parsed.params) == ({}, {}, {}, {"suspendtime": "600"})


def test_reader_takes_parameters_node_lines_defaults_and_includes(tmp_path) -> None:
    (tmp_path / "nodes.conf").write_text("NodeName=gpu[03-04] State=CLOUD CPUs=16 RealMemory=1000\n")
    conf = tmp_path / "slurm.conf"
    conf.write_text(textwrap.dedent("""\
        ClusterName=c1   # a comment
        slurmuser=slurm
        ResumeTimeout=900
        NodeName=DEFAULT CPUs=8 RealMemory=64000 \\
            Gres=gpu:h100:1
        NodeName=gpu[01-02] State=CLOUD Feature="cloud,h100"
        NodeName=login1 CPUs=4
        PartitionName=gpu Nodes=gpu[01-04] State=UP
        Include nodes.conf
        """))
    parsed = read_slurm_conf(conf)
    assert parsed.get("SlurmUser") == "slurm" and parsed.seconds("resumetimeout") == 900
    assert parsed.seconds("SuspendTimeout") == 30, "Slurm's default"
    assert parsed.nodes["gpu02"] == {"cpus": "8", "realmemory": "64000", "gres": "gpu:h100:1",
                                     "state": "CLOUD", "feature": "cloud,h100"}
    assert parsed.nodes["gpu04"]["cpus"] == "16"
    assert parsed.partitions == {"gpu": "gpu[01-04]"} and "state" not in parsed.params
    assert sorted(parsed.cloud_nodes) == ["gpu01", "gpu02", "gpu03", "gpu04"]
    assert "partitionname" not in parsed.params


@pytest.mark.parametrize(("gres", "count"), [
    ("", 0), ("gpu:1", 1), ("gpu:h100:2", 2), ("gpu", 1), ("gpu:a100:2(S:0-1),nic:1", 2),
    ("gpu:a:1,gpu:b:3", 4), ("mps:100", 0), ("gpu:1k", 1024),
])
def test_gres_gpu_count(gres: str, count: int) -> None:
    assert gres_gpus(gres) == count


@pytest.mark.parametrize(("gres", "types"), [
    ("", {}), ("gpu:2", {"": 2}), ("gpu:h100:2", {"h100": 2}), ("gpu", {"": 1}), ("gpu:h100", {"h100": 1}),
    ("gpu:a100:2(S:0-1),nic:1", {"a100": 2}), ("gpu:a:1,gpu:b:3,gpu:a:1", {"a": 2, "b": 3}), ("mps:100", {}),
])
def test_gres_gpus_by_type(gres: str, types: dict[str, int]) -> None:
    assert gres_gpu_types(gres) == types


def test_gres_conf_reader_takes_node_lines_global_lines_and_autodetect(tmp_path) -> None:
    path = tmp_path / "gres.conf"
    path.write_text(textwrap.dedent("""\
        AutoDetect=nvml   # the site's own GPUs
        NodeName=gpu[01-02] AutoDetect=off Name=gpu Type=h100 Count=2 \\
            File=/dev/nvidia[0-1]
        Name=gpu File=/dev/nvidia0
        NodeName=login1 AutoDetect=rsmi
        NodeName=bad[ Name=gpu File=/dev/nvidia0
        Name=mps Count=100 File=/dev/nvidia0
        """))
    gres = read_gres_conf(path)
    assert gres is not None and gres.path == path
    assert [line.keys.get("file") for line in gres.gpu_lines("gpu02")] == ["/dev/nvidia[0-1]", "/dev/nvidia0"]
    assert gres.gpu_lines("gpu02")[0].keys["type"] == "h100" and gres.gpu_lines("gpu02")[0].keys["count"] == "2"
    assert [line.keys.get("file") for line in gres.gpu_lines("cpu01")] == ["/dev/nvidia0"]  # no NodeName: all
    assert (gres.autodetect("gpu01"), gres.autodetect("login1"), gres.autodetect("cpu01")) == ("off", "rsmi", "nvml")


def test_gres_conf_reader_without_the_file_gives_none(tmp_path) -> None:
    assert read_gres_conf(tmp_path / "gres.conf") is None
    (tmp_path / "gres.conf").write_text("# nothing\n")
    empty = read_gres_conf(tmp_path / "gres.conf")
    assert empty is not None and empty.lines == [] and empty.autodetect("gpu01") == ""


def test_node_cpus_from_topology_when_cpus_missing() -> None:
    assert node_cpus({"cpus": "12"}) == 12
    assert node_cpus({"sockets": "2", "corespersocket": "8", "threadspercore": "2"}) == 32
    assert node_cpus({}) == 1


@pytest.mark.parametrize(("pci", "count"), [
    (None, 0),
    ({"VENDOR": "10de", "CLASS": "0302"}, 1),
    ([{"VENDOR": "10de", "CLASS": "0302"}, {"VENDOR": "10de", "CLASS": "0302"}], 2),
    ([{"VENDOR": "10de"}, {"VENDOR": "15b3", "TYPE": "NIC"}], 1),
    ({"VENDOR": "15b3", "CLASS": "0207"}, 0),
    ({"PROFILE": "nvidia-h100-1-10c"}, 1),
    ({"SHORT_ADDRESS": "41:00.0"}, 1),
])
def test_pci_gpus(pci, count: int) -> None:
    assert pci_gpus(pci) == count


def test_template_without_vcpu_gives_one_vcpu() -> None:
    shape = template_shape({"CPU": "2", "MEMORY": "4096"}, 7)
    assert (shape.vcpus, shape.memory_mb, shape.gpus, shape.source) == (1, 4096, 0, "template 7")


# ---- generating --------------------------------------------------------------------------------------


def test_node_lines_come_from_the_templates(sim, setup, capsys) -> None:
    lines = generated(capsys, setup.env)
    # slurm-gpu-worker: VCPU 8, MEMORY 65536, one PCI GPU; slurm-cpu-worker: VCPU 4, MEMORY 8192.
    assert "NodeName=gpu[01-08] State=CLOUD CPUs=8 RealMemory=62259 Gres=gpu:1 Feature=cloud" in lines
    assert "NodeName=cpu[01-04] State=CLOUD CPUs=4 RealMemory=7782 Feature=cloud" in lines
    assert "PartitionName=gpu Nodes=gpu[01-08] MaxTime=INFINITE State=UP" in lines
    assert "PartitionName=cloud Nodes=cpu[01-04] MaxTime=INFINITE State=UP" in lines
    assert "GresTypes=gpu" in lines


def test_power_saving_lines_have_absolute_existing_program_paths(sim, setup, capsys) -> None:
    lines = dict(line.split("=", 1) for line in generated(capsys, setup.env)
                 if not line.startswith(("Node", "Part")))
    for key, name in (("ResumeProgram", "slurm-nebula-resume"), ("SuspendProgram", "slurm-nebula-suspend"),
                      ("ResumeFailProgram", "slurm-nebula-resume-fail"),
                      ("PrologSlurmctld", "slurm-nebula-prolog")):
        assert os.path.isabs(lines[key]) and lines[key].endswith("/" + name)
        assert os.access(lines[key], os.X_OK)
    assert int(lines["ResumeTimeout"]) > 20, "above boot_timeout"
    assert int(lines["SuspendTimeout"]) > 15, "above [power] suspend_timeout"
    # The fake scontrol says 22.05: PrivateData=cloud is needed there; NodeAddr comes from resume,
    # so never cloud_reg_addrs (it would replace the leased address with slurmd's source address).
    assert lines["SlurmctldParameters"] == "idle_on_node_suspend"
    assert lines["PrivateData"] == "cloud"


def test_newer_slurm_gets_no_private_data(sim, setup, capsys) -> None:
    setup.set_version("slurm 24.05.1")
    lines = generated(capsys, setup.env)
    assert "SlurmctldParameters=idle_on_node_suspend" in lines
    assert not [line for line in lines if line.startswith(("PrivateData", "SchedulerParameters"))]


@pytest.mark.parametrize(("version", "expected"), [
    ("slurm 22.05.8", []), ("slurm 24.11.5", []), ("slurm 25.05.0", ["requeue_on_resume_failure"]),
    ("slurm 26.05.5", ["requeue_on_resume_failure"])])
def test_requeue_on_resume_failure_from_25_05(sim, setup, capsys, version: str, expected: list[str]) -> None:
    setup.set_version(version)
    lines = generated(capsys, setup.env)
    assert [line.split("=", 1)[1] for line in lines if line.startswith("SchedulerParameters")] == expected


def test_node_set_options_name_gpu_type_features_and_partition(sim, tmp_path, capsys) -> None:
    site = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=GPU_SETS)
    lines = generated(capsys, site.env)
    assert ("NodeName=gpu[01-04] State=CLOUD CPUs=8 RealMemory=62259 Gres=gpu:h100:1 Feature=cloud,h100,ib"
            in lines)
    assert "PartitionName=a100s Nodes=gpu[01-04] MaxTime=INFINITE State=UP" in lines
    assert "ResumeTimeout=900" in lines, "boot_timeout 600 + 300"


def test_node_sets_sharing_a_partition_are_weighted_in_their_order_with_their_gpu_model_as_feature(
        sim, tmp_path, capsys) -> None:
    site = model_site(sim, tmp_path / "site")
    assert slurmconf.main([], site.env) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if not line.startswith("#")]
    assert [line for line in lines if line.startswith("NodeName=")] == [
        "NodeName=gpa[1-2] State=CLOUD CPUs=8 RealMemory=62259 Gres=gpu:1 Feature=cloud,gpu_10de_20b5 Weight=10",
        "NodeName=gpb[1-2] State=CLOUD CPUs=8 RealMemory=62259 Gres=gpu:2 Feature=cloud,gpu_10de_2330 Weight=20",
        "NodeName=cpu[01-02] State=CLOUD CPUs=4 RealMemory=7782 Feature=cloud",  # alone in its partition
        "NodeName=gpc[1-2] State=CLOUD CPUs=8 RealMemory=62259 Gres=gpu:1 Feature=cloud,spare Weight=30"]
    assert "PartitionName=gpu Nodes=gpa[1-2],gpb[1-2],gpc[1-2] MaxTime=INFINITE State=UP" in lines
    [said] = [line for line in out if line.startswith("# partition gpu:")]
    assert said == (f"# partition gpu: gpa[1-2] Weight=10 (cloud,gpu_10de_20b5), gpb[1-2] Weight=20 "
                    f"(cloud,gpu_10de_2330), gpc[1-2] Weight=30 (cloud,spare), in their order in {site.config}: jobs "
                    "go to the lowest Weight first; a node set that runs out of GPUs steps out (drained with a "
                    "nebula: reason) and jobs fall back to the next; --constraint=<feature> pins a model")
    assert not [line for line in out if "no GPU model feature" in line], "gpc's features option names it"


def test_a_node_set_alone_gets_no_weight_and_one_without_a_model_is_said(sim, tmp_path, capsys) -> None:
    site = model_site(sim, tmp_path / "site", FALLBACK_SETS.replace('features = "cloud,spare"\n', ""))
    assert slurmconf.main([], site.env) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    assert "NodeName=gpc[1-2] State=CLOUD CPUs=8 RealMemory=62259 Gres=gpu:1 Feature=cloud Weight=30" in out
    assert ("# gpc[1-2]: no GPU model feature (the template's PCI entry names no DEVICE or PROFILE): set gpu_type to "
            "pin it with --constraint") in out
    alone = model_site(sim, tmp_path / "alone", '[[nodeset]]\nnodes = "gpb[1-2]"\ntemplate = "slurm-h100"\n')
    assert slurmconf.main([], alone.env) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    assert "NodeName=gpb[1-2] State=CLOUD CPUs=8 RealMemory=62259 Gres=gpu:2 Feature=cloud,gpu_10de_2330" in out
    assert not [line for line in out if "Weight" in line]


@pytest.mark.parametrize(("vendor", "device", "profile", "feature"), [
    ("10de", "2330", "", "gpu_10de_2330"), ("10DE", "20B5", "", "gpu_10de_20b5"), ("", "2330", "", "gpu_2330"),
    ("10de", "", "nvidia-h100-1g.10gb", "gpu_nvidia_h100_1g_10gb"),
    ("10de", "", "NVIDIA L40S-1B", "gpu_nvidia_l40s_1b"),
    ("10de", "", "", ""), ("", "", "", ""), ("10de", "x y\n", "", "gpu_10de_x_y"),
])
def test_a_gpu_model_feature_is_a_slurm_token(vendor, device, profile, feature) -> None:
    assert model_feature(vendor, device, profile) == feature
    assert not feature or (feature.replace("_", "").isalnum() and feature.isascii())


def test_a_template_s_gpus_name_a_model_only_when_they_are_all_one(tmp_path) -> None:
    h100 = {"VENDOR": "10de", "DEVICE": "2330", "CLASS": "0302"}
    assert template_shape({"PCI": [h100, h100]}, 1).gpu_model == "gpu_10de_2330"
    assert template_shape({"PCI": [h100, {**h100, "DEVICE": "20b5"}]}, 1).gpu_model == ""
    assert template_shape({"PCI": [h100, {"VENDOR": "15b3", "DEVICE": "101e", "TYPE": "NIC"}]}, 1).gpu_model == \
        "gpu_10de_2330"
    site = make_setup(tmp_path, "http://127.0.0.1:9/RPC2", AUTH, nodesets=(
        '[[nodeset]]\nnodes = "g[1-2]"\ntemplate = "t"\nvcpu = 8\nmemory_mb = 1000\ngpu_device = "2330"\n'))
    [nodeset] = load_config(site.config, site.env).nodesets
    shape = options_shape(nodeset)
    assert shape is not None and shape.gpu_model == "gpu_10de_2330" and shape.gpus == 1


def test_unreadable_template_is_an_error_though_the_node_set_options_describe_it(sim, tmp_path, capsys) -> None:
    # issue 32: a template the user cannot read printed as if fine, exit 0; resume then failed every node
    site = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=(
        '[[nodeset]]\nnodes = "gpu[01-02]"\ntemplate = "missing"\nvcpu = 16\nmemory_mb = 100000\ngpus = 2\n'))
    assert slurmconf.main([], site.env) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert "NodeName=gpu[01-02] State=CLOUD CPUs=16 RealMemory=95000 Gres=gpu:2 Feature=cloud" in out
    assert "template unreadable" in out
    [line] = err.strip().splitlines()
    assert line.startswith("slurm-nebula-power slurm-conf: error: node set gpu[01-02]: template 'missing': no VM "
                           "template named 'missing' is visible to user oneadmin; the template must be one user "
                           "oneadmin may use: if it does not exist, create it as that user: ONE_AUTH=")
    assert "as oneadmin: onetemplate chown <id> oneadmin" in line


def test_unreadable_template_without_options_is_an_error(sim, tmp_path, capsys) -> None:
    site = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=(
        '[[nodeset]]\nnodes = "gpu[01-02]"\ntemplate = "missing"\n'))
    assert slurmconf.main([], site.env) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == "" and "no VM template named 'missing'" in err and "onetemplate chown <id> oneadmin" in err
    assert "vcpu, memory_mb and gpus" in err and len(err.strip().splitlines()) == 1


def test_refused_credentials_are_not_blamed_on_the_templates(sim, tmp_path, capsys) -> None:
    site = make_setup(tmp_path / "site", sim.endpoint, AUTH.split(":")[0] + ":wrong", nodesets=(
        '[[nodeset]]\nnodes = "gpu[01-02]"\ntemplate = "slurm-gpu-worker"\nvcpu = 16\nmemory_mb = 100000\n'))
    assert slurmconf.main([], site.env) == 4
    out, err = capsys.readouterr()
    [line] = err.strip().splitlines()
    assert out == "" and "refused user oneadmin" in line and "put valid credentials" in line
    assert "onetemplate" not in line


def test_a_gpu_type_alone_counts_one_gpu_from_the_options(sim, tmp_path, capsys) -> None:
    # issue 32: gpus defaults to 1 with any gpu_* key, gpu_type too (docs/configuration.md)
    site = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=(
        '[[nodeset]]\nnodes = "gpu[01-02]"\ntemplate = "missing"\nvcpu = 16\nmemory_mb = 100000\n'
        'gpu_type = "h100"\n'))
    assert slurmconf.main([], site.env) == EXIT_CONFIG
    assert "NodeName=gpu[01-02] State=CLOUD CPUs=16 RealMemory=95000 Gres=gpu:h100:1 Feature=cloud,h100" in \
        capsys.readouterr().out


def test_help_exits_0(capsys) -> None:
    assert slurmconf.main(["--help"]) == 0
    assert "slurm.conf" in capsys.readouterr().out


# ---- the real controller accepts the output ----------------------------------------------------------

# Keys our output sets: the harness's own lines for them are dropped before ours are appended.
OURS = ("resumeprogram", "suspendprogram", "resumefailprogram", "prologslurmctld", "resumetimeout",
        "suspendtimeout", "suspendtime", "resumerate", "suspendrate", "slurmctldparameters", "privatedata",
        "schedulerparameters", "grestypes", "nodename", "partitionname")


def real_slurmctld_with_the_generated_lines(setup, capsys, slurm_factory):
    """A real slurmctld of the release under test running the lines slurm-conf prints for that release; the
    lines."""
    cluster = slurm_factory(nodes=["spare1"])
    major, minor = cluster.version
    setup.set_version(f"slurm {major}.{minor:02d}")  # the lines for the release under test
    lines = generated(capsys, setup.env)
    kept = [line for line in cluster.conf.read_text().splitlines()
            if line.partition("=")[0].strip().lower() not in OURS]
    cluster.conf.write_text("\n".join(kept + lines) + "\n")
    cluster.restart_slurmctld(clear_state=True)
    return cluster, lines


def our_errors(cluster) -> list[str]:
    """slurmctld's log lines with an error about power saving, programs, GRES or nodes."""
    errors = [line for line in cluster.log_text("slurmctld.log").lower().splitlines() if "error" in line]
    # Harmless on this machine: pmix missing, fresh state files, no Default=YES partition (a site has one).
    words = ("power", "program", "gres", "node", "invalid", "feature", "weight")
    return [line for line in errors if any(w in line for w in words)]


@pytest.mark.slurm
def test_real_slurmctld_accepts_the_generated_lines(sim, setup, capsys, slurm_factory) -> None:
    cluster, lines = real_slurmctld_with_the_generated_lines(setup, capsys, slurm_factory)
    gpu = cluster.node_info("gpu05")
    assert gpu["State"] == "IDLE+CLOUD+POWERED_DOWN"
    assert (gpu["CPUTot"], gpu["RealMemory"], gpu["Gres"]) == ("8", "62259", "gpu:1")
    assert cluster.node_info("cpu04")["CPUTot"] == "4"
    config = cluster.scontrol("show", "config")
    resume = [line for line in config.splitlines() if line.startswith("ResumeProgram ")]
    assert resume and resume[0].split("=", 1)[1].strip().endswith("/slurm-nebula-resume")
    expected = [line.split("=", 1)[1] for line in lines if line.startswith("SchedulerParameters")]
    scheduler = [line.split("=", 1)[1].strip() for line in config.splitlines()
                 if line.startswith("SchedulerParameters ")]
    assert scheduler == (expected or ["(null)"]), scheduler
    assert our_errors(cluster) == []
    parts = cluster.run("sinfo", "-h", "-o", "%P %D").stdout.split()
    assert parts == ["gpu", "8", "cloud", "4"]


@pytest.mark.slurm
def test_real_slurmctld_takes_the_weights_and_model_features_of_node_sets_sharing_a_partition(
        sim, tmp_path, capsys, slurm_factory) -> None:
    """Issue 33: two GPU models in one partition. slurmctld takes each node set's Weight and GPU model
    Feature; a job goes to the lowest Weight, and --constraint=<model> pins the other (sbatch --test-only:
    where slurmctld would start it, nothing powered up)."""
    site = model_site(sim, tmp_path / "site")
    cluster, _ = real_slurmctld_with_the_generated_lines(site, capsys, slurm_factory)
    seen = {node: cluster.node_info(node) for node in ("gpa1", "gpb2", "gpc1", "cpu01")}
    assert {node: (info["Weight"], info["AvailableFeatures"]) for node, info in seen.items()} == {
        "gpa1": ("10", "cloud,gpu_10de_20b5"), "gpb2": ("20", "cloud,gpu_10de_2330"),
        "gpc1": ("30", "cloud,spare"), "cpu01": ("1", "cloud")}
    assert seen["gpb2"]["State"] == "IDLE+CLOUD+POWERED_DOWN" and seen["gpb2"]["Gres"] == "gpu:2"
    assert our_errors(cluster) == []

    def starts_on(*args: str) -> str:
        done = cluster.run("sbatch", "--test-only", "--partition=gpu", "--nodes=2", "--gres=gpu:1", *args,
                           "--wrap=true", check=False)
        found = re.search(r" on nodes (\S+)", done.stdout + done.stderr)
        finding(f"sbatch --test-only {' '.join(['--nodes=2', *args])} over gpa (Weight 10), gpb (20), gpc (30)",
                (done.stdout + done.stderr).strip())
        return found.group(1) if found else (done.stdout + done.stderr).strip()

    assert starts_on() == "gpa[1-2]"
    assert starts_on("--constraint=gpu_10de_2330") == "gpb[1-2]"
    assert starts_on("--gres=gpu:2") == "gpb[1-2]"  # only gpb's nodes have two GPUs


@pytest.mark.parametrize("flag", [[], ["--gres-conf"]], ids=["slurm.conf", "gres.conf"])
def test_a_node_set_holding_static_nodes_is_refused_never_printed_as_cloud_nodes(sim, setup, capsys, flag) -> None:
    # issue 32: node[05-06] static in slurm.conf inside a node set's hostlist came out as State=CLOUD lines
    (setup.root / "slurm.conf").write_text("ClusterName=testcluster\nNodeName=gpu[07-08] CPUs=8 State=UNKNOWN\n")
    assert slurmconf.main(flag, setup.env) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "node set gpu[01-08]: gpu[07-08] are static nodes in" in err
    assert "take them out of the node set's nodes" in err
