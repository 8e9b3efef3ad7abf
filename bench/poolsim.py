"""A simulator holding a big VM pool (ours and other users'), for power_bench.py's pool-query figures.

    python bench/poolsim.py --ours 1000 --others 9000 --latency-ms 20

prints its endpoint on one line once the pool is filled and serves until stdin closes. The VMs are
injected with the handle's add_vm (no API calls), ours tagged as resume would tag them, others owned
by another user (uid 5) and untagged. Separate process: the simulator must not share the
benchmark's interpreter lock.
"""

from __future__ import annotations

import argparse
import math
import sys

from opennebula_sim import Durations, NetworkSpec, SimConfig, running_simulator
from opennebula_sim.config import default_hosts

AUTH = "oneadmin:bench-secret"
CLUSTER = "bench"
PER_HOST = 8  # GPU VMs per default host (8 GPUs; 64 cores and 512 GiB hold eight 8-core 64-GiB VMs)


def main() -> int:
    """Fill the pool, print the endpoint, serve until stdin closes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", type=int, default=1000)
    parser.add_argument("--others", type=int, default=0)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    args = parser.parse_args()
    total = args.ours + args.others
    hosts = default_hosts(max(1, math.ceil(total / PER_HOST)), gpus=PER_HOST)
    cfg = SimConfig(hosts=hosts, durations=Durations(0, 0, 0, 0), network=NetworkSpec(cidr="127.64.0.0/10"))
    with running_simulator(cfg, auth=AUTH) as sim:
        for index in range(total):
            host = hosts[index // PER_HOST].name
            if index < args.ours:
                node = f"gpu{index + 1:05d}"
                sim.add_vm(name=node, user_template={"SLURM_CLUSTER": CLUSTER, "SLURM_NODENAME": node,
                                                     "SLURM_NEBULA_POWER": "0.1.0"}, host=host)
            else:
                sim.add_vm(name=f"user5-vm-{index}", user_template={"LABELS": "other"}, uid=5, host=host)
        sim.set_faults(latency_ms=args.latency_ms)
        print(sim.endpoint, flush=True)
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
