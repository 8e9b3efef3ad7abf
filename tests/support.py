"""Test helpers: a configuration pointing at the simulator, and a recording scontrol executable."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

FAKE_SCONTROL = """\
#!{python}
# Recording stand-in for scontrol (unit tests of argv shapes only; real Slurm is tested in test_e2e).
import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "scontrol.calls.jsonl"), "a") as out:
    out.write(json.dumps(sys.argv[1:]) + "\\n")
with open("/proc/self/status") as status, open(os.path.join(here, "scontrol.sigblk"), "w") as out:
    out.write([l.split()[1] for l in status if l.startswith("SigBlk:")][0])
if sys.argv[1:] == ["--version"]:
    print(open(os.path.join(here, "scontrol.version")).read().strip())
elif sys.argv[1:3] == ["show", "node"]:
    path = os.path.join(here, "scontrol.nodes")
    seq = path + ".seq"  # successive outputs, one per call; the last one repeats
    if os.path.exists(seq):
        outputs = json.load(open(seq))
        print(outputs[0], end="")
        if len(outputs) > 1:
            json.dump(outputs[1:], open(seq, "w"))
    elif os.path.exists(path):
        print(open(path).read(), end="")
    elif len(sys.argv) > 4:  # no state given: every node asked for is a cloud node slurmctld is powering up
        import re  # python-hostlist may be missing from the interpreter: a[01-03,05],b1 forms only
        for name, ranges in re.findall(r"([^,\\[]+)(?:\\[([^\\]]*)\\])?", sys.argv[4]):
            for part in (ranges.split(",") if ranges else [""]):
                low, _, high = part.partition("-")
                for i in (range(int(low), int(high or low) + 1) if part else [None]):
                    node = name if i is None else name + str(i).zfill(len(low))
                    print("NodeName=" + node + " Arch=x86_64 State=IDLE+CLOUD+POWERING_UP Reason=")
elif sys.argv[1:3] == ["show", "job"]:
    path = os.path.join(here, "scontrol.job")
    if os.path.exists(path):
        text = open(path).read()
        if text.startswith("error:"):
            print("slurm_load_jobs " + text, file=sys.stderr)
            sys.exit(1)
        print(text, end="")
if os.path.exists(os.path.join(here, "scontrol.unreachable")) and sys.argv[1:2] == ["update"]:  # slurmctld down
    print("slurm_update error: Unable to contact slurm controller (connect failure)", file=sys.stderr)
    sys.exit(1)
refuse = os.path.join(here, "scontrol.refuse")  # an argument holding this text is refused, like slurmctld
if os.path.exists(refuse) and any(open(refuse).read().strip() in arg for arg in sys.argv[1:]):
    print("slurm_update error: Invalid node name specified", file=sys.stderr)
    sys.exit(1)
rc_file = os.path.join(here, "scontrol.rc")
sys.exit(int(open(rc_file).read() or 0) if os.path.exists(rc_file) else 0)
"""


@dataclass
class Setup:
    """A test deployment: config file, auth file, fake scontrol, log and lock dirs."""

    root: Path
    config: Path
    log: Path
    scontrol_dir: Path
    password: str

    @property
    def env(self) -> dict[str, str]:
        """The environment slurmctld would give: SLURM_CONF only (plus our config location)."""
        return {"SLURM_CONF": str(self.root / "slurm.conf"), "SLURM_NEBULA_POWER_CONFIG": str(self.config)}

    def scontrol_calls(self) -> list[list[str]]:
        """Every argv the fake scontrol received."""
        path = self.scontrol_dir / "scontrol.calls.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    def updates(self) -> list[list[str]]:
        """Only the `scontrol update` calls."""
        return [c[1:] for c in self.scontrol_calls() if c and c[0] == "update"]

    def set_version(self, version: str) -> None:
        """What `scontrol --version` prints."""
        (self.scontrol_dir / "scontrol.version").write_text(version + "\n")

    def refuse(self, text: str) -> None:
        """scontrol fails every call with an argument holding text (as slurmctld refuses a bad update)."""
        (self.scontrol_dir / "scontrol.refuse").write_text(text)

    def set_nodes(self, text: str) -> None:
        """What `scontrol show node -o` prints."""
        (self.scontrol_dir / "scontrol.nodes").write_text(text)

    def set_node_sequence(self, outputs: list[str]) -> None:
        """What successive `scontrol show node -o` calls print, one each; the last repeats."""
        (self.scontrol_dir / "scontrol.nodes.seq").write_text(json.dumps(outputs))

    def set_job(self, text: str) -> None:
        """What `scontrol show job -o` prints; "error: ..." makes it fail with that message instead."""
        (self.scontrol_dir / "scontrol.job").write_text(text)

    @property
    def audit(self) -> Path:
        """The usage records file ([log] audit_file)."""
        return self.root / "audit.jsonl"

    @property
    def metrics(self) -> Path:
        """The metrics file ([log] metrics_file)."""
        return self.root / "nebula-power.prom"

    def records(self) -> list[dict]:
        """Every usage record so far, in file order."""
        if not self.audit.exists():
            return []
        return [json.loads(line) for line in self.audit.read_text().splitlines()]

    def log_text(self) -> str:
        """Everything our programs logged."""
        return self.log.read_text() if self.log.exists() else ""


def make_setup(root: Path, endpoint: str, auth: str, nodesets: str | None = None, extra: str = "") -> Setup:
    """Write a complete deployment for the simulator at endpoint."""
    root.mkdir(parents=True, exist_ok=True)
    sdir = root / "sbin"
    sdir.mkdir(exist_ok=True)
    scontrol = sdir / "scontrol"
    scontrol.write_text(FAKE_SCONTROL.format(python=sys.executable))
    scontrol.chmod(0o755)
    (sdir / "scontrol.version").write_text("slurm 22.05.8\n")
    auth_file = root / "one_auth"
    auth_file.write_text(auth + "\n")
    auth_file.chmod(stat.S_IRUSR | stat.S_IWUSR)
    (root / "slurm.conf").write_text("ClusterName=testcluster\n")
    if nodesets is None:
        nodesets = textwrap.dedent("""\
            [[nodeset]]
            nodes = "gpu[01-08]"
            template = "slurm-gpu-worker"
            boot_timeout = 20

            [[nodeset]]
            nodes = "cpu[01-04]"
            template = "slurm-cpu-worker"
            suspend_action = "poweroff"
            boot_timeout = 20
            """)
    config = root / "nebula-power.toml"
    config.write_text(textwrap.dedent(f"""\
        [opennebula]
        endpoint = "{endpoint}"
        auth_file = "one_auth"
        timeout = 5
        retry_seconds = 10
        retry_backoff = 0.2
        max_parallel = 8

        [slurm]
        scontrol = "{scontrol}"

        [log]
        file = "{root / 'nebula-power.log'}"
        level = "debug"
        audit_file = "{root / 'audit.jsonl'}"
        metrics_file = "{root / 'nebula-power.prom'}"

        [power]
        lock_dir = "{root / 'locks'}"
        suspend_timeout = 15
        poll_max = 0.5
        {extra}
        """) + "\n" + nodesets)
    return Setup(root=root, config=config, log=root / "nebula-power.log", scontrol_dir=sdir,
                 password=auth.split(":", 1)[1])


def run_env(setup: Setup) -> dict[str, str]:
    """Environment for running a program as a subprocess the way slurmctld does (no PATH)."""
    env = dict(setup.env)
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env

