"""check proves each node set's template as the configured OpenNebula user (issue 32): its NICs' networks and
DISKs' images resolve for that user as oned resolves them at instantiate, and `check --instantiate` lets oned
itself instantiate it on hold, removed at once; the Reason of a resume oned refused for such a name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from simfixtures import calls, fast_config
from support import Setup, make_setup

from opennebula_sim import Simulator, TemplateSpec, running_simulator
from opennebula_sim import states as S
from slurm_nebula_power.cli import check
from slurm_nebula_power.errors import EXIT_NODES_FAILED, CloudError
from slurm_nebula_power.grants import Rights
from slurm_nebula_power.operation import cloud_reason
from slurm_nebula_power.owned import NETWORK, Owned, resolve

PLAIN = "slurm:Plain-pass-1"  # the unprivileged user a site makes for Slurm: uid 2, group users (1)
BODY = 'CPU = "1"\nVCPU = "2"\nMEMORY = "2048"\nPCI = [ VENDOR = "10de", CLASS = "0302" ]\n' \
       'CONTEXT = [ NETWORK = "YES" ]\n'
NODESET = '[[nodeset]]\nnodes = "gpu[01-02]"\ntemplate = "worker"\n'
SUBJECT = "node set gpu[01-02] template 'worker'"


@pytest.fixture
def cloud(request: pytest.FixtureRequest) -> Iterator[Simulator]:
    """The simulator as the Slurm user sees it; the template `worker` (id 0) is BODY plus the test's lines."""
    lines = getattr(request, "param", 'NIC = [ NETWORK = "slurm-net", NETWORK_UNAME = "oneadmin" ]\n')
    config = fast_config(templates=(TemplateSpec(0, "worker", BODY + lines),))
    with running_simulator(config, auth=PLAIN) as sim:
        yield sim


def site(tmp_path: Path, sim: Simulator, nodesets: str = NODESET) -> Setup:
    return make_setup(tmp_path / "site", sim.endpoint, PLAIN, nodesets=nodesets)


def findings(setup: Setup, capsys, *args: str) -> tuple[int, list[dict[str, str]]]:
    code = check.main(["--json", *args], setup.env)
    return code, [f for f in json.loads(capsys.readouterr().out) if f["subject"].startswith("node set gpu[01-02] "
                                                                                          "template")]


def lines(found: list[dict[str, str]], level: str) -> list[str]:
    return [f"{f['subject']}: {f['text']} -> {f['fix']}" for f in found if f["level"] == level]


def test_a_template_that_resolves_for_the_user_is_ok_and_names_what_it_uses(tmp_path, capsys, cloud) -> None:
    _, found = findings(site(tmp_path, cloud), capsys)
    assert f"{SUBJECT} networks and images: resolve for user slurm as oned resolves them at instantiate: NIC 0 " \
           "network slurm-net (id 0, oneadmin's) -> " in lines(found, "ok")
    assert not lines(found, "problem")
    assert calls(cloud, "one.template.instantiate") == 0, "check creates nothing without --instantiate"


@pytest.mark.parametrize("cloud", ['NIC = [ NETWORK = "slurm-net" ]\n'], indirect=True)
def test_a_nic_network_by_name_of_another_owner_is_a_problem_with_the_exact_fix(tmp_path, capsys, cloud) -> None:
    # issue 32: check said nothing, then every resume failed with "User 2 does not own a network..."
    code, found = findings(site(tmp_path, cloud), capsys)
    assert code == EXIT_NODES_FAILED
    assert lines(found, "problem") == [
        f'{SUBJECT} NIC 0: NETWORK = "slurm-net" is looked up among the networks of user slurm itself (no '
        "NETWORK_UNAME or NETWORK_UID), but the network slurm-net user slurm may use is oneadmin's (id 0): oned "
        'refuses every instantiate ("does not own a network with name") -> add NETWORK_UNAME = "oneadmin" to the '
        "NIC, or use NETWORK_ID = 0 (onetemplate update, or make the template again with `slurm-nebula-power "
        "template`, which names them by id)"]
    # and oned agrees: --instantiate reports its refusal, naming the node set
    _, found = findings(site(tmp_path / "again", cloud), capsys, "--instantiate")
    [refused] = [line for line in lines(found, "problem") if line.startswith(f"{SUBJECT} instantiate:")]
    assert refused.startswith(f"{SUBJECT} instantiate: oned refuses to instantiate it as user slurm: "
                              "[one.template.instantiate] Error allocating a new virtual machine template. User 2 "
                              "does not own a network with name: slurm-net . Set NETWORK_UNAME or NETWORK_UID of "
                              "owner in NIC.")
    assert not [vm for vm in cloud.vms() if vm.state != S.DONE]


@pytest.mark.parametrize("cloud", ['DISK = [ IMAGE = "slurm-worker", IMAGE_UNAME = "oneadmin" ]\n'], indirect=True)
def test_a_disk_image_the_user_may_not_use_names_the_acl_to_grant(tmp_path, capsys, cloud) -> None:
    cloud.set_use("image", 0, other_use=False)
    _, found = findings(site(tmp_path, cloud), capsys)
    assert lines(found, "problem") == [
        f'{SUBJECT} DISK 0: IMAGE = "slurm-worker" is looked up among the images of oneadmin (IMAGE_UNAME), and '
        "user slurm may use no image of that name: oned refuses every instantiate -> as oneadmin grant USE of it: "
        'oneacl create "@1 IMAGE/#<id> USE" (oneimage list shows the id), or name one the user may use '
        "(onetemplate update, or make the template again with `slurm-nebula-power template`, which names them by id)"]
    cloud.set_use("image", 0, grant_gid=1)  # the rule check names
    _, found = findings(site(tmp_path / "granted", cloud), capsys)
    assert not lines(found, "problem")


@pytest.mark.parametrize("cloud", ['NIC = [ NETWORK_ID = "7" ]\n'], indirect=True)
def test_a_network_id_that_names_nothing_usable_is_a_problem(tmp_path, capsys, cloud) -> None:
    _, found = findings(site(tmp_path, cloud), capsys)
    assert lines(found, "problem") == [
        f'{SUBJECT} NIC 0: NETWORK_ID = "7": user slurm may use no network 7 ("Virtual network with ID: 7 does not '
        'exist" or not authorized to USE it) -> as oneadmin grant USE of it: oneacl create "@1 NET/#7 USE", or set '
        "NETWORK_ID to one it may use (onetemplate update, or make the template again with `slurm-nebula-power "
        "template`, which names them by id)"]


@pytest.mark.parametrize("cloud", ['NIC = [ NETWORK_ID = "0" ]\nPCI = [ TYPE = "NIC", NETWORK = "ib-vfs" ]\n'],
                         indirect=True)
def test_the_network_of_a_pci_nic_is_checked_too(tmp_path, capsys, cloud) -> None:
    cloud.add_network("ib-vfs", uid=0)
    _, found = findings(site(tmp_path, cloud), capsys)
    [problem] = lines(found, "problem")
    assert problem.startswith(f'{SUBJECT} PCI 1 (TYPE NIC): NETWORK = "ib-vfs" is looked up among the networks of '
                              "user slurm itself")
    assert 'add NETWORK_UNAME = "oneadmin" to the NIC, or use NETWORK_ID = 1' in problem


def test_a_template_the_user_cannot_see_says_how_to_make_it_the_users(tmp_path, capsys, cloud) -> None:
    # issue 32: "create the template in OpenNebula" for a template that exists, oneadmin's
    setup = site(tmp_path, cloud, NODESET.replace('"worker"', '"oneadmins-worker"'))
    _, found = findings(setup, capsys)
    [problem] = [line for line in lines(found, "problem") if "'oneadmins-worker'" in line]
    assert "no VM template named 'oneadmins-worker' is visible to user slurm" in problem
    assert f"if it does not exist, create it as that user: ONE_AUTH={setup.root / 'one_auth'} onetemplate create " \
           "FILE" in problem
    assert "if it exists but is another user's (made as oneadmin), as oneadmin: onetemplate chown <id> slurm" in problem


def test_instantiate_proves_the_template_on_hold_and_removes_the_vm_at_once(tmp_path, capsys, cloud) -> None:
    _, found = findings(site(tmp_path, cloud), capsys, "--instantiate")
    [proved] = [line for line in lines(found, "ok") if line.startswith(f"{SUBJECT} instantiate:")]
    assert proved.startswith(f"{SUBJECT} instantiate: oned instantiated it on hold as user slurm (VM 0, named "
                             "'slurm-nebula-power check 0') and check removed it at once")
    [vm] = cloud.vms()
    assert vm.state == S.DONE and vm.uid == 2 and vm.name == "slurm-nebula-power check 0"
    assert calls(cloud, "one.vm.action") == 1 and calls(cloud, "one.vm.deploy") == 0  # terminate: owner's right
    # nothing that reconcile or status could take for a node's VM: no node name, no identity in it
    assert "SLURM_CLUSTER" not in vm.user_template and "SLURM_NODENAME" not in vm.template.get("CONTEXT", {})
    assert vm.user_template["SLURM_NEBULA_POWER_CHECK"].startswith("instantiate probe of check")


def test_instantiate_over_the_quota_is_a_warning_not_a_verdict(tmp_path, capsys, cloud) -> None:
    cloud.set_faults(quota_exceeded=True)
    _, found = findings(site(tmp_path, cloud), capsys, "--instantiate")
    [warned] = [line for line in lines(found, "warning") if line.startswith(f"{SUBJECT} instantiate:")]
    assert "not proved: oned refused it for a quota of user slurm" in warned
    assert not cloud.vms()


def test_check_help_says_it_creates_nothing_without_instantiate(capsys) -> None:
    assert check.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--instantiate" in out and "creates nothing in OpenNebula unless --instantiate is given" in out


# ---- the rules, without oned ------------------------------------------------------------------------------

USER = Rights(2, "slurm", 1, (1,))
POOL = [Owned(0, "slurm-net", 0, "oneadmin"), Owned(4, "slurm-net", 2, "slurm"), Owned(5, "other", 7, "user7")]


@pytest.mark.parametrize(("nic", "found"), [
    ({"NETWORK": "slurm-net"}, 4),  # the user's own first: no owner given
    ({"NETWORK": "slurm-net", "NETWORK_UNAME": "oneadmin"}, 0),
    ({"NETWORK": "slurm-net", "NETWORK_UID": "0"}, 0),
    ({"NETWORK_ID": "5", "NETWORK": "slurm-net"}, 5),  # the id wins over the name, as in oned
    ({"NETWORK": "other"}, None),
    ({"NETWORK": "other", "NETWORK_UNAME": "user7"}, 5),
    ({"NETWORK_ID": "²"}, None),  # not an ASCII number
])
def test_a_nic_resolves_as_oned_resolves_it(nic, found) -> None:
    hit = resolve(NETWORK, nic, POOL, USER)
    assert (hit.id if isinstance(hit, Owned) else None) == found


def test_a_nic_without_a_predefined_network_names_nothing() -> None:
    assert resolve(NETWORK, {"NETWORK_MODE": "auto", "NETWORK": "x"}, POOL, USER) is None
    assert resolve(NETWORK, {"MODEL": "virtio"}, POOL, USER) is None


# ---- resume's Reason --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("said", "reason"), [
    ("[one.template.instantiate] Error allocating a new virtual machine template. User 2 does not own a network "
     "with name: slurm-net . Set NETWORK_UNAME or NETWORK_UID of owner in NIC.",
     "OpenNebula: template NIC: network slurm-net not owned by user 2; set NETWORK_UNAME or use NETWORK_ID "
     "(check says how)"),
    ("[one.template.instantiate] Error allocating a new virtual machine template. DISK 0: User 2 does not own an "
     "image with name: " + "w" * 90 + " . Set IMAGE_UNAME or IMAGE_UID of owner in DISK.",
     "OpenNebula: template DISK: image " + "w" * 37 + "... not owned by user 2; set IMAGE_UNAME or use IMAGE_ID "
     "(check says how)"),
    ("[one.template.instantiate] Error allocating a new virtual machine template. Virtual network with ID: 9 does "
     "not exist", "OpenNebula: template NIC: no network 9; fix NETWORK_ID (check says how)"),
    ("[one.template.instantiate] User [2] : Not authorized to perform USE IMAGE [3].",
     "OpenNebula: template DISK: image 3 not usable by the user; oneadmin grants USE (check says how)"),
])
def test_resume_reason_for_a_template_reference_is_a_short_whole_sentence(said, reason) -> None:
    # issue 32: the node's Reason was oned's text cut at REASON_LENGTH, "... Set NETWORK_UNAME or"
    assert cloud_reason(CloudError(said)) == reason
    assert len("nebula: " + reason) <= 200  # slurm.hand_back's cut never reaches it


# ---- oned's pool documents, strictly -----------------------------------------------------------------------

VNET = "<VNET><ID>{id}</ID><UID>0</UID><GID>0</GID><UNAME>oneadmin</UNAME><NAME>{name}</NAME></VNET>"


def test_the_pools_are_read_strictly() -> None:
    from slurm_nebula_power.owned import owned_from_xml

    text = "<VNET_POOL>" + VNET.format(id=3, name="slurm-net") + "</VNET_POOL>"
    assert owned_from_xml(text, NETWORK) == [Owned(3, "slurm-net", 0, "oneadmin")]
    for bad in (VNET.format(id="1_0", name="x"), VNET.format(id="٣", name="x"), VNET.format(id=1, name="n" * 129)):
        with pytest.raises(ValueError, match="VNET/"):  # the field named, never its value
            owned_from_xml(f"<VNET_POOL>{bad}</VNET_POOL>", NETWORK)


@pytest.mark.parametrize("field", ["NAME", "UNAME"])
def test_a_network_name_or_owner_with_a_control_character_is_refused_never_written_into_a_template(field) -> None:
    # template writes the owner's name into a comment line: a newline there would be a template line of its own
    from slurm_nebula_power.owned import NETWORK, owned_from_xml

    values = {"NAME": "slurm-net", "UNAME": "oneadmin"}
    values[field] += "\nCONTEXT = [ X = 1 ]"
    text = (f"<VNET_POOL><VNET><ID>0</ID><UID>0</UID><NAME>{values['NAME']}</NAME>"
            f"<UNAME>{values['UNAME']}</UNAME></VNET></VNET_POOL>")
    with pytest.raises(ValueError, match="control character"):
        owned_from_xml(text, NETWORK)
