"""What `check` reports (Finding, Report), and the checks of files and of the path to oned: who can read
and write what, and whether the session travels protected."""

from __future__ import annotations

import errno
import grp
import ipaddress
import os
import pwd
import stat
import textwrap
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .config import Config
from .files import group_name, user_name
from .model import cell
from .slurmconf import SlurmConf

OK, WARNING, PROBLEM = "ok", "warning", "problem"
FIELD_LENGTH = 1000  # characters of a finding's subject, text or fix kept (ours are a few hundred)
LINE_LENGTH = 200  # characters of a printed line at most: the subject, the text's first clauses, the fix
SUBJECT_LENGTH = 80  # of them at most for the subject (a path, a hostlist)
TEXT_LENGTH = 60  # at least for the text: a fix that leaves less goes to a line of its own
CUT = "..."
INDENT = " " * 9  # a finding's continued text, under its text (no level word: grep ^problem counts findings)
R, W, X = os.R_OK, os.W_OK, os.X_OK


@dataclass(frozen=True)
class Finding:
    """One result: ok, warning or problem, about a subject, with its fix."""

    level: str
    subject: str
    text: str
    fix: str = ""

    def lines(self, length: int = LINE_LENGTH) -> list[str]:
        """`problem  auth file /etc/slurm/one_auth: ... -> fix: ...`, whatever OpenNebula answered: its values
        (oned's version, a template's CONTEXT, error texts) are escaped, so none can forge an `ok` line or hide
        a problem. No line is longer than `length`: a longer finding keeps its subject, the start of its text
        (cut after a clause, marked "...") and its fix if that fits; an ok line ends there (`check --json` has
        it whole), a warning's or problem's rest and fix follow on indented lines: nothing to act on is lost."""
        subject, text, fix = (cell(part, FIELD_LENGTH) for part in (self.subject, self.text, self.fix))
        whole = f"{self.level:<8} {subject}: {text}" + (f" -> fix: {fix}" if fix else "")
        if len(whole) <= length:
            return [whole]
        short_subject = clip(subject, SUBJECT_LENGTH)
        head = f"{self.level:<8} {short_subject}: "
        tail = f" -> fix: {fix}" if fix and len(head) + len(" -> fix: ") + len(fix) + TEXT_LENGTH <= length else ""
        cut = cut_at(text, length - len(head) - len(tail))
        headline = head + shown(text, cut) + tail
        if self.level == OK:
            return [headline]
        more = [f"subject: {subject}"] if short_subject != subject else []
        more += [CUT + " " + text[cut:].lstrip(" ;:,")] if cut < len(text) else []
        more += [f"-> fix: {fix}"] if fix and not tail else []
        return [headline, *(INDENT + part for said in more
                            for part in textwrap.wrap(said, length - len(INDENT), break_on_hyphens=False))]


def cut_at(text: str, length: int) -> int:
    """Where to cut text so that what is kept, marked "...", fits in length: all of it when it fits; else
    after a clause ("; ", ": ", ", ", before " (") in the second half of the room, else a word, else anywhere."""
    if len(text) <= length:
        return len(text)
    room = max(0, length - len(CUT))
    cut = max(text.rfind(mark, room // 2, room + 1) for mark in ("; ", ": ", ", ", " ("))
    if cut < 0:
        cut = text.rfind(" ", room // 2, room + 1)
    return room if cut < 0 else cut


def shown(text: str, cut: int) -> str:
    """text up to cut, marked "..." when that is not all of it."""
    return text if cut >= len(text) else text[:cut].rstrip(" ;:,") + CUT


def clip(text: str, length: int) -> str:
    """text in at most length characters, marked "..." when cut."""
    return shown(text, cut_at(text, length))


class Report:
    """The findings of one check run."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []

    def ok(self, subject: str, text: str) -> None:
        """Record a passed check."""
        self.findings.append(Finding(OK, subject, text))

    def warn(self, subject: str, text: str, fix: str) -> None:
        """Record something that works but is likely not what you want."""
        self.findings.append(Finding(WARNING, subject, text, fix))

    def problem(self, subject: str, text: str, fix: str) -> None:
        """Record something that will fail."""
        self.findings.append(Finding(PROBLEM, subject, text, fix))

    @property
    def problems(self) -> list[Finding]:
        """The problems only."""
        return [f for f in self.findings if f.level == PROBLEM]


# ---- file access as SlurmUser -------------------------------------------------------------------------


def allowed(user: pwd.struct_passwd, path: Path, want: int) -> bool | None:
    """Whether user may access path (want: R/W/X bits), every directory the kernel searches on the way
    included, a symlink's own directory as well as its target's; None: cannot tell.

    POSIX mode bits only (ACLs are not read); root may do anything.
    """
    if user.pw_uid == 0:
        return True
    groups = {user.pw_gid} | {g.gr_gid for g in grp.getgrall() if user.pw_name in g.gr_mem}

    def bits(p: Path, need: int) -> bool:
        info = p.stat()
        shift = 6 if info.st_uid == user.pw_uid else 3 if info.st_gid in groups else 0
        return (info.st_mode >> shift) & need == need

    try:
        searched, reached = lookup(path)
        return all(bits(directory, X) for directory in dict.fromkeys(searched)) and bits(reached, want)
    except PermissionError:
        return None
    except OSError:
        return False


MOST_LINKS = 40  # the kernel follows at most 40 symlinks in one lookup (ELOOP)


def lookup(path: Path) -> tuple[list[Path], Path]:
    """What the kernel looks at to open path: each directory it searches, links followed as it follows them
    (a link in /usr/local/bin to a script in /root needs /root searchable: realpath alone hides that), and
    the file it reaches."""
    searched: list[Path] = []
    current, parts, links = Path("/"), list(path.absolute().parts[1:]), 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent  # current is never a link: its parent is the real one, as the kernel's
            continue
        searched.append(current)
        candidate = current / part
        if not candidate.is_symlink():
            current = candidate
            continue
        links += 1
        if links > MOST_LINKS:
            raise OSError(errno.ELOOP, f"{path}: more than {MOST_LINKS} symlinks")
        target = Path(os.readlink(candidate))
        if target.is_absolute():
            current, parts = Path("/"), [*target.parts[1:], *parts]
        else:
            parts = [*target.parts, *parts]
    return searched, current


def writable(user: pwd.struct_passwd, path: Path, directory: bool) -> bool | None:
    """Whether user can write path, or create it (and its missing parent directories)."""
    target = path
    while not target.exists() and target != target.parent:
        target = target.parent
    if target == path:
        return allowed(user, path, W | X if directory else W)
    return allowed(user, target, W | X)


def _access(report: Report, user: pwd.struct_passwd, subject: str, ok: bool | None, fix: str) -> None:
    if ok is None:
        report.warn(subject, f"cannot tell whether SlurmUser {user.pw_name} has access", "run check as root")
    elif not ok:
        report.problem(subject, f"SlurmUser {user.pw_name} has no access", fix)


def check_files(report: Report, config: Config, user: pwd.struct_passwd) -> None:
    """Config, auth file, log file, lock dir, audit and metrics files as SlurmUser sees them."""
    name = user.pw_name
    _access(report, user, f"configuration {config.path}", allowed(user, config.path, R),
            f"chmod o+r {config.path} (it holds no secret) and make its directories searchable")
    auth = config.opennebula.auth_file
    before = len(report.problems)
    _access(report, user, f"auth file {auth}", allowed(user, auth, R),
            f"chown {name} {auth} && chmod 600 {auth}")
    if len(report.problems) == before:
        report.ok(f"auth file {auth}", f"readable by SlurmUser {name}, not by group or others")
    if config.log.file is not None:
        _access(report, user, f"log file {config.log.file}", writable(user, config.log.file, False),
                f"mkdir -p {config.log.file.parent} && chown {name} {config.log.file.parent}")
    _access(report, user, f"lock_dir {config.power.lock_dir}", writable(user, config.power.lock_dir, True),
            f"mkdir -p {config.power.lock_dir} && chown {name} {config.power.lock_dir}")
    audit = config.log.audit_file
    if audit is not None:
        _access(report, user, f"audit_file {audit}", writable(user, audit, False),
                f"mkdir -p {audit.parent} && chown {name} {audit.parent}")
    metrics = config.log.metrics_file
    if metrics is not None:  # written to a temporary file beside it, then renamed: the directory must be writable
        _access(report, user, f"metrics_file {metrics}", writable(user, metrics.parent, True),
                f"mkdir -p {metrics.parent} && chown {name} {metrics.parent} (node_exporter's textfile directory)")


def check_program_access(report: Report, conf: SlurmConf, user: pwd.struct_passwd) -> None:
    """SlurmUser can run each program slurm.conf names: the file, and its interpreter (#! line, links
    followed) with every directory on the way; mode bits alone passed a venv whose python lived in
    root's home."""
    keys = ("ResumeProgram", "SuspendProgram", "ResumeFailProgram", "PrologSlurmctld")
    for key in keys:
        value = conf.params.get(key.lower(), "")
        if not value or not os.path.isabs(value) or not os.path.exists(value):
            continue  # check_programs says what is wrong with it
        program = Path(value)
        blocked = [] if allowed(user, program, R | X) is not False else [str(program)]
        interpreter = _interpreter(program)
        if interpreter is not None and allowed(user, Path(interpreter), X) is False:
            resolved = os.path.realpath(interpreter)
            blocked.append(f"its interpreter {interpreter}" + (f" ({resolved})" if resolved != interpreter else ""))
        if blocked:
            report.problem(f"slurm.conf {key}", f"SlurmUser {user.pw_name} cannot run {' nor '.join(blocked)} "
                           "(a directory on the way, or the file, lacks the permission)",
                           "install slurm-nebula-power where SlurmUser can reach it, e.g. python3 -m venv "
                           "/opt/slurm-nebula-power with the system's python3")


def _interpreter(program: Path) -> str | None:
    """The interpreter of a script's #! line, or None."""
    try:
        with program.open("rb") as handle:
            first = handle.readline(4096)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode("utf-8", "replace").split()
    return words[0] if words else None


def who_can_change(path: Path) -> str | None:
    """Who, besides root, can change what path holds: its owner when not root (a SlurmUser-owned file decides
    what a root run does), its group or others when they can write it (its group root's aside), or write its
    directory without the sticky bit (a rename replaces it); None: root alone."""
    try:
        info, parent = path.stat(), path.parent.stat()
    except OSError:
        return None
    if info.st_uid != 0:
        return f"its owner {user_name(info.st_uid)}"
    for node, through in ((info, ""), (parent, f" (through its directory {path.parent})")):
        if node is parent and node.st_mode & stat.S_ISVTX:
            continue
        if node.st_mode & stat.S_IWOTH:
            return "other users" + through
        if node.st_mode & stat.S_IWGRP and node.st_gid != 0:
            return f"the group {group_name(node.st_gid)}" + through
    return None


def check_ownership(report: Report, config: Config, slurm_user: pwd.struct_passwd | None = None) -> None:
    """Nothing that decides what SlurmUser runs, and no lock directory, is writable by other users (nor
    owned by one: its owner can write it whatever its mode, and the programs trust its owner's files)."""
    named = [("configuration", config.path, "it names scontrol and prolog_chain, which SlurmUser runs"),
             ("[slurm] scontrol", config.slurm.scontrol, "SlurmUser runs it"),
             ("[slurm] prolog_chain", config.slurm.prolog_chain, "slurmctld runs it for every job"),
             ("[opennebula] ca_file", config.opennebula.ca_file, "it decides which server gets the session")]
    for what, path, why in named:
        if path is None:
            continue
        who = who_can_change(path)
        if who is not None:
            report.problem(f"{what} {path}", f"{who} can change it, not root alone: {why}",
                           f"chown root {path} && chmod go-w {path} {path.parent}")
    directories = [("lock_dir", config.power.lock_dir, "the node locks and shortage state")]
    if config.log.audit_file is not None:
        directories.append(("audit_file's directory", config.log.audit_file.parent, "the usage records"))
    if config.log.metrics_file is not None:
        directories.append(("metrics_file's directory", config.log.metrics_file.parent,
                            "the metrics file and its lock"))
    for what, directory, holds in directories:
        try:
            info = directory.stat()
        except OSError:
            continue
        mode = info.st_mode
        if slurm_user is not None and info.st_uid not in (0, os.geteuid(), slurm_user.pw_uid):
            owner = user_name(info.st_uid)
            report.problem(f"{what} {directory}", f"owned by {owner}, neither root nor SlurmUser: {owner} can "
                           f"plant links, FIFOs or files in place of {holds}, and the programs trust their "
                           "directory's owner", f"chown {slurm_user.pw_name} {directory}")
        elif mode & (stat.S_IWGRP | stat.S_IWOTH) and mode & stat.S_ISVTX and what.startswith("audit_file"):
            who = "other users" if mode & stat.S_IWOTH else "its group"
            report.problem(f"{what} {directory}", f"writable by {who}: the sticky bit does not stop them planting "
                           "rotated copies (audit.jsonl.1...) that `usage` would bill", f"chmod go-w {directory}")
        elif mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
            who = "other users" if mode & stat.S_IWOTH else "its group"
            report.problem(f"{what} {directory}", f"writable by {who}, without the sticky bit: they can plant "
                           f"links, FIFOs or files in place of {holds}, or remove them",
                           f"chmod go-w {directory} (or chmod +t {directory} where others must write there)")
        if what == "lock_dir" and mode & (stat.S_IXOTH | stat.S_IROTH):
            report.problem(f"{what} {directory}", "other users can look up its files: one may open a lock file an "
                           "older version left readable and flock it, holding its node (and the node's GPUs) "
                           "for ever", f"chmod o-rwx {directory}")


def check_transport(report: Report, config: Config) -> None:
    """The session travels in every request and template answers hold the munge key: say when the path to
    oned is not protected."""
    one = config.opennebula
    url = urlsplit(one.endpoint)
    host = url.hostname or ""
    if url.scheme == "http" and not _loopback(host):
        report.warn(f"OpenNebula {one.endpoint}", f"plain http to {host}: the session (user:password) and "
                    "the munge key in template answers cross the network readable",
                    "use https:// (oned behind a TLS proxy, or FireEdge's), or a loopback endpoint")
    if url.scheme == "https" and not one.https_verify:
        report.warn(f"OpenNebula {one.endpoint}", "https_verify = false: any host that answers for "
                    f"{host} gets the session", "set ca_file to the front end's CA and remove https_verify = false")
    if url.scheme == "http" and one.ca_file is not None:
        report.warn(f"OpenNebula {one.endpoint}", f"ca_file {one.ca_file} is set, but the endpoint is plain http: "
                    "the CA is not used", "use the front end's https:// endpoint, or remove ca_file")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
