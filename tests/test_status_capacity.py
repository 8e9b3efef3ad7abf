"""`status --capacity`: per GPU node set, its devices per host: free, held by our VMs, held by others."""

from __future__ import annotations

import json

from opsupport import ours_vm

from slurm_nebula_power.cli import status
from slurm_nebula_power.errors import EXIT_OK


def test_json_capacity_counts_free_ours_and_others_per_host(sim, setup, capsys) -> None:
    sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="RUNNING", host="gpu-host-01")
    sim.add_vm(name="someone", uid=7, state="RUNNING", host="gpu-host-01")
    sim.set_host_state("gpu-host-04", "DISABLED")
    assert status.main(["--json", "--capacity", "--no-slurm"], setup.env) == EXIT_OK
    out = json.loads(capsys.readouterr().out)
    assert [r["node"] for r in out["nodes"]][:1] == ["gpu01"]
    [gpus] = out["capacity"]  # the cpu node set's template has no GPU
    assert {k: gpus[k] for k in ("nodeset", "gpu", "gpus_per_vm", "free", "ours", "others")} == {
        "nodeset": "gpu[01-08]", "gpu": "10de:0302", "gpus_per_vm": 1, "free": 10, "ours": 1, "others": 1}
    assert gpus["hosts"][0] == {"host": "gpu-host-01", "state": "MONITORED", "placeable": True, "free": 2,
                                "ours": 1, "others": 1}
    assert gpus["hosts"][3] == {"host": "gpu-host-04", "state": "DISABLED", "placeable": False, "free": 4,
                                "ours": 0, "others": 0}


def test_table_capacity_section_follows_the_node_rows(sim, setup, capsys) -> None:
    sim.add_vm(name="someone", uid=7, state="RUNNING", host="gpu-host-02")
    sim.set_host_state("gpu-host-03", "OFFLINE")
    assert status.main(["--capacity", "--no-slurm", "gpu01"], setup.env) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("CAPACITY"))
    assert lines[start] == ("CAPACITY gpu[01-08]: GPU 10de:0302 x1 per VM: 11 free, 0 held by our VMs, "
                            "1 by others")
    assert lines[start + 1].split() == ["HOST", "STATE", "FREE", "OURS", "OTHERS"]
    assert lines[start + 3].split() == ["gpu-host-02", "MONITORED", "3", "0", "1"]
    assert lines[start + 4].split() == ["gpu-host-03", "OFFLINE", "(takes", "no", "VM)", "4", "0", "0"]


def test_without_the_flag_json_stays_a_list_and_the_host_pool_is_read_once(sim, setup, capsys) -> None:
    # The one host pool read is the maintenance diagnosis's (a node whose VM's host is DISABLED or OFFLINE).
    assert status.main(["--json", "--no-slurm"], setup.env) == EXIT_OK
    assert isinstance(json.loads(capsys.readouterr().out), list)
    assert sim.stats()["calls"].get("one.hostpool.info") == 1
