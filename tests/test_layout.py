"""The layout's import contracts (pyproject.toml) catch what they are for: each rule, broken once in a copy."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

LAYERS = "commands -> operator back ends -> power programs -> adapters -> pure decisions -> model"
SIMULATOR_ALONE = "the simulator imports nothing of the product"
ONLY_ONERPC = "only onerpc imports pyone"
ONLY_METRICS = "only metrics imports prometheus_client"

# (what is added to the copy: a path and the line appended to it, the one contract it must break)
VIOLATIONS = {
    "a pure decision imports an adapter": ("slurm_nebula_power/capacity.py", "from . import slurm", LAYERS),
    "a module in no layer": ("slurm_nebula_power/stray.py", '"""Belongs to no layer."""', LAYERS),
    "a command imports pyone": ("slurm_nebula_power/cli/stray.py", "import pyone", ONLY_ONERPC),
    "a pure decision imports pyone": ("slurm_nebula_power/plan.py", "import pyone", ONLY_ONERPC),
    "an adapter imports prometheus_client": (
        "slurm_nebula_power/cloud.py", "import prometheus_client", ONLY_METRICS),
    "a command imports prometheus_client": (
        "slurm_nebula_power/cli/stray.py", "from prometheus_client import Counter", ONLY_METRICS),
    "the simulator imports the product": ("opennebula_sim/stray.py", "import slurm_nebula_power", SIMULATOR_ALONE),
}


def _copy(tmp_path: Path) -> Path:
    """The two packages and pyproject.toml, copied where an added module cannot reach the real tree."""
    for package in ("slurm_nebula_power", "opennebula_sim"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _lint(tree: Path) -> tuple[int, dict[str, str]]:
    """Run lint-imports on the copy (its cwd comes first on sys.path); its exit code and each contract's verdict."""
    if not LINT_IMPORTS.exists():
        pytest.skip(f"lint-imports not installed beside {sys.executable} (pip install -e '.[test]')")
    env = {**os.environ, "COLUMNS": "500", "PYTHONPATH": str(tree)}  # one contract a line, however long its name
    proc = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(tree / "pyproject.toml")],
        cwd=tree, env=env, capture_output=True, text=True, timeout=300,
    )
    verdicts = dict(re.findall(r"^(.+?) (KEPT|BROKEN)\b", proc.stdout, re.MULTILINE))
    return proc.returncode, verdicts


def test_the_untouched_copy_keeps_every_contract(tmp_path: Path) -> None:
    code, verdicts = _lint(_copy(tmp_path))
    assert code == 0
    assert {LAYERS, SIMULATOR_ALONE, ONLY_ONERPC, ONLY_METRICS} <= verdicts.keys()
    assert set(verdicts.values()) == {"KEPT"}


@pytest.mark.parametrize("violation", VIOLATIONS)
def test_a_violation_breaks_its_contract_and_only_it(tmp_path: Path, violation: str) -> None:
    relative, line, contract = VIOLATIONS[violation]
    tree = _copy(tmp_path)
    target = tree / relative
    before = target.read_text() if target.exists() else ""
    target.write_text(before + line + "\n")
    code, verdicts = _lint(tree)
    assert code != 0
    assert verdicts[contract] == "BROKEN"
    assert {name for name, verdict in verdicts.items() if verdict == "BROKEN"} == {contract}


MOST_LINES = 400  # STYLE.md: modules stay small; the layout issue (27) set the line


def test_no_module_exceeds_400_lines() -> None:
    # issue 27: resume.py grew to 544 lines while the limit was only a habit; a module past it fails here,
    # named with its length, so it is split before it grows further
    over = {}
    for package in ("slurm_nebula_power", "opennebula_sim"):
        for module in sorted((ROOT / package).rglob("*.py")):
            lines = len(module.read_text(encoding="utf-8").splitlines())
            if lines > MOST_LINES:
                over[str(module.relative_to(ROOT))] = lines
    assert over == {}, f"modules over {MOST_LINES} lines: {over}"
