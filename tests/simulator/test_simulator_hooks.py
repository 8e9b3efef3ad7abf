"""--on-running / --on-stopped hooks: argument lists, environment, the CONTEXT file, failures."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pyone
import pytest

from opennebula_sim import Durations, SimConfig, running_simulator
from opennebula_sim.cloud import HookEvent
from opennebula_sim.hooks import context_file_text

# A hook that records its argv, the ONE_VM_* environment and the sourced CONTEXT file as JSON lines.
RECORDER = """
import json, os, shlex, subprocess, sys
ctx = subprocess.run(["sh", "-c", '. "$ONE_VM_CONTEXT"; printf %s "$SET_HOSTNAME|$ETH0_IP|$QUOTE"'],
                     capture_output=True, text=True, check=True).stdout
record = {"argv": sys.argv[2:], "id": os.environ["ONE_VM_ID"], "name": os.environ["ONE_VM_NAME"],
          "ip": os.environ["ONE_VM_IP"], "context": ctx}
with open(sys.argv[1], "a") as out:
    out.write(json.dumps(record) + "\\n")
"""


def _records(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _config(tmp_path: Path, kind: str, extra: tuple[str, ...] = ()) -> SimConfig:
    script = tmp_path / "hook.py"
    script.write_text(RECORDER)
    argv = (sys.executable, str(script), str(tmp_path / f"{kind}.jsonl"), *extra)
    return SimConfig(durations=Durations(0, 0, 0, 0), **{f"on_{kind}": argv})  # type: ignore[arg-type]


def test_on_running_gets_vm_identity_and_sourceable_context(tmp_path: Path) -> None:
    with running_simulator(_config(tmp_path, "running", ("a b", "; rm -rf /", "$HOME"))) as sim:
        one = pyone.OneServer(sim.endpoint, session=sim.auth)
        extra = 'CONTEXT = [ NETWORK = "YES", SET_HOSTNAME = "$NAME", QUOTE = "it\'s \\"q\\"" ]'
        vm_id = one.template.instantiate(0, "gpu01", False, extra, False)
        records = sim.wait_for(lambda: _records(tmp_path / "running.jsonl"), 10)
    assert records == [{"argv": ["a b", "; rm -rf /", "$HOME"], "id": str(vm_id), "name": "gpu01",
                        "ip": "127.0.1.1", "context": "gpu01|127.0.1.1|it's \"q\""}]


@pytest.mark.parametrize(("action", "fires"), [
    ("poweroff", True), ("undeploy", True), ("stop", True), ("suspend", True), ("terminate", True),
    ("reboot", False),
])
def test_on_stopped_fires_when_a_vm_leaves_running(tmp_path: Path, action: str, fires: bool) -> None:
    with running_simulator(_config(tmp_path, "stopped")) as sim:
        one = pyone.OneServer(sim.endpoint, session=sim.auth)
        vm_id = one.template.instantiate(1, "cpu01", False, "", False)
        sim.wait_for(lambda: sim.vm(vm_id).state_str == "RUNNING", 5)
        assert _records(tmp_path / "stopped.jsonl") == []
        one.vm.action(action, vm_id)
        if fires:
            records = sim.wait_for(lambda: _records(tmp_path / "stopped.jsonl"), 10)
            assert [r["name"] for r in records] == ["cpu01"]
        else:
            one.vm.action("poweroff", vm_id)  # a later event proves nothing was queued for the reboot
            records = sim.wait_for(lambda: _records(tmp_path / "stopped.jsonl"), 10)
            assert len(records) == 1


def test_failing_hook_is_logged_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = SimConfig(durations=Durations(0, 0, 0, 0), on_running=(sys.executable, "-c", "raise SystemExit(3)"))
    with caplog.at_level(logging.WARNING, logger="opennebula_sim.hooks"):
        with running_simulator(cfg) as sim:
            one = pyone.OneServer(sim.endpoint, session=sim.auth)
            vm_id = one.template.instantiate(1, "x", False, "", False)
            sim.wait_for(lambda: sim.hooks.failed == 1, 10)
            assert one.vm.info(vm_id).LCM_STATE == 3
    assert "exited with 3" in caplog.text


def test_missing_hook_program_is_logged_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = SimConfig(durations=Durations(0, 0, 0, 0), on_running=(str(tmp_path / "nope"),))
    with caplog.at_level(logging.ERROR, logger="opennebula_sim.hooks"):
        with running_simulator(cfg) as sim:
            one = pyone.OneServer(sim.endpoint, session=sim.auth)
            one.template.instantiate(1, "x", False, "", False)
            sim.wait_for(lambda: sim.hooks.failed == 1, 10)
            assert one.system.version() == "6.10.0"
    assert "could not start" in caplog.text


def test_injected_vms_run_no_hook(tmp_path: Path) -> None:
    with running_simulator(_config(tmp_path, "running")) as sim:
        sim.add_vm(name="foreign", state="RUNNING", template_id=1)
        one = pyone.OneServer(sim.endpoint, session=sim.auth)
        mine = one.template.instantiate(1, "mine", False, "", False)
        records = sim.wait_for(lambda: _records(tmp_path / "running.jsonl"), 10)
    assert [r["id"] for r in records] == [str(mine)]


def test_context_file_quotes_single_quotes() -> None:
    event = HookEvent("running", 1, "n", "127.0.1.9", {"A": "x'y", "B": "$(id)"})
    assert context_file_text(event) == "A='x'\"'\"'y'\nB='$(id)'\nETH0_IP='127.0.1.9'\n"
