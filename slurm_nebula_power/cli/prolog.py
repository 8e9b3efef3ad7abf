"""`slurm-nebula-prolog` (and `slurm-nebula-power prolog-wait`): slurm.conf's PrologSlurmctld.

It waits until the job's cloud nodes are up (prolog.Wait), then runs the site's own prolog_chain. No pyone
import: it starts in about 0.1 s.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence

from ..errors import EXIT_CONFIG, EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, PowerError
from ..hostlists import fold
from ..prolog import (
    CHAIN_TIMEOUT,
    MARGIN,
    PROG,
    SCONTROL_TIMEOUT,
    Wait,
    bounds,
    our_nodes,
    run_chain,
    slurmctld_environ,
)
from ..slurm import scontrol_for
from .common import load, make_parser, parse, report_error, setup_logging

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """PrologSlurmctld: wait until the job's cloud nodes are up, then run [slurm] prolog_chain."""
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
            code = Wait(scontrol_for(config, lookup, SCONTROL_TIMEOUT), job_id, nodes, bound).run()
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
