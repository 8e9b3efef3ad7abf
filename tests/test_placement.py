"""Direct placement's pure decisions: requirement expressions as oned's scheduler evaluates them, the
candidate hosts, the host choice (pack, a job together), jobs first, the deploy level; and what the host
pool and a VM document give them (hosts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_nebula_power.hosts import Host, PciDevice, VmNeeds, hosts_from_xml, vm_needs_from_xml
from slurm_nebula_power.model import Pci
from slurm_nebula_power.placement import (
    Rooms,
    Unsupported,
    candidates,
    choose,
    deploy_level,
    jobs_first,
    requirement,
)

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "opennebula-xml"
GPU = Pci(vendor="10de", klass="0302")
ONE_GPU = VmNeeds(cpu=100, memory_kb=1024 * 1024, pci=(GPU,))


def gpus(count: int, taken: int = 0) -> tuple[PciDevice, ...]:
    return tuple(PciDevice(f"{41 + i:02x}:00.0", vendor="10de", klass="0302", vmid=7 if i < taken else -1)
                 for i in range(count))


def host(hid: int, free: int = 4, taken: int = 0, state: int = 2, cluster: int = 0, cpu: int | None = 6400,
         **attrs: str) -> Host:
    attributes = (("ID", str(hid)), ("NAME", f"h{hid}"), ("CLUSTER_ID", str(cluster)), *attrs.items())
    return Host(id=hid, name=f"h{hid}", state=state, devices=gpus(free + taken, taken), cluster_id=cluster,
                cpu_free=cpu, memory_free_kb=512 << 20, searched=attributes)


# ---- requirement expressions ---------------------------------------------------------------------------

H = host(3, ARCH="x86_64", LABELS="gpu,a100", PIN_POLICY="NONE", FREE="1.5")


@pytest.mark.parametrize(("text", "holds"), [
    ("", True),
    ("ID = 3", True),
    ("ID != 3", False),
    ("ID > 2 & ID < 4", True),
    ("CLUSTER_ID = 0 | CLUSTER_ID = 100", True),
    ("(CLUSTER_ID = 0) & !(PIN_POLICY = PINNED)", True),
    ("(CLUSTER_ID = 0) & !(PUBLIC_CLOUD = YES) & !(PIN_POLICY = PINNED)", True),
    ('ARCH = "x86*"', True),                        # shell wildcards (fnmatch)
    ("NAME = h3", True),
    ("MISSING != 1", False),                        # oned: an attribute a host lacks fails even !=
    ("!(MISSING = 1)", True),
    ("FREE > 1.2", True),
    ('LABELS = "*a100*"', True),
    ("ID = 3 | ID = 4 & ID = 5", False),            # one precedence, left to right: (3 | 4) & 5
    ("! ID = 3 & ID = 4", False),                   # ! binds to the next comparison: (!(ID = 3)) & ID = 4
])
def test_requirements_evaluate_as_oneds_scheduler_does(text: str, holds: bool) -> None:
    assert requirement(text)(H) is holds


@pytest.mark.parametrize("text", [
    "CURRENT_VMS != 5",                 # oned's pseudo-attribute of a host's VMs
    '"/HOST/TEMPLATE/X" = 1',           # an xpath
    "ID = $VMID",                       # no substitution here
    "ID = 3 &",                         # unfinished
    "(ID = 3",                          # unbalanced
    "ID >= 3",                          # no such operator
    "NAME > abc",                       # > compares numbers only
])
def test_requirements_we_cannot_evaluate_are_unsupported(text: str) -> None:
    with pytest.raises(Unsupported):
        requirement(text)


@pytest.mark.parametrize("text", ["!" * 996 + "ID = 3", "(" * 495 + "ID = 3" + ")" * 495])
def test_a_requirement_nested_deeper_than_the_bound_is_unsupported_never_a_recursion_error(text: str) -> None:
    # SCHED_REQUIREMENTS are the template's (or whoever rewrites OpenNebula's answers): under the token bound,
    # 996 `!` recursed past Python's limit and the RecursionError left the first VM on hold (exit 4)
    with pytest.raises(Unsupported, match="nesting deeper than 32"):
        requirement(text)
    assert requirement("!" * 32 + "ID = 3")(H) is True


def test_a_host_value_too_long_for_an_integer_is_skipped_as_oned_skips_it() -> None:
    # int() refuses 4,300 digits: a host attribute of 5,000 made the comparison raise ValueError
    huge = host(0, FREE_CPU="9" * 5000)
    assert requirement("FREE_CPU > 400")(huge) is False
    assert requirement("FREE_CPU > 400")(host(0, FREE_CPU="800")) is True


def test_candidates_take_placeable_hosts_meeting_both_requirements() -> None:
    hosts = [host(0), host(1, state=4), host(2, cluster=100), host(3)]
    needs = VmNeeds(cpu=100, memory_kb=1, requirements="(CLUSTER_ID = 0) & !(PIN_POLICY = PINNED)",
                    sched_requirements="ID > 0", ds_requirements='("CLUSTERS/ID" @> 0)')
    assert [h.id for h in candidates(hosts, needs)] == [3]


@pytest.mark.parametrize(("needs", "why"), [
    (VmNeeds(cpu=1, memory_kb=1, vm_group=True), "VMGROUP"),
    (VmNeeds(cpu=1, memory_kb=1, auto_nics=True), "NETWORK_MODE"),
    (VmNeeds(cpu=1, memory_kb=1, pinned=True), "PIN_POLICY"),
    (VmNeeds(cpu=1, memory_kb=1, sched_ds_requirements="ID = 100"), "SCHED_DS_REQUIREMENTS"),
    (VmNeeds(cpu=1, memory_kb=1, ds_requirements='("CLUSTERS/ID" @> 0) & ("ID" @> 105)'), "AUTOMATIC_DS"),
])
def test_what_only_the_scheduler_honours_is_unsupported(needs: VmNeeds, why: str) -> None:
    with pytest.raises(Unsupported, match=why):
        candidates([host(0)], needs)


# ---- the host choice -----------------------------------------------------------------------------------


def place(rooms: Rooms, hosts: list[Host], needs: VmNeeds = ONE_GPU, **kw) -> int | None:
    chosen = choose(rooms, hosts, needs, **kw)
    if chosen is None:
        return None
    rooms.take(chosen[0].id, needs, chosen[1])
    return chosen[0].id


def test_pack_fills_the_fullest_host_first() -> None:
    hosts = [host(0, free=4), host(1, free=2, taken=2), host(2, free=3, taken=1)]
    rooms = Rooms(hosts)
    assert [place(rooms, hosts) for _ in range(9)] == [1, 1, 2, 2, 2, 0, 0, 0, 0]
    assert place(rooms, hosts) is None


def test_a_job_goes_where_it_fits_whole_then_stays_together() -> None:
    hosts = [host(0, free=1, taken=3), host(1, free=4)]
    rooms = Rooms(hosts)
    first = place(rooms, hosts, want=2)
    assert first == 1  # host 0 is fuller but takes one of the two
    assert place(rooms, hosts, near={1: 1}) == 1


def test_cpu_and_memory_count_as_oned_enforce_counts_them() -> None:
    hosts = [host(0, cpu=150), host(1, cpu=6400)]
    rooms = Rooms(hosts)
    assert [place(rooms, hosts) for _ in range(3)] == [0, 1, 1]  # host 0 holds one VM of 100


def test_a_dropped_host_takes_nothing_more() -> None:
    hosts = [host(0), host(1)]
    rooms = Rooms(hosts)
    rooms.drop(0)
    assert place(rooms, [h for h in hosts if h.id in rooms.hosts]) == 1


def test_a_cpu_only_vm_packs_by_cpu() -> None:
    hosts = [host(0, cpu=1000), host(1, cpu=300)]
    needs = VmNeeds(cpu=100, memory_kb=1)
    rooms = Rooms(hosts)
    assert [place(rooms, hosts, needs) for _ in range(4)] == [1, 1, 1, 0]


# ---- jobs first, the deploy level ----------------------------------------------------------------------


def test_jobs_first_puts_the_earliest_jobs_nodes_first_and_jobless_last() -> None:
    jobs = {"n5": [7], "n6": [7], "n1": [8], "n2": [8, 7]}  # the resume file's order: job 7, then 8
    order = jobs_first(["n1", "n2", "n3", "n5", "n6"], jobs, lambda n: n)
    assert order == ["n2", "n5", "n6", "n1", "n3"]


@pytest.mark.parametrize(("user", "group", "level"), [
    ({}, {}, "ADMIN"),
    ({"MANAGE": "deploy"}, {}, "MANAGE"),
    ({}, {"USE": "deploy, resume"}, "USE"),
    ({"ADMIN": "deploy"}, {"MANAGE": "deploy"}, "ADMIN"),  # the user's template before its group's
])
def test_deploy_level_user_then_group_then_oned_conf(user, group, level) -> None:
    system = {"ADMIN": "migrate, delete, recover, retry, deploy, resched,\n    backup, restore", "MANAGE": "hold"}
    assert deploy_level(user, group, system) == level


# ---- documents -----------------------------------------------------------------------------------------


def test_a_recorded_host_document_gives_cluster_room_and_attributes() -> None:
    text = (REFERENCE / "host_01.xml").read_text().replace(' xmlns="http://opennebula.org/XMLSchema"', "")
    [parsed] = hosts_from_xml(text)
    assert (parsed.cluster_id, parsed.cpu_free, parsed.memory_free_kb) == (0, 100, 1020364)
    assert requirement('CLUSTER = default & HYPERVISOR = kvm & LABELS = "*LOWPOWER*" & MAX_CPU > 50')(parsed)
    assert parsed.attribute("ID") == ["0"]


VM_7_0_2 = """<VM><ID>0</ID><STATE>2</STATE><TEMPLATE><AUTOMATIC_DS_REQUIREMENTS><![CDATA[("CLUSTERS/ID" @> 0)]]>
</AUTOMATIC_DS_REQUIREMENTS><AUTOMATIC_NIC_REQUIREMENTS><![CDATA[("CLUSTERS/ID" @> 0)]]></AUTOMATIC_NIC_REQUIREMENTS>
<AUTOMATIC_REQUIREMENTS><![CDATA[(CLUSTER_ID = 0) & !(PIN_POLICY = PINNED)]]></AUTOMATIC_REQUIREMENTS>
<CPU><![CDATA[0.1]]></CPU><MEMORY><![CDATA[128]]></MEMORY><NIC><NETWORK><![CDATA[slurm-net]]></NETWORK></NIC>
<PCI><CLASS><![CDATA[0302]]></CLASS><PCI_ID><![CDATA[0]]></PCI_ID><VENDOR><![CDATA[10de]]></VENDOR></PCI></TEMPLATE>
<USER_TEMPLATE><SCHED_REQUIREMENTS><![CDATA[ID=1]]></SCHED_REQUIREMENTS></USER_TEMPLATE></VM>"""


@pytest.mark.parametrize("cpu, units", [("0.1", 10), ("2", 200), (".5", 50), ("1.", 100), ("0.125", 12),
                                        ("0.999", 100), ("", 0), ("9999999.99", 999999999)])
def test_a_vm_cpu_is_read_in_hundredths(cpu: str, units: int) -> None:
    assert vm_needs_from_xml(VM_7_0_2.replace("<![CDATA[0.1]]>", cpu)).cpu == units


@pytest.mark.parametrize("cpu", ["1_0", "\u0661", "nan", "inf", "1e3", "-1", "+1", ".", "0x1", "1.2.3", "12345678"])
def test_a_vm_cpu_that_is_not_a_plain_decimal_is_refused_without_its_value(cpu: str) -> None:
    with pytest.raises(ValueError) as refused:
        vm_needs_from_xml(VM_7_0_2.replace("<![CDATA[0.1]]>", cpu))
    assert str(refused.value) == "VM/TEMPLATE/CPU is not a number"


def test_a_vm_document_gives_what_it_asks_of_a_host() -> None:
    needs = vm_needs_from_xml(VM_7_0_2)
    assert (needs.cpu, needs.memory_kb, needs.sched_requirements) == (10, 128 * 1024, "ID=1")
    assert needs.pci == (Pci(vendor="10de", klass="0302"),)
    assert [h.id for h in candidates([host(0), host(1)], needs)] == [1]
