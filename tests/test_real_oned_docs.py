"""docs/installation.md's "The OpenNebula side", run as written against a real oned 7.4.0 (tests/oned), then
a node resumed as the user those steps make.

oned is started without the test kit's own Slurm user (ONED_SLURM_USER=0): the cloud as oneadmin leaves it
(hosts with GPUs, the network slurm-net, the image slurm-worker, all oneadmin's). The section's ```sh
blocks run with bash -e, oneadmin's CLI on PATH (ONE_AUTH, ONE_XMLRPC), `/etc/slurm/` taken to the test's
directory; nothing else in them is changed. Slurm is the recording fake scontrol (tests/support.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
import xmlrpc.client
from collections.abc import Iterator
from pathlib import Path

import onedfix
import pytest
from reliability_support import run_program
from support import Setup, make_setup

from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK

ROOT = Path(__file__).resolve().parent.parent
VERSION = "7.4.0"
SECTION = "## The OpenNebula side"


def blocks() -> list[str]:
    """The ```sh blocks of the section, in order."""
    text = (ROOT / "docs" / "installation.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    found = re.findall(r"^```sh\n(.*?)^```$", text[start:end], re.M | re.S)
    assert len(found) == 2, f"{SECTION}: expected the user's block and the template's, found {len(found)}"
    return found


@pytest.fixture(scope="module")
def bare_oned() -> Iterator[onedfix.RealOned]:
    """oned 7.4.0 as oneadmin leaves it, before the Slurm user exists."""
    if VERSION not in onedfix.VERSIONS:
        pytest.skip(f"oned {VERSION} not among ONED_VERSIONS")
    try:
        oned = onedfix.start(VERSION, hosts=2, gpus=1, ONED_SLURM_USER="0")
    except onedfix.OnedUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield oned
    finally:
        oned.stop()


def run_block(block: str, base: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = "set -euo pipefail\n" + block.replace("/etc/slurm/", f"{base}/etc/slurm/")
    return subprocess.run(["bash", "-c", script], cwd=base, env=env, capture_output=True, text=True,
                          timeout=180, check=False)


def nodeset(base: Path, setup_root: Path) -> str:
    key = setup_root / "munge.key"
    key.write_bytes(os.urandom(64))
    return (f'[[nodeset]]\nnodes = "gpu[01-16]"\ntemplate = "slurm-docs-worker"\nboot_timeout = 30\n'
            f'vcpu = 1\nmemory_mb = 128\ncpu = 0.1\ngpus = 1\nnetwork = "slurm-net"\nimage = "slurm-worker"\n'
            f'controller = "127.0.0.1:6817"\nmunge_key_file = "{key}"\n')


def vms(oned: onedfix.RealOned, session: str) -> list[ET.Element]:
    text = xmlrpc.client.ServerProxy(oned.endpoint).one.vmpool.infoextended(session, -2, -1, -1, -1)[1]
    return list(ET.fromstring(text).iterfind("VM"))


def test_the_documented_steps_make_a_user_whose_printed_template_resumes_a_node(bare_oned, tmp_path) -> None:
    oned = bare_oned
    base = tmp_path
    (base / "etc" / "slurm").mkdir(parents=True)
    env = {**oned.cli_env, "PATH": f"{Path(sys.executable).parent}:{oned.cli_env['PATH']}"}
    user_block, template_block = blocks()
    done = run_block(user_block, base, env)
    assert done.returncode == 0, done.stderr
    auth = (base / "etc" / "slurm" / "one_auth").read_text()
    assert auth.startswith("slurm:") and oct((base / "etc" / "slurm" / "one_auth").stat().st_mode & 0o777) == "0o600"
    assert not list(base.glob("slurm.password*")), "the password file is left behind"

    setup: Setup = make_setup(base / "etc" / "slurm", oned.endpoint, auth.strip(), nodesets=nodeset(base, base))
    env.update(setup.env)  # SLURM_CONF, and the configuration beside it
    done = run_block(template_block, base, env)
    assert done.returncode == 0, done.stderr
    assert not (base / "worker.tmpl").exists(), "the template file (it holds the munge key) is left behind"

    # check proves the template as the user: nothing about OpenNebula or the template is a problem
    done = subprocess.run([str(Path(sys.executable).parent / "slurm-nebula-power"), "check", "--json"],
                          env={**setup.env, "PATH": env["PATH"]}, capture_output=True, text=True, timeout=120,
                          check=False)
    findings = json.loads(done.stdout)
    cloud = [f for f in findings
             if f["level"] == "problem" and re.search(r"OpenNebula|template", f["subject"])]
    assert not cloud, cloud
    [pool] = [f for f in findings if f["subject"] == "OpenNebula host pool"]
    assert pool["level"] == "ok" and pool["text"].startswith("2 hosts"), pool  # the GPU count sees the hosts
    rights = {f["subject"]: f["level"] for f in findings if f["subject"].endswith(" right")}
    assert rights == {"OpenNebula user slurm deploy right": "ok", "OpenNebula user slurm recover right": "ok"}

    # a node resumed as that user: its VM is the user's, with the NIC and the image, and then suspended
    done = run_program(setup, "resume", "gpu01", guard=120)
    assert done.returncode == EXIT_OK, setup.log_text()[-3000:]
    [vm] = [v for v in vms(oned, auth.strip()) if v.findtext("NAME") == "gpu01"]
    assert vm.findtext("UNAME") == "slurm" and vm.findtext("STATE") == "3"
    assert vm.findtext("TEMPLATE/NIC/NETWORK") == "slurm-net" and vm.findtext("TEMPLATE/DISK/IMAGE") == "slurm-worker"
    assert run_program(setup, "suspend", "gpu01", guard=120).returncode == EXIT_OK
    assert not [v for v in vms(oned, auth.strip()) if v.findtext("NAME") == "gpu01"]

    # oneadmin's own template is not the user's: check names it, and how to fix it
    text = setup.config.read_text().replace('template = "slurm-docs-worker"', 'template = "slurm-gpu-worker"')
    setup.config.write_text(text)
    done = subprocess.run([str(Path(sys.executable).parent / "slurm-nebula-power"), "check", "--json"],
                          env={**setup.env, "PATH": env["PATH"]}, capture_output=True, text=True, timeout=120,
                          check=False)
    [problem] = [f for f in json.loads(done.stdout) if f["level"] == "problem" and "slurm-gpu-worker" in f["subject"]]
    assert "chown" in problem["fix"], problem
    assert run_program(setup, "resume", "gpu02", guard=120).returncode == EXIT_NODES_FAILED
    assert not [v for v in vms(oned, oned.admin) if v.findtext("NAME") == "gpu02"]
