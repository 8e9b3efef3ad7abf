"""`slurm-nebula-power slurm-conf`: print the slurm.conf lines for the configured node sets (--gres-conf: the
gres.conf lines of their GPUs; --topology: topology.conf of their domains)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Mapping, Sequence

from ..config import Config
from ..errors import EXIT_CONFIG, EXIT_OK, ConfigError, UsageError
from ..gres import generate_gres
from ..hostlists import fold
from ..shapes import generate, options_shape, read_shapes, topology_conf
from ..slurm import slurm_version
from ..slurmchecks import static_nodes
from ..slurmconf import read_slurm_conf
from ..templateuse import missing_template_fix
from .common import interactive_cloud, make_parser, report_error, run_command

PROG = "slurm-nebula-power slurm-conf"


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """slurm-nebula-power slurm-conf: print the slurm.conf lines for the configured node sets."""
    env = os.environ if environ is None else environ
    parser = make_parser(PROG, "Print the slurm.conf lines for the configured node "
                     "sets (NodeName from each template's VCPU, MEMORY and PCI GPUs), their partitions and "
                     "the power-saving parameters with this installation's program paths.")
    parser.epilog = ("A template the configured user cannot read in OpenNebula is an error (resume could not "
                     "instantiate it): its node set is described from its vcpu, memory_mb and gpus options if "
                     "given, and the command says what to fix. exit: 0 printed, 3 configuration error (a node "
                     "set's template the user cannot read included), 4 OpenNebula could not be asked")
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
        _refuse_static(config)
        shapes, notes, unusable = [], [], []
        for nodeset, shape, error in read_shapes(config, interactive_cloud(config), unreachable_raises=True):
            if shape is None:
                # resume cannot instantiate a template the user cannot read: never a quiet exit 0 (issue 32)
                problem = f"node set {nodeset.nodes_expr}: template {nodeset.template!r}: {error}"
                unusable.append(f"{problem}; {missing_template_fix(config, nodeset)}")
                shape = options_shape(nodeset)
                if shape is None:
                    raise ConfigError(problem, missing_template_fix(config, nodeset) + " (slurm-conf can describe "
                                      "it from vcpu, memory_mb and gpus in the node set meanwhile)")
                notes.append(f"{nodeset.nodes_expr}: template unreadable ({error}): from the node set's "
                             "options")
            shapes.append((nodeset, shape))

        def show() -> int:
            if args.gres_conf:
                print("\n".join(generate_gres(config, shapes, notes)))
            else:
                print("\n".join(generate(config, shapes, slurm_version(config, env), notes)))
            for line in unusable:
                report_error(PROG, line, quiet=True)
            return EXIT_CONFIG if unusable else EXIT_OK

        return show

    return run_command(PROG, parser, argv, env, work, quiet_below=logging.WARNING)


def _refuse_static(config: Config) -> None:
    """A node set whose hostlist holds nodes slurm.conf declares static: never printed as cloud nodes (that
    paste would turn production nodes into cloud nodes); the node set is to be fixed first."""
    path = config.slurm.slurm_conf
    if path is None or not path.exists():
        return
    try:
        overlaps = static_nodes(config, read_slurm_conf(path))
    except ConfigError:
        return  # check says why slurm.conf cannot be read; the lines to paste do not depend on it

    if overlaps:
        which = "; ".join(f"node set {expr}: {fold(nodes)}" for expr, nodes in overlaps.items())
        raise ConfigError(f"{config.path}: {which} are static nodes in {path} (no State=CLOUD); take them out of "
                          "the node set's nodes (slurm-conf never prints a static node as a cloud node)")
