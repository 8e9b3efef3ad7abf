"""Usage records (records.py) and the audit file they are appended to (audit.py); TEMPLATE/PCI on Vm."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat

import pytest
from simfixtures import AUTH, fast_config

from opennebula_sim import running_simulator
from slurm_nebula_power.audit import AuditLog
from slurm_nebula_power.cloud import OneCloud
from slurm_nebula_power.config import OneConfig
from slurm_nebula_power.model import MOST_JOB_IDS, Pci, Vm, parse_job_ids, vms_from_xml
from slurm_nebula_power.records import CATEGORIES, from_json, read_records, reason_category

# A VM as oned shows it once deployed: TEMPLATE/PCI with the host device's address; a guest's OneGate PUT can
# only reach USER_TEMPLATE, where a PCI lookalike must be ignored.
VM_DOC = """<VM><ID>5</ID><NAME>gpu01</NAME><STATE>3</STATE><LCM_STATE>3</LCM_STATE><STIME>1</STIME>
<TEMPLATE><NIC><IP>10.0.0.5</IP></NIC>
<PCI><ADDRESS>0000:41:00.0</ADDRESS><BUS>41</BUS><CLASS>0302</CLASS><DEVICE>2330</DEVICE><DOMAIN>0000</DOMAIN>
<FUNCTION>0</FUNCTION><PCI_ID>0</PCI_ID><PROFILE>nvidia-h100-1g</PROFILE><SHORT_ADDRESS>41:00.0</SHORT_ADDRESS>
<SLOT>00</SLOT><VENDOR>10de</VENDOR></PCI>
<PCI><ADDRESS>0000:c1:00.1</ADDRESS><CLASS>0207</CLASS><TYPE>NIC</TYPE><VENDOR>15b3</VENDOR></PCI>
<CONTEXT><SLURM_NODENAME>gpu01</SLURM_NODENAME><SLURM_JOB_IDS>41,42</SLURM_JOB_IDS></CONTEXT>
</TEMPLATE>
<USER_TEMPLATE><SLURM_JOB_IDS>99</SLURM_JOB_IDS><PCI><ADDRESS>0000:ff:00.0</ADDRESS></PCI></USER_TEMPLATE>
<HISTORY_RECORDS><HISTORY><HOSTNAME>h1</HOSTNAME></HISTORY></HISTORY_RECORDS></VM>"""


def test_template_pci_gives_the_gpus_as_oned_assigned_them() -> None:
    [vm] = vms_from_xml(VM_DOC)
    assert vm.gpus == (Pci(address="0000:41:00.0", short_address="41:00.0", vendor="10de", device="2330",
                           klass="0302", profile="nvidia-h100-1g"),)
    assert len(vm.pci) == 2 and vm.pci[1].type == "NIC"  # the InfiniBand VF is PCI but no GPU
    assert vm.job_ids == (41, 42), "from CONTEXT, never the guest-writable USER_TEMPLATE (99)"


@pytest.mark.parametrize("text", ["\u00b2", "4" * 5000, "1\u0663", "1_0", "+5", "-5", " ", "7," * 10_000])
def test_job_ids_are_parsed_strictly_and_bounded(text: str) -> None:
    ids = parse_job_ids(text)  # never raises, whatever a rewritten answer holds
    assert len(ids) <= MOST_JOB_IDS and all(0 <= i < 1 << 32 for i in ids)
    assert ids == ((7,) * MOST_JOB_IDS if text.startswith("7,") else ())


def test_a_vm_tagged_only_in_its_user_template_has_no_job_ids() -> None:
    vm = Vm(id=1, name="gpu01", state=3, lcm_state=3, user_template={"SLURM_JOB_IDS": "41"},
            context={"SLURM_NODENAME": "gpu01"})
    assert vm.job_ids == ()


def test_the_simulator_s_deployed_gpu_vm_carries_its_host_device(tmp_path) -> None:
    with running_simulator(fast_config(hosts=1, gpus=1), auth=AUTH) as sim:
        vm_id = sim.add_vm("gpu01", {"SLURM_CLUSTER": "c"})
        cloud = OneCloud(OneConfig(endpoint=sim.endpoint, auth_file=tmp_path, session=AUTH))
        [vm] = [v for v in cloud.cluster_vms("c") if v.id == vm_id]
        assert [g.address for g in vm.gpus] == list(sim.vm(vm_id).pci) and vm.gpus[0].assigned


def record_line(tmp_path, **kw) -> dict:
    audit = AuditLog(tmp_path / "audit.jsonl", "resume", "c1", clock=lambda: 1_764_576_000.25)
    audit.record(**kw)
    audit.close()
    [line] = (tmp_path / "audit.jsonl").read_text().splitlines()
    return json.loads(line)


def test_a_record_names_node_vm_host_gpus_jobs_event_and_time(tmp_path) -> None:
    [vm] = vms_from_xml(VM_DOC)
    data = record_line(tmp_path, event="running", node="gpu01", vm=vm, jobs=[42])
    assert data["time"] == "2025-12-01T08:00:00.250+00:00"
    assert (data["event"], data["node"], data["vm"], data["host"], data["jobs"]) == ("running", "gpu01", 5, "h1",
                                                                                     [42])
    assert data["gpus"] == [{"address": "0000:41:00.0", "short_address": "41:00.0", "vendor": "10de",
                             "device": "2330", "class": "0302", "profile": "nvidia-h100-1g"}]
    assert data["program"] == "resume" and data["cluster"] == "c1" and data["pid"] == os.getpid()
    record = from_json(json.dumps(data))
    assert record.time == 1_764_576_000.25 and record.gpus[0]["address"] == "0000:41:00.0"


def test_job_ids_default_to_the_vm_s_context_and_a_failure_carries_its_category(tmp_path) -> None:
    [vm] = vms_from_xml(VM_DOC)
    data = record_line(tmp_path, event="failed", node="gpu01", vm=vm,
                       reason="no host with a free GPU (VM PENDING past boot_timeout)")
    assert data["jobs"] == [41, 42] and data["category"] == "no_capacity"


def test_a_record_stays_one_short_line_whatever_the_reason(tmp_path) -> None:
    data = record_line(tmp_path, event="handed_back", node="gpu01", reason="x" * 10_000 + "\nsecond line")
    assert len(json.dumps(data)) < 1000 and "\n" not in data["reason"]


@pytest.mark.parametrize(("reason", "category"), [
    ("no host with a free GPU (VM PENDING past boot_timeout)", "no_capacity"),
    ("no free GPU (PENDING past boot_timeout; oned: [HOST] Unavailable PCI devices on hosts: 0)", "no_capacity"),
    ("no host can take the VM (PENDING past boot_timeout; oned: Cannot allocate VM. Not enough capacity in hosts 0)",
     "no_capacity"),
    ("VM failed to boot (ACTIVE/BOOT_FAILURE)", "boot_failed"),
    ("not up after boot_timeout 6s (ACTIVE/BOOT)", "timeout"),
    ("OpenNebula: [one.template.instantiate] User couldn't be authenticated", "api_error"),
    ("not in any nodeset of nebula-power.toml", "not_in_nodeset"),
    ("busy: another run holds its lock", "busy"),
    ("internal error in resume, see nebula-power log", "internal"),
    ("reconcile: its VM is gone", "vm_lost"),
    ("something new", "other"),
])
def test_reasons_fall_into_a_small_set_of_categories(reason: str, category: str) -> None:
    assert reason_category(reason) == category and category in CATEGORIES


def _append_many(path: str, writer: int, count: int) -> None:
    [vm] = vms_from_xml(VM_DOC)
    audit = AuditLog(__import__("pathlib").Path(path), f"w{writer}", "c1")
    for number in range(count):
        audit.record("running", f"gpu{writer:02d}", vm, jobs=[number], reason="r" * (number % 150))
    audit.close()


def test_concurrent_processes_append_whole_lines(tmp_path) -> None:
    path = tmp_path / "audit.jsonl"
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_append_many, args=(str(path), n, 300)) for n in range(6)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(60)
        assert process.exitcode == 0
    records, bad = read_records(path.read_text().splitlines())
    assert bad == [] and len(records) == 6 * 300
    for writer in range(6):
        assert [r.jobs[0] for r in records if r.program == f"w{writer}"] == list(range(300))  # each in order
    assert stat.S_IMODE(path.stat().st_mode) & 0o027 == 0  # 0640 at most: no write for group, nothing for others


def test_an_unwritable_audit_file_is_logged_once_and_never_fails_the_run(tmp_path, caplog) -> None:
    audit = AuditLog(tmp_path / "missing-dir" / "audit.jsonl", "suspend", "c1")
    for _ in range(3):
        audit.record("removed", "gpu01", Vm(id=1, name="gpu01", state=6, lcm_state=0))
    audit.close()
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "cannot append usage records" in caplog.records[0].message
    assert audit.count("removed") == 3  # still counted for the metrics


def test_lines_that_are_not_records_are_reported_with_their_number() -> None:
    good = '{"v":1,"time":"2025-12-01T08:00:00+00:00","event":"created","node":"gpu01","vm":3}'
    records, bad = read_records([good, "{half a line", '{"event":"exploded","node":"x"}', ""])
    assert len(records) == 1 and [n for n, _ in bad] == [2, 3]
