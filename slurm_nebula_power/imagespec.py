"""What `image build` is asked for, checked before anything is made: options, prerequisites, the output.

Everything a build needs is checked here first (root, the tools and which Debian package brings each, the
one-context source, the hooks, the output path), so a build that starts has what it needs, and a refusal
changes nothing on disk.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, UsageError

# Debian suites the builder knows: suite -> (release, Slurm release of its slurmd package). The Slurm
# release is what the image's slurmd will be, so the controller must run the same one (or a newer one).
SUITES = {"bookworm": ("12", "22.05"), "trixie": ("13", "24.11")}
KERNELS = {"generic": "linux-image-amd64", "cloud": "linux-image-cloud-amd64"}
COMPONENTS = ("main", "contrib", "non-free", "non-free-firmware")
# What every worker image holds: systemd and udev (one-context's units and rules), the kernel's initramfs,
# ifupdown and iproute2 (one-context's network renderers), the bootstrap's needs (curl, munge, slurmd), the
# one-context package's own dependencies (bash, bind9-host, cloud-guest-utils, parted, ruby for the onegate
# command, sudo, passwd, dbus, openssh-server, qemu-guest-agent, gawk, virt-what), chrony for the clock
# (munge credentials and Slurm need it), e2fsprogs and fdisk (one-context grows the root filesystem),
# grub-efi-amd64-bin (the UEFI boot loader is made from it, in the image).
BASE_PACKAGES = ("systemd-sysv", "udev", "dbus", "initramfs-tools", "ifupdown", "iproute2", "curl",
                 "ca-certificates", "slurmd", "munge", "chrony", "bash", "bind9-host", "cloud-guest-utils",
                 "parted", "ruby", "sudo", "passwd", "openssh-server", "qemu-guest-agent", "gawk", "virt-what",
                 "e2fsprogs", "fdisk", "procps", "util-linux", "less", "grub-efi-amd64-bin")
# tool -> the Debian package that brings it
TOOLS = {"mmdebstrap": "mmdebstrap", "qemu-img": "qemu-utils", "extlinux": "extlinux", "sfdisk": "fdisk",
         "mkfs.vfat": "dosfstools", "mcopy": "mtools", "mmd": "mtools",
         "mkfs.ext4": "e2fsprogs", "losetup": "mount", "mount": "mount", "umount": "mount", "chroot": "coreutils",
         "bash": "bash"}
FILES = {"/usr/lib/EXTLINUX/mbr.bin": "extlinux"}
PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+~:-]+)?$")
MIRROR = re.compile(r"^(https?|file)://[A-Za-z0-9._~:/?#@!$&'()*+,;=%-]+$")
ONE_CONTEXT_TARBALL = re.compile(r"v?(\d+\.\d+\.\d+)")
SIZE = re.compile(r"^(\d+)([GM])$")
MIN_SIZE_MB = 1024


@dataclass(frozen=True)
class ImageSpec:
    """One image build, as asked on the command line."""

    suite: str
    output: Path
    one_context: Path
    one_context_version: str
    packages: tuple[str, ...] = ()
    hooks: tuple[Path, ...] = ()
    size_mb: int = 4096
    kernel: str = "generic"
    components: tuple[str, ...] = ("main",)
    mirror: str = "http://deb.debian.org/debian"
    slurm_release: str | None = None
    force: bool = False
    name: str = ""
    datastore: str = "default"

    @property
    def slurm_of_suite(self) -> str:
        """The Slurm release of the suite's slurmd."""
        return SUITES[self.suite][1]

    def includes(self) -> list[str]:
        """Every package mmdebstrap installs."""
        return [*BASE_PACKAGES, KERNELS[self.kernel], *self.packages]


def suite_of(text: str) -> str:
    """bookworm, trixie, 12, 13 or debian-12 -> the suite name."""
    value = text.strip().lower().removeprefix("debian-").removeprefix("debian")
    for suite, (release, _) in SUITES.items():
        if value in (suite, release):
            return suite
    raise UsageError(f"--suite {text}: not a Debian suite this builder knows; one of "
                     + ", ".join(f"{s} ({r})" for s, (r, _) in SUITES.items()))


def size_of(text: str) -> int:
    """'4G' or '2048M' -> megabytes, at least MIN_SIZE_MB."""
    found = SIZE.match(text.strip().upper())
    if not found:
        raise UsageError(f"--size {text}: give a size like 4G or 3072M")
    mb = int(found.group(1)) * (1024 if found.group(2) == "G" else 1)
    if mb < MIN_SIZE_MB or mb > 1024 * 1024:
        raise UsageError(f"--size {text}: between 1G and 1024G (one-context grows the root filesystem to "
                         "the VM's disk at boot, so a small image is fine)")
    return mb


def package_names(values: list[str]) -> tuple[str, ...]:
    """--package values (comma or blank separated) as Debian package names, each checked."""
    names = [name for value in values for name in re.split(r"[,\s]+", value) if name]
    bad = [name for name in names if not PACKAGE.match(name)]
    if bad:
        raise UsageError(f"--package {bad[0]!r}: not a Debian package name (name or name=version)")
    return tuple(names)


def components_of(text: str) -> tuple[str, ...]:
    """--components main,contrib,... checked against Debian's archive areas."""
    names = tuple(name for name in text.split(",") if name)
    bad = [name for name in names if name not in COMPONENTS]
    if bad or "main" not in names:
        raise UsageError(f"--components {text}: a comma-separated list of {', '.join(COMPONENTS)}, main included")
    return names


def mirror_of(text: str) -> str:
    """--mirror: an http(s) or file URL of a Debian archive."""
    if not MIRROR.match(text):
        raise UsageError(f"--mirror {text!r}: give the URL of a Debian archive, e.g. http://deb.debian.org/debian")
    return text


def one_context_version(source: Path, given: str | None) -> str:
    """The one-context version: --one-context-version, else from the tarball's name (v7.2.1)."""
    if not source.exists():
        raise ConfigError(f"--one-context {source}: no such file; give a tarball of OpenNebula's one-apps at a "
                          "release tag (git archive), or a checkout of it")
    if given:
        if not re.match(r"^\d+\.\d+\.\d+$", given):
            raise UsageError(f"--one-context-version {given}: a version like 7.2.1")
        return given
    found = ONE_CONTEXT_TARBALL.search(source.name)
    if not found:
        raise UsageError(f"--one-context {source}: cannot tell its version from the name; give "
                         "--one-context-version")
    return found.group(1)


def check_prerequisites(spec: ImageSpec, euid: int | None = None, which: object = shutil.which) -> None:
    """Refuse, before anything is made, what would fail later: not root, a missing tool (named with its
    Debian package), an unusable one-context source or hook, an output that exists or cannot be written."""
    if (os.geteuid() if euid is None else euid) != 0:
        raise ConfigError("image build must run as root (mmdebstrap, loop devices, mounts, chroot)")
    missing = sorted({pkg for tool, pkg in TOOLS.items() if which(tool) is None}  # type: ignore[operator]
                     | {pkg for path, pkg in FILES.items() if not Path(path).exists()})
    if missing:
        raise ConfigError(f"image build needs {', '.join(missing)}: apt-get install {' '.join(missing)}")
    check_output(spec)
    check_one_context(spec.one_context)
    for hook in spec.hooks:
        check_hook(hook)


def check_output(spec: ImageSpec) -> None:
    """The output's directory exists and is writable; an existing output only with --force."""
    out = spec.output
    if out.is_dir():
        raise UsageError(f"--output {out} is a directory: give the image's file name, e.g. {out}/worker.qcow2")
    if (out.exists() or out.is_symlink()) and not spec.force:
        raise UsageError(f"{out} exists: give another --output, or --force to replace it")
    if out.is_symlink():
        raise UsageError(f"{out} is a symbolic link: give the image's own path")
    parent = out.parent
    if not parent.is_dir():
        raise UsageError(f"{parent} does not exist: create it, or give another --output")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"cannot write in {parent}: give another --output")


def check_one_context(source: Path) -> None:
    """A one-apps tarball (or checkout) holding context-linux/generate.sh."""
    if source.is_dir():
        if not ((source / "context-linux" / "generate.sh").is_file() or (source / "generate.sh").is_file()):
            raise ConfigError(f"--one-context {source}: no context-linux/generate.sh in it; give a checkout of "
                              "OpenNebula's one-apps at a release tag, or its tarball")
        return
    if not source.is_file():
        raise ConfigError(f"--one-context {source}: no such file; give a tarball of OpenNebula's one-apps at a "
                          "release tag (git archive), or a checkout of it")
    try:
        with tarfile.open(source) as archive:
            if not any(name.endswith("context-linux/generate.sh") for name in archive.getnames()):
                raise ConfigError(f"--one-context {source}: the tarball holds no context-linux/generate.sh")
    except (tarfile.TarError, OSError) as exc:
        raise ConfigError(f"--one-context {source}: not a readable tarball ({exc})") from None


def check_hook(hook: Path) -> None:
    """A hook runs as root in the image: a regular executable file of root's that nobody else can write,
    in a directory nobody else can write (no one may swap it between this check and its run)."""
    try:
        info = hook.lstat()
    except OSError:
        raise ConfigError(f"--hook {hook}: no such file") from None
    if not stat.S_ISREG(info.st_mode) or not info.st_mode & stat.S_IXUSR:
        raise ConfigError(f"--hook {hook}: not an executable regular file: chmod 755 it (no symbolic link)")
    for path, what in ((hook, "the hook"), (hook.resolve().parent, "its directory")):
        st = path.lstat()
        if st.st_uid != 0 or st.st_mode & 0o022:
            raise ConfigError(f"--hook {hook}: {what} is owned by uid {st.st_uid} or writable by others, and the "
                              "hook runs as root in the image: make it root's, mode 755 at most")
