"""The one back-off of every poll loop: intervals that grow by a factor up to a cap."""

from __future__ import annotations

from dataclasses import dataclass, field

GROWTH = 1.5  # gentle: a VM, a lock or a node that is close to ready is looked at again soon


@dataclass
class Backoff:
    """first, first x growth, ... up to cap; reset() starts over (after progress, say)."""

    first: float
    cap: float
    growth: float = GROWTH
    current: float = field(init=False)

    def __post_init__(self) -> None:
        self.current = self.first

    def next(self) -> float:
        """The interval to wait now; the following one grows."""
        value = self.current
        self.current = min(self.current * self.growth, self.cap)
        return value

    def reset(self) -> None:
        """Start again from first."""
        self.current = self.first
