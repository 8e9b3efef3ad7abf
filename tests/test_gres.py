"""gres.conf: the lines `slurm-conf --gres-conf` prints for the GPU node sets, what `check` says of the gres.conf
beside slurm.conf, and what the real slurmctld and slurmd do with each case `check` calls a problem."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from simfixtures import AUTH, fast_config
from slurm_findings import finding
from slurmharness import SlurmCluster, SlurmCommandError, SlurmTimeout, rewrite_lines
from support import Setup, make_setup

from opennebula_sim import TemplateSpec, running_simulator
from slurm_nebula_power.cli import check
from slurm_nebula_power.cli import slurm_conf as slurmconf
from slurm_nebula_power.cloud import OneCloud
from slurm_nebula_power.config import load_config
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK
from slurm_nebula_power.gres import generate_gres
from slurm_nebula_power.shapes import generate, read_shapes

GPU = '[ VENDOR = "10de", CLASS = "0302" ]'
TEMPLATES = (
    TemplateSpec(id=0, name="h100x2", body=f'CPU = "16"\nVCPU = "16"\nMEMORY = "131072"\nPCI = {GPU}\nPCI = {GPU}\n'
                 'NIC = [ NETWORK = "slurm-net" ]\n'),
    TemplateSpec(id=1, name="vgpu", body='CPU = "4"\nVCPU = "4"\nMEMORY = "16384"\n'
                 'PCI = [ VENDOR = "10de", PROFILE = "nvidia-558" ]\nNIC = [ NETWORK = "slurm-net" ]\n'),
    TemplateSpec(id=2, name="amd", body='CPU = "8"\nVCPU = "8"\nMEMORY = "65536"\n'
                 'PCI = [ VENDOR = "1002", CLASS = "0380" ]\nNIC = [ NETWORK = "slurm-net" ]\n'),
    TemplateSpec(id=3, name="cpu", body='CPU = "4"\nVCPU = "4"\nMEMORY = "8192"\nNIC = [ NETWORK = "slurm-net" ]\n'),
)
H100 = '[[nodeset]]\nnodes = "gpu[01-02]"\ntemplate = "h100x2"\ngpu_type = "h100"\n'
CPU = '\n[[nodeset]]\nnodes = "cpu[01-02]"\ntemplate = "cpu"\ngpus = 0\n'
EVERY_KIND = (H100 + '\n[[nodeset]]\nnodes = "vgpu[01-02]"\ntemplate = "vgpu"\ngpu_profile = "nvidia-558"\n'
              '\n[[nodeset]]\nnodes = "amd[01-02]"\ntemplate = "amd"\ngpu_vendor = "1002"\n' + CPU)
GRES_LINE = "NodeName=gpu[01-02] AutoDetect=off Name=gpu Type=h100 Count=2 File=/dev/nvidia[0-1]"


@pytest.fixture
def gpu_sim() -> Iterator:
    """A simulator whose templates give 2 passthrough GPUs, a vGPU, an AMD GPU, or none."""
    with running_simulator(fast_config(templates=TEMPLATES), auth=AUTH) as sim:
        yield sim


def printed(capsys, site: Setup, *argv: str) -> list[str]:
    assert slurmconf.main(list(argv), site.env) == EXIT_OK
    return capsys.readouterr().out.splitlines()


def good_site(sim, root: Path, nodesets: str = H100 + CPU) -> Setup:
    """A deployment whose slurm.conf and gres.conf are what slurm-conf prints (SlurmUser root)."""
    site = make_setup(root, sim.endpoint, AUTH, nodesets=nodesets)
    config = load_config(site.config, site.env)
    shapes = [(ns, shape) for ns, shape, _ in read_shapes(config, OneCloud(config.opennebula))]
    conf = ["ClusterName=testcluster", "SlurmUser=root", *generate(config, shapes, (22, 5))]
    (root / "slurm.conf").write_text("\n".join(conf) + "\n")
    (root / "gres.conf").write_text("\n".join(generate_gres(config, shapes)) + "\n")
    return site


def gres_findings(site: Setup, capsys) -> tuple[int, list[dict[str, str]]]:
    """check's exit code and its findings about GPUs (gres.conf and GresTypes)."""
    code = check.main(["--json"], site.env)
    found = json.loads(capsys.readouterr().out)
    return code, [f for f in found if f["subject"].startswith(("gres.conf", "slurm.conf GresTypes"))]


# ---- what slurm-conf prints ---------------------------------------------------------------------------


def test_gres_conf_lines_bind_each_gpu_node_set_s_devices(gpu_sim, tmp_path, capsys) -> None:
    site = make_setup(tmp_path / "site", gpu_sim.endpoint, AUTH, nodesets=EVERY_KIND)
    out = printed(capsys, site, "--gres-conf")
    assert [line for line in out if not line.startswith("#")] == [
        GRES_LINE,  # Type as in Gres=gpu:h100:2, one File a GPU
        "NodeName=vgpu[01-02] AutoDetect=off Name=gpu Count=1 File=/dev/nvidia0",  # a vGPU is a GPU to the guest
    ]
    comments = "\n".join(out)
    assert "vGPU(s) of profile nvidia-558, each a /dev/nvidiaN of its own" in comments
    assert "# amd[01-02]: template 2 ('amd'): 1 GPU(s) of PCI vendor 1002, not NVIDIA: write their" in comments
    assert "cpu[01-02]" not in comments


def test_gres_conf_types_and_counts_are_those_of_the_slurm_conf_lines(gpu_sim, tmp_path, capsys) -> None:
    site = make_setup(tmp_path / "site", gpu_sim.endpoint, AUTH, nodesets=EVERY_KIND)
    conf = printed(capsys, site)
    # the three GPU node sets share partition gpu: weighted in their order in the configuration
    assert ("NodeName=gpu[01-02] State=CLOUD CPUs=16 RealMemory=124518 Gres=gpu:h100:2 Feature=cloud,h100 Weight=10"
            in conf)
    assert ("NodeName=vgpu[01-02] State=CLOUD CPUs=4 RealMemory=15564 Gres=gpu:1 Feature=cloud,gpu_nvidia_558 "
            "Weight=20") in conf
    assert "GresTypes=gpu" in conf
    assert "# the GPUs' devices go in gres.conf beside slurm.conf: slurm-nebula-power slurm-conf --gres-conf" in conf


def test_gres_conf_of_an_unreadable_template_comes_from_the_node_set_options(gpu_sim, tmp_path, capsys) -> None:
    site = make_setup(tmp_path / "site", gpu_sim.endpoint, AUTH, nodesets=(
        '[[nodeset]]\nnodes = "gpu[01-04]"\ntemplate = "missing"\nvcpu = 16\nmemory_mb = 100000\ngpus = 4\n'
        'gpu_type = "l40s"\n'))
    assert slurmconf.main(["--gres-conf"], site.env) == 3  # still an error: resume could not use it (issue 32)
    out = capsys.readouterr().out.splitlines()
    assert "NodeName=gpu[01-04] AutoDetect=off Name=gpu Type=l40s Count=4 File=/dev/nvidia[0-3]" in out
    assert any("template unreadable" in line for line in out if line.startswith("#"))


def test_gres_conf_without_gpu_node_sets_says_so(gpu_sim, tmp_path, capsys) -> None:
    site = make_setup(tmp_path / "site", gpu_sim.endpoint, AUTH, nodesets=CPU)
    out = printed(capsys, site, "--gres-conf")
    assert all(line.startswith("#") for line in out) and "# No node set has GPUs: nothing to bind." in out


# ---- what check says ----------------------------------------------------------------------------------


def test_what_slurm_conf_prints_passes_the_gres_checks(gpu_sim, tmp_path, capsys) -> None:
    site = good_site(gpu_sim, tmp_path / "site")
    code, found = gres_findings(site, capsys)
    assert code == EXIT_OK
    assert [(f["level"], f["subject"]) for f in found] == [("ok", "gres.conf NodeName=gpu[01-02]")]
    assert found[0]["text"] == "File= lines for Gres=gpu:h100:2"


def gres_edit(old: str, new: str) -> Callable[[str | None], str | None]:
    def change(text: str | None) -> str | None:
        assert text is not None and old in text, (old, text)
        return text.replace(old, new)
    return change


def no_gres_conf(text: str | None) -> str | None:
    return None


def slurm_edit(old: str, new: str) -> Callable[[list[str]], list[str]]:
    def change(lines: list[str]) -> list[str]:
        assert old in lines, (old, lines)
        return [new if line == old else line for line in lines]
    return change


# Each case: what it does to the gres.conf (None: removes it) and to slurm.conf's lines, and check's problem.
PROBLEMS = {
    "no gres.conf": (no_gres_conf, None, "gres.conf {path}: missing, and slurm.conf gives gpu[01-02] Gres=gpu: "
                     "slurmd finds no GPU device on them"),
    "Count without File": (gres_edit(" File=/dev/nvidia[0-1]", ""), None, "gres.conf NodeName=gpu[01-02]: no "
                           "Name=gpu line with File= for them, and slurm.conf says Gres=gpu:h100:2"),
    "lines for other nodes": (gres_edit("NodeName=gpu[01-02]", "NodeName=gpu[03-04]"), None,
                              "gres.conf NodeName=gpu[01-02]: no Name=gpu line with File= for them"),
    "fewer files": (gres_edit("Count=2 File=/dev/nvidia[0-1]", "Count=1 File=/dev/nvidia0"), None,
                    "gres.conf NodeName=gpu[01-02]: their File= lines give gpu:h100:1, slurm.conf Gres=gpu:h100:2: "
                    "slurmd reports fewer GPUs"),
    "more files": (gres_edit("Count=2 File=/dev/nvidia[0-1]", "Count=3 File=/dev/nvidia[0-2]"), None,
                   "their File= lines give gpu:h100:3, slurm.conf Gres=gpu:h100:2: a VM with the GPUs slurm.conf "
                   "gives lacks the devices beyond them"),
    "no Type": (gres_edit(" Type=h100", ""), None, "their File= lines give gpu:2, slurm.conf Gres=gpu:h100:2: "
                "slurmd reports fewer GPUs of the type slurm.conf names"),
    "no GresTypes": (None, slurm_edit("GresTypes=gpu", "#"), "slurm.conf GresTypes: lacks gpu, and gpu[01-02] "
                     "have Gres=gpu: slurmctld drops their GPUs"),
}
# AutoDetect reaching a cloud node: what it does depends on the release and the value.
AUTODETECT = {
    "global AutoDetect=nvml": gres_edit("NodeName=gpu[01-02] AutoDetect=off ", "AutoDetect=nvml\nNodeName=gpu[01-02] "),
    "AutoDetect=nvml on the line": gres_edit("AutoDetect=off Name=gpu", "AutoDetect=nvml Name=gpu"),
    "global AutoDetect=nvidia": gres_edit("NodeName=gpu[01-02] AutoDetect=off ",
                                          "AutoDetect=nvidia\nNodeName=gpu[01-02] "),
}
REFUSED = "refuses AutoDetect on cloud nodes, and slurmctld exits at start (\"Cannot use AutoDetect on cloud node\")"
IGNORED = "which gres.conf(5) rules out for cloud nodes: Slurm 22.05 does not know it and ignores it"
DETECTS = "which gres.conf(5) rules out for cloud nodes: slurmctld logs \"Cannot use AutoDetect on cloud/dynamic node\""
FINE = {
    "a site-wide AutoDetect=nvml beside ours": gres_edit("NodeName=gpu[01-02]", "AutoDetect=nvml\nNodeName=gpu[01-02]"),
    "one line a device": gres_edit("Count=2 File=/dev/nvidia[0-1]", "File=/dev/nvidia0\n"
                                   "NodeName=gpu[01-02] Name=gpu Type=h100 File=/dev/nvidia1"),
    "a line without NodeName": gres_edit("NodeName=gpu[01-02] AutoDetect=off ", "AutoDetect=off\n"),
    "MultipleFiles for each": gres_edit("Count=2 File=/dev/nvidia[0-1]", "MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/"
                                        "nvidia-cap21\nNodeName=gpu[01-02] Name=gpu Type=h100 "
                                        "MultipleFiles=/dev/nvidia1,/dev/nvidia-caps/nvidia-cap30"),
}


def apply(root: Path, gres: Callable[[str | None], str | None] | None,
          slurm: Callable[[list[str]], list[str]] | None) -> None:
    """Apply a case's edits to the gres.conf and slurm.conf in `root`."""
    path = root / "gres.conf"
    if gres is not None:
        text = gres(path.read_text() if path.exists() else None)
        if text is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(text)
    if slurm is not None:
        rewrite_lines(root / "slurm.conf", slurm)


@pytest.mark.parametrize("case", list(PROBLEMS))
def test_a_gres_conf_that_leaves_gpu_nodes_without_devices_is_a_problem(gpu_sim, tmp_path, capsys, case) -> None:
    site = good_site(gpu_sim, tmp_path / "site")
    gres, slurm, expected = PROBLEMS[case]
    apply(site.root, gres, slurm)
    code, found = gres_findings(site, capsys)
    problems = [f"{f['subject']}: {f['text']}" for f in found if f["level"] == "problem"]
    assert code == EXIT_NODES_FAILED
    assert len(problems) == 1 and expected.format(path=site.root / "gres.conf") in problems[0], problems
    [fix] = [f["fix"] for f in found if f["level"] == "problem"]
    assert "slurm-nebula-power slurm-conf --gres-conf" in fix or "GresTypes=gpu" in fix, fix


@pytest.mark.parametrize(("release", "case", "level", "text"), [
    ("22.05.8", "global AutoDetect=nvml", "problem", "AutoDetect=nvml applies to them: Slurm 22.05 " + REFUSED),
    ("22.05.8", "AutoDetect=nvml on the line", "problem", "AutoDetect=nvml applies to them: Slurm 22.05 " + REFUSED),
    ("22.05.8", "global AutoDetect=nvidia", "warning", "AutoDetect=nvidia applies to them, " + IGNORED),
    ("24.11.5", "global AutoDetect=nvml", "warning", "AutoDetect=nvml applies to them, " + DETECTS),
    ("26.05.5", "global AutoDetect=nvidia", "warning", "AutoDetect=nvidia applies to them, " + DETECTS),
])
def test_autodetect_on_gpu_cloud_nodes_is_judged_by_what_the_release_does(gpu_sim, tmp_path, capsys, release, case,
                                                                          level, text) -> None:
    site = good_site(gpu_sim, tmp_path / "site")
    site.set_version(f"slurm {release}")
    apply(site.root, AUTODETECT[case], None)
    code, found = gres_findings(site, capsys)
    said = [(f["level"], f["text"], f["fix"]) for f in found if f["level"] != "ok"]
    assert len(said) == 1 and said[0][0] == level and said[0][1].startswith(text), said
    assert said[0][2] == "add AutoDetect=off to their line (slurm-nebula-power slurm-conf --gres-conf prints them)"
    assert code == (EXIT_NODES_FAILED if level == "problem" else EXIT_OK)


@pytest.mark.parametrize("case", list(FINE))
def test_gres_conf_lines_slurm_binds_the_same_way_pass(gpu_sim, tmp_path, capsys, case) -> None:
    site = good_site(gpu_sim, tmp_path / "site")
    apply(site.root, FINE[case], None)
    code, found = gres_findings(site, capsys)
    assert code == EXIT_OK and [f["level"] for f in found] == ["ok"], found


def test_an_untyped_gres_takes_typed_lines(gpu_sim, tmp_path, capsys) -> None:
    # slurmd logs a warning for the typed line, and binds its devices all the same (22.05, 24.11, 26.05)
    site = good_site(gpu_sim, tmp_path / "site", nodesets=H100.replace('gpu_type = "h100"\n', "") + CPU)
    apply(site.root, gres_edit("Name=gpu Count=2", "Name=gpu Type=h100 Count=2"), None)
    code, found = gres_findings(site, capsys)
    assert code == EXIT_OK and [f["level"] for f in found] == ["ok"], found


def test_cpu_node_sets_need_no_gres_conf(gpu_sim, tmp_path, capsys) -> None:
    site = good_site(gpu_sim, tmp_path / "site", nodesets=CPU)
    (site.root / "gres.conf").unlink()
    code, found = gres_findings(site, capsys)
    assert code == EXIT_OK and found == []


def test_an_unreadable_gres_conf_is_a_problem(gpu_sim, tmp_path, capsys) -> None:
    site = good_site(gpu_sim, tmp_path / "site")
    path = site.root / "gres.conf"
    path.unlink()
    path.mkdir()  # read() fails with EISDIR even for root
    code, found = gres_findings(site, capsys)
    assert code == EXIT_NODES_FAILED
    assert [(f["subject"], f["text"]) for f in found] == [
        (f"gres.conf {path}", f"{path}: cannot read gres.conf: Is a directory; run check as root or as SlurmUser "
                              "on the slurmctld host")]


# ---- the real slurmctld and slurmd --------------------------------------------------------------------

VM_GPUS = 2  # the devices a VM of template h100x2 has


def last_fatal(log: str) -> str:
    """The last fatal (else error) line of a Slurm log, without its time stamp."""
    for word in ("fatal:", "error:"):
        lines = [line.split("] ", 1)[-1] for line in log.splitlines() if word in line]
        if lines:
            return lines[-1]
    return "(nothing in the log)"


def real_outcome(cluster: SlurmCluster) -> tuple[bool, str]:
    """Start slurmctld on the case's files, boot gpu01 as a VM with its GPU devices, run a job that asks for
    all of them: (whether the job saw each device, what happened on the way)."""
    try:
        cluster.restart_slurmctld(clear_state=True)
    except (SlurmCommandError, SlurmTimeout):
        return False, "slurmctld refused to start: " + last_fatal(cluster.log_text("slurmctld.log"))
    cluster.scontrol("update", "NodeName=gpu01", "NodeAddr=127.0.1.1", "NodeHostname=gpu01")
    cluster.scontrol("update", "NodeName=gpu01", "State=POWER_UP")
    # The VM boots once slurmctld has run the ResumeProgram (POWERING_UP), as with our resume: a slurmd that
    # registers before that, while the node only has the POWER_UP request, was seen ignored by 24.11.
    cluster.wait_until(lambda: cluster.node_state("gpu01"), lambda state: "POWERING_UP" in state.split("+"), 60,
                       "gpu01 POWERING_UP (its ResumeProgram run)")
    # slurmd waits about 20 s for a File= device that is missing before it gives up: before it daemonizes
    # on 22.05 (it exits 1), after on 26.05 (it exits 0, then the daemon ends)
    started = cluster.run(*cluster.guest_argv("gpu01", "127.0.1.1", VM_GPUS), check=False, timeout=180)
    if started.returncode != 0:
        log = cluster.log_text("slurmd-gpu01.log")
        return False, f"slurmd exited {started.returncode} at start: {last_fatal(log)}"

    def registered_or_ended() -> str:
        state = cluster.node_state("gpu01")
        if state and not any(flag in state for flag in ("NOT_RESPONDING", "POWERED_DOWN")):
            return state
        return "ended" if "fatal:" in cluster.log_text("slurmd-gpu01.log") else ""

    try:
        state = cluster.wait_for(registered_or_ended, 90, "gpu01 registered, or its slurmd ended")
    except SlurmTimeout as exc:  # what the guest's slurmd said decides why it never registered
        raise SlurmTimeout(f"{exc}\n--- slurmd-gpu01.log (tail) ---\n{cluster.log_tail('slurmd-gpu01.log', 40)}"
                           ) from None
    if state == "ended":
        return False, f"slurmd ended after it started: {last_fatal(cluster.log_text('slurmd-gpu01.log'))}"
    if "DRAIN" in state or "INVALID" in state:
        return False, f"registered {state}: {cluster.node_info('gpu01').get('Reason', '')}"
    try:
        job = cluster.sbatch("--gres=gpu:2", "-w", "gpu01", "--wrap",
                             "echo CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}")
    except SlurmCommandError as exc:
        return False, f"registered {state}; sbatch refused: {exc.stderr.strip()}"
    ended = cluster.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 60)
    printed = cluster.job_output(job).strip()
    return printed == f"CUDA_VISIBLE_DEVICES={','.join(map(str, range(VM_GPUS)))}", \
        f"registered {state}; the job {ended}: {printed}"


@pytest.mark.slurm
@pytest.mark.parametrize("case", ["as printed", *PROBLEMS, *AUTODETECT])
def test_check_calls_gres_a_problem_exactly_where_a_real_job_gets_no_gpu(gpu_sim, tmp_path, capsys, slurm_factory,
                                                                          case) -> None:
    site = good_site(gpu_sim, tmp_path / "site")
    conf = (site.root / "slurm.conf").read_text().split()
    [gres] = {token for token in conf if token.startswith("Gres=")}
    cluster = slurm_factory(nodes=["gpu01", "gpu02"], node_extra=gres, extra_conf="GresTypes=gpu")
    (cluster.base / "gres.conf").write_text((site.root / "gres.conf").read_text())  # as slurm-conf printed it
    edits = PROBLEMS[case][:2] if case in PROBLEMS else (AUTODETECT.get(case), None)
    apply(cluster.base, *edits)
    apply(site.root, *edits)
    major, minor = cluster.version
    site.set_version(f"slurm {major}.{minor:02d}")
    bound, what = real_outcome(cluster)
    code, found = gres_findings(site, capsys)
    problems = [f"{f['subject']}: {f['text']}" for f in found if f["level"] == "problem"]
    said = [f["level"] for f in found if f["level"] != "ok"]
    finding(f"gres.conf case '{case}' (Gres=gpu:h100:2): what the real job got; check",
            f"{what}; {', '.join(said) or 'ok'}")
    if case in AUTODETECT:  # what the release does with it decides; check says it either way
        assert said, found
    else:
        assert bound == (case == "as printed"), what
    assert bool(problems) == (not bound) and code == (EXIT_OK if bound else EXIT_NODES_FAILED), (what, problems)


FORGED = "NodeName=gpu01 Name=gpu File=/dev/sda"


@pytest.mark.parametrize(("key", "value"), [("PROFILE", f"nvidia-558\n{FORGED}"), ("VENDOR", f"10de\n{FORGED}"),
                                            ("DEVICE", "2330\r# x"), ("PROFILE", "a#b"), ("VENDOR", "10dee")])
def test_a_template_value_that_would_write_a_line_of_its_own_is_refused(tmp_path, capsys, key: str,
                                                                       value: str) -> None:
    # issue 34, item 4: a template's PCI PROFILE (or VENDOR) with a newline wrote a whole extra
    # `NodeName=... File=/dev/sda` line into the gres.conf check tells the administrator to install
    entry = {"VENDOR": "10de", "CLASS": "0302", key: value}
    pci = "[ " + ", ".join(f'{k} = "{v}"' for k, v in entry.items()) + " ]"
    templates = (TemplateSpec(id=0, name="forged", body=f'CPU = "4"\nVCPU = "4"\nMEMORY = "16384"\nPCI = {pci}\n'
                              'NIC = [ NETWORK = "slurm-net" ]\n'),)
    with running_simulator(fast_config(templates=templates), auth=AUTH) as sim:
        site = make_setup(tmp_path / "site", sim.endpoint, AUTH,
                          nodesets='[[nodeset]]\nnodes = "gpu[01-02]"\ntemplate = "forged"\n')
        for argv in (["--gres-conf"], []):
            code = slurmconf.main(argv, site.env)
            captured = capsys.readouterr()
            assert code == 3, captured.out
            assert FORGED not in captured.out and "/dev/sda" not in captured.out
            assert f"template 0: PCI {key}" in captured.out + captured.err, captured
            assert "fix the template" in captured.out + captured.err
