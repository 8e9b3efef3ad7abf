"""`python -m opennebula_sim`: the simulator command until the main CLI wires it."""

import sys

from opennebula_sim.cli import main

sys.exit(main())
