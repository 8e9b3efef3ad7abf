"""Chaos: seeded random rounds of resume, suspend, resume-fail and reconcile over 32 nodes, with transient API
failures, random latency and boot failures; after every reconcile and at the end nothing leaks.

Run one seed by hand (prints the summary):
    CHAOS_SEED=7 CHAOS_ROUNDS=300 python -m pytest tests/test_reliability_chaos.py -q -s
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from reliability_support import DONE, TEARING_DOWN, SlurmModel, settle, site, violations
from simfixtures import AUTH, fast_config

from opennebula_sim import running_simulator
from opennebula_sim.config import Faults
from slurm_nebula_power.cli import reconcile
from slurm_nebula_power.cli.main import resume_fail_main, resume_main, suspend_main
from slurm_nebula_power.errors import EXIT_NODES_FAILED, EXIT_OK
from slurm_nebula_power.hostlists import fold
from slurm_nebula_power.records import read_records

SEED = int(os.environ.get("CHAOS_SEED", "20240607"))
ROUNDS = int(os.environ.get("CHAOS_ROUNDS", "300"))
NODES = [f"gpu{i:02d}" for i in range(1, 33)]
FAULTS = Faults(transient_rate=0.2, latency_ms=8, latency_jitter_ms=8, boot_failure_rate=0.1)
# Operation mix of one round (weights), and at most this many nodes per call.
MIX = {"resume": 4, "suspend": 3, "resume-fail": 1, "reconcile": 2}
MOST = 8
RECONCILE_TRIES = 5  # a reconcile that met exhausted retries runs again, as the timer would a minute later


@dataclass
class Figures:
    """What a chaos run prints."""

    seed: int
    rounds: int = 0
    ops: Counter[str] = field(default_factory=Counter)
    node_ops: int = 0
    schedule: str = ""
    exits: Counter[str] = field(default_factory=Counter)
    handed_back: int = 0
    reconcile_reruns: int = 0
    checks: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    retries: int = 0
    api_calls: int = 0
    vms_created: int = 0
    leaks: int = 0

    def line(self) -> str:
        """The summary line."""
        faults = sum(self.faults.values())
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        ops = ", ".join(f"{k} {v}" for k, v in sorted(self.ops.items()))
        return (f"chaos seed={self.seed}: rounds {self.rounds} ({ops}; {self.node_ops} node operations,"
                f" schedule {self.schedule}), faults injected {faults} ({kinds}),"
                f" retries {self.retries}, API calls {self.api_calls}, VMs created {self.vms_created},"
                f" hand-backs {self.handed_back}, reconcile re-runs {self.reconcile_reruns},"
                f" invariant checks {self.checks}, leaks: {self.leaks}")


def schedule(seed: int, rounds: int) -> list[tuple[str, list[str]]]:
    """The rounds, drawn from the seed alone (not from outcomes): the same seed, the same calls."""
    rng = random.Random(seed)
    ops = list(MIX)
    plan = []
    for _ in range(rounds):
        op = rng.choices(ops, weights=[MIX[o] for o in ops])[0]
        nodes = [] if op == "reconcile" else sorted(rng.sample(NODES, rng.randint(1, MOST)))
        plan.append((op, nodes))
    return plan


def run_chaos(tmp_path: Path, seed: int, rounds: int, capsys) -> Figures:
    """Play the rounds against a seeded simulator; fail at the first broken invariant."""
    figures = Figures(seed)
    plan = schedule(seed, rounds)
    figures.schedule = hashlib.sha256(repr(plan).encode()).hexdigest()[:12]
    with running_simulator(fast_config(hosts=10, gpus=4, seed=seed, faults=FAULTS), auth=AUTH) as sim:
        setup = site(tmp_path / "site", sim, nodes="gpu[01-32]", boot_timeout=4, template=0, timeout=2,
                     retry_seconds=4, retry_backoff=0.02, max_parallel=8, suspend_timeout=6, poll_max=0.2, level="info")
        model = SlurmModel(setup, NODES)
        env = setup.env

        def check(when: str) -> None:
            settle(sim)
            figures.checks += 1
            broken = violations(sim, model.up, model.down)
            assert not broken, f"seed {seed}, {when}: " + "; ".join(broken)

        def run_reconcile(when: str) -> None:
            for _ in range(RECONCILE_TRIES):
                model.publish()
                code = reconcile.main([], env)
                capsys.readouterr()
                model.absorb()
                if code == EXIT_OK:
                    break
                figures.reconcile_reruns += 1
            else:
                raise AssertionError(f"seed {seed}, {when}: reconcile failed {RECONCILE_TRIES} times")
            check(when)

        for number, (op, nodes) in enumerate(plan, 1):
            figures.rounds += 1
            figures.ops[op] += 1
            figures.node_ops += len(nodes)
            when = f"round {number} {op} {fold(nodes) if nodes else ''}"
            if op == "reconcile":
                run_reconcile(when)
                continue
            main = {"resume": resume_main, "suspend": suspend_main, "resume-fail": resume_fail_main}[op]
            if op == "resume":
                model.publish(powering_up=nodes)  # slurmctld powers them up before it runs resume
            code = main([fold(nodes)], env)
            capsys.readouterr()
            figures.exits[f"{op} {code}"] += 1
            assert code in (EXIT_OK, EXIT_NODES_FAILED), f"seed {seed}, {when}: exit {code}"
            if op == "resume":
                model.resumed(nodes)
            else:
                model.powered_down(nodes)
        run_reconcile("end")
        stats = sim.stats()
        figures.faults = dict(stats["faults_injected"])
        figures.api_calls = sum(stats["calls"].values())
        figures.vms_created = len(sim.vms())
        figures.handed_back = model.handed_back
        figures.leaks = len(violations(sim, model.up, model.down))
        check_audit(setup, sim)
    log = setup.log_text()
    figures.retries = len(re.findall(r" retrying ", log))
    summary_retries = sum(int(n) for n in re.findall(r"summary: .* (\d+) retries", log))
    assert summary_retries <= figures.retries, "every retry counted in a summary line was logged"
    return figures


def check_audit(setup, sim) -> None:
    """The usage records of every concurrent and failing run: valid JSONL, each line a whole record naming a
    VM the simulator has under that node's name; every VM recorded removed is DONE (or being torn down)."""
    lines = setup.audit.read_text().splitlines()
    records, bad = read_records(lines)
    assert bad == [] and len(records) == len(lines) > 0
    vms = {vm.id: vm for vm in sim.vms()}
    for record in records:
        if record.vm is not None:
            assert vms[record.vm].name == record.node, record
    for record in records:
        if record.event == "removed":
            vm = vms[record.vm]
            assert vm.state == DONE or vm.lcm_state in TEARING_DOWN, (record, vm.state_str)
    assert {r.event for r in records} >= {"created", "running", "removed", "failed", "handed_back"}


def test_chaos_rounds_leak_nothing(tmp_path, capsys) -> None:
    figures = run_chaos(tmp_path, SEED, ROUNDS, capsys)
    with capsys.disabled():
        print("\n" + figures.line())
    assert figures.leaks == 0
    assert figures.rounds == ROUNDS and figures.checks == figures.ops["reconcile"] + 1
    assert sum(figures.faults.values()) > 0 and figures.retries > 0, "the faults did happen"
    assert figures.exits["resume 1"] > 0, "some resumes met boot failures or exhausted retries"


def test_schedule_is_a_function_of_the_seed() -> None:
    assert schedule(SEED, ROUNDS) == schedule(SEED, ROUNDS)
    assert schedule(SEED, ROUNDS) != schedule(SEED + 1, ROUNDS)
