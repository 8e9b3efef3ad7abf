"""Resume and suspend of N nodes as whole processes, against the physical floor and a one-by-one baseline.

    python bench/power_bench.py [--nodes 1,10,100,1000] [--latency-ms 20] [--parallel 32] [--runs 5]

A benchmark, not a test: it prints figures (a Markdown table on stdout, a JSON file) and asserts nothing
about time. Everything runs on 127.0.0.1 against the bundled OpenNebula simulator, started as its own
process. See bench/README.md for how to read the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import xmlrpc.client
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent  # the installed entry points (not a pyenv/virtualenv shim)
AUTH = "oneadmin:bench-secret"
CLUSTER = "bench"
PER_HOST = 8  # GPU VMs per simulated host

# Started the way slurmctld starts ResumeProgram/SuspendProgram: signals blocked, fds 0-2 closed, an
# environment holding only SLURM_* variables.  The launcher forks the program itself and reads the child's
# rusage with wait4, so the figures are the program's alone (a fork from the big benchmark process would
# carry the benchmark's peak RSS into the child's ru_maxrss).
LAUNCHER = r"""
import json, os, signal, sys, time
argv, env = json.loads(sys.argv[1]), json.loads(sys.argv[2])
start = time.monotonic()
pid = os.fork()
if pid == 0:
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK,
                               {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP})
        for fd in (0, 1, 2):
            os.close(fd)
        os.execve(argv[0], argv, env)
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
wall = time.monotonic() - start
print(json.dumps({"rc": os.waitstatus_to_exitcode(status), "wall": wall,
                  "cpu": usage.ru_utime + usage.ru_stime, "user": usage.ru_utime, "sys": usage.ru_stime,
                  "rss_mb": usage.ru_maxrss / 1024}))
"""

FAKE_SCONTROL = """#!/bin/sh
# Stand-in for scontrol: accepts every update, as a healthy slurmctld does.
[ "$1" = "--version" ] && echo "slurm 23.02.7"
exit 0
"""


# ---- processes -------------------------------------------------------------------------------------


def launch(program: str, args: Sequence[str], env: dict[str, str]) -> dict[str, Any]:
    """Run one of our programs slurmctld-style; its exit code, wall seconds, CPU seconds and peak RSS."""
    return launch_argv([str(BIN / program), *args], env)


def launch_argv(argv: Sequence[str], env: dict[str, str]) -> dict[str, Any]:
    """Run argv slurmctld-style (see LAUNCHER) and return its figures."""
    out = subprocess.run([sys.executable, "-c", LAUNCHER, json.dumps(argv), json.dumps(env)],
                         capture_output=True, text=True, check=True, env={})
    return dict(json.loads(out.stdout))


class Simulator:
    """The simulator as a separate process (`python -m opennebula_sim`)."""

    def __init__(self, root: Path, nodes: int, latency_ms: float) -> None:
        root.mkdir(parents=True, exist_ok=True)
        config = root / "sim.toml"
        config.write_text(textwrap.dedent(f"""\
            [durations]
            prolog = 0
            boot = 0
            shutdown = 0
            epilog = 0

            [network]
            cidr = "127.64.0.0/10"

            [hosts]
            count = {max(1, math.ceil(nodes / PER_HOST))}
            gpus_per_host = {PER_HOST}
            """))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "opennebula_sim", "--listen", "127.0.0.1:0", "--auth", AUTH,
             "--config", str(config), "--latency-ms", str(latency_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        self.endpoint = _endpoint_line(self.proc)

    def stats(self) -> dict[str, Any]:
        """sim.stats (no session; not counted among the calls)."""
        with xmlrpc.client.ServerProxy(self.endpoint) as proxy:
            return dict(proxy.sim.stats())  # type: ignore[arg-type]

    def stop(self) -> None:
        """SIGTERM and wait."""
        self.proc.terminate()
        self.proc.wait(30)


@contextmanager
def simulator(root: Path, nodes: int, latency_ms: float) -> Iterator[Simulator]:
    """A fresh simulator with room for `nodes` GPU VMs."""
    sim = Simulator(root, nodes, latency_ms)
    try:
        yield sim
    finally:
        sim.stop()


@contextmanager
def pool_simulator(ours: int, others: int, latency_ms: float) -> Iterator[str]:
    """bench/poolsim.py: a simulator already holding `ours` tagged VMs and `others` of another user."""
    proc = subprocess.Popen([sys.executable, str(HERE / "poolsim.py"), "--ours", str(ours), "--others",
                             str(others), "--latency-ms", str(latency_ms)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        yield _endpoint_line(proc)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(60)


def _endpoint_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("http://127.0.0.1:"):
        proc.kill()
        raise SystemExit(f"the simulator did not start (printed {line!r})")
    return line


# ---- a site as slurmctld would see it --------------------------------------------------------------


def hostlist(count: int) -> str:
    """The hostlist expression slurmctld passes for the first `count` nodes."""
    return "gpu00001" if count == 1 else f"gpu[00001-{count:05d}]"


def write_site(root: Path, endpoint: str, parallel: int, max_nodes: int) -> dict[str, str]:
    """slurm.conf, nebula-power.toml beside it, credentials, a fake scontrol; returns the program env."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "slurm.conf").write_text(f"ClusterName={CLUSTER}\n")
    auth = root / "one_auth"
    auth.write_text(AUTH + "\n")
    auth.chmod(0o600)
    scontrol = root / "scontrol"
    scontrol.write_text(FAKE_SCONTROL)
    scontrol.chmod(0o755)
    (root / "nebula-power.toml").write_text(textwrap.dedent(f"""\
        [opennebula]
        endpoint = "{endpoint}"
        auth_file = "one_auth"
        max_parallel = {parallel}

        [slurm]
        scontrol = "{scontrol}"

        [log]
        file = "{root / 'nebula-power.log'}"
        level = "info"

        [power]
        lock_dir = "{root / 'locks'}"

        [[nodeset]]
        nodes = "{hostlist(max_nodes) if max_nodes > 1 else 'gpu00001'}"
        template = "slurm-gpu-worker"
        """))
    return {"SLURM_CONF": str(root / "slurm.conf")}


def resume_file(root: Path, count: int) -> str:
    """SLURM_RESUME_FILE as slurmctld 23.02 writes it: one job for all the nodes."""
    path = root / "resume.json"
    path.write_text(json.dumps({"all_nodes_resume": hostlist(count), "jobs": [
        {"job_id": 4242, "nodes_alloc": hostlist(count), "nodes_resume": hostlist(count), "partition": "gpu",
         "features": None, "extra": None, "reservation": None, "oversubscribe": "NO"}]}))
    return str(path)


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Calls per method made between two sim.stats."""
    return {m: after[m] - before.get(m, 0) for m in sorted(after) if after[m] != before.get(m, 0)}


# ---- what is measured ------------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall seconds of fn() and its result."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def our_pool_query(config_path: Path) -> Callable[[], int]:
    """The programs' own pool query (OneCloud.cluster_vms) against a site's endpoint; returns VMs read."""
    from slurm_nebula_power.cloud import OneCloud
    from slurm_nebula_power.config import load_config

    config = load_config(config_path, {"SLURM_CONF": str(config_path.parent / "slurm.conf")})
    cloud = OneCloud(config.opennebula)
    return lambda: len(cloud.cluster_vms(config.slurm.cluster))


def full_pool_query(config_path: Path) -> Callable[[], int]:
    """The whole pool, every user's VMs (filter flag -2), through the same transport and parser."""
    from slurm_nebula_power.cloud import OneCloud
    from slurm_nebula_power.config import load_config
    from slurm_nebula_power.model import vms_from_xml

    config = load_config(config_path, {"SLURM_CONF": str(config_path.parent / "slurm.conf")})
    cloud = OneCloud(config.opennebula)

    def query() -> int:
        body = cloud.call("vmpool.infoextended", lambda s: s.call("vmpool.infoextended", -2, -1, -1, -1))
        return len(vms_from_xml(str(body)))

    return query


def measure_startup(runs: int) -> dict[str, Any]:
    """`slurm-nebula-resume --version` and `--help`: start-up alone (no OpenNebula import)."""
    out: dict[str, Any] = {}
    for flag in ("--version", "--help"):
        samples = [launch("slurm-nebula-resume", [flag], {}) for _ in range(runs)]
        out[flag] = summarize(samples)
    return out


def measure_pool(latency_ms: float, runs: int) -> list[dict[str, Any]]:
    """The pool query with 1,000 and 10,000 VMs in the pool, ours and other users'."""
    rows = []
    for ours, others in ((1000, 0), (1000, 9000), (10000, 0)):
        with pool_simulator(ours, others, latency_ms) as endpoint, tempfile.TemporaryDirectory() as tmp:
            write_site(Path(tmp), endpoint, 32, 1)
            config = Path(tmp) / "nebula-power.toml"
            queries = {"ours (flag -3, as the programs query)": (-3, our_pool_query(config)),
                       "full pool (flag -2, every user)": (-2, full_pool_query(config))}
            for label, (flag, query) in queries.items():
                size = len(_raw_pool(endpoint, flag))  # also warms: the simulator caches each VM body
                samples = [timed(query) for _ in range(runs)]
                rows.append({"pool": ours + others, "ours": ours, "others": others, "query": label,
                             "vms_read": samples[0][1], "mb": size / 1e6,
                             "seconds": statistics.median(s for s, _ in samples),
                             "samples": [s for s, _ in samples]})
    return rows


def _raw_pool(endpoint: str, flag: int) -> str:
    """The pool document itself (to report its size)."""
    proxy = xmlrpc.client.ServerProxy(endpoint)
    answer: list[Any] = proxy.one.vmpool.infoextended(AUTH, flag, -1, -1, -1)  # type: ignore[assignment]
    assert answer[0], answer[1]
    return str(answer[1])


def measure_power(count: int, args: argparse.Namespace, work: Path, startup: float) -> dict[str, Any]:
    """Resume then suspend `count` nodes, `args.runs` times, each on a fresh simulator."""
    runs: dict[str, list[dict[str, Any]]] = {"resume": [], "suspend": []}
    pools: list[float] = []
    for run in range(args.runs):
        root = work / f"n{count}-run{run}"
        with simulator(root / "sim", count, args.latency_ms) as sim:
            env = write_site(root, sim.endpoint, args.parallel, count)
            query = our_pool_query(root / "nebula-power.toml")
            for program, name in (("resume", "slurm-nebula-resume"), ("suspend", "slurm-nebula-suspend")):
                pool_seconds, vms_read = timed(query)
                if program == "suspend":
                    pools.append(pool_seconds)  # the pool holds the N VMs resume made
                before = sim.stats()["calls"]
                extra = {"SLURM_RESUME_FILE": resume_file(root, count)} if program == "resume" else {}
                result = launch(name, [hostlist(count)], {**env, **extra})
                stats = sim.stats()
                result["calls"] = delta(before, stats["calls"])
                result["api_calls"] = sum(result["calls"].values())
                result["pool_query"] = pool_seconds
                result["pool_vms"] = vms_read
                vms = stats["vms"]
                result["ok"] = result["rc"] == 0 and (
                    vms.get("RUNNING", 0) == count if program == "resume" else set(vms) <= {"DONE"})
                runs[program].append(result)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    rounds = math.ceil(count / args.parallel)
    # The one pool query of the ideal reads the N VMs: suspend plans from it, and resume must read them
    # once to see them RUNNING (its planning query, on a pool without them, costs one more latency).
    pool = statistics.median(pools)
    out: dict[str, Any] = {"nodes": count, "rounds": rounds, "pool_query": pool}
    for program, samples in runs.items():
        row = summarize(samples)
        row["ideal"] = startup + pool + rounds * args.latency_ms / 1000
        row["ideal_parts"] = {"startup": startup, "pool_query": pool,
                              "rounds": rounds * args.latency_ms / 1000}
        row["ratio"] = row["wall"] / row["ideal"]
        row["api_calls_max"] = max(s["api_calls"] for s in samples)
        row["calls"] = max((s["calls"] for s in samples), key=lambda c: sum(c.values()))
        row["ok"] = all(s["ok"] for s in samples)
        out[program] = row
    return out


def measure_baseline(count: int, latency_ms: float, work: Path) -> dict[str, Any]:
    """The simplest way (bench/baseline.py): one node after another, one lookup and one action each."""
    root = work / f"baseline-n{count}"
    with simulator(root / "sim", count, latency_ms) as sim:
        write_site(root, sim.endpoint, 1, count)
        out: dict[str, Any] = {"nodes": count}
        for program in ("resume", "suspend"):
            before = sim.stats()["calls"]
            result = launch_argv([sys.executable, str(HERE / "baseline.py"), program, sim.endpoint,
                                  str(root / "one_auth"), CLUSTER, f"1-{count}"], {})
            result["calls"] = delta(before, sim.stats()["calls"])
            result["api_calls"] = sum(result["calls"].values())
            action = "one.template.instantiate" if program == "resume" else "one.vm.action"
            result["ok"] = result["rc"] == 0 and result["calls"].get(action) == count
            out[program] = result
    return out


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of wall, CPU and peak RSS, plus every sample."""
    return {"wall": statistics.median(s["wall"] for s in samples),
            "wall_min": min(s["wall"] for s in samples), "wall_max": max(s["wall"] for s in samples),
            "cpu": statistics.median(s["cpu"] for s in samples),
            "rss_mb": statistics.median(s["rss_mb"] for s in samples),
            "rc": sorted({s["rc"] for s in samples}), "samples": samples}


# ---- report ----------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """Where the figures were taken."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        mem_kb = 0
    from slurm_nebula_power import __version__

    return {"nproc": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "cpu_model": model,
            "load_before": [round(x, 2) for x in os.getloadavg()],
            "memory_gb": round(mem_kb / 1024 / 1024, 1), "python": platform.python_version(),
            "kernel": platform.release(), "slurm_nebula_power": __version__,
            "pyone": _dist_version("pyone"), "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _calls_text(calls: dict[str, int]) -> str:
    return ", ".join(f"{m.removeprefix('one.')} {n}" for m, n in calls.items())


def markdown(result: dict[str, Any]) -> str:
    """The figures as Markdown tables."""
    a = result["args"]
    m = result["machine"]
    lines = [f"# power_bench: latency {a['latency_ms']:g} ms, parallel {a['parallel']}, "
             f"median of {a['runs']} runs",
             "", f"{m['nproc']} CPUs ({m['cpu_model']}), {m['memory_gb']} GB, Python {m['python']}, "
             f"pyone {m['pyone']}, {m['date']}", "",
             "| program | nodes | wall s (min-max) | ideal s | wall/ideal | API calls (max) "
             "| calls by method | CPU s | peak RSS MB | baseline s | baseline/ours | ok |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for row in result["power"]:
        for program in ("resume", "suspend"):
            r = row[program]
            base = row.get("baseline", {}).get(program)
            lines.append(
                f"| {program} | {row['nodes']} | {r['wall']:.2f} ({r['wall_min']:.2f}-{r['wall_max']:.2f}) "
                f"| {r['ideal']:.2f} | {r['ratio']:.2f} | {r['api_calls_max']} | {_calls_text(r['calls'])} "
                f"| {r['cpu']:.2f} | {r['rss_mb']:.0f} | "
                + (f"{base['wall']:.2f} | {base['wall'] / r['wall']:.1f}x" if base else "- | -")
                + f" | {'yes' if r['ok'] else 'NO'} |")
    lines += ["", "ideal = start-up (`--version`) + one pool query of the N VMs (measured before suspend) + "
              "ceil(nodes / parallel) x latency; load average before/after: "
              f"{m['load_before']} / {m.get('load_after')}", "",
              "| start-up | wall s (min-max) | CPU s | peak RSS MB |", "| --- | ---: | ---: | ---: |"]
    for flag, r in result["startup"].items():
        lines.append(f"| slurm-nebula-resume {flag} | {r['wall']:.3f} "
                     f"({r['wall_min']:.3f}-{r['wall_max']:.3f}) | {r['cpu']:.3f} | {r['rss_mb']:.0f} |")
    if result["pool"]:
        lines += ["", "| pool (VMs) | ours | others' | query | VMs read | document MB | seconds |",
                  "| ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
        for p in result["pool"]:
            lines.append(f"| {p['pool']} | {p['ours']} | {p['others']} | {p['query']} | {p['vms_read']} "
                         f"| {p['mb']:.1f} | {p['seconds']:.3f} |")
    lines += ["", "| target (issue 6) | figure | met |", "| --- | --- | --- |"]
    lines += [f"| {what} | {figure} | {'yes' if met else 'NO'} |" for what, figure, met in targets(result)]
    return "\n".join(lines)


def targets(result: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """The issue's targets, checked on the largest node count measured (they are set for 1,000)."""
    out: list[tuple[str, str, bool]] = []
    if result["power"]:
        row = max(result["power"], key=lambda r: r["nodes"])
        n = row["nodes"]
        for program in ("resume", "suspend"):
            r = row[program]
            out.append((f"{program} {n}: within 1.5x of the ideal", f"{r['ratio']:.2f}x", r["ratio"] <= 1.5))
            out.append((f"{program} {n}: at most N + 10 API calls", str(r["api_calls_max"]),
                        r["api_calls_max"] <= n + 10))
            out.append((f"{program} {n}: peak RSS under 150 MB", f"{r['rss_mb']:.0f} MB", r["rss_mb"] < 150))
            base = row.get("baseline", {}).get(program)
            if base:
                speedup = base["wall"] / r["wall"]
                out.append((f"{program} {n}: 20x faster than one after another", f"{speedup:.0f}x",
                            speedup >= 20))
    for flag, r in result["startup"].items():
        out.append((f"{flag} under 0.3 s", f"{r['wall']:.3f} s", r["wall"] < 0.3))
    for p in result["pool"]:
        if p["pool"] == 10000 and p["others"] and p["query"].startswith("ours"):
            out.append(("pool of 10,000 VMs under 1 s (or a narrower query)",
                        f"{p['seconds']:.2f} s reading our {p['vms_read']} of {p['pool']}", p["seconds"] < 1))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run every measurement, print the Markdown table, write the JSON file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,10,100,1000", help="comma-separated node counts")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="simulator latency per API call")
    parser.add_argument("--parallel", type=int, default=32, help="max_parallel of the programs")
    parser.add_argument("--runs", type=int, default=5, help="runs per figure (the median is reported)")
    parser.add_argument("--baseline-max", type=int, default=1000,
                        help="run the one-by-one baseline only up to this many nodes (it is slow)")
    parser.add_argument("--no-pool", action="store_true", help="skip the 1,000/10,000-VM pool queries")
    parser.add_argument("--json", default=str(HERE / "power_bench.json"),
                        help="where to write the JSON figures (default: bench/power_bench.json)")
    parser.add_argument("--keep", action="store_true", help="keep each run's directory (with its log)")
    parser.add_argument("--workdir", help="directory for sites and simulator configs "
                        "(default: a new temporary one, removed at the end)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.nodes.split(",") if n.strip()]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="power_bench-"))
    started = time.monotonic()
    result: dict[str, Any] = {"args": vars(args), "machine": machine()}
    print("start-up ...", file=sys.stderr)
    result["startup"] = measure_startup(max(args.runs, 5))
    startup = result["startup"]["--version"]["wall"]
    result["power"] = []
    for count in counts:
        print(f"{count} nodes: resume + suspend x {args.runs} ...", file=sys.stderr)
        row = measure_power(count, args, work, startup)
        if count <= args.baseline_max:
            print(f"{count} nodes: one-by-one baseline ...", file=sys.stderr)
            row["baseline"] = measure_baseline(count, args.latency_ms, work)
        result["power"].append(row)
    result["pool"] = []
    if not args.no_pool:
        print("pool queries (1,000 and 10,000 VMs) ...", file=sys.stderr)
        result["pool"] = measure_pool(args.latency_ms, min(args.runs, 3))
    result["bench_seconds"] = time.monotonic() - started
    result["machine"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    print(f"\n(benchmark took {result['bench_seconds']:.0f} s; JSON in {args.json})")
    if not args.keep and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    failed = [f"{program} {row['nodes']}" for row in result["power"] for program in ("resume", "suspend")
              if not row[program]["ok"] or not row.get("baseline", {}).get(program, {"ok": True})["ok"]]
    if failed:
        print(f"runs that did not do their work (figures meaningless): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
