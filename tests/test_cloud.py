"""OneCloud below the programs: the retry schedule, the transport, and the pool parser."""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from simfixtures import AUTH

from slurm_nebula_power.cloud import OneCloud
from slurm_nebula_power.config import OneConfig
from slurm_nebula_power.errors import (
    ActionRefused,
    CloudAuthError,
    CredentialsRefused,
    QuotaExceeded,
    TransientCloudError,
)
from slurm_nebula_power.model import ACTIVE, LCM_INIT, PENDING, RUNNING_LCM, Vm, vms_from_xml
from slurm_nebula_power.onerpc import translate


def cloud_for(endpoint: str = "http://127.0.0.1:9/RPC2", timeout: float = 5.0,
              retry_seconds: float = 60.0) -> tuple[OneCloud, list[float]]:
    slept: list[float] = []
    config = OneConfig(endpoint=endpoint, auth_file=Path("/nonexistent"), session=AUTH, timeout=timeout,
                       retry_seconds=retry_seconds)
    return OneCloud(config, sleep=slept.append), slept


def failing(times: int, error: Exception | None = None):  # type: ignore[no-untyped-def]
    """A call that fails `times` times with a transient error (or `error`), then answers 7."""
    attempts: list[int] = []

    def fn(server: object) -> int:
        attempts.append(1)
        if len(attempts) <= times:
            raise error or TransientCloudError(f"[one.x] attempt {len(attempts)} failed")
        return 7

    return fn, attempts


# ---- the retry schedule ----------------------------------------------------------------------------


def test_a_call_that_answers_at_once_is_one_attempt_without_sleep() -> None:
    cloud, slept = cloud_for()
    fn, attempts = failing(0)
    assert cloud.call("x", fn) == 7
    assert (len(attempts), slept, cloud.stats.calls, cloud.stats.retries) == (1, [], 1, 0)


def test_transient_failures_are_retried_with_exponential_backoff_and_jitter(caplog) -> None:
    cloud, slept = cloud_for()
    fn, attempts = failing(3)
    with caplog.at_level(logging.WARNING, logger="slurm_nebula_power.cloud"):
        assert cloud.call("vm.action 5", fn) == 7
    assert len(attempts) == 4 and (cloud.stats.calls, cloud.stats.retries) == (4, 3)
    for delay, base in zip(slept, (0.2, 0.4, 0.8), strict=True):
        assert base <= delay <= base + 0.5
    assert [r.getMessage() for r in caplog.records] == [
        f"retrying vm.action 5 after attempt {n}: [one.x] attempt {n} failed" for n in (1, 2, 3)]


def test_backoff_is_capped_at_five_seconds_plus_jitter() -> None:
    cloud, slept = cloud_for(retry_seconds=1e9)
    fn, _ = failing(8)
    assert cloud.call("x", fn) == 7
    assert all(5.0 <= delay <= 5.5 for delay in slept[5:]) and len(slept) == 8


def test_the_budget_counts_from_the_first_attempt() -> None:
    cloud, slept = cloud_for(retry_seconds=0.3)

    def slow_failure(server: object) -> int:
        time.sleep(0.4)
        raise TransientCloudError("[one.x] no answer within the timeout")

    with pytest.raises(TransientCloudError, match="no answer"):
        cloud.call("x", slow_failure)
    assert (slept, cloud.stats.calls, cloud.stats.retries) == ([], 1, 0), "the first attempt spent the budget"


def test_a_deadline_shorter_than_the_budget_wins() -> None:
    cloud, slept = cloud_for(retry_seconds=60)
    fn, attempts = failing(100)
    with pytest.raises(TransientCloudError):
        cloud.call("x", fn, deadline=time.monotonic() - 1)
    assert (len(attempts), slept) == (1, [])


@pytest.mark.parametrize("retry", [True, False])
def test_refusals_are_never_retried_and_retry_false_stops_at_the_first_failure(retry: bool) -> None:
    cloud, slept = cloud_for()
    refused, attempts = failing(1, ActionRefused("[one.vm.action] not in this state", 0x800))
    with pytest.raises(ActionRefused):
        cloud.call("x", refused, retry=retry)
    assert (len(attempts), slept) == (1, [])
    transient, attempts = failing(1)
    if retry:
        assert cloud.call("x", transient, retry=True) == 7 and len(attempts) == 2
    else:
        with pytest.raises(TransientCloudError):
            cloud.call("x", transient, retry=False)
        assert len(attempts) == 1


# ---- the transport ---------------------------------------------------------------------------------


def test_calls_share_a_kept_alive_connection_and_survive_the_server_closing_it(sim) -> None:
    accepted: list[object] = []
    serve = sim.server.httpd.process_request

    def counting(request, address):  # type: ignore[no-untyped-def]
        accepted.append(address)
        return serve(request, address)

    sim.server.httpd.process_request = counting
    cloud, slept = cloud_for(sim.endpoint)
    for _ in range(70):  # the simulator closes a connection after 30 calls, as oned's default does
        assert cloud.version()
    assert len(accepted) == 3 and (cloud.stats.retries, slept) == (0, [])


def test_a_silent_server_times_out_within_the_timeout() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True).start()
    try:
        cloud, _ = cloud_for(f"http://127.0.0.1:{listener.getsockname()[1]}/RPC2", timeout=0.5,
                             retry_seconds=0.1)
        # The server never answers: only the 0.5 s timeout can end this call.  The 30 s wait is a hang guard
        # (without the timeout the call would never return), not a measure of speed.
        call = concurrent.futures.ThreadPoolExecutor(1)
        try:
            with pytest.raises(TransientCloudError, match="no answer within the timeout"):
                call.submit(cloud.version).result(timeout=30)
        finally:
            call.shutdown(wait=False)
    finally:
        listener.close()
        for conn in held:
            conn.close()


def test_a_refused_connection_is_transient() -> None:
    cloud, _ = cloud_for("http://127.0.0.1:9/RPC2", retry_seconds=0.1)
    with pytest.raises(TransientCloudError, match="connection failed"):
        cloud.version()


def test_an_answer_that_is_not_xml_rpc_is_transient() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def garbage() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/xml\r\nContent-Length: 9\r\n\r\n<methodRe")
            conn.close()

    threading.Thread(target=garbage, daemon=True).start()
    try:
        cloud, _ = cloud_for(f"http://127.0.0.1:{listener.getsockname()[1]}/RPC2", retry_seconds=0.1)
        with pytest.raises(TransientCloudError, match="unreadable answer"):
            cloud.version()
    finally:
        listener.close()


def test_large_escaped_answers_are_read_whole(sim) -> None:
    for n in range(200):  # the default network leases 253 addresses
        sim.add_vm(name=f"gpu{n:03d}", user_template={"SLURM_CLUSTER": "c1", "SLURM_NODENAME": f"gpu{n:03d}",
                                                       "NOTE": "a < b & c > d"}, state="PENDING")
    cloud, _ = cloud_for(sim.endpoint)
    vms = cloud.cluster_vms("c1")
    assert len(vms) == 200 and {vm.user_template["NOTE"] for vm in vms} == {"a < b & c > d"}


# ---- the pool parser -------------------------------------------------------------------------------

POOL = """<VM_POOL>
<VM><ID>7</ID><NAME>gpu01</NAME><STATE>3</STATE><LCM_STATE>3</LCM_STATE><STIME>100</STIME>
  <TEMPLATE><CONTEXT><ETH0_IP>10.0.0.9</ETH0_IP></CONTEXT><NIC><NETWORK>a</NETWORK></NIC>
    <NIC><IP>10.0.0.1</IP></NIC><NIC><IP>10.0.0.2</IP></NIC></TEMPLATE>
  <USER_TEMPLATE><SLURM_CLUSTER><![CDATA[c1]]></SLURM_CLUSTER><EMPTY></EMPTY>
    <SCHED_ACTION><ID>1</ID></SCHED_ACTION></USER_TEMPLATE>
  <HISTORY_RECORDS><HISTORY><HOSTNAME>h1</HOSTNAME></HISTORY><HISTORY><HOSTNAME>h2</HOSTNAME></HISTORY>
  </HISTORY_RECORDS></VM>
<VM><ID>8</ID><NAME>gpu02</NAME><STATE>1</STATE><LCM_STATE>0</LCM_STATE><TEMPLATE/></VM>
</VM_POOL>"""


def test_pool_documents_give_the_fields_the_programs_use() -> None:
    first, second = vms_from_xml(POOL)
    assert first == Vm(id=7, name="gpu01", state=ACTIVE, lcm_state=RUNNING_LCM, ip="10.0.0.1", host="h2", stime=100,
                       user_template={"SLURM_CLUSTER": "c1", "EMPTY": ""}, context={"ETH0_IP": "10.0.0.9"})
    assert second == Vm(id=8, name="gpu02", state=PENDING, lcm_state=LCM_INIT)


def test_context_is_read_from_template_never_from_a_guests_user_template_copy() -> None:
    # A guest's OneGate PUT of CONTEXT=[...] lands in USER_TEMPLATE/CONTEXT (real-oned.md): never identity.
    doc = ("<VM><ID>1</ID><NAME>gpu01</NAME><STATE>3</STATE><LCM_STATE>3</LCM_STATE>"
           "<USER_TEMPLATE><CONTEXT><SLURM_NODENAME>gpu01</SLURM_NODENAME><SLURM_CLUSTER>c1</SLURM_CLUSTER>"
           "</CONTEXT><SLURM_CLUSTER>c1</SLURM_CLUSTER><SLURM_NODENAME>gpu01</SLURM_NODENAME></USER_TEMPLATE>"
           "<TEMPLATE><CONTEXT><NETWORK>YES</NETWORK></CONTEXT></TEMPLATE></VM>")
    [vm] = vms_from_xml(doc)
    assert vm.context == {"NETWORK": "YES"}
    assert not vm.is_ours("c1", "gpu01") and vm.is_impostor("c1", {"gpu01"})


def test_one_vm_document_parses_like_a_pool_of_one() -> None:
    body = ET.tostring(ET.fromstring(POOL).find("VM"), encoding="unicode")
    assert vms_from_xml(body) == vms_from_xml(POOL)[:1]



@pytest.mark.parametrize(("message", "code", "kind"), [
    # real oned 7.0.2 / 7.4.0 (tests/test_contract.py): instantiate and resume over a user's VM quota
    ("[one.template.instantiate] User [2] : user [2] limit of 0 reached for VMS quota in VM.", 0x200, QuotaExceeded),
    ("[one.vm.action] user [3] limit of 0 reached for RUNNING_VMS quota in VM", 0x800, QuotaExceeded),
    # forms from the source, not seen: a group quota (SharedAPI.cc's "Group [N] " prefix), 7.4's cluster quota
    ("[one.template.instantiate] Group [1] : group [1] limit of 8 reached for CPU quota in VM.", 0x200,
     QuotaExceeded),
    ("[one.template.instantiate] User [2] : user [2] limit of 4 reached for RUNNING_VMS quota in VM with ID: 0",
     0x200, QuotaExceeded),
    ("[one.vm.info] User couldn't be authenticated, aborting call.", 0x100, CredentialsRefused),
    ("[one.hostpool.info] User [2] not authorized to perform action on host.", 0x200, CloudAuthError),
    ('[one.vm.action] Error performing action "resume": This action is not available for state RUNNING', 0x800,
     ActionRefused),
])
def test_quota_refusals_are_told_apart_from_auth_failures_and_refused_actions(message, code, kind) -> None:
    assert type(translate(message, code)) is kind
