"""Directories other users can write (issue 22, items 2, 7 and 9): whoever can write the metrics directory
(node_exporter's textfile directory, often shared) or the lock directory (a shared HA directory) plants
links, hard links, FIFOs and devices where the programs open their files. The installed programs run as
processes; what is asserted is what they never do (follow, hang, log the content, create, chmod) and that
the run still does its work.
"""

from __future__ import annotations

import json
import os
import re
import resource
import stat
import subprocess
from pathlib import Path

import pytest
from reliability_support import live_ours, run_env, run_program, site
from test_cli import program

from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK


def metrics_written(setup) -> bool:
    """The run's metrics reached the file, a regular file of its own."""
    info = os.lstat(setup.metrics)
    return stat.S_ISREG(info.st_mode) and info.st_nlink == 1 and "slurm_nebula_power_runs_total" in \
        setup.metrics.read_text()


@pytest.fixture
def setup(tmp_path, sim):
    return site(tmp_path / "site", sim, boot_timeout=20, poll_max=0.2)


def secret_file(tmp_path: Path) -> tuple[Path, str]:
    """A file the attacker wants to read through the program's log: the credentials' shape."""
    secret = tmp_path / "victim-secret"
    secret.write_text("oneadmin:Victim-Pa55word\nsecond line\n")
    secret.chmod(0o600)
    return secret, "Victim-Pa55word"


@pytest.mark.parametrize("plant", ["symlink-to-credentials", "hardlink-to-credentials", "symlink-to-shadow"])
def test_a_metrics_file_linked_to_a_secret_never_puts_it_in_the_log(setup, tmp_path, plant: str) -> None:
    # Before: the parse error quoted the file, so the log got the OpenNebula password (as root: /etc/shadow's
    # first line). Now a linked file is refused without reading it, and a new file is written in its place.
    secret, word = secret_file(tmp_path)
    if plant == "symlink-to-credentials":
        setup.metrics.symlink_to(setup.root / "one_auth")
        word = setup.password
    elif plant == "hardlink-to-credentials":
        os.link(secret, setup.metrics)
    else:
        setup.metrics.symlink_to("/etc/shadow")
        word = Path("/etc/shadow").read_text().split("\n", 1)[0]
    before = secret.read_text(), stat.S_IMODE(secret.stat().st_mode)
    done = run_program(setup, "suspend", "gpu01")
    assert done.returncode == EXIT_OK, done.stderr
    log = setup.log_text()
    assert word not in log and word not in done.stderr
    assert "metrics_file" in log and "starting it again" in log
    assert metrics_written(setup), "replaced by a file of its own"
    assert (secret.read_text(), stat.S_IMODE(secret.stat().st_mode)) == before
    assert (setup.root / "one_auth").read_text().strip().endswith(setup.password), "the credentials untouched"


@pytest.mark.parametrize("plant", ["dev-zero", "fifo", "huge"])
def test_a_metrics_file_that_is_a_device_a_fifo_or_huge_neither_hangs_nor_fills_memory(setup, plant: str) -> None:
    # Before: /dev/zero took the run to 1.35 GB, a FIFO hung it holding the metrics lock.
    if plant == "dev-zero":
        setup.metrics.symlink_to("/dev/zero")
    elif plant == "fifo":
        os.mkfifo(setup.metrics)
    else:
        with setup.metrics.open("wb") as big:
            big.truncate(64 << 20)  # sparse, 64 MiB: far over the cap
    done = subprocess.run([program("slurm-nebula-suspend"), "gpu01"], env=run_env(setup), capture_output=True,
                          text=True, timeout=60, preexec_fn=lambda: resource.setrlimit(
                              resource.RLIMIT_AS, (1 << 30, 1 << 30)))  # 1 GiB: /dev/zero read whole fails
    assert done.returncode == EXIT_OK, done.stderr
    assert metrics_written(setup)
    assert "starting it again" in setup.log_text()


@pytest.mark.parametrize("plant", ["dangling-symlink", "symlink-to-file", "fifo"])
def test_a_planted_metrics_lock_is_never_followed_or_created_through(setup, tmp_path, plant: str) -> None:
    # Before: a link at nebula-power.prom.lock made a root run create any file (/etc/nologin stops logins).
    lock = setup.root / "nebula-power.prom.lock"
    victim = tmp_path / "nologin"
    if plant == "dangling-symlink":
        lock.symlink_to(victim)
    elif plant == "symlink-to-file":
        victim.write_text("keep\n")
        victim.chmod(0o600)
        lock.symlink_to(victim)
    else:
        os.mkfifo(lock)
    done = run_program(setup, "reconcile", guard=60)
    assert done.returncode == EXIT_OK, done.stderr
    if plant == "dangling-symlink":
        assert not victim.exists(), "no file made through the link"
    elif plant == "symlink-to-file":
        assert victim.read_text() == "keep\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert "cannot write this run's metrics" in setup.log_text()
    assert not setup.metrics.exists(), "no metrics written without the lock"


def test_a_fifo_or_link_in_the_lock_directory_hands_that_node_back_and_hangs_nothing(setup, sim, tmp_path) -> None:
    # Before: the lock was opened before its type was checked and without O_NONBLOCK: a FIFO hung resume.
    locks = setup.root / "locks"
    locks.mkdir(exist_ok=True)
    os.mkfifo(locks / "gpu01.lock")
    other = tmp_path / "someone-elses"
    other.write_text("")
    os.link(other, locks / "gpu02.lock")  # a hard link: not a lock of ours
    done = run_program(setup, "resume", "gpu[01-03]", guard=60)
    assert done.returncode == EXIT_NODES_FAILED, done.stderr
    handbacks = [u[0] for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
    assert handbacks == ["NodeName=gpu[01-02]"]
    assert sorted(live_ours(sim)) == ["gpu03"]
    log = setup.log_text()
    assert "gpu01.lock is not a regular file" in log and "gpu02.lock has 2 hard links" in log


@pytest.mark.parametrize(("plant", "why"), [("symlink-to-credentials", "is a symlink, never followed"),
                                           ("fifo", "is not a regular file"), ("huge", "is larger than 65536 bytes"),
                                           ("deep", "malformed shortage state")])
def test_a_planted_shortage_file_is_no_cooldown_and_leaks_nothing(setup, plant: str, why: str) -> None:
    # The cooldown's state in lock_dir: it was read by path, following links and FIFOs, with no size limit.
    from slurm_nebula_power.cooldown import ShortageLog

    locks = setup.root / "locks"
    locks.mkdir(exist_ok=True)
    state = ShortageLog(locks, cluster="testcluster").path("gpu[01-08]")  # make_setup's ClusterName
    if plant == "symlink-to-credentials":
        state.symlink_to(setup.root / "one_auth")
    elif plant == "fifo":
        os.mkfifo(state)
    elif plant == "huge":
        state.write_text('{"nodes": "gpu[01-08]", "reason": "' + "x" * (1 << 20) + '"}')
    else:
        state.write_text("[" * 30_000)  # past json's recursion limit, under the size cap
    done = run_program(setup, "resume", "gpu01", guard=60)
    assert done.returncode == EXIT_OK, done.stderr + setup.log_text()[-1000:]
    log = setup.log_text()
    assert f"shortage state {state}" in log and why in log, log[-1500:]
    assert setup.password not in log


def test_a_suspend_of_5000_nodes_under_a_hard_limit_of_1024_files_does_what_fits(tmp_path, sim) -> None:
    # Before: the locks took every descriptor and OpenNebula could not be reached at all: 0 done, 5,000 failed.
    setup = site(tmp_path / "site", sim, nodes="n[0001-5000]", boot_timeout=20)

    def hard_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    done = subprocess.run([program("slurm-nebula-suspend"), "n[0001-5000]"], env=run_env(setup),
                          capture_output=True, text=True, timeout=300, preexec_fn=hard_limit)
    assert done.returncode == EXIT_NODES_FAILED, done.stderr[-500:]
    [summary] = [line for line in setup.log_text().splitlines() if "summary:" in line]
    found = re.search(r"n\[0001-5000\]: (\d+) done, (\d+) failed", summary)
    assert found, summary
    done_count, failed_count = int(found.group(1)), int(found.group(2))
    assert done_count + failed_count == 5000 and 500 < done_count < 1024, summary
    assert "no descriptor left for its lock: the hard limit of open files (1024)" in setup.log_text()
    assert "api_error" not in summary and "OpenNebula" not in summary, "the API kept its descriptors"


PLANTED_RECORDS = {  # what a writer of the audit directory can append: JSON of the right shape, wrong types
    "vm-infinite": '"vm": 1e400', "vm-object": '"vm": {}', "vm-true": '"vm": true', "host-object": '"host": {"a": 1}',
    "host-list": '"host": [1]', "job-infinite": '"jobs": [1e400]', "jobs-text": '"jobs": "7"',
    "gpus-text": '"gpus": "abc"', "reason-number": '"reason": 5', "time-number": '"time": 5',
}


@pytest.mark.parametrize("field", PLANTED_RECORDS)
def test_a_record_of_the_wrong_types_in_the_audit_file_is_a_warning_never_a_crash(setup, field: str) -> None:
    # `usage` took int(1e400) (OverflowError), a host of {} (unhashable) or a deep nesting (RecursionError)
    # as given: a traceback and exit 1, where a line that is not a record is a warning
    assert run_program(setup, "resume", "gpu01", guard=60).returncode == EXIT_OK
    good = setup.audit.read_text().splitlines()
    record = json.loads(good[-1])
    planted = json.dumps({k: v for k, v in record.items() if k not in ("vm", "host", "jobs", "gpus")})
    planted = planted[:-1] + ", " + PLANTED_RECORDS[field] + "}"
    if field == "time-number":
        planted = planted.replace(f'"time": "{record["time"]}"', '"time": 5', 1)
    with setup.audit.open("a") as audit:
        audit.write(planted + "\n" + "[" * 15000 + "\n")
    for by in ("host", "job", "vm"):
        usage = subprocess.run([program("slurm-nebula-power"), "usage", "--by", by, "--no-cloud", "--json"],
                               env=run_env(setup), capture_output=True, text=True, timeout=60)
        assert usage.returncode == EXIT_OK and "Traceback" not in usage.stderr, (field, by, usage.stderr)
        found = json.loads(usage.stdout)
        assert len(found["unreadable_lines"]) == 2, found["unreadable_lines"]
        assert sum(len(row["vms"]) for row in found["rows"]) == 1, "the good records still counted"


@pytest.mark.parametrize("plant", ["symlink-to-credentials", "dangling-symlink", "hardlink", "fifo", "dev-null"])
def test_a_planted_audit_file_is_never_followed_read_or_written_and_the_run_goes_on(setup, sim, tmp_path,
                                                                                   plant: str) -> None:
    # issue 22, item 2 names the audit file beside the metrics file: a writer of its directory plants a
    # link to the credentials (records appended to them), a dangling link (a root run creates the file it
    # names), a hard link, a FIFO (the append would block) or a device
    victim = tmp_path / "victim"
    if plant == "symlink-to-credentials":
        setup.audit.symlink_to(setup.root / "one_auth")
    elif plant == "dangling-symlink":
        setup.audit.symlink_to(victim)
    elif plant == "hardlink":
        victim.write_text("keep\n")
        os.link(victim, setup.audit)
    elif plant == "fifo":
        os.mkfifo(setup.audit)
    else:
        setup.audit.symlink_to("/dev/null")
    credentials = (setup.root / "one_auth").read_text()
    done = run_program(setup, "resume", "gpu01", guard=60)
    assert done.returncode == EXIT_OK, done.stderr
    assert sorted(live_ours(sim)) == ["gpu01"], "the run did its work"
    log = setup.log_text()
    assert "cannot append usage records (those of this run are lost)" in log and setup.password not in log
    assert (setup.root / "one_auth").read_text() == credentials
    assert victim.exists() == (plant == "hardlink") and (plant != "hardlink" or victim.read_text() == "keep\n")


def test_a_planted_record_forges_no_line_of_usage_s_disagreements(setup) -> None:
    # The table's cells were escaped (issue 22 item 6); the disagreements under it quoted a record's node as
    # written, so a line planted in the audit file could add a line of its own to the report
    record = {"v": 1, "time": "2026-12-01T00:00:00+00:00", "event": "running", "node": "gpu01\nFORGED: all billed",
              "vm": 999, "host": "h", "gpus": [], "jobs": [7], "program": "resume", "cluster": "testcluster"}
    setup.audit.write_text(json.dumps(record) + "\n")
    usage = subprocess.run([program("slurm-nebula-power"), "usage"], env=run_env(setup), capture_output=True,
                           text=True, timeout=60)
    assert usage.returncode == EXIT_NODES_FAILED, usage.stderr
    assert "VM 999 (gpu01\\nFORGED: all billed)" in usage.stdout, usage.stdout
    assert not [line for line in usage.stdout.splitlines() if line.startswith("FORGED")], usage.stdout
