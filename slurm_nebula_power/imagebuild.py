"""`image build`: a bootable worker image (qcow2) from Debian packages, one-context from its source, and
the site's hooks.

The steps, each logged to `<output>.log`: one-context's file tree from its pinned source (one-apps'
context-linux, `generate.sh` with TARGET=deb TYPE=dir: fpm is not in Debian); a Debian root by mmdebstrap
(minbase and the worker's packages); one-context copied in and its postinstall run in a chroot; the
worker's settings (below); the site's hooks in the chroot; the disk. The image replaces the output only
when everything succeeded (one rename); the work directory, its mounts and loop devices go on every path.

The worker's settings, each for a pitfall met on a real hypervisor (docs/worker-image.md):
- systemd-networkd enabled: on Debian 12 one-context renders the network for networkd but enables nothing;
- the packaged slurmd and munge units disabled: the bootstrap starts munged with the cluster's key and
  slurmd in a unit of its own (configless, no slurm.conf in the image; Debian's slurmd.service would be
  skipped for want of one); no munge key, ssh host keys, machine-id or hostname baked in (one per VM);
- apt's daily timers disabled: nothing downloads or upgrades under jobs;
- the kernel's console on the serial port too, so a VM's boot can be read where the hypervisor logs it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .errors import ConfigError
from .imagedisk import BuildFailed, Runner, boot_files, chroot_mounts, extlinux_conf, grub_cfg, make_disk
from .imagespec import SUITES, ImageSpec, check_prerequisites

MANIFEST = "etc/slurm-nebula-power-image"
DISABLED_UNITS = ("slurmd.service", "munge.service", "apt-daily.timer", "apt-daily-upgrade.timer")
ENABLED_UNITS = ("systemd-networkd.service",)
HOOK_TIMEOUT = 3600.0


@dataclass(frozen=True)
class Built:
    """What a build made: the image, its packages' versions, the time it took."""

    output: Path
    slurmd_version: str
    one_context_version: str
    seconds: float
    log: Path

    def register_command(self, spec: ImageSpec) -> list[str]:
        """The oneimage command that registers the image in OpenNebula (virtio disk, qcow2)."""
        name = spec.name or spec.output.stem
        return ["oneimage", "create", "--name", name, "--path", str(self.output.resolve()), "--type", "OS",
                "--prefix", "vd", "--format", "qcow2", "--datastore", spec.datastore,
                "--description", f"Slurm worker: Debian {SUITES[spec.suite][0]}, slurmd {self.slurmd_version}, "
                f"one-context {self.one_context_version}"]


def controller_release(which: Callable[[str], str | None] = shutil.which) -> str | None:
    """This machine's slurmctld release (22.05), when it has one: the release the image must match."""
    slurmctld = which("slurmctld")
    if slurmctld is None:
        return None
    try:
        said = subprocess.run([slurmctld, "-V"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"(\d+)\.(\d+)\.\d+", said)
    return f"{found.group(1)}.{found.group(2)}" if found else None


def check_release(spec: ImageSpec) -> None:
    """The suite's slurmd must be the controller's release (slurmd newer than slurmctld is refused by Slurm,
    and configless needs the controller's options to mean the same). With hooks, which may install a site's
    own Slurm packages, the slurmd installed is checked instead, before the disk is made."""
    if spec.slurm_release is not None and spec.slurm_release != spec.slurm_of_suite and not spec.hooks:
        fits = [suite for suite, (_, slurm) in SUITES.items() if slurm == spec.slurm_release]
        fix = f"--suite {fits[0]}" if fits else "a suite whose slurmd is that release"
        raise ConfigError(f"the controller runs Slurm {spec.slurm_release} but {spec.suite}'s slurmd is "
                          f"{spec.slurm_of_suite}: build with {fix} (or install the site's slurmd by --hook)")


def build(spec: ImageSpec, say: Callable[[str], None] = print) -> Built:
    """Build the image; ConfigError/UsageError before anything is made, BuildFailed when a step fails."""
    check_prerequisites(spec)
    check_release(spec)
    started = time.monotonic()
    log_path = spec.output.with_name(spec.output.name + ".log")
    work = Path(tempfile.mkdtemp(prefix=f".{spec.output.name}.", dir=spec.output.parent))
    # The output's directory may be one others can write (/tmp): the log is never followed through a link.
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise ConfigError(f"cannot write the build log {log_path}: {exc.strerror}") from None
    with open(fd, "w", encoding="utf-8") as log, contextlib.ExitStack() as cleanup:
        cleanup.callback(remove_work, work)  # last: after every unmount and loop detach
        runner = Runner(log, log_path)
        say(f"building {spec.output} (Debian {SUITES[spec.suite][0]} {spec.suite}); log: {log_path}")
        tree = one_context_tree(runner, spec, work)
        root = work / "root"
        say("mmdebstrap: the Debian root (a few minutes)")
        runner.run("mmdebstrap", ["mmdebstrap", "--mode=root", "--variant=minbase",
                                  f"--components={','.join(spec.components)}", f"--include={','.join(spec.includes())}",
                                  spec.suite, str(root), spec.mirror], timeout=3600)
        say("one-context, the worker's settings and the hooks")
        root_uuid = str(uuid.uuid4())
        with chroot_mounts(runner, root):
            install_one_context(runner, tree, root)
            configure(runner, root)
            run_hooks(runner, spec, root)
            # Again after the hooks: a driver's module options (NVIDIA's nouveau blacklist), fsck of e2fsprogs.
            runner.run("the initramfs", ["chroot", str(root), "update-initramfs", "-u", "-k", "all"], timeout=600)
            efi_loader = uefi_loader(runner, root, work, root_uuid)
            slurmd = runner.output("slurmd's version", ["chroot", str(root), "dpkg-query", "-W", "-f=${Version}",
                                                        "slurmd"])
        check_slurmd(spec, slurmd)
        finish_root(root, spec, slurmd, root_uuid)
        say("the disk: ext4, extlinux, qcow2")
        qcow2 = work / "image.qcow2"
        make_disk(runner, root, work, spec.size_mb, root_uuid, qcow2, efi_loader)
        qcow2.chmod(0o644)
        os.replace(qcow2, spec.output)
        runner.note(f"done: {spec.output}")
    return Built(spec.output, slurmd, spec.one_context_version, time.monotonic() - started, log_path)


def remove_work(work: Path) -> None:
    """Remove the work directory, unless something is still mounted below it (then removing would reach
    into the build host's /dev or /proc): it is left, and said."""
    with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
        busy = [line.split()[4] for line in mounts if line.split()[4].startswith(str(work) + "/")]
    if busy:
        raise BuildFailed(f"{busy[0]} is still mounted: {work} was left; unmount it (umount -l) and remove it")
    shutil.rmtree(work, ignore_errors=True)


def one_context_tree(runner: Runner, spec: ImageSpec, work: Path) -> Path:
    """one-context's package tree (TARGET=deb TYPE=dir), from a one-apps tarball or checkout."""
    source = spec.one_context
    if source.is_file():
        with tarfile.open(source) as archive:
            archive.extractall(work / "one-apps", filter="data")
        source = work / "one-apps"
    found = [p.parent for p in (source / "generate.sh", *source.glob("context-linux/generate.sh"),
                                *source.glob("*/context-linux/generate.sh")) if p.is_file()]
    if not found:
        raise ConfigError(f"--one-context {spec.one_context}: no context-linux/generate.sh in it")
    out = work / "one-context"
    runner.run("one-context's file tree (generate.sh)", ["bash", "generate.sh"], timeout=300, cwd=found[0],
               env={"TARGET": "deb", "TYPE": "dir", "VERSION": spec.one_context_version, "RELEASE": "1",
                    "OUT": str(out)})
    if not (out / "etc" / "one-context.d").is_dir():
        raise BuildFailed(f"generate.sh wrote no etc/one-context.d under {out} (log: {runner.log_path})")
    (out / "pkg").mkdir()
    shutil.copy2(found[0] / "pkg" / "postinstall", out / "pkg" / "postinstall")
    return out


def install_one_context(runner: Runner, tree: Path, root: Path) -> None:
    """Copy the package's files into the root (as dpkg would, through merged /usr's links), then run its
    postinstall in the chroot: it enables one-context's units and resets /etc/network/interfaces."""
    for directory, _, files in os.walk(tree):
        rel = Path(directory).relative_to(tree)
        if rel.parts[:1] == ("pkg",):
            continue
        (root / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            shutil.copy2(Path(directory) / name, root / rel / name, follow_symlinks=False)
    script = root / "root" / "one-context-postinstall"
    shutil.copy2(tree / "pkg" / "postinstall", script)
    try:
        runner.run("one-context's postinstall", ["chroot", str(root), "/bin/bash", "/root/one-context-postinstall",
                                                 "configure"], timeout=300)
    finally:
        script.unlink()
    for unit in ("one-context-local", "one-context", "one-context-online"):
        wants = [d / f"{unit}.service" for d in root.glob("etc/systemd/system/*.wants")]
        if not any(os.path.lexists(link) for link in wants):  # links to /lib/...: dangling seen from here
            raise BuildFailed(f"one-context's postinstall did not enable {unit} (log: {runner.log_path})")


def configure(runner: Runner, root: Path) -> None:
    """The worker's units: networkd on, the packaged slurmd and munge off, apt's timers off."""
    def exists(unit: str) -> bool:
        return any((root / d / unit).exists() for d in ("usr/lib/systemd/system", "lib/systemd/system"))

    enable = [unit for unit in ENABLED_UNITS if exists(unit)]
    disable = [unit for unit in DISABLED_UNITS if exists(unit)]
    if enable:
        runner.run("enable units", ["chroot", str(root), "systemctl", "enable", *enable], timeout=120)
    if disable:
        runner.run("disable units", ["chroot", str(root), "systemctl", "disable", *disable], timeout=120)


def run_hooks(runner: Runner, spec: ImageSpec, root: Path) -> None:
    """Each hook, in the order given, as root in the chroot, with the build host's DNS and no daemon
    starting (policy-rc.d); IMAGE_SUITE, IMAGE_RELEASE and IMAGE_KERNEL in its environment."""
    if not spec.hooks:
        return
    policy = root / "usr/sbin/policy-rc.d"
    resolv = root / "etc/resolv.conf"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    shutil.copy2("/etc/resolv.conf", resolv)
    try:
        for index, hook in enumerate(spec.hooks):
            inside = f"/root/slurm-nebula-power-hook-{index}"
            shutil.copy2(hook, root / inside.lstrip("/"))
            try:
                runner.run(f"hook {hook}", ["chroot", str(root), inside], timeout=HOOK_TIMEOUT,
                           env={"IMAGE_SUITE": spec.suite, "IMAGE_RELEASE": SUITES[spec.suite][0],
                                "IMAGE_KERNEL": spec.kernel})
            finally:
                (root / inside.lstrip("/")).unlink(missing_ok=True)
    finally:
        policy.unlink(missing_ok=True)


def uefi_loader(runner: Runner, root: Path, work: Path, root_uuid: str) -> Path:
    """GRUB as one UEFI executable (grub-mkstandalone, in the chroot) with its configuration built in: it
    finds the root file system by its UUID and boots /vmlinuz, so kernel updates need no step."""
    (root / "root/grub.cfg").write_text(grub_cfg(root_uuid))
    try:
        runner.run("the UEFI boot loader", ["chroot", str(root), "grub-mkstandalone", "--format=x86_64-efi",
                                            "--output=/root/BOOTX64.EFI", "boot/grub/grub.cfg=/root/grub.cfg"],
                   timeout=300)
    finally:
        (root / "root/grub.cfg").unlink(missing_ok=True)
    loader = work / "BOOTX64.EFI"
    shutil.move(root / "root/BOOTX64.EFI", loader)
    return loader


def check_slurmd(spec: ImageSpec, version: str) -> None:
    """The image's slurmd, as installed, is the release the controller runs (when known)."""
    found = re.match(r"(?:\d+:)?(\d+)\.(\d+)\.", version)
    if found is None:
        raise BuildFailed(f"the image's slurmd has version {version!r}: not a Slurm version")
    release = f"{found.group(1)}.{found.group(2)}"
    if spec.slurm_release is not None and release != spec.slurm_release:
        raise BuildFailed(f"the image's slurmd is {version}, not Slurm {spec.slurm_release} as the controller "
                          "(a hook or --package changed it): nothing was written")


def finish_root(root: Path, spec: ImageSpec, slurmd: str, root_uuid: str) -> None:
    """What every VM must have of its own is removed; fstab, the boot loader's configuration, the manifest."""
    for pattern in ("etc/ssh/ssh_host_*", "var/lib/apt/lists/*_*", "var/cache/apt/archives/*.deb"):
        for path in root.glob(pattern):
            path.unlink()
    for name in ("etc/munge/munge.key", "var/lib/dbus/machine-id", "etc/hostname", "etc/resolv.conf"):
        (root / name).unlink(missing_ok=True)  # a link too (resolv.conf may be one), never followed
    (root / "etc/machine-id").write_text("")  # systemd makes one at first boot
    (root / "etc/hosts").write_text("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
    (root / "etc/fstab").write_text(f"UUID={root_uuid}\t/\text4\terrors=remount-ro\t0\t1\n")
    kernel = boot_files(root)
    (root / "boot/extlinux").mkdir(parents=True, exist_ok=True)
    (root / "boot/extlinux/extlinux.conf").write_text(extlinux_conf(root_uuid))
    (root / MANIFEST).write_text(
        f"BUILDER=slurm-nebula-power {__version__}\nBUILT={time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
        f"DEBIAN={SUITES[spec.suite][0]}\nSUITE={spec.suite}\nKERNEL={kernel}\n"
        f"SLURMD={slurmd}\nONE_CONTEXT={spec.one_context_version}\n"
        f"PACKAGES={' '.join(spec.packages)}\nHOOKS={' '.join(p.name for p in spec.hooks)}\n")
