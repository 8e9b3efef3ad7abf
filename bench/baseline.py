"""The one-after-another baseline: what a simple power-saving script does, node by node, through pyone.

    python bench/baseline.py resume|suspend ENDPOINT AUTH_FILE CLUSTER FIRST-LAST [scan]

For each node, one lookup (the node's VM by name) and one action (instantiate, or terminate), each
waiting for the previous: the way existing OpenStack power-saving scripts create and delete servers.
It neither waits for the VMs to run nor tells Slurm their addresses, so it does less than
slurm-nebula-resume does. power_bench.py starts it as a whole process, as it starts our programs.

`scan`: look the node up in the whole pool of the user's VMs instead of oned's NAME= filter, which is a
MySQL full-text search that a real oned on SQLite refuses (oned_bench.py passes it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyone


def main(argv: list[str]) -> int:
    """Run the baseline; exit 0 when every node was handled."""
    mode, endpoint, auth_file, cluster, span, *scan = argv
    first, last = (int(n) for n in span.split("-"))
    one = pyone.OneServer(endpoint, session=Path(auth_file).read_text().strip())

    def lookup(node: str) -> list:  # type: ignore[type-arg]
        if scan:
            return [vm for vm in one.vmpool.info(-3, -1, -1, -1).VM if vm.NAME == node]
        return list(one.vmpool.info(-3, -1, -1, -1, f"NAME={node}").VM)

    names = [f"gpu{i:05d}" for i in range(first, last + 1)]
    if mode == "resume":
        templates = one.templatepool.info(-2, -1, -1).VMTEMPLATE
        template = next(t.ID for t in templates if t.NAME == "slurm-gpu-worker")
        for node in names:
            if not lookup(node):
                one.template.instantiate(template, node, False,
                                         f'SLURM_CLUSTER = "{cluster}"\nSLURM_NODENAME = "{node}"', False)
    else:
        for node in names:
            for vm in lookup(node):
                one.vm.action("terminate", vm.ID)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
