"""`slurm-nebula-power image build`: a worker image (qcow2) from Debian packages, and how to register it."""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from .. import __version__
from ..errors import EXIT_INTERNAL, EXIT_OK, PowerError, UsageError
from ..imagebuild import build, controller_release
from ..imagedisk import BuildFailed
from ..imagespec import (
    KERNELS,
    SUITES,
    ImageSpec,
    components_of,
    mirror_of,
    one_context_version,
    package_names,
    size_of,
    suite_of,
)
from .args import parse
from .common import report_error

PROG = "slurm-nebula-power image"
EPILOG = """\
The image: Debian (minbase) with the kernel, systemd, slurmd of the controller's Slurm release, munge,
chrony, curl, one-context from the given one-apps source (with its postinstall), systemd-networkd enabled,
the packaged slurmd and munge units and apt's timers disabled; no munge key, ssh host keys or machine-id
(one per VM). Hooks run as root in the image (chroot) after the packages: the GPU driver, LDAP/SSSD, mounts.
It prints the oneimage command that registers the image. Runs as root. See docs/worker-image.md.

exit: 0 built, 1 a step failed (named, with its log), 2 usage (or the output exists: --force),
3 a prerequisite is missing (root, a tool, the one-context source, a hook, the Slurm release), 4 internal"""


def parser() -> argparse.ArgumentParser:
    """The image command's options."""
    top = argparse.ArgumentParser(prog=PROG, description="Build the worker image.")
    top.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = top.add_subparsers(dest="command", metavar="build", required=True)
    p = commands.add_parser("build", prog=f"{PROG} build", epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            description="Build a bootable worker image (qcow2) from Debian packages.")
    p.add_argument("--one-context", metavar="PATH", required=True, type=Path,
                   help="OpenNebula's one-apps at a release tag: a tarball (git archive) or a checkout, holding "
                        "context-linux/ (6.10.0 or later)")
    p.add_argument("--one-context-version", metavar="X.Y.Z",
                   help="its version (default: from the tarball's name, e.g. ...-v7.2.1.tar.gz)")
    p.add_argument("--suite", help="Debian suite: " + ", ".join(f"{s} ({r}, Slurm {v})" for s, (r, v) in
                   SUITES.items()) + "; default: the one whose slurmd is this machine's slurmctld release")
    p.add_argument("--slurm-release", metavar="X.Y", help="the controller's Slurm release, which the image's "
                   "slurmd must have (default: this machine's slurmctld -V, if it has one)")
    p.add_argument("-o", "--output", metavar="FILE", type=Path,
                   help="the image (default: ./slurm-worker-debianN.qcow2); its build log is FILE.log")
    p.add_argument("--force", action="store_true", help="replace an existing output")
    p.add_argument("--package", action="append", default=[], metavar="NAME",
                   help="more Debian packages (repeatable, or comma-separated), e.g. sssd-ldap,nfs-common")
    p.add_argument("--components", default="main", help="archive areas, e.g. main,contrib,non-free,"
                   "non-free-firmware for Debian's NVIDIA driver (default: main)")
    p.add_argument("--hook", action="append", default=[], metavar="EXE", type=Path,
                   help="an executable run as root in the image after the packages (repeatable, in order); "
                        "owned by root and writable by nobody else")
    p.add_argument("--kernel", choices=sorted(KERNELS), default="generic",
                   help="generic: every driver (AHCI for q35's context CD, GPUs); cloud: smaller, virtio only, "
                        "boots faster, machine type pc only (default: generic)")
    p.add_argument("--size", default="4G", help="the disk's virtual size, e.g. 4G or 3072M (one-context grows "
                   "the root file system to the VM's disk; default: 4G)")
    p.add_argument("--mirror", default="http://deb.debian.org/debian", help="the Debian archive")
    p.add_argument("--name", help="the image's name in the printed oneimage command (default: FILE's stem)")
    p.add_argument("--datastore", default="default", help="the image datastore in the printed oneimage command")
    return top


def default_output(suite: str) -> Path:
    """The image's file when -o is not given; its stem is the name the printed oneimage command gives it."""
    return Path(f"slurm-worker-debian{SUITES[suite][0]}.qcow2")


def spec_of(args: argparse.Namespace) -> ImageSpec:
    """The command line as an ImageSpec; UsageError for a bad value."""
    release = args.slurm_release or controller_release()
    if args.slurm_release and not re.match(r"^\d+\.\d+$", args.slurm_release):
        raise UsageError(f"--slurm-release {args.slurm_release}: a release like 22.05")
    if args.suite:
        suite = suite_of(args.suite)
    else:
        fits = [s for s, (_, slurm) in SUITES.items() if slurm == release]
        if not fits:
            raise UsageError("give --suite: " + (f"no suite known here has Slurm {release}" if release else
                                                 "this machine has no slurmctld whose release it could match"))
        suite = fits[0]
    output = args.output or default_output(suite)
    return ImageSpec(suite=suite, output=output.absolute(), one_context=args.one_context.absolute(),
                     one_context_version=one_context_version(args.one_context, args.one_context_version),
                     packages=package_names(args.package), hooks=tuple(h.absolute() for h in args.hook),
                     size_mb=size_of(args.size), kernel=args.kernel, components=components_of(args.components),
                     mirror=mirror_of(args.mirror), slurm_release=release, force=args.force,
                     name=args.name or "", datastore=args.datastore)


def _interrupted(signum: int, frame: FrameType | None) -> None:
    raise BuildFailed(f"interrupted by signal {signum}: nothing was written, the work directory was removed")


def main(argv: Sequence[str] | None = None) -> int:
    """slurm-nebula-power image build."""
    args = parse(parser(), argv)
    if isinstance(args, int):
        return args
    try:
        spec = spec_of(args)
        previous = signal.signal(signal.SIGTERM, _interrupted)
        try:
            built = build(spec, say=lambda text: print(f"{PROG}: {text}", file=sys.stderr, flush=True))
        except KeyboardInterrupt:
            raise BuildFailed("interrupted: nothing was written, the work directory was removed") from None
        finally:
            signal.signal(signal.SIGTERM, previous)
    except PowerError as exc:
        report_error(f"{PROG} build", str(exc), quiet=True)
        return exc.exit_code
    except OSError as exc:
        report_error(f"{PROG} build", f"{exc.filename or ''}: {exc.strerror}", quiet=True)
        return EXIT_INTERNAL
    print(f"{PROG}: built {built.output} in {built.seconds:.0f} s: slurmd {built.slurmd_version}, one-context "
          f"{built.one_context_version}; register it with:", file=sys.stderr)
    print(shlex.join(built.register_command(spec)))
    return EXIT_OK
