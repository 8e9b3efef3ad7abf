"""`slurm-nebula-power template`: a node set's OpenNebula VM template, ready for `onetemplate create`."""

from __future__ import annotations

import argparse
import os
import stat
import sys
from collections.abc import Callable, Mapping, Sequence

from ..config import Config, NodeSet
from ..errors import EXIT_OK, UsageError
from ..slurmconf import gres_gpus, read_if_any
from ..template import gpus_of, named, pick_nodeset, render, resolve_names
from .common import interactive_cloud, make_parser, run_command


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """slurm-nebula-power template: print a node set's VM template."""
    env = os.environ if environ is None else environ
    prog = "slurm-nebula-power template"
    parser = make_parser(prog, "Print the OpenNebula VM template of a node set, ready for `onetemplate create`: "
                     "CPU, VCPU, MEMORY, the GPU by PCI passthrough, an optional InfiniBand SR-IOV NIC, the "
                     "NIC, the image, and CONTEXT with the controller, the munge key and the worker "
                     "bootstrap. Values come from the node set's options; a network or image given by name is "
                     "looked up in OpenNebula as the configured user sees it and written by id (numeric ids need no "
                     "OpenNebula).")
    parser.add_argument("--nodeset", metavar="NODES", help="the node set: its nodes expression or some of "
                        "its nodes (needed when there are several node sets)")
    parser.epilog = ("The output holds the munge key, a secret: redirect it to a file of mode 600. "
                     "exit: 0 printed, 2 no such node set, 3 configuration error (a network or image name the user "
                     "cannot use, or several of that name, included), 4 OpenNebula could not be asked")

    def work(args: argparse.Namespace, config: Config) -> Callable[[], int]:
        index, nodeset = pick_nodeset(config, args.nodeset)
        text = render(config, index, nodeset)  # every option checked before OpenNebula is asked anything
        refuse_readable_output()
        if named(config, index, nodeset):  # names, as the configured user sees them, written by id
            refs = resolve_names(config, index, nodeset, interactive_cloud(config))
            text = render(config, index, nodeset, refs=refs)
        warning = gpu_mismatch(config, index, nodeset)

        def show() -> int:
            if warning:
                print(f"{prog}: warning: {warning}", file=sys.stderr)
            sys.stdout.write(text)
            return EXIT_OK

        return show

    return run_command(prog, parser, argv, env, work)


def gpu_mismatch(config: Config, index: int, nodeset: NodeSet) -> str | None:
    """slurm.conf gives the node set's nodes GPUs (Gres=gpu) and the template gets none, or another count."""
    conf = read_if_any(config.slurm.slurm_conf)
    if conf is None:
        return None
    counts = {gres_gpus(conf.nodes[node].get("gres", "")) for node in nodeset.nodes if node in conf.nodes}
    gpus = gpus_of(nodeset)
    wrong = sorted(count for count in counts if count != gpus)
    if not wrong:
        return None
    none = " (no PCI line: its VMs get no GPU)" if not gpus else ""
    return (f"slurm.conf gives nodes of {nodeset.nodes_expr} Gres=gpu:{wrong[0]}, but nodeset[{index}] of "
            f"{config.path} gives the template {gpus} GPU(s){none}; set gpus = {wrong[0]} (and gpu_vendor, "
            "gpu_device) in the node set")


def refuse_readable_output() -> None:
    """The template holds the munge key: refuse to write it to a file that group or others can read (the
    usual `template > worker.tmpl` under umask 022 makes a 0644 file)."""
    try:
        info = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError):
        return
    if stat.S_ISREG(info.st_mode) and info.st_mode & 0o077:
        raise UsageError(f"standard output is a file of mode {stat.S_IMODE(info.st_mode):04o} that group or others "
                         "can read, and the template holds the munge key: run `umask 077` first, or chmod 600 "
                         "the file and run again")

