"""`slurm-nebula-prolog`: slurm.conf's PrologSlurmctld, so a job starts the moment its cloud nodes are up.

Without a PrologSlurmctld, Slurm 22.05 starts a batch job whose powered-down nodes have registered only at
slurmctld's next periodic check, a compiled-in 30 s timer (docs/SLURM-FINDINGS.md d). slurmctld starts the
job as soon as its PrologSlurmctld returns 0, so this program returns once every node of the job that is
one of ours is up. It returns non-zero (slurmctld then requeues the job) at once when one of them was
handed back as failed, when the job left CONFIGURING (requeued or cancelled: slurmctld keeps a requeued
job in Reason=Cleaning while its old prolog runs), and after a bound derived from ResumeTimeout. Then it
runs the site's own PrologSlurmctld, `[slurm] prolog_chain`, and returns that program's exit code.

Cheap: one `scontrol show node -o <the job's cloud nodes>` per poll, 4 polls in the first second backing
off to one a second, and one `scontrol show job` every 2 s. No pyone import: it starts in about 0.1 s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .config import ENV_CONFIG
from .errors import (
    EXIT_CONFIG,
    EXIT_INTERNAL,
    EXIT_NODES_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    HostlistError,
    PowerError,
    SlurmError,
)
from .hostlists import fold
from .slurm import NodeState

if TYPE_CHECKING:
    from .config import Config
    from .slurm import Scontrol

log = logging.getLogger(__name__)

PROG = "slurm-nebula-prolog"
MARGIN = 30.0  # seconds beyond ResumeTimeout: slurmctld gives up on the nodes itself first
POLL_FIRST = 0.25  # seconds between node polls, growing by POLL_GROWTH up to POLL_MAX
POLL_GROWTH = 1.5
POLL_MAX = 1.0
JOB_EVERY = 2.0  # seconds between checks that the job is still CONFIGURING
SCONTROL_TIMEOUT = 10.0
CHAIN_TIMEOUT = 600.0  # the chained site prolog's bound unless slurm.conf sets PrologEpilogTimeout
OUTPUT_TAIL = 5  # lines of the chained program's output copied to the log
# slurmctld (22.05) gives PrologSlurmctld the job's SLURM_* variables but not SLURM_CONF: these are taken
# from the environment slurmctld itself was started with (our parent, slurmscriptd) when missing.
INHERITED = ("SLURM_CONF", ENV_CONFIG)
# Job states in which the job still waits for its nodes (the prolog runs while it is CONFIGURING).
WAITING_JOB = ("CONFIGURING", "RUNNING")

UP, WAITING, FAILED = "up", "waiting", "failed"


# ---- node states ------------------------------------------------------------------------------------


def classify(state: NodeState | None) -> tuple[str, str]:
    """UP, WAITING or FAILED for one of the job's nodes, and the words for the log.

    FAILED only when the node cannot serve the job any more: DOWN (ResumeTimeout, or the 23.02+ hand-back
    DOWN+ResumeAfter), DRAIN or FAIL (slurmctld requeues the job), powering down, or IDLE with a power-down
    flag (22.05's POWER_DOWN_FORCE hand-back: no longer allocated to the job). Not the Reason: a node handed
    back earlier keeps its "nebula: ..." reason until it registers again, also while it is resumed anew.
    """
    if state is None:
        return WAITING, "not shown by scontrol"
    flags = state.flags
    base = state.state.split("+", 1)[0].rstrip("*~#%!$@^-").upper()
    words = state.state + (f" Reason={state.reason}" if state.reason else "")
    if base in ("DOWN", "FAIL") or flags & {"DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING"}:
        return FAILED, words
    if "POWERING_DOWN" in flags or (base == "IDLE" and flags & {"POWER_DOWN", "POWERED_DOWN"}):
        return FAILED, words
    if flags & {"POWERING_UP", "POWER_UP", "POWERED_DOWN", "NOT_RESPONDING"} or base in ("UNKNOWN", "FUTURE"):
        return WAITING, words
    return UP, words


def job_state(slurm: Scontrol, job_id: str) -> str | None:
    """The job's JobState; "GONE" when slurmctld no longer knows it; None when it could not be asked."""
    try:
        out = slurm.run("show", "job", "-o", job_id)
    except SlurmError as exc:
        if "invalid job id" in str(exc).lower():
            return "GONE"
        log.debug("job %s: scontrol show job: %s", job_id, exc)
        return None
    match = re.search(r"(?:^|\s)JobState=(\S+)", out)
    return match.group(1) if match else None


# ---- the wait ---------------------------------------------------------------------------------------


@dataclass
class Wait:
    """Poll the job's cloud nodes until all are up, one fails, the job leaves, or the bound passes."""

    slurm: Scontrol
    job_id: str
    nodes: Sequence[str]
    bound: float
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    parent: Callable[[], int] = os.getppid
    polls: int = 0
    seen: dict[str, str] = field(default_factory=dict)

    def run(self) -> int:
        """EXIT_OK when every node is up, EXIT_NODES_FAILED otherwise (the job then requeues)."""
        start = self.clock()
        deadline, next_job = start + self.bound, start + JOB_EVERY
        parent = self.parent()
        interval, errors = POLL_FIRST, 0
        while True:
            self.polls += 1
            try:
                states = self.slurm.show_nodes(self.nodes)
            except SlurmError as exc:  # slurmctld busy or restarting: the next poll may get through
                errors += 1
                (log.warning if errors == 1 else log.debug)("job %s: cannot read node states (%s); retrying",
                                                            self.job_id, exc)
                states = None
            if states is not None:
                verdicts = {n: classify(states.get(n)) for n in self.nodes}
                failed = {n: words for n, (kind, words) in verdicts.items() if kind == FAILED}
                if failed:
                    for node, words in failed.items():
                        log.error("job %s: node %s failed (%s): exiting so slurmctld requeues the job now",
                                  self.job_id, node, words)
                    return EXIT_NODES_FAILED
                progressed = self._note_progress(verdicts, self.clock() - start)
                if all(kind == UP for kind, _ in verdicts.values()):
                    log.info("job %s: %d node(s) up after %.1fs (%d polls): job starts now", self.job_id,
                             len(self.nodes), self.clock() - start, self.polls)
                    return EXIT_OK
                if progressed:
                    interval = POLL_FIRST  # the others are often close behind
            now = self.clock()
            if now >= next_job:
                next_job = now + JOB_EVERY
                state = job_state(self.slurm, self.job_id)
                if state is not None and state not in WAITING_JOB:
                    log.warning("job %s: job is %s, no longer waiting for its nodes: exiting", self.job_id,
                                state)
                    return EXIT_NODES_FAILED
            if self.parent() != parent:
                log.warning("job %s: slurmctld is gone (orphaned): exiting", self.job_id)
                return EXIT_NODES_FAILED
            if now >= deadline:
                waiting = fold(n for n in self.nodes if self.seen.get(n) != UP)
                log.error("job %s: %s not up after %.0fs (ResumeTimeout + %.0fs): giving up, the job "
                          "requeues", self.job_id, waiting, self.bound, MARGIN)
                return EXIT_NODES_FAILED
            self.sleep(min(interval, max(0.0, deadline - now)))
            interval = min(interval * POLL_GROWTH, POLL_MAX)

    def _note_progress(self, verdicts: Mapping[str, tuple[str, str]], elapsed: float) -> bool:
        progressed = False
        count = sum(self.seen.get(node) == UP and kind == UP for node, (kind, _) in verdicts.items())
        for node, (kind, words) in verdicts.items():
            if kind == UP and self.seen.get(node) != UP:
                progressed, count = True, count + 1
                log.info("job %s: node %s up after %.1fs (%d of %d): %s", self.job_id, node, elapsed, count,
                         len(verdicts), words)
            self.seen[node] = kind
        return progressed


# ---- chaining the site's prolog ---------------------------------------------------------------------


def run_chain(path: Path, environ: Mapping[str, str], timeout: float, job_id: str) -> int:
    """Run the site's PrologSlurmctld with our environment; its exit code (1 when it cannot run or
    overruns `timeout`: then its whole process group is killed, children included)."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as output:
        try:
            child = subprocess.Popen([str(path)], env=dict(environ), stdin=subprocess.DEVNULL, stdout=output,
                                     stderr=subprocess.STDOUT, process_group=0)
        except OSError as exc:
            log.error("job %s: prolog_chain %s cannot be run: %s", job_id, path, exc.strerror or exc)
            return EXIT_NODES_FAILED
        try:
            returncode = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            log.error("job %s: prolog_chain %s still running after %.0fs: killed", job_id, path, timeout)
            return EXIT_NODES_FAILED
        output.seek(0)
        lines = output.read().decode(errors="replace").strip().splitlines()[-OUTPUT_TAIL:]
    if returncode:
        how = f"exited {returncode}" if returncode > 0 else f"killed by signal {-returncode}"
        log.error("job %s: prolog_chain %s %s after %.1fs%s", job_id, path, how, time.monotonic() - start,
                  "".join(f"\n  | {line}" for line in lines))
        return returncode if returncode > 0 else EXIT_NODES_FAILED
    log.debug("job %s: prolog_chain %s exited 0 after %.1fs", job_id, path, time.monotonic() - start)
    return EXIT_OK


# ---- the program ------------------------------------------------------------------------------------


def slurmctld_environ(environ: Mapping[str, str], pid: int | None = None) -> dict[str, str]:
    """environ plus SLURM_CONF and SLURM_NEBULA_POWER_CONFIG from process pid's environment (default: our
    parent, slurmctld's script daemon) where environ lacks them; unreadable -> environ unchanged."""
    out = dict(environ)
    missing = [key for key in INHERITED if not out.get(key)]
    if not missing:
        return out
    try:
        raw = Path(f"/proc/{os.getppid() if pid is None else pid}/environ").read_bytes()
    except OSError:
        return out
    items = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0"))
    theirs = {key: value for key, sep, value in items if sep}
    out.update({key: theirs[key] for key in missing if theirs.get(key)})
    return out


def our_nodes(config: Config, nodelist: str) -> list[str]:
    """The job's nodes that are in a node set; [] when the nodelist cannot be read (the job then merely
    waits for slurmctld's own check)."""
    from .hostlists import expand_trusted

    if not nodelist.strip():
        return []
    try:
        names = expand_trusted(nodelist)
    except HostlistError as exc:
        log.warning("SLURM_JOB_NODELIST unreadable (%s): not waiting for its nodes", exc)
        return []
    ours = set(config.all_nodes)
    return [name for name in names if name in ours]


def bounds(config: Config) -> tuple[float, float | None, str]:
    """(wait bound, slurm.conf's PrologEpilogTimeout or None, how the bound was derived): ResumeTimeout plus
    MARGIN; an unreadable slurm.conf gives the ResumeTimeout slurm-conf recommends."""
    from .slurmconf import RESUME_MARGIN, read_slurm_conf

    assert config.slurm.slurm_conf is not None  # load_config always sets it
    try:
        conf = read_slurm_conf(config.slurm.slurm_conf)
    except PowerError as exc:
        resume = max(ns.boot_timeout for ns in config.nodesets) + RESUME_MARGIN
        log.warning("%s; waiting up to the recommended ResumeTimeout %.0fs + %.0fs", exc, resume, MARGIN)
        return resume + MARGIN, None, "recommended"
    resume = conf.seconds("ResumeTimeout") or 60
    limit = conf.seconds("PrologEpilogTimeout") if conf.get("PrologEpilogTimeout") else None
    return resume + MARGIN, float(limit) if limit and limit > 0 else None, f"ResumeTimeout {resume}s"


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """PrologSlurmctld: wait until the job's cloud nodes are up, then run [slurm] prolog_chain."""
    from .cli import load, make_parser, parse, report_error, setup_logging

    started = time.monotonic()
    env = dict(os.environ if environ is None else environ)
    parser = make_parser(PROG, "Slurm PrologSlurmctld for OpenNebula cloud nodes: return as soon as every node "
                     "of the job (SLURM_JOB_ID, SLURM_JOB_NODELIST) that is in a node set is up, so the job "
                     "starts now rather than at slurmctld's next 30 s check; fail at once when one was "
                     "handed back as failed. Then run [slurm] prolog_chain, the site's own prolog.")
    parser.epilog = ("exit: 0 nodes up (or none of ours) and prolog_chain passed, else prolog_chain's code; "
                     "1 a node failed, the job left CONFIGURING, or ResumeTimeout + 30 s passed (slurmctld "
                     "requeues the job); 2 SLURM_JOB_ID missing; 3 configuration error")
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id.isdigit():
        report_error(PROG, "SLURM_JOB_ID is not set: slurmctld runs this as PrologSlurmctld, with SLURM_JOB_ID "
                "and SLURM_JOB_NODELIST")
        return EXIT_USAGE
    try:
        lookup = slurmctld_environ(env)
        config = load(args, lookup)
        setup_logging(PROG, config)
    except PowerError as exc:  # cannot tell our nodes nor the site's prolog_chain: fail like a missing prolog
        report_error(PROG, str(exc))
        return exc.exit_code
    try:
        nodes = our_nodes(config, env.get("SLURM_JOB_NODELIST", ""))
        chain = config.slurm.prolog_chain
        if chain is not None and chain.name == PROG:
            report_error(PROG, f"{config.path}: slurm.prolog_chain: {chain} is {PROG} itself, which would run "
                    "itself without end; name the site's own prolog or remove prolog_chain")
            return EXIT_CONFIG
        if not nodes and chain is None:
            log.debug("job %s: no cloud nodes", job_id)
            return EXIT_OK
        bound, limit, derived = bounds(config)
        if nodes:
            log.info("job %s: waiting for %s (%d node(s)), at most %.0fs (%s + %.0fs)", job_id, fold(nodes),
                     len(nodes), bound, derived, MARGIN)
            code = Wait(scontrol(config, lookup), job_id, nodes, bound).run()
            if code != EXIT_OK:
                return code
        if chain is None:
            return EXIT_OK
        # Within slurmctld's own PrologEpilogTimeout, which would kill us and leave the chained one running.
        timeout = CHAIN_TIMEOUT if limit is None else max(1.0, limit - (time.monotonic() - started) - 1)
        return run_chain(chain, env, timeout, job_id)
    except PowerError as exc:
        report_error(PROG, f"job {job_id}: {exc}")
        return exc.exit_code
    except Exception:
        log.exception("job %s: internal error", job_id)
        return EXIT_INTERNAL


def scontrol(config: Config, environ: Mapping[str, str]) -> Scontrol:
    """scontrol for the polls: SLURM_CONF as configured, a short timeout per call."""
    from .slurm import Scontrol, find_scontrol

    path = find_scontrol(config, environ)
    slurm_env = {"SLURM_CONF": str(config.slurm.slurm_conf)} if config.slurm.slurm_conf else {}
    return Scontrol(path, env=slurm_env, timeout=SCONTROL_TIMEOUT)
