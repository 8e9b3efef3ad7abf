"""files.py: what the programs open in directories others can write (issue 22, items 2, 4 and 7)."""

from __future__ import annotations

import os
import stat

import pytest

from slurm_nebula_power import files
from slurm_nebula_power.files import UnsafeFile, open_file, read_capped, replace


def test_replace_gives_the_file_its_mode_before_the_rename(tmp_path, monkeypatch) -> None:
    # Before: the metrics file was renamed into place and then chmod'ed by path, a race whose loser is
    # whatever another user swapped in at that path
    target = tmp_path / "m.prom"
    seen = []
    real = os.replace

    def watching(src, dst):
        info = os.stat(src)
        seen.append((stat.S_IMODE(info.st_mode), info.st_nlink))
        real(src, dst)

    monkeypatch.setattr(files.os, "replace", watching)
    replace(target, b"data\n", 0o644)
    assert seen == [(0o644, 1)] and target.read_bytes() == b"data\n"
    assert [p.name for p in tmp_path.iterdir()] == ["m.prom"], "no temporary file left"


def test_replace_puts_a_regular_file_where_a_symlink_was_and_leaves_its_target_alone(tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    victim.chmod(0o600)
    (tmp_path / "m.prom").symlink_to(victim)
    replace(tmp_path / "m.prom", b"new", 0o644)
    assert not (tmp_path / "m.prom").is_symlink() and victim.read_text() == "keep"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600


@pytest.mark.parametrize("plant", ["symlink", "dangling", "fifo", "hardlink", "directory"])
def test_open_file_refuses_what_was_planted_and_creates_nothing_through_it(tmp_path, plant: str) -> None:
    path = tmp_path / "planted"  # not named like a log: the secrets scan reads every *.jsonl it finds
    victim = tmp_path / "victim"
    if plant in ("symlink", "hardlink"):
        victim.write_text("secret")
    if plant in ("symlink", "dangling"):
        path.symlink_to(victim)
    elif plant == "fifo":
        os.mkfifo(path)
    elif plant == "hardlink":
        os.link(victim, path)
    else:
        path.mkdir()
    for flags in (os.O_RDONLY, os.O_WRONLY | os.O_APPEND | os.O_CREAT):
        with pytest.raises(UnsafeFile) as refused:
            open_file(path, flags)
        assert str(path) in str(refused.value) and "remove it" in str(refused.value)
    assert victim.exists() == (plant in ("symlink", "hardlink")), "nothing created through a link"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another user")
def test_open_file_refuses_another_users_file_and_gives_what_root_creates_to_the_owner(tmp_path) -> None:
    theirs = tmp_path / "theirs"
    theirs.write_text("")
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UnsafeFile, match="not to this program's user or root"):
        open_file(theirs, os.O_RDONLY)
    fd = open_file(theirs, os.O_RDONLY, owner=(65534, 65534))  # the service owner's file is ours to use
    os.close(fd)
    home = tmp_path / "theirs.d"  # and so is a file of the owner of its directory (who may replace it anyway)
    home.mkdir()
    (home / "log").write_text("")
    for path in (home, home / "log"):
        os.chown(path, 65534, 65534)
    os.close(open_file(home / "log", os.O_WRONLY | os.O_APPEND))
    fd = open_file(tmp_path / "new", os.O_WRONLY | os.O_CREAT, 0o640, owner=(65534, 65534), exact_mode=True)
    info = os.fstat(fd)
    os.close(fd)
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (65534, 65534, 0o640)


def test_read_capped_reads_at_most_its_cap(tmp_path) -> None:
    path = tmp_path / "state.json"
    assert read_capped(path, 10) is None
    path.write_bytes(b"x" * 10)
    assert read_capped(path, 10) == b"x" * 10
    path.write_bytes(b"x" * 11)
    with pytest.raises(UnsafeFile, match="larger than 10 bytes"):
        read_capped(path, 10)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the chown of a directory a root run makes")
@pytest.mark.parametrize("made_by", ["lock directory", "shortage state", "log directory"])
def test_a_directory_swapped_for_a_link_after_its_mkdir_gives_the_link_s_target_to_nobody(tmp_path, monkeypatch,
                                                                                         made_by: str) -> None:
    # issue 22 item 4's variant for directories: a root run made lock_dir (or the log's directory) and then
    # chowned it to SlurmUser by path; a SlurmUser who swaps the new directory for a link in between (its
    # parent, /var/lib/slurm or /var/log/slurm, is SlurmUser's) is given the link's target: /etc/shadow.
    # The race is won here every time: mkdir is followed at once by the swap. (The log's directory is made
    # by files.make_directory in cli/common.setup_logging.)
    from slurm_nebula_power.cooldown import ShortageLog
    from slurm_nebula_power.locks import NodeLocks

    victim = tmp_path / "shadow"
    victim.write_text("root:x:0:0\n")
    victim.chmod(0o600)
    target = tmp_path / "parent" / "made"
    real = os.mkdir

    def swapped(path, mode=0o777, *args, **kwargs):
        real(path, mode, *args, **kwargs)
        if os.fspath(path) == os.fspath(target):
            os.rename(path, f"{path}.moved")
            os.symlink(victim, path)

    monkeypatch.setattr(os, "mkdir", swapped)
    slurm = (65534, 65534)
    if made_by == "lock directory":
        with pytest.raises(Exception, match="replaced while it was made"), \
                NodeLocks(target, ["gpu01"], wait=0, owner=slurm):
            pass
    elif made_by == "shortage state":
        ShortageLog(target, owner=slurm).record("gpu[01-02]", "count", 0, "short", [])  # logged, never raised
    else:
        with pytest.raises(UnsafeFile, match="replaced while it was made"):
            files.make_directory(target, slurm)
    info = victim.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o600), "the link's target stays root's"
