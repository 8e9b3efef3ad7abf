"""Entry points: parse argv, configure logging, wire objects, map errors to exit codes.

Nothing here imports pyone at module level: `--help` and `--version` must stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import syslog
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from . import __version__
from .errors import EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, PowerError

if TYPE_CHECKING:
    from .config import Config
    from .power import Context, Outcome

log = logging.getLogger("slurm_nebula_power")
LOG_FORMAT = "%(asctime)s %(prog)s[%(process)d] %(levelname)s %(message)s"


# ---- process hygiene ------------------------------------------------------------------------------


def process_hygiene() -> None:
    """slurmctld starts us with fds 0-2 closed and signals blocked: reopen and unblock first thing."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)  # fd 1 lives as long as the process
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signal.valid_signals())


def setup_logging(prog: str, config: Config | None, stream_too: bool = False) -> None:
    """Log to the configured file (or stderr), with the program name and pid on every line."""
    from .errors import ConfigError

    root = logging.getLogger("slurm_nebula_power")
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    handlers: list[logging.Handler] = []
    if config is not None and config.log.file is not None:
        try:
            config.log.file.parent.mkdir(parents=True, exist_ok=True)
            handlers.append(logging.FileHandler(config.log.file, encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{config.path}: log.file: cannot write {config.log.file}: {exc.strerror}; "
                              "make its directory writable by SlurmUser or change log.file") from None
    if not handlers or stream_too:
        handlers.append(logging.StreamHandler(sys.stderr))
    for handler in handlers:
        handler.setFormatter(logging.Formatter(LOG_FORMAT, defaults={"prog": prog}))
        root.addHandler(handler)
    root.setLevel((config.log.level if config else "info").upper())


def report_error(prog: str, message: str) -> None:
    """A fatal one-line error: stderr, the log if it is set up, and syslog (stdout/err may be discarded)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    if logging.getLogger("slurm_nebula_power").handlers:
        log.error("%s", message)
    try:
        syslog.openlog(prog, syslog.LOG_PID)
        syslog.syslog(syslog.LOG_ERR, message)
    except OSError:
        pass


# ---- shared argument handling ---------------------------------------------------------------------


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every program shares (--version, --config)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--config", metavar="PATH", help="configuration file (default: $SLURM_NEBULA_POWER_CONFIG, "
                        "nebula-power.toml beside $SLURM_CONF, /etc/slurm/nebula-power.toml)")
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    """Parse argv; on --help/--version/usage errors return the exit code instead of exiting."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE


def load(args: argparse.Namespace, environ: Mapping[str, str]) -> Config:
    """Find and load the configuration."""
    from .config import find_config, load_config

    return load_config(find_config(args.config, environ), environ)


def build_context(config: Config, environ: Mapping[str, str], slurm: object | None = None) -> Context:
    """Wire the real cloud and Slurm into a power.Context."""
    from .cloud import OneCloud
    from .power import Context
    from .slurm import Scontrol, find_scontrol

    if slurm is None:
        env = {"SLURM_CONF": str(config.slurm.slurm_conf)} if config.slurm.slurm_conf else {}
        slurm = Scontrol(find_scontrol(config, environ), env=env)
    return Context(config=config, cloud=OneCloud(config.opennebula), slurm=slurm)  # type: ignore[arg-type]


def read_resume_file(environ: Mapping[str, str]) -> dict[str, list[int]]:
    """Job ids per node from SLURM_RESUME_FILE (22.05 `nodes`, 23.02+ `nodes_resume`); {} when absent."""
    from .hostlists import expand

    path = environ.get("SLURM_RESUME_FILE")
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        jobs: dict[str, list[int]] = {}
        for job in data.get("jobs") or []:
            nodes = job.get("nodes_resume") or job.get("nodes") or ""
            for node in expand(nodes) if nodes else []:
                jobs.setdefault(node, []).append(int(job["job_id"]))
        return jobs
    except (OSError, ValueError, TypeError, KeyError, AttributeError, PowerError) as exc:
        log.warning("SLURM_RESUME_FILE %s unreadable, continuing without job ids: %s", path, exc)
        return {}


# ---- the three power-saving programs --------------------------------------------------------------


Operation = Callable[["Context", list[str], dict[str, list[int]]], "Outcome"]


def _power_program(prog: str, description: str, operation: Operation, argv: Sequence[str] | None,
                   environ: Mapping[str, str] | None, detachable: bool = False) -> int:
    env = os.environ if environ is None else environ
    parser = make_parser(prog, description)
    parser.add_argument("hostlist", help="Slurm hostlist expression, e.g. gpu[01-04]")
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    jobs = read_resume_file(env) if detachable else {}  # the memfd vanishes when we exit: read it first
    try:
        from .hostlists import expand

        config = load(args, env)
        setup_logging(prog, config)
        nodes = expand(args.hostlist)
    except PowerError as exc:
        report_error(prog, str(exc))
        return exc.exit_code
    if detachable and config.power.detach and _detach():
        log.info("detached: %s continues in the background", args.hostlist)
        return EXIT_OK
    return _run_locked(prog, config, env, nodes, jobs, operation, args.hostlist)


def _detach() -> bool:
    """Fork; True in the parent (which returns to slurmctld), False in the detached child."""
    if os.fork() > 0:
        return True
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    return False


def _run_locked(prog: str, config: Config, environ: Mapping[str, str], nodes: list[str],
                jobs: dict[str, list[int]], operation: Operation, expression: str) -> int:
    from .hostlists import fold
    from .locks import NodeLocks

    start = time.monotonic()
    wait = max(ns.boot_timeout for ns in config.nodesets) + config.power.suspend_timeout
    try:
        context = build_context(config, environ)
        with NodeLocks(config.power.lock_dir, nodes, wait) as locks:
            if locks.busy:
                log.error("%s: still locked by another run after %.0fs, left to it", fold(locks.busy), wait)
            outcome = operation(context, [n for n in nodes if n in locks.held], jobs)
            for node in locks.busy:
                outcome.fail(node, "busy: another run holds its lock")
    except PowerError as exc:
        report_error(prog, str(exc))
        return exc.exit_code
    except Exception:
        log.exception("%s %s: internal error", prog, expression)
        return EXIT_INTERNAL
    stats = context.cloud.stats  # type: ignore[attr-defined]
    log.info("summary: %s %s: %s in %.1fs, %d API calls, %d retries", prog, expression, outcome.describe(),
             time.monotonic() - start, stats.calls, stats.retries)
    return 0 if not outcome.failed else 1


def _resume_op(ctx: Context, nodes: list[str], jobs: dict[str, list[int]]) -> Outcome:
    from .power import resume

    return resume(ctx, nodes, jobs)


def _suspend_op(ctx: Context, nodes: list[str], jobs: dict[str, list[int]]) -> Outcome:
    from .power import power_down

    return power_down(ctx, nodes, "suspend", force=False)


def _resume_fail_op(ctx: Context, nodes: list[str], jobs: dict[str, list[int]]) -> Outcome:
    from .power import power_down

    return power_down(ctx, nodes, "resume failed: node never registered with slurmctld", force=True)


def resume_main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """ResumeProgram: create, resume or recreate the VMs of the given nodes."""
    return _power_program("slurm-nebula-resume", "Slurm ResumeProgram for OpenNebula: boot the VMs of "
                          "these nodes and tell slurmctld their addresses.", _resume_op, argv, environ,
                          detachable=True)


def suspend_main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """SuspendProgram: power the nodes' VMs down with their node set's suspend_action."""
    return _power_program("slurm-nebula-suspend", "Slurm SuspendProgram for OpenNebula: power these "
                          "nodes' VMs down (terminate by default, which frees their GPUs).", _suspend_op,
                          argv, environ)


def resume_fail_main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """ResumeFailProgram: terminate the VMs of nodes that never came up."""
    return _power_program("slurm-nebula-resume-fail", "Slurm ResumeFailProgram for OpenNebula: terminate "
                          "the VMs of nodes that never registered, so no VM or GPU leaks.", _resume_fail_op,
                          argv, environ)


def prolog_main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """PrologSlurmctld: return once the job's cloud nodes are up, so it starts without Slurm's 30 s wait."""
    from .prolog import main

    return main(argv, environ)


# ---- slurm-nebula-power <command> -----------------------------------------------------------------

COMMANDS: dict[str, tuple[str, str]] = {
    "simulator": ("slurm_nebula_power.simulator.cli:main", "run the OpenNebula simulator (XML-RPC over HTTP)"),
    "demo": ("slurm_nebula_power.demo:main", "resume and suspend gpu[01-04] on the embedded simulator, no Slurm"),
    "status": ("slurm_nebula_power.status:main", "per node: Slurm state, VM, IP, host, age and what is wrong"),
    "check": ("slurm_nebula_power.check:main", "find configuration, credential, template and slurm.conf problems"),
    "reconcile": ("slurm_nebula_power.reconcile:main", "repair drift: orphan VMs, vanished VMs, stuck boots"),
    "slurm-conf": ("slurm_nebula_power.slurmconf:main", "print slurm.conf lines derived from the templates"),
    "template": ("slurm_nebula_power.template:main", "print a node set's VM template for onetemplate create"),
    "prolog-wait": ("slurm_nebula_power.prolog:main",
                    "PrologSlurmctld: wait until the job's cloud nodes are up (as slurm-nebula-prolog)"),
}


def power_main(argv: Sequence[str] | None = None) -> int:
    """The operator command: dispatch to a subcommand, imported only when used."""
    args = list(sys.argv[1:] if argv is None else argv)
    width = max(len(name) for name in COMMANDS)
    usage = "usage: slurm-nebula-power [--version] COMMAND [ARGS...]\n\ncommands:\n" + "".join(
        f"  {name:<{width}}  {text}\n" for name, (_, text) in COMMANDS.items()) + \
        "\nRun 'slurm-nebula-power COMMAND --help' for a command's options."
    if not args or args[0] in ("-h", "--help"):
        print(usage)
        return EXIT_OK if args else EXIT_USAGE
    if args[0] == "--version":
        print(f"slurm-nebula-power {__version__}")
        return EXIT_OK
    if args[0] not in COMMANDS:
        print(f"slurm-nebula-power: error: unknown command {args[0]!r}; one of: {', '.join(COMMANDS)}",
              file=sys.stderr)
        return EXIT_USAGE
    module, _, function = COMMANDS[args[0]][0].partition(":")
    main: Callable[[list[str]], int] = getattr(importlib.import_module(module), function)
    return main(args[1:])


def _entry(main: Callable[[], int]) -> Callable[[], None]:
    def entry() -> None:
        process_hygiene()
        sys.exit(main())

    return entry


resume_entry = _entry(resume_main)
suspend_entry = _entry(suspend_main)
resume_fail_entry = _entry(resume_fail_main)
prolog_entry = _entry(prolog_main)
power_entry = _entry(power_main)
