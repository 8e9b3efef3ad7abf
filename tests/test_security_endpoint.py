"""A hostile OpenNebula endpoint (issue 15, items 1 and 5): a proxy in front of the simulator that drips,
floods or rewrites its answers. Every program still ends within its bounds, hands back what it could not
do, and lets nothing it was told reach scontrol or the log unchecked.

The programs run as processes (the installed console scripts); a guard on each wait fails the test if one
hangs, and what is asserted is the exit code, the hand-back and the log.
"""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
import threading
import time
from datetime import datetime

import pytest
from hostile import HostileEndpoint
from reliability_support import live_ours, run_env, run_program, site
from simfixtures import AUTH
from test_cli import program
from test_security_guest import guest_put

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


def _in_host_pool(rewrite):
    """A rewrite of host pool answers only."""
    return lambda body: rewrite(body) if b"&lt;HOST_POOL&gt;" in body else body


HOST_POOL_DAMAGE = {
    "vmid-not-a-number": _in_host_pool(lambda b: re.sub(rb"&lt;VMID&gt;.*?&lt;/VMID&gt;",
                                                         b"&lt;VMID&gt;free&lt;/VMID&gt;", b)),
    "vmid-superscript": _in_host_pool(lambda b: re.sub(rb"&lt;VMID&gt;.*?&lt;/VMID&gt;",
                                                        "&lt;VMID&gt;\u00b2&lt;/VMID&gt;".encode(), b)),
    "host-id-5000-digits": _in_host_pool(lambda b: re.sub(rb"&lt;ID&gt;(\d+)&lt;/ID&gt;",
                                                           b"&lt;ID&gt;" + b"9" * 5000 + b"&lt;/ID&gt;", b, count=1)),
    "truncated": _in_host_pool(lambda b: b.replace(b"&lt;/HOST_POOL&gt;", b"&lt;HOST")),
}


@pytest.mark.parametrize("damage", list(HOST_POOL_DAMAGE))
def test_a_malformed_host_pool_is_unknown_capacity_never_a_crash(tmp_path, sim, damage: str) -> None:
    # issue 22, item 5: a PCI VMID that is not a number, or a truncated document, made resume hand back every
    # node as "internal error in resume" and reconcile print a traceback
    proxy = HostileEndpoint(sim.endpoint, rewrite=HOST_POOL_DAMAGE[damage])
    try:
        setup = site(tmp_path / "site", proxy, boot_timeout=20, **TIGHT)
        done = run_program(setup, "resume", "gpu[01-02]", guard=60)
        tidy = run_program(setup, "reconcile", guard=60)
        status = subprocess.run([program("slurm-nebula-power"), "status", "--capacity"], env=run_env(setup),
                                capture_output=True, text=True, timeout=60)
    finally:
        proxy.close()
    assert done.returncode == 0, done.stderr + setup.log_text()[-1500:]
    log = setup.log_text()
    assert "GPU capacity not checked" in log and "unreadable document" in log
    assert "internal error" not in log and "Traceback" not in log + tidy.stderr + status.stderr
    assert sorted(live_ours(sim)) == ["gpu01", "gpu02"], "the nodes were resumed regardless"
    assert tidy.returncode == 0, tidy.stderr
    assert status.returncode != 0 and "unreadable document" in status.stderr, status.stderr


def _slow_host_pool(seconds: float):
    def rewrite(body: bytes) -> bytes:
        if b"&lt;HOST_POOL&gt;" in body:
            time.sleep(seconds)
        return body
    return rewrite


@pytest.mark.parametrize("damage", ["vmid-not-a-number", "truncated", "slow"])
def test_a_host_pool_unparsable_or_slower_than_boot_timeout_is_not_retried_and_the_resume_ends(tmp_path, sim,
                                                                                               damage: str) -> None:
    # issue 34, item 12: behind an endpoint that made the host pool unparsable, resume retried it for
    # retry_seconds (past boot_timeout) as if it were transient, then never sent a VM and never ended,
    # its node locks held: the nodes its first wave could no longer send were dropped, never given up
    rewrite = _slow_host_pool(5) if damage == "slow" else HOST_POOL_DAMAGE[damage]
    proxy = HostileEndpoint(sim.endpoint, rewrite=rewrite)
    try:
        setup = site(tmp_path / "site", proxy, boot_timeout=3, timeout=10, retry_seconds=6, retry_backoff=0.5)
        done = run_program(setup, "resume", "gpu[01-02]", guard=60)
    finally:
        proxy.close()
    log = setup.log_text()
    assert "retrying hostpool.info" not in log, "an answer that cannot be parsed is not retried"
    if damage == "slow":  # the read alone took boot_timeout: the nodes are handed back, nothing is left
        assert done.returncode == EXIT_NODES_FAILED, log[-1500:]
        assert "not sent within boot_timeout" in log
        assert handed_back(setup) == ["NodeName=gpu[01-02]"]
        assert live_ours(sim) == {}
    else:  # capacity unknown at once: the nodes are resumed as before
        assert done.returncode == 0, log[-1500:]
        assert sorted(live_ours(sim)) == ["gpu01", "gpu02"]


LAUGHS = ('<!DOCTYPE x [<!ENTITY a "' + "a" * 1000 + '">'
          + "".join(f'<!ENTITY {chr(98 + i)} "{("&" + chr(97 + i) + ";") * 10}">' for i in range(6)) + "]>")


def _entities_in_answer(body: bytes) -> bytes:
    """The XML-RPC answer itself declares nested entities (10**6 x 1 KB once expanded) and uses them."""
    if b"<methodResponse>" not in body:
        return body
    body = body.replace(b"<methodResponse>", LAUGHS.encode() + b"<methodResponse>", 1)
    return body.replace(b"<string>", b"<string>&g;", 1)


def _entities_in_vm_pool(body: bytes) -> bytes:
    """The VM pool document inside the answer (escaped in its XML-RPC string) declares them."""
    if b"&lt;VM_POOL&gt;" not in body:
        return body
    escaped = LAUGHS.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").encode()
    return body.replace(b"&lt;VM_POOL&gt;", escaped + b"&lt;VM_POOL&gt;&amp;g;", 1)


@pytest.mark.parametrize("where", ["XML-RPC answer", "VM pool document"])
def test_entities_in_an_answer_are_refused_in_bounded_memory(tmp_path, sim, where: str) -> None:
    # issue 34, item 3: a DOCTYPE with nested entities took resume to 1.6 GB RSS from a 457 KB answer
    rewrite = _entities_in_answer if where == "XML-RPC answer" else _entities_in_vm_pool
    proxy = HostileEndpoint(sim.endpoint, rewrite=rewrite)
    try:
        setup = site(tmp_path / "site", proxy, boot_timeout=20, **TIGHT)
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        done = run_program(setup, "resume", "gpu[01-02]", guard=60)
        peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    finally:
        proxy.close()
    log = setup.log_text()
    assert done.returncode != 0 and "a DOCTYPE, which oned never sends" in log, log[-1500:]
    assert handed_back(setup) == ["NodeName=gpu[01-02]"]
    assert peak_kb < max(before, 300 * 1024), f"resume peaked at {peak_kb // 1024} MB"
    assert live_ours(sim) == {}


def test_a_doctype_a_guest_writes_into_a_value_is_text_not_a_declaration(tmp_path, sim) -> None:
    # the variant the refusal must not turn into a denial of service: the words in a CDATA value of a VM's
    # USER_TEMPLATE (which a guest writes through OneGate) leave every other node's resume alone
    setup = site(tmp_path / "site", sim, boot_timeout=20, **TIGHT)
    assert run_program(setup, "resume", "gpu01", guard=60).returncode == 0
    [vm] = live_ours(sim)["gpu01"]
    assert guest_put(sim, vm.id, "NOTE=<!DOCTYPE x SYSTEM 'file:///etc/passwd'> <!ENTITY c 'd'> &c;") == 200
    assert "<!DOCTYPE" in sim.vm(vm.id).user_template["NOTE"]
    assert run_program(setup, "resume", "gpu02", guard=60).returncode == 0
    assert sorted(live_ours(sim)) == ["gpu01", "gpu02"]


def _hostname(value: bytes):
    return lambda body: re.sub(rb"&lt;HOSTNAME&gt;[^&]*&lt;/HOSTNAME&gt;", b"&lt;HOSTNAME&gt;" + value +
                               b"&lt;/HOSTNAME&gt;", body)


def _up_and_down_behind(tmp_path, sim, rewrite, nodes: str):
    """Resume nodes and suspend the first behind a proxy that rewrites OpenNebula's answers; the site."""
    proxy = HostileEndpoint(sim.endpoint, rewrite=rewrite)
    try:
        setup = site(tmp_path / "site", proxy, boot_timeout=20, **TIGHT)
        assert run_program(setup, "resume", nodes, guard=60).returncode == 0
        assert run_program(setup, "suspend", "gpu01", guard=60).returncode == 0
    finally:
        proxy.close()
    return setup


def test_a_4_mb_host_name_makes_no_4_mb_usage_record(tmp_path, sim) -> None:
    # issue 22, item 6: the records were unbounded; the docs promise far below 4 KiB a line
    setup = _up_and_down_behind(tmp_path, sim, _hostname(b"h" * (4 << 20)), "gpu01")
    lines = setup.audit.read_bytes().splitlines()
    assert lines and max(len(line) for line in lines) < 1000, [len(line) for line in lines]
    assert any(b'"event":"running"' in line and b'"host":"hhh' in line for line in lines)
    assert len(setup.log.read_bytes()) < 1 << 20, "nor a 4 MB log"


def test_a_newline_in_a_host_name_forges_no_row_of_status_or_usage(tmp_path, sim) -> None:
    forged = b"host01\ngpu99     FORGED-ROW\r"
    proxy = HostileEndpoint(sim.endpoint, rewrite=_hostname(forged))
    try:
        setup = site(tmp_path / "site", proxy, boot_timeout=20, **TIGHT)
        assert run_program(setup, "resume", "gpu[01-02]", guard=60).returncode == 0
        status = subprocess.run([program("slurm-nebula-power"), "status", "gpu[01-02]"], env=run_env(setup),
                                capture_output=True, text=True, timeout=60)
        usage = subprocess.run([program("slurm-nebula-power"), "usage", "--by", "host", "--no-cloud"],
                               env=run_env(setup), capture_output=True, text=True, timeout=60)
    finally:
        proxy.close()
    for shown in (status, usage):
        assert "FORGED-ROW" in shown.stdout, shown.stderr  # the value is shown, escaped, in its own cell
        assert not [line for line in shown.stdout.splitlines() if line.startswith("gpu99")], shown.stdout
        assert "\r" not in shown.stdout
    assert [line.split()[0] for line in status.stdout.splitlines()][:3] == ["NODE", "gpu01", "gpu02"]


@pytest.mark.parametrize("name", ["\u00b2", "\u0663", "9" * 5000], ids=["superscript", "arabic-indic", "5000-digits"])
def test_a_host_name_of_digits_int_refuses_groups_usage_like_any_name(tmp_path, sim, name: str) -> None:
    # `usage --by host` sorted a row as a number when str.isdigit() said so, then int() refused "²": a
    # traceback and exit 1, the variant of issue 22 item 1 in the usage table's order (other digits and
    # 5,000 of them, cut to 80 in the record, are the variants a fix by isdigit() alone would miss)
    setup = _up_and_down_behind(tmp_path, sim, _hostname(name.encode()), "gpu[01-02]")
    for by in ("host", "job", "vm", "nodeset"):
        usage = subprocess.run([program("slurm-nebula-power"), "usage", "--by", by, "--no-cloud", "--json"],
                               env=run_env(setup), capture_output=True, text=True, timeout=60)
        assert usage.returncode == 0 and "Traceback" not in usage.stderr, (by, usage.stderr)
        rows = json.loads(usage.stdout)["rows"]
        assert sum(len(row["vms"]) for row in rows) == 2, rows
        if by == "host":
            assert {row["host"] for row in rows} == {name[:80]}, "the name kept as the host, its record's length"


def _in_template_answers(rewrite):
    """A rewrite of the template pool's and a template's answers only (pyone binds those)."""
    return lambda body: rewrite(body) if b"&lt;VMTEMPLATE" in body else body


TEMPLATE_DAMAGE = {
    "id-superscript": _in_template_answers(lambda b: re.sub(rb"&lt;ID&gt;\d+&lt;/ID&gt;",
                                                            "&lt;ID&gt;\u00b2&lt;/ID&gt;".encode(), b)),
    "id-not-a-number": _in_template_answers(lambda b: re.sub(rb"&lt;ID&gt;\d+&lt;/ID&gt;", b"&lt;ID&gt;x&lt;/ID&gt;",
                                                             b)),
    "id-5000-digits": _in_template_answers(lambda b: re.sub(rb"&lt;ID&gt;\d+&lt;/ID&gt;",
                                                            b"&lt;ID&gt;" + b"9" * 5000 + b"&lt;/ID&gt;", b)),
    "truncated": _in_template_answers(lambda b: re.sub(rb"&lt;/VMTEMPLATE(_POOL)?&gt;", b"&lt;VMTEMPLATE", b)),
}


@pytest.mark.parametrize("damage", list(TEMPLATE_DAMAGE))
def test_a_malformed_template_answer_hands_the_nodes_back_never_an_internal_error(tmp_path, sim, damage) -> None:
    # The variant of issue 22 item 5 in the answers pyone binds (one.templatepool.info, one.template.info):
    # an ID that is not a number made pyone raise its own parse error, and resume handed every node back as
    # "internal error in resume" with exit 4 (check and slurm-conf: a traceback)
    proxy = HostileEndpoint(sim.endpoint, rewrite=TEMPLATE_DAMAGE[damage])
    try:
        setup = site(tmp_path / "site", proxy, boot_timeout=20, **TIGHT)
        done = run_program(setup, "resume", "gpu[01-02]", guard=60)
        shown = {command: subprocess.run([program("slurm-nebula-power"), command], env=run_env(setup),
                                         capture_output=True, text=True, timeout=60)
                 for command in ("check", "slurm-conf")}
    finally:
        proxy.close()
    assert done.returncode == EXIT_NODES_FAILED, done.stderr
    log = setup.log_text()
    assert "internal error" not in log and "Traceback" not in log, log[-2000:]
    assert "unreadable document" in log
    assert handed_back(setup) == ["NodeName=gpu[01-02]"] and live_ours(sim) == {}
    for command, answer in shown.items():
        assert "Traceback" not in answer.stderr and answer.returncode in (1, 4), (command, answer.stderr)
        assert "unreadable document" in answer.stdout + answer.stderr, (command, answer.stdout, answer.stderr)
        assert "create the template" not in answer.stdout, "no template's fault"


def test_a_template_answer_with_a_doctype_is_refused_and_its_entities_never_read(tmp_path, sim) -> None:
    # pyone binds these answers with lxml, which before 5.0 resolves a DOCTYPE's external entities: a
    # proxy's SYSTEM "file:///..." entity would put a local file (as root: /etc/shadow) in the template, and
    # check prints a template's CONTEXT values
    secret = tmp_path / "secret"
    secret.write_text("Victim-Pa55word\n")
    entity = f'&lt;!DOCTYPE VMTEMPLATE_POOL [&lt;!ENTITY e SYSTEM "file://{secret}"&gt;]&gt;'.encode()

    def plant(body: bytes) -> bytes:
        body = body.replace(b"&lt;VMTEMPLATE_POOL&gt;", entity + b"&lt;VMTEMPLATE_POOL&gt;", 1)
        return re.sub(rb"&lt;NAME&gt;slurm-gpu-worker&lt;/NAME&gt;", b"&lt;NAME&gt;&amp;e;&lt;/NAME&gt;", body)

    proxy = HostileEndpoint(sim.endpoint, rewrite=_in_template_answers(plant))
    try:
        setup = site(tmp_path / "site", proxy, boot_timeout=20, **TIGHT)
        done = run_program(setup, "resume", "gpu01", guard=60)
        check = subprocess.run([program("slurm-nebula-power"), "check"], env=run_env(setup), capture_output=True,
                               text=True, timeout=60)
    finally:
        proxy.close()
    assert done.returncode == EXIT_NODES_FAILED, done.stderr
    log = setup.log_text()
    assert "a DOCTYPE, which oned never sends" in log and "a DOCTYPE, which oned never sends" in check.stdout
    assert "Victim-Pa55word" not in log + check.stdout + check.stderr + done.stderr


def test_a_newline_in_oned_s_answers_forges_no_line_of_check(tmp_path, sim) -> None:
    # issue 22 item 6's variant in check: its lines quoted oned's version (and a template's CONTEXT, oned's
    # error texts) as answered, so a rewriting proxy could add an `ok` line or overwrite a problem with \r
    forged = b"6.10.0\nok       FORGED: every problem solved&#13;"
    proxy = HostileEndpoint(sim.endpoint, rewrite=lambda body: body.replace(b">6.10.0<", b">" + forged + b"<"))
    try:
        setup = site(tmp_path / "site", proxy, boot_timeout=20, **TIGHT)
        check = subprocess.run([program("slurm-nebula-power"), "check"], env=run_env(setup), capture_output=True,
                               text=True, timeout=60)
    finally:
        proxy.close()
    assert "FORGED" in check.stdout, "the answer was rewritten and shown"
    assert not [line for line in check.stdout.splitlines() if line.startswith("ok       FORGED")], check.stdout
    assert "\r" not in check.stdout


def test_refuse_doctype_stops_at_a_declaration_and_leaves_cdata_text_alone() -> None:
    from slurm_nebula_power.model import refuse_doctype

    with pytest.raises(ValueError, match="DOCTYPE"):
        refuse_doctype(LAUGHS + "<VM_POOL>&g;</VM_POOL>")
    with pytest.raises(ValueError, match="DOCTYPE"):
        refuse_doctype("<?xml version='1.0'?>\n<!DOCTYPE VM_POOL SYSTEM 'file:///etc/passwd'><VM_POOL/>")
    refuse_doctype("<VM><USER_TEMPLATE><NOTE><![CDATA[<!DOCTYPE x [<!ENTITY a 'b'>]>]]></NOTE></USER_TEMPLATE></VM>")
    refuse_doctype("<VM><NAME>gpu01</NAME></VM>")



def _answer_echoing(session: str, kind: str, padding: int):
    """Every answer replaced: oned's failure array, or an XML-RPC fault, whose text repeats the call's session
    (as an endpoint echoing its parameters would), then `padding` characters."""
    text = f"[one.call] refused the call ({session}, -3, -1): try again" + "x" * padding
    if kind == "fault":
        body = ("<?xml version='1.0'?><methodResponse><fault><value><struct><member><name>faultCode</name>"
                "<value><int>1</int></value></member><member><name>faultString</name><value><string>"
                f"{text}</string></value></member></struct></value></fault></methodResponse>")
    else:
        body = ("<?xml version='1.0'?><methodResponse><params><param><value><array><data>"
                f"<value><boolean>0</boolean></value><value><string>{text}</string></value>"
                "<value><i4>2048</i4></value></data></array></value></param></params></methodResponse>")
    return lambda _: body.encode()


@pytest.mark.parametrize("kind", ["oned's failure", "fault"])
@pytest.mark.parametrize("padding", [0, 1 << 20])
def test_an_answer_that_echoes_the_session_publishes_it_nowhere_and_is_cut(tmp_path, sim, kind: str,
                                                                           padding: int) -> None:
    # issue 34, items 7 and 10: a fault repeating the call's parameters put the password into three log lines
    # and a node's Reason (sinfo -R, scontrol's command line); a 1 MB fault was a 1 MB log line per node
    proxy = HostileEndpoint(sim.endpoint, rewrite=_answer_echoing(AUTH, kind, padding))
    try:
        setup = site(tmp_path / "site", proxy, boot_timeout=20, **TIGHT)
        done = run_program(setup, "resume", "gpu[01-02]", guard=60)
    finally:
        proxy.close()
    assert done.returncode != 0
    said = setup.log_text() + done.stdout + done.stderr + json.dumps(setup.scontrol_calls())
    assert setup.password not in said, "the session's secret in a log line, an error or a Reason"
    assert "<session>" in said
    assert max(len(line) for line in setup.log_text().splitlines()) < 4000
    assert handed_back(setup) == ["NodeName=gpu[01-02]"]


def test_with_oned_gone_mid_resume_the_nodes_are_handed_back_within_one_retry_window(tmp_path, sim) -> None:
    # issue 34, item 13: oned killed 1.5 s into a 4-node resume: each call retried for retry_seconds of its own,
    # so the nodes were handed back after 316 s, 142 calls, 123 retries, each refused at once
    sim.set_durations(prolog=0.2, boot=60)  # the VMs stay in BOOT: resume is watching when oned goes
    proxy = HostileEndpoint(sim.endpoint)
    setup = site(tmp_path / "site", proxy, boot_timeout=120, timeout=1, retry_seconds=4, retry_backoff=0.2,
                 poll_max=0.2)
    closer = threading.Thread(target=lambda: (sim.wait_for(lambda: len(sim.vms()) == 4, 30), time.sleep(0.5),
                                              proxy.close()))
    closer.start()
    done = run_program(setup, "resume", "gpu[01-04]", guard=90)
    closer.join()
    log = setup.log_text()
    assert done.returncode == EXIT_NODES_FAILED, log[-1500:]
    assert handed_back(setup) == ["NodeName=gpu[01-04]"]
    stamps = [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() for line in log.splitlines()
              if " WARNING retrying " in line]
    assert stamps, "it did retry while OpenNebula was away"
    assert stamps[-1] - stamps[0] <= 4 + 1 + 1, "retries end once the run's retry window (retry_seconds) is over"
