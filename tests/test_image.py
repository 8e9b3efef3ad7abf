"""`slurm-nebula-power image build`: what it refuses before making anything, and what the image it made holds.

The refusals run anywhere in milliseconds (no mmdebstrap). The image's contents are read from the image the
builder made for the boot test (tests/kvm/image.sh, cached by its inputs), mounted read-only from a raw copy:
marked `kvm`, they run where that image is built (tests/setup-and-run.sh, after the build).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from slurm_nebula_power.cli import image as image_cmd
from slurm_nebula_power.errors import EXIT_CONFIG, EXIT_USAGE, ConfigError
from slurm_nebula_power.imagespec import ImageSpec, check_prerequisites

HERE = Path(__file__).resolve().parent
ONE_APPS = HERE.parent.parent / "shared" / "one-apps" / "one-apps-context-linux-v7.2.1.tar.gz"


def build(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = image_cmd.main(["build", *argv])
    return code, err.getvalue()


@pytest.fixture
def source(tmp_path) -> Path:
    """A one-apps checkout as far as the checks look: context-linux/generate.sh."""
    (tmp_path / "one-apps" / "context-linux").mkdir(parents=True)
    (tmp_path / "one-apps" / "context-linux" / "generate.sh").write_text("#!/bin/bash\n")
    return tmp_path / "one-apps"


@pytest.mark.parametrize(("args", "said"), [
    (["--suite", "buster"], "--suite buster: not a Debian suite this builder knows"),
    (["--suite", "bookworm", "--size", "lots"], "--size lots: give a size like 4G"),
    (["--suite", "bookworm", "--size", "100M"], "between 1G and 1024G"),
    (["--suite", "bookworm", "--package", "nvidia driver;rm"], "not a Debian package name"),
    (["--suite", "bookworm", "--components", "contrib"], "main included"),
    (["--suite", "bookworm", "--mirror", "ftp://x y"], "the URL of a Debian archive"),
    (["--suite", "bookworm", "--slurm-release", "22"], "a release like 22.05"),
    (["--suite", "bookworm", "--one-context-version", "latest"], "a version like 7.2.1"),
])
def test_a_bad_option_is_one_line_and_exit_2(args, said, source, tmp_path) -> None:
    code, err = build("--one-context", str(source), "--one-context-version", "7.2.1", *args,
                      "-o", str(tmp_path / "w.qcow2"))
    assert code == EXIT_USAGE, err
    assert said in err and err.count("\n") == 1, err
    assert not (tmp_path / "w.qcow2").exists()


def test_an_existing_output_is_refused_without_force_and_left_alone(source, tmp_path) -> None:
    out = tmp_path / "worker.qcow2"
    out.write_bytes(b"the site's image")
    code, err = build("--one-context", str(source), "--one-context-version", "7.2.1", "--suite", "bookworm",
                      "--slurm-release", "22.05", "-o", str(out))
    assert code == EXIT_USAGE
    assert "exists: give another --output, or --force to replace it" in err
    assert out.read_bytes() == b"the site's image"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one-apps", "worker.qcow2"]  # no log, no work dir


def test_a_suite_whose_slurmd_is_not_the_controllers_release_is_refused_before_building(source, tmp_path) -> None:
    code, err = build("--one-context", str(source), "--one-context-version", "7.2.1", "--suite", "bookworm",
                      "--slurm-release", "24.11", "-o", str(tmp_path / "w.qcow2"))
    if os.geteuid() != 0:
        pytest.skip("the release is checked after the root check")
    assert code == EXIT_CONFIG
    assert "the controller runs Slurm 24.11 but bookworm's slurmd is 22.05: build with --suite trixie" in err
    assert "or install the site's slurmd by --hook" in err
    assert not (tmp_path / "w.qcow2.log").exists()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mmdebstrap") is None, reason="needs root, the tools")
def test_a_build_log_planted_as_a_link_is_not_followed(source, tmp_path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep")
    (tmp_path / "w.qcow2.log").symlink_to(target)
    code, err = build("--one-context", str(source), "--one-context-version", "7.2.1", "--suite", "bookworm",
                      "--slurm-release", "22.05", "-o", str(tmp_path / "w.qcow2"))
    assert code == EXIT_CONFIG and "cannot write the build log" in err, err
    assert target.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one-apps", "precious", "w.qcow2.log"]


def spec(tmp_path: Path, source: Path, **kw) -> ImageSpec:
    return ImageSpec(suite="bookworm", output=tmp_path / "w.qcow2", one_context=source, one_context_version="7.2.1",
                     **kw)


def test_not_root_is_refused(source, tmp_path) -> None:
    with pytest.raises(ConfigError, match="must run as root"):
        check_prerequisites(spec(tmp_path, source), euid=1000)


def test_a_missing_tool_is_named_with_its_debian_package(source, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"needs extlinux, mmdebstrap: apt-get install extlinux mmdebstrap"):
        check_prerequisites(spec(tmp_path, source), euid=0,
                            which=lambda tool: None if tool in ("mmdebstrap", "extlinux") else "/usr/bin/" + tool)


def test_a_one_context_source_without_generate_sh_is_refused(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no context-linux/generate\.sh"):
        check_prerequisites(spec(tmp_path, tmp_path / "empty"), euid=0, which=lambda tool: "/bin/" + tool)


@pytest.mark.skipif(os.geteuid() != 0, reason="the hook's owner is checked against root")
@pytest.mark.parametrize("mode", [0o777, 0o757, 0o644])
def test_a_hook_others_can_write_or_not_executable_is_refused(mode, source, tmp_path) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir(mode=0o755)
    hook = hooks / "nvidia.sh"
    hook.write_text("#!/bin/sh\n")
    hook.chmod(mode)
    with pytest.raises(ConfigError, match="--hook"):
        check_prerequisites(spec(tmp_path, source, hooks=(hook,)), euid=0, which=lambda tool: "/bin/" + tool)


# ---- the image the builder made (tests/kvm/image.sh) --------------------------------------------------

@pytest.fixture(scope="module")
def image(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root (a loop device)")
    done = subprocess.run(["bash", str(HERE / "kvm" / "image.sh"), "--path"], capture_output=True, text=True,
                          timeout=60, check=False)
    path = Path(done.stdout.strip())
    if done.returncode != 0:
        pytest.skip(f"the worker image is not built ({path}): run bash tests/kvm/image.sh")
    work = tmp_path_factory.mktemp("image")
    raw, mnt = work / "disk.raw", work / "mnt"
    mnt.mkdir()
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(path), str(raw)], check=True, timeout=300)
    table = json.loads(subprocess.run(["sfdisk", "--json", str(raw)], capture_output=True, text=True, check=True,
                                      timeout=60).stdout)["partitiontable"]["partitions"]
    starts = {part["type"]: part["start"] * 512 for part in table}
    subprocess.run(["mount", "-o", f"ro,loop,offset={starts['83']}", str(raw), str(mnt)], check=True, timeout=60)
    try:
        yield mnt, raw, table
    finally:
        subprocess.run(["umount", str(mnt)], check=False, timeout=60)
        raw.unlink()


def package_version(root: Path, name: str) -> str | None:
    status = (root / "var/lib/dpkg/status").read_text()
    found = re.search(rf"^Package: {re.escape(name)}\n(?:(?!\n\n).)*?^Version: (\S+)", status, re.M | re.S)
    return found.group(1) if found else None


def enabled(root: Path, unit: str) -> bool:
    return any(os.path.lexists(d / unit) for d in (root / "etc/systemd/system").glob("*.wants"))


@pytest.mark.kvm
def test_the_image_has_the_controllers_slurmd_and_munge(image) -> None:
    image_root = image[0]
    assert (package_version(image_root, "slurmd") or "").startswith("22.05.")  # the host's slurmctld: 22.05
    assert package_version(image_root, "munge")
    manifest = (image_root / "etc/slurm-nebula-power-image").read_text()
    assert "SLURMD=22.05." in manifest and "SUITE=bookworm" in manifest


@pytest.mark.kvm
def test_the_image_has_one_context_from_its_source_with_its_units_enabled(image) -> None:
    image_root = image[0]
    assert (image_root / "usr/sbin/one-contextd").is_file()
    assert (image_root / "etc/one-context.d/net-97-start-script").is_file()
    assert "ONE_CONTEXT=7.2.1" in (image_root / "etc/slurm-nebula-power-image").read_text()
    for unit in ("one-context-local.service", "one-context.service", "one-context-online.service",
                 "systemd-networkd.service", "chrony.service"):
        assert enabled(image_root, unit), unit


@pytest.mark.kvm
def test_the_image_leaves_slurmd_and_munge_to_the_bootstrap_and_nothing_to_apt(image) -> None:
    image_root = image[0]
    for unit in ("slurmd.service", "munge.service", "apt-daily.timer", "apt-daily-upgrade.timer"):
        assert not enabled(image_root, unit), unit


@pytest.mark.kvm
def test_the_image_bakes_in_no_secret_and_no_identity(image) -> None:
    image_root = image[0]
    assert not (image_root / "etc/munge/munge.key").exists()
    assert not list((image_root / "etc/ssh").glob("ssh_host_*"))
    assert (image_root / "etc/machine-id").read_text() == ""
    assert not (image_root / "etc/hostname").exists()


@pytest.mark.kvm
def test_the_image_boots_its_own_root_file_system_by_bios(image) -> None:
    image_root, _, table = image
    assert [part.get("bootable", False) for part in table] == [False, True]  # the root partition is active
    fstab = (image_root / "etc/fstab").read_text()
    uuid = re.search(r"UUID=([0-9a-f-]{36})\s+/\s+ext4", fstab)
    assert uuid, fstab
    conf = (image_root / "boot/extlinux/extlinux.conf").read_text()
    assert f"root=UUID={uuid.group(1)}" in conf and "LINUX /vmlinuz" in conf and "INITRD /initrd.img" in conf
    for link in ("vmlinuz", "initrd.img"):  # Debian's links, which kernel updates move
        assert (image_root / os.readlink(image_root / link)).is_file()
    assert (image_root / "boot/extlinux/ldlinux.sys").is_file()


@pytest.mark.kvm
def test_the_image_has_an_efi_system_partition_with_its_uefi_loader(image) -> None:
    _, raw, table = image
    assert [part["type"] for part in table] == ["ef", "83"]
    listing = subprocess.run(["mdir", "-i", f"{raw}@@{table[0]['start'] * 512}", "::/EFI/BOOT"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    assert "BOOTX64  EFI" in listing, listing
