"""Other users (issue 15, items 3 and 7): a root run of a command leaves nothing SlurmUser cannot use, the
lock directory never follows a symlink, a node whose lock cannot be taken is handed back, and one call may
lock 5,000 nodes under the usual `ulimit -n 1024`.

The programs run as processes, as root or as the `slurm` user that Debian's Slurm packages create.
"""

from __future__ import annotations

import os
import pwd
import resource
import shutil
import subprocess
from pathlib import Path

import pytest
from reliability_support import live_ours, run_env, site
from test_cli import program

from slurm_nebula_power.errors import EXIT_CONFIG, EXIT_NODES_FAILED, EXIT_OK

try:
    SLURM = pwd.getpwnam("slurm")
except KeyError:
    SLURM = None

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or SLURM is None,
                                reason="needs root and the slurm user (Debian's slurmctld package makes it)")



ENTRIES = {"slurm-nebula-resume": "resume_entry", "slurm-nebula-suspend": "suspend_entry"}
REPO = Path(__file__).resolve().parent.parent


def slurm_argv(name: str, *args: str) -> list[str]:
    """The installed program as the slurm user can start it: the test venv's interpreter may live in
    root's home (pyenv), so Debian's python3 runs the same code from this checkout and the venv's packages."""
    paths = [str(REPO), *sysconfig_paths()]
    code = (f"import sys; sys.path[:0] = {paths!r}; "
            f"from slurm_nebula_power.cli.main import {ENTRIES[name]} as entry; entry()")
    return ["/usr/bin/python3", "-c", code, *args]


def sysconfig_paths() -> list[str]:
    import sysconfig

    return [sysconfig.get_paths()["purelib"]]


def run(setup, name: str, *args: str, as_slurm: bool = False) -> subprocess.CompletedProcess[str]:
    if as_slurm:
        return subprocess.run(slurm_argv(name, *args), env=run_env(setup), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=120, user=SLURM.pw_uid, group=SLURM.pw_gid,
                              extra_groups=[], cwd="/")
    return subprocess.run([program(name), *args], env=run_env(setup), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)


def slurm_site(shared: Path, sim):
    setup = site(shared / "site", sim, boot_timeout=20, poll_max=0.2)
    (setup.root / "slurm.conf").write_text("ClusterName=testcluster\nSlurmUser=slurm\n")
    setup.log.unlink(missing_ok=True)
    fake = setup.scontrol_dir / "scontrol"  # its interpreter must be one the slurm user can start too
    fake.write_text("#!/usr/bin/python3\n" + fake.read_text().split("\n", 1)[1])
    shutil.rmtree(setup.root / "locks", ignore_errors=True)
    for record in ("scontrol.calls.jsonl", "scontrol.sigblk"):  # the fake's records, written by root and slurm
        (setup.scontrol_dir / record).touch()
        (setup.scontrol_dir / record).chmod(0o666)
    for path in [setup.root, *setup.root.rglob("*")]:
        os.chown(path, SLURM.pw_uid, SLURM.pw_gid)
    setup.root.chmod(0o755)
    try:
        probe = subprocess.run(slurm_argv("slurm-nebula-resume", "--version"), capture_output=True, text=True,
                               user=SLURM.pw_uid, group=SLURM.pw_gid, extra_groups=[], cwd="/", timeout=60)
    except OSError as exc:
        pytest.skip(f"the slurm user cannot start /usr/bin/python3: {exc}")
    if probe.returncode != 0:
        pytest.skip(f"the slurm user cannot run this checkout (directories not readable by others?): "
                    f"{probe.stderr[-300:]!r}")
    return setup


def test_a_resume_typed_by_root_leaves_locks_and_log_that_slurmuser_can_use(shared, sim) -> None:
    setup = slurm_site(shared, sim)
    done = run(setup, "slurm-nebula-resume", "gpu01")  # by hand, as root: creates lock dir, lock and log
    assert done.returncode == EXIT_OK, done.stderr
    locks = setup.root / "locks"
    assert (locks.stat().st_uid, setup.log.stat().st_uid) == (SLURM.pw_uid, SLURM.pw_uid), "made for SlurmUser"
    # Then slurmctld runs the programs as SlurmUser: before, every one exited 3 and handed nothing back.
    down = run(setup, "slurm-nebula-suspend", "gpu01", as_slurm=True)
    assert down.returncode == EXIT_OK, down.stderr + setup.log_text()[-2000:]
    up = run(setup, "slurm-nebula-resume", "gpu[01-02]", as_slurm=True)
    assert up.returncode == EXIT_OK, up.stderr + setup.log_text()[-2000:]
    assert sorted(live_ours(sim)) == ["gpu01", "gpu02"]


def test_a_lock_slurmuser_cannot_open_hands_the_node_back(shared, sim) -> None:
    setup = slurm_site(shared, sim)
    locks = setup.root / "locks"
    locks.mkdir()
    os.chown(locks, SLURM.pw_uid, SLURM.pw_gid)
    stale = locks / "gpu02.lock"
    stale.write_text("")
    stale.chmod(0o600)  # root's, as an older version left it
    done = run(setup, "slurm-nebula-resume", "gpu[01-02]", as_slurm=True)
    assert done.returncode == EXIT_NODES_FAILED, done.stderr
    handbacks = [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
    assert handbacks == [["NodeName=gpu02", "State=POWER_DOWN_FORCE",
                          "Reason=nebula: lock unavailable: see the nebula-power log"]]
    assert sorted(live_ours(sim)) == ["gpu01"], "the other node was resumed"
    # The fix names the real cause: the file a root run left, not the directory.
    assert f"gpu02.lock (file of root, mode 0600) cannot be used by slurm: run chown slurm {stale}" \
        in setup.log_text()


def test_no_symlink_in_the_lock_directory_is_followed(tmp_path, sim) -> None:
    setup = site(tmp_path / "site", sim, boot_timeout=20, poll_max=0.2)
    locks = setup.root / "locks"
    locks.mkdir(exist_ok=True)
    victim = tmp_path / "victim"  # a local user plants a link where root will create a lock
    (locks / "gpu01.lock").symlink_to(victim)
    done = subprocess.run([program("slurm-nebula-resume"), "gpu01"], env=run_env(setup), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == EXIT_NODES_FAILED
    assert not victim.exists(), "the link was not followed"
    assert "symlink, never followed" in setup.log_text()
    assert live_ours(sim) == {}


def test_5000_nodes_in_one_call_under_ulimit_1024(tmp_path, sim) -> None:
    nodesets = '[[nodeset]]\nnodes = "n[0001-5000]"\ntemplate = "slurm-cpu-worker"\nboot_timeout = 20\n'
    setup = site(tmp_path / "site", sim, nodes="n[0001-5000]", boot_timeout=20)
    assert nodesets  # the same node set the site was written with

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    done = subprocess.run([program("slurm-nebula-suspend"), "n[0001-5000]"], env=run_env(setup),
                          capture_output=True, text=True, timeout=300, preexec_fn=low_limit)
    assert done.returncode == EXIT_OK, done.stderr[-500:]
    assert "5000 done, 0 failed" in setup.log_text()


def slurm_user_site(shared: Path, sim, nodes: str = "gpu[01-08]"):
    """slurm_site with its own node set (site's nodes)."""
    setup = slurm_site(shared, sim)
    text = setup.config.read_text()
    setup.config.write_text(text.replace('nodes = "gpu[01-08]"', f'nodes = "{nodes}"'))
    return setup


def test_a_root_run_leaves_audit_metrics_and_shortage_files_slurmuser_goes_on_using(shared, sim) -> None:
    # issue 22, item 3: a root run made the audit file and the metrics lock 0640 root:root, and every later
    # SlurmUser run lost its usage records ("fix its directory's permissions": the directory was fine)
    setup = slurm_user_site(shared, sim, nodes="gpu[01-20]")  # 16 GPUs in the simulator: 4 nodes short
    by_root = run(setup, "slurm-nebula-resume", "gpu[01-20]")
    assert by_root.returncode == EXIT_NODES_FAILED, by_root.stderr
    shortages = list((setup.root / "locks").glob("shortage-*.json"))
    made = [setup.audit, setup.metrics, setup.metrics.with_name(setup.metrics.name + ".lock"), *shortages]
    assert len(shortages) == 1 and all(p.stat().st_uid == SLURM.pw_uid for p in made), \
        [(p.name, p.stat().st_uid) for p in made]
    before = len(setup.records())
    again = run(setup, "slurm-nebula-resume", "gpu[17-20]", as_slurm=True)  # reads the shortage: the cooldown
    assert again.returncode == EXIT_NODES_FAILED, again.stderr
    down = run(setup, "slurm-nebula-suspend", "gpu[01-16]", as_slurm=True)
    assert down.returncode == EXIT_OK, down.stderr + setup.log_text()[-2000:]
    log = setup.log_text()
    assert "cannot append usage records" not in log and "cannot write this run's metrics" not in log, log[-2000:]
    assert "ignoring unreadable shortage state" not in log and "cooldown" in log
    records = setup.records()[before:]
    assert {r["program"] for r in records} == {"resume", "suspend"}, "SlurmUser's runs recorded"
    assert sum(r["event"] == "removed" for r in records) == 16
    assert 'program="suspend",result="ok"' in setup.metrics.read_text()


def test_a_file_a_root_run_left_names_the_file_its_owner_and_the_chown(shared, sim) -> None:
    # What an older version's root run left behind: the error names the file, not the directory.
    setup = slurm_site(shared, sim)
    setup.audit.write_text("")
    setup.audit.chmod(0o640)  # root's
    done = run(setup, "slurm-nebula-resume", "gpu01", as_slurm=True)
    assert done.returncode == EXIT_OK, done.stderr
    assert f"audit_file {setup.audit}: cannot append usage records (those of this run are lost): {setup.audit} " \
           f"(file of root, mode 0640) cannot be used by slurm: run chown slurm {setup.audit}" in setup.log_text()


@pytest.mark.parametrize("target", ["dangling", "existing"])
def test_a_link_slurmuser_plants_at_the_log_file_is_never_followed_by_root(shared, sim, target: str) -> None:
    # issue 22, item 4: the log file was checked, touched and chowned by path: a dangling link planted by
    # SlurmUser made a root run create a file of SlurmUser's anywhere (e.g. in /etc/profile.d)
    setup = slurm_site(shared, sim)
    protected = shared / "profile.d"
    protected.mkdir(mode=0o755)
    victim = protected / "zz-slurm.sh"
    if target == "existing":
        victim.write_text("# root's\n")
        victim.chmod(0o644)
    os.symlink(victim, setup.log)
    os.lchown(setup.log, SLURM.pw_uid, SLURM.pw_gid)
    done = run(setup, "slurm-nebula-resume", "gpu01")  # by hand, as root
    assert done.returncode == EXIT_CONFIG, done.stderr
    assert f"log.file: cannot write {setup.log}: {setup.log} is a symlink, never followed: remove it" in done.stderr
    if target == "dangling":
        assert not victim.exists(), "no file made through the link"
    else:
        assert victim.read_text() == "# root's\n" and victim.stat().st_uid == 0
    assert live_ours(sim) == {}, "nothing done"
