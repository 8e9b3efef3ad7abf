"""Secrets: no log line, no usage record, no stderr line and no Slurm Reason contains the password or the login
token.

This module runs after the other reliability modules (file order) and reads every credentials file and every
log the session wrote under its base temporary directory: the chaos, race, crash, bad-input, foreign and hung
runs included. Its own runs add a user:token session (one.user.login) through failures of every kind.
"""

from __future__ import annotations

import os
import stat

import pyone
from opsupport import show
from reliability_support import run_program, site
from simfixtures import AUTH

from slurm_nebula_power.cli import reconcile
from slurm_nebula_power.cli.main import resume_fail_main, resume_main, suspend_main

PASSWORD = AUTH.split(":", 1)[1]


def test_a_token_session_through_every_failure_is_never_written(tmp_path, sim) -> None:
    token = pyone.OneServer(sim.endpoint, session=AUTH).user.login("oneadmin", "", 3600, -1)
    setup = site(tmp_path / "token-site", sim, auth=f"oneadmin:{token}", boot_timeout=3, timeout=1,
                 retry_seconds=1, suspend_timeout=2, poll_max=0.2)
    sim.set_faults(transient_rate=0.3, boot_failure_rate=0.5)
    resume_main(["gpu[01-04]"], setup.env)
    setup.set_nodes(show("gpu01 State=IDLE+CLOUD+POWERED_DOWN", "gpu02 State=IDLE+CLOUD"))
    reconcile.main([], setup.env)
    suspend_main(["gpu[01-02]"], setup.env)
    sim.set_faults(transient_rate=0.0, quota_exceeded=True)
    resume_main(["gpu[05-06]"], setup.env)
    sim.set_faults(quota_exceeded=False)
    sim.set_authorized(False)
    resume_fail_main(["gpu[03-04]"], setup.env)
    sim.set_authorized(True)
    outputs = [run_program(setup, program, *args) for program, args in
               (("resume", ["gpu07"]), ("reconcile", []), ("suspend", ["gpu07"]))]
    (setup.root / "one_auth").write_text(f"oneadmin:{token}-revoked\n")
    outputs += [run_program(setup, program, *args) for program, args in
                (("resume", ["gpu08"]), ("reconcile", []), ("resume-fail", ["gpu08"]))]
    text = setup.log_text() + "".join(done.stdout + done.stderr for done in outputs) + setup.audit.read_text()
    assert "retrying" in text and "couldn't be authenticated" in text, "the failure paths did run"
    for secret in (token, PASSWORD):
        assert secret not in text
        assert secret not in (setup.scontrol_dir / "scontrol.calls.jsonl").read_text()


def test_no_log_of_the_session_holds_a_secret(tmp_path_factory) -> None:
    base = tmp_path_factory.getbasetemp()
    secrets = {PASSWORD}
    for auth in base.rglob("one_auth"):
        for line in auth.read_text().splitlines():
            secret = line.partition(":")[2].strip()
            if len(secret) >= 8:
                secrets.add(secret)
    # the logs, the usage records (audit.jsonl), the metrics files and the fake scontrol's argv records
    logs = [*base.rglob("*.log"), *base.rglob("*.jsonl"), *base.rglob("*.prom")]
    # regular files only: the security tests plant links, FIFOs and directories under these names
    logs = [path for path in logs if stat.S_ISREG(os.lstat(path).st_mode)]
    assert any(path.name == "audit.jsonl" and path.stat().st_size for path in logs), "usage records were written"
    assert logs, "the session wrote logs"
    leaks = [f"{path}:{n}" for path in logs
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if any(secret in line for secret in secrets)]
    assert leaks == [], f"secrets in {leaks[:5]}"
    print(f"\nsecrets: {len(secrets)} credentials checked against {len(logs)} logs "
          f"({sum(p.stat().st_size for p in logs)} bytes): none found")
