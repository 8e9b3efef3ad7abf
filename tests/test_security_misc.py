"""Smaller findings of the security review (issue 15, item 8): the munge key never lands in a file others
can read, no core dump holds the session, a malformed pool document is a failure (not retried), node-set
look-up is a look-up; SLURM_RESUME_FILE is read strictly (issue 34, item 11)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from hostile import HostileEndpoint
from reliability_support import run_env, run_program, site, tune
from test_cli import program
from test_template import GPU_SET_IDS
from test_template import site as template_site

from slurm_nebula_power.config import Config, NodeSet
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK, EXIT_USAGE


def test_template_refuses_to_write_the_munge_key_to_a_file_others_can_read(tmp_path) -> None:
    setup = template_site(tmp_path, GPU_SET_IDS)  # numeric ids: no OpenNebula needed
    out = tmp_path / "worker.tmpl"
    env = {**os.environ, **setup.env}
    with out.open("w") as handle:  # `template > worker.tmpl` under umask 022
        out.chmod(0o644)
        done = subprocess.run([program("slurm-nebula-power"), "template"], env=env, stdout=handle,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    assert done.returncode == EXIT_USAGE
    assert "umask 077" in done.stderr and done.stderr.count("\n") == 1
    assert out.read_text() == "", "not a byte of the key written"
    out.chmod(0o600)
    with out.open("w") as handle:
        done = subprocess.run([program("slurm-nebula-power"), "template"], env=env, stdout=handle,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    assert done.returncode == EXIT_OK and "MUNGE_KEY_BASE64" in out.read_text()


def test_no_core_dump_and_no_ptrace_by_others_of_our_uid() -> None:
    code = ("import ctypes, resource; from slurm_nebula_power.cli.process import process_hygiene; "
            "process_hygiene(); libc = ctypes.CDLL(None); "
            "print(resource.getrlimit(resource.RLIMIT_CORE), libc.prctl(3, 0, 0, 0, 0))")  # 3: PR_GET_DUMPABLE
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["(0,", "0)", "0"], done.stderr


def test_a_malformed_pool_document_is_not_retried_and_the_node_handed_back(tmp_path, sim) -> None:
    # issue 34, item 12: the same answer again parses no better; retried, it took a resume's boot_timeout
    def break_pool(body: bytes) -> bytes:  # a VM_POOL cut short, as a broken proxy would send it
        return re.sub(rb"&lt;/VM_POOL&gt;", b"&lt;VM", body)

    proxy = HostileEndpoint(sim.endpoint, rewrite=break_pool)
    try:
        setup = tune(site(tmp_path / "site", proxy, boot_timeout=20), timeout=2, retry_seconds=2, poll_max=0.2)
        done = run_program(setup, "resume", "gpu01", guard=60)
    finally:
        proxy.close()
    assert done.returncode == EXIT_NODES_FAILED, "not an internal error (exit 4)"
    log = setup.log_text()
    assert "retrying vmpool.infoextended" not in log and "unreadable document" in log
    assert [u[0] for u in setup.updates() if "State=POWER_DOWN_FORCE" in u] == ["NodeName=gpu01"]


def test_node_set_of_a_node_in_a_65536_node_set(tmp_path) -> None:
    nodes = tuple(f"n{i:05d}" for i in range(65536))
    config = Config(path=tmp_path, opennebula=None, slurm=None, log=None, power=None,  # type: ignore[arg-type]
                    nodesets=(NodeSet("n[00000-65535]", nodes, "t"), NodeSet("x1", ("x1",), "u")))
    assert config.nodeset_for("n65535") is config.nodesets[0]
    assert config.nodeset_for("x1") is config.nodesets[1] and config.nodeset_for("n65536") is None


RESUME_FILES = {
    "deep nesting": "[" * 100_000 + "]" * 100_000,
    "Infinity": '{"jobs": [{"job_id": Infinity, "nodes": "gpu01"}]}',
    "NaN": '{"jobs": [{"job_id": NaN, "nodes": "gpu01"}]}',
    "1e30": '{"jobs": [{"job_id": 1e30, "nodes": "gpu01"}]}',
    "2**40": '{"jobs": [{"job_id": 1099511627776, "nodes": "gpu01"}]}',
    "-5": '{"jobs": [{"job_id": -5, "nodes": "gpu01"}]}',
    "true": '{"jobs": [{"job_id": true, "nodes": "gpu01"}]}',
    "a string": '{"jobs": [{"job_id": "7", "nodes": "gpu01"}]}',
    "nodes a list": '{"jobs": [{"job_id": 7, "nodes": ["gpu01"]}]}',
    "not JSON": "job 7 on gpu01",
}


@pytest.mark.parametrize("case", list(RESUME_FILES))
def test_a_resume_file_slurmctld_would_not_write_is_no_job_id_and_no_traceback(tmp_path, sim, case: str) -> None:
    # issue 34, item 11: deep nesting or Infinity gave a traceback and no hand-back; 1e30, 2**40 and -5 were
    # taken as job ids into CONTEXT and the usage records
    from slurm_nebula_power.slurm import jobs_from_resume_file

    path = tmp_path / "resume.json"
    path.write_text(RESUME_FILES[case])
    assert jobs_from_resume_file({"SLURM_RESUME_FILE": str(path)}) == {}
    setup = tune(site(tmp_path / "site", sim, boot_timeout=20), poll_max=0.2)
    env = {**run_env(setup), "SLURM_RESUME_FILE": str(path)}
    done = subprocess.run([program("slurm-nebula-resume"), "gpu01"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == EXIT_OK, done.stderr + setup.log_text()[-1000:]
    assert "Traceback" not in done.stderr + setup.log_text()
    said = done.stderr + setup.log_text()  # read before the log file is set up: on stderr, which slurmctld logs
    assert "SLURM_RESUME_FILE" in said and "continuing without job ids" in said, said
    [vm] = [v for v in sim.vms() if v.name == "gpu01"]
    assert "SLURM_JOB_IDS" not in vm.template["CONTEXT"] or vm.template["CONTEXT"]["SLURM_JOB_IDS"] == ""


def test_a_resume_file_as_slurmctld_writes_it_gives_the_job_ids() -> None:
    import json as _json
    import tempfile

    from slurm_nebula_power.slurm import jobs_from_resume_file

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        _json.dump({"all_nodes_resume": "gpu[01-02]", "jobs": [{"job_id": 4294967293, "nodes_resume": "gpu01"},
                                                             {"job_id": 8, "nodes_resume": "gpu[01-02]"}]}, handle)
    try:
        assert jobs_from_resume_file({"SLURM_RESUME_FILE": handle.name}) == {"gpu01": [4294967293, 8], "gpu02": [8]}
    finally:
        os.unlink(handle.name)
