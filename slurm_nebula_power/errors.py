"""One root exception and the named exit codes every program uses."""

from __future__ import annotations

import re

EXIT_OK = 0
EXIT_NODES_FAILED = 1
EXIT_USAGE = 2
EXIT_CONFIG = 3
EXIT_INTERNAL = 4
_QUOTA = re.compile(r"\b(?:user|group) \[\d+\] limit of .*", re.IGNORECASE)  # after "User [3] : "


class PowerError(Exception):
    """Root of every error this package raises on purpose."""

    exit_code = EXIT_INTERNAL


class UsageError(PowerError):
    """Bad command line (including a malformed hostlist)."""

    exit_code = EXIT_USAGE


class HostlistError(UsageError):
    """A hostlist expression or node name that cannot be accepted."""


class ConfigError(PowerError):
    """Configuration that cannot be used; the message names the file, the key and the fix (given apart, the
    fix ends the message after "; ", and `check` shows it in its fix column)."""

    exit_code = EXIT_CONFIG

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(f"{problem}; {fix}" if fix else problem)
        self.problem = problem
        self.fix = fix


class SlurmError(PowerError):
    """scontrol failed or could not be run."""


class SlurmUnreachable(SlurmError):
    """slurmctld did not answer scontrol (down, or not reachable): nothing was refused."""


class CloudError(PowerError):
    """OpenNebula refused or failed a call."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class TransientCloudError(CloudError):
    """Worth retrying: connection errors, timeouts, HTTP 5xx, INTERNAL, LOCKED."""


class Unanswered(TransientCloudError):
    """OpenNebula has answered none of the run's calls for retry_seconds: a run watching VMs gives up on them
    and hands their nodes back rather than polling on until boot_timeout (docs/behaviour.md, "Worst case")."""


class UnreadableAnswer(TransientCloudError):
    """An answer that came whole but cannot be parsed (a field that is not a number, a truncated or altered
    document): a failure of its call as an answer that never came is, but never retried, since the same
    answer again parses no better (a host pool retried for retry_seconds once took a resume's whole
    boot_timeout)."""


class EndpointError(CloudError):
    """The endpoint as configured cannot serve (its host name, its TLS certificate): nothing was sent, never
    retried; `problem` and `fix` apart for `check`, both in the message."""

    exit_code = EXIT_CONFIG

    def __init__(self, call: str, problem: str, fix: str) -> None:
        super().__init__(f"[{call}] {problem}: {fix}")
        self.problem = problem
        self.fix = fix


class EndpointUnresolved(EndpointError):
    """The resolver answered that the endpoint's host name has no address (a resolver that could not answer
    is a TransientCloudError)."""


class EndpointUntrusted(EndpointError):
    """The endpoint's TLS certificate failed verification: not trusted, issued for another host name, expired."""


class CloudAuthError(CloudError):
    """Authentication or authorization failed: never retried."""


class CredentialsRefused(CloudAuthError):
    """oned did not authenticate the session (AUTHENTICATION: a wrong password or token, a disabled or unknown
    user), whatever the call was about; the other CloudAuthErrors are rights the user lacks (AUTHORIZATION)."""


class QuotaExceeded(CloudError):
    """oned refused for a quota of the user or group (instantiate: AUTHORIZATION, resume: ACTION): like a
    shortage, not an authentication failure; never retried at once."""

    @property
    def quota(self) -> str:
        """Quota.cc's sentence without the call's prefix: "user [3] limit of 4 reached for VMS quota in VM"."""
        text = first_line(self)
        found = _QUOTA.search(text)
        return (found.group(0) if found else text).rstrip(".")


class VmNotFound(CloudError):
    """The VM or template does not exist."""


class ActionRefused(CloudError):
    """oned refused an action for the VM's current state."""


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """An error's first line (its class name when it has no text), at most limit characters."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if limit is None else text[:limit]
