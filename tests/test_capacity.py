"""Pure capacity decisions: matching a template's GPUs against the host pool, admitting nodes job by job,
the all-or-nothing drag, the cooldown's retry rule and its state file."""

from __future__ import annotations

import json

import pytest

from slurm_nebula_power.admission import COUNT, PLACEMENT, Need, Shortage, admit, may_retry
from slurm_nebula_power.capacity import PciRequest, Pool, gpu_requests, held_by, label, usage
from slurm_nebula_power.cooldown import ShortageLog
from slurm_nebula_power.hosts import Host, PciDevice, hosts_from_xml
from slurm_nebula_power.model import Pci
from slurm_nebula_power.plan import dragged
from slurm_nebula_power.shapes import pci_gpus

GPU = PciRequest(vendor="10de", klass="0302")


def gpu(addr: str, vmid: int = -1, device: str = "2330", profiles: tuple[str, ...] = ()) -> PciDevice:
    return PciDevice(addr, vendor="10de", device=device, klass="0302", profiles=profiles, vmid=vmid)


def host(name: str, *devices: PciDevice, state: int = 2) -> Host:
    return Host(id=0, name=name, state=state, devices=devices)


def test_gpu_requests_are_the_templates_gpu_entries_not_its_nics() -> None:
    template = {"PCI": [{"VENDOR": "10de", "CLASS": "0302"}, {"TYPE": "NIC", "VENDOR": "15b3"},
                        {"VENDOR": "10de", "CLASS": "0302", "PROFILE": "1145"}]}
    assert gpu_requests(template) == (GPU, PciRequest(vendor="10de", klass="0302", profile="1145"))
    assert gpu_requests({"CPU": "4"}) == ()
    assert label((GPU, GPU)) == "10de:0302"


@pytest.mark.parametrize(("entry", "is_gpu"), [
    ({"VENDOR": "10de", "CLASS": "0302"}, True),
    ({"VENDOR": "1002"}, True),                       # a GPU vendor, no CLASS
    ({"VENDOR": "8086"}, False),                      # another vendor without CLASS is not taken for a GPU
    ({"VENDOR": "15b3", "CLASS": "0207"}, False),
    ({"VENDOR": "10de", "CLASS": "0302", "TYPE": "nic"}, False),
    ({"PROFILE": "nvidia-h100-1-10c"}, True),
    ({"SHORT_ADDRESS": "41:00.0"}, True),             # one exact device by address
    ({"VENDOR": "8086", "SHORT_ADDRESS": "41:00.0"}, False),
    ({"DEVICE": "2330"}, False),
])
def test_one_gpu_rule_for_templates_capacity_and_vms(entry: dict[str, str], is_gpu: bool) -> None:
    assert Pci.from_entry(entry).is_gpu is is_gpu
    assert len(gpu_requests({"PCI": entry})) == pci_gpus(entry) == int(is_gpu)


@pytest.mark.parametrize(("request_", "device", "match"), [
    (GPU, gpu("41:00.0"), True),
    (PciRequest(vendor="10DE", device="2330"), gpu("41:00.0"), True),  # hex, either case
    (PciRequest(vendor="10de", device="20b5"), gpu("41:00.0"), False),
    (PciRequest(vendor="1002", klass="0302"), gpu("41:00.0"), False),
    (PciRequest(short_address="41:00.0"), gpu("41:00.0"), True),
    (PciRequest(short_address="42:00.0"), gpu("41:00.0"), False),
    (PciRequest(vendor="10de", profile="1146"), gpu("41:00.0", profiles=("1145 (NVIDIA L40S-1B)",)), False),
    (PciRequest(vendor="10de", profile="1145"), gpu("41:00.0", profiles=("1145 (NVIDIA L40S-1B)",)), True),
    (PciRequest(vendor="10de", profile="NVIDIA L40S-1B"), gpu("41:00.0", profiles=("1145 (NVIDIA L40S-1B)",)),
     True),
    (PciRequest(vendor="10de", profile="1145"), gpu("41:00.0"), True),  # no PROFILES listed: oned decides
])
def test_matching_follows_oned(request_: PciRequest, device: PciDevice, match: bool) -> None:
    assert request_.matches(device) is match


def test_pool_counts_free_devices_on_placeable_hosts_only() -> None:
    hosts = [host("a", gpu("41:00.0"), gpu("42:00.0", vmid=5)), host("b", gpu("41:00.0"), state=4),
             host("c", gpu("41:00.0"), state=8), host("d", gpu("41:00.0", vmid=9))]
    assert Pool(hosts).free((GPU,)) == 1
    assert Pool(hosts, released=[9]).free((GPU,)) == 2, "a VM we are about to terminate frees its GPU"


def test_a_vm_needing_two_gpus_fits_only_where_two_are_free() -> None:
    hosts = [host("a", gpu("41:00.0"), gpu("42:00.0", vmid=1)), host("b", gpu("41:00.0")),
             host("c", gpu("41:00.0"), gpu("42:00.0"), gpu("43:00.0"))]
    pool = Pool(hosts)
    assert pool.take((GPU, GPU)) and not pool.take((GPU, GPU)), "floor(3/2) on c, none on a or b"
    assert pool.take((GPU,)) and pool.take((GPU,)) and pool.take((GPU,)) and not pool.take((GPU,))


def test_take_all_is_all_or_none() -> None:
    pool = Pool([host("a", gpu("41:00.0"), gpu("42:00.0"))])
    assert not pool.take_all([(GPU,)] * 3)
    assert pool.free((GPU,)) == 2


def test_held_by_and_usage() -> None:
    hosts = [host("a", gpu("41:00.0", vmid=3), gpu("42:00.0", vmid=4), gpu("43:00.0")),
             host("b", gpu("41:00.0"), state=4)]
    assert held_by(hosts, 3) == 1 and held_by(hosts, 8) == 0
    assert [(u.host, u.state, u.placeable, u.free, u.ours, u.others) for u in usage(hosts, (GPU,), [3])] == [
        ("a", "MONITORED", True, 1, 1, 1), ("b", "DISABLED", False, 1, 0, 0)]


def test_hosts_from_xml_reads_only_host_share_pci_devices() -> None:
    text = ("<HOST_POOL><HOST><ID>3</ID><NAME>h</NAME><STATE>4</STATE><HOST_SHARE><PCI_DEVICES><PCI>"
            "<SHORT_ADDRESS>41:00.0</SHORT_ADDRESS><VENDOR>10de</VENDOR><DEVICE>2330</DEVICE><CLASS>0302</CLASS>"
            "<PROFILES>1145 (NVIDIA L40S-1B),1146 (NVIDIA L40S-2B)</PROFILES><VMID>12</VMID></PCI></PCI_DEVICES>"
            "</HOST_SHARE><TEMPLATE><PCI><SHORT_ADDRESS>99:00.0</SHORT_ADDRESS></PCI></TEMPLATE></HOST></HOST_POOL>")
    [h] = hosts_from_xml(text)
    assert (h.id, h.name, h.state_name, h.placeable) == (3, "h", "DISABLED", False)
    assert h.devices == (PciDevice("41:00.0", "10de", "2330", "0302",
                                   ("1145 (NVIDIA L40S-1B)", "1146 (NVIDIA L40S-2B)"), 12),)


def needs(*nodes: str) -> list[Need]:
    return [Need(n, "gpu[01-08]", (GPU,)) for n in nodes]


def test_admit_all_or_nothing_refuses_the_whole_job_and_lets_a_later_one_fit() -> None:
    pool = Pool([host("a", *(gpu(f"4{i}:00.0") for i in range(3)))])
    jobs = {"n1": [7], "n2": [7], "n3": [7], "n4": [7], "n5": [8]}
    refused = admit(needs("n1", "n2", "n3", "n4", "n5"), jobs, lambda n: True, pool)
    assert refused == {n: "job 7: needs 5 GPUs 10de:0302, 3 free" for n in ("n1", "n2", "n3", "n4")}


def test_admit_best_effort_takes_what_fits() -> None:
    pool = Pool([host("a", gpu("41:00.0"), gpu("42:00.0"))])
    refused = admit(needs("n1", "n2", "n3"), {}, lambda n: False, pool)
    assert refused == {"n3": "needs 3 GPUs 10de:0302, 2 free"}


def test_admit_counts_our_pending_vms_first_and_never_refuses_them() -> None:
    pool = Pool([host("a", gpu("41:00.0"))])
    queued = Need("n1", "gpu[01-08]", (GPU,), queued=True)
    assert admit([queued, *needs("n2")], {}, lambda n: True, pool) == {"n2": "needs 1 GPU 10de:0302, 1 free"}


def test_admit_ignores_nodes_that_need_nothing_new() -> None:
    pool = Pool([host("a", gpu("41:00.0", vmid=4))])
    assert admit([Need("n1", "gpu[01-08]")], {"n1": [1]}, lambda n: True, pool) == {}


def test_dragged_takes_the_jobs_other_all_or_nothing_nodes() -> None:
    jobs = {"a": [1], "b": [1], "c": [1], "cpu": [1]}
    assert dragged({"a"}, jobs, lambda n: n != "cpu") == {"b": 1, "c": 1}


def test_dragged_keeps_a_node_another_intact_job_needs() -> None:
    jobs = {"a": [1], "b": [1, 2], "c": [2]}
    assert dragged({"a"}, jobs, lambda n: True) == {}
    assert dragged({"a", "c"}, jobs, lambda n: True) == {"b": 1}


def test_dragged_leaves_nodes_of_no_job_alone() -> None:
    assert dragged({"a"}, {"b": [1]}, lambda n: True) == {}


@pytest.mark.parametrize(("kind", "then", "now", "wanted", "retry"), [
    (COUNT, 3, 3, 4, False),      # the 4-node job still does not fit
    (COUNT, 3, 3, 1, True),       # a 1-GPU job does
    (PLACEMENT, 4, 4, 1, False),  # oned could not place with 4 "free": the count is not trusted
    (PLACEMENT, 0, 1, 1, True),   # someone freed a GPU since
    (PLACEMENT, None, 4, 1, False),
    (COUNT, 3, None, 1, False),   # host pool unreadable now
])
def test_may_retry(kind: str, then: int | None, now: int | None, wanted: int, retry: bool) -> None:
    shortage = Shortage("gpu[01-08]", 0.0, kind, then, "x", ({"vendor": "10de"},))
    assert may_retry(shortage, now, wanted) is retry


def test_shortage_log_round_trip_atomic_and_safe(tmp_path) -> None:
    store = ShortageLog(tmp_path / "locks", clock=lambda: 1000.0)
    assert store.read("gpu[01-08]") is None
    store.record("gpu[01-08]", PLACEMENT, 0, "no free GPU", [{"vendor": "10de", "klass": "0302"}])
    got = store.read("gpu[01-08]")
    assert got == Shortage("gpu[01-08]", 1000.0, PLACEMENT, 0, "no free GPU", ({"vendor": "10de", "klass": "0302"},))
    assert got is not None and got.age(1060.5) == 60.5
    assert [p.name for p in (tmp_path / "locks").iterdir()] == [store.path("gpu[01-08]").name], "no temp file left"
    assert store.read("cpu[01-04]") is None
    store.path("gpu[01-08]").write_text("{not json")
    assert store.read("gpu[01-08]") is None
    store.path("gpu[01-08]").write_text(json.dumps({"nodes": "other", "at": 1, "kind": COUNT}))
    assert store.read("gpu[01-08]") is None, "a hash collision is no shortage"
    store.clear("gpu[01-08]")
    store.clear("gpu[01-08]")
    assert store.read("gpu[01-08]") is None
