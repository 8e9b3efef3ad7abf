"""An OpenNebula simulator: oned's XML-RPC API over real HTTP, for tests, benchmarks and the demo.

    with running_simulator(SimConfig(), auth="oneadmin:secret") as sim:
        server = pyone.OneServer(sim.endpoint, session=sim.auth)
"""

from opennebula_sim.config import (
    Durations,
    Faults,
    HostSpec,
    ImageSpec,
    NetworkSpec,
    PciDevice,
    SimConfig,
    TemplateSpec,
    default_hosts,
    default_images,
    default_templates,
    load_sim_config,
)
from opennebula_sim.handle import HostSnapshot, Simulator, VmSnapshot, running_simulator

__all__ = [
    "Durations",
    "Faults",
    "HostSnapshot",
    "HostSpec",
    "ImageSpec",
    "NetworkSpec",
    "PciDevice",
    "SimConfig",
    "Simulator",
    "TemplateSpec",
    "VmSnapshot",
    "default_hosts",
    "default_images",
    "default_templates",
    "load_sim_config",
    "running_simulator",
]
