"""The simulator's XML against real oned documents: element names, nesting and order; compact; CDATA."""

from __future__ import annotations

import base64
import gzip
import json
import re
import xml.etree.ElementTree as ET
import xmlrpc.client
from collections.abc import Iterator
from pathlib import Path

import pyone
import pytest

from opennebula_sim import Durations, SimConfig, running_simulator
from opennebula_sim.handle import Simulator

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference" / "opennebula-xml"
needs_reference = pytest.mark.skipif(not REFERENCE.is_dir(), reason=f"reference documents not at {REFERENCE}")


@pytest.fixture(scope="module")
def sim() -> Iterator[Simulator]:
    with running_simulator(SimConfig(durations=Durations(0, 0, 0, 0))) as running:
        one = pyone.OneServer(running.endpoint, session=running.auth)
        ids = [one.template.instantiate(0, f"gpu{i}", False, 'SLURM_NODE = "n"\nLABELS = "slurm"', False)
               for i in range(3)]
        running.wait_for(lambda: all(running.vm(i).state_str == "RUNNING" for i in ids), 5)
        one.vm.action("poweroff", ids[1])
        one.vm.action("terminate", ids[2])
        running.wait_for(lambda: running.vm(ids[2]).state_str == "DONE", 5)
        running.lock_vm(ids[0])
        yield running


def _raw(sim: Simulator, method: str, *args: object) -> str:
    reply = getattr(xmlrpc.client.ServerProxy(sim.endpoint), method)(sim.auth, *args)
    assert reply[0] is True, reply
    return str(reply[1])


def _xml(text: str) -> ET.Element:
    return ET.fromstring(text.encode())


def _strip(elem: ET.Element) -> ET.Element:
    for node in elem.iter():
        node.tag = node.tag.split("}")[-1]
    return elem


def _order(tags: list[str]) -> list[str]:
    return [t for i, t in enumerate(tags) if i == 0 or tags[i - 1] != t]


def assert_shared_structure(real: ET.Element, mine: ET.Element, path: str = "") -> None:
    """For every element both documents have, the children they share come in the same order, recursively."""
    real_tags, my_tags = [c.tag for c in real], [c.tag for c in mine]
    shared = set(real_tags) & set(my_tags)
    where = path or real.tag
    assert [t for t in _order(real_tags) if t in shared] == [t for t in _order(my_tags) if t in shared], where
    for tag in shared:
        real_child, my_child = real.find(tag), mine.find(tag)
        assert real_child is not None and my_child is not None
        if len(real_child) and len(my_child):
            assert_shared_structure(real_child, my_child, f"{where}/{tag}")
        elif (len(real_child) and (my_child.text or "").strip()) or \
                (len(my_child) and (real_child.text or "").strip()):
            pytest.fail(f"{where}/{tag}: a value in one document, nested elements in the other")


def _tape() -> dict[str, dict[str, dict[str, list[list[object]]]]]:
    with gzip.open(REFERENCE / "tape-one-5.4-integration.json.gz", "rt") as tape:
        return json.load(tape)  # type: ignore[no-any-return]


@needs_reference
@pytest.mark.parametrize("name", ["vm_01.xml", "vm_02.xml", "vm_03.xml", "vm_04.xml"])
def test_vm_info_matches_real_vm_documents(sim: Simulator, name: str) -> None:
    real = _strip(_xml((REFERENCE / name).read_text()))
    for vm_id in (0, 1, 2):
        assert_shared_structure(real, _xml(_raw(sim, "one.vm.info", vm_id)))


@needs_reference
def test_vmpool_infoextended_matches_real_pool_document(sim: Simulator) -> None:
    real = _strip(_xml((REFERENCE / "vm_pool_01.xml").read_text()))
    mine = _xml(_raw(sim, "one.vmpool.infoextended", -2, -1, -1, -2))
    assert real.tag == mine.tag == "VM_POOL"
    assert_shared_structure(real, mine)
    assert_shared_structure(real.find("VM"), mine.find("VM"))  # type: ignore[arg-type]


@needs_reference
def test_host_matches_real_host_document(sim: Simulator) -> None:
    real = _strip(_xml((REFERENCE / "host_01.xml").read_text()))
    assert_shared_structure(real, _xml(_raw(sim, "one.host.info", 0)))


@needs_reference
def test_vm_info_matches_compact_oned_reply_on_tape(sim: Simulator) -> None:
    (reply,) = _tape()["test_vm_info"]["one.vm.info"].values()
    raw = str(reply[0][1])
    assert_shared_structure(_xml(raw), _xml(_raw(sim, "one.vm.info", 0)))


@needs_reference
def test_hostpool_matches_compact_oned_reply_on_tape(sim: Simulator) -> None:
    (reply,) = _tape()["setup"]["one.hostpool.info"].values()
    real = _xml(str(reply[0][1]))
    mine = _xml(_raw(sim, "one.hostpool.info"))
    assert_shared_structure(real, mine)
    assert_shared_structure(real.find("HOST"), mine.find("HOST"))  # type: ignore[arg-type]


@needs_reference
def test_unknown_method_fault_matches_oned(sim: Simulator) -> None:
    (reply,) = _tape()["test_invalid_method"]["one.invalid.api.call"].values()
    recorded = base64.b64decode(reply[0]["exception"])  # type: ignore[index]  # a pickled OneException
    assert b"<Fault -506: \"Method 'one.invalid.api.call' not defined\">" in recorded
    with pytest.raises(xmlrpc.client.Fault) as caught:
        xmlrpc.client.ServerProxy(sim.endpoint).one.invalid.api.call(sim.auth)
    fault = caught.value
    assert (fault.faultCode, fault.faultString) == (-506, "Method 'one.invalid.api.call' not defined")


@pytest.mark.parametrize(("method", "args"), [
    ("one.vm.info", (0,)), ("one.vm.info", (1,)), ("one.vm.info", (2,)),
    ("one.vmpool.info", (-2, -1, -1, -2)), ("one.vmpool.infoextended", (-2, -1, -1, -2)),
    ("one.hostpool.info", ()), ("one.host.info", (0,)), ("one.templatepool.info", (-2, -1, -1)),
    ("one.template.info", (0,)),
])
def test_xml_is_compact_without_namespace(sim: Simulator, method: str, args: tuple[object, ...]) -> None:
    raw = _raw(sim, method, *args)
    assert "xmlns" not in raw and not raw.startswith("<?xml")
    assert re.search(r">\s+<", raw) is None and "\n" not in raw


def test_template_values_are_cdata_and_names_are_plain(sim: Simulator) -> None:
    raw = _raw(sim, "one.vm.info", 0)
    template = raw[raw.index("<TEMPLATE>"):raw.index("</USER_TEMPLATE>")]
    assert re.search(r">[^<]", re.sub(r"<!\[CDATA\[.*?\]\]>", "", template)) is None, "values are all CDATA"
    assert "<IP><![CDATA[127.0.1.1]]></IP>" in template
    assert "<NAME>gpu0</NAME>" in raw and "<STATE>3</STATE>" in raw
    assert "<LOCK><LOCKED>1</LOCKED>" in raw


@pytest.mark.parametrize(("method", "args"), [
    ("vm.info", (0,)), ("vm.info", (1,)), ("vm.info", (2,)), ("vmpool.info", (-2, -1, -1, -2)),
    ("vmpool.infoextended", (-2, -1, -1, -2)), ("hostpool.info", ()), ("host.info", (0,)),
    ("templatepool.info", (-2, -1, -1)), ("template.info", (1,)),
])
def test_pyone_parses_every_reply_without_warnings(sim: Simulator, capfd: pytest.CaptureFixture[str],
                                                    method: str, args: tuple[object, ...]) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    group, name = method.split(".")
    parsed = getattr(getattr(one, group), name)(*args)
    assert parsed is not None
    assert "Warnings" not in capfd.readouterr().err


def test_pyone_objects_hold_the_right_values(sim: Simulator) -> None:
    one = pyone.OneServer(sim.endpoint, session=sim.auth)
    pool = one.vmpool.infoextended(-2, -1, -1, -2)
    by_id = {vm.ID: vm for vm in pool.VM}
    assert [(by_id[i].NAME, by_id[i].STATE, by_id[i].LCM_STATE) for i in (0, 1, 2)] == [
        ("gpu0", 3, 3), ("gpu1", 8, 0), ("gpu2", 6, 0)]
    assert [by_id[i].TEMPLATE["NIC"]["IP"] for i in (0, 1, 2)] == ["127.0.1.1", "127.0.1.2", "127.0.1.3"]
    assert by_id[0].USER_TEMPLATE["SLURM_NODE"] == "n"
    assert by_id[0].TEMPLATE["CONTEXT"]["ETH0_IP"] == "127.0.1.1"
    assert by_id[1].HISTORY_RECORDS.HISTORY[0].ACTION == 19  # poweroff
    short = {vm.ID: vm for vm in one.vmpool.info(-2, -1, -1, -2).VM}
    assert short[0].USER_TEMPLATE == {"LABELS": "slurm"}
    assert short[2].ETIME > 0 and short[0].ETIME == 0
