"""The simulator's XML-RPC methods through real pyone over real HTTP: normal paths and every error code."""

from __future__ import annotations

import re
import xmlrpc.client

import pyone
import pytest

from opennebula_sim import Durations, SimConfig, running_simulator
from opennebula_sim.handle import Simulator

# the simulator conftest's `sim` fixture runs
SIM_CONFIG = FAST = SimConfig(durations=Durations(prolog=0, boot=0, shutdown=0, epilog=0))


def _running(sim: Simulator, vm_id: int) -> bool:
    return sim.vm(vm_id).state_str == "RUNNING"


def test_endpoint_is_loopback_rpc2(sim: Simulator) -> None:
    assert sim.endpoint.startswith("http://127.0.0.1:") and sim.endpoint.endswith("/RPC2")
    assert sim.auth == "oneadmin:secret"


def test_instantiate_returns_new_ids_and_vm_runs(sim: Simulator, one: pyone.OneServer) -> None:
    first = one.template.instantiate(0, "gpu-a", False, "", False)
    second = one.template.instantiate(0, "gpu-b", False, "", False)
    assert (first, second) == (0, 1)
    sim.wait_for(lambda: _running(sim, first) and _running(sim, second), 5)
    vm = one.vm.info(first)
    assert (vm.ID, vm.NAME, vm.STATE, vm.LCM_STATE) == (first, "gpu-a", 3, 3)
    assert vm.HISTORY_RECORDS.HISTORY[0].HOSTNAME == "gpu-host-01"
    assert vm.DEPLOY_ID == f"one-{first}"


def test_instantiate_without_name_uses_template_name_and_id(one: pyone.OneServer) -> None:
    vm_id = one.template.instantiate(1, "", False, "", False)
    assert one.vm.info(vm_id).NAME == f"slurm-cpu-worker-{vm_id}"


def test_pending_vm_already_shows_its_leased_ip(sim: Simulator, one: pyone.OneServer) -> None:
    vm_id = one.template.instantiate(0, "held", True, "", False)
    vm = one.vm.info(vm_id)
    assert vm.STATE == 2  # HOLD: never scheduled, yet oned leased the address at allocation
    assert vm.TEMPLATE["NIC"]["IP"] == "127.0.1.1"
    assert vm.TEMPLATE["CONTEXT"]["ETH0_IP"] == "127.0.1.1"


def test_extra_template_string_form_splits_user_template_and_template(one: pyone.OneServer) -> None:
    extra = 'SLURM_NODE = "gpu-007"\nVCPU = "16"\nCONTEXT = [ NETWORK = "YES", SLURM_ROLE = "worker" ]'
    vm = one.vm.info(one.template.instantiate(0, "x", True, extra, False))
    assert vm.USER_TEMPLATE["SLURM_NODE"] == "gpu-007"
    assert vm.TEMPLATE["VCPU"] == "16"
    assert "VCPU" not in vm.USER_TEMPLATE
    assert vm.TEMPLATE["CONTEXT"]["SLURM_ROLE"] == "worker"
    # oned's Template::merge replaces CONTEXT wholesale: the template's SET_HOSTNAME is gone
    assert "SET_HOSTNAME" not in vm.TEMPLATE["CONTEXT"]


def test_extra_template_xml_form_and_pyone_dicts(one: pyone.OneServer) -> None:
    nested = {"TEMPLATE": {"SLURM_NODE": "gpu-9", "CONTEXT": {"NETWORK": "YES", "SET_HOSTNAME": "$NAME"}}}
    vm = one.vm.info(one.template.instantiate(0, "gpu-9", True, nested, False))
    assert vm.USER_TEMPLATE["SLURM_NODE"] == "gpu-9"
    assert vm.TEMPLATE["CONTEXT"]["SET_HOSTNAME"] == "gpu-9"
    flat = one.vm.info(one.template.instantiate(0, "flat", True, {"SLURM_NODE": "gpu-10"}, False))
    assert flat.USER_TEMPLATE["SLURM_NODE"] == "gpu-10"


def test_vmpool_info_is_short_and_infoextended_is_full(sim: Simulator, one: pyone.OneServer) -> None:
    vm_id = one.template.instantiate(0, "gpu-a", False, "SLURM_NODE = gpu-a", False)
    sim.wait_for(lambda: _running(sim, vm_id), 5)
    short = one.vmpool.info(-2, -1, -1, -1).VM[0]
    assert short.TEMPLATE["NIC"]["IP"] == "127.0.1.1"
    assert "SLURM_NODE" not in short.USER_TEMPLATE
    assert "CONTEXT" not in short.TEMPLATE and "PCI" not in short.TEMPLATE
    full = one.vmpool.infoextended(-2, -1, -1, -1).VM[0]
    assert full.USER_TEMPLATE["SLURM_NODE"] == "gpu-a"
    assert full.TEMPLATE["PCI"]["VENDOR"] == "10de"
    assert full.TEMPLATE["PCI"]["ADDRESS"] == "0000:41:00:0"


def test_vmpool_state_filter(sim: Simulator, one: pyone.OneServer) -> None:
    done = one.template.instantiate(1, "done", True, "", False)
    one.vm.action("terminate", done)
    held = one.template.instantiate(1, "held", True, "", False)
    assert [v.ID for v in one.vmpool.info(-2, -1, -1, -2).VM] == [held, done]
    assert [v.ID for v in one.vmpool.info(-2, -1, -1, -1).VM] == [held]
    assert [v.ID for v in one.vmpool.info(-2, -1, -1, 6).VM] == [done]
    assert one.vmpool.info(-2, -1, -1, 3).VM == []


def test_vmpool_owner_filter(sim: Simulator, one: pyone.OneServer) -> None:
    mine = one.template.instantiate(1, "mine", True, "", False)
    foreign = sim.add_vm(name="foreign", state="PENDING", uid=5, template_id=1)
    assert [v.ID for v in one.vmpool.info(-3, -1, -1, -1).VM] == [mine]
    assert [v.ID for v in one.vmpool.info(5, -1, -1, -1).VM] == [foreign]
    assert [v.ID for v in one.vmpool.info(-4, -1, -1, -1).VM] == [mine]
    assert sorted(v.ID for v in one.vmpool.info(-2, -1, -1, -1).VM) == [mine, foreign]
    assert one.vmpool.info(-2, -1, -1, -1).VM[0].UNAME == "user5"


def test_vmpool_id_range_and_pagination(one: pyone.OneServer) -> None:
    ids = [one.template.instantiate(1, f"v{i}", True, "", False) for i in range(6)]
    assert [v.ID for v in one.vmpool.info(-2, 2, 4, -1).VM] == [4, 3, 2]
    assert [v.ID for v in one.vmpool.info(-2, 3, -1, -1).VM] == [5, 4, 3]
    assert [v.ID for v in one.vmpool.info(-2, 0, -2, -1).VM] == [5, 4]  # offset 0, page of 2
    assert [v.ID for v in one.vmpool.info(-2, 2, -2, -1).VM] == [3, 2]
    assert len(ids) == 6


def test_vmpool_fifth_argument_matches_user_template_values(one: pyone.OneServer) -> None:
    a = one.template.instantiate(1, "a", True, 'SLURM_NODE = "n1"\nSLURM_CLUSTER = "c1"', False)
    one.template.instantiate(1, "b", True, 'SLURM_NODE = "n2"\nSLURM_CLUSTER = "c1"', False)
    assert [v.ID for v in one.vmpool.info(-2, -1, -1, -1, "SLURM_NODE=n1").VM] == [a]
    assert len(one.vmpool.info(-2, -1, -1, -1, "SLURM_CLUSTER=c1").VM) == 2
    assert [v.ID for v in one.vmpool.info(-2, -1, -1, -1, "SLURM_CLUSTER=c1&SLURM_NODE=n1").VM] == [a]
    assert one.vmpool.info(-2, -1, -1, -1, "SLURM_NODE=n3").VM == []


@pytest.mark.parametrize(("query", "matches"), [
    ("VM.NAME=a", True), ("NAME=b", False), ("VM.USER_TEMPLATE.SLURM_NODE=n1", True),
    ("VM.TEMPLATE.SLURM_NODE=n1", False), ("VM.TEMPLATE.NIC[*].IP=127.0.1.1", True),
    ("VM.TEMPLATE.NIC.IP=127.0.1.2", False), ("VM.TEMPLATE.CPU=4", True), ("ID=0", True), ("a", True),
])
def test_vmpool_fifth_argument_search_paths(one: pyone.OneServer, query: str, matches: bool) -> None:
    one.template.instantiate(1, "a", True, 'SLURM_NODE = "n1"', False)
    assert len(one.vmpool.info(-2, -1, -1, -1, query).VM) == int(matches)


@pytest.mark.parametrize(("who", "state", "message"), [
    (-5, -1, "[one.vmpool.info] Incorrect filter_flag"),
    (-2, -3, "[one.vmpool.info] Incorrect filter_flag, state"),
    (-2, 12, "[one.vmpool.info] Incorrect filter_flag, state"),
])
def test_vmpool_bad_filters_are_api_errors(one: pyone.OneServer, who: int, state: int, message: str) -> None:
    with pytest.raises(pyone.OneApiException, match=re.escape(message)):
        one.vmpool.info(who, -1, -1, state)


def test_templatepool_and_template_info(one: pyone.OneServer) -> None:
    pool = one.templatepool.info(-2, -1, -1)
    names = sorted((t.ID, t.NAME) for t in pool.VMTEMPLATE)
    assert names == [(0, "slurm-gpu-worker"), (1, "slurm-cpu-worker")]
    gpu = one.template.info(0, False, False)
    assert gpu.TEMPLATE["PCI"] == {"CLASS": "0302", "VENDOR": "10de"}
    assert gpu.TEMPLATE["NIC"]["NETWORK"] == "slurm-net"
    assert "NAME" not in gpu.TEMPLATE


def test_hostpool_info_shows_pci_devices_and_holders(sim: Simulator, one: pyone.OneServer) -> None:
    vm_id = one.template.instantiate(0, "g", False, "", False)
    sim.wait_for(lambda: _running(sim, vm_id), 5)
    hosts = one.hostpool.info().HOST
    assert [h.NAME for h in hosts] == ["gpu-host-01", "gpu-host-02", "gpu-host-03", "gpu-host-04"]
    pci = hosts[0].HOST_SHARE.PCI_DEVICES.PCI
    gpus = [p for p in pci if p.CLASS == "0302"]
    assert len(gpus) == 4 and len(pci) == 5
    assert [p.VMID for p in gpus] == [vm_id, -1, -1, -1]
    assert hosts[0].HOST_SHARE.CPU_USAGE == 800
    assert hosts[0].VMS.ID == [vm_id]


def test_system_version_and_user_login_token(sim: Simulator, one: pyone.OneServer) -> None:
    assert one.system.version() == "6.10.0"
    token = one.user.login("oneadmin", "", 3600)
    assert len(token) == 40
    assert pyone.OneServer(sim.endpoint, session=f"oneadmin:{token}").system.version() == "6.10.0"
    assert one.user.login("oneadmin", token, 0) == token
    with pytest.raises(pyone.OneAuthenticationException):
        pyone.OneServer(sim.endpoint, session=f"oneadmin:{token}").system.version()


def test_login_for_another_user_is_not_authorized(one: pyone.OneServer) -> None:
    with pytest.raises(pyone.OneAuthorizationException, match=r"^\[one.user.login\] User \[0\] not author"):
        one.user.login("alice", "", 60)


@pytest.mark.parametrize("method", ["vm.info", "vmpool.info", "system.version"])
def test_wrong_session_is_authentication_error(sim: Simulator, method: str) -> None:
    bad = pyone.OneServer(sim.endpoint, session="oneadmin:wrong")
    args = {"vm.info": (0,), "vmpool.info": (-2, -1, -1, -1), "system.version": ()}[method]
    with pytest.raises(pyone.OneAuthenticationException,
                       match=rf"^\[one.{method}\] User couldn't be authenticated, aborting call.$"):
        getattr(getattr(bad, method.split(".")[0]), method.split(".")[1])(*args)


def test_unauthorized_session_is_authorization_error(sim: Simulator, one: pyone.OneServer) -> None:
    sim.set_authorized(False)
    with pytest.raises(pyone.OneAuthorizationException,
                       match=r"^\[one.vm.info\] User \[0\] not authorized to perform action on virtual "):
        one.vm.info(0)
    sim.set_authorized(True)
    with pytest.raises(pyone.OneNoExistsException):
        one.vm.info(0)


@pytest.mark.parametrize(("call", "message"), [
    (lambda one: one.vm.info(42), "[one.vm.info] Error getting virtual machine [42]."),
    (lambda one: one.vm.action("poweroff", 42), "[one.vm.action] Error getting virtual machine [42]."),
    (lambda one: one.vm.recover(42, 3), "[one.vm.recover] Error getting virtual machine [42]."),
    (lambda one: one.template.info(9), "[one.template.info] Error getting virtual machine template [9]."),
    (lambda one: one.template.instantiate(9, "", False, "", False),
     "[one.template.instantiate] Error getting virtual machine template [9]."),
    (lambda one: one.host.info(9), "[one.host.info] Error getting host [9]."),
])
def test_missing_objects_are_no_exists_errors(one: pyone.OneServer, call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(pyone.OneNoExistsException) as caught:
        call(one)
    assert str(caught.value) == message


def test_unknown_method_is_an_xmlrpc_fault(one: pyone.OneServer, sim: Simulator) -> None:
    with pytest.raises(pyone.OneException, match=r"Method 'one\.invalid\.api\.call' not defined"):
        one.invalid.api.call()
    with pytest.raises(xmlrpc.client.Fault) as caught:
        xmlrpc.client.ServerProxy(sim.endpoint).one.nothing(sim.auth)
    assert caught.value.faultCode == -506


def test_wrong_parameter_type_is_an_xmlrpc_fault(sim: Simulator) -> None:
    with pytest.raises(xmlrpc.client.Fault) as caught:
        xmlrpc.client.ServerProxy(sim.endpoint).one.vm.info(sim.auth, "seven")
    assert caught.value.faultCode == -501


def test_malformed_extra_template_is_internal_error(one: pyone.OneServer) -> None:
    with pytest.raises(pyone.OneInternalException, match=r"^\[one.template.instantiate\] Parse error"):
        one.template.instantiate(0, "x", False, 'A = "unterminated', False)


def test_exhausted_ip_range_is_allocate_error(sim: Simulator) -> None:
    cfg = SimConfig(durations=FAST.durations, network=FAST.network.__class__(cidr="127.0.9.0/30"))
    with running_simulator(cfg) as small:
        one = pyone.OneServer(small.endpoint, session=small.auth)
        one.template.instantiate(1, "a", True, "", False)
        one.template.instantiate(1, "b", True, "", False)
        with pytest.raises(pyone.OneException) as caught:
            one.template.instantiate(1, "c", True, "", False)
    assert str(caught.value) == ("[one.template.instantiate] Error allocating a new virtual machine. "
                                 "Cannot get IP/MAC lease from virtual network 0.")


def test_quota_exceeded_fails_instantiate_and_resume(sim: Simulator, one: pyone.OneServer) -> None:
    vm_id = one.template.instantiate(1, "a", False, "", False)
    sim.wait_for(lambda: _running(sim, vm_id), 5)
    one.vm.action("poweroff", vm_id)
    sim.wait_for(lambda: sim.vm(vm_id).state_str == "POWEROFF", 5)
    sim.set_faults(quota_exceeded=True)
    with pytest.raises(pyone.OneAuthorizationException, match=r"quota"):
        one.template.instantiate(1, "b", False, "", False)
    with pytest.raises(pyone.OneActionException, match=r"quota"):
        one.vm.action("resume", vm_id)


def test_allocate_failure_fault_is_allocate_code(sim: Simulator) -> None:
    sim.set_faults(allocate_failure=True)
    reply = xmlrpc.client.ServerProxy(sim.endpoint).one.template.instantiate(sim.auth, 0, "", False, "")
    assert reply[:3] == [False, "[one.template.instantiate] Error allocating a new virtual machine. "
                                "Cannot allocate the VM in the database", 0x4000]


def test_locked_vm_refuses_actions_but_answers_info(sim: Simulator, one: pyone.OneServer) -> None:
    vm_id = one.template.instantiate(1, "a", True, "", False)
    sim.lock_vm(vm_id)
    with pytest.raises(pyone.OneException) as caught:
        one.vm.action("release", vm_id)
    assert str(caught.value) == f"[one.vm.action] The resource virtual machine is locked. [{vm_id}]."
    assert one.vm.info(vm_id).LOCK.LOCKED == 1
    sim.unlock_vm(vm_id)
    assert one.vm.action("release", vm_id) == vm_id


def test_replies_are_oned_arrays(sim: Simulator) -> None:
    raw = xmlrpc.client.ServerProxy(sim.endpoint).one
    assert raw.system.version(sim.auth) == [True, "6.10.0", 0]
    failed = raw.vm.info(sim.auth, 5)
    assert failed == [False, "[one.vm.info] Error getting virtual machine [5].", 0x400, 5, -1]  # as oned's 5


def test_sim_stats_counts_calls_without_a_session(sim: Simulator, one: pyone.OneServer) -> None:
    one.template.instantiate(1, "a", True, "", False)
    one.vm.info(0)
    one.vm.info(0)
    stats = xmlrpc.client.ServerProxy(sim.endpoint).sim.stats()
    assert stats["calls"] == {"one.template.instantiate": 1, "one.vm.info": 2}
    assert stats["vms"] == {"HOLD": 1}
    assert sim.stats()["calls"] == stats["calls"]
    sim.reset_stats()
    assert sim.stats()["calls"] == {}


def _post(conn, body: bytes):  # type: ignore[no-untyped-def]
    conn.request("POST", "/RPC2", body, {"Content-Type": "text/xml"})
    response = conn.getresponse()
    return response, response.read()


def test_a_kept_alive_connection_serves_calls_until_keepalive_max_conn(sim: Simulator) -> None:
    import http.client

    from opennebula_sim.server import KEEPALIVE_MAX_CONN

    host, port = sim.server.address
    conn = http.client.HTTPConnection(host, port, timeout=5)
    body = xmlrpc.client.dumps((sim.auth,), "one.system.version").encode()
    first, _ = _post(conn, body)
    sock = conn.sock
    assert first.version == 11 and first.getheader("Connection") is None and sock is not None
    for _ in range(KEEPALIVE_MAX_CONN - 2):
        answer, payload = _post(conn, body)
        assert answer.status == 200 and conn.sock is sock, "the same connection serves every call"
    last, payload = _post(conn, body)
    assert last.getheader("Connection") == "close" and conn.sock is None, "oned's KEEPALIVE_MAX_CONN"
    assert xmlrpc.client.loads(payload)[0][0][0] is True
    assert _post(conn, body)[0].status == 200, "the client reconnects"
    conn.close()



def test_vn_info_lists_each_lease_until_the_vm_is_done(sim: Simulator, one: pyone.OneServer) -> None:
    vm_id = one.template.instantiate(1, "leaser", True, "", False)
    ip = sim.vm(vm_id).ip
    raw = xmlrpc.client.ServerProxy(sim.endpoint).one.vn.info(sim.auth, 0, False)
    assert raw[0] and f"<LEASE><IP><![CDATA[{ip}]]></IP>" in raw[1] and f"<VM><![CDATA[{vm_id}]]></VM>" in raw[1]
    assert one.vn.info(0).NAME == "slurm-net"  # pyone parses it
    one.vm.action("terminate", vm_id)
    after = xmlrpc.client.ServerProxy(sim.endpoint).one.vn.info(sim.auth, 0, False)[1]
    assert f"<LEASE><IP><![CDATA[{ip}]]>" not in after


def test_template_allocate_instantiate_and_delete(sim: Simulator, one: pyone.OneServer) -> None:
    tid = one.template.allocate('NAME = "made"\nCPU = "1"\nMEMORY = "64"')
    assert one.template.info(tid).NAME == "made"
    vm_id = one.template.instantiate(tid, "", False, "", False)
    assert sim.vm(vm_id).name == f"made-{vm_id}"
    with pytest.raises(pyone.OneException, match="NAME is already taken"):
        one.template.allocate('NAME = "made"')
    assert one.template.delete(tid, False) == tid
    with pytest.raises(pyone.OneNoExistsException):
        one.template.info(tid)
