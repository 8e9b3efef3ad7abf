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
from opsupport import ours_vm
from reliability_support import PROGRAMS, run_program, site, tune
from test_cli import BAD_HOSTLISTS

from slurm_nebula_power.errors import EXIT_CONFIG, EXIT_INTERNAL, EXIT_NODES_FAILED, EXIT_USAGE

ALL = tuple(PROGRAMS)
POWER = ("resume", "suspend", "resume-fail")
EXIT_FAILED = {"resume": EXIT_NODES_FAILED, "suspend": EXIT_NODES_FAILED, "resume-fail": EXIT_NODES_FAILED,
               "reconcile": EXIT_INTERNAL}  # reconcile: 4 when OpenNebula cannot be used at all
Prepare = Callable[[Any, Any], None]  # (sim, setup) -> None: makes the bad input


@dataclass(frozen=True)
class Case:
    """One bad input: how to make it, what each program must answer."""

    name: str
    programs: tuple[str, ...]
    exit_code: int | dict[str, int]
    message: str  # regex the one error line must match (stderr for exit 2/3/4, else the log)
    prepare: Prepare = lambda sim, setup: None
    hostlist: str | None = "gpu[01-02]"
    invalid: bool = True  # invalid input: zero API calls, zero scontrol calls
    no_retry: bool = False  # oned's answer is final: nothing is retried

    def code(self, program: str) -> int:
        """The documented exit code for this program."""
        return self.exit_code if isinstance(self.exit_code, int) else self.exit_code[program]


def edit(old: str, new: str) -> Prepare:
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


HOSTILE = ["gpu01|reboot", "`reboot`", "gpu01\nreboot", "gpu01 gpu02", "gpu[01-04]]", "gpu[a-c]",
           "gpu{01..04}", "../../etc/passwd", "gpu[0001-99999]", "x" * 65, " ", "gpu\u200b01"]
HOSTLIST_ERROR = r"error: .*(hostlist|node name|argument)"


def hostlist(text: str, programs: tuple[str, ...] = ALL) -> Case:
    """A malformed or hostile hostlist: exit 2 before any call."""
    return Case(f"hostlist {text!r}", programs, EXIT_USAGE, HOSTLIST_ERROR, hostlist=text)


def config(name: str, message: str, prepare: Prepare, programs: tuple[str, ...] = ALL) -> Case:
    """A configuration error: exit 3 before any call, the line names the file and the key."""
    return Case(name, programs, EXIT_CONFIG, message, prepare)


def refused(name: str, message: str, prepare: Prepare, programs: tuple[str, ...] = ALL,
            hostlist: str | None = "gpu[01-02]", no_retry: bool = True, exit_code: int | None = None) -> Case:
    """oned refusing: the nodes fail (exit 1; reconcile 4 when it cannot read the pool), the log says why."""
    return Case(name, programs, EXIT_FAILED if exit_code is None else exit_code, message, prepare, hostlist,
                invalid=False, no_retry=no_retry)


def locked(state: str, slurm: str = "") -> Prepare:
    """Our VM for gpu01 in state, locked (onevm lock); Slurm shows gpu01 as slurm if given."""
    def prepare(sim: Any, setup: Any) -> None:
        sim.lock_vm(sim.add_vm(name="gpu01", **ours_vm("gpu01"), state=state))
        if slurm:
            setup.set_nodes(f"NodeName=gpu01 State={slurm}\n")
    return prepare


def quota(state: str | None = None) -> Prepare:
    """The VM quota exhausted (with our VM for gpu01 in state, if given)."""
    def prepare(sim: Any, setup: Any) -> None:
        if state:
            sim.add_vm(name="gpu01", **ours_vm("gpu01"), state=state)
        sim.set_faults(quota_exceeded=True)
    return prepare


def wrong_password(sim: Any, setup: Any) -> None:
    (setup.root / "one_auth").write_text("oneadmin:Wr0ng-pass\n")


QUOTA = r"limit of \d+ reached for RUNNING_VMS quota"  # oned: "user [0] limit of 0 reached for ... quota in VM"
STILL_RUNNING = r"VM still ACTIVE/RUNNING after \d+s"
CASES = [
    *(hostlist(text, ("reconcile",)) for text in BAD_HOSTLISTS),  # test_cli.py: the other three programs
    *(hostlist(text) for text in HOSTILE),
    config("missing key", r"opennebula\.endpoint: missing", edit("endpoint = ", "")),
    config("unknown key", r"power\.whatever: unknown key", edit("[power]", "[power]\nwhatever = 1")),
    config("wrong type: string for a number", r"opennebula\.timeout: must be a number",
           edit("timeout = ", 'timeout = "2"')),
    config("wrong type: float for an integer", r"opennebula\.max_parallel: must be an integer",
           edit("max_parallel = ", "max_parallel = 2.5")),
    config("wrong type: table for a string", r"nodeset\[0\]\.nodes: must be a string",
           edit("nodes = ", "nodes = { x = 1 }")),
    config("non-http endpoint", r"opennebula\.endpoint: must be an http:// or https://",
           edit("endpoint = ", 'endpoint = "ftp://127.0.0.1:2633/RPC2"')),
    config("endpoint without scheme", r"opennebula\.endpoint: must be an http://",
           edit("endpoint = ", 'endpoint = "127.0.0.1:2633"')),
    config("missing template", r"nodeset\[0\]\.template: missing", edit("template = ", "")),
    config("empty template", r"nodeset\[0\]\.template: empty", edit("template = ", 'template = ""')),
    config("group-readable auth file", r"opennebula\.auth_file: .* accessible by group or others",
           chmod_auth),
    config("missing auth file", r"opennebula\.auth_file: cannot read", remove_auth),
    config("unwritable log directory", r"log\.file: cannot write", blocked_log_dir),
    config("unusable lock directory", r"power\.lock_dir: cannot create", blocked_lock_dir, POWER),
    config("not TOML", r"not valid TOML", edit("[power]", "[power")),
    config("no configuration file", r"no such configuration file", no_config),
    refused("authentication failure", r"User couldn't be authenticated|refused the credentials of user oneadmin in",
            wrong_password),
    refused("authorization failure", r"not authorized to perform action",
            lambda sim, setup: sim.set_authorized(False)),
    refused("quota exceeded: new VM", QUOTA, quota(), ("resume",)),
    refused("quota exceeded: resuming a powered-off VM", QUOTA, quota("POWEROFF"), ("resume",), "gpu01"),
    refused("locked VM: resume", r"virtual machine is locked", locked("POWEROFF"), ("resume",), "gpu01",
            no_retry=False),  # LOCKED is transient: retried within retry_seconds
    refused("locked VM: power down", STILL_RUNNING, locked("RUNNING"), ("suspend", "resume-fail"), "gpu01",
            no_retry=False),
    refused("locked VM: reconcile", STILL_RUNNING, locked("RUNNING", "IDLE+CLOUD+POWERED_DOWN"),
            ("reconcile",), None, no_retry=False, exit_code=EXIT_NODES_FAILED),  # a repair failed
    refused("unknown template name", r"no VM template named 'no-such-template'",
            edit("template = ", 'template = "no-such-template"'), ("resume",)),
    refused("unknown template id", r"template 99: .*Error getting", edit("template = ", "template = 99"),
            ("resume",)),
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
def test_bad_input_gives_one_clear_error_and_the_documented_exit(tmp_path, sim, case: Case, program: str
                                                                  ) -> None:
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
        if case.name == "unusable lock directory" and program == "resume":
            # No node can be locked: resume hands them back, so their jobs requeue now (issue 15, item 3).
            [handback] = [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
            assert handback[0] == "NodeName=gpu[01-02]"
        elif program == "resume" and done.returncode == EXIT_CONFIG:
            # The nodes slurmctld is powering up (all, by the fake's default) are handed back, nothing else;
            # a file that is not TOML, or none, does not name the site's scontrol (the fake): nothing then.
            unnamed = case.name in ("not TOML", "no configuration file")
            assert setup.updates() == ([] if unnamed else [[
                "NodeName=gpu[01-02]", "State=POWER_DOWN_FORCE",
                "Reason=nebula: configuration unusable: run slurm-nebula-power check"]])
        else:
            assert setup.scontrol_calls() == [], "no scontrol call on invalid input"
    if case.no_retry:
        assert "retrying" not in setup.log_text(), "oned's refusal is not retried"
    if program == "resume" and not case.invalid:
        [handback] = [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
        assert re.search(case.message, handback[-1]), f"the node's Reason says why: {handback}"
    if case.invalid:
        assert sim.vms() == []
