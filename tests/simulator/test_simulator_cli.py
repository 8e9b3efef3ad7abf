"""The simulator command: prints its endpoint once serving, stops cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pyone
import pytest

from opennebula_sim.cli import main

COMMAND = [sys.executable, "-m", "opennebula_sim"]


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*COMMAND, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_prints_endpoint_serves_and_exits_zero_on_signal(sig: signal.Signals) -> None:
    proc = _start("--listen", "127.0.0.1:0", "--auth", "oneadmin:cli-pass", "--boot-seconds", "0")
    try:
        assert proc.stdout is not None
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("http://127.0.0.1:") and endpoint.endswith("/RPC2")
        assert pyone.OneServer(endpoint, session="oneadmin:cli-pass").system.version() == "6.10.0"
        proc.send_signal(sig)
        assert proc.wait(10) == 0
        assert proc.stdout.read() == "", "exactly one line on stdout"
    finally:
        proc.kill()
        proc.wait()


def test_config_file_and_flags_shape_the_cloud(tmp_path: Path) -> None:
    sim_toml = tmp_path / "sim.toml"
    sim_toml.write_text('seed = 5\n[hosts]\ncount = 2\ngpus_per_host = 1\n[network]\ncidr = "127.0.5.0/24"\n')
    proc = _start("--listen", "127.0.0.1:0", "--config", str(sim_toml), "--latency-ms", "1")
    try:
        assert proc.stdout is not None
        endpoint = proc.stdout.readline().strip()
        one = pyone.OneServer(endpoint, session="oneadmin:secret")
        assert [h.NAME for h in one.hostpool.info().HOST] == ["gpu-host-01", "gpu-host-02"]
        vm_id = one.template.instantiate(0, "", True, "", False)
        assert one.vm.info(vm_id).TEMPLATE["NIC"]["IP"] == "127.0.5.1"
        proc.terminate()
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("listen", ["10.0.0.1:2633", "0.0.0.0:2633", "::1:2633", "example.org:2633"])
def test_refuses_non_loopback_addresses(listen: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--listen", listen]) == 2
    assert "127.0.0.0/8" in capsys.readouterr().err


def test_malformed_listen_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--listen", "127.0.0.1"]) == 2
    assert "ADDRESS:PORT" in capsys.readouterr().err


def test_bad_config_is_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sim_toml = tmp_path / "sim.toml"
    sim_toml.write_text("[faults]\nlatencyms = 3\n")
    assert main(["--listen", "127.0.0.1:0", "--config", str(sim_toml)]) == 3
    assert "unknown key faults.latencyms" in capsys.readouterr().err


def test_verbose_logs_each_request_to_stderr() -> None:
    proc = _start("--listen", "127.0.0.1:0", "-v")
    try:
        assert proc.stdout is not None and proc.stderr is not None
        endpoint = proc.stdout.readline().strip()
        pyone.OneServer(endpoint, session="oneadmin:secret").system.version()
        proc.terminate()
        assert proc.wait(10) == 0
        assert '"POST /RPC2 HTTP/1.1" 200' in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
