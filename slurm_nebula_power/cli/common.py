"""What every command shares: process hygiene, logging, the one error line, argument parsing, wiring."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pwd
import sys
import syslog
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ..audit import AuditLog
from ..config import Config, find_config, load_config
from ..errors import (
    CloudAuthError,
    CloudError,
    ConfigError,
    CredentialsRefused,
    EndpointUnresolved,
    EndpointUntrusted,
    PowerError,
    TransientCloudError,
    first_line,
)
from ..files import UnsafeFile, make_directory, open_file
from ..metrics import RunFigures, write_metrics
from ..model import DONE, printable
from ..operation import Cloud, Context, Outcome
from ..protectlog import ProtectLog
from ..records import reason_category
from ..slurm import SlurmControl, scontrol_for
from ..slurmconf import read_slurm_conf
from .args import make_parser as make_parser
from .args import parse as parse

log = logging.getLogger("slurm_nebula_power")
LOG_FORMAT = "%(asctime)s %(prog)s[%(process)d] %(levelname)s %(message)s"


class OneLineFormatter(logging.Formatter):
    """Every message is one line: values from OpenNebula or a guest (names, addresses, error texts) have
    their control characters escaped, so none can forge a log line. Tracebacks stay as Python wrote them."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)


def service_owner(config: Config) -> tuple[int, int] | None:
    """When root runs a program (a resume or reconcile typed by hand): SlurmUser's uid and gid from
    slurm.conf, who gets the directories and files this run creates, so SlurmUser's next run can use them.
    None when not root, or SlurmUser is root or unknown."""
    if os.geteuid() != 0 or config.slurm.slurm_conf is None:
        return None
    try:
        entry = pwd.getpwnam(read_slurm_conf(config.slurm.slurm_conf).get("SlurmUser"))
    except (ConfigError, KeyError):
        return None
    return None if entry.pw_uid == 0 else (entry.pw_uid, entry.pw_gid)


class _LogFile(logging.StreamHandler):  # type: ignore[type-arg]
    """The log file, opened by files.open_file (no link followed, created for SlurmUser by a root run)."""

    def __init__(self, path: Path, owner: tuple[int, int] | None) -> None:
        fd = open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644, owner)
        super().__init__(os.fdopen(fd, "a", encoding="utf-8"))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.stream.close()
        super().close()


def _at_a_terminal() -> bool:
    try:
        return os.isatty(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False


def setup_logging(prog: str, config: Config | None, stream_too: bool = False) -> None:
    """Log to the configured file (or stderr), with the program name and pid on every line."""
    root = logging.getLogger("slurm_nebula_power")
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    handlers: list[logging.Handler] = []
    if config is not None and config.log.file is not None:
        owner, file = service_owner(config), config.log.file
        try:
            make_directory(file.parent, owner)
            handlers.append(_LogFile(file, owner))
        except OSError as exc:
            fix = "" if isinstance(exc, (UnsafeFile, PermissionError)) else \
                "; make its directory writable by SlurmUser or change log.file"
            raise ConfigError(f"{config.path}: log.file: cannot write {config.log.file}: {exc.strerror}{fix}") \
                from None
    # Run by hand at a terminal, a program that logs to its file says the same on stderr: the administrator
    # sees what it does (slurmctld gives its programs no terminal).
    if not handlers or stream_too or _at_a_terminal():
        handlers.append(logging.StreamHandler(sys.stderr))
    for handler in handlers:
        handler.setFormatter(OneLineFormatter(LOG_FORMAT, defaults={"prog": prog}))
        root.addHandler(handler)
    root.setLevel((config.log.level if config else "info").upper())


def quiet_logging(prog: str, level: int) -> None:
    """For the operator commands that never write the log: stderr only, from this level up."""
    setup_logging(prog, None)
    logging.getLogger("slurm_nebula_power").setLevel(level)


def report_error(prog: str, message: str, quiet: bool = False) -> None:
    """The one line of a fatal error: stderr, and (unless quiet) the log if it is set up, and syslog
    (slurmctld may discard stdout and stderr). Commands that never write the log pass quiet."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    if quiet:
        return
    # The log too, but not a second time on stderr (a dry run, or a run at a terminal, logs there as well)
    files = [h for h in logging.getLogger("slurm_nebula_power").handlers
             if getattr(h, "stream", None) not in (sys.stderr, sys.__stderr__)]
    if files:
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (message,), None)
        for handler in files:
            handler.handle(record)
    try:
        syslog.openlog(prog, syslog.LOG_PID)
        syslog.syslog(syslog.LOG_ERR, message)
    except OSError:
        pass


def load(args: argparse.Namespace, environ: Mapping[str, str]) -> Config:
    """Find and load the configuration."""
    return load_config(find_config(args.config, environ), environ)


# Seconds an operator command (status, reconcile, usage, slurm-conf, template) retries a failing call: a
# person waits for it, so a down endpoint is one error line in seconds, not a minute of retries; the
# programs slurmctld runs keep [opennebula] retry_seconds.
INTERACTIVE_RETRY = 2.0


def interactive_cloud(config: Config) -> Cloud:
    """The OpenNebula client of an operator command: its retries end within INTERACTIVE_RETRY seconds."""
    return open_cloud(config, retry_seconds=min(config.opennebula.retry_seconds, INTERACTIVE_RETRY))


def cloud_error_line(config: Config, exc: CloudError) -> str:
    """The one error line of an operator command that OpenNebula failed: the endpoint, the auth file and
    what to do, not only oned's words ("User couldn't be authenticated" named neither)."""
    one = config.opennebula
    said = first_line(exc, 200)
    if isinstance(exc, CredentialsRefused):
        return (f"OpenNebula at {one.endpoint} refused user {one.user} ({said}): put valid credentials "
                f"(user:password or user:token) in {one.auth_file}")
    if isinstance(exc, CloudAuthError):  # authenticated, but without a right this command needs
        return (f"OpenNebula at {one.endpoint} did not let user {one.user} do this ({said}): grant it the "
                "right (an ACL rule, or the object's owner, group and permissions)")
    if isinstance(exc, (EndpointUnresolved, EndpointUntrusted)):  # it names the fix: [opennebula] in this file
        return f"OpenNebula at {one.endpoint} ({config.path}): {first_line(exc, 400)}"
    if isinstance(exc, TransientCloudError):
        return (f"cannot reach OpenNebula at {one.endpoint} ({said}): check [opennebula] endpoint in "
                f"{config.path}, that oned runs and that this host reaches it (credentials: {one.auth_file})")
    return f"OpenNebula at {one.endpoint}: {said}"


def open_cloud(config: Config, retry_seconds: float | None = None) -> Cloud:
    """The real OpenNebula client."""
    # Imported here, not at the top: pyone costs ~0.13 s to import, and --help, --version and the prolog
    # (which never talks to OpenNebula) must not pay it.
    from ..cloud import OneCloud

    return OneCloud(config.opennebula, retry_seconds=retry_seconds)


def build_context(config: Config, environ: Mapping[str, str], slurm: SlurmControl | None = None,
                  interactive: bool = False, **options: object) -> Context:
    """Wire the real cloud and Slurm (or the given one) into an operation Context."""
    control = scontrol_for(config, environ) if slurm is None else slurm
    cloud = interactive_cloud(config) if interactive else open_cloud(config)
    return Context(config=config, cloud=cloud, slurm=control, owner=service_owner(config),
                   **options)  # type: ignore[arg-type]


def audit_log(config: Config, program: str) -> AuditLog:
    """This run's usage recorder ([log] audit_file; counting only when it is not set)."""
    return AuditLog(config.log.audit_file, program, config.slurm.cluster, owner=service_owner(config))


def run_figures(config: Config, program: str, outcome: Outcome | None, recorder: AuditLog, cloud: object,
                seconds: float, result: str) -> RunFigures:
    """One run's metrics from its outcome, its usage records and its client's counts."""
    figures = RunFigures(program, seconds=seconds, result=result)

    def nodeset(node: str) -> str:
        found = config.nodeset_for(node)
        return found.nodes_expr if found is not None else "none"

    if outcome is not None:
        for node in outcome.done:
            figures.done[nodeset(node)] += 1
        for reason, nodes in outcome.failed.items():
            for node in nodes:
                figures.failed[(nodeset(node), reason_category(reason))] += 1
    for (event, category), count in recorder.counts.items():
        figures.events[event] += count
        if event == "handed_back":
            figures.handbacks[category or "other"] += count
    stats = getattr(cloud, "stats", None)
    if stats is not None:
        figures.api_calls, figures.retries = stats.calls, stats.retries
    vms = getattr(cloud, "last_vms", None)
    if vms is not None:
        ours = [vm for vm in vms if vm.state != DONE and vm.is_ours(config.slurm.cluster, vm.name)]
        figures.gauges["vms"] = len(ours)
        figures.gauges["gpus_held"] = sum(1 for vm in ours for gpu in vm.gpus if gpu.assigned)
    if program in ("resume", "reconcile"):  # reconcile's timer keeps it fresh, resume as it changes
        store, now = ProtectLog.of(config), time.time()
        for each in config.nodesets:
            state = store.read(each.nodes_expr) if store.path(each.nodes_expr).exists() else None
            protected = state is not None and state.active(now, config.power.protect_for)
            figures.labelled[("nodeset_protected", each.nodes_expr)] = float(protected)
    return figures


def publish_metrics(config: Config, figures: RunFigures) -> None:
    """Merge one run's figures into [log] metrics_file, when it is set."""
    if config.log.metrics_file is not None:
        write_metrics(config.log.metrics_file, figures, owner=service_owner(config))


def run_command(prog: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None, environ: Mapping[str, str],
                work: Callable[[argparse.Namespace, Config], Callable[[], int]], quiet_below: int | None = None) -> int:
    """The commands that read and print: parse argv, load the configuration, quiet the library's log below
    `quiet_below`, then `work`; a PowerError in any of that is the one error line (stderr only) and its exit
    code. `work` returns what prints its result once nothing can fail, and gives the exit code."""
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    config: Config | None = None
    try:
        config = load(args, environ)
        if quiet_below is not None:
            quiet_logging(prog, quiet_below)
        show = work(args, config)
    except PowerError as exc:
        cloud = config is not None and isinstance(exc, CloudError)
        report_error(prog, cloud_error_line(config, exc) if cloud else str(exc), quiet=True)  # type: ignore[arg-type]
        return exc.exit_code
    return show()
