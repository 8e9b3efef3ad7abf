"""Hostlist expansion: Slurm's syntax in, validated node names out, hostile input refused."""

from __future__ import annotations

import pytest

from slurm_nebula_power.errors import HostlistError
from slurm_nebula_power.hostlists import expand, fold, size


@pytest.mark.parametrize(("expression", "names"), [
    ("gpu[01-04]", ["gpu01", "gpu02", "gpu03", "gpu04"]),
    ("gpu[01-02,07],cpu12", ["gpu01", "gpu02", "gpu07", "cpu12"]),
    ("a1,a1,a2", ["a1", "a2"]),
    ("node-1.rack_2", ["node-1.rack_2"]),
])
def test_expands_slurm_hostlists(expression: str, names: list[str]) -> None:
    assert expand(expression) == names


BAD = {
    "unbalanced bracket": "gpu[01-04",
    "reversed range": "gpu[04-01]",
    "shell metacharacters": "gpu01;rm -rf /",
    "command substitution": "$(reboot)",
    "backticks": "`id`",
    "option-like": "--all",
    "leading dash": "-gpu01",
    "space": "gpu01 gpu02",
    "non-ASCII": "gpü01",
    "control character": "gpu\x0701",
    "million-node range": "gpu[1-1000000]",
    "empty": "",
    "blank": "   ",
    "only commas": ",,",
    "quote": "gpu'01",
}


@pytest.mark.parametrize("expression", BAD.values(), ids=BAD.keys())
def test_hostile_hostlists_are_refused_with_one_line(expression: str) -> None:
    with pytest.raises(HostlistError) as info:
        expand(expression)
    assert "\n" not in str(info.value)


def test_fold_is_the_inverse_for_logs_and_scontrol() -> None:
    assert fold(["gpu01", "gpu02", "gpu04"]) == "gpu[01-02,04]"
    assert expand(fold(expand("gpu[01-16],cpu[1-3]"))) == expand("cpu[1-3],gpu[01-16]")


def test_a_hostlist_is_bounded_before_it_is_expanded() -> None:
    # Twenty bracket groups are 2^20 names: python-hostlist would build them all (253 MB) before any count.
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(HostlistError, match="names 1048576 nodes; at most 65536"):
            expand("n" + "[1-2]" * 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes"
    assert size("gpu[01-04],cpu[1-2]x[1-3],login") == 11
