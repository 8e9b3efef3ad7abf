"""The simplest clients of a real oned, over plain xmlrpc.client: how fast it accepts instantiates, how fast
it places them when they are sent at once, in waves, or through a sliding window, and the floor of direct
placement: instantiate-on-hold + deploy pairs to the free GPUs of one host pool read.

Used by bench/oned_bench.py; standard library only.  Every address it talks to is the endpoint it is given
(bench/oned_bench.py gives it a loopback one).
"""

from __future__ import annotations

import os
import threading
import time
import xml.etree.ElementTree as ET
import xmlrpc.client
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

PENDING, ACTIVE, RUNNING_LCM = 1, 3, 3
STALL_SECONDS = 60.0  # no VM left PENDING for this long while some are PENDING: oned's scheduler stalled


class Client:
    """One xmlrpc.client proxy per thread (a ServerProxy is not thread-safe)."""

    def __init__(self, endpoint: str, auth: str) -> None:
        self.endpoint, self.auth = endpoint, auth
        self._local = threading.local()

    def call(self, method: str, *args: Any) -> Any:
        """one.<method>(session, *args); raises RuntimeError on a refusal."""
        proxy = getattr(self._local, "proxy", None)
        if proxy is None:
            proxy = self._local.proxy = xmlrpc.client.ServerProxy(self.endpoint)
        answer = getattr(proxy.one, method)(self.auth, *args)
        if not answer[0]:
            raise RuntimeError(f"one.{method}: {answer[1]}")
        return answer[1]

    def template_id(self, name: str) -> int:
        """The id of the template called name."""
        root = ET.fromstring(self.call("templatepool.info", -2, -1, -1))
        for tmpl in root.findall("VMTEMPLATE"):
            if tmpl.findtext("NAME") == name:
                return int(tmpl.findtext("ID") or -1)
        raise RuntimeError(f"no template {name}")

    def states(self, prefix: str) -> dict[int, tuple[int, int, bool]]:
        """Our VMs (name starts with prefix, not DONE): id -> (STATE, LCM_STATE, has a SCHED_MESSAGE)."""
        root = ET.fromstring(self.call("vmpool.info", -3, -1, -1, -1))
        out = {}
        for vm in root.findall("VM"):
            if (vm.findtext("NAME") or "").startswith(prefix):
                out[int(vm.findtext("ID") or -1)] = (int(vm.findtext("STATE") or 0),
                                                     int(vm.findtext("LCM_STATE") or 0),
                                                     bool(vm.findtext("USER_TEMPLATE/SCHED_MESSAGE")))
        return out

    def clean(self, prefix: str, timeout: float = 300) -> None:
        """terminate-hard every VM of ours and wait until none is left (each VM asked again after 15 s:
        the dummy driver queues the actions, and a VM in BOOT refuses it)."""
        asked: dict[int, float] = {}
        with ThreadPoolExecutor(8) as pool:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                left = self.states(prefix)
                if not left:
                    return
                now = time.monotonic()
                due = [vm for vm in left if now - asked.get(vm, -99.0) > 15]
                asked.update((vm, now) for vm in due)
                list(pool.map(self._kill, due))
                time.sleep(1)
        raise RuntimeError(f"VMs {prefix}* still there after {timeout:g} s")

    def _kill(self, vm: int) -> None:
        try:
            self.call("vm.action", "terminate-hard", vm)
        except (RuntimeError, OSError):
            pass  # e.g. BOOT refuses terminate-hard: the next round tries again


@dataclass
class Run:
    """What one paced run saw."""

    mode: str
    width: int
    nodes: int
    accepted: float = 0.0  # seconds until the last instantiate answered
    all_running: float | None = None  # seconds until every VM was RUNNING (None: never, see stalled)
    stalled: bool = False
    max_pending: int = 0
    messages: int = 0  # most VMs PENDING with a SCHED_MESSAGE at once
    first_running: float | None = None  # seconds until the first VM was RUNNING
    calls: int = 0  # API calls made (the polls included)
    cpu: float = 0.0  # CPU seconds of this process during the run (its threads, the polls included)
    load: tuple[list[float], list[float]] = ([], [])  # load average before and after
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, pending, running)


def accept_rate(client: Client, tid: int, nodes: int, threads: int, prefix: str) -> float:
    """Seconds for `nodes` instantiates from `threads` threads, each answered (placement not awaited)."""
    start = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: client.call("template.instantiate", tid, f"{prefix}{i:05d}", False, "", False),
                      range(nodes)))
    return time.monotonic() - start


def paced(client: Client, tid: int, nodes: int, mode: str, width: int, prefix: str, threads: int = 32,
          poll: float = 0.25, timeout: float = 900.0) -> Run:
    """Instantiate `nodes` VMs and watch them to RUNNING.

    mode "burst": all at once (width ignored); "wave": `width` at a time, the next wave once every VM of
    the last one left PENDING; "window": at most `width` VMs PENDING or being instantiated at any time.
    """
    run = Run(mode, width, nodes)
    start = time.monotonic()
    sent = 0
    calls: list[Future[int]] = []
    created: set[int] = set()
    last_progress = start
    last_pending = -1
    with ThreadPoolExecutor(threads) as pool:
        while True:
            now = time.monotonic()
            done = [f for f in calls if f.done()]
            for f in done:
                created.add(f.result())
            calls = [f for f in calls if not f.done()]
            if sent == nodes and not calls and not run.accepted:
                run.accepted = now - start
            states = client.states(prefix) if created else {}
            mine = {i: s for i, s in states.items() if i in created}
            pending = sum(1 for s in mine.values() if s[0] == PENDING)
            running = sum(1 for s in mine.values() if s[0] == ACTIVE and s[1] == RUNNING_LCM)
            run.messages = max(run.messages, sum(1 for s in mine.values() if s[0] == PENDING and s[2]))
            run.max_pending = max(run.max_pending, pending)
            run.timeline.append((round(now - start, 2), pending, running))
            run.calls += 1 if created else 0
            if running and run.first_running is None:
                run.first_running = now - start
            if running == nodes:
                run.all_running = now - start
                return run
            if pending != last_pending or not pending:
                last_progress, last_pending = now, pending
            if (pending and now - last_progress > STALL_SECONDS) or now - start > timeout:
                run.stalled = True
                return run
            room = nodes - sent
            if mode == "wave":
                room = min(room, width) if not calls and pending == 0 else 0
            elif mode == "window":
                room = min(room, max(0, width - pending - len(calls)))
            for _ in range(room):
                name = f"{prefix}{sent:05d}"
                calls.append(pool.submit(
                    lambda n=name: int(client.call("template.instantiate", tid, n, False, "", False))))
                sent += 1
                run.calls += 1
            time.sleep(poll)


def pause(elapsed: float, first_seen: bool) -> float:
    """How long a watcher waits between two reads of the pool: 0.1 s until the first VM runs, then a fiftieth of
    the time so far (at most 2 s): a 1,000-VM pool read every 0.1 s took oned and the watcher most of a core,
    which the figures then measured; a fiftieth keeps each time within 2 % of itself."""
    return 0.1 if not first_seen else min(2.0, max(0.1, elapsed / 50))


def free_gpus(client: Client) -> list[int]:
    """One host pool read: a host id per free GPU (class 03xx) of the hosts that take VMs, host by host (pack)."""
    root = ET.fromstring(client.call("hostpool.info"))
    return [int(host.findtext("ID") or -1) for host in root.findall("HOST") if host.findtext("STATE") == "2"
            for pci in host.findall("HOST_SHARE/PCI_DEVICES/PCI")
            if (pci.findtext("CLASS") or "").startswith("03") and pci.findtext("VMID") == "-1"]


def direct(client: Client, tid: int, nodes: int, prefix: str, threads: int = 12, timeout: float = 900.0,
           extra: str = "") -> Run:
    """The floor of direct placement: one host pool read, then `nodes` instantiate-on-hold + deploy (with
    enforce) pairs from `threads` threads (`extra`: the extra template of every instantiate), each VM to the
    next free GPU (pack), watched to RUNNING as oned_bench watches resume (pause())."""
    run = Run("direct", threads, nodes, load=([round(x, 2) for x in os.getloadavg()], []))
    cpu, start = time.process_time(), time.monotonic()
    slots = free_gpus(client)
    if len(slots) < nodes:
        raise RuntimeError(f"{len(slots)} free GPUs for {nodes} nodes")

    def pair(index: int) -> int:
        vm_id = int(client.call("template.instantiate", tid, f"{prefix}{index:05d}", True, extra, False))
        client.call("vm.deploy", vm_id, slots[index], True, -1)
        return vm_id

    with ThreadPoolExecutor(threads) as workers:
        calls = [workers.submit(pair, i) for i in range(nodes)]
        run.calls = 1 + 2 * nodes
        while True:
            now = time.monotonic()
            if not run.accepted and all(c.done() for c in calls):
                for c in calls:
                    c.result()  # a refused pair ends the run with its error
                run.accepted = now - start
            states = client.states(prefix)
            run.calls += 1
            running = sum(1 for s in states.values() if s[0] == ACTIVE and s[1] == RUNNING_LCM)
            run.timeline.append((round(now - start, 2), len(states) - running, running))
            if running and run.first_running is None:
                run.first_running = now - start
            if running == nodes:
                run.all_running = now - start
                break
            if now - start > timeout:
                run.stalled = True
                break
            time.sleep(pause(now - start, run.first_running is not None))
    run.cpu = time.process_time() - cpu
    run.load = (run.load[0], [round(x, 2) for x in os.getloadavg()])
    return run
