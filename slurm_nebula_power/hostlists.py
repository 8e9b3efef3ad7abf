"""Hostlist expansion and folding (python-hostlist), with strict node-name validation."""

from __future__ import annotations

import re
from collections.abc import Iterable

import hostlist

from .errors import HostlistError

# Slurm node names as we accept them: no shell metacharacters, no leading dash (option-like),
# ASCII only.  Checked on every expanded name, so a hostile expression never reaches scontrol.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
MAX_NAME_LENGTH = 64
# One expression may name at most this many nodes (python-hostlist refuses larger ranges itself
# before expanding them, so a "million-node range" costs nothing).
MAX_NODES = 65536


def expand(expression: str) -> list[str]:
    """Expand a Slurm hostlist expression into validated node names, in order, without duplicates."""
    text = expression.strip()
    if not text:
        raise HostlistError("empty hostlist: give node names such as gpu[01-04]")
    if not text.isascii() or not text.isprintable():
        raise HostlistError(f"hostlist {expression!r} has non-ASCII or control characters: use plain node names")
    count = size(text)
    if count > MAX_NODES:  # before expanding: twenty bracket groups in one name are 2^20 names and 253 MB
        raise HostlistError(f"hostlist {expression!r} names {count} nodes; at most {MAX_NODES} per call")
    try:
        names: list[str] = hostlist.expand_hostlist(text)
    except hostlist.BadHostlist as exc:
        raise HostlistError(f"malformed hostlist {expression!r}: {exc}") from None
    if not names:
        raise HostlistError(f"hostlist {expression!r} names no node")
    if len(names) > MAX_NODES:
        raise HostlistError(f"hostlist {expression!r} names {len(names)} nodes; at most {MAX_NODES} per call")
    for name in names:
        validate_name(name, expression)
    return names


_RANGE = re.compile(r"(\d+)(?:-(\d+))?\Z")


def split_top_level(expression: str) -> list[str]:
    """The comma-separated items of a list whose items may be hostlists (commas inside brackets stay), as
    written: unstripped, empty ones kept."""
    depth, start = 0, 0
    items = []
    for index, char in enumerate(expression):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            items.append(expression[start:index])
            start = index + 1
    items.append(expression[start:])
    return items


def size(expression: str) -> int:
    """How many names an expression stands for, counted without expanding it (duplicates counted; 0 for
    what python-hostlist will refuse as malformed anyway)."""
    total = 0
    for item in split_top_level(expression):
        product = 1
        for group in re.findall(r"\[([^\[\]]*)\]", item):
            count = 0
            for part in group.split(","):
                match = _RANGE.match(part.strip())
                if not match:
                    return 0
                low, high = int(match.group(1)), int(match.group(2) or match.group(1))
                count += max(0, high - low + 1)
            product *= count
        total += product
    return total


def expand_trusted(expression: str) -> list[str]:
    """Expand a hostlist Slurm itself made (SLURM_JOB_NODELIST): names are not validated, since only the
    ones found in a node set (validated at load) are used; HostlistError when malformed."""
    try:
        names: list[str] = hostlist.expand_hostlist(expression.strip())
    except hostlist.BadHostlist as exc:
        raise HostlistError(f"malformed hostlist {expression!r}: {exc}") from None
    return names


def validate_name(name: str, expression: str | None = None) -> str:
    """Return name if it is an acceptable Slurm node name, else raise HostlistError."""
    where = f" in hostlist {expression!r}" if expression is not None and expression != name else ""
    if len(name) > MAX_NAME_LENGTH or not NODE_NAME.match(name):
        raise HostlistError(
            f"invalid node name {name!r}{where}: names are letters, digits, '.', '_' and '-', "
            f"start with a letter or digit, at most {MAX_NAME_LENGTH} characters"
        )
    return name


def fold(names: Iterable[str]) -> str:
    """Fold node names back into a compact hostlist expression (for logs and scontrol)."""
    collected: str = hostlist.collect_hostlist(list(names))
    return collected
