"""Helpers shared by the operator-command tests (status, reconcile, check)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from simfixtures import AUTH
from support import Setup, make_setup


def ours(node: str, cluster: str = "testcluster") -> dict[str, str]:
    """The USER_TEMPLATE tags that make a VM ours."""
    return {"SLURM_CLUSTER": cluster, "SLURM_NODENAME": node}


def ours_vm(node: str, cluster: str = "testcluster") -> dict[str, dict[str, str]]:
    """add_vm arguments for a VM of ours as resume makes it: the identity in CONTEXT, the tags too."""
    context = {"SLURM_NODENAME": node, "SLURM_CLUSTER": cluster, "SET_HOSTNAME": node}
    return {"user_template": ours(node, cluster), "context": context}


def show(*records: str) -> str:
    """`scontrol show node -o` output: one `NodeName=<record>` line each."""
    return "".join(f"NodeName={record}\n" for record in records)


def real_site(root: Path, sim: Any, cluster: Any, nodesets: str, extra: str = "") -> Setup:
    """A deployment using the harness's real scontrol and slurm.conf (ClusterName cloudtest)."""
    site = make_setup(root, sim.endpoint, AUTH, nodesets=nodesets, extra=extra)
    fake = f'scontrol = "{site.scontrol_dir / "scontrol"}"'
    text = site.config.read_text()
    assert fake in text
    site.config.write_text(text.replace(fake, f'scontrol = "{cluster.binaries["scontrol"]}"\n'
                                              f'slurm_conf = "{cluster.conf}"'))
    return site


def boot_node(cluster: Any, node: str, addr: str) -> None:
    """Bring a CLOUD node up in the real controller without any VM: power it up and start its slurmd."""
    cluster.scontrol("update", f"NodeName={node}", f"NodeAddr={addr}")
    cluster.scontrol("update", f"NodeName={node}", "State=POWER_UP")
    # slurmd registering before slurmctld has started the power-up (POWER_UP queued) is not taken as a boot.
    cluster.wait_until(lambda: cluster.node_state(node), lambda s: "POWERING_UP" in s, 30,
                       f"{node} powering up")
    cluster.start_slurmd(node, addr)
    cluster.wait_until(lambda: cluster.node_state(node), lambda s: s == "IDLE+CLOUD", 30, f"{node} up")
