"""Session-wide test setup: a private network namespace, and fixtures for a real Slurm controller."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onedfix
import pytest
import slurm_findings
import vmnet
from e2e_support import E2E, start_e2e
from simfixtures import AUTH, fast_config
from slurmharness import SlurmCluster, SlurmUnavailable, find_binaries, make_base
from support import make_setup

from opennebula_sim import running_simulator

NETNS_ENV = vmnet.NETNS_ENV  # set once done (inherited by children); "off" disables it
NETNS_WORKER_ENV = "SLURM_NEBULA_POWER_TEST_NETNS_WORKER"  # the xdist worker whose namespace it is
CLONE_NEWNET = 0x40000000
IP_PATHS = ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip")


@dataclass(frozen=True)
class NetnsStatus:
    """Whether this test session runs in a network namespace of its own, and if not, why."""

    isolated: bool
    detail: str


def _enter_private_netns() -> NetnsStatus:
    """Move this process into a new network namespace with only `lo` (127.0.0.1 and 127.0.0.2) up."""
    marker = os.environ.get(NETNS_ENV)
    if marker == "off":
        return NetnsStatus(False, f"disabled by {NETNS_ENV}=off")
    # Each xdist worker gets a namespace of its own, as tests on separate machines would: the guests' VM
    # addresses (127.0.1.x from every simulator) and ports of two workers never meet.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    fresh_worker = marker == "isolated" and worker is not None and os.environ.get(NETNS_WORKER_ENV) != worker
    if marker and not fresh_worker:
        # A child of a session that already made the namespace (pytester, a worker's children): inherited.
        return NetnsStatus(marker == "isolated", f"inherited from the parent process ({marker})")
    if os.geteuid() != 0:
        return NetnsStatus(False, "not root: cannot create a network namespace")
    ip = next((p for p in IP_PATHS if os.access(p, os.X_OK)), None)
    if ip is None:
        return NetnsStatus(False, "iproute2 is not installed (apt-get install iproute2): no `ip` command")
    # A namespace belongs to a thread: unshare() before any thread exists, or other threads stay outside.
    # (An xdist worker has execnet's I/O thread, which only moves messages over its pipes: it may stay.)
    threads = 2 if fresh_worker else 1
    if threading.active_count() > threads or len(os.listdir("/proc/self/task")) > threads:
        return NetnsStatus(False, "other threads already run; unshare would isolate only the main one")
    libc = ctypes.CDLL(None, use_errno=True)  # Python 3.11 has no os.unshare
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        return NetnsStatus(False, f"unshare(CLONE_NEWNET) failed: {errno.errorcode.get(err, err)} "
                                  f"{os.strerror(err)}")
    # Slurm's getaddrinfo(AI_ADDRCONFIG) fails with only 127.0.0.1 in the namespace: add 127.0.0.2.
    for argv in ([ip, "link", "set", "lo", "up"], [ip, "addr", "add", "127.0.0.2/8", "dev", "lo"]):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        if proc.returncode != 0:
            # We are already inside the namespace: without lo nothing works, so stop here.
            raise pytest.UsageError(f"{' '.join(argv)} failed in the new network namespace: {proc.stderr}")
    try:
        vmnet.prepare_session()  # guests of their own, each at its VM address (tests/vmnet.py)
    except (vmnet.VmnetError, OSError) as exc:
        raise pytest.UsageError(f"cannot prepare the namespace for guest namespaces: {exc}") from None
    os.environ[NETNS_ENV] = "isolated"
    if worker is not None:
        os.environ[NETNS_WORKER_ENV] = worker
    return NetnsStatus(True, "private network namespace, lo (127.0.0.1, 127.0.0.2) and one veth per guest"
                             + (f", this xdist worker's own ({worker})" if worker else ""))


_netns_key = pytest.StashKey[NetnsStatus]()


def pytest_configure(config: pytest.Config) -> None:
    """Enter the private network namespace first thing, so no server or child can reach the network."""
    status = _enter_private_netns()
    config.stash[_netns_key] = status
    if not status.isolated and os.environ.get(NETNS_ENV) is None:
        os.environ[NETNS_ENV] = "not-isolated"
        print(f"WARNING: tests run on the host's loopback, not isolated: {status.detail}", file=sys.stderr)


def pytest_report_header(config: pytest.Config) -> str:
    """Say in the session header whether the network is isolated."""
    status = config.stash[_netns_key]
    return f"network: {'isolated' if status.isolated else 'NOT isolated'} ({status.detail})"


@pytest.fixture(scope="session")
def netns(pytestconfig: pytest.Config) -> NetnsStatus:
    """The session's network isolation status."""
    return pytestconfig.stash[_netns_key]


# ---- Slurm ------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def slurm_binaries() -> dict[str, str]:
    """Absolute paths of slurmctld, slurmd, scontrol, sbatch, ..., munged; skips the test when missing."""
    try:
        return find_binaries()
    except SlurmUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def slurm_factory(
    request: pytest.FixtureRequest, slurm_binaries: dict[str, str]
) -> Iterator[Callable[..., SlurmCluster]]:
    """Start clusters: `make(nodes=[...], resume_program=..., suspend_time=...)`; all stopped after the test.

    Each cluster lives in its own /tmp/snp-slurm-* directory (see make_base), removed when the test passed
    and kept (path in the report) when it failed.
    """
    clusters: list[SlurmCluster] = []

    def make(**kwargs: Any) -> SlurmCluster:
        cluster = SlurmCluster(base=make_base(), binaries=slurm_binaries, **kwargs)
        clusters.append(cluster)
        cluster.start()
        cluster.mark_logs()
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()
    if not getattr(request.node, "_slurm_failed", False):
        for cluster in clusters:
            shutil.rmtree(cluster.base, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Let log sections of module-scoped clusters start at this test; findings go to its report."""
    slurm_findings.running(item)
    for cluster in list(SlurmCluster.live):
        cluster.mark_logs()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """List the Slurm behaviour the real-controller tests measured (tests/slurm_findings.py)."""
    reports = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])]
    try:
        release = subprocess.run([find_binaries()["slurmctld"], "-V"], capture_output=True, text=True,
                                 timeout=10, check=False).stdout.strip() or "slurm ?"
    except (SlurmUnavailable, OSError, subprocess.SubprocessError):
        release = "no slurm"
    found = slurm_findings.lines(reports, release)
    if found:
        terminalreporter.section("Slurm findings (release | what | measured | test)")
        for line in found:
            terminalreporter.write_line(line)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Attach the logs of every running cluster (slurmctld, slurmd, munged, registered) to a failure."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed and report.when in ("setup", "call"):
        item._slurm_failed = True  # type: ignore[attr-defined]  # keeps the cluster directories
        for cluster in list(SlurmCluster.live):
            for title, text in cluster.log_sections():
                report.sections.append((f"log {cluster.base}/{title}", text))


def _skip_slurm_tests_without_binaries(items: list[pytest.Item]) -> None:
    """Skip `slurm`-marked tests with an install hint when the binaries are missing."""
    try:
        find_binaries()
    except SlurmUnavailable as exc:
        skip = pytest.mark.skip(reason=str(exc))
        for item in items:
            if "slurm" in item.keywords:
                item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop clusters a test forgot to stop (module fixtures that crashed before teardown), and the oneds."""
    for cluster in list(SlurmCluster.live):
        cluster.stop()
    onedfix.stop_shared()


# ---- the simulator (most program tests) -------------------------------------------------------------


@pytest.fixture
def sim():
    """A fast simulator on a free loopback port."""
    with running_simulator(fast_config(), auth=AUTH) as handle:
        yield handle


@pytest.fixture
def setup(tmp_path, sim):
    """A deployment (config, auth file, fake scontrol) pointing at the simulator."""
    return make_setup(tmp_path / "site", sim.endpoint, AUTH)


# ---- a real OpenNebula (tests/oned, tests/onedfix.py) ------------------------------------------------


@pytest.fixture(scope="session", params=onedfix.VERSIONS, ids=[f"oned-{v}" for v in onedfix.VERSIONS])
def oned(request):
    """A real oned of each release (4 dummy hosts of 1 GPU, network slurm-net on 127.0.2.0/24, the worker
    templates, OneGate), one per test session and release (onedfix.shared: the contract suite's backends use
    the same instances, kept across the other release's tests, stopped at the end); SKIPPED with the reason and
    how to provide it when the source or its build is missing. A start that fails with both present is tried
    once more, then the test errors: that is a real failure."""
    try:
        return onedfix.shared(request.param)
    except onedfix.OnedUnavailable as exc:
        pytest.skip(str(exc))
    except onedfix.OnedFailed:
        try:
            return onedfix.shared(request.param)
        except onedfix.OnedFailed as exc:
            pytest.fail(str(exc))


def pytest_collection_modifyitems(config, items) -> None:
    """Tests of one oned release run in one xdist worker (one instance per release, not one per worker);
    `slurm` tests are skipped without the binaries."""
    _skip_slurm_tests_without_binaries(items)
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "oned" in callspec.params:
            item.add_marker(pytest.mark.xdist_group(f"oned-{callspec.params['oned']}"))


@pytest.fixture
def e2e(slurm_factory) -> Iterator[Callable[..., E2E]]:
    """Start a deployment of the real controller with the simulator (tests/e2e_support.py):
    `e2e(hosts=1, gpus_per_host=1, boot_timeout=6, **cluster_settings)`."""
    made: list[E2E] = []

    def make(**kw) -> E2E:
        env = start_e2e(slurm_factory, **kw)
        made.append(env)
        return env

    yield make
    for env in made:
        env.stop()


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory both root and slurm can reach (pytest's own tmp_path is root's alone)."""
    root = Path(tempfile.mkdtemp(prefix="snp-users-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
