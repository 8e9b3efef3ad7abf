"""slurm-nebula-power check: a good deployment passes; each listed problem is found, with its fix."""

from __future__ import annotations

import base64
import contextlib
import grp
import io
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from simfixtures import AUTH, fast_config
from slurm_findings import finding
from slurmharness import SlurmCommandError, as_power_actions, recording_program, rewrite_lines
from support import Setup, make_setup, run_env

from opennebula_sim import Durations, SimConfig, TemplateSpec, default_hosts, running_simulator
from slurm_nebula_power.cli import check
from slurm_nebula_power.cloud import OneCloud
from slurm_nebula_power.config import load_config
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK
from slurm_nebula_power.gres import generate_gres
from slurm_nebula_power.shapes import PROGRAMS, generate, program_path, read_shapes

NODESETS = """\
[[nodeset]]
nodes = "gpu[01-04]"
template = "slurm-gpu-worker"
boot_timeout = 600

[[nodeset]]
nodes = "cpu[01-02]"
template = "slurm-cpu-worker"
gpus = 0
"""
PROLOG = f"PrologSlurmctld={program_path('slurm-nebula-prolog')[0]}"  # slurm-conf prints it


def good_site(sim, root: Path, nodesets: str = NODESETS) -> Setup:
    """A deployment that passes: slurm.conf and gres.conf made by slurm-conf's generators, SlurmUser root."""
    site = make_setup(root, sim.endpoint, AUTH, nodesets=nodesets)
    config = load_config(site.config, site.env)
    shapes = [(ns, shape) for ns, shape, _ in read_shapes(config, OneCloud(config.opennebula))]
    lines = generate(config, shapes, (22, 5))
    conf = ["ClusterName=testcluster", "SlurmUser=root", *lines]
    assert PROLOG in conf
    (root / "slurm.conf").write_text("\n".join(conf) + "\n")
    (root / "gres.conf").write_text("\n".join(generate_gres(config, shapes)) + "\n")
    return site


@pytest.fixture
def site(sim, tmp_path) -> Setup:
    return good_site(sim, tmp_path / "site")


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new))


def findings(site: Setup, capsys) -> tuple[int, list[dict[str, str]]]:
    code = check.main(["--json"], site.env)
    return code, json.loads(capsys.readouterr().out)


def problems(site: Setup, capsys) -> tuple[int, list[str]]:
    code, found = findings(site, capsys)
    return code, [f"{f['subject']}: {f['text']} -> fix: {f['fix']}" for f in found if f["level"] == "problem"]


def test_good_deployment_passes(site, capsys) -> None:
    code = check.main([], site.env)
    out, err = capsys.readouterr()
    assert code == EXIT_OK, out
    assert [line for line in out.splitlines() if not line.startswith("ok ")] == []
    assert "0 problem(s), 0 warning(s)" in err
    assert "oned 6.10.0, user oneadmin, VM pool readable" in out
    assert "template 0: 8 vCPU, 65536 MiB, 1 GPU" in out
    assert "OpenNebula host pool: " in out and " take VMs; gpu[01-04]: " in out and " GPU 10de:0302 free" in out
    assert f"oned.conf ONEGATE_ENDPOINT: {sim_onegate(site)} (the templates of gpu[01-04], cpu[01-02] have " \
           'CONTEXT TOKEN = "YES")' in out


def sim_onegate(site: Setup) -> str:
    """Where the simulator serves OneGate: its XML-RPC endpoint without /RPC2."""
    config = load_config(site.config, site.env)
    return config.opennebula.endpoint.removesuffix("/RPC2")


def test_token_yes_without_onegate_endpoint_in_oned_conf_is_a_problem(tmp_path, capsys) -> None:
    # oned refuses every instantiate of such a template, even with wait_for = "running".
    with running_simulator(fast_config(onegate=False), auth=AUTH) as sim:
        site = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=NODESETS)
        code, found = problems(site, capsys)
    assert code == EXIT_NODES_FAILED
    assert [p for p in found if p.startswith("oned.conf ONEGATE_ENDPOINT")] == [
        'oned.conf ONEGATE_ENDPOINT: not set, and the templates of gpu[01-04], cpu[01-02] have CONTEXT TOKEN = '
        '"YES": oned refuses every instantiate ("TOKEN set, but onegate endpoint was not defined in oned.conf."), '
        "whatever wait_for says -> fix: set ONEGATE_ENDPOINT in oned.conf to OneGate's URL as the VMs reach it "
        "(e.g. http://<front end>:5030), restart oned and run onegate-server"]


def test_templates_without_token_need_no_onegate_endpoint(tmp_path, capsys) -> None:
    body = 'CPU = "1"\nVCPU = "8"\nMEMORY = "65536"\nPCI = [ VENDOR = "10de", CLASS = "0302" ]\n' \
           'CONTEXT = [ NETWORK = "YES" ]\n'
    templates = (TemplateSpec(id=0, name="slurm-gpu-worker", body=body),)
    with running_simulator(fast_config(onegate=False, templates=templates), auth=AUTH) as sim:
        site = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=NODESETS.split("\n\n")[0] + "\n")
        _, found = findings(site, capsys)
    assert not [f for f in found if f["subject"].startswith("oned.conf ONEGATE_ENDPOINT")]


@pytest.mark.parametrize(("old", "new", "expected"), [
    ("CPUs=8", "CPUs=32", "NodeName=gpu[01-04]: CPUs=32 but template 0 gives 8 vCPUs: slurmd registers fewer "
     "and the node is drained -> fix: set CPUs=8"),
    ("RealMemory=62259", "RealMemory=70000", "NodeName=gpu[01-04]: RealMemory=70000 is above the VM's MEMORY "
     "65536 MiB: the node is drained (Low RealMemory) -> fix: set RealMemory=62259"),
    ("Gres=gpu:1", "Gres=gpu:2", "NodeName=gpu[01-04]: Gres has 2 GPU(s) but template 0 gives 1 -> fix: set "
     "Gres=gpu:1"),
    ("ResumeTimeout=900", "ResumeTimeout=300", "ResumeTimeout: 300 s is not above the longest boot_timeout "
     "600 s: Slurm gives up on nodes still booting -> fix: set ResumeTimeout=900, or lower boot_timeout"),
    ("SuspendTimeout=45", "SuspendTimeout=10", "SuspendTimeout: 10 s is below [power] suspend_timeout 15 s: "
     "a terminate may still run when slurmctld reuses the node name, and a quick resume meets the old VM -> "
     "fix: set SuspendTimeout=45, or lower suspend_timeout"),
    ("PrivateData=cloud", "PrivateData=jobs", "PrivateData: lacks cloud"),
    ("ResumeProgram=", "ResumeProgram=/bin/true\n#", "slurm.conf ResumeProgram: is /bin/true, not "
     "slurm-nebula-resume -> fix: ResumeProgram=/"),
    ("SuspendProgram=", "SuspendProgram=/nowhere/slurm-nebula-suspend\n#", "slurm.conf SuspendProgram: "
     "/nowhere/slurm-nebula-suspend does not exist or is not executable"),
    # a static node inside a node set: taken out of the node set, never made a cloud node
    ("NodeName=cpu[01-02] State=CLOUD", "NodeName=cpu[01-02]", "node set cpu[01-02]: cpu[01-02] are static nodes "
     "in slurm.conf (no State=CLOUD): resume refuses them and never makes a VM for them -> fix: take cpu[01-02] "
     "out of the node set's nodes"),
    ("NodeName=cpu[01-02]", "#", "node set cpu[01-02]: cpu[01-02] not in slurm.conf -> fix: add NodeName "
     "lines with State=CLOUD (slurm-nebula-power slurm-conf prints them)"),
    ("SlurmUser=root", "SlurmUser=root\nNodeName=gpu[05-06] State=CLOUD CPUs=8 RealMemory=1",
     "slurm.conf gpu[05-06]: State=CLOUD but in no [[nodeset]]: resume refuses them"),
    ("SlurmUser=root", "SlurmUser=no-such-user",
     "slurm.conf SlurmUser: no-such-user does not exist on this host"),
    # a digit to str.isdigit() that int() refuses made check a traceback (issue 22 item 1's bug class)
    ("CPUs=8", "CPUs=\u00b2", "NodeName=gpu[01-04]: CPUs=\u00b2 is not a number -> fix: give CPUs in ASCII digits"),
    ("RealMemory=62259", "RealMemory=\u00b2", "NodeName=gpu[01-04]: RealMemory=\u00b2 is not a number"),
])
def test_slurm_conf_problem_is_found_with_its_fix(site, capsys, old: str, new: str, expected: str) -> None:
    edit(site.root / "slurm.conf", old, new)
    code, found = problems(site, capsys)
    assert code == EXIT_NODES_FAILED
    assert any(expected in line for line in found), found


def test_auth_file_readable_by_others_is_found(site, capsys) -> None:
    (site.root / "one_auth").chmod(0o644)
    code, found = problems(site, capsys)
    assert code == EXIT_NODES_FAILED
    [line] = found  # its own fix, not "example-config prints an example" (issue 32)
    assert line.endswith(f"one_auth is accessible by group or others (mode 0644) -> fix: chmod 600 "
                         f"{site.root / 'one_auth'} and chown it to SlurmUser"), line


def test_auth_file_slurm_user_cannot_read_is_found(site, capsys) -> None:
    user = pwd.getpwnam("nobody").pw_name
    edit(site.root / "slurm.conf", "SlurmUser=root", f"SlurmUser={user}")
    code, found = problems(site, capsys)
    assert code == EXIT_NODES_FAILED
    auth = site.root / "one_auth"
    fix = f"chown {user} {auth} && chmod 600 {auth}"
    assert f"auth file {auth}: SlurmUser {user} has no access -> fix: {fix}" in found


def test_audit_and_metrics_files_slurm_user_cannot_write_are_found(site, capsys) -> None:
    user = pwd.getpwnam("nobody").pw_name
    edit(site.root / "slurm.conf", "SlurmUser=root", f"SlurmUser={user}")
    site.root.chmod(0o755)  # nobody may search it, not write it
    code, found = problems(site, capsys)
    assert code == EXIT_NODES_FAILED
    assert f"audit_file {site.audit}: SlurmUser {user} has no access -> fix: mkdir -p {site.root} && chown " \
           f"{user} {site.root}" in found
    assert any(line.startswith(f"metrics_file {site.metrics}: SlurmUser {user} has no access") for line in found)


def test_wrong_credentials_are_found(site, capsys) -> None:
    (site.root / "one_auth").write_text("oneadmin:wrong\n")
    code, found = problems(site, capsys)
    assert code == EXIT_NODES_FAILED
    assert any(line.startswith("OpenNebula http://127.0.0.1:") and "user oneadmin refused" in line and
               "put valid credentials" in line for line in found), found


def test_unreachable_endpoint_is_found(site, capsys) -> None:
    edit(site.config, "endpoint = \"http://127.0.0.1:", "endpoint = \"http://127.0.0.1:9/RPC2\"\n# ")
    code, found = problems(site, capsys)
    assert code == EXIT_NODES_FAILED
    expected = "OpenNebula http://127.0.0.1:9/RPC2: unreachable: [one.system.version] connection failed"
    assert any(expected in line for line in found), found


@pytest.mark.parametrize(("old", "new", "expected"), [
    ('template = "slurm-gpu-worker"', 'template = "missing"', "node set gpu[01-04] template 'missing': no VM "
     "template named 'missing' is visible to user oneadmin -> fix: the template must be one user oneadmin may use: "
     "if it does not exist, create it as that user: ONE_AUTH="),
    ("gpus = 0\n", "\n", "node set cpu[01-02] template 'slurm-cpu-worker': has no PCI GPU -> fix: add "
     'PCI = [ VENDOR = "10de", CLASS = "0302" ] to the template, or set gpus = 0'),
    ("boot_timeout = 600\n", "boot_timeout = 600\ngpus = 2\n",
     "gives 1 GPU(s) but the node set says gpus = 2"),
    ("gpus = 0\n", 'gpus = 0\nsuspend_action = "poweroff"\n', 'node set cpu[01-02]: suspend_action = '
     '"poweroff": a powered-off VM keeps its GPU reserved on its host while the node is idle -> fix: use '
     '"terminate"'),
])
def test_configuration_problem_is_found_with_its_fix(site, capsys, old: str, new: str, expected: str) -> None:
    edit(site.config, old, new)
    code, found = problems(site, capsys)
    assert code == EXIT_NODES_FAILED
    assert any(expected in line for line in found), found


def test_prolog_other_than_ours_is_a_warning_only(site, capsys) -> None:
    edit(site.root / "slurm.conf", PROLOG, "PrologSlurmctld=/etc/slurm/prolog.sh")
    code, found = findings(site, capsys)
    assert code == EXIT_OK
    [warning] = [f for f in found if f["level"] == "warning"]
    assert warning["text"] == ("is /etc/slurm/prolog.sh, not slurm-nebula-prolog: a job on cloud nodes "
                               "starts only at slurmctld's next 30 s check after they are up")
    assert "prolog_chain" in warning["fix"]


def test_our_prolog_is_ok_and_its_chain_checked(site, capsys) -> None:
    chain = site.root / "site-prolog"
    chain.write_text("#!/bin/sh\nexit 0\n")
    chain.chmod(0o755)
    edit(site.config, "[slurm]\n", f'[slurm]\nprolog_chain = "{chain}"\n')
    code, found = findings(site, capsys)
    assert code == EXIT_OK
    ok = {f["subject"]: f["text"] for f in found if f["level"] == "ok"}
    assert ok["slurm.conf PrologSlurmctld"].endswith("slurm-nebula-prolog: jobs start as soon as their cloud "
                                                     "nodes are up")
    assert ok[f"{site.config} slurm.prolog_chain"] == f"{chain}, run after the nodes are up"


@pytest.mark.parametrize(("chain", "expected"), [
    ("/nowhere/site-prolog", "/nowhere/site-prolog does not exist or is not executable: slurm-nebula-prolog "
     "fails every job"),
    ("/usr/bin/slurm-nebula-prolog", "is slurm-nebula-prolog itself: it would run itself without end"),
])
def test_bad_prolog_chain_is_a_problem(site, capsys, chain: str, expected: str) -> None:
    edit(site.config, "[slurm]\n", f'[slurm]\nprolog_chain = "{chain}"\n')
    code, found = problems(site, capsys)
    assert code == EXIT_NODES_FAILED
    assert any(f"slurm.prolog_chain: {chain}" in line and expected in line for line in found), found


def test_prolog_that_is_ours_but_missing_is_a_problem(site, capsys) -> None:
    edit(site.root / "slurm.conf", PROLOG, "PrologSlurmctld=/nowhere/slurm-nebula-prolog")
    code, found = problems(site, capsys)
    assert code == EXIT_NODES_FAILED
    assert any("/nowhere/slurm-nebula-prolog does not exist or is not executable: every job fails" in line
               for line in found), found


def test_prolog_epilog_timeout_below_resume_timeout_is_a_warning(site, capsys) -> None:
    edit(site.root / "slurm.conf", "ResumeTimeout=900", "ResumeTimeout=900\nPrologEpilogTimeout=300")
    code, found = findings(site, capsys)
    assert code == EXIT_OK
    [warning] = [f for f in found if f["level"] == "warning"]
    assert warning["subject"] == "slurm.conf PrologEpilogTimeout"
    assert warning["text"].startswith("300 s is below ResumeTimeout 900 s + 30 s")
    assert warning["fix"] == "set PrologEpilogTimeout=930 or more, or remove it"


def test_a_resume_timeout_within_the_outage_bound_is_a_warning(site, capsys) -> None:
    # issue 34, item 13: with OpenNebula gone mid-resume, resume hands its nodes back up to retry_seconds +
    # timeout after boot_timeout (600 s here; make_setup: retry_seconds 10, timeout 5)
    edit(site.root / "slurm.conf", "ResumeTimeout=900", "ResumeTimeout=610")
    code, found = findings(site, capsys)
    assert code == EXIT_OK
    [warning] = [f for f in found if f["subject"] == "slurm.conf ResumeTimeout"]
    assert warning["level"] == "warning" and "up to 15 s (retry_seconds + timeout)" in warning["text"]
    assert warning["fix"] == "set ResumeTimeout=900"


def test_every_problem_of_a_broken_setup_is_reported_in_one_run(sim, tmp_path, capsys) -> None:
    site = good_site(sim, tmp_path / "site")
    conf = site.root / "slurm.conf"
    for old, new in (("CPUs=8", "CPUs=32"), ("ResumeTimeout=900", "ResumeTimeout=60"),
                     ("SuspendTimeout=45", "SuspendTimeout=5"), ("PrivateData=cloud", "#"),
                     ("SlurmUser=root", "SlurmUser=root\nNodeName=x1 State=CLOUD")):
        edit(conf, old, new)
    edit(site.config, "gpus = 0\n", 'suspend_action = "poweroff"\n')
    code, found = problems(site, capsys)
    assert code == EXIT_NODES_FAILED
    for expected in ("CPUs=32 but template 0", "ResumeTimeout: 60 s", "SuspendTimeout: 5 s",
                     "PrivateData: lacks", "x1: State=CLOUD but in no [[nodeset]]",
                     "slurm-cpu-worker': has no PCI GPU",
                     'suspend_action = "poweroff"'):
        assert sum(expected in line for line in found) == 1, (expected, found)
    assert len(found) == 7


def test_quiet_prints_only_what_is_wrong(site, capsys) -> None:
    edit(site.root / "slurm.conf", "CPUs=8", "CPUs=4")
    assert check.main(["-q"], site.env) == EXIT_OK
    out = capsys.readouterr().out
    assert out.splitlines() == ["warning  slurm.conf NodeName=gpu[01-04]: CPUs=4 uses only 4 of the VM's 8 "
                                "vCPUs -> fix: set CPUs=8"]


def test_missing_configuration_is_one_problem(tmp_path, capsys) -> None:
    code = check.main(["--config", str(tmp_path / "none.toml"), "--json"], {})  # whole (a line is cut at 200)
    out = [f"{f['level']}  {f['subject']}: {f['text']} -> fix: {f['fix']}" for f in json.loads(capsys.readouterr().out)]
    assert code == EXIT_NODES_FAILED
    assert out == [f"problem  configuration: {tmp_path / 'none.toml'}: no such configuration "
                   f"file; create it: slurm-nebula-power example-config > {tmp_path / 'none.toml'} "
                   "-> fix: slurm-nebula-power example-config prints an example to start from"]


# ---- issue 15: what check says about the path to oned and who can write what ------------------------


def warnings(site: Setup, capsys) -> list[str]:
    _, found = findings(site, capsys)
    return [f"{f['subject']}: {f['text']}" for f in found if f["level"] == "warning"]


def test_plain_http_to_another_host_and_unverified_https_are_warned_about(site, capsys) -> None:
    assert not [w for w in warnings(site, capsys) if "plain http" in w], "loopback is fine"
    text = site.config.read_text()
    endpoint = text.split('endpoint = "', 1)[1].split('"', 1)[0]
    site.config.write_text(text.replace(endpoint, "http://frontend.example:2633/RPC2"))
    [http] = [w for w in warnings(site, capsys) if "plain http" in w]
    assert http.startswith("OpenNebula http://frontend.example:2633/RPC2: plain http to frontend.example")
    site.config.write_text(text.replace(endpoint, "https://frontend.example/RPC2").replace(
        "[slurm]", "https_verify = false\n\n[slurm]"))
    [tls] = [w for w in warnings(site, capsys) if "https_verify" in w]
    assert "any host that answers for frontend.example gets the session" in tls


def test_a_configuration_or_lock_directory_other_users_can_write_is_a_problem(site, capsys) -> None:
    site.config.chmod(0o666)
    (site.root / "locks").mkdir(exist_ok=True)
    (site.root / "locks").chmod(0o777)
    code, found = problems(site, capsys)
    assert code == EXIT_NODES_FAILED
    assert any(p.startswith(f"configuration {site.config}: other users can change it") for p in found), found
    assert any(p.startswith(f"lock_dir {site.root / 'locks'}: writable by other users") for p in found), found


class _HostsRefused(OneCloud):
    """A user who may list VMs but not hosts."""

    def hosts(self):
        from slurm_nebula_power.errors import CloudAuthError

        raise CloudAuthError("[one.hostpool.info] User [2] not authorized to perform action on host.")


def test_an_unreadable_host_pool_is_a_warning(site) -> None:
    from slurm_nebula_power.checks import run_checks
    from slurm_nebula_power.findings import WARNING

    report = run_checks(None, site.env, lambda config: _HostsRefused(config.opennebula, retry_seconds=0))
    [found] = [f for f in report.findings if f.subject == "OpenNebula host pool"]
    assert found.level == WARNING and "relies on pending_timeout alone" in found.text
    assert 'oneacl create "#<uid> HOST/* USE"' in found.fix
    assert not report.problems


# ---- settings that depend on the Slurm release --------------------------------------------------------

def release_site(sim, root: Path, version: tuple[int, int]) -> Setup:
    """A good deployment for that release: slurm.conf from slurm-conf's generator, scontrol saying so."""
    site = good_site(sim, root)
    config = load_config(site.config, site.env)
    shapes = [(ns, shape) for ns, shape, _ in read_shapes(config, OneCloud(config.opennebula))]
    conf = ["ClusterName=testcluster", "SlurmUser=root", *generate(config, shapes, version)]
    (root / "slurm.conf").write_text("\n".join(conf) + "\n")
    site.set_version(f"slurm {version[0]}.{version[1]:02d}.5")
    return site


@pytest.mark.parametrize("version", [(22, 5), (23, 11), (24, 11), (25, 5), (26, 5)])
def test_what_slurm_conf_prints_for_each_release_passes_check(sim, tmp_path, capsys, version) -> None:
    site = release_site(sim, tmp_path / "site", version)
    code, found = findings(site, capsys)
    assert code == EXIT_OK and [f for f in found if f["level"] != "ok"] == []


@pytest.mark.parametrize(("version", "level", "expected"), [
    ((22, 5), "warning", "cloud_reg_addrs replaces the NodeAddr resume sets from OpenNebula's lease"),
    ((24, 11), "problem", "cloud_reg_addrs is defunct in Slurm 24.11"),
])
def test_cloud_reg_addrs_is_named_for_what_it_does_on_each_release(sim, tmp_path, capsys, version, level,
                                                                   expected) -> None:
    site = release_site(sim, tmp_path / "site", version)
    edit(site.root / "slurm.conf", "SlurmctldParameters=idle_on_node_suspend",
         "SlurmctldParameters=idle_on_node_suspend,cloud_reg_addrs")
    code, found = findings(site, capsys)
    [hit] = [f for f in found if f["subject"] == "slurm.conf SlurmctldParameters"]
    assert hit["level"] == level and expected in hit["text"] and hit["fix"] == "remove cloud_reg_addrs"
    assert code == (EXIT_NODES_FAILED if level == "problem" else EXIT_OK)


def test_25_05_and_later_without_requeue_on_resume_failure_is_a_warning(sim, tmp_path, capsys) -> None:
    site = release_site(sim, tmp_path / "site", (26, 5))
    edit(site.root / "slurm.conf", "SchedulerParameters=requeue_on_resume_failure",
         "SchedulerParameters=sched_interval=30")
    code, found = findings(site, capsys)
    [hit] = [f for f in found if f["subject"] == "slurm.conf SchedulerParameters"]
    assert code == EXIT_OK and hit["level"] == "warning"
    assert hit["fix"] == "add requeue_on_resume_failure to SchedulerParameters"


@pytest.mark.parametrize(("version", "level"), [((26, 5), "ok"), ((25, 11), "warning"), ((24, 11), "problem")])
def test_power_actions_naming_our_programs_are_26_05s(sim, tmp_path, capsys, version, level) -> None:
    site = release_site(sim, tmp_path / "site", version)
    rewrite_lines(site.root / "slurm.conf", as_power_actions)
    code, found = findings(site, capsys)
    # Each PowerAction is followed to its Program: our program's path, found and executable.
    programs = {f["subject"]: f for f in found if f["subject"] in {f"slurm.conf {key}" for key in PROGRAMS}}
    assert {s: (f["level"], f["text"]) for s, f in programs.items()} == {
        f"slurm.conf {key}": ("ok", str(program_path(name)[0])) for key, name in PROGRAMS.items()}
    said = [f for f in found if f["subject"] == "slurm.conf PowerAction"]
    assert [f["level"] for f in said] == ([] if level == "ok" else [level]), said
    if level == "problem":
        assert "refuses to start" in said[0]["text"] and "programs' paths" in said[0]["fix"]
    assert code == (EXIT_NODES_FAILED if level == "problem" else EXIT_OK)


@pytest.mark.parametrize(("location", "arguments", "fix"), [
    ("slurmd", "", "Location=slurmctld on the PowerAction=nebula_resumeprogram line"),
    ("slurmctld", " --verbose", 'Program="'),
])
def test_a_power_action_on_the_nodes_or_with_arguments_is_a_problem(sim, tmp_path, capsys, location, arguments,
                                                                   fix) -> None:
    site = release_site(sim, tmp_path / "site", (26, 5))
    rewrite_lines(site.root / "slurm.conf", lambda lines: as_power_actions(lines, location, arguments))
    code, found = findings(site, capsys)
    [hit] = [f for f in found if f["subject"] == "slurm.conf ResumeProgram"]
    assert code == EXIT_NODES_FAILED and hit["level"] == "problem" and hit["fix"].startswith(fix), hit
    assert "names PowerAction nebula_resumeprogram" in hit["text"]


@pytest.mark.parametrize(("version", "states", "level", "text"), [
    ((22, 5), "DOWN", "problem", "Slurm 22.05 refuses to start with it"),
    ((24, 11), "CLOUD,DOWN", "problem", "has CLOUD: no cloud node is ever powered down"),
    ((24, 11), "down,DRAIN,RESERVED", "warning", "has DOWN,DRAIN: an idle cloud node in that state keeps its VM"),
    ((26, 5), "RESERVED,MAINTENANCE", None, ""),
])
def test_suspend_exc_states_is_judged_by_what_it_keeps_powered_up(sim, tmp_path, capsys, version, states, level,
                                                                   text) -> None:
    site = release_site(sim, tmp_path / "site", version)
    rewrite_lines(site.root / "slurm.conf", lambda lines: [*lines, f"SuspendExcStates={states}"])
    code, found = findings(site, capsys)
    said = [f for f in found if f["subject"] == "slurm.conf SuspendExcStates"]
    assert [(f["level"], text in f["text"]) for f in said] == ([(level, True)] if level else []), said
    assert code == (EXIT_NODES_FAILED if level == "problem" else EXIT_OK)


def with_slurmctld_parameter(option: str) -> Callable[[list[str]], list[str]]:
    """slurm.conf lines with an option added to the (last) SlurmctldParameters line."""
    return lambda lines: [f"{line},{option}" if line.startswith("SlurmctldParameters=") else line for line in lines]


def on_cloud_node_lines(keys: str) -> Callable[[list[str]], list[str]]:
    """slurm.conf lines with keys added to every State=CLOUD NodeName line."""
    return lambda lines: [f"{line} {keys}" if line.startswith("NodeName=") and "State=CLOUD" in line else line
                          for line in lines]


@pytest.mark.parametrize(("version", "change", "level", "text"), [
    ((22, 5), with_slurmctld_parameter("max_powered_nodes=2"), "warning",
     "ignored by Slurm 22.05 (max_powered_nodes is from Slurm 24.05)"),
    ((24, 11), lambda lines: [*with_slurmctld_parameter("max_powered_nodes=2")(lines), "NodeName=login[1-2] CPUs=4"],
     "problem", "no cloud node can ever be powered up (2 static nodes count as powered up)"),
    ((24, 11), with_slurmctld_parameter("max_powered_nodes=3"), "warning",
     "at most 3 cloud nodes up at once, fewer than node set gpu[01-04]'s 4: a job needing more than 3"),
    ((26, 5), lambda lines: [*with_slurmctld_parameter("max_powered_nodes=7")(lines), "NodeName=login1 CPUs=4"],
     "ok", "at most 6 cloud nodes up at once (1 static node counts as powered up)"),
    ((26, 5), with_slurmctld_parameter("max_powered_nodes=x"), "problem", "no cloud node can ever be powered up"),
], ids=["22.05-ignored", "static-fill-it", "below-a-node-set", "room", "not-a-number-is-0"])
def test_max_powered_nodes_is_judged_by_the_cloud_nodes_it_leaves_room_for(sim, tmp_path, capsys, version, change,
                                                                           level, text) -> None:
    site = release_site(sim, tmp_path / "site", version)
    rewrite_lines(site.root / "slurm.conf", change)
    code, found = findings(site, capsys)
    said = [f for f in found if f["subject"].startswith("slurm.conf SlurmctldParameters max_powered_nodes=")]
    assert [(f["level"], text in f["text"]) for f in said] == [(level, True)], said
    assert code == (EXIT_NODES_FAILED if level == "problem" else EXIT_OK)
    if level == "warning" and version >= (24, 5):
        assert said[0]["fix"] == "raise max_powered_nodes to 4, or accept that limit on jobs"


@pytest.mark.parametrize(("version", "keys", "level", "text"), [
    ((22, 5), "SuspendTime=INFINITE", "problem", "Slurm 22.05 refuses to start with it on cpu[01-02],gpu[01-04]"),
    ((24, 11), "SuspendTime=300", "problem", "Slurm 24.11 refuses to start with it"),
    ((26, 5), "SuspendTime=INFINITE", "warning", "cpu[01-02],gpu[01-04] never powered down (SuspendTime=INFINITE)"),
    ((26, 5), "SuspendTime=-1", "warning", "never powered down (SuspendTime=-1)"),
    ((26, 5), "SuspendTime=300", None, ""),
], ids=["22.05-refused", "24.11-refused", "26.05-infinite", "26.05-minus-1", "26.05-seconds"])
def test_a_node_line_suspend_time_is_26_05_s_and_infinite_keeps_the_vms_up(sim, tmp_path, capsys, version, keys,
                                                                           level, text) -> None:
    site = release_site(sim, tmp_path / "site", version)
    rewrite_lines(site.root / "slurm.conf", on_cloud_node_lines(keys))
    code, found = findings(site, capsys)
    said = [f for f in found if f["subject"] == "slurm.conf NodeName SuspendTime"]
    assert [(f["level"], text in f["text"]) for f in said] == ([(level, True)] if level else []), said
    assert code == (EXIT_NODES_FAILED if level == "problem" else EXIT_OK)


STATIC = "NodeName=static1 NodeAddr=127.0.0.1 Port=9 CPUs=1 RealMemory=100"  # no slurmd: never powered down


@pytest.mark.slurm
def test_check_calls_max_powered_nodes_a_problem_exactly_when_static_nodes_leave_no_cloud_node_room(
        sim, tmp_path, capsys, slurm_factory) -> None:
    """What the max_powered_nodes check assumes (power_up_node_bitmap, node_mgr.c): a static node counts as powered
    up, so max_powered_nodes=1 beside one static node refuses every power-up; =2 lets one cloud node up."""
    cluster = slurm_factory(nodes=["cloud1"], slurmctld_parameters=["max_powered_nodes=1"], extra_conf=STATIC)
    site = release_site(sim, tmp_path / "site", cluster.version)
    generated = (site.root / "slurm.conf").read_text().splitlines()
    for limit in (1, 2):
        if limit == 2:
            rewrite_lines(cluster.conf, lambda lines: [line.replace("max_powered_nodes=1", "max_powered_nodes=2")
                                                       for line in lines])
            cluster.restart_slurmctld(clear_state=True)
        done = cluster.run("scontrol", "update", "NodeName=cloud1", "State=POWER_UP", check=False)
        refused = (done.stdout + done.stderr).strip() if done.returncode else ""
        if limit == 1:  # and a job on the cloud node: held, as check says, where the power-up was refused
            job = cluster.sbatch("--wrap=true")
            info = cluster.wait_until(lambda j=job: cluster.job_info(j), lambda i: i.get("JobState") != "PENDING"
                                      or i.get("Reason") not in ("None", "Priority", "Resources", ""), 20, "held")
            cluster.run("scancel", str(job), check=False)
            finding("max_powered_nodes=1, 1 static node: a 1-node job on a cloud node",
                    f"{info.get('JobState')} Reason={info.get('Reason')}")
            assert (info.get("JobState"), info.get("Reason")) == ("PENDING", "MaxPoweredUpNodes") if refused else \
                info.get("JobState") != "PENDING", info
        lines = [*with_slurmctld_parameter(f"max_powered_nodes={limit}")(generated), STATIC]
        (site.root / "slurm.conf").write_text("\n".join(lines) + "\n")
        code, found = findings(site, capsys)
        said = [f"{f['level']}: {f['text']}" for f in found
                if f["subject"].startswith("slurm.conf SlurmctldParameters max_powered_nodes=")]
        finding(f"max_powered_nodes={limit}, 1 static node: scontrol power up of a cloud node; check",
                f"{'refused: ' + refused if refused else 'accepted'}; {said}")
        assert [s.startswith("problem") for s in said] == [bool(refused)], said
        assert code == (EXIT_NODES_FAILED if refused else EXIT_OK)
        if limit == 2:
            assert not refused, "one static node and one cloud node: 2 powered up, the limit"


# What check calls refused, checked against the real slurmctld of the release under test.
RELEASE_SETTINGS = {"PowerAction": as_power_actions,
                    "SuspendExcStates=DOWN": lambda lines: [*lines, "SuspendExcStates=DOWN"],
                    "NodeName SuspendTime=INFINITE": on_cloud_node_lines("SuspendTime=INFINITE"),
                    "max_powered_nodes=100": with_slurmctld_parameter("max_powered_nodes=100")}


@pytest.mark.slurm
@pytest.mark.parametrize("setting", sorted(RELEASE_SETTINGS))
def test_check_calls_a_setting_refused_exactly_when_the_real_slurmctld_refuses_it(sim, tmp_path, capsys,
                                                                                  slurm_factory, setting) -> None:
    cluster = slurm_factory(nodes=["spare1"])
    rewrite_lines(cluster.conf, RELEASE_SETTINGS[setting])
    try:
        cluster.restart_slurmctld(clear_state=True)
        refused = ""
    except SlurmCommandError as exc:
        key = setting.split("=")[0].split()[-1]  # PowerAction, SuspendTime...
        refused = next((line for line in exc.stderr.splitlines() if key in line), exc.stderr)
    site = release_site(sim, tmp_path / "site", cluster.version)
    rewrite_lines(site.root / "slurm.conf", RELEASE_SETTINGS[setting])
    code, found = findings(site, capsys)
    said = [f"{f['subject']}: {f['text']}" for f in found if f["level"] == "problem"]
    finding(f"slurm.conf with {setting}: slurmctld; check", f"{'refused: ' + refused if refused else 'started'}; "
            f"{said or 'no problem'}")
    assert [p for p in said if "refuses to start" in p] == (said if refused else []) and bool(said) == bool(refused)
    assert code == (EXIT_NODES_FAILED if refused else EXIT_OK)


@pytest.mark.parametrize(("setting", "level", "text"), [
    ("SuspendExcNodes=gpu[01-02],cpu01", "warning", "cpu01,gpu[01-02] never powered down"),
    ("SuspendExcNodes=gpu[01-04]:2,login[1-2]", "ok", "keeps 2 of gpu[01-04] powered up when idle"),
    ("SuspendExcNodes=login1,spare[1-3]:1", None, ""),
    ("SuspendExcParts=gpu", "warning", "partition gpu's gpu[01-04] never powered down"),
    ("SuspendExcParts=debug", None, ""),
])
def test_suspend_exclusions_that_keep_idle_vms_up_are_named(site, capsys, setting, level, text) -> None:
    rewrite_lines(site.root / "slurm.conf", lambda lines: [*lines, setting])
    code, found = findings(site, capsys)
    said = [f for f in found if f["subject"] == f"slurm.conf {setting.partition('=')[0]}"]
    assert [(f["level"], text in f["text"]) for f in said] == ([(level, True)] if level else []), said
    assert code == EXIT_OK


@pytest.mark.slurm
@pytest.mark.parametrize(("excluded", "up"), [("cloud[1-2]", ["cloud1", "cloud2"]), ("cloud[1-3]:1", None)],
                         ids=["listed", "count"])
def test_real_slurmctld_keeps_suspend_excluded_nodes_up(slurm_factory, tmp_path, excluded, up) -> None:
    """What the SuspendExcNodes warning says: a node listed there is never powered down when idle (its VM would
    keep its GPUs); with a count, that many of the list stay up."""
    resume = recording_program(tmp_path / "resume", tmp_path / "resume.jsonl", action=(
        'boot(HOSTS, ["127.0.1.%d" % int(h[-1]) for h in HOSTS])'))
    nodes = ["cloud1", "cloud2", "cloud3"]
    cluster = slurm_factory(nodes=nodes, resume_program=resume, suspend_time=4, suspend_timeout=6,
                            extra_conf=f"SuspendExcNodes={excluded}")
    cluster.scontrol("update", "NodeName=cloud[1-3]", "State=POWER_UP")
    for node in nodes:
        cluster.wait_until(lambda n=node: cluster.node_state(n), lambda s: s == "IDLE+CLOUD", 30, f"{node} up")
    # Well past SuspendTime: the others are powering down or down, the excluded ones still up.
    down = len(nodes) - (len(up) if up else 1)
    cluster.wait_for(lambda: sum("POWER" in cluster.node_state(n) for n in nodes) == down, 30,
                     f"{down} powered down")
    time.sleep(4)
    states = {n: cluster.node_state(n) for n in nodes}
    still_up = sorted(n for n, state in states.items() if state == "IDLE+CLOUD")
    finding(f"SuspendExcNodes={excluded}, 3 idle nodes, SuspendTime 4", f"up after 8+ s idle: {still_up}; {states}")
    if up is None:  # a count: that many of the list, whichever slurmctld keeps
        assert len(still_up) == 1, states
    else:
        assert still_up == up, states


def test_max_pending_names_the_oned_settings_that_shape_bursts(site) -> None:
    from slurm_nebula_power.checks import run_checks
    from slurm_nebula_power.findings import OK

    report = run_checks(None, site.env, lambda config: OneCloud(config.opennebula))
    [found] = [f for f in report.findings if f.subject == "[opennebula] max_pending"]
    assert found.level == OK
    assert found.text.startswith("at most 30 VMs at once for oned to place")
    for setting in ("MAX_HOST", "MAX_ACTIONS_PER_CLUSTER", "SCHED_MAX_WND_TIME", "SCHED_MAX_WND_LENGTH"):
        assert setting in found.text


def test_max_pending_above_the_stock_dispatch_limit_is_a_warning(site) -> None:
    from slurm_nebula_power.checks import run_checks
    from slurm_nebula_power.findings import WARNING

    edit(site.config, "max_parallel = 8\n", "max_parallel = 8\nmax_pending = 100\n")
    report = run_checks(None, site.env, lambda config: OneCloud(config.opennebula))
    [found] = [f for f in report.findings if f.subject == "[opennebula] max_pending"]
    assert found.level == WARNING and "above its stock MAX_ACTIONS_PER_CLUSTER 30" in found.text
    assert found.fix.startswith("set max_pending = 30 or below")
    assert not report.problems


def test_a_burst_of_every_node_slower_to_send_than_boot_timeout_is_a_warning_whose_fix_clears_it(
        sim, tmp_path, capsys) -> None:
    # 202 nodes, 4 hosts take VMs: 51 waves of 4, the last sent 50 plans after the first.
    site = good_site(sim, tmp_path / "site", NODESETS.replace("gpu[01-04]", "gpu[001-200]"))
    code, found = findings(site, capsys)
    warned = {f["subject"]: f for f in found if f["subject"].endswith(" boot_timeout")}
    assert sorted(warned) == ["node set cpu[01-02] boot_timeout", "node set gpu[001-200] boot_timeout"]
    hit = warned["node set gpu[001-200] boot_timeout"]
    assert hit["level"] == "warning" and code == EXIT_OK
    assert "all 202 nodes oned's scheduler places at once goes out in 51 waves of at most 4 VMs" in hit["text"]
    assert "above its boot_timeout 600 s" in hit["text"]
    [boot] = re.findall(r"set boot_timeout = (\d+) ", hit["fix"])
    assert int(boot) > 600 and f"ResumeTimeout={int(boot) + 300}" in hit["fix"]
    # Following the fix clears it, and check is content with the ResumeTimeout it named.
    edit(site.config, "boot_timeout = 600\n", f"boot_timeout = {boot}\n")
    edit(site.config, "gpus = 0\n", f"gpus = 0\nboot_timeout = {boot}\n")
    edit(site.root / "slurm.conf", "ResumeTimeout=900", f"ResumeTimeout={int(boot) + 300}")
    code, found = findings(site, capsys)
    assert not [f for f in found if f["subject"].endswith(" boot_timeout")]
    [ok] = [f for f in found if f["subject"] == "[opennebula] bursts"]
    assert ok["level"] == "ok" and ok["text"].endswith("within every node set's boot_timeout")
    assert code == EXIT_OK and not [f for f in found if f["level"] == "problem"]


def test_max_parallel_at_oned_stock_max_conn_is_a_warning(site) -> None:
    from slurm_nebula_power.checks import run_checks
    from slurm_nebula_power.findings import WARNING

    subject = "[opennebula] max_parallel"
    report = run_checks(None, site.env, lambda config: OneCloud(config.opennebula))
    assert not [f for f in report.findings if f.subject == subject], "8 is below MAX_CONN 15"
    edit(site.config, "max_parallel = 8\n", "max_parallel = 32\n")
    report = run_checks(None, site.env, lambda config: OneCloud(config.opennebula))
    [found] = [f for f in report.findings if f.subject == subject]
    assert found.level == WARNING and "oned's stock MAX_CONN is 15" in found.text
    assert found.fix.startswith("set max_parallel = 12 or lower")


@pytest.mark.parametrize(("mode", "who"), [(0o775, "its group"), (0o757, "other users"), (0o1777, None),
                                           (0o755, None)])
def test_a_lock_audit_or_metrics_directory_others_can_write_is_a_problem_unless_sticky(site, capsys, mode,
                                                                                     who) -> None:
    # issue 22, item 2: whoever can write these directories can plant links or FIFOs where the programs
    # open the locks, the usage records and the metrics file (root's runs included)
    (site.root / "locks").mkdir(exist_ok=True)
    for directory in (site.root, site.root / "locks"):
        directory.chmod(mode)
    _, found = problems(site, capsys)
    flagged = {p.split(" ", 1)[0] for p in found if "without the sticky bit" in p}
    if who is None:
        assert flagged == set(), found
        # issue 34, item 5: sticky or not, others who write the audit directory plant rotated copies
        planted = {p.split(" ", 1)[0] for p in found if "rotated copies" in p}
        assert planted == ({"audit_file's"} if mode & 0o022 else set()), found
        return
    assert flagged == {"lock_dir", "audit_file's", "metrics_file's"}, found
    [line] = [p for p in found if p.startswith(f"metrics_file's directory {site.root}:")]
    assert f"writable by {who}, without the sticky bit" in line and f"chmod go-w {site.root}" in line



@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_lock_audit_or_metrics_directory_another_user_owns_is_a_problem(site) -> None:
    # The variant of the writable directory: its owner can write it whatever its mode (0755 passed), and
    # files.py trusts the files of a file's directory's owner
    nobody = pwd.getpwnam("nobody")
    locks = site.root / "locks"
    locks.mkdir(exist_ok=True)
    os.chown(locks, nobody.pw_uid, nobody.pw_gid)
    locks.chmod(0o755)
    done = subprocess.run([str(Path(sys.executable).with_name("slurm-nebula-power")), "check", "--json"],
                          env=run_env(site), capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_NODES_FAILED, done.stderr
    said = [f for f in json.loads(done.stdout) if f["level"] == "problem" and "owned by" in f["text"]]
    assert [(f["subject"], f["fix"]) for f in said] == [(f"lock_dir {locks}", f"chown root {locks}")], said
    assert said[0]["text"].startswith("owned by nobody, neither root nor SlurmUser")

@pytest.mark.parametrize(("mode", "flagged"), [(0o755, True), (0o751, True), (0o754, True), (0o750, False),
                                               (0o700, False)])
def test_a_lock_dir_others_can_search_is_a_problem(site, capsys, mode: int, flagged: bool) -> None:
    # issue 34, item 1: whoever can look a lock file up can open one an older version left 0644 and flock it
    locks = site.root / "locks"
    locks.mkdir(exist_ok=True)
    locks.chmod(mode)
    _, found = problems(site, capsys)
    said = [p for p in found if p.startswith(f"lock_dir {locks}: other users can look up its files")]
    assert bool(said) is flagged, found
    if flagged:
        assert said[0].endswith(f"chmod o-rwx {locks}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to other users")
@pytest.mark.parametrize("change", ["group-writable", "group-writable directory", "owned by slurm",
                                    "group root", "root alone"])
def test_a_configuration_its_group_or_a_user_other_than_root_can_change_is_a_problem(site, capsys,
                                                                                     change: str) -> None:
    # issue 34, item 6: only others' write bit was looked at, and not the owner: a SlurmUser-owned or
    # group-writable configuration decides what a root run runs ([slurm] scontrol, prolog_chain)
    slurm = pwd.getpwnam("slurm") if change == "owned by slurm" else None
    staff = grp.getgrnam("staff").gr_gid
    site.config.chmod(0o640)
    if change == "group-writable":
        os.chown(site.config, 0, staff)
        site.config.chmod(0o660)
    elif change == "group-writable directory":
        os.chown(site.root, 0, staff)
        site.root.chmod(0o775)
    elif change == "owned by slurm":
        assert slurm is not None
        os.chown(site.config, slurm.pw_uid, slurm.pw_gid)
    elif change == "group root":
        site.config.chmod(0o660)  # root's group: root's own
    _, found = problems(site, capsys)
    said = [p for p in found if p.startswith(f"configuration {site.config}: ")]
    if change in ("group root", "root alone"):
        assert said == [], said
        return
    who = {"group-writable": "the group staff can change it",
           "group-writable directory": f"the group staff (through its directory {site.root}) can change it",
           "owned by slurm": "its owner slurm can change it"}[change]
    assert said and said[0].startswith(f"configuration {site.config}: {who}, not root alone"), said
    assert said[0].endswith(f"chown root {site.config} && chmod go-w {site.config} {site.root}")


# ---- issue 25: what check passed and later failed -------------------------------------------------------

WORKERS = """\
[[nodeset]]
nodes = "gpu[01-04]"
template = "slurm-h100"
gpus = 1
vcpu = 8
memory_mb = 16384
network = "0"
controller = "ctl.example:6817"
munge_key_file = "{key}"
"""


def worker_site(tmp_path: Path, context_edit=None, key: bytes = bytes(range(64))):
    """A site whose node set's template is what `template` prints (edited by context_edit), in a simulator."""
    from slurm_nebula_power.cli import template as template_cmd

    key_file = tmp_path / "munge.key"
    key_file.write_bytes(key)
    setup = make_setup(tmp_path / "site", "http://127.0.0.1:9/RPC2", AUTH, nodesets=WORKERS.format(key=key_file))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert template_cmd.main([], setup.env) == EXIT_OK
    body = printed.getvalue() if context_edit is None else context_edit(printed.getvalue())
    return setup, SimConfig(hosts=default_hosts(2, 4), durations=Durations(0, 0, 0, 0),
                            templates=(TemplateSpec(id=0, name="slurm-h100", body=body),))


def context_findings(tmp_path, capsys, context_edit=None, key_now: bytes | None = None):
    setup, sim_config = worker_site(tmp_path, context_edit)
    if key_now is not None:
        Path(tomllib.loads(setup.config.read_text())["nodeset"][0]["munge_key_file"]).write_bytes(key_now)
    with running_simulator(sim_config, auth=AUTH) as sim:
        setup.config.write_text(setup.config.read_text().replace("http://127.0.0.1:9/RPC2", sim.endpoint))
        _, found = findings(setup, capsys)
    return [f for f in found if f["subject"].endswith("template 'slurm-h100' CONTEXT")]


def test_a_template_as_template_prints_it_passes_its_context_check(tmp_path, capsys) -> None:
    [said] = context_findings(tmp_path, capsys)
    assert said["level"] == "ok" and "controller, munge key and bootstrap" in said["text"]


@pytest.mark.parametrize(("edit", "level", "text"), [
    (lambda t: re.sub(r'\n  SLURM_CONTROLLER = "[^"]*",', "", t), "problem", "lacks SLURM_CONTROLLER"),
    (lambda t: re.sub(r'\n  MUNGE_KEY_BASE64 = "[^"]*",', "", t), "problem", "lacks MUNGE_KEY_BASE64"),
    (lambda t: t.replace('SLURM_CONTROLLER = "ctl.example:6817"', 'SLURM_CONTROLLER = "old-ctl"'), "problem",
     "SLURM_CONTROLLER is old-ctl, the node set's controller ctl.example:6817"),
    (lambda t: re.sub(r'START_SCRIPT_BASE64 = "[^"]*"', 'START_SCRIPT_BASE64 = "'
                      + base64.b64encode(b"#!/bin/sh\n# an older bootstrap\n").decode() + '"', t),
     "warning", "another bootstrap than this version's"),
], ids=["no-controller", "no-munge-key", "other-controller", "old-bootstrap"])
def test_a_template_context_that_would_fail_the_worker_is_found(tmp_path, capsys, edit, level, text) -> None:
    # issue 25: check never read the template's CONTEXT
    [said] = context_findings(tmp_path, capsys, edit)
    assert said["level"] == level and text in said["text"], said
    assert "slurm-nebula-power template" in said["fix"]


def test_a_template_with_another_munge_key_is_a_problem_and_no_key_is_shown(tmp_path, capsys) -> None:
    new_key = bytes(range(64, 128))
    [said] = context_findings(tmp_path, capsys, key_now=new_key)
    assert said["level"] == "problem" and "is not the key in the node set's munge_key_file" in said["text"]
    assert base64.b64encode(new_key).decode() not in json.dumps(said)


@pytest.mark.parametrize("last", ["SlurmctldParameters=idle_on_node_suspend",
                                  "SlurmctldParameters=idle_on_node_suspend,enable_configless"])
def test_configless_is_judged_by_the_last_slurmctld_parameters_line(tmp_path, capsys, last) -> None:
    # issue 25: enable_configless lost to a later SlurmctldParameters= line passed check
    setup, sim_config = worker_site(tmp_path)
    rewrite_lines(setup.root / "slurm.conf", lambda lines: [*lines, "SlurmctldParameters=enable_configless", last])
    with running_simulator(sim_config, auth=AUTH) as sim:
        setup.config.write_text(setup.config.read_text().replace("http://127.0.0.1:9/RPC2", sim.endpoint))
        _, found = findings(setup, capsys)
    [said] = [f for f in found if f["subject"] == "slurm.conf SlurmctldParameters"]
    if "enable_configless" in last:
        assert said["level"] == "ok", said
    else:
        assert said["level"] == "problem" and "only the last SlurmctldParameters line counts" in said["text"]
        assert said["fix"] == "add enable_configless to the last SlurmctldParameters line"


@pytest.mark.slurm
def test_the_real_slurmctld_keeps_only_the_last_slurmctld_parameters_line(slurm_factory) -> None:
    """What the configless check relies on: a later SlurmctldParameters line replaces an earlier one."""
    cluster = slurm_factory(nodes=["spare1"])
    rewrite_lines(cluster.conf, lambda lines: [*lines, "SlurmctldParameters=enable_configless",
                                               "SlurmctldParameters=idle_on_node_suspend"])
    cluster.restart_slurmctld(clear_state=True)
    [line] = [x for x in cluster.scontrol("show", "config").splitlines() if x.startswith("SlurmctldParameters")]
    finding("SlurmctldParameters=enable_configless, then SlurmctldParameters=idle_on_node_suspend: in force",
            line.split("=", 1)[1].strip())
    assert "enable_configless" not in line and "idle_on_node_suspend" in line, line


def test_a_cluster_name_other_than_slurm_conf_s_is_a_problem(site, capsys) -> None:
    # issue 25: [slurm] cluster = "prod" while slurm.conf says ClusterName=adm passed check
    edit(site.config, "[slurm]\n", '[slurm]\ncluster = "prod"\n')
    code, found = problems(site, capsys)
    [said] = [p for p in found if p.startswith("[slurm] cluster")]
    assert code == EXIT_NODES_FAILED and "is 'prod' but slurm.conf says ClusterName=testcluster" in said


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make directories the slurm user cannot enter")
def test_a_program_whose_interpreter_slurmuser_cannot_reach_is_a_problem(site, capsys, tmp_path) -> None:
    # issue 25: check looked at the mode bits only; a venv whose python lived in root's home passed
    try:
        pwd.getpwnam("slurm")
    except KeyError:
        pytest.skip("needs the slurm user (Debian's slurmctld package makes it)")
    private = tmp_path / "root-home"
    private.mkdir(mode=0o700)
    python = private / "python3"
    python.symlink_to(sys.executable)
    public = Path(tempfile.mkdtemp(prefix="snp-prog-", dir="/tmp"))
    try:
        public.chmod(0o755)
        program = public / "slurm-nebula-resume"
        program.write_text(f"#!{python}\nprint('resume')\n")
        program.chmod(0o755)
        rewrite_lines(site.root / "slurm.conf", lambda lines: [
            *(x for x in lines if not x.startswith("SlurmUser=")), "SlurmUser=slurm", f"ResumeProgram={program}"])
        _, found = problems(site, capsys)
        [said] = [p for p in found if p.startswith("slurm.conf ResumeProgram")]
        assert f"SlurmUser slurm cannot run its interpreter {python}" in said
    finally:
        shutil.rmtree(public, ignore_errors=True)


def test_the_deploy_right_and_what_to_grant_for_direct_placement(tmp_path, capsys) -> None:
    plain = "slurm:Plain-pass-1"
    with running_simulator(fast_config(), auth=plain) as sim:
        site = make_setup(tmp_path / "site", sim.endpoint, plain, nodesets=NODESETS.replace(
            "boot_timeout = 600\n", 'boot_timeout = 600\nplacement = "direct"\n'))
        _, found = findings(site, capsys)
        [right] = [f for f in found if f["subject"] == "OpenNebula user slurm deploy right"]
        assert right["level"] == "warning"
        assert right["text"].startswith("may not deploy: deploy is an ADMIN operation for it (oned.conf), and node "
                                        'sets gpu[01-04] use placement = "direct"')
        assert 'put VM_MANAGE_OPERATIONS = "deploy" in user slurm\'s template' in right["fix"]
        assert "`oneuser update slurm FILE --append`" in right["fix"]
        sim.set_user_template(VM_MANAGE_OPERATIONS="deploy")  # what the fix says oneadmin does
        _, found = findings(site, capsys)
        [right] = [f for f in found if f["subject"] == "OpenNebula user slurm deploy right"]
        assert right["level"] == "ok" and right["text"] == (
            'may deploy its VMs: deploy is a MANAGE operation for it (its user template); node sets gpu[01-04] use '
            'placement = "direct"')


def test_the_recover_right_a_plain_user_lacks_and_what_to_grant(tmp_path, capsys) -> None:
    # recover --delete removes a VM stuck in a transient state; oned.conf ships it at ADMIN (real oned refuses
    # it to its owner: the contract suite's admin session runs it)
    plain = "slurm:Plain-pass-1"
    with running_simulator(fast_config(), auth=plain) as sim:
        site = make_setup(tmp_path / "site", sim.endpoint, plain, nodesets=NODESETS)
        _, found = findings(site, capsys)
        [right] = [f for f in found if f["subject"] == "OpenNebula user slurm recover right"]
        assert right["level"] == "warning" and "left for an administrator, its GPU held" in right["text"]
        assert 'put VM_MANAGE_OPERATIONS = "recover" in user slurm\'s template' in right["fix"]
        sim.set_user_template(VM_MANAGE_OPERATIONS="deploy")
        _, found = findings(site, capsys)
        [right] = [f for f in found if f["subject"] == "OpenNebula user slurm recover right"]
        assert 'VM_MANAGE_OPERATIONS = "deploy, recover"' in right["fix"], "the list it has, kept"
        sim.set_user_template(VM_MANAGE_OPERATIONS="recover, deploy")  # docs/installation.md's line
        _, found = findings(site, capsys)
        [right] = [f for f in found if f["subject"] == "OpenNebula user slurm recover right"]
        assert right["level"] == "ok"


def test_an_administrator_may_deploy_and_the_scheduler_needs_no_grant(site, capsys) -> None:
    _, found = findings(site, capsys)
    [right] = [f for f in found if f["subject"] == "OpenNebula user oneadmin deploy right"]
    assert (right["level"], right["text"]) == (
        "ok", 'may deploy: the user is in group oneadmin; no node set uses placement = "direct"')
def _runs_as(user: pwd.struct_passwd, program: Path) -> bool:
    """What the kernel says: whether user can start program (the ground truth check must agree with)."""
    try:
        done = subprocess.run([str(program)], user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/",
                              env={}, capture_output=True, timeout=60)
    except PermissionError:
        return False
    return done.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make directories the slurm user cannot enter")
@pytest.mark.parametrize("layout", ["interpreter-linked-from-a-private-dir", "program-linked-into-a-private-dir",
                                    "interpreter-linked-from-a-public-dir", "program-linked-from-a-public-dir"])
def test_check_says_slurmuser_cannot_run_a_program_exactly_when_the_kernel_refuses_it(site, tmp_path,
                                                                                       layout: str) -> None:
    # The interpreter check looked at the link's target only (realpath): a venv made with the system's
    # python3 in root's home (/root/venv/bin/python3 -> /usr/bin/python3) passed, and so did a program
    # linked from /usr/local/bin to a script in root's home; the kernel searches the link's own directory
    # too. Through the installed check, judged against what the kernel does when SlurmUser starts it.
    try:
        slurm = pwd.getpwnam("slurm")
    except KeyError:
        pytest.skip("needs the slurm user (Debian's slurmctld package makes it)")
    private = tmp_path / "root-home"  # pytest's tmp_path is root's: the slurm user cannot enter it
    private.mkdir(mode=0o700)
    public = Path(tempfile.mkdtemp(prefix="snp-prog-", dir="/tmp"))
    try:
        public.chmod(0o755)
        where = private if layout.startswith("interpreter-linked-from-a-private") else public
        python = where / "python3"
        python.symlink_to("/usr/bin/python3")  # the system's python3, which SlurmUser can run
        script = (private if layout == "program-linked-into-a-private-dir" else public) / "resume-script"
        script.write_text(f"#!{python}\nprint('resume')\n")
        script.chmod(0o755)
        program = script
        if layout.startswith("program-linked"):
            program = public / "slurm-nebula-resume"
            program.symlink_to(script)
        rewrite_lines(site.root / "slurm.conf", lambda lines: [
            *(x for x in lines if not x.startswith("SlurmUser=")), "SlurmUser=slurm", f"ResumeProgram={program}"])
        done = subprocess.run([str(Path(sys.executable).with_name("slurm-nebula-power")), "check", "--json"],
                              env=run_env(site), capture_output=True, text=True, timeout=120)
        said = [f for f in json.loads(done.stdout) if f["subject"] == "slurm.conf ResumeProgram"
                and f["level"] == "problem" and "cannot run" in f["text"]]
        runs = _runs_as(slurm, program)
        assert runs == layout.endswith("public-dir"), "the layout does what its name says"
        assert bool(said) == (not runs), (layout, said)
    finally:
        shutil.rmtree(public, ignore_errors=True)


def test_no_line_of_check_is_longer_than_200_characters_and_nothing_to_act_on_is_lost(sim, tmp_path) -> None:
    # issue 32: lines ran to ~600 characters (max_pending's, the burst warning's); a configuration that makes
    # the long ones: max_pending and max_parallel above oned's stock, a boot_timeout shorter than a burst
    site = good_site(sim, tmp_path / "site", NODESETS + "boot_timeout = 10\n")
    edit(site.config, "max_parallel = 8\n", "max_parallel = 16\nmax_pending = 64\n")
    program = [str(Path(sys.executable).with_name("slurm-nebula-power")), "check"]
    done = subprocess.run(program, env=run_env(site), capture_output=True, text=True, timeout=120)
    whole = json.loads(subprocess.run([*program, "--json"], env=run_env(site), capture_output=True, text=True,
                                      timeout=120).stdout)
    lines = done.stdout.splitlines()
    assert done.returncode == EXIT_OK and max(len(line) for line in lines + done.stderr.splitlines()) <= 200
    assert max(len(f"{f['subject']}: {f['text']} -> fix: {f['fix']}") for f in whole) > 400, "long ones made"
    assert [line.split()[0] for line in lines if not line.startswith(" ")] == [f["level"] for f in whole]
    blocks = re.split(r"\n(?! )", done.stdout.rstrip("\n"))  # a finding's line and its indented continuation lines
    warned = [(f, block) for f, block in zip(whole, blocks, strict=True) if f["level"] == "warning"]
    assert {f["subject"] for f, _ in warned} == {"[opennebula] max_pending", "[opennebula] max_parallel",
                                                "node set cpu[01-02] boot_timeout"}
    for said, block in warned:  # every word of the text and of the fix is printed, in order
        printed = iter(re.findall(r"\w+", block))
        assert all(word in printed for word in re.findall(r"\w+", said["text"] + " fix " + said["fix"])), block
