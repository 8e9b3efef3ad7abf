"""A network of its own for every guest the tests boot: one network namespace per VM, holding the VM's IP.

A real cluster's nodes each connect from their own address; since 23.11 slurmctld takes the address a
CLOUD node's slurmd registers from as its NodeAddr (cloud_reg_addrs, the default), so the tests need the
same. Inside the test session's private namespace (conftest.py), `guest_argv(addr, argv)` runs `argv` in
a new network namespace (and UTS namespace, with the VM's hostname) whose only IPv4 address is `addr`,
on one end of a veth pair; the other end stays in the session's namespace with a /32 route to `addr`:

    session namespace                                  guest namespace (one per VM)
      lo 127.0.0.1, 127.0.0.2 (slurmctld, oned, ...)     lo up, without 127.0.0.1
      snpXXXXXXXX --- veth ---------------------------- eth0 127.0.1.5/32
      127.0.1.5/32 dev snpXXXXXXXX src 127.0.0.1         127.0.0.0/8 via 127.0.0.1 (the session)

All of 127.0.0.0/8 is local to the session's lo, so its routing looks at the main table (the /32 routes)
before the local table, and accepts loopback addresses on its veths (route_localnet; no rp_filter). A
guest reaches slurmctld at 127.0.0.1 and other guests through the session (ip_forward), always from its
own address; slurmctld reaches the guest at its address. Nothing leaves the session's namespace.

The namespace lives as long as a process runs in it (slurmd daemonizes and keeps it; munged too in the
worker's guests): when the guest's daemons are stopped by pid, the namespace, the veth pair and the route
go with them, and the address is local to the session again (a connection to it is refused, as before).

A VM is never up in the second it was asked for, and neither is a guest here: its program starts at the
earliest at the next whole second of the wall clock after the boot was asked for (VMNET_BOOT_ASKED_AT, in
seconds since the epoch, from a caller that boots several guests for one request; else the moment vmnet
starts). slurmctld needs that of a `slurmd -b`: it takes a node's boot time as its own time(NULL) less the
uptime slurmd reports, and ignores, at debug level, a powering-up node's registration that says it booted
before the second its ResumeProgram was started (waiting_for_node_boot); such a slurmd never registers
again and the node stays POWERING_UP until ResumeTimeout. 22.05's -b reports the whole seconds the system's
uptime turned since slurmd started, and those turn at another moment of the second than the wall clock's:
a slurmd started in the request's own second, with the uptime's second turning between its start and its
registration, said it booted a second before it was asked to (seen: a job's node never registered, the
other did in 1.2 s). From the next second on, the boot time it reports is never before the request.

Run as a program (what the power programs and hooks call): `vmnet.py ADDR HOSTNAME -- ARGV...` starts ARGV
in a new guest namespace and exits with its status (slurmd: once it has daemonized); with ADDR "" only the
hostname is its own (a UTS namespace on the session's network: a controller host at 127.0.0.1). Standard library only:
the recording programs and hooks run it with the tests' interpreter.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import math
import os
import secrets
import select
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

NETNS_ENV = "SLURM_NEBULA_POWER_TEST_NETNS"  # conftest.py's marker: "isolated" inside its namespace
IP_PATHS = ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip")
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
SESSION_ADDR = "127.0.0.1"  # the session namespace's address as the guests see it (slurmctld's)
VETH_PREFIX = "snp"  # the session-side ends: snp + 8 hex digits
RULE_PREF_MAIN, RULE_PREF_LOCAL = 50, 100
HANDSHAKE_SECONDS = 20.0  # bound for each side waiting for the other while a guest namespace is made
ASKED_AT_ENV = "VMNET_BOOT_ASKED_AT"  # when the boot was asked for (epoch seconds); see the module doc


class VmnetError(RuntimeError):
    """A guest namespace could not be made; the message says which step failed."""


def ip_binary() -> str:
    """Absolute path of iproute2's `ip`."""
    found = next((p for p in IP_PATHS if os.access(p, os.X_OK)), None)
    if found is None:
        raise VmnetError("iproute2 is not installed: no `ip` command")
    return found


def _ip(*args: str) -> None:
    proc = subprocess.run([ip_binary(), *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=10, check=False)
    if proc.returncode != 0:
        raise VmnetError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")


def _sysctl(name: str, value: str) -> None:
    # /proc/sys/net shows the network namespace of the process that opens it.
    Path("/proc/sys", *name.split(".")).write_text(value + "\n")


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)  # Python 3.11 has no os.unshare
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise VmnetError(f"unshare failed: {errno.errorcode.get(err, err)} {os.strerror(err)}")


def prepare_session() -> None:
    """In the session's namespace (once, right after it is made): let /32 routes to guests beat the local
    127.0.0.0/8, accept loopback addresses on veths, forward between guests."""
    for name, value in (("net.ipv4.conf.all.route_localnet", "1"), ("net.ipv4.conf.default.route_localnet", "1"),
                        ("net.ipv4.conf.all.rp_filter", "0"), ("net.ipv4.conf.default.rp_filter", "0"),
                        ("net.ipv4.ip_forward", "1")):
        _sysctl(name, value)
    # The kernel's rule 0 looks at the local table first, where all of 127.0.0.0/8 is this namespace's own;
    # the main table (only the guests' /32 routes here) goes before it.
    _ip("rule", "add", "pref", str(RULE_PREF_MAIN), "lookup", "main")
    _ip("rule", "add", "pref", str(RULE_PREF_LOCAL), "lookup", "local")
    _ip("rule", "del", "pref", "0")


def reserve(addr: str) -> None:
    """Make `addr` unreachable from the session until a guest takes it (the guest's route replaces this
    one; once that guest is gone the address is local to the session again). For an address where a server
    of the session would otherwise answer itself: a primary slurmctld started before its backup (24.11
    asks the backup's address to give up control at startup) would reach its own port there."""
    _ip("route", "replace", "unreachable", f"{addr}/32")


def in_private_namespace() -> bool:
    """True in a network namespace prepared by prepare_session(), with no way out (no default route): not
    the machine's own network. (The power programs get no environment from slurmctld, and /proc/1 may be
    unreadable, so this looks at the namespace itself.)"""
    def ip_out(*args: str) -> str:
        return subprocess.run([ip_binary(), *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=10, check=True).stdout
    try:
        prepared = "lookup main" in ip_out("rule", "show", "pref", str(RULE_PREF_MAIN))
        return prepared and not ip_out("route", "show", "default").strip()
    except (OSError, subprocess.SubprocessError, VmnetError):
        return False


def guest_argv(addr: str, argv: Sequence[str], hostname: str | None = None,
               python: str = sys.executable) -> list[str]:
    """The command that runs `argv` in a guest namespace of its own at `addr` (hostname: the VM's); with
    `addr` "", on the session's network under a hostname of its own."""
    return [python, str(Path(__file__).resolve()), addr, hostname or "", "--", *argv]


def boot_not_before(asked_at: float) -> float:
    """The earliest moment a guest asked for at `asked_at` starts: the next whole second of the wall clock."""
    return math.floor(asked_at) + 1.0


def _asked_at(started: float) -> float:
    value = os.environ.get(ASKED_AT_ENV, "")
    if not value:
        return started
    try:
        asked = float(value)
    except ValueError:
        asked = math.nan
    if not math.isfinite(asked) or asked > started:
        raise VmnetError(f"{ASKED_AT_ENV}={value!r}: want the epoch seconds when the boot was asked for")
    return asked


def _read_byte(fd: int, what: str) -> None:
    ready, _, _ = select.select([fd], [], [], HANDSHAKE_SECONDS)
    if not ready or os.read(fd, 1) != b"g":
        raise VmnetError(f"no {what} within {HANDSHAKE_SECONDS:g}s")


def _inside(ready_fd: int, go_fd: int, addr: str, hostname: str, argv: list[str]) -> int:
    """The guest's side: new namespaces, wait for the veth end, configure it, become argv."""
    _unshare(CLONE_NEWNET | (CLONE_NEWUTS if hostname else 0))
    if hostname:
        socket.sethostname(hostname)
    os.write(ready_fd, b"g")
    os.close(ready_fd)
    _read_byte(go_fd, "veth from the session")
    os.close(go_fd)
    _ip("link", "set", "lo", "up")
    # A VM's 127.0.0.1 is its own; here it must be the session's (slurmctld), reached through eth0.
    _ip("addr", "del", "127.0.0.1/8", "dev", "lo")
    for name, value in (("net.ipv4.conf.all.route_localnet", "1"), ("net.ipv4.conf.all.rp_filter", "0"),
                        ("net.ipv4.conf.default.rp_filter", "0")):
        _sysctl(name, value)
    _ip("addr", "add", f"{addr}/32", "dev", "eth0")
    _ip("link", "set", "eth0", "up")
    _ip("route", "add", "127.0.0.0/8", "via", SESSION_ADDR, "dev", "eth0", "onlink", "src", addr)
    os.execvp(argv[0], argv)


def _outside(addr: str, hostname: str, argv: list[str]) -> int:
    """The session's side: start the guest, give it its veth end and a route to it, wait for argv."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--inside", str(ready_w), str(go_r),
                              addr, hostname, "--", *argv], pass_fds=(ready_w, go_r))
    os.close(ready_w)
    os.close(go_r)
    try:
        _read_byte(ready_r, "guest namespace")
        veth = VETH_PREFIX + secrets.token_hex(4)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", str(child.pid))
        _ip("link", "set", veth, "up")
        # replace: the previous guest at this address may still be going away with its own veth.
        _ip("route", "replace", f"{addr}/32", "dev", veth, "src", SESSION_ADDR)
        os.write(go_w, b"g")
    except (VmnetError, OSError):
        child.kill()
        child.wait()
        raise
    finally:
        os.close(ready_r)
        os.close(go_w)
    return child.wait()


def main(args: list[str]) -> int:
    """`vmnet.py ADDR HOSTNAME -- ARGV...`: ARGV's exit status; 70 when the namespace could not be made."""
    started = time.time()
    try:
        if args[:1] == ["--inside"]:
            ready_fd, go_fd, addr, hostname, _sep, *argv = args[1:]
            return _inside(int(ready_fd), int(go_fd), addr, hostname, argv)
        addr, hostname, sep, *argv = args
        if sep != "--" or not argv or not (addr or hostname):
            raise ValueError(args)
        if not addr:  # a machine of its own name on this network (a second slurmctld host)
            _unshare(CLONE_NEWUTS)
            socket.sethostname(hostname)
            os.execvp(argv[0], argv)
        if not ipaddress.ip_address(addr).is_loopback:
            raise VmnetError(f"{addr}: guests get loopback addresses only (127.0.0.0/8)")
        if not in_private_namespace():
            raise VmnetError("not inside the test session's private network namespace: refusing to change "
                             "this namespace's network")
        time.sleep(max(0.0, boot_not_before(_asked_at(started)) - time.time()))
        return _outside(addr, hostname, argv)
    except ValueError:
        print("usage: vmnet.py ADDR HOSTNAME -- ARGV...", file=sys.stderr)
        return 2
    except (VmnetError, OSError, subprocess.SubprocessError) as exc:
        print(f"vmnet: {exc}", file=sys.stderr)
        return 70


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
