"""slurm-nebula-prolog (PrologSlurmctld): unit tests against the fake scontrol, then the real slurmctld."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from simfixtures import AUTH
from slurm_findings import finding
from slurmharness import SlurmCluster, pid_alive, recording_program, wait_for
from support import Setup, make_setup

from slurm_nebula_power import prolog
from slurm_nebula_power.cli import prolog as prolog_cmd
from slurm_nebula_power.cli.main import power_main
from slurm_nebula_power.config import load_config
from slurm_nebula_power.errors import EXIT_CONFIG, EXIT_NODES_FAILED, EXIT_OK, EXIT_USAGE
from slurm_nebula_power.slurm import scontrol_for

NOWHERE = "http://127.0.0.1:9/RPC2"  # the prolog never calls OpenNebula
GPU = "NodeName={} Arch=x86_64 CPUTot=8 State={}"
PROG = "slurm-nebula-prolog"


def program(name: str = PROG) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    assert os.access(path, os.X_OK), f"{name} is not installed (pip install -e .)"
    return path


def nodes(**states: str) -> str:
    """`scontrol show node -o` output: gpu01="IDLE+CLOUD" ... (Reason= may follow the state)."""
    return "".join(GPU.format(name, state) + "\n" for name, state in states.items())


@pytest.fixture
def site(tmp_path) -> Setup:
    return make_setup(tmp_path / "site", NOWHERE, AUTH)


def job_env(site: Setup, nodelist: str, job: str = "42") -> dict[str, str]:
    return {**site.env, "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": nodelist}


def shows(site: Setup) -> list[list[str]]:
    return [c for c in site.scontrol_calls() if c[:2] == ["show", "node"]]


def job_checks(site: Setup) -> list[list[str]]:
    return [c for c in site.scontrol_calls() if c[:2] == ["show", "job"]]


def site_prolog(path: Path, code: int, record: Path) -> Path:
    """A site PrologSlurmctld (shell) that records its environment and exits `code`."""
    path.write_text(f"#!/bin/sh\nenv > {record}\necho 'site prolog says no' >&2\nexit {code}\n")
    path.chmod(0o755)
    return path


def set_chain(site: Setup, chain: Path) -> None:
    text = site.config.read_text()
    site.config.write_text(text.replace("[slurm]\n", f'[slurm]\nprolog_chain = "{chain}"\n', 1))


# ---- which nodes ----------------------------------------------------------------------------------------


def test_job_without_cloud_nodes_exits_0_at_once_without_asking_slurm(site) -> None:
    assert prolog_cmd.main([], job_env(site, "static[1-4],login1")) == EXIT_OK
    assert site.scontrol_calls() == []


def test_only_our_nodes_are_polled_in_one_call_per_poll(site) -> None:
    site.set_nodes(nodes(gpu02="ALLOCATED+CLOUD", gpu03="MIXED+CLOUD"))
    assert prolog_cmd.main([], job_env(site, "static1,gpu[02-03],cpu9")) == EXIT_OK
    assert shows(site) == [["show", "node", "-o", "gpu[02-03]"]]


def test_an_unreadable_nodelist_means_no_wait(site) -> None:
    assert prolog_cmd.main([], job_env(site, "gpu[01-")) == EXIT_OK
    assert site.scontrol_calls() == []
    assert "unreadable" in site.log_text()


# ---- waiting --------------------------------------------------------------------------------------------


def test_nodes_coming_up_one_by_one(site) -> None:
    down, booting = "ALLOCATED+CLOUD+POWERED_DOWN", "ALLOCATED+CLOUD+NOT_RESPONDING+POWERING_UP"
    site.set_node_sequence([
        nodes(gpu01=down, gpu02=down, gpu03=down),
        nodes(gpu01=booting, gpu02=booting, gpu03=booting),
        nodes(gpu01="ALLOCATED+CLOUD", gpu02=booting, gpu03=booting),
        nodes(gpu01="ALLOCATED+CLOUD", gpu02=booting, gpu03="ALLOCATED+CLOUD"),
        nodes(gpu01="ALLOCATED+CLOUD", gpu02="ALLOCATED+CLOUD+NOT_RESPONDING", gpu03="ALLOCATED+CLOUD"),
        nodes(gpu01="ALLOCATED+CLOUD", gpu02="ALLOCATED+CLOUD", gpu03="ALLOCATED+CLOUD"),
        nodes(gpu01="should not be asked again"),
    ])
    assert prolog_cmd.main([], job_env(site, "gpu[01-03]")) == EXIT_OK
    assert shows(site) == [["show", "node", "-o", "gpu[01-03]"]] * 6
    log = site.log_text()
    ups = [re.search(rf"node {n} up after [\d.]+s \((\d) of 3\)", log) for n in ("gpu01", "gpu03", "gpu02")]
    assert all(ups) and [m.group(1) for m in ups] == ["1", "2", "3"]  # type: ignore[union-attr]
    assert log.index("node gpu03 up") < log.index("node gpu02 up") < log.index("3 node(s) up after")
    assert "job 42: waiting for gpu[01-03] (3 node(s)), at most 90s (ResumeTimeout 60s + 30s)" in log


def test_a_reason_left_from_an_earlier_hand_back_is_not_a_failure(site) -> None:
    """slurmctld keeps "nebula: ..." until the node registers, also while it is resumed for the next job."""
    old = " Reason=nebula: no free GPU [slurm@2026-01-01T00:00:00]"
    site.set_node_sequence([
        nodes(gpu01="ALLOCATED+CLOUD+POWERED_DOWN" + old),
        nodes(gpu01="ALLOCATED+CLOUD+NOT_RESPONDING+POWERING_UP" + old),
        nodes(gpu01="ALLOCATED+CLOUD"),
    ])
    assert prolog_cmd.main([], job_env(site, "gpu01")) == EXIT_OK
    assert len(shows(site)) == 3


@pytest.mark.parametrize("failed", [
    "IDLE+CLOUD+POWER_DOWN+NOT_RESPONDING Reason=nebula: no free GPU [slurm@now]",  # 22.05, right after
    "IDLE+CLOUD+POWERING_DOWN Reason=nebula: no free GPU [slurm@now]",  # a second later
    "IDLE+CLOUD+POWERED_DOWN Reason=nebula: no free GPU [slurm@now]",  # after SuspendTimeout
    "DOWN+CLOUD+NOT_RESPONDING+POWERING_UP Reason=nebula: boot failed [slurm@now]",  # 23.02+ hand-back
    "DOWN+CLOUD+POWERED_DOWN+NOT_RESPONDING Reason=ResumeTimeout reached [slurm@now]",
    "ALLOCATED+DRAIN+CLOUD+POWERING_UP Reason=bad GPU [root@now]",
])
def test_a_node_handed_back_as_failed_ends_the_wait_at_once(site, failed: str) -> None:
    booting = "ALLOCATED+CLOUD+NOT_RESPONDING+POWERING_UP"
    site.set_node_sequence([nodes(gpu01=booting, gpu02=booting),
                            nodes(gpu01="ALLOCATED+CLOUD", gpu02=failed)])
    assert prolog_cmd.main([], job_env(site, "gpu[01-02]")) == EXIT_NODES_FAILED
    assert len(shows(site)) == 2, "non-zero at the poll that saw it"
    assert f"job 42: node gpu02 failed ({failed.split(' Reason=')[0]}" in site.log_text()


def test_a_job_that_left_configuring_ends_the_wait(site, monkeypatch) -> None:
    monkeypatch.setattr(prolog, "JOB_EVERY", 0.3)
    site.set_nodes(nodes(gpu01="IDLE+CLOUD+NOT_RESPONDING+POWERING_UP"))
    chain_record = site.root / "chain.env"
    set_chain(site, site_prolog(site.root / "site-prolog", 0, chain_record))
    site.set_job(
        "JobId=42 JobName=x UserId=u(1) JobState=PENDING Reason=BeginTime Dependency=(null) Restarts=1\n")
    assert prolog_cmd.main([], job_env(site, "gpu01")) == EXIT_NODES_FAILED
    assert job_checks(site) == [["show", "job", "-o", "42"]]
    assert "job 42: job is PENDING, no longer waiting for its nodes" in site.log_text()
    assert not chain_record.exists(), "the site prolog runs only after a successful wait"


def test_a_job_slurmctld_forgot_ends_the_wait_but_a_failed_query_does_not(site, monkeypatch) -> None:
    monkeypatch.setattr(prolog, "JOB_EVERY", 0.2)
    site.set_nodes(nodes(gpu01="ALLOCATED+CLOUD+NOT_RESPONDING+POWERING_UP"))
    site.set_job("error: Unable to contact slurm controller (connect failure)")
    slurm = scontrol_for(load_config(site.config, site.env), site.env, prolog.SCONTROL_TIMEOUT)
    assert prolog.job_state(slurm, "42") is None
    site.set_job("error: Invalid job id specified")
    assert prolog.job_state(slurm, "42") == "GONE"
    assert prolog_cmd.main([], job_env(site, "gpu01")) == EXIT_NODES_FAILED
    assert "job 42: job is GONE" in site.log_text()


def test_gives_up_after_resume_timeout_plus_margin_polling_a_few_times_a_second(site, monkeypatch) -> None:
    (site.root / "slurm.conf").write_text("ClusterName=testcluster\nResumeTimeout=1\n")
    monkeypatch.setattr(prolog, "MARGIN", 1.0)
    site.set_nodes(nodes(gpu01="ALLOCATED+CLOUD+NOT_RESPONDING+POWERING_UP", gpu02="ALLOCATED+CLOUD"))
    site.set_job("JobId=42 JobState=CONFIGURING Reason=None\n")
    start = time.monotonic()
    assert prolog_cmd.main([], job_env(site, "gpu[01-02]")) == EXIT_NODES_FAILED
    elapsed = time.monotonic() - start
    polls, checks = len(shows(site)), len(job_checks(site))
    print(f"bound 2 s: gave up after {elapsed:.1f}s with {polls} node polls and {checks} job checks")
    assert "job 42: gpu01 not up after 2s (ResumeTimeout + 1s): giving up" in site.log_text()
    # 0.25 s growing to 1 s: about 0, 0.25, 0.62, 1.19, 2.0 -> 5 polls in 2 s; one job check (at 2 s).
    assert 3 <= polls <= 6 and checks <= 1


def test_bounds_come_from_slurm_conf(site) -> None:
    conf = site.root / "slurm.conf"
    conf.write_text("ClusterName=testcluster\nResumeTimeout=900\nPrologEpilogTimeout=120\n")
    config = load_config(site.config, site.env)
    assert prolog.bounds(config) == (930.0, 120.0, "ResumeTimeout 900s")
    conf.write_text("ClusterName=testcluster\n")
    assert prolog.bounds(config) == (90.0, None, "ResumeTimeout 60s")  # Slurm's default 60
    conf.unlink()
    # No slurm.conf to read: what slurm-conf recommends (longest boot_timeout 20 s + 300 s), plus the margin.
    assert prolog.bounds(config) == (350.0, None, "recommended")


def test_classify_states() -> None:
    from slurm_nebula_power.nodestate import NodeState

    def kind(state: str, reason: str = "") -> str:
        return prolog.classify(NodeState("n", state, reason))[0]

    assert kind("ALLOCATED+CLOUD") == kind("MIXED+CLOUD") == kind("IDLE+CLOUD") == prolog.UP
    assert kind("ALLOCATED+CLOUD+POWER_DOWN") == prolog.UP  # a queued power-down waits for the job
    assert kind("ALLOCATED+CLOUD+POWERED_DOWN", "nebula: old") == prolog.WAITING
    assert kind("ALLOCATED+CLOUD+NOT_RESPONDING") == kind("UNKNOWN+CLOUD") == prolog.WAITING
    assert kind("ALLOCATED+CLOUD+POWER_DOWN+POWERING_UP") == prolog.WAITING
    assert kind("IDLE+CLOUD+POWER_DOWN+NOT_RESPONDING") == kind("DOWN+CLOUD") == prolog.FAILED
    assert kind("IDLE+DRAIN+CLOUD") == kind("FAIL+CLOUD") == prolog.FAILED
    assert kind("ALLOCATED+CLOUD+POWERING_DOWN") == prolog.FAILED
    assert prolog.classify(None)[0] == prolog.WAITING
    assert kind("") == kind("WEIRD+CLOUD") == prolog.WAITING, "an empty or unknown state is never up (issue 15)"


# ---- chaining the site's prolog -------------------------------------------------------------------------


def test_chains_to_a_site_prolog_that_fails_and_returns_its_code(site) -> None:
    record = site.root / "chain.env"
    set_chain(site, site_prolog(site.root / "site-prolog", 7, record))
    site.set_node_sequence([nodes(gpu01="ALLOCATED+CLOUD+POWERING_UP"), nodes(gpu01="ALLOCATED+CLOUD")])
    env = job_env(site, "gpu01")
    assert prolog_cmd.main([], env) == 7
    theirs = dict(line.split("=", 1) for line in record.read_text().splitlines() if "=" in line)
    assert {k: theirs.get(k) for k in env} == env, "the same environment"
    assert len(shows(site)) == 2, "after the wait"
    log = site.log_text()
    assert "prolog_chain " + str(site.root / "site-prolog") + " exited 7" in log
    assert "| site prolog says no" in log


def test_chain_runs_for_jobs_without_cloud_nodes_too(site) -> None:
    record = site.root / "chain.env"
    set_chain(site, site_prolog(site.root / "site-prolog", 0, record))
    assert prolog_cmd.main([], job_env(site, "static1")) == EXIT_OK
    assert record.exists() and site.scontrol_calls() == []


def test_chain_is_bounded_by_prolog_epilog_timeout(site) -> None:
    (site.root / "slurm.conf").write_text("ClusterName=testcluster\nPrologEpilogTimeout=1\n")
    pids = site.root / "chain.pids"
    chain = site.root / "site-prolog"
    chain.write_text(f"#!/bin/sh\nsleep 300 &\necho $$ $! > {pids}\nwait\n")  # itself, and a child
    chain.chmod(0o755)
    set_chain(site, chain)
    assert prolog_cmd.main([], job_env(site, "static1")) == EXIT_NODES_FAILED
    assert "still running after 1s: killed" in site.log_text()
    shell, child = map(int, pids.read_text().split())  # killed, not waited for: its child too
    wait_for(lambda: not (pid_alive(shell) or pid_alive(child)), 5, f"the site prolog's pids {shell}, {child} killed")


def test_chain_to_the_prolog_itself_is_refused(site, capsys) -> None:
    set_chain(site, Path("/usr/local/bin") / PROG)
    assert prolog_cmd.main([], job_env(site, "static1")) == EXIT_CONFIG
    assert "would run itself without end" in capsys.readouterr().err


def test_chain_that_cannot_run_fails_the_job(site) -> None:
    set_chain(site, site.root / "no-such-prolog")
    assert prolog_cmd.main([], job_env(site, "static1")) == EXIT_NODES_FAILED
    assert "cannot be run" in site.log_text()


# ---- the program ----------------------------------------------------------------------------------------


def test_without_a_job_id_it_is_a_usage_error(site, capsys) -> None:
    assert prolog_cmd.main([], site.env) == EXIT_USAGE
    assert "SLURM_JOB_ID is not set" in capsys.readouterr().err


def test_a_configuration_error_fails_the_job(site) -> None:
    site.config.write_text(site.config.read_text() + "\n[bogus]\n")
    assert prolog_cmd.main([], job_env(site, "static1")) == EXIT_CONFIG
    assert site.scontrol_calls() == []


def test_reachable_as_prolog_wait_subcommand(site, monkeypatch) -> None:
    for key, value in job_env(site, "static1").items():
        monkeypatch.setenv(key, value)
    assert power_main(["prolog-wait"]) == EXIT_OK
    assert power_main(["prolog-wait", "--version"]) == EXIT_OK


def test_slurm_conf_is_taken_from_slurmctlds_environment_when_missing(tmp_path) -> None:
    parent = subprocess.Popen(["/bin/sleep", "30"], env={"SLURM_CONF": "/x/slurm.conf", "OTHER": "y"})
    try:
        time.sleep(0.05)
        got = prolog.slurmctld_environ({"SLURM_JOB_ID": "1"}, parent.pid)
        assert got == {"SLURM_JOB_ID": "1", "SLURM_CONF": "/x/slurm.conf"}
        mine = prolog.slurmctld_environ({"SLURM_CONF": "/mine"}, parent.pid)
        assert mine == {"SLURM_CONF": "/mine"}
        assert prolog.slurmctld_environ({}, 0) == {}  # unreadable: unchanged
    finally:
        parent.kill()
        parent.wait()


# As slurmctld's script daemon runs it: its own environment has SLURM_CONF, the prolog's has only the job's
# variables; fds 0-2 closed, signals blocked, no PATH.
SCRIPTD = """
import os, signal, subprocess, sys
prog, job_env = sys.argv[1], {k: v for k, v in os.environ.items() if k.startswith("SLURM_JOB")}
def child():
    for fd in (0, 1, 2):
        os.close(fd)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD})
sys.exit(subprocess.run([prog], env=job_env, preexec_fn=child).returncode)
"""


def test_runs_as_slurmctld_runs_it_and_finds_the_configuration_beside_slurmctlds_slurm_conf(site) -> None:
    site.set_node_sequence([nodes(gpu01="ALLOCATED+CLOUD+POWERING_UP"), nodes(gpu01="ALLOCATED+CLOUD")])
    env = {"SLURM_CONF": str(site.root / "slurm.conf"), "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu01"}
    proc = subprocess.run([sys.executable, "-c", SCRIPTD, program()], env=env, timeout=60, check=False)
    assert proc.returncode == EXIT_OK
    assert len(shows(site)) == 2
    assert int((site.scontrol_dir / "scontrol.sigblk").read_text(), 16) == 0
    assert "job 7: 1 node(s) up after" in site.log_text()


def test_answers_help_and_version() -> None:
    version = subprocess.run([program(), "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and version.stdout.strip() == f"{PROG} 0.1.0"
    helped = subprocess.run([program(), "--help"], capture_output=True, text=True, timeout=30)
    assert helped.returncode == 0 and "PrologSlurmctld" in helped.stdout


def test_starts_fast_without_pyone(site) -> None:
    env = {**job_env(site, "static1"), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    code = ("import sys; from slurm_nebula_power.cli.main import prolog_main; "
            "print(prolog_main([]), 'pyone' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["0", "False"], out.stderr
    start = time.monotonic()
    done = subprocess.run([program()], env=job_env(site, "static1"), timeout=30, check=False)
    print(f"{PROG} for a job without cloud nodes: {time.monotonic() - start:.2f}s")
    assert done.returncode == EXIT_OK


# ---- the real slurmctld ---------------------------------------------------------------------------------

SITE_CONFIG = """\
[opennebula]
endpoint = "{endpoint}"
auth_file = "one_auth"

[slurm]
scontrol = "{scontrol}"
slurm_conf = "{conf}"

[log]
file = "{log}"
level = "debug"

[power]
lock_dir = "{base}/locks"

[[nodeset]]
nodes = "{nodes}"
template = "slurm-gpu-worker"
"""


def our_prolog_site(cluster: SlurmCluster) -> Path:
    """nebula-power.toml beside the cluster's slurm.conf, where the prolog finds it; returns its log."""
    auth = cluster.base / "one_auth"
    auth.write_text(AUTH + "\n")
    auth.chmod(0o600)
    log = cluster.log_dir / "nebula-power.log"
    (cluster.base / "nebula-power.toml").write_text(SITE_CONFIG.format(
        endpoint=NOWHERE, scontrol=cluster.binaries["scontrol"], conf=cluster.conf, log=log,
        base=cluster.base, nodes=",".join(cluster.nodes)))
    return log


ONE_BY_ONE = """
import time
for i, host in enumerate(HOSTS):
    if i:
        time.sleep(2)
    boot([host], ["127.0.1.%d" % (i + 1)])
"""


@pytest.mark.slurm
def test_real_multi_node_job_starts_when_its_nodes_have_come_up_one_by_one(slurm_factory, tmp_path) -> None:
    resume = recording_program(tmp_path / "resume", tmp_path / "resume.jsonl", action=ONE_BY_ONE)
    cluster = slurm_factory(nodes=["cloud1", "cloud2", "cloud3"], resume_program=resume,
                            prolog_slurmctld=program())
    log = our_prolog_site(cluster)
    job = cluster.sbatch(nodes=3)
    cluster.wait_job(job, ["COMPLETED"], timeout=60)
    assert sorted(cluster.job_output(job).split()) == ["cloud1", "cloud2", "cloud3"]
    text = log.read_text()
    assert f"job {job}: waiting for cloud[1-3] (3 node(s))" in text
    order = [text.index(f"job {job}: node cloud{i} up after") for i in (1, 2, 3)]
    assert order == sorted(order)
    assert text.index("node cloud3 up after") < text.index(f"job {job}: 3 node(s) up after")
    assert cluster.job_info(job)["Restarts"] == "0"


FAIL_CLOUD2_ONCE = """
if not os.path.exists(RECORD + ".failed"):
    open(RECORD + ".failed", "w").close()
    boot([h for h in HOSTS if h != "cloud2"], ["127.0.1.1"])
    time.sleep(1)
    scontrol("update", "NodeName=cloud2", "State=POWER_DOWN_FORCE", "Reason=nebula: no free GPU")
else:
    boot(HOSTS, ["127.0.1.%s" % h[-1] for h in HOSTS])
"""


@pytest.mark.slurm
def test_real_failed_node_ends_the_prolog_and_the_requeued_job_completes(slurm_factory, tmp_path) -> None:
    resume = recording_program(tmp_path / "resume", tmp_path / "resume.jsonl", action=FAIL_CLOUD2_ONCE)
    cluster = slurm_factory(nodes=["cloud1", "cloud2"], resume_program=resume, prolog_slurmctld=program())
    log = our_prolog_site(cluster)
    job = cluster.sbatch(nodes=2)
    cluster.wait_for(lambda: cluster.job_info(job).get("Restarts") == "1", 40, "job requeued")
    cluster.wait_for(lambda: "node cloud2 failed" in log.read_text(), 20, "the prolog saw cloud2 fail")
    text = log.read_text()
    failed = rf"job {job}: node cloud2 failed \(IDLE\+CLOUD\+POWER\S* Reason=nebula: no free GPU"
    assert re.search(failed, text)
    # The second run waits through cloud2's leftover "nebula:" reason and lets the job start.
    cluster.wait_job(job, ["COMPLETED"], timeout=90)
    assert sorted(cluster.job_output(job).split()) == ["cloud1", "cloud2"]
    assert cluster.job_info(job)["Restarts"] == "1"
    assert f"job {job}: 2 node(s) up after" in log.read_text()
    assert f"prolog_slurmctld JobId={job} prolog exit status 1:0" in cluster.log_text("slurmctld.log")


SLEEPER = "#!/bin/sh\nsleep 3\n"
BOOT_NOW = 'boot(HOSTS, ["127.0.1.%d" % (i + 1) for i in range(len(HOSTS))])'


def launch_times(cluster: SlurmCluster) -> tuple[float, float]:
    """(sbatch -> job RUNNING, nodes registered -> job RUNNING) in seconds, sampled every 0.1 s."""
    start = time.monotonic()
    job = cluster.sbatch(script=SLEEPER, nodes=2)
    registered = None
    while True:
        info = cluster.job_info(job)
        up = ("ALLOCATED+CLOUD", "MIXED+CLOUD", "IDLE+CLOUD")
        if registered is None and all(cluster.node_state(n) in up for n in cluster.nodes):
            registered = time.monotonic()
        if info.get("JobState") in ("RUNNING", "COMPLETING", "COMPLETED"):
            now = time.monotonic()
            return now - start, now - (registered or now)
        assert time.monotonic() - start < 90, f"job {job} never ran: {info}"
        time.sleep(0.1)


@pytest.mark.slurm
def test_real_sbatch_to_running_with_and_without_the_prolog(slurm_factory, tmp_path) -> None:
    figures = {}
    for label, with_prolog in (("with slurm-nebula-prolog", True), ("without PrologSlurmctld", False)):
        resume = recording_program(tmp_path / f"resume-{with_prolog}", tmp_path / f"{with_prolog}.jsonl",
                                   action=BOOT_NOW)
        cluster = slurm_factory(nodes=["cloud1", "cloud2"], resume_program=resume,
                                prolog_slurmctld=program() if with_prolog else None)
        our_prolog_site(cluster)
        figures[label] = launch_times(cluster)
        cluster.stop()
    # Figures, not limits (launch_times fails a job that never runs; behaviour is asserted above).
    for label, (total, after) in figures.items():
        finding(f"2-node job, instant boots, {label}: sbatch -> RUNNING (nodes registered -> RUNNING)",
                f"{total:.1f} s ({after:.1f} s)")


@pytest.mark.slurm
def test_real_job_requeued_while_its_nodes_boot_is_let_go_and_starts_again(slurm_factory) -> None:
    # ResumeProgram /bin/true: the node stays POWERING_UP until ResumeTimeout.
    cluster = slurm_factory(nodes=["cloud1"], prolog_slurmctld=program())
    log = our_prolog_site(cluster)
    job = cluster.sbatch(nodes=1)
    cluster.wait_for(lambda: f"job {job}: waiting for cloud1" in (log.read_text() if log.exists() else ""),
                     15, "the prolog waiting")
    # Requeued before the resume began, the node would go back to IDLE+POWERED_DOWN (a failure to the
    # prolog, which exits at once too); once POWERING_UP it stays so, and only the job's state tells.
    cluster.wait_until(lambda: cluster.node_state("cloud1"), lambda s: "POWERING_UP" in s, 10, "powering up")
    cluster.scontrol("requeue", str(job))
    cluster.wait_for(lambda: f"job {job}: job is PENDING, no longer waiting" in log.read_text(), 10,
                     "the prolog letting go of the requeued job")
    # Allocated again (its old prolog no longer holds it): a second prolog waits for its node. From 23.02
    # (seen on 24.11 and 26.05) a requeued job waits cred_expire (BeginTime) first; 22.05 took 2 s.
    cluster.wait_for(lambda: log.read_text().count(f"job {job}: waiting for cloud1") == 2,
                     (cluster.cred_expire or 120) + 10, "the job allocated again")
