"""The three power-saving programs slurmctld runs: slurm-nebula-resume, -suspend and -resume-fail.

This module parses the command line only; the run itself (cli/powerrun.py) is imported once the arguments
are good, so `--help` and `--version` stay as quick as a bare interpreter (slurmctld runs these often).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .args import make_parser, parse


def _power_program(prog: str, description: str, operation: str, argv: Sequence[str] | None,
                   environ: Mapping[str, str] | None) -> int:
    parser = make_parser(prog, description)
    parser.add_argument("hostlist", help="Slurm hostlist expression, e.g. gpu[01-04]")
    if operation == "resume":
        parser.add_argument("--force", action="store_true", help="resume cloud nodes slurmctld is not powering "
                            "up (by hand: their VMs are ones Slurm does not know of; prefer scontrol update "
                            "NodeName=... State=POWER_UP); never static nodes or nodes unknown to slurmctld")
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    from .powerrun import run  # the whole library: only past --help and --version

    return run(prog, operation, args, environ)


def resume_main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """ResumeProgram: create, resume or recreate the VMs of the given nodes."""
    return _power_program("slurm-nebula-resume", "Slurm ResumeProgram for OpenNebula: boot the VMs of "
                          "these nodes and tell slurmctld their addresses.", "resume", argv, environ)


def suspend_main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """SuspendProgram: power the nodes' VMs down with their node set's suspend_action."""
    return _power_program("slurm-nebula-suspend", "Slurm SuspendProgram for OpenNebula: power these "
                          "nodes' VMs down (terminate by default, which frees their GPUs).", "suspend",
                          argv, environ)


def resume_fail_main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """ResumeFailProgram: terminate the VMs of nodes that never came up."""
    return _power_program("slurm-nebula-resume-fail", "Slurm ResumeFailProgram for OpenNebula: terminate "
                          "the VMs of nodes that never registered, so no VM or GPU leaks.", "resume-fail",
                          argv, environ)
