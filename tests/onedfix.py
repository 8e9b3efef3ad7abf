"""A real OpenNebula front end for the tests: oned 7.0.2 or 7.4.0 built from source by tests/oned/build.sh
(tests/setup-and-run.sh builds both, cached), started per test session by tests/oned/start.sh in a private
directory on free loopback ports, stopped by pid afterwards.

Without the source or the build, the real-oned tests are SKIPPED with the reason and how to provide it.

In a Slurm release root (tests/releases/run-in-root.sh) the build is the host's, made for the host's Debian:
the scripts run there by chroot to the host's / (SNP_HOST_ROOT), with this root's paths as the host sees
them (below SNP_ROOT_ON_HOST); oned still listens in this process's network namespace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "oned"
KNOWN = ("7.0.2", "7.4.0")
# ONED_VERSIONS="7.4.0" runs the real-oned tests on fewer releases (the Slurm release roots do: the oned axis is
# covered on the host, each Slurm release meets the newest oned).
VERSIONS = tuple(os.environ.get("ONED_VERSIONS", " ".join(KNOWN)).split())
if not VERSIONS or set(VERSIONS) - set(KNOWN):
    raise SystemExit(f"ONED_VERSIONS={os.environ.get('ONED_VERSIONS')!r}: each must be one of {' '.join(KNOWN)}")
NOT_BUILT = 75  # build.sh's exit code under ONED_NO_BUILD when the cache has no build
HOW = ("point ONE_SOURCE at a checkout of OpenNebula's repository at a release tag (e.g. release-7.4.0) or "
       "a tarball of one, and run bash tests/oned/build.sh (about 9 minutes a release on 2 cores)")


HOST_ROOT = os.environ.get("SNP_HOST_ROOT", "")
ROOT_ON_HOST = os.environ.get("SNP_ROOT_ON_HOST", "")
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def script(name: str, directory: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run tests/oned/<name> DIR (start.sh, stop.sh) with `env` added: here, or in a release root on the host."""
    if not HOST_ROOT:
        return subprocess.run(["bash", str(SCRIPTS / name), str(directory)], env={**os.environ, **(env or {})},
                              capture_output=True, text=True, timeout=1200)
    passed = {k: v for k, v in {**os.environ, **(env or {})}.items() if k.startswith(("ONE_", "ONED_"))}
    argv = ["chroot", HOST_ROOT, "/usr/bin/env", "-i", f"PATH={HOST_PATH}", "HOME=/root", "LANG=C.UTF-8",
            *(f"{k}={v}" for k, v in sorted(passed.items())),
            "bash", ROOT_ON_HOST + str(SCRIPTS / name), ROOT_ON_HOST + str(directory)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=1200)


class OnedUnavailable(Exception):
    """No real oned can be started here (no source, not built); the message says why and how to provide one."""


class OnedFailed(Exception):
    """The source and the build are there, but oned did not start: a real failure."""


@dataclass
class RealOned:
    """One running instance."""

    version: str
    root: Path
    endpoint: str
    auth: str  # the unprivileged user's session (docs/installation.md, "The OpenNebula side"): what the tests use
    onegate: str
    admin: str  # oneadmin's session: hosts, users, quotas, what a site's administrator does

    @property
    def cli_env(self) -> dict[str, str]:
        """The environment in which OpenNebula's CLI (bin/one*) acts as oneadmin on this instance."""
        values = dict(line.removeprefix("export ").split("=", 1) for line in
                      (self.root / "cli.env").read_text().splitlines() if "=" in line)
        values["PATH"] = values["PATH"].replace("$PATH", os.environ.get("PATH", "/usr/bin:/bin"))
        return {**os.environ, **values}

    @property
    def dummy_actions(self) -> Path:
        """The dummy VMM driver's switches: a file `deploy` holding `failure` fails every deploy."""
        return self.root / "dummy_actions"

    def force_vm_state(self, vm_id: int, state: str) -> None:
        """Make the dummy monitor report a VM in `state` from now on, as a hypervisor would: POWEROFF (its qemu
        killed: oned moves a RUNNING VM to POWEROFF) or FAILURE (oned: UNKNOWN). oned ignores the report
        until the VM has been in its state for 30 s; it comes every STATE_VM period (5 s)."""
        import xml.etree.ElementTree as ET
        import xmlrpc.client

        text = xmlrpc.client.ServerProxy(self.endpoint).one.vm.info(self.admin, vm_id)[1]
        host = ET.fromstring(text).findall("HISTORY_RECORDS/HISTORY/HID")[-1].text
        with (self.root / "forced_vm_states").open("a") as states:
            states.write(f"{host} {vm_id} {state}\n")

    def unforce(self) -> None:
        """Stop reporting forced VM states."""
        (self.root / "forced_vm_states").unlink(missing_ok=True)

    def host_status(self, name: str, status: str) -> None:
        """`onehost enable|disable|offline NAME`."""
        import xmlrpc.client

        server = xmlrpc.client.ServerProxy(self.endpoint)
        code = {"enable": 0, "disable": 1, "offline": 2}[status]
        answer = server.one.host.status(self.admin, self.host_id(name), code)
        assert answer[0], answer

    def host_states(self) -> dict[str, int]:
        """Host name -> STATE (2 MONITORED, 4 DISABLED, 8 OFFLINE, 0 INIT...)."""
        import xml.etree.ElementTree as ET
        import xmlrpc.client

        pool = ET.fromstring(xmlrpc.client.ServerProxy(self.endpoint).one.hostpool.info(self.admin)[1])
        return {h.findtext("NAME") or "": int(h.findtext("STATE") or -1) for h in pool.iterfind("HOST")}

    def enable_hosts(self, timeout: float = 60) -> None:
        """`onehost enable` every host that is not MONITORED (enabling one that is would send it through INIT,
        where it takes no VM until its next monitoring), then wait until every host is MONITORED."""
        import time

        for name, state in self.host_states().items():
            if state in (4, 8):
                self.host_status(name, "enable")
        deadline = time.monotonic() + timeout
        while any(state != 2 for state in self.host_states().values()):
            if time.monotonic() > deadline:
                raise AssertionError(f"hosts not MONITORED within {timeout} s: {self.host_states()}")
            time.sleep(0.3)

    def host_update(self, name: str, text: str) -> None:
        """`onehost update NAME --append` with this template text (e.g. NVLINK_DOMAIN = "nvl-a")."""
        import xmlrpc.client

        answer = xmlrpc.client.ServerProxy(self.endpoint).one.host.update(self.admin, self.host_id(name), text, 1)
        assert answer[0], answer

    def host_id(self, name: str) -> int:
        """A host's id by its name."""
        import xml.etree.ElementTree as ET
        import xmlrpc.client

        pool = ET.fromstring(xmlrpc.client.ServerProxy(self.endpoint).one.hostpool.info(self.admin)[1])
        return next(int(h.findtext("ID") or -1) for h in pool.iterfind("HOST") if h.findtext("NAME") == name)

    def stop(self) -> None:
        """Stop every process of the instance and remove its directory."""
        script("stop.sh", self.root)
        shutil.rmtree(self.root.parent, ignore_errors=True)


def start(version: str, hosts: int = 4, gpus: int = 1, net_ip: str = "127.0.2.1", **env: str) -> RealOned:
    """Start oned `version` with `hosts` dummy hosts of `gpus` GPUs each; OnedUnavailable when it cannot."""
    if shutil.which("bash") is None:
        raise OnedUnavailable("bash is missing")
    root = Path(tempfile.mkdtemp(prefix=f"oned-{version}-"))
    settings = {"ONE_VERSION": version, "ONED_HOSTS": str(hosts), "ONED_GPUS": str(gpus), "ONED_NET_IP": net_ip,
                "ONED_NO_BUILD": "1", **env}
    try:
        done = script("start.sh", root / "one", settings)
    except subprocess.TimeoutExpired:
        script("stop.sh", root / "one")
        raise OnedFailed(f"oned {version} did not start within 1200 s, its turn included "
                         f"(log: {root / 'one' / 'var'})") from None
    last = (done.stderr.strip().splitlines() or [""])[-1]
    if done.returncode == NOT_BUILT or "no OpenNebula" in done.stderr:
        shutil.rmtree(root, ignore_errors=True)
        why = last.removeprefix("build.sh: ")
        raise OnedUnavailable(f"oned {version}: {why}" + ("" if "ONE_SOURCE" in why else f"; {HOW}"))
    if done.returncode != 0:
        script("stop.sh", root / "one")
        tail = " | ".join(done.stderr.strip().splitlines()[-6:])
        raise OnedFailed(f"oned {version} failed to start ({done.returncode}): {tail} (log: {root / 'one' / 'var'})")
    values = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return RealOned(version, root / "one", values["ENDPOINT"], values["AUTH"], values["ONEGATE"], values["ADMIN_AUTH"])


_shared: dict[str, RealOned | OnedUnavailable] = {}


def shared(version: str) -> RealOned:
    """The process's one instance of `version`, started on first use (a failure to start is remembered, so it
    is not retried for every test); stop_shared() stops them all at the end of the session."""
    if version not in _shared:
        try:
            _shared[version] = start(version)
        except OnedUnavailable as exc:
            _shared[version] = exc
    found = _shared[version]
    if isinstance(found, OnedUnavailable):
        raise found
    return found


def stop_shared() -> None:
    """Stop every instance shared() started."""
    while _shared:
        _, found = _shared.popitem()
        if isinstance(found, RealOned):
            found.stop()
