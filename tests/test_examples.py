"""`slurm-nebula-power example-config` (issue 25): the example files ship inside the package, so an installed
copy without the source tree still has them, and the command prints or writes them out."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from test_cli import program

from slurm_nebula_power.cli.examples import EXAMPLES

REPO = Path(__file__).resolve().parent.parent


def power(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([program("slurm-nebula-power"), "example-config", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd)


def test_each_example_is_the_file_etc_shows() -> None:
    for name in EXAMPLES:
        shown = power(name)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout == (REPO / "etc" / name).read_text(), name


def test_the_default_is_the_configuration_and_it_is_toml() -> None:
    shown = power()
    assert shown.returncode == 0 and "[opennebula]" in shown.stdout
    tomllib.loads(shown.stdout)


def test_out_writes_every_file_and_never_overwrites(tmp_path) -> None:
    written = power("--out", str(tmp_path / "ex"))
    assert written.returncode == 0, written.stderr
    assert sorted(written.stdout.split()) == sorted(str(tmp_path / "ex" / name) for name in EXAMPLES)
    assert os.access(tmp_path / "ex" / "worker" / "slurm-nebula-worker.sh", os.X_OK)
    (tmp_path / "ex" / "nebula-power.toml").write_text("mine\n")
    again = power("--out", str(tmp_path / "ex"))
    assert again.returncode == 2 and "exists already: nothing written" in again.stderr
    assert (tmp_path / "ex" / "nebula-power.toml").read_text() == "mine\n"


def test_an_unknown_name_is_one_line_and_exit_2() -> None:
    done = power("nope.toml")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "one of: nebula-power.toml" in done.stderr


def test_a_wheel_carries_the_examples(tmp_path) -> None:
    # What `pip install /path/to/slurm-nebula-power` installs: the examples come with it (etc/ links to them).
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = tmp_path.glob("*.whl")
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    for inside, _ in EXAMPLES.values():
        assert f"slurm_nebula_power/{inside}" in names, inside
    assert any(n.endswith("licenses/LICENSE") or n.endswith("/LICENSE") for n in names), "LICENSE ships too"
