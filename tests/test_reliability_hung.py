"""A hung endpoint (accepts connections, never answers): every program finishes within its bounds and hands
the nodes back, whether oned hangs from the first call or in the middle of a run; once oned answers again,
reconcile removes what was left. test_cli.py covers resume, suspend and resume-fail against an endpoint
hung from the start; here reconcile too, and all four when the hang starts mid-run.

Bounds are not timed: each program runs as a process whose wait has a timeout (a guard that fails the test
if the program hangs); what is checked is the exit code, the hand-back and the log.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from opsupport import show
from reliability_support import gpu_holders, live_ours, run_program, settle, site, tune
from simfixtures import AUTH
from support import make_setup
from test_cli import HungEndpoint

from slurm_nebula_power.cli import reconcile
from slurm_nebula_power.cli.main import resume_main
from slurm_nebula_power.errors import EXIT_INTERNAL, EXIT_NODES_FAILED, EXIT_OK

# One call may take 1 s, its retries 2 s; a boot 4 s; a power-down 4 s. A hung program must end well within
# the guard: resume within boot_timeout + the removal's retries + a call; the others within their budget.
TIGHT = {"timeout": 1, "retry_seconds": 2, "suspend_timeout": 4, "poll_max": 0.2}
GUARD = 60


def test_reconcile_against_an_endpoint_hung_from_the_start_exits_4(tmp_path) -> None:
    hung = HungEndpoint()
    try:
        setup = tune(make_setup(tmp_path / "site", hung.endpoint, AUTH), timeout=1, retry_seconds=2)
        setup.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN", "gpu02 State=IDLE+CLOUD"))
        done = run_program(setup, "reconcile", guard=GUARD)
        assert done.returncode == EXIT_INTERNAL
        assert hung.held, "it did connect"
        [line] = done.stderr.splitlines()
        assert "no answer within the timeout" in line
        assert setup.updates() == [], "without OpenNebula's answer no node is handed back"
    finally:
        hung.close()


class HangAfter:
    """From the n-th call of method on, every API call is held unanswered, then lost: oned never executes it
    (the n-th call itself is answered). clear() lets the held calls go and restores the simulator."""

    def __init__(self, sim: Any, calls: int, method: str) -> None:
        self.sim, self.calls, self.method = sim, calls, method
        self.seen = 0
        self.held = 0
        self.hanging = False
        self.released = threading.Event()
        self.lock = threading.Lock()
        self.original = sim.api.dispatch
        sim.api.dispatch = self.dispatch

    def dispatch(self, method: str, params: tuple[Any, ...]) -> Any:
        with self.lock:
            hanging = self.hanging
            self.held += hanging
        if hanging:
            self.released.wait()
            return self.sim.api.internal_error(method)  # the caller gave up long ago
        answer = self.original(method, params)
        with self.lock:
            if method == self.method:
                self.seen += 1
                self.hanging = self.seen >= self.calls
        return answer

    def clear(self) -> None:
        self.sim.api.dispatch = self.original
        self.released.set()


MID_RUN = [
    # program, prepared VMs, hang after the n-th call of method, exit code
    ("resume", False, 2, "one.template.instantiate", EXIT_NODES_FAILED),  # while watching the boots
    ("suspend", True, 1, "one.vm.action", EXIT_NODES_FAILED),  # while confirming the power-down
    ("resume-fail", True, 1, "one.vm.action", EXIT_NODES_FAILED),
    ("reconcile", True, 1, "one.vmpool.infoextended", EXIT_INTERNAL),  # between the plan and the re-read
]


@pytest.mark.parametrize(("program", "prepared", "calls", "method", "code"), MID_RUN,
                         ids=[m[0] for m in MID_RUN])
def test_endpoint_hung_mid_run_each_program_ends_and_nothing_leaks_afterwards(
        tmp_path, sim, program, prepared, calls, method, code) -> None:
    sim.set_durations(prolog=2.0, boot=2.0)  # resume is still watching when the hang starts
    setup = site(tmp_path / "site", sim, boot_timeout=4, **TIGHT)
    if prepared:
        sim.set_durations(prolog=0, boot=0)
        assert resume_main(["gpu[01-02]"], setup.env) == EXIT_OK
        setup.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN", "gpu02 State=IDLE+CLOUD+POWERED_DOWN"))
    hang = HangAfter(sim, calls, method)
    try:
        done = run_program(setup, program, *([] if program == "reconcile" else ["gpu[01-02]"]), guard=GUARD)
    finally:
        hang.clear()
    assert hang.held > 0, "calls were held unanswered"
    assert done.returncode == code, done.stderr
    log = setup.log_text()
    assert "no answer within the timeout" in log
    if program == "resume":
        handbacks = [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
        assert [u[0] for u in handbacks] == ["NodeName=gpu[01-02]"], "both nodes handed back at once"
    left = live_ours(sim)
    assert left, "the lost calls left VMs behind"
    # oned answers again: Slurm has the nodes powered down, and reconcile removes what the hang left.
    setup.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN", "gpu02 State=IDLE+CLOUD+POWERED_DOWN"))
    sim.set_durations(prolog=0, boot=0)
    assert reconcile.main([], setup.env) == EXIT_OK
    settle(sim)
    assert live_ours(sim) == {} and gpu_holders(sim) == {}
