"""Files in directories other users can write: opened without following links, checked, capped.

The log, the audit file, the metrics file and its lock, the node locks and the shortage files live in
directories that SlurmUser can write, and often others too (node_exporter's textfile directory, a shared
lock directory of two controllers). Whoever can write such a directory can plant a symlink, a hard link,
a FIFO or a device where a program will open a file, or swap a file between a check and a use. So every
such file is:

- opened with O_NOFOLLOW (a symlink is refused, never followed) and O_NONBLOCK (a FIFO cannot hang the
  open), then checked on the open descriptor (fstat): a regular file, one link only (a hard link to the
  credentials is not "our" file), owned by this process's user, by root, by the service owner, or by
  the directory's owner;
- created with O_EXCL, so a dangling symlink is never followed into a new file, and given to the service
  owner (SlurmUser, when root runs a program by hand) with fchown on the descriptor, never by path;
- read with a size cap, and never quoted in an error (a parser's message would log the file's content);
- replaced through a temporary file beside it that gets its mode and owner (fchmod, fchown) before the
  rename, so no chmod by path can ever hit another file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import os
import pwd
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

Owner = tuple[int, int]  # (uid, gid)
SAFE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeFile(OSError):
    """A file that is not what a program may use: a symlink, a FIFO or device, a hard link, another
    user's file, or larger than its cap. The message names the file and the fix, never its content."""


def trusted_owners(owner: Owner | None, directory_uid: int | None = None) -> frozenset[int]:
    """Whose files a program may use: its own user's, root's, the service owner's, and the owner of the
    file's directory (who can replace any file there anyway: a root run by hand where slurm.conf names no
    SlurmUser still uses SlurmUser's log in SlurmUser's /var/log/slurm)."""
    extra = {uid for uid in (owner[0] if owner is not None else None, directory_uid) if uid is not None}
    return frozenset({os.geteuid(), 0} | extra)


def user_name(uid: int) -> str:
    """A uid as a name where the system knows it."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    """A gid as a name where the system knows it."""
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def check_open(fd: int, path: Path | str, owner: Owner | None, any_owner: bool = False,
               directory_uid: int | None = None) -> os.stat_result:
    """Check an open descriptor: a regular file with one link, of a trusted owner (unless any_owner: a
    file only read, by whoever may read it); UnsafeFile if not."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFile(errno.EINVAL, f"{path} is not a regular file (a FIFO, device or directory): remove it")
    if any_owner:
        return info
    if info.st_nlink != 1:
        raise UnsafeFile(errno.EINVAL, f"{path} has {info.st_nlink} hard links, so it may be another file: "
                                       "remove it")
    if info.st_uid not in trusted_owners(owner, directory_uid):
        raise UnsafeFile(errno.EPERM, f"{path} belongs to {user_name(info.st_uid)}, not to this program's "
                                      "user or root: remove it")
    return info


def _refusal(path: Path | str, exc: OSError) -> OSError:
    if exc.errno == errno.ELOOP:
        return UnsafeFile(errno.ELOOP, f"{path} is a symlink, never followed: remove it")
    if exc.errno in (errno.ENXIO, errno.EISDIR):  # ENXIO: O_NONBLOCK|O_WRONLY on a FIFO with no reader
        return UnsafeFile(exc.errno, f"{path} is not a regular file (a FIFO, device or directory): remove it")
    if exc.errno == errno.EACCES:
        return PermissionError(errno.EACCES, denied(path))
    return exc


def denied(path: Path | str) -> str:
    """Why this user may not open path, and the fix: the file's owner and mode when it exists (a file a
    root run left), else its directory's."""
    target = Path(path)
    for where in (target, target.parent):
        try:
            info = os.stat(where, follow_symlinks=False)
        except OSError:
            continue
        kind = "file" if where == target else "directory"
        me = user_name(os.geteuid())
        return (f"{where} ({kind} of {user_name(info.st_uid)}, mode {stat.S_IMODE(info.st_mode):04o}) cannot be "
                f"used by {me}: run chown {me} {where}")
    return f"{path}: permission denied"


def open_file(path: Path | str, flags: int, mode: int = 0o640, owner: Owner | None = None,
              dir_fd: int | None = None, exact_mode: bool = False, shown: Path | None = None,
              any_owner: bool = False) -> int:
    """Open path safely (see the module's docstring); with O_CREAT, a file this call creates gets `mode`
    (exactly, or under the umask) and, when root runs this, `owner`. Returns the descriptor. `shown`: the
    whole path, for messages, when path is relative to dir_fd."""
    created = False
    name = path
    path = shown or path
    for _ in range(3):  # a file removed between the two opens below: try again
        try:
            if flags & os.O_CREAT:
                try:
                    fd = os.open(name, flags | os.O_EXCL | SAFE_FLAGS, mode, dir_fd=dir_fd)
                    created = True
                    break
                except FileExistsError:
                    pass
            fd = os.open(name, (flags & ~os.O_CREAT) | SAFE_FLAGS, dir_fd=dir_fd)
            break
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
        except OSError as exc:
            raise _refusal(path, exc) from None
    else:
        raise UnsafeFile(errno.EAGAIN, f"{path} keeps vanishing while it is opened: is another process "
                                       "removing it?")
    try:
        check_open(fd, path, owner, any_owner, _directory_uid(name, dir_fd))
        if created:
            if exact_mode:
                os.fchmod(fd, mode)
            if owner is not None and os.geteuid() == 0:
                os.fchown(fd, *owner)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _directory_uid(name: Path | str, dir_fd: int | None) -> int | None:
    try:
        return os.fstat(dir_fd).st_uid if dir_fd is not None else os.stat(Path(name).parent).st_uid
    except OSError:
        return None


def read_capped(path: Path, cap: int, owner: Owner | None = None) -> bytes | None:
    """A whole file of at most `cap` bytes, opened safely; None when it does not exist."""
    try:
        fd = open_file(path, os.O_RDONLY, owner=owner)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(cap + 1)
    if len(data) > cap:
        raise UnsafeFile(errno.EFBIG, f"{path} is larger than {cap} bytes, more than it can be: remove it")
    return data


LOCK_MODE = 0o600  # a lock file: only its owner (SlurmUser) and root may open it, so only they can flock it
PRIVATE_DIRECTORY = 0o750  # lock_dir: others may not even look up a name in it


def make_directory(path: Path, owner: Owner | None = None, mode: int = 0o755) -> None:
    """Make a directory (its missing parents too) when it does not exist, with `mode` under the umask;
    when root runs this, the directory itself is given to owner by fchown on a descriptor opened without
    following a link: a chown by path gave owner whatever link a writer of the parent put there between the
    mkdir and the chown (SlurmUser, /etc/shadow)."""
    if os.path.lexists(path):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return  # made meanwhile by another run (or planted: the opens below it check what they find)
    if owner is None or os.geteuid() != 0:
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise UnsafeFile(errno.ELOOP, f"{path} was replaced while it was made (a link?): remove it") from exc
    try:
        if os.fstat(fd).st_uid == 0:  # the one this run made, not another user's put in its place
            os.fchown(fd, *owner)
    finally:
        os.close(fd)


def replace(path: Path, data: bytes, mode: int, owner: Owner | None = None) -> None:
    """Write a whole file atomically: a temporary file beside it (O_EXCL), fchmod and fchown on its
    descriptor, then rename over path (a rename never follows a link at path)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            if owner is not None and os.geteuid() == 0:
                os.fchown(handle.fileno(), *owner)
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def private_lock(fd: int, owner: Owner | None) -> None:
    """Make an open lock file SlurmUser's and 0600 (what an older version, or a root run without an owner,
    left 0644 or root's): anyone who can open a lock file can flock it and hold a node for ever."""
    info = os.fstat(fd)
    if os.geteuid() == 0 and owner is not None and info.st_uid != owner[0]:
        os.fchown(fd, *owner)
    elif info.st_uid != os.geteuid() and os.geteuid() != 0:
        return  # root's or another's: check names it
    if stat.S_IMODE(info.st_mode) != LOCK_MODE:
        os.fchmod(fd, LOCK_MODE)


@contextlib.contextmanager
def flocked(lock: Path, wait: float, owner: Owner | None = None) -> Iterator[None]:
    """Hold an flock on the file `lock` (opened safely, made 0600 for `owner` when missing), waiting at most
    `wait` seconds for another holder (TimeoutError); the kernel drops it if the process dies."""
    fd = open_file(lock, os.O_RDONLY | os.O_CREAT, LOCK_MODE, owner, exact_mode=True)
    try:
        private_lock(fd, owner)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{lock} held for more than {wait:g}s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)
