"""The texts oned writes on a VM: SCHED_MESSAGE's, as 7.0 and 7.4 word them, and their timestamp."""

from __future__ import annotations

import time

# 7.x when no host takes VMs at all (SchedulerManager: no host in a state to run VMs).
NO_HOSTS_TEXT = "Cannot dispatch VM: No hosts enabled to run VMs"
# What a stuck VM (fault) is told: the text real oned left on VMs its scheduler stalled on.
STUCK_TEXT = ("Cannot dispatch VM to any Host. Possible reasons: Not enough capacity in Host or System DS, "
              "dispatch limit reached, or limit of free leases reached.")
# 7.4's rank scheduler names each shortage and the hosts that had it (SchedulerFailure::log_failures).
_SHORTAGE_7_4 = {"CPU": "[HOST] Not enough CPU on hosts: ", "MEMORY": "[HOST] Not enough MEMORY on hosts: ",
                 "PCI": "[HOST] Unavailable PCI devices on hosts: "}

def ctime(now: float) -> str:
    """oned's timestamp for ERROR and SCHED_MESSAGE (one_util::log_time, ctime's form): `Tue Dec  1 08:36:52 2026`."""
    return time.strftime("%a %b %e %H:%M:%S %Y", time.localtime(now))


def version_at_least(version: str, major: int, minor: int) -> bool:
    """Whether the configured oned version (`7.4.0`) is at least major.minor."""
    parts = tuple(int(p) if p.isdigit() else 0 for p in [*version.split("."), "0", "0"][:2])
    return parts >= (major, minor)


def sched_text(version: str, shortages: dict[int, str]) -> str:
    """SCHED_MESSAGE's text (after the time) for a VM no host could take: host id -> CPU, MEMORY or PCI.

    7.0 (Scheduler.cc) names every host tried, whatever was short; 7.4 names each shortage with its hosts.
    """
    if version_at_least(version, 7, 4):
        return "".join(prefix + ",".join(str(h) for h, kind in sorted(shortages.items()) if kind == short)
                       for short, prefix in _SHORTAGE_7_4.items() if short in shortages.values())
    return "Cannot allocate VM. Not enough capacity in hosts " + ",".join(str(h) for h in sorted(shortages))
