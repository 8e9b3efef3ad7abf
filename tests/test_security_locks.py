"""Issue 34, item 1: no local user but root and SlurmUser may open a lock file, so nobody else can flock one
and hold a node (its VM and GPUs) for ever; lock_dir is not searchable by others, and check says so when it is.

The other user is `nobody`, in a process of its own; the locks are made by root for the `slurm` user (as a
root run by hand makes them) or by that user itself."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
from pathlib import Path

import pytest

from slurm_nebula_power.cooldown import ShortageLog
from slurm_nebula_power.files import make_directory
from slurm_nebula_power.locks import NodeLocks
from slurm_nebula_power.metrics import RunFigures, write_metrics
from slurm_nebula_power.protectlog import ProtectLog

try:
    SLURM = pwd.getpwnam("slurm")
    NOBODY = pwd.getpwnam("nobody")
except KeyError:
    SLURM = NOBODY = None

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or SLURM is None or NOBODY is None,
                                reason="needs root, the slurm user (Debian's Slurm packages make it) and nobody")


@pytest.fixture
def lock_dir(shared: Path) -> Path:
    """A lock_dir below a directory every user can search (pytest's tmp_path is root's alone)."""
    return shared / "locks"


def owner() -> tuple[int, int]:
    assert SLURM is not None
    return SLURM.pw_uid, SLURM.pw_gid


def flock_as_nobody(path: Path) -> str:
    """What happens when `nobody` tries to open the file and flock it: "held", or the error's name."""
    assert NOBODY is not None
    code = ("import fcntl, os, sys\n"
            "try:\n"
            "    fd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
            "    print('held')\n"
            "except OSError as exc:\n"
            "    print(type(exc).__name__)\n")
    uid, gid = NOBODY.pw_uid, NOBODY.pw_gid

    def drop() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    done = subprocess.run(["/usr/bin/python3", "-c", code, str(path)], capture_output=True, text=True, timeout=30,
                          preexec_fn=drop, check=False)
    return done.stdout.strip() or done.stderr.strip()[-200:]


def test_a_node_lock_made_by_root_for_slurmuser_cannot_be_held_by_another_user(lock_dir) -> None:
    with NodeLocks(lock_dir, ["gpu01"], 1.0, owner=owner()) as locks:
        assert locks.held == ["gpu01"]
    lock = lock_dir / "gpu01.lock"
    info = lock.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (SLURM.pw_uid, 0o600)
    assert stat.S_IMODE(lock_dir.stat().st_mode) & 0o007 == 0, "lock_dir is not searchable by others"
    lock_dir.chmod(0o755)  # even where an administrator opened the directory up
    assert flock_as_nobody(lock) == "PermissionError"


@pytest.mark.parametrize("left", ["0644 by an older version", "root's, by a root run without an owner"])
def test_a_lock_file_left_open_to_others_is_made_private_on_its_next_use(lock_dir, left: str) -> None:
    make_directory(lock_dir, owner(), 0o755)
    lock = lock_dir / "gpu01.lock"
    lock.touch()
    lock.chmod(0o644)
    if left.startswith("0644"):
        os.chown(lock, *owner())
    assert flock_as_nobody(lock) == "held", "the hole: anyone could flock it"
    with NodeLocks(lock_dir, ["gpu01"], 1.0, owner=owner()) as locks:
        assert locks.held == ["gpu01"]
    info = lock.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (SLURM.pw_uid, 0o600)
    assert flock_as_nobody(lock) == "PermissionError"


def test_the_protected_mode_step_out_and_metrics_locks_are_private_too(lock_dir) -> None:
    ProtectLog(lock_dir, owner=owner()).failed("gpu[01-02]", 1, "VM failed", 3, 60)  # under its lock
    with ShortageLog(lock_dir, owner=owner()).locked("gpu[01-02]", 1.0):  # what StepOut.settle holds
        pass
    assert write_metrics(lock_dir / "nebula-power.prom", RunFigures("reconcile"), owner=owner())
    locks = sorted(lock_dir.glob("*.lock"))
    assert [lock.name.split("-")[0] for lock in locks] == ["nebula", "protect", "shortage"], locks
    for lock in locks:
        info = lock.stat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (SLURM.pw_uid, 0o600), lock
        assert flock_as_nobody(lock) == "PermissionError"
    assert stat.S_IMODE(lock_dir.stat().st_mode) & 0o007 == 0
