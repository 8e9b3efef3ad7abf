"""`slurm-nebula-power slurm-conf`: print the slurm.conf lines for the configured node sets (--gres-conf: the
gres.conf lines of their GPUs; --topology: topology.conf of their domains)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Mapping, Sequence

from ..config import Config
from ..errors import EXIT_OK, PowerError, UsageError
from ..gres import generate_gres
from ..shapes import generate, options_shape, read_shapes, topology_conf
from ..slurm import slurm_version
from .common import interactive_cloud, make_parser, run_command

PROG = "slurm-nebula-power slurm-conf"


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """slurm-nebula-power slurm-conf: print the slurm.conf lines for the configured node sets."""
    env = os.environ if environ is None else environ
    parser = make_parser(PROG, "Print the slurm.conf lines for the configured node "
                     "sets (NodeName from each template's VCPU, MEMORY and PCI GPUs), their partitions and "
                     "the power-saving parameters with this installation's program paths.")
    parser.epilog = ("A template OpenNebula cannot show is described from the node set's vcpu, memory_mb and "
                     "gpus options instead. exit: 0 printed, 3 configuration error, 4 a template could be "
                     "read neither from OpenNebula nor from the options")
    # Files of their own, as Slurm keeps them: `> gres.conf` works, and the slurm.conf lines stay one paste.
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--gres-conf", action="store_true", help="print the gres.conf lines instead: each GPU "
                       "node set's devices (File=/dev/nvidia...), for the gres.conf beside slurm.conf")
    which.add_argument("--topology", action="store_true", help="print topology.conf instead: each node set "
                       "domain's nodes as one Slurm block (23.11+) or switch (22.05), for the slurmctld's release")

    def work(args: argparse.Namespace, config: Config) -> Callable[[], int]:
        if args.topology:
            lines = topology_conf(config, slurm_version(config, env))
            if not lines:
                raise UsageError(f"no node set of {config.path} has a domain: there is no topology to write")
            def topology() -> int:
                print("\n".join(lines))
                return EXIT_OK

            return topology
        shapes, notes = [], []
        for nodeset, shape, error in read_shapes(config, interactive_cloud(config), unreachable_raises=True):
            if shape is None:
                shape = options_shape(nodeset)
                if shape is None:
                    raise PowerError(f"node set {nodeset.nodes_expr}: template {nodeset.template!r}: "
                                     f"{error}; fix the template, or give vcpu, memory_mb and gpus in the "
                                     "node set")
                notes.append(f"{nodeset.nodes_expr}: template unreadable ({error}): from the node set's "
                             "options")
            shapes.append((nodeset, shape))

        def show() -> int:
            if args.gres_conf:
                print("\n".join(generate_gres(config, shapes, notes)))
            else:
                print("\n".join(generate(config, shapes, slurm_version(config, env), notes)))
            return EXIT_OK

        return show

    return run_command(PROG, parser, argv, env, work, quiet_below=logging.WARNING)
