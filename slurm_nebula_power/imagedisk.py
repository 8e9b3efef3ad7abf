"""The image builder's steps that touch the machine: commands with a log and a time bound, the chroot's
mounts, and the disk (a raw file with one MBR partition, ext4 filled from the root tree, extlinux, then a
compressed qcow2). Every mount and loop device is undone by the ExitStack that made it, on every exit path.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

from .errors import EXIT_NODES_FAILED, PowerError

MBR = Path("/usr/lib/EXTLINUX/mbr.bin")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PARTITION_START = 1024 * 1024  # 1 MiB: the first partition's first byte (sector 2048)
ESP_MB = 64  # the EFI system partition: the standalone GRUB is about 10 MiB


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


def make_disk(runner: Runner, root: Path, work: Path, size_mb: int, root_uuid: str, qcow2: Path,
              efi_loader: Path) -> None:
    """root -> a compressed qcow2 of size_mb that boots by BIOS and by UEFI: an MBR with an EFI system
    partition (GRUB, standalone: BOOTX64.EFI) and the root partition (ext4, extlinux, active)."""
    raw = work / "disk.raw"
    with open(raw, "wb") as file:
        file.truncate(size_mb * 1024 * 1024)
    esp_start, esp_size = PARTITION_START, ESP_MB * 1024 * 1024
    root_start = esp_start + esp_size
    runner.run("partition the disk", ["sfdisk", "--quiet", str(raw)], timeout=60,
               stdin=f"label: dos\nstart=2048, size={ESP_MB}MiB, type=ef\nstart={root_start // 512}, type=83, "
                     "bootable\n".encode())
    mnt = work / "mnt"
    mnt.mkdir()
    with loop_device(runner, raw, esp_start, esp_size) as device:
        runner.run("make the EFI system partition", ["mkfs.vfat", "-F", "32", "-n", "EFI", device], timeout=120)
        # mtools writes FAT without mounting it (a build host's kernel may have no vfat).
        runner.run("the EFI directory", ["mmd", "-i", device, "::/EFI", "::/EFI/BOOT"], timeout=60)
        runner.run("the UEFI boot loader onto the EFI system partition",
                   ["mcopy", "-i", device, str(efi_loader), "::/EFI/BOOT/BOOTX64.EFI"], timeout=120)
    with loop_device(runner, raw, root_start, size_mb * 1024 * 1024 - root_start) as device:
        # -d fills the file system from the tree; no 64bit feature (extlinux reads the file system itself).
        runner.run("make the file system", ["mkfs.ext4", "-q", "-L", "root", "-U", root_uuid, "-O", "^64bit",
                                            "-d", str(root), device], timeout=1800)
        with mounted(runner, ["mount", device], mnt):
            runner.run("install extlinux", ["extlinux", "--install", str(mnt / "boot" / "extlinux")], timeout=120)
    with open(raw, "r+b") as disk, open(MBR, "rb") as mbr:
        disk.write(mbr.read(440))  # the boot code only: the partition table stays
    runner.run("convert to qcow2", ["qemu-img", "convert", "-c", "-O", "qcow2", str(raw), str(qcow2)], timeout=3600)
    raw.unlink()


KERNEL_ARGS = "ro console=tty0 console=ttyS0,115200n8 net.ifnames=0 biosdevname=0"


def extlinux_conf(root_uuid: str) -> str:
    """/boot/extlinux/extlinux.conf (BIOS): Debian's /vmlinuz and /initrd.img links follow kernel updates;
    the serial console too, so the VM's boot can be read where the hypervisor logs it."""
    return (f"DEFAULT linux\nTIMEOUT 1\nPROMPT 0\nLABEL linux\n  LINUX /vmlinuz\n  INITRD /initrd.img\n"
            f"  APPEND root=UUID={root_uuid} {KERNEL_ARGS}\n")


def grub_cfg(root_uuid: str) -> str:
    """The configuration built into the UEFI loader: the same kernel, found by the root's UUID."""
    return (f"search --no-floppy --fs-uuid --set=root {root_uuid}\nset timeout=0\n"
            f"linux /vmlinuz root=UUID={root_uuid} {KERNEL_ARGS}\ninitrd /initrd.img\nboot\n")


def boot_files(root: Path) -> str:
    """The kernel version Debian's /vmlinuz and /initrd.img links (what both boot loaders load) point at."""
    found = []
    for link in ("vmlinuz", "initrd.img"):
        target = os.readlink(root / link) if os.path.islink(root / link) else ""
        if not target or not (root / target.lstrip("/")).is_file():
            raise BuildFailed(f"the image has no /{link} link to a file in /boot: the kernel or initramfs-tools "
                              "did not install")
        found.append(target.rsplit("/", 1)[-1].split("-", 1)[1])
    if found[0] != found[1]:
        raise BuildFailed(f"/vmlinuz is {found[0]} but /initrd.img is {found[1]}: update-initramfs did not run")
    return found[0]
