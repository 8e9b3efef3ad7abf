"""Process hygiene for every program, loaded first and alone: slurmctld's way of starting us, no core dumps."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import sys

PR_SET_DUMPABLE = 4  # <linux/prctl.h>


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
    no_core_dumps()


def no_core_dumps() -> None:
    """A core dump of a running program would hold the OpenNebula session: none, and no ptrace by others
    of our uid either (prctl PR_SET_DUMPABLE 0)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
