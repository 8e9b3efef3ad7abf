"""Foreign VMs: a VM named like a node but without our tags (or with another cluster's, another node's, or
another user's), in every state the simulator can inject, is never acted on by resume, suspend, resume-fail
or reconcile. A spy on the simulator's API records every call that changes a VM.
"""

from __future__ import annotations

import time

import pytest
from opsupport import ours, show
from reliability_support import CLUSTER, live_ours, recorded_calls, settle, site, vm_changes
from simfixtures import AUTH, fast_config

from opennebula_sim import running_simulator
from opennebula_sim import states as S
from opennebula_sim.config import NetworkSpec
from slurm_nebula_power.cli import reconcile
from slurm_nebula_power.cli.common import build_context
from slurm_nebula_power.cli.main import resume_fail_main, resume_main, suspend_main
from slurm_nebula_power.config import load_config
from slurm_nebula_power.drift import reconcile as repair_drift
from slurm_nebula_power.errors import EXIT_OK

NODES = [f"gpu0{i}" for i in range(1, 9)]
CPU_TEMPLATE = 1  # foreign VMs take CPU, not the GPUs our VMs need


def variants(node: str) -> dict[str, tuple[dict[str, str], int]]:
    """Ways a VM named like node is not ours: (USER_TEMPLATE tags, owner uid)."""
    return {
        "no tags": ({}, 0),
        "other cluster": (ours(node, "othercluster"), 0),
        "our cluster, other node": ({"SLURM_CLUSTER": CLUSTER, "SLURM_NODENAME": "gpu99"}, 0),
        "cluster tag only": ({"SLURM_CLUSTER": CLUSTER}, 0),
        "node tag only": ({"SLURM_NODENAME": node}, 0),
        "another user's, our tags": (ours(node), 5),
    }


INJECTABLE = sorted(set(S.STATE_NAMES.values()) | set(S.LCM_NAMES.values()))


@pytest.fixture
def crowd():
    """A simulator with 32 hosts, and foreign VMs for gpu01..gpu08 in every state and every variant."""
    config = fast_config(hosts=32, gpus=4, network=NetworkSpec(cidr="127.1.0.0/20"))  # 500 leases and more
    with running_simulator(config, auth=AUTH) as sim:
        injected: dict[int, tuple[str, str]] = {}
        refused: set[str] = set()
        for i, state in enumerate(INJECTABLE):
            for j, (variant, (tags, uid)) in enumerate(variants("gpuXX").items()):
                node = NODES[(i + j) % len(NODES)]
                tags = {k: (node if v == "gpuXX" else v) for k, v in tags.items()}
                try:
                    vm_id = sim.add_vm(name=node, user_template=tags, state=state, uid=uid,
                                       template_id=CPU_TEMPLATE)
                except ValueError:
                    refused.add(state)
                    break
                injected[vm_id] = (state, variant)
        yield sim, injected, refused


def test_foreign_vms_in_every_state_are_never_acted_on(crowd, tmp_path) -> None:
    sim, injected, refused = crowd
    assert refused == {"INIT", "ACTIVE", "CLONING", "CLONING_FAILURE"}, "add_vm injects every other state"
    assert len({state for state, _ in injected.values()}) == len(INJECTABLE) - 4 == 79
    setup = site(tmp_path / "site", sim, boot_timeout=20, poll_max=0.2)
    env = setup.env
    with recorded_calls(sim) as calls:
        assert resume_main(["gpu[01-08]"], env) == EXIT_OK
        mine = live_ours(sim)
        assert sorted(mine) == NODES
        assert all(len(vms) == 1 and vms[0].state_str == "RUNNING" for vms in mine.values())
        assert suspend_main(["gpu[01-04]"], env) == EXIT_OK
        assert resume_fail_main(["gpu[05-06]"], env) == EXIT_OK
        # Slurm: gpu01-04 powered down, gpu05-06 up without a VM, gpu07 up, gpu08 powering up.
        setup.set_nodes(show(*(f"{n} State=IDLE+CLOUD+POWERED_DOWN" for n in NODES[:4]),
                             "gpu05 State=IDLE+CLOUD", "gpu06 State=ALLOCATED+CLOUD",
                             "gpu07 State=IDLE+CLOUD", "gpu08 State=ALLOCATED+CLOUD+POWERING_UP"))
        assert reconcile.main([], env) == EXIT_OK
        setup.set_nodes(show(*(f"{n} State=IDLE+CLOUD+POWERED_DOWN" for n in NODES[:6]),
                             "gpu07 State=IDLE+CLOUD", "gpu08 State=ALLOCATED+CLOUD+POWERING_UP"))
        # An hour on, every foreign VM still starting is past boot_timeout: the stuck-boot rule must not bite.
        config = load_config(setup.config, env)
        ctx = build_context(config, env)
        outcome = repair_drift(ctx, ctx.slurm.show_all_nodes, emit=lambda line: None,
                                      now=lambda: time.time() + 3600)
        assert not outcome.failed
        assert resume_fail_main(["gpu[01-08]"], env) == EXIT_OK
        settle(sim)
    touched = {vm_id: what for vm_id, what in vm_changes(calls).items() if vm_id in injected}
    assert touched == {}, {f"VM {i} {injected[i]}": what for i, what in touched.items()}
    assert live_ours(sim) == {}, "our own VMs were all handled"
    ours_made = {vm.id for vm in sim.vms() if vm.id not in injected}
    assert set(vm_changes(calls)) <= ours_made, "only our VMs were changed"
    handed_back = [u[0] for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
    assert handed_back == ["NodeName=gpu[05-06]"], "reconcile handed back the up nodes without a VM of ours"
