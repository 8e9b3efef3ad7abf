"""Bad input, as one table run against the programs as processes: hostile hostlists, broken configuration, and
oned refusing. Each case gives one clear error line, the documented exit code, and, where the input is
invalid, not a single API call nor scontrol call.

Elsewhere: test_cli.py runs the hostlists of its BAD_HOSTLISTS through resume, suspend and resume-fail (here:
through reconcile, plus more hostile ones through all four); test_config.py checks each configuration error's
full message (here: that every program exits 3 with it, before touching anything).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from opsupport import ours
from reliability_support import PROGRAMS, run_program, site, tune
from simfixtures import sim
from test_cli import BAD_HOSTLISTS

from slurm_nebula_power.errors import EXIT_CONFIG, EXIT_INTERNAL, EXIT_NODES_FAILED, EXIT_USAGE

ALL = tuple(PROGRAMS)
POWER = ("resume", "suspend", "resume-fail")
EXIT_FAILED = {"resume": EXIT_NODES_FAILED, "suspend": EXIT_NODES_FAILED, "resume-fail": EXIT_NODES_FAILED,
               "reconcile": EXIT_INTERNAL}  # reconcile: 4 when OpenNebula cannot be used at all


@dataclass(frozen=True)
class Case:
    """One bad input: how to make it, what each program must answer."""

    name: str
    programs: tuple[str, ...]
    exit_code: int | dict[str, int]
    message: str  # regex the one error line must match (stderr for exit 2/3/4, else the log)
    prepare: Callable[[Any, Any], None] = lambda sim, setup: None
    hostlist: str | None = "gpu[01-02]"
    invalid: bool = True  # invalid input: zero API calls, zero scontrol calls
    no_retry: bool = False  # oned's answer is final: nothing is retried

    def code(self, program: str) -> int:
        return self.exit_code if isinstance(self.exit_code, int) else self.exit_code[program]


def edit(old: str, new: str) -> Callable[[Any, Any], None]:
    """Replace the first line of the configuration that starts with old (a key or a line) by new."""
    def prepare(sim: Any, setup: Any) -> None:
        text = setup.config.read_text()
        line = next(line for line in text.splitlines() if line.startswith(old))
        setup.config.write_text(text.replace(line, new, 1))
    return prepare


def chmod_auth(sim: Any, setup: Any) -> None:
    (setup.root / "one_auth").chmod(0o640)


def remove_auth(sim: Any, setup: Any) -> None:
    (setup.root / "one_auth").unlink()


def blocked_log_dir(sim: Any, setup: Any) -> None:
    (setup.root / "not-a-dir").write_text("")
    tune(setup, file=str(setup.root / "not-a-dir" / "nebula-power.log"))


def blocked_lock_dir(sim: Any, setup: Any) -> None:
    (setup.root / "not-a-dir").write_text("")
    tune(setup, lock_dir=str(setup.root / "not-a-dir" / "locks"))


def no_config(sim: Any, setup: Any) -> None:
    setup.config.unlink()


HOSTILE = ["gpu01|reboot", "`reboot`", "gpu01\nreboot", "gpu01 gpu02", "gpu[01-04]]", "gpu[a-c]", "gpu{01..04}",
           "../../etc/passwd", "gpu[0001-99999]", "x" * 65, " ", "gpu\u200b01"]

CASES = [
    *(Case(f"hostlist {h!r}", ("reconcile",), EXIT_USAGE, r"error: .*(hostlist|node name|argument)", hostlist=h)
      for h in BAD_HOSTLISTS),
    *(Case(f"hostlist {h!r}", ALL, EXIT_USAGE, r"error: .*(hostlist|node name|argument)", hostlist=h)
      for h in HOSTILE),
    Case("missing key", ALL, EXIT_CONFIG, r"opennebula\.endpoint: missing", edit("endpoint = ", "")),
    Case("unknown key", ALL, EXIT_CONFIG, r"power\.whatever: unknown key", edit("[power]", "[power]\nwhatever = 1")),
    Case("wrong type: string for a number", ALL, EXIT_CONFIG, r"opennebula\.timeout: must be a number",
         edit("timeout = ", 'timeout = "2"')),
    Case("wrong type: float for an integer", ALL, EXIT_CONFIG, r"opennebula\.max_parallel: must be an integer",
         edit("max_parallel = ", "max_parallel = 2.5")),
    Case("wrong type: table for a string", ALL, EXIT_CONFIG, r"nodeset\[0\]\.nodes: must be a string",
         edit("nodes = ", "nodes = { x = 1 }")),
    Case("non-http endpoint", ALL, EXIT_CONFIG, r"opennebula\.endpoint: must be an http:// or https://",
         edit("endpoint = ", 'endpoint = "ftp://127.0.0.1:2633/RPC2"')),
    Case("endpoint without scheme", ALL, EXIT_CONFIG, r"opennebula\.endpoint: must be an http://",
         edit("endpoint = ", 'endpoint = "127.0.0.1:2633"')),
    Case("missing template", ALL, EXIT_CONFIG, r"nodeset\[0\]\.template: missing", edit("template = ", "")),
    Case("empty template", ALL, EXIT_CONFIG, r"nodeset\[0\]\.template: empty", edit("template = ", 'template = ""')),
    Case("group-readable auth file", ALL, EXIT_CONFIG, r"opennebula\.auth_file: .* accessible by group or others",
         chmod_auth),
    Case("missing auth file", ALL, EXIT_CONFIG, r"opennebula\.auth_file: cannot read", remove_auth),
    Case("unwritable log directory", ALL, EXIT_CONFIG, r"log\.file: cannot write", blocked_log_dir),
    Case("unusable lock directory", POWER, EXIT_CONFIG, r"power\.lock_dir: cannot create", blocked_lock_dir),
    Case("not TOML", ALL, EXIT_CONFIG, r"not valid TOML", edit("[power]", "[power")),
    Case("no configuration file", ALL, EXIT_CONFIG, r"no such configuration file", no_config),
    Case("authentication failure", ALL, EXIT_FAILED, r"User couldn't be authenticated",
         lambda sim, setup: (setup.root / "one_auth").write_text("oneadmin:Wr0ng-pass\n"),
         invalid=False, no_retry=True),
    Case("authorization failure", ALL, EXIT_FAILED, r"not authorized to perform action",
         lambda sim, setup: sim.set_authorized(False), invalid=False, no_retry=True),
    Case("quota exceeded: new VM", ("resume",), EXIT_NODES_FAILED, r"Limit of \d+ reached for RUNNING_VMS quota",
         lambda sim, setup: sim.set_faults(quota_exceeded=True), invalid=False, no_retry=True),
    Case("quota exceeded: resuming a powered-off VM", ("resume",), EXIT_NODES_FAILED,
         r"Limit of \d+ reached for RUNNING_VMS quota",
         lambda sim, setup: (sim.add_vm(name="gpu01", user_template=ours("gpu01"), state="POWEROFF"),
                             sim.set_faults(quota_exceeded=True)),
         hostlist="gpu01", invalid=False, no_retry=True),
    Case("locked VM: resume", ("resume",), EXIT_NODES_FAILED, r"virtual machine is locked",
         lambda sim, setup: sim.lock_vm(sim.add_vm(name="gpu01", user_template=ours("gpu01"), state="POWEROFF")),
         hostlist="gpu01", invalid=False),
    Case("locked VM: power down", ("suspend", "resume-fail"), EXIT_NODES_FAILED,
         r"VM \d+ still ACTIVE/RUNNING after \d+s",
         lambda sim, setup: sim.lock_vm(sim.add_vm(name="gpu01", user_template=ours("gpu01"))),
         hostlist="gpu01", invalid=False),
    Case("locked VM: reconcile", ("reconcile",), EXIT_NODES_FAILED, r"VM \d+ still ACTIVE/RUNNING after \d+s",
         lambda sim, setup: (sim.lock_vm(sim.add_vm(name="gpu01", user_template=ours("gpu01"))),
                             setup.set_nodes("NodeName=gpu01 State=IDLE+CLOUD+POWERED_DOWN\n")),
         hostlist=None, invalid=False),
    Case("unknown template name", ("resume",), EXIT_NODES_FAILED, r"no VM template named 'no-such-template'",
         edit("template = ", 'template = "no-such-template"'), invalid=False, no_retry=True),
    Case("unknown template id", ("resume",), EXIT_NODES_FAILED, r"template 99: .*Error getting",
         edit("template = ", "template = 99"), invalid=False, no_retry=True),
]
ROWS = [(case, program) for case in CASES for program in case.programs]


def one_error_line(text: str, pattern: str) -> str:
    """The single line of text saying error, which must match pattern; other lines may only be usage."""
    lines = text.splitlines()
    errors = [line for line in lines if "error" in line.lower()]
    assert len(errors) == 1, f"one error line, not {lines}"
    assert all(line.startswith("usage:") or line.startswith(" ") or line in errors for line in lines), lines
    assert re.search(pattern, errors[0]), f"{errors[0]!r} !~ {pattern!r}"
    return errors[0]


@pytest.mark.parametrize(("case", "program"), ROWS, ids=[f"{c.name}-{p}" for c, p in ROWS])
def test_bad_input_gives_one_clear_error_and_the_documented_exit(tmp_path, sim, case: Case, program: str) -> None:
    setup = site(tmp_path / "site", sim, timeout=2, retry_seconds=2, suspend_timeout=3, poll_max=0.2)
    case.prepare(sim, setup)
    sim.reset_stats()
    args = [] if case.hostlist is None else [case.hostlist]
    done = run_program(setup, program, *args)
    assert done.returncode == case.code(program), done.stderr
    if case.invalid or done.returncode == EXIT_INTERNAL:
        line = one_error_line(done.stderr, case.message)
        if case.code(program) == EXIT_CONFIG and case.name != "unusable lock directory":
            assert str(setup.config) in line, "the error names the configuration file"
    else:
        assert re.search(case.message, setup.log_text()), f"a log line says why: {setup.log_text()}"
    calls = sum(sim.stats()["calls"].values())
    if case.invalid:
        assert calls == 0, f"no API call on invalid input ({sim.stats()['calls']})"
        assert setup.scontrol_calls() == [], "no scontrol call on invalid input"
    if case.no_retry:
        assert "retrying" not in setup.log_text(), "oned's refusal is not retried"
    if program == "resume" and not case.invalid:
        [handback] = [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
        assert re.search(case.message, handback[-1]), f"the node's Reason says why: {handback}"
    if case.invalid:
        assert sim.vms() == []
