"""`python -m slurm_nebula_power.simulator`: the simulator command until the main CLI wires it."""

import sys

from slurm_nebula_power.simulator.cli import main

sys.exit(main())
