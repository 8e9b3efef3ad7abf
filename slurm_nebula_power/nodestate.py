"""A node as `scontrol show node -o` reports it, interpreted once (slurm.py reads it, everyone asks it)."""

from __future__ import annotations

from dataclasses import dataclass

# Base states of a node that serves jobs (scontrol's State= before the first '+').
UP_STATES = ("IDLE", "ALLOCATED", "MIXED", "COMPLETING")
# Where a node is in Slurm's power cycle.
OFF, STOPPING, STARTING, UP, OTHER = "off", "stopping", "starting", "up", "other"


@dataclass(frozen=True)
class NodeState:
    """A node as `scontrol show node -o` reports it, interpreted once: every caller uses these predicates."""

    name: str
    state: str  # e.g. IDLE+CLOUD+POWERED_DOWN, DOWN*+CLOUD (the * marks a node not responding)
    reason: str = ""
    addr: str = ""

    @property
    def base(self) -> str:
        """The base state without the suffix scontrol/sinfo append (DOWN* -> DOWN, IDLE~ -> IDLE)."""
        return self.state.split("+", 1)[0].rstrip("*~#%!$@^-").upper()

    @property
    def flags(self) -> set[str]:
        """The state's words: base state and flags."""
        return set(self.state.upper().replace("*", "").split("+"))

    @property
    def is_powering_up(self) -> bool:
        """Its power-up (resume) is in progress."""
        return "POWERING_UP" in self.flags

    @property
    def is_powered_down(self) -> bool:
        """Powered down: no VM should run for it."""
        return "POWERED_DOWN" in self.flags

    @property
    def is_powering_down(self) -> bool:
        """On its way down, or a power-down is queued for it."""
        return bool(self.flags & {"POWERING_DOWN", "POWER_DOWN"})

    @property
    def is_down(self) -> bool:
        """DOWN (not responding or not, DOWN* included)."""
        return self.base == "DOWN"

    @property
    def is_drained(self) -> bool:
        """DRAIN among its flags."""
        return "DRAIN" in self.flags

    @property
    def is_up(self) -> bool:
        """Serving jobs: IDLE, ALLOCATED, MIXED or COMPLETING, with no power transition under way."""
        return self.phase == UP

    @property
    def phase(self) -> str:
        """OFF | STOPPING | STARTING | UP | OTHER (DOWN, FUTURE, ...)."""
        if self.is_powering_up:
            return STARTING
        if self.is_powered_down:
            return OFF
        if self.is_powering_down:
            return STOPPING
        return UP if self.base in UP_STATES else OTHER

    @property
    def is_lost_to_job(self) -> bool:
        """It can no longer serve the job it was resumed for: DOWN (ResumeTimeout, or a DOWN set by hand),
        DRAIN or FAIL (slurmctld requeues the job), powering down, or IDLE with a power-down flag (the
        POWER_DOWN_FORCE hand-back: no longer allocated to the job).
        Not the Reason: a node handed back earlier keeps its "nebula: ..." reason until it registers again."""
        flags, base = self.flags, self.base
        if base in ("DOWN", "FAIL") or flags & {"DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING"}:
            return True
        return "POWERING_DOWN" in flags or (base == "IDLE" and bool(flags & {"POWER_DOWN", "POWERED_DOWN"}))

    @property
    def is_registering(self) -> bool:
        """Still on its way to serving a job: powering up, powered down, not responding, UNKNOWN or FUTURE."""
        return bool(self.flags & {"POWERING_UP", "POWER_UP", "POWERED_DOWN", "NOT_RESPONDING"}) or \
            self.base in ("UNKNOWN", "FUTURE")
