"""The simulator's guest side: one.vm.update, OneGate's PUT /vm, and the CONTEXT that TOKEN=YES gives."""

from __future__ import annotations

import shutil
import threading
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
import xmlrpc.client
from pathlib import Path

import pyone
import pytest
from simfixtures import AUTH, fast_config, vms_of
from support import make_setup

from opennebula_sim import Durations, SimConfig, running_simulator
from opennebula_sim.cloud import HookEvent
from opennebula_sim.hooks import context_file_text
from slurm_nebula_power.cli.main import resume_main
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK

POWERING_UP = "NodeName=gpu01 State=IDLE+CLOUD+POWERING_UP\n"  # what slurmctld says when it runs resume
SIM_CONFIG, SIM_AUTH = fast_config(), AUTH  # conftest's sim: the one the product's tests use (tests/conftest.py)


def _running(sim, one, template_id: int = 0, name: str = "gpu01", extra: str = "") -> int:
    vm_id = one.template.instantiate(template_id, name, False, extra, False)
    sim.wait_for(lambda: sim.vm(vm_id).state_str == "RUNNING", 5)
    return vm_id


def _put(endpoint: str, vm_id: object, token: str, body: str = "READY=YES") -> tuple[int, str]:
    request = urllib.request.Request(f"{endpoint}/vm", data=body.encode(), method="PUT",
                                     headers={"X-ONEGATE-TOKEN": token, "X-ONEGATE-VMID": str(vm_id)})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _token(sim, vm_id: int) -> str:
    with sim.cloud.lock:
        return sim.cloud.vms[vm_id].onegate_token


def test_token_yes_adds_onegate_endpoint_and_vmid_to_context(sim) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    vm_id = _running(sim, one)  # template 0 has CONTEXT TOKEN=YES
    context = sim.vm(vm_id).template["CONTEXT"]
    assert context["ONEGATE_ENDPOINT"] == sim.endpoint.removesuffix("/RPC2")
    assert context["VMID"] == str(vm_id)
    assert len(_token(sim, vm_id)) == 32
    # one.vm.info shows the same CONTEXT (oned keeps ONEGATE_ENDPOINT and VMID there); never the token
    info = one.vm.info(vm_id)
    assert info.TEMPLATE["CONTEXT"]["ONEGATE_ENDPOINT"] == context["ONEGATE_ENDPOINT"]
    assert _token(sim, vm_id) not in str(info.TEMPLATE)


def test_without_token_there_is_no_onegate(sim) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    vm_id = _running(sim, one, extra='CONTEXT = [ NETWORK = "YES" ]')
    assert "ONEGATE_ENDPOINT" not in sim.vm(vm_id).template["CONTEXT"]
    assert _token(sim, vm_id) == ""
    assert _put(sim.endpoint.removesuffix("/RPC2"), vm_id, "") == (401, "Not authorized")


def test_put_vm_with_the_vms_token_merges_ready_into_user_template(sim) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    vm_id = _running(sim, one, extra='SLURM_NODENAME = "gpu01"')
    endpoint = sim.vm(vm_id).template["CONTEXT"]["ONEGATE_ENDPOINT"]
    assert _put(endpoint, vm_id, _token(sim, vm_id)) == (200, "")
    user = one.vm.info(vm_id).USER_TEMPLATE
    assert user["READY"] == "YES" and user["SLURM_NODENAME"] == "gpu01"  # merged, nothing else lost
    assert sim.stats()["calls"]["onegate.vm.update"] == 1


@pytest.mark.parametrize(("vm_offset", "token", "body", "expect"), [
    (0, "wrong", "READY=YES", (401, "Not authorized")),
    (1, None, "READY=YES", (401, "Not authorized")),  # another VM's id with this VM's token
    (0, None, "READY = [", None),  # a template that does not parse: 500 with the update's error
])
def test_put_vm_refusals(sim, vm_offset, token, body, expect) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    first = _running(sim, one, name="a")
    second = _running(sim, one, name="b")
    endpoint = sim.endpoint.removesuffix("/RPC2")
    code, text = _put(endpoint, [first, second][vm_offset], token or _token(sim, first), body)
    if expect is None:
        assert code == 500 and text.startswith("[one.vm.update] Cannot update template.")
    else:
        assert (code, text) == expect
    assert "READY" not in sim.vm(first).user_template and "READY" not in sim.vm(second).user_template


def test_vm_update_merge_and_replace_through_pyone(sim) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    vm_id = _running(sim, one, extra='SLURM_NODENAME = "gpu01"\nKEEP = "x"')
    assert one.vm.update(vm_id, 'READY = "YES"\nKEEP = "y"', 1) == vm_id
    user = one.vm.info(vm_id).USER_TEMPLATE
    assert (user["READY"], user["KEEP"], user["SLURM_NODENAME"]) == ("YES", "y", "gpu01")
    assert one.vm.update(vm_id, 'ONLY = "this"', 0) == vm_id
    user = one.vm.info(vm_id).USER_TEMPLATE
    assert user.get("ONLY") == "this" and "READY" not in user and "SLURM_NODENAME" not in user


@pytest.mark.parametrize(("args", "code", "text"), [
    ((99, 'READY = "YES"', 1), 0x400, "[one.vm.update] Error getting virtual machine [99]."),
    ((0, 'READY = "YES"', 2), 0x1000, "[one.vm.update] Wrong update type"),
    ((0, "READY = [", 1), 0x2000, "[one.vm.update] Cannot update template. Parse error"),
])
def test_vm_update_errors(sim, args, code, text) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    _running(sim, one)
    with pytest.raises(pyone.OneException) as raised:
        one.vm.update(*args)
    assert str(raised.value).startswith(text)
    reply = __import__("xmlrpc.client").client.ServerProxy(sim.endpoint).one.vm.update(sim.auth, *args)
    assert reply[0] is False and reply[2] == code


def test_hook_context_file_carries_the_token_as_tokentxt() -> None:
    context = {"VMID": "3", "ONEGATE_ENDPOINT": "http://x"}
    event = HookEvent("running", 3, "gpu01", "127.0.1.4", context, "abc")
    text = context_file_text(event)
    assert "TOKENTXT='abc'\n" in text and "VMID='3'\n" in text
    assert "TOKENTXT" not in context_file_text(HookEvent("running", 3, "gpu01", "", {}))


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_context_packages_curl_call_reports_ready(tmp_path: Path) -> None:
    """A hook doing exactly what one-context's net-99-report-ready does with curl sets READY=YES."""
    hook = tmp_path / "report-ready.sh"
    hook.write_text('#!/bin/sh\n. "$ONE_VM_CONTEXT"\n'
                    'curl -sf -X PUT "${ONEGATE_ENDPOINT}/vm" --header "X-ONEGATE-TOKEN: $TOKENTXT" '
                    '--header "X-ONEGATE-VMID: $VMID" --max-time 10 -d "READY=YES"\n')
    config = SimConfig(durations=Durations(0, 0, 0, 0), on_running=("/bin/sh", str(hook)))
    with running_simulator(config, auth=AUTH) as sim:
        one = pyone.OneServer(sim.endpoint, session=sim.auth)
        vm_id = one.template.instantiate(0, "gpu01", False, "", False)
        sim.wait_for(lambda: sim.vm(vm_id).user_template.get("READY") == "YES", 10)


# ---- resume with wait_for = "ready" ---------------------------------------------------------------

READY_SETS = """
[[nodeset]]
nodes = "gpu[01-02]"
template = "slurm-gpu-worker"
boot_timeout = {timeout}
wait_for = "ready"
"""


def test_resume_waits_for_the_guests_ready(tmp_path: Path, sim) -> None:
    setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=READY_SETS.format(timeout=20))
    stop = threading.Event()

    def guest() -> None:  # plays the guest: once a VM of ours runs, report READY through OneGate
        reported: set[int] = set()
        while not stop.is_set():
            for vm in sim.vms():
                if vm.state_str == "RUNNING" and vm.id not in reported:
                    context = vm.template["CONTEXT"]
                    stop.wait(0.5)  # RUNNING a while before READY: resume must not stop at RUNNING
                    _put(context["ONEGATE_ENDPOINT"], vm.id, _token(sim, vm.id))
                    reported.add(vm.id)
            stop.wait(0.05)

    thread = threading.Thread(target=guest, daemon=True)
    thread.start()
    try:
        assert resume_main(["gpu[01-02]"], setup.env) == EXIT_OK
        for node in ("gpu01", "gpu02"):
            [vm] = vms_of(sim, node)
            assert vm.user_template["READY"] == "YES"  # resume returned only once the guest said so
    finally:
        stop.set()
        thread.join(5)


@pytest.mark.parametrize("slurm_says", ["", "NodeName=gpu01 State=IDLE+CLOUD+POWERING_UP\n"],
                         ids=["no answer", "powering up"])
def test_resume_hands_back_a_node_whose_guest_never_reports_ready(tmp_path: Path, sim, slurm_says) -> None:
    setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=READY_SETS.format(timeout=1.5))
    setup.set_node_sequence([POWERING_UP, slurm_says])  # slurmctld asked for it; its slurmd has not registered
    assert resume_main(["gpu01"], setup.env) == EXIT_NODES_FAILED
    sim.wait_for(lambda: vms_of(sim, "gpu01") == [], 10)  # its VM was terminated: no GPU held
    [handback] = [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
    assert handback[0] == "NodeName=gpu01"
    assert "READY=YES" in " ".join(handback)


@pytest.mark.parametrize("state", ["IDLE+CLOUD", "ALLOCATED+CLOUD"])
def test_resume_counts_a_node_whose_slurmd_registered_without_ready_as_up(tmp_path: Path, sim, state) -> None:
    """OneGate slow or unreachable from the guest, but slurmd registered (and may run a job): at boot_timeout
    resume asks Slurm, keeps the VM and counts the node up, with a warning, instead of tearing it down."""
    setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=READY_SETS.format(timeout=1.5))
    setup.set_node_sequence([POWERING_UP, f"NodeName=gpu01 State={state} NodeAddr=127.0.1.1\n"])
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    [vm] = vms_of(sim, "gpu01")
    assert vm.state_str == "RUNNING" and "READY" not in vm.user_template
    assert not [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
    assert "node=gpu01 vm=0: slurmd registered but the guest reported no READY=YES within boot_timeout 1.5s: " \
           "counted as up; check the guest's OneGate access" in setup.log_text()


def _ours_stopped(tmp_path: Path, sim, off: str, body: str = "READY=YES") -> int:
    """gpu01's VM made by resume, whose guest reported READY=YES (and whatever else `body` says), then
    stopped by `off`."""
    first = make_setup(tmp_path / "before", sim.endpoint, AUTH,
                       nodesets=READY_SETS.format(timeout=5).replace('"ready"', '"running"'))
    assert resume_main(["gpu01"], first.env) == EXIT_OK
    [vm] = vms_of(sim, "gpu01")
    assert _put(vm.template["CONTEXT"]["ONEGATE_ENDPOINT"], vm.id, _token(sim, vm.id), body)[0] == 200
    pyone.OneServer(sim.endpoint, session=sim.auth).vm.action(off, vm.id)
    sim.wait_for(lambda: sim.vm(vm.id).state_str in ("POWEROFF", "UNDEPLOYED"), 10)
    assert sim.vm(vm.id).user_template["READY"] == "YES"  # oned keeps it: only a new report overwrites it
    return vm.id


@pytest.mark.parametrize("off", ["poweroff", "undeploy"])
def test_resume_of_a_stopped_vm_waits_for_this_boots_ready(tmp_path: Path, sim, off) -> None:
    """oned keeps the READY=YES of the boot before a poweroff or undeploy (real-kvm.md): resume clears it before
    it resumes the VM, so a guest that does not come up this time is handed back at boot_timeout, not counted
    as up the moment its VM is RUNNING again."""
    vm_id = _ours_stopped(tmp_path, sim, off)
    setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=READY_SETS.format(timeout=1.5))
    assert resume_main(["gpu01"], setup.env) == EXIT_NODES_FAILED  # this boot never reported
    assert sim.vm(vm_id).user_template["READY"] == "NO"
    [handback] = [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
    assert handback[0] == "NodeName=gpu01" and "READY=YES" in " ".join(handback)


def test_resume_of_a_stopped_vm_whose_guest_reports_again_is_up(tmp_path: Path, sim) -> None:
    vm_id = _ours_stopped(tmp_path, sim, "poweroff")
    setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=READY_SETS.format(timeout=20))
    stop = threading.Event()

    def guest() -> None:  # this boot's report, a while after RUNNING
        while not stop.is_set() and sim.vm(vm_id).state_str != "RUNNING":
            stop.wait(0.05)
        stop.wait(0.5)
        _put(sim.vm(vm_id).template["CONTEXT"]["ONEGATE_ENDPOINT"], vm_id, _token(sim, vm_id))

    thread = threading.Thread(target=guest, daemon=True)
    thread.start()
    try:
        assert resume_main(["gpu01"], setup.env) == EXIT_OK
        assert sim.vm(vm_id).user_template["READY"] == "YES"
        assert "action=clear-stale result=ok" in setup.log_text()
    finally:
        stop.set()
        thread.join(5)


@pytest.mark.parametrize(("body", "stored"), [
    ("READY=YES", {"READY": "YES"}),  # what the worker sends
    ("NOTE=two words", {"NOTE": "two words"}),  # onegate-server quotes bare values
    ("CONTEXT=[A=b]\nX=1", {"CONTEXT": {"A": "b"}, "X": "1"}),  # the stray quote after ] is ignored, as oned does
])
def test_put_vm_body_is_escaped_as_onegate_server_does(sim, body, stored) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    vm_id = _running(sim, one)
    assert _put(sim.endpoint.removesuffix("/RPC2"), vm_id, _token(sim, vm_id), body) == (200, "")
    user = sim.vm(vm_id).user_template
    assert {k: user[k] for k in stored} == stored


@pytest.mark.parametrize("body", ['READY = "YES"', "NOTE=a, b"])
def test_put_vm_bodies_the_escaping_breaks(sim, body) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    vm_id = _running(sim, one)
    code, text = _put(sim.endpoint.removesuffix("/RPC2"), vm_id, _token(sim, vm_id), body)
    assert code == 500 and text.startswith("[one.vm.update] Cannot update template.")


def test_put_vm_of_a_restricted_attribute_is_403(sim) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    vm_id = _running(sim, one)
    endpoint = sim.endpoint.removesuffix("/RPC2")
    answer = _put(endpoint, vm_id, _token(sim, vm_id), "SERVICE_ID=3")
    assert answer == (403, "Attribute (SERVICE_ID) cannot be modified")
    assert "SERVICE_ID" not in sim.vm(vm_id).user_template


def _put_form(endpoint: str, vm_id: object, token: str, form: str, query: str = "") -> tuple[int, str]:
    """A PUT /vm as the onegate client sends it: `URI.encode_www_form(options)`, a form content type."""
    request = urllib.request.Request(f"{endpoint}/vm{query}", data=form.encode(), method="PUT",
                                     headers={"X-ONEGATE-TOKEN": token, "X-ONEGATE-VMID": str(vm_id),
                                              "Content-Type": "application/x-www-form-urlencoded"})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_put_vm_decodes_the_onegate_clients_form_as_onegate_server_does(sim) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    vm_id = _running(sim, one)
    endpoint = sim.endpoint.removesuffix("/RPC2")
    assert _put_form(endpoint, vm_id, _token(sim, vm_id), "data=READY%3DYES&type=1") == (200, "")
    user = one.vm.info(vm_id).USER_TEMPLATE
    assert user["READY"] == "YES" and "DATA" not in user


def test_put_vm_takes_data_from_the_query_too(sim) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    vm_id = _running(sim, one)
    endpoint = sim.endpoint.removesuffix("/RPC2")
    assert _put_form(endpoint, vm_id, _token(sim, vm_id), "", "?data=NOTE%3Dx") == (200, "")
    assert one.vm.info(vm_id).USER_TEMPLATE["NOTE"] == "x"


def test_put_vm_type_2_erases_the_attribute(sim) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    vm_id = _running(sim, one, extra='KEEP = "x"')
    endpoint = sim.endpoint.removesuffix("/RPC2")
    token = _token(sim, vm_id)
    assert _put(endpoint, vm_id, token) == (200, "")
    assert _put_form(endpoint, vm_id, token, "data=READY&type=2") == (200, "")
    assert "READY" not in sim.vm(vm_id).user_template and "KEEP" in sim.vm(vm_id).user_template
    assert _put_form(endpoint, vm_id, token, "data=READY&type=2") == (500, "attribute not found")


def test_system_config_shows_onegate_endpoint_as_oned_conf_has_it(sim) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    rpc = xmlrpc.client.ServerProxy(sim.endpoint)
    ok, text, _ = rpc.one.system.config(sim.auth)[:3]
    assert ok and ET.fromstring(text).findtext("ONEGATE_ENDPOINT") == sim.endpoint.removesuffix("/RPC2")
    assert ET.fromstring(text).findtext("DB/BACKEND") == "sqlite"  # the oneadmin group sees DB
    assert one.template.instantiate(0, "gpu01", False, "", False) >= 0


def test_without_onegate_endpoint_oned_refuses_to_instantiate_token_yes() -> None:
    with running_simulator(SimConfig(durations=Durations(0, 0, 0, 0), onegate=False), auth=AUTH) as sim:
        rpc = xmlrpc.client.ServerProxy(sim.endpoint)
        ok, text, _ = rpc.one.system.config(sim.auth)[:3]
        assert ok and ET.fromstring(text).find("ONEGATE_ENDPOINT") is None
        answer = rpc.one.template.instantiate(sim.auth, 0, "gpu01", False, "", False)
        assert answer[0] is False and "TOKEN set, but onegate endpoint was not defined in oned.conf." in answer[1]
        assert sim.vms() == []


def test_a_sched_message_the_guest_wrote_is_cleared_before_its_stopped_vm_is_resumed(tmp_path: Path, sim) -> None:
    """SCHED_MESSAGE lives in USER_TEMPLATE, which the guest writes through OneGate (onegate-server restricts
    only SCHED_REQUIREMENTS, SERVICE_ID and ROLE_NAME): a planted one read on the resumed VM, PENDING again,
    made resume hand the node back as "no free GPU" with the guest's words in its Reason."""
    planted = "Cannot dispatch VM: No host with enough capacity to deploy the VM: PCI planted-by-the-guest"
    # its resume goes through PENDING, where the scheduler places it
    vm_id = _ours_stopped(tmp_path, sim, "undeploy", f"READY=YES\nSCHED_MESSAGE={planted}")
    assert planted in sim.vm(vm_id).user_template["SCHED_MESSAGE"]
    with sim.cloud.lock:  # the scheduler places nothing for a second: the resumed VM waits PENDING
        sim.cloud.stalled_until = sim.cloud.monotonic() + 1.0
    sets = READY_SETS.format(timeout=20).replace('"ready"', '"running"') + "pending_timeout = 0.05\n"
    setup = make_setup(tmp_path / "site", sim.endpoint, AUTH, nodesets=sets)
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    assert sim.vm(vm_id).state_str == "RUNNING" and not sim.vm(vm_id).user_template.get("SCHED_MESSAGE")
    assert "action=clear-stale result=ok" in setup.log_text() and "planted" not in setup.log_text()
    assert not [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
