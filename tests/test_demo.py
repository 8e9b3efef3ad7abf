"""slurm-nebula-power demo: start to finish in-process, and in a fresh venv installed as the README says."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from slurm_nebula_power.cli import demo
from slurm_nebula_power.cli.main import power_main

REPO = Path(__file__).resolve().parent.parent
FORWARD = ("PENDING", "ACTIVE/PROLOG", "ACTIVE/BOOT", "ACTIVE/RUNNING", "ACTIVE/SHUTDOWN", "ACTIVE/EPILOG",
           "DONE")


def test_demo_runs_start_to_finish_without_slurm(capsys) -> None:
    assert power_main(["demo", "--phase-seconds", "0.2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for node in ("gpu01", "gpu02", "gpu03", "gpu04"):
        seen = [m.group(1) for m in (re.match(rf"\s+\[\s*[\d.]+s\] {node}\s+VM \d+\s+(\S+)", line)
                                     for line in lines) if m]
        assert "ACTIVE/RUNNING" in seen and seen[-1] == "DONE", seen
        assert seen.index("ACTIVE/RUNNING") < seen.index("DONE")
        order = [state for state in seen if state in FORWARD]
        assert order == sorted(order, key=FORWARD.index), "states only move forward"
    # Each node's address goes to Slurm once, as its VM gets it (resume sends in waves: one update per wave).
    addrs = {}
    for names, ips in re.findall(r"would run: scontrol update NodeName=(\S+) NodeAddr=(\S+) ", out):
        for name, ip in zip(names.split(","), ips.split(","), strict=True):
            assert name not in addrs, f"{name}'s address sent twice"
            addrs[name] = ip
    assert sorted(addrs) == ["gpu01", "gpu02", "gpu03", "gpu04"]
    assert all(re.fullmatch(r"127\.0\.1\.\d+", ip) for ip in addrs.values()), addrs
    assert "resume: 4 done, 0 failed; 0 of 4 GPUs free" in out
    assert "slurm-nebula-prolog (the PrologSlurmctld) lets the waiting job start at once" in out
    table = [line.split() for line in lines if re.match(r"\s+gpu0\d\s+n/a\s", line)]
    assert [row[3] for row in table] == ["ACTIVE/RUNNING"] * 4
    assert "suspend: 4 done, 0 failed; 4 of 4 GPUs free" in out
    assert "every VM created, booted and terminated, every GPU back." in out
    usage = {row[0]: row for row in (line.split() for line in lines) if row and row[0] in ("1001", "1002", "1003")}
    assert sorted(usage) == ["1001", "1002", "1003"], out
    assert usage["1001"][2] == "gpu[01-02]" and len(usage["1001"][1].split(",")) == 2  # one job, two VMs
    assert usage["1002"][2] == "gpu03" and re.fullmatch(r"gpu-host-0\d", usage["1002"][3])
    # a job that asks for more GPUs than exist: handed back whole, at once, with no VM created
    assert "would run: scontrol update NodeName=gpu[01-05] State=POWER_DOWN_FORCE Reason=nebula: job 1: needs 5 " \
           "GPUs 10de:0302, 4 free" in out
    assert re.search(r"resume: 0 done, 5 failed \(job 1: needs 5 GPUs 10de:0302, 4 free: gpu\[01-05\]\) in "
                     r"\d+\.\ds, 0 VMs created", out)
    assert "CAPACITY gpu[01-08]: GPU 10de:0302 x1 per VM: 4 free, 0 held by our VMs, 0 by others" in out
    root = Path(re.search(r"programs in (\S+),", out).group(1))  # type: ignore[union-attr]
    assert not root.exists(), "the temporary directory is removed"


def test_keep_leaves_the_configuration_and_a_private_auth_file(capsys) -> None:
    assert demo.main(["--phase-seconds", "0", "--keep"]) == 0
    out = capsys.readouterr().out
    root = Path(re.search(r"kept (\S+)", out).group(1))  # type: ignore[union-attr]
    try:
        assert (root / "one_auth").stat().st_mode & 0o777 == 0o600
        assert "nodes = \"gpu[01-08]\"" in (root / "nebula-power.toml").read_text()
        assert "summary" not in out and "node=gpu01" in (root / "nebula-power.log").read_text()
    finally:
        shutil.rmtree(root)


def test_demo_answers_help(capsys) -> None:
    assert demo.main(["--help"]) == 0
    assert "Needs no Slurm" in " ".join(capsys.readouterr().out.split())
    assert demo.main(["--phase-seconds", "99"]) == 2


# ---- a fresh virtual environment -------------------------------------------------------------------
# The README's first command: python3 -m venv X && X/bin/pip install <repo> && X/bin/slurm-nebula-power demo.
# Tests run without network (a private namespace with only loopback), so pip gets its packages from a local
# wheelhouse: the dependencies as installed in this test environment, repacked as wheels. The package itself
# is built from a copy of this source tree by pip, as an administrator's install would.


def _requirement(text: str):  # type: ignore[no-untyped-def]
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors packaging
        from pip._vendor.packaging.requirements import Requirement
    return Requirement(text)


def _closure(names: list[str]) -> list[metadata.Distribution]:
    """These distributions and everything they require (markers evaluated, no extras)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        dist = metadata.distribution(name)
        seen[name] = dist
        for text in dist.requires or []:
            req = _requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _repack(dist: metadata.Distribution, into: Path) -> Path:
    """A wheel of an installed distribution, from the files its RECORD lists."""
    base = Path(str(dist.locate_file("")))
    info = next(f for f in dist.files or [] if f.parts[0].endswith(".dist-info"))
    tags = [line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")]
    parts = [sorted({t.split("-")[i] for t in tags}) for i in range(3)]
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    wheel = into / f"{name}-{dist.version}-{'-'.join('.'.join(p) for p in parts)}.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as out:
        for file in dist.files or []:
            text = str(file)
            if text.startswith("..") or file.suffix == ".pyc" or file.name in (
                    "RECORD", "INSTALLER", "REQUESTED", "direct_url.json"):
                continue
            data = (base / file).read_bytes()
            out.writestr(text, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{text},sha256={digest},{len(data)}")
        record.append(f"{info.parts[0]}/RECORD,,")
        out.writestr(f"{info.parts[0]}/RECORD", "\n".join(record) + "\n")
    return wheel


def _build_backend() -> list[str]:
    """The installed build backend, if it can build this package (setuptools 77+: PEP 639 license string)."""
    setuptools = metadata.version("setuptools")
    if tuple(int(p) for p in re.findall(r"\d+", setuptools)[:2]) < (77, 0):
        pytest.skip(f"building the package offline needs setuptools>=77 in the test environment (found "
                    f"{setuptools}): pip install --upgrade setuptools")
    return ["setuptools"]


def test_demo_in_a_fresh_venv_installed_as_the_readme_says(tmp_path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    ours = metadata.distribution("slurm-nebula-power")
    needed = [_requirement(r).name for r in ours.requires or [] if "extra ==" not in r]
    for dist in _closure(needed + _build_backend()):
        _repack(dist, wheels)
    source = tmp_path / "slurm-nebula-power"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"))
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    # No pip configuration file either: nothing but the wheelhouse is looked at.
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
               PIP_NO_CACHE_DIR="1")

    def run(*argv: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(a) for a in argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, check=False)
        assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
        return done

    run(sys.executable, "-m", "venv", venv)
    run(venv / "bin" / "pip", "install", "--no-index", "--find-links", wheels, source)
    shown = run(venv / "bin" / "slurm-nebula-power", "demo", timeout=120).stdout
    assert "every VM created, booted and terminated, every GPU back." in shown
    assert run(venv / "bin" / "slurm-nebula-resume", "--version").stdout.startswith("slurm-nebula-resume ")
