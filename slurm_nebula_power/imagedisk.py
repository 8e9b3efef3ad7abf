"""The image builder's steps that touch the machine: commands with a log and a time bound, the chroot's
mounts, and the disk (a raw file with one MBR partition, ext4 filled from the root tree, extlinux, then a
compressed qcow2). Every mount and loop device is undone by the ExitStack that made it, on every exit path.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

from .errors import EXIT_NODES_FAILED, PowerError

MBR = Path("/usr/lib/EXTLINUX/mbr.bin")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PARTITION_START = 1024 * 1024  # 1 MiB: the partition's first byte (sector 2048)


class BuildFailed(PowerError):
    """A step of the build failed; the message names the step and the log. Exit 1: the work failed."""

    exit_code = EXIT_NODES_FAILED


class Runner:
    """Runs the build's commands (argument lists, never a shell), each with a wall-clock bound, their
    output appended to the build log; a failure is a BuildFailed naming the step and the log's tail."""

    def __init__(self, log: IO[str], log_path: Path) -> None:
        self.log, self.log_path = log, log_path

    def note(self, text: str) -> None:
        """One line in the build log."""
        self.log.write(f"==> {time.strftime('%H:%M:%S')} {text}\n")
        self.log.flush()

    def run(self, step: str, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
            stdin: bytes | None = None, cwd: Path | None = None) -> None:
        """Run argv for `step`; BuildFailed when it fails or outlives `timeout` seconds."""
        self.note(f"{step}: {' '.join(argv)}")
        environ = {"PATH": PATH, "LANG": "C.UTF-8", "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive",
                   **(env or {})}
        try:
            done = subprocess.run(list(argv), input=stdin, stdout=self.log, stderr=subprocess.STDOUT,
                                  env=environ, cwd=cwd, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise BuildFailed(f"{step}: no end after {timeout:.0f} s (log: {self.log_path})") from None
        except OSError as exc:
            raise BuildFailed(f"{step}: cannot run {argv[0]}: {exc.strerror} (log: {self.log_path})") from None
        if done.returncode != 0:
            raise BuildFailed(f"{step}: {argv[0]} exited with {done.returncode}: {self.tail()} "
                              f"(log: {self.log_path})")

    def output(self, step: str, argv: Sequence[str], timeout: float = 60) -> str:
        """Run argv and return its standard output (short commands: versions, a loop device's name)."""
        self.note(f"{step}: {' '.join(argv)}")
        try:
            done = subprocess.run(list(argv), capture_output=True, text=True, env={"PATH": PATH, "LANG": "C.UTF-8"},
                                  timeout=timeout, check=False)
        except (subprocess.TimeoutExpired, OSError) as exc:
            raise BuildFailed(f"{step}: {argv[0]} failed: {exc} (log: {self.log_path})") from None
        self.log.write(done.stderr)
        if done.returncode != 0:
            raise BuildFailed(f"{step}: {argv[0]} exited with {done.returncode}: {done.stderr.strip()[-300:]}")
        return done.stdout.strip()

    def tail(self) -> str:
        """The log's last lines that say something, joined on one line."""
        self.log.flush()
        try:
            lines = [line.strip() for line in self.log_path.read_text(errors="replace").splitlines()[-40:]]
        except OSError:
            return ""
        said = [line for line in lines if line and not line.startswith("==>")][-3:]
        return " | ".join(said)[-400:]


def unmount(runner: Runner, target: Path) -> None:
    """Undo one mount; a lazy unmount if it is busy (a hook left a process behind)."""
    try:
        runner.run(f"unmount {target}", ["umount", str(target)], timeout=60)
    except BuildFailed:
        with contextlib.suppress(BuildFailed):
            runner.run(f"unmount {target} (lazy)", ["umount", "-l", str(target)], timeout=60)


@contextlib.contextmanager
def mounted(runner: Runner, argv: Sequence[str], target: Path) -> Iterator[Path]:
    """mount argv... target for the block, unmounted whatever happens in it."""
    runner.run(f"mount {target}", [*argv, str(target)], timeout=60)
    try:
        yield target
    finally:
        unmount(runner, target)


@contextlib.contextmanager
def chroot_mounts(runner: Runner, root: Path) -> Iterator[Path]:
    """/proc, /sys, /dev and /dev/pts of the build host in the root tree, for commands run in it."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mounted(runner, ["mount", "-t", "proc", "proc"], root / "proc"))
        stack.enter_context(mounted(runner, ["mount", "-t", "sysfs", "sysfs"], root / "sys"))
        stack.enter_context(mounted(runner, ["mount", "--bind", "/dev"], root / "dev"))
        stack.enter_context(mounted(runner, ["mount", "--bind", "/dev/pts"], root / "dev/pts"))
        yield root


@contextlib.contextmanager
def loop_device(runner: Runner, raw: Path, offset: int, size: int) -> Iterator[str]:
    """The partition of `raw` as a loop device (offset and size: no partition nodes without udev)."""
    device = runner.output("attach the partition", ["losetup", "--find", "--show", "--offset", str(offset),
                                                    "--sizelimit", str(size), str(raw)])
    try:
        yield device
    finally:
        with contextlib.suppress(BuildFailed):
            runner.run(f"detach {device}", ["losetup", "--detach", device], timeout=60)


def make_disk(runner: Runner, root: Path, work: Path, size_mb: int, root_uuid: str, qcow2: Path) -> None:
    """root -> a bootable compressed qcow2 of size_mb: MBR + one ext4 partition + extlinux."""
    raw = work / "disk.raw"
    with open(raw, "wb") as file:
        file.truncate(size_mb * 1024 * 1024)
    # One bootable Linux partition from 1 MiB to the end.
    runner.run("partition the disk", ["sfdisk", "--quiet", str(raw)], timeout=60,
               stdin=b"label: dos\nstart=2048, type=83, bootable\n")
    size = size_mb * 1024 * 1024 - PARTITION_START
    with loop_device(runner, raw, PARTITION_START, size) as device:
        # -d fills the file system from the tree; no 64bit feature (extlinux reads the file system itself).
        runner.run("make the file system", ["mkfs.ext4", "-q", "-L", "root", "-U", root_uuid, "-O", "^64bit",
                                            "-d", str(root), device], timeout=1800)
        mnt = work / "mnt"
        mnt.mkdir()
        with mounted(runner, ["mount", device], mnt):
            runner.run("install extlinux", ["extlinux", "--install", str(mnt / "boot" / "extlinux")], timeout=120)
    with open(raw, "r+b") as disk, open(MBR, "rb") as mbr:
        disk.write(mbr.read(440))  # the boot code only: the partition table stays
    runner.run("convert to qcow2", ["qemu-img", "convert", "-c", "-O", "qcow2", str(raw), str(qcow2)], timeout=3600)
    raw.unlink()


def extlinux_conf(kernel: str, initrd: str, root_uuid: str) -> str:
    """/boot/extlinux/extlinux.conf: the serial console too, so the VM's boot can be read from its log."""
    return (
        "DEFAULT linux\nTIMEOUT 1\nPROMPT 0\n"
        "LABEL linux\n"
        f"  LINUX /boot/{kernel}\n"
        f"  INITRD /boot/{initrd}\n"
        f"  APPEND root=UUID={root_uuid} ro console=tty0 console=ttyS0,115200n8 net.ifnames=0 biosdevname=0\n"
    )


def boot_files(root: Path) -> tuple[str, str]:
    """The names of the newest kernel and initramfs under root/boot."""
    kernels = sorted(p.name for p in (root / "boot").glob("vmlinuz-*"))
    if not kernels:
        raise BuildFailed("no kernel in the image's /boot: the kernel package did not install")
    version = kernels[-1].removeprefix("vmlinuz-")
    initrd = f"initrd.img-{version}"
    if not (root / "boot" / initrd).exists():
        raise BuildFailed(f"no {initrd} in the image's /boot: initramfs-tools did not run")
    return kernels[-1], initrd
