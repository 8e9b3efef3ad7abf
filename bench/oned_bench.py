"""Resume and suspend against a real oned (tests/oned), beside the simplest clients of the same oned.

    python bench/oned_bench.py [--version 7.4.0] [--hosts 10] [--gpus 100]
        [--clients accept:100,window:30:300,wave:30:300,direct:100,...] [--resume 100:32:30[:direct],...]
        [--baseline 100]
    python bench/oned_bench.py --suite placement [--sizes 1,100,1000] [--version 7.4.0]

A benchmark, not a test: it prints figures (Markdown on stdout, every sample in a JSON file) and asserts
nothing about time.  It starts its own oned with tests/oned/start.sh (everything on 127.0.0.1, the
network's addresses in 127.3.0.0/16, records only) and stops it with stop.sh, also after a stall, when it
starts a fresh one for the next run.  See bench/README.md, "Real oned".

--clients items (plain xmlrpc.client, 32 threads, bench/onedpace.py):
  accept:N          N instantiates at once, until the last one answered (oned's accept rate)
  burst:N           N at once, watched until all RUNNING (or stalled)
  wave:W:N          waves of W, the next once the last wave's VMs all left PENDING
  window:W:N        at most W VMs PENDING (or being instantiated) at any time
  direct:N[:tagged] the floor of direct placement: N instantiate-on-hold + deploy pairs, 12 threads (resume's
                    max_parallel), each VM to the next free GPU of one host pool read; `tagged`: each
                    instantiate with the extra template resume sends (the same VMs as resume makes)
  resume:N:P:W[:direct]  a --resume item run here, between the clients (the same oned, minutes apart)
--resume items: N:MAX_PARALLEL:MAX_PENDING[:direct], the installed slurm-nebula-resume then
slurm-nebula-suspend of N nodes, started as slurmctld starts them (bench/power_bench.py's launcher), the node
set's placement "scheduler" or "direct"; a poller beside it times the first and the last VM RUNNING.
--suite placement: for each of --sizes, on 20 hosts x 60 GPUs unless --hosts/--gpus say otherwise:
direct:N, direct:N:tagged, resume:N:12:30:direct, wave:20:N, resume:N:12:30 (issue 24's comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import onedpace  # noqa: E402  (bench/ is not a package)
import power_bench  # noqa: E402

ONED = HERE.parent / "tests" / "oned"
NET_IP, NET_SIZE = "127.3.0.1", "4000"
MAX_PARALLEL = 12  # resume's default: the floor client sends its pairs with the same parallelism
BASH = shutil.which("bash") or "/bin/bash"


class Oned:
    """One instance of tests/oned under a private directory."""

    def __init__(self, work: Path, version: str, hosts: int, gpus: int) -> None:
        self.version, self.hosts, self.gpus = version, hosts, gpus
        self.dir = work / f"oned-{version}"
        self.endpoint = self.auth = ""

    def start(self) -> None:
        """start.sh; raise SystemExit when it fails."""
        self.stop()
        env = {**os.environ, "ONE_VERSION": self.version, "ONED_HOSTS": str(self.hosts),
               "ONED_GPUS": str(self.gpus), "ONED_NET_IP": NET_IP, "ONED_NET_SIZE": NET_SIZE,
               "ONED_DS_INTERVAL": "4", "ONED_START_TIMEOUT": "300",
               # one Ruby probe per host per period: stock 5 s (STATE_VM) on 30 hosts took most of 2 cores
               # and failed host monitoring at start-up; placement does not depend on them (dummy driver)
               "ONED_STATE_VM_PERIOD": "60", "ONED_MONITOR_VM_PERIOD": "300"}
        self.dir.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([BASH, str(ONED / "start.sh"), str(self.dir)], env=env, capture_output=True,
                              text=True, timeout=600)
        (self.dir.parent / f"start-{self.version}.err").write_text(done.stderr)
        if done.returncode:
            self.stop()
            said = [line for line in done.stderr.splitlines() if line.startswith(("start.sh", "onedctl"))]
            raise SystemExit(f"oned {self.version} did not start: {' / '.join(said)[-800:]}")
        values = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
        self.endpoint, self.auth = values["ENDPOINT"], values["ADMIN_AUTH"]  # the bench measures oned, as oneadmin
        if not self.endpoint.startswith("http://127."):
            self.stop()
            raise SystemExit(f"oned endpoint {self.endpoint} is not a loopback one")

    def stop(self) -> None:
        """stop.sh (idempotent)."""
        if self.dir.exists():
            subprocess.run([BASH, str(ONED / "stop.sh"), str(self.dir)], capture_output=True, timeout=180)

    def client(self) -> onedpace.Client:
        return onedpace.Client(self.endpoint, self.auth)


def run_client(oned: Oned, item: str) -> dict[str, Any]:
    """One --clients item on a clean oned (restarted first if the last run stalled)."""
    kind, *numbers = item.split(":")
    client = oned.client()
    tid = client.template_id("slurm-gpu-worker")
    prefix = "pace-"
    client.clean(prefix)
    load, cpu = [round(x, 2) for x in os.getloadavg()], time.process_time()
    if kind == "accept":
        nodes = int(numbers[0])
        seconds = onedpace.accept_rate(client, tid, nodes, 32, prefix)
        out: dict[str, Any] = {"item": item, "nodes": nodes, "accepted": seconds, "per_second": nodes / seconds}
    elif kind == "direct":
        extra = tagged(client, tid) if numbers[1:] == ["tagged"] else ""
        out = {"item": item, **vars(onedpace.direct(client, tid, int(numbers[0]), prefix, MAX_PARALLEL, extra=extra))}
    else:
        width, nodes = (0, int(numbers[0])) if kind == "burst" else (int(numbers[0]), int(numbers[1]))
        run = onedpace.paced(client, tid, nodes, kind, width, prefix)
        out = {"item": item, **vars(run)}
    out["cpu"] = time.process_time() - cpu
    out["load"] = (load, [round(x, 2) for x in os.getloadavg()])
    try:
        client.clean(prefix)
        out["clean"] = "ok"
    except (RuntimeError, OSError) as exc:
        out["clean"] = str(exc)
    return out


def tagged(client: onedpace.Client, tid: int) -> str:
    """The extra template resume sends with each instantiate (its tags and the template's CONTEXT with them),
    so that the floor makes the same VMs."""
    from slurm_nebula_power.plan import extra_template

    found = ET.fromstring(client.call("template.info", tid, False, False)).find("TEMPLATE/CONTEXT")
    context = {item.tag: item.text or "" for item in (found if found is not None else ())}
    return extra_template(power_bench.CLUSTER, "gpu00001", [1], context)


def write_site(root: Path, oned: Oned, nodes: int, parallel: int, max_pending: int,
               placement: str = "scheduler") -> dict[str, str]:
    """power_bench's site, pointed at the real oned (its credentials, 127.3.x addresses)."""
    env = power_bench.write_site(root, oned.endpoint, parallel, nodes)
    (root / "one_auth").write_text(oned.auth + "\n")
    conf = root / "nebula-power.toml"
    text = conf.read_text().replace(f"max_parallel = {parallel}\n",
                                    f"max_parallel = {parallel}\nmax_pending = {max_pending}\n")
    conf.write_text(text + textwrap.dedent(f"""\
        boot_timeout = 900
        placement = "{placement}"
        """))
    return env


class Watch(threading.Thread):
    """Polls the pool (one.vmpool.info, as often as onedpace.pause says) while a program runs: when the first
    and the last of its `nodes` VMs were RUNNING, in seconds from `start`."""

    def __init__(self, client: onedpace.Client, nodes: int, start: float) -> None:
        super().__init__(daemon=True)
        self.client, self.nodes, self.start_time = client, nodes, start
        self.first: float | None = None
        self.last: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and self.last is None:
            try:
                states = self.client.states("gpu")
            except (RuntimeError, OSError):
                states = {}
            now = time.monotonic() - self.start_time
            running = sum(1 for s in states.values() if s[0] == onedpace.ACTIVE and s[1] == onedpace.RUNNING_LCM)
            if running and self.first is None:
                self.first = now
            if running >= self.nodes:
                self.last = now
            self.stop.wait(onedpace.pause(now, self.first is not None))


def api_calls(log: Path) -> int | None:
    """The API calls of the last run, from its summary line (`..., 1004 API calls, 0 retries`)."""
    found = re.findall(r"summary: .*, (\d+) API calls, \d+ retries", log.read_text() if log.exists() else "")
    return int(found[-1]) if found else None


def run_resume(oned: Oned, item: str, work: Path) -> dict[str, Any]:
    """One --resume item: resume then suspend N nodes with the installed programs."""
    nodes, parallel, max_pending, *rest = item.split(":")
    placement = rest[0] if rest else "scheduler"
    root = work / f"site-{item.replace(':', '-')}"
    shutil.rmtree(root, ignore_errors=True)
    env = write_site(root, oned, int(nodes), int(parallel), int(max_pending), placement)
    client = oned.client()
    out: dict[str, Any] = {"item": item, "nodes": int(nodes), "max_parallel": int(parallel),
                           "max_pending": int(max_pending), "placement": placement}
    for program, name in (("resume", "slurm-nebula-resume"), ("suspend", "slurm-nebula-suspend")):
        extra = {"SLURM_RESUME_FILE": power_bench.resume_file(root, int(nodes))} if program == "resume" else {}
        load = [round(x, 2) for x in os.getloadavg()]
        watch = Watch(oned.client(), int(nodes), time.monotonic())
        if program == "resume":
            watch.start()
        result = power_bench.launch(name, [power_bench.hostlist(int(nodes))], {**env, **extra})
        watch.stop.set()
        states = client.states("gpu")
        running = sum(1 for s in states.values() if s[0] == onedpace.ACTIVE and s[1] == onedpace.RUNNING_LCM)
        result["ok"] = result["rc"] == 0 and (running == int(nodes) if program == "resume" else not states)
        if program == "resume" and watch.last is None and running == int(nodes):
            watch.last = result["wall"]  # all RUNNING between the watcher's last read and resume's exit: at most this
        result.update(first_running=watch.first, all_running=watch.last, calls=api_calls(root / "nebula-power.log"),
                      load=(load, [round(x, 2) for x in os.getloadavg()]))
        out[program] = result
    client.clean("gpu")
    return out


def run_baseline(oned: Oned, nodes: int, work: Path) -> dict[str, Any]:
    """bench/baseline.py (one node after another, plain pyone) against the real oned; resume's figure
    includes the wait until every VM is RUNNING (the baseline itself does not wait)."""
    root = work / f"baseline-{nodes}"
    shutil.rmtree(root, ignore_errors=True)
    write_site(root, oned, nodes, 1, 1)
    client = oned.client()
    out: dict[str, Any] = {"nodes": nodes}
    for program in ("resume", "suspend"):
        start = time.monotonic()
        out[program] = power_bench.launch_argv(
            [sys.executable, str(HERE / "baseline.py"), program, oned.endpoint, str(root / "one_auth"),
             power_bench.CLUSTER, f"1-{nodes}", "scan"], {})
        while time.monotonic() - start < 1800:
            states = client.states("gpu")
            running = sum(1 for s in states.values() if s[0] == onedpace.ACTIVE and s[1] == onedpace.RUNNING_LCM)
            if (program == "suspend" and not states) or (program == "resume" and running == nodes):
                break
            time.sleep(0.25)
        out[program]["until_done"] = time.monotonic() - start
    client.clean("gpu")
    return out


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}"


def _load(load: Any) -> str:
    """The 1-minute load average before and after one figure."""
    return f"{load[0][0]} / {load[1][0]}" if load and load[0] and load[1] else "-"


def suite(sizes: str, hosts: int) -> str:
    """--suite placement: per size, the direct floor, resume with each placement, the wave client between."""
    items = []
    for n in (int(x) for x in sizes.split(",") if x):
        items += [f"direct:{n}", f"direct:{n}:tagged", f"resume:{n}:{MAX_PARALLEL}:30:direct", f"wave:{hosts}:{n}",
                  f"resume:{n}:{MAX_PARALLEL}:30"]
    return ",".join(items)


def markdown(result: dict[str, Any]) -> str:
    """The figures as Markdown tables."""
    m, a = result["machine"], result["args"]
    lines = [f"# oned_bench: oned {a['version']}, {a['hosts']} hosts x {a['gpus']} GPUs, "
             f"MAX_ACTIONS_PER_CLUSTER 30, MAX_ACTIONS_PER_HOST 1, window 10 s / 7, STATE_VM 60 s, MONITOR_VM 300 s",
             "", f"{m['nproc']} CPUs ({m['cpu_model']}), {m['memory_gb']} GB, Python {m['python']}, "
             f"{m['date']}, load before/after {m['load_before']} / {m.get('load_after')}", ""]
    if result["clients"]:
        lines += ["| client | nodes | accepted s | per s | first RUNNING s | all RUNNING s | stalled | max PENDING | "
                  "API calls | CPU s | load before / after |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |"]
        for r in result["clients"]:
            per = r.get("per_second")
            lines.append(f"| {r['item']} | {r['nodes']} | {r['accepted']:.1f} | {f'{per:.0f}' if per else '-'} | "
                         f"{_s(r.get('first_running'))} | {_s(r.get('all_running'))} | "
                         f"{'YES' if r.get('stalled') else 'no'} | {r.get('max_pending', '-')} | "
                         f"{r.get('calls') or '-'} | {r.get('cpu', 0):.2f} | {_load(r.get('load'))} |")
    if result["resume"]:
        lines += ["", "| program | placement | nodes | max_parallel | max_pending | first RUNNING s | all RUNNING s | "
                  "wall s | API calls | CPU s | rc | ok | load before / after |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
        for r in result["resume"]:
            for program in ("resume", "suspend"):
                p = r[program]
                lines.append(f"| {program} | {r.get('placement', 'scheduler')} | {r['nodes']} | {r['max_parallel']} | "
                             f"{r['max_pending']} | {_s(p.get('first_running'))} | {_s(p.get('all_running'))} | "
                             f"{p['wall']:.1f} | {p.get('calls') or '-'} | {p['cpu']:.2f} | {p['rc']} | "
                             f"{'yes' if p['ok'] else 'NO'} | {_load(p.get('load'))} |")
    for r in result["baseline"]:
        lines += ["", f"one-by-one baseline, {r['nodes']} nodes: resume {r['resume']['wall']:.1f} s "
                  f"(rc {r['resume']['rc']}; all RUNNING after {r['resume']['until_done']:.1f} s), suspend "
                  f"{r['suspend']['wall']:.1f} s (rc {r['suspend']['rc']}; all gone after "
                  f"{r['suspend']['until_done']:.1f} s)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Start oned, run every item, stop oned, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="7.4.0", choices=("7.0.2", "7.4.0"))
    parser.add_argument("--hosts", type=int, default=None, help="dummy hosts (default 10; 20 with --suite)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs per host, at most 200 (default 100; 60 with "
                        "--suite)")
    parser.add_argument("--suite", choices=("placement",), help="run issue 24's comparison (see above)")
    parser.add_argument("--sizes", default="1,100,1000", help="node counts of --suite")
    parser.add_argument("--clients", default="", help="comma-separated client runs (see above)")
    parser.add_argument("--resume", default="", help="comma-separated N:MAX_PARALLEL:MAX_PENDING")
    parser.add_argument("--baseline", default="", help="node counts for the one-by-one baseline")
    parser.add_argument("--json", default="", help="where to write the JSON figures")
    parser.add_argument("--workdir", help="directory for oned and the sites (default: a temporary one)")
    args = parser.parse_args(argv)
    args.hosts = args.hosts or (20 if args.suite else 10)
    args.gpus = args.gpus or (60 if args.suite else 100)
    if args.suite:
        args.clients = ",".join(filter(None, [suite(args.sizes, args.hosts), args.clients]))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="oned_bench-"))
    result: dict[str, Any] = {"args": vars(args), "machine": power_bench.machine(), "clients": [],
                              "resume": [], "baseline": []}
    oned = Oned(work, args.version, args.hosts, args.gpus)
    json_path = Path(args.json or work / f"oned_bench-{args.version}.json")
    started = time.monotonic()
    try:
        print(f"starting oned {args.version} ({args.hosts} x {args.gpus} GPUs) ...", file=sys.stderr)
        oned.start()
        for item in filter(None, args.clients.split(",")):
            if item.startswith("resume:"):  # resume between the clients: the same oned, minutes apart
                print(f"resume {item} ...", file=sys.stderr, flush=True)
                row = run_resume(oned, item.removeprefix("resume:"), work)
                print(f"  {json.dumps(row)}", file=sys.stderr, flush=True)
                result["resume"].append(row)
                json_path.write_text(json.dumps(result, indent=1) + "\n")
                continue
            print(f"client {item} ...", file=sys.stderr, flush=True)
            row = run_client(oned, item)
            print(f"  {json.dumps({k: v for k, v in row.items() if k != 'timeline'})}", file=sys.stderr, flush=True)
            result["clients"].append(row)
            if row.get("stalled") or row.get("clean") != "ok":
                print("  stalled: restarting oned", file=sys.stderr, flush=True)
                oned.start()
            json_path.write_text(json.dumps(result, indent=1) + "\n")
        for item in filter(None, args.resume.split(",")):
            print(f"resume {item} ...", file=sys.stderr, flush=True)
            row = run_resume(oned, item, work)
            print(f"  {json.dumps(row)}", file=sys.stderr, flush=True)
            result["resume"].append(row)
            json_path.write_text(json.dumps(result, indent=1) + "\n")
        for nodes in filter(None, args.baseline.split(",")):
            print(f"baseline {nodes} ...", file=sys.stderr, flush=True)
            result["baseline"].append(run_baseline(oned, int(nodes), work))
    finally:
        oned.stop()
    result["bench_seconds"] = time.monotonic() - started
    result["machine"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    print(f"\n(benchmark took {result['bench_seconds']:.0f} s; JSON in {json_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
