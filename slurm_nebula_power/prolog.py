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

from .backoff import Backoff
from .config import ENV_CONFIG, Config
from .errors import (
    EXIT_NODES_FAILED,
    EXIT_OK,
    HostlistError,
    PowerError,
    SlurmError,
)
from .hostlists import expand_trusted, fold
from .nodestate import UP_STATES, NodeState
from .shapes import RESUME_MARGIN
from .slurm import Scontrol
from .slurmconf import read_slurm_conf

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

    FAILED only when the node cannot serve the job any more (NodeState.is_lost_to_job); not the Reason: a
    node handed back earlier keeps its "nebula: ..." reason until it registers again, also while it is
    resumed anew.
    """
    if state is None:
        return WAITING, "not shown by scontrol"
    words = state.state + (f" Reason={state.reason}" if state.reason else "")
    if state.is_lost_to_job:
        return FAILED, words
    if state.is_registering or state.base not in UP_STATES:  # an empty or unknown state is never "up"
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
        interval, errors = Backoff(POLL_FIRST, POLL_MAX, POLL_GROWTH), 0
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
                    interval.reset()  # the others are often close behind
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
            self.sleep(min(interval.next(), max(0.0, deadline - now)))

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
