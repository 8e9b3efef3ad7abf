"""Fallback between GPU models on a real oned (7.0.2 and 7.4.0, tests/oned) with a real slurmctld (22.05 here,
24.11 and 26.05 in the release roots), as the unprivileged user `slurm` (issue 33).

Node sets gpa[1-2] (a template of the user's own whose PCI DEVICE no dummy host has) and gpb[1-2] (the worker
template, one GPU on each of the 4 dummy hosts) share a partition, gpa listed first. A 2-node job bounces off
gpa once (resume counts 0 free GPUs of its model and hands both back), gpa steps out of Slurm's way
(SuspendProgram drains its nodes), and the job runs on gpb; with every node powered down again, a second job
goes straight to gpb. No VM is ever created for gpa. The guests are played as in test_real_oned_fleet.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pyone
import pytest
from slurm_findings import finding
from test_real_oned_fleet import Fleet, Guests, restore
from test_real_oned_programs import pool, wipe
from test_worker import write_config

from slurm_nebula_power.shapes import program_path

pytestmark = pytest.mark.slurm

NODES = ("gpa1", "gpa2", "gpb1", "gpb2")
CLUSTER = "cloudtest"
GPA_TEMPLATE = '''NAME = "slurm-gpa-worker"
CPU = "0.1"
VCPU = "1"
MEMORY = "128"
PCI = [ VENDOR = "10de", DEVICE = "ffff", CLASS = "0302" ]
NIC = [ NETWORK = "slurm-net", NETWORK_UNAME = "oneadmin" ]
CONTEXT = [ NETWORK = "YES", TOKEN = "YES", SET_HOSTNAME = "$NAME" ]
'''


@pytest.fixture
def site(oned, slurm_factory) -> Iterator[Fleet]:
    wipe(oned)
    restore(oned)
    one = pyone.OneServer(oned.endpoint, session=oned.auth)  # the user's own template
    gpa_template = one.template.allocate(GPA_TEMPLATE)
    resume, suspend, fail = (program_path(name)[0] for name in
                             ("slurm-nebula-resume", "slurm-nebula-suspend", "slurm-nebula-resume-fail"))
    cluster = slurm_factory(nodes=NODES, partition="gpu", cluster_name=CLUSTER, resume_program=resume,
                            suspend_program=suspend, resume_fail_program=fail, suspend_time=4, suspend_timeout=10,
                            resume_timeout=120, cred_expire=15)  # a requeued job waits past SuspendTimeout
    config = write_config(cluster, oned.endpoint, boot_timeout=90)
    (cluster.base / "one_auth").write_text(oned.auth + "\n")
    text = config.read_text()
    config.write_text(text[:text.index("[[nodeset]]")] + "".join(
        f'[[nodeset]]\nnodes = "{nodes}"\ntemplate = "{template}"\nboot_timeout = 90\n\n'
        for nodes, template in (("gpa[1-2]", "slurm-gpa-worker"), ("gpb[1-2]", "slurm-gpu-worker"))))
    guests = Guests(oned, cluster)
    yield Fleet(oned, cluster, config)
    guests.stop()
    cluster.stop()
    wipe(oned)
    one.template.delete(gpa_template)


def test_a_gpu_model_no_host_has_steps_out_and_jobs_run_on_the_other(site: Fleet) -> None:
    c = site.cluster
    first = c.sbatch(nodes=2)
    c.wait_for(lambda: c.job_info(first).get("JobState") == "COMPLETED", 240, "the first job completed")
    info = c.job_info(first)
    assert info["NodeList"] == "gpb[1-2]" and info["Restarts"] == "1", info
    assert c.job_output(first).split() in (["gpb1", "gpb2"], ["gpb2", "gpb1"])
    for node in ("gpa1", "gpa2"):
        state = c.node_info(node)
        assert "DRAIN" in state["State"] and state["Reason"].startswith("nebula: out of service since "), state
        assert "needs 2 GPUs 10de:ffff" in state["Reason"], state
    log = (c.log_dir / "nebula-power.log").read_text()
    assert not [vm for vm in pool(site.oned) if vm.name.startswith("gpa")], "no VM ever made for gpa"
    assert not [line for line in log.splitlines() if "action=instantiate" in line and "node=gpa" in line], \
        "resume instantiated nothing for gpa"
    assert any("action=instantiate" in line and "node=gpb" in line for line in log.splitlines())

    # Every node powered down again: slurmctld would pick gpa first, were it not out.
    c.wait_for(lambda: all(c.sinfo_state(n) in ("idle~", "drained~") for n in NODES), 90, "all powered down")
    second = c.sbatch(nodes=2)
    c.wait_for(lambda: c.job_info(second).get("JobState") in ("RUNNING", "COMPLETED"), 120, "the second job started")
    info = c.job_info(second)
    assert info["NodeList"] == "gpb[1-2]" and info["Restarts"] == "0", info
    finding("real oned: a 2-node job while gpa (no host has its GPU) is out", f"{info['NodeList']}, no requeue")
    out = site.power("reconcile")
    assert any(re.match(r"node set gpa\[1-2\] out \(", line) for line in out), out
    assert "DRAIN" in c.node_info("gpa1")["State"]
