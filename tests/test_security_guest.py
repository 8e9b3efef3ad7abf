"""A hostile guest (issue 15, item 2): a job user inside a worker VM rewrites what OneGate lets it write.

Identity rests on NAME and the CONTEXT set at instantiate, which OneGate cannot touch (a guest's update goes
through one.vm.update into USER_TEMPLATE only; real-oned.md), so the guest cannot detach its VM: suspend
still frees its GPU, and the next resume makes no second VM.
"""

from __future__ import annotations

import urllib.request
from typing import Any

from opsupport import show
from reliability_support import gpu_holders, live_ours, site

from opennebula_sim import states as S
from slurm_nebula_power.cli import status
from slurm_nebula_power.cli.main import resume_main, suspend_main
from slurm_nebula_power.errors import EXIT_OK

DETACH = 'SLURM_CLUSTER="evil"\nSLURM_NODENAME="elsewhere"\nCONTEXT=[ SLURM_CLUSTER="evil", SLURM_NODENAME="x" ]'


def guest_put(sim: Any, vm_id: int, body: str) -> int:
    """What a job user inside the VM can do: OneGate PUT /vm with the VM's own token."""
    with sim.cloud.lock:
        token = sim.cloud.vms[vm_id].onegate_token
    endpoint = sim.vm(vm_id).template["CONTEXT"]["ONEGATE_ENDPOINT"]
    request = urllib.request.Request(f"{endpoint}/vm", data=body.encode(), method="PUT",
                                     headers={"X-ONEGATE-TOKEN": token, "X-ONEGATE-VMID": str(vm_id)})
    with urllib.request.urlopen(request, timeout=5) as answer:
        return int(answer.status)


def test_a_guest_cannot_detach_its_vm_from_management(tmp_path, sim, capsys) -> None:
    setup = site(tmp_path / "site", sim, boot_timeout=20, poll_max=0.2)
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    [vm] = live_ours(sim)["gpu01"]
    assert guest_put(sim, vm.id, DETACH) == 200
    seen = sim.vm(vm.id)
    assert seen.user_template["SLURM_CLUSTER"] == "evil", "the guest did rewrite its USER_TEMPLATE"
    assert seen.template["CONTEXT"]["SLURM_CLUSTER"] == "testcluster", "but not the CONTEXT"
    # The node is resumed again (its job requeued, say): the VM is still ours, no second one is made.
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    assert [v.id for v in sim.vms() if v.name == "gpu01" and v.state != S.DONE] == [vm.id]
    setup.set_nodes(show("gpu01 State=IDLE+CLOUD"))
    assert status.main(["--json", "gpu01"], setup.env) == EXIT_OK
    assert f'"vm_id": {vm.id}' in capsys.readouterr().out
    # Suspend frees its GPU as for any VM of ours.
    assert suspend_main(["gpu01"], setup.env) == EXIT_OK
    assert sim.vm(vm.id).state == S.DONE and gpu_holders(sim) == {}
