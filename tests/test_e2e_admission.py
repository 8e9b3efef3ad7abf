"""Resume acts only on what slurmctld asked for: a real slurmctld with the simulator (tests/e2e_support.py).

Run by hand, slurm-nebula-resume refuses a static node inside a node set's hostlist, a node slurmctld does not
know, and a cloud node slurmctld is not powering up: one line, exit 2, no VM, no NodeAddr changed.
"""

from __future__ import annotations

import subprocess

import pytest
from e2e_support import RESUME

from slurm_nebula_power.errors import EXIT_USAGE

pytestmark = pytest.mark.slurm

STATIC = "NodeName=gpu03 NodeAddr=127.0.0.9 CPUs=1 RealMemory=100 State=UNKNOWN\n"


def test_resume_by_hand_of_a_static_an_unknown_or_a_powered_down_node_is_refused_and_changes_nothing(e2e) -> None:
    env = e2e(extra_conf=STATIC)
    text = env.config.read_text()
    assert 'nodes = "gpu01,gpu02"' in text
    env.config.write_text(text.replace('nodes = "gpu01,gpu02"', 'nodes = "gpu[01-04]"'))  # gpu03 static, gpu04 unknown
    c = env.cluster
    env.wait_nodes(("gpu01", "gpu02"), "idle~", timeout=30)
    addresses = {node: c.node_info(node)["NodeAddr"] for node in ("gpu01", "gpu03")}
    assert addresses["gpu03"] == "127.0.0.9"
    for node, said in (("gpu03", "gpu03: static nodes (no State=CLOUD in slurm.conf)"),
                       ("gpu04", "gpu04: unknown to slurmctld"),
                       ("gpu01", "gpu01: not being powered up by slurmctld"),
                       ("gpu[01,03]", "gpu03: static nodes")):
        done = subprocess.run([str(RESUME), node], env=c.env, capture_output=True, text=True, timeout=60,
                              check=False)
        assert done.returncode == EXIT_USAGE, (node, done.stderr)
        assert said in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert env.sim.vms() == [], "no VM was created"
    assert {node: c.node_info(node)["NodeAddr"] for node in ("gpu01", "gpu03")} == addresses
    assert c.sinfo_state("gpu01") == "idle~"
