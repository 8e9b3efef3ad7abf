"""`demo`: the README's first command. The embedded simulator, a temporary configuration, a resume of
gpu[01-04] watched state by state, the status table, then a suspend that gives every GPU back, and a job
that asks for more GPUs than exist, handed back whole before any VM is created. No Slurm: the scontrol
commands are printed instead of run.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import stat
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from opennebula_sim import Durations, SimConfig, default_hosts, running_simulator

from .. import __version__
from ..config import load_config
from ..errors import EXIT_NODES_FAILED, EXIT_OK, PowerError
from ..hostlists import expand
from ..resume import resume
from ..slurm import PrintedSlurm
from ..statustable import capacity, render, render_capacity, table_rows
from ..suspend import power_down
from ..usage import intervals, read_audit, summarize
from ..usage import render as usage_table
from .common import audit_log, build_context, parse, publish_metrics, report_error, run_figures, setup_logging

NODES = "gpu[01-04]"
NODESET = "gpu[01-08]"  # twice the GPUs of the simulated cloud: room for a job that asks too much
BIG_JOB = "gpu[01-05]"
TEMPLATE = "slurm-gpu-worker"
# The job ids slurmctld would pass in SLURM_RESUME_FILE: a 2-node job and two 1-node jobs.
JOBS = {"gpu01": [1001], "gpu02": [1001], "gpu03": [1002], "gpu04": [1003]}

CONFIG = """\
# slurm-nebula-power configuration written by the demo (`slurm-nebula-power example-config` prints every key)
[opennebula]
endpoint = "{endpoint}"
auth_file = "one_auth"        # one line user:password, mode 0600
timeout = 10
retry_seconds = 10

[slurm]
cluster = "demo"              # normally ClusterName from slurm.conf

[log]
file = "{root}/nebula-power.log"
audit_file = "{root}/audit.jsonl"        # usage records: `slurm-nebula-power usage` reads them
metrics_file = "{root}/nebula-power.prom"  # Prometheus textfile (node_exporter)

[power]
lock_dir = "{root}/locks"
suspend_timeout = 30
poll_max = 0.5

[[nodeset]]
nodes = "{nodes}"
template = "{template}"
suspend_action = "terminate"
boot_timeout = 60
"""


class Progress:
    """The on_vm observer: one line each time a node's VM changes state, host or address."""

    def __init__(self, emit: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.emit = emit
        self.clock = clock
        self.start = clock()
        self.seen: dict[str, tuple[Any, ...]] = {}

    def restart(self) -> None:
        """Count seconds from now."""
        self.start = self.clock()

    def __call__(self, node: str, vm: Any) -> None:
        key = (vm.id, vm.state_name, vm.host, vm.ip)
        if self.seen.get(node) == key:
            return
        self.seen[node] = key
        where = f" on {vm.host}" if vm.host else ""
        address = f" ip {vm.ip}" if vm.ip else ""
        seconds = self.clock() - self.start
        self.emit(f"   [{seconds:5.1f}s] {node}  VM {vm.id:<3} {vm.state_name}{where}{address}")


def gpus(sim: Any) -> str:
    """Free GPUs of the simulated cloud, per host."""
    hosts = sim.hosts()
    free, total = sum(h.gpus_free for h in hosts), sum(h.gpus_total for h in hosts)
    return f"{free} of {total} GPUs free (" + ", ".join(f"{h.name}: {h.gpus_free}/{h.gpus_total}"
                                                        for h in hosts) + ")"


def observed(ctx: Any, config: Any, program: str, operation: Callable[[Any], Any]) -> Any:
    """Run one operation as its program would: usage records to the audit file, metrics merged at the end."""
    recorder = audit_log(config, program)
    start = time.monotonic()
    try:
        outcome = operation(replace(ctx, recorder=recorder))
    finally:
        recorder.close()
    publish_metrics(config, run_figures(config, program, outcome, recorder, ctx.cloud, time.monotonic() - start,
                                        "failed" if outcome.failed else "ok"))
    return outcome


def write_config(root: Path, endpoint: str, auth: str) -> Path:
    """The demo's configuration and its 0600 auth file."""
    auth_file = root / "one_auth"
    auth_file.touch(mode=stat.S_IRUSR | stat.S_IWUSR)
    auth_file.chmod(stat.S_IRUSR | stat.S_IWUSR)
    auth_file.write_text(auth + "\n", encoding="utf-8")
    path = root / "nebula-power.toml"
    text = CONFIG.format(endpoint=endpoint, root=root, nodes=NODESET, template=TEMPLATE)
    path.write_text(text, encoding="utf-8")
    return path


def run(root: Path, phase: float, emit: Callable[[str], None], environ: Mapping[str, str]) -> int:
    """The demo itself, in root; returns the exit code."""
    start = time.monotonic()
    nodes = expand(NODES)
    auth = f"oneadmin:{secrets.token_urlsafe(12)}"
    # The scheduler runs once per tick: a tick of one phase lets PENDING be seen, as with oned's scheduler
    # (which places VMs every SCHED_INTERVAL seconds, not at once).
    cfg = SimConfig(hosts=default_hosts(2, 2), durations=Durations(phase, phase, phase / 2, phase / 2),
                    tick_seconds=phase or 0.01)
    with running_simulator(cfg, auth=auth) as sim:
        path = write_config(root, sim.endpoint, auth)
        config = load_config(path, {})
        setup_logging("slurm-nebula-power demo", config)
        progress = Progress(emit)
        ctx = build_context(config, environ, slurm=PrintedSlurm(emit=lambda line: emit(f"   {line}")),
                            on_vm=progress, poll_first=0.05)
        version = ctx.cloud.version()
        emit(f"1. OpenNebula simulator at {sim.endpoint} (oned {version}): {gpus(sim)}")
        emit(f"2. configuration {path} (auth file {config.opennebula.auth_file.name}, mode 0600):")
        emit(textwrap.indent(path.read_text(encoding="utf-8").rstrip(), "   | ", lambda line: True))
        emit(f"3. slurm-nebula-resume {NODES}   (slurmctld runs this when jobs need the nodes; here for jobs "
             "1001 on gpu[01-02], 1002 on gpu03, 1003 on gpu04)")
        progress.restart()
        up = observed(ctx, config, "resume", lambda run: resume(run, nodes, JOBS))
        emit(f"   resume: {up.describe()}; {gpus(sim)}")
        emit("   with Slurm, each guest's slurmd now registers and slurm-nebula-prolog (the PrologSlurmctld) "
             "lets the waiting job start at once, not at slurmctld's next 30 s check")
        emit("4. slurm-nebula-power status   (no Slurm here: its column says n/a)")
        emit(textwrap.indent(render(table_rows(config, ctx.cloud, None, nodes), slurm_asked=False), "   "))
        emit(f"5. slurm-nebula-suspend {NODES}   (slurmctld runs this after SuspendTime idle)")
        progress.restart()
        down = observed(ctx, config, "suspend", lambda run: power_down(run, nodes, "suspend", force=False))
        emit(f"   suspend: {down.describe()}; {gpus(sim)}")
        big = expand(BIG_JOB)
        emit(f"6. job 1 asks for {len(big)} GPU nodes ({BIG_JOB}) on a cloud with 4 GPUs: "
             f"slurm-nebula-resume {BIG_JOB}")
        created = len(sim.vms())
        start_big = time.monotonic()
        short = observed(ctx, config, "resume", lambda run: resume(run, big, {node: [1] for node in big}))
        emit(f"   resume: {short.describe()} in {time.monotonic() - start_big:.1f}s, "
             f"{len(sim.vms()) - created} VMs created; {gpus(sim)}")
        emit("   the whole job is handed back at once (all-or-nothing), so Slurm requeues it now, not at "
             "boot_timeout, and no GPU idles for it")
        emit("7. slurm-nebula-power status --capacity   (the GPUs per host)")
        emit(textwrap.indent(render_capacity(capacity(config, ctx.cloud)), "   "))
        hosts = sim.hosts()
        freed = all(h.gpus_free == h.gpus_total for h in hosts)
        no_vm = len(sim.vms()) == created and sorted(short.failed_nodes) == big
        emit(f"8. slurm-nebula-power usage   (from the usage records in {config.log.audit_file})")
        records, _ = read_audit([config.log.audit_file] if config.log.audit_file else [])
        rows = summarize(intervals(records), "job", None, time.time(), lambda node: NODES)
        emit(textwrap.indent(usage_table(rows, "job"), "   "))
        emit(f"   metrics for Prometheus (node_exporter's textfile collector) in {config.log.metrics_file}")
    ok = not up.failed and not down.failed and freed and len(up.done) == len(nodes) and no_vm
    emit(f"{'done' if ok else 'FAILED'} in {time.monotonic() - start:.1f}s: "
         + ("every VM created, booted and terminated, every GPU back. The job too big for the cloud was handed "
            "back whole, with no VM created." if ok else "see the log " +
            str(config.log.file)))
    emit("Next: write your configuration (slurm-nebula-power example-config > /etc/slurm/nebula-power.toml), "
         "then `slurm-nebula-power check` and `slurm-nebula-power slurm-conf`.")
    return EXIT_OK if ok else EXIT_NODES_FAILED


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """slurm-nebula-power demo: resume and suspend gpu[01-04] on the embedded simulator, no Slurm needed."""
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="slurm-nebula-power demo", description=(
        f"Start the embedded OpenNebula simulator, write a temporary configuration, resume {NODES} showing "
        "each VM's progress (PENDING -> PROLOG -> BOOT -> RUNNING), show the status table, then suspend them "
        f"and show the GPUs freed; then a job that asks for more GPUs than exist ({BIG_JOB}) is handed back "
        "whole at once. Needs no Slurm: the scontrol commands are printed. Takes about 10 s."))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.epilog = "exit: 0 demo ran start to finish, 1 something failed (the log says what), 2 usage"
    parser.add_argument("--phase-seconds", type=float, default=1.0, metavar="S",
                        help="seconds each simulated VM phase (prolog, boot) lasts (default 1)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (config and log)")
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    if not 0 <= args.phase_seconds <= 30:
        print("slurm-nebula-power demo: error: --phase-seconds must be between 0 and 30", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="snp-demo-"))
    print(f"slurm-nebula-power demo: OpenNebula simulator and the power-saving programs in {root}, no Slurm "
          "needed", flush=True)
    try:
        return run(root, args.phase_seconds, lambda line: print(line, flush=True), env)
    except PowerError as exc:
        report_error("slurm-nebula-power demo", str(exc), quiet=True)
        return exc.exit_code
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
