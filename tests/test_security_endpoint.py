"""A hostile OpenNebula endpoint (issue 15, items 1 and 5): a proxy in front of the simulator that drips,
floods or rewrites its answers. Every program still ends within its bounds, hands back what it could not
do, and lets nothing it was told reach scontrol or the log unchecked.

The programs run as processes (the installed console scripts); a guard on each wait fails the test if one
hangs, and what is asserted is the exit code, the hand-back and the log.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hostile import HostileEndpoint
from reliability_support import live_ours, run_env, run_program, site
from test_cli import program

from slurm_nebula_power.errors import EXIT_NODES_FAILED

TIGHT = {"timeout": 2, "retry_seconds": 4, "poll_max": 0.2}


def handed_back(setup) -> list[str]:
    return [u[0] for u in setup.updates() if any(s.startswith(("State=POWER_DOWN_FORCE", "State=DOWN")) for s in u)]


def test_an_endpoint_that_drips_its_answer_is_cut_off_at_the_timeout(tmp_path, sim) -> None:
    # One byte a second: every socket read gets data within the 2 s timeout, so only a bound on the whole
    # call ends it. Before, resume ran past 45 s holding its lock and handed nothing back.
    drip = HostileEndpoint(sim.endpoint, mode="drip")
    try:
        setup = site(tmp_path / "site", drip, boot_timeout=20, **TIGHT)
        done = run_program(setup, "resume", "gpu01", guard=40)
    finally:
        drip.close()
    assert done.returncode == EXIT_NODES_FAILED, done.stderr
    assert "no answer within the timeout" in setup.log_text()
    assert handed_back(setup) == ["NodeName=gpu01"]


def test_a_huge_answer_is_refused_without_reading_it_all(tmp_path, sim) -> None:
    # 300 MB without Content-Length; the bound (here 16 MiB) refuses it as a transient error. Before, resume
    # read it all: 644 MB RSS.
    flood = HostileEndpoint(sim.endpoint, mode="huge")
    try:
        setup = site(tmp_path / "site", flood, boot_timeout=20, **TIGHT)
        setup.config.write_text(setup.config.read_text().replace("\ntimeout = ", "\nmax_answer_mb = 16\ntimeout = "))
        probe = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
                 "print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        done = subprocess.run([sys.executable, "-c", probe, program("slurm-nebula-resume"), "gpu01"],
                              env=run_env(setup), capture_output=True, text=True, timeout=60)
    finally:
        flood.close()
    code, rss_kib = (int(v) for v in done.stdout.split())
    assert code == EXIT_NODES_FAILED
    assert "above max_answer_mb" in setup.log_text()
    assert rss_kib < 160 * 1024, f"resume peaked at {rss_kib // 1024} MiB"
    assert handed_back(setup) == ["NodeName=gpu01"]


def rewrite_ip(value: str):
    """Every VM's NIC IP replaced by value (the pool document travels escaped inside an XML-RPC string)."""
    def rewrite(body: bytes) -> bytes:
        ip = rb"&lt;IP&gt;&lt;!\[CDATA\[[^\]]*\]\]&gt;&lt;/IP&gt;"
        return re.sub(ip, b"&lt;IP&gt;&lt;![CDATA[" + value.encode() + b"]]&gt;&lt;/IP&gt;", body)
    return rewrite


@pytest.mark.parametrize("address", ["10.0.0.1,10.0.0.2", "[10.0.0.1]", "10.0.0.1\nNodeName=gpu09 State=IDLE",
                                     "fe80::1%eth0", "gpu01", ""])
def test_only_a_valid_ip_address_reaches_scontrol(tmp_path, sim, address) -> None:
    proxy = HostileEndpoint(sim.endpoint, rewrite=rewrite_ip(address))
    try:
        setup = site(tmp_path / "site", proxy, boot_timeout=3, **TIGHT)
        done = run_program(setup, "resume", "gpu[01-02]", guard=60)
    finally:
        proxy.close()
    assert done.returncode == EXIT_NODES_FAILED
    addr_updates = [u for u in setup.updates() if any(s.startswith("NodeAddr=") for s in u)]
    assert addr_updates == [], "no address from the rewritten answers went to scontrol"
    assert handed_back(setup) == ["NodeName=gpu[01-02]"]
    for line in setup.log_text().splitlines():
        assert not line.startswith("NodeName="), "no log line forged by a value from OpenNebula"
    assert live_ours(sim) == {}, "the VMs of the nodes handed back were removed"


def test_a_refused_address_update_is_retried_then_fails_its_nodes(tmp_path, sim) -> None:
    setup = site(tmp_path / "site", sim, boot_timeout=20, **TIGHT)
    setup.refuse("NodeAddr=")
    done = run_program(setup, "resume", "gpu[01-02]", guard=60)
    assert done.returncode == EXIT_NODES_FAILED
    tries = [u for u in setup.updates() if any(s.startswith("NodeAddr=") for s in u)]
    assert len(tries) == 2, "one retry"
    assert "slurmctld refused the node address update" in setup.log_text()
    assert handed_back(setup) == ["NodeName=gpu[01-02]"]
    assert live_ours(sim) == {}
