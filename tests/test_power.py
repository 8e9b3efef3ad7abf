"""resume with in-memory fakes: the fail-safe paths that a real cloud cannot be made to take on demand."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import make_setup

from slurm_nebula_power.config import load_config
from slurm_nebula_power.operation import Context
from slurm_nebula_power.resume import resume


class RecordingSlurm:
    def __init__(self) -> None:
        self.handed_back: list[tuple[list[str], str]] = []

    def set_addresses(self, addresses, instances=None) -> None:
        pass

    def hand_back(self, nodes, reason) -> None:
        self.handed_back.append((list(nodes), reason))


class BrokenCloud:
    """Templates resolve, then the pool query fails with a bug-like error (not a CloudError)."""

    def template_id(self, ref):
        return 0

    def template(self, template_id):
        return {"CONTEXT": {"NETWORK": "YES"}}

    def cluster_vms(self, cluster, first_id=-1):
        raise RuntimeError("unexpected answer")


def test_unexpected_error_still_hands_every_node_back(tmp_path: Path) -> None:
    setup = make_setup(tmp_path, "http://127.0.0.1:9/RPC2", "u:p")
    slurm = RecordingSlurm()
    ctx = Context(config=load_config(setup.config, setup.env), cloud=BrokenCloud(), slurm=slurm)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        resume(ctx, ["gpu01", "gpu02"], {})
    assert slurm.handed_back == [(["gpu01", "gpu02"], "internal error in resume, see nebula-power log")]
