"""--on-running / --on-stopped: run a command per VM event, never through a shell, and reap it."""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from opennebula_sim.cloud import HookEvent

log = logging.getLogger(__name__)


def context_file_text(event: HookEvent) -> str:
    """The VM's CONTEXT as shell-sourceable KEY='value' lines, like the context packages' one_env."""
    context = dict(event.context)
    if event.ip:
        context.setdefault("ETH0_IP", event.ip)
    if event.token:
        context.setdefault("TOKENTXT", event.token)  # one_env carries the token.txt of TOKEN=YES
    lines = []
    for key in sorted(context):
        quoted = context[key].replace("'", "'\"'\"'")
        lines.append(f"{key}='{quoted}'\n")
    return "".join(lines)


class HookRunner:
    """A thread that starts hook processes for queued events, writes their context files and reaps them."""

    def __init__(self, on_running: Sequence[str], on_stopped: Sequence[str], poll: float = 0.05) -> None:
        self.commands = {"running": list(on_running), "stopped": list(on_stopped)}
        self.poll = poll
        self._queue: queue.Queue[HookEvent | None] = queue.Queue()
        self._children: list[tuple[subprocess.Popen[bytes], HookEvent, list[str]]] = []
        self._dir = tempfile.TemporaryDirectory(prefix="nebula-sim-hooks-")
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="sim-hooks", daemon=True)
        self.started = 0
        self.failed = 0

    @property
    def enabled(self) -> bool:
        """Whether any hook command is configured."""
        return bool(self.commands["running"] or self.commands["stopped"])

    def start(self) -> None:
        """Start the runner thread."""
        self._thread.start()

    def submit(self, events: Sequence[HookEvent]) -> None:
        """Queue events; those without a configured command are dropped."""
        for event in events:
            if self.commands.get(event.kind):
                self._queue.put(event)

    def stop(self, wait: float = 5.0) -> None:
        """Stop accepting events, wait for running hooks up to `wait` seconds, remove context files."""
        self._queue.put(None)
        self._thread.join(wait)
        for child, _, _ in list(self._children):
            if child.poll() is None:
                child.kill()
                child.wait()
        self._dir.cleanup()

    def _run(self) -> None:
        stopping = False
        while not stopping or self._children:
            try:
                event = self._queue.get(timeout=self.poll)
            except queue.Empty:
                event = None
            else:
                if event is None:
                    stopping = True
                else:
                    self._launch(event)
            self._reap()

    def _launch(self, event: HookEvent) -> None:
        self._seq += 1
        path = Path(self._dir.name) / f"vm-{event.vm_id}-{self._seq}.context"
        path.write_text(context_file_text(event), encoding="utf-8")
        argv = self.commands[event.kind]
        env = dict(os.environ, ONE_VM_ID=str(event.vm_id), ONE_VM_NAME=event.name, ONE_VM_IP=event.ip,
                   ONE_VM_CONTEXT=str(path), ONE_VM_EVENT=event.kind)
        try:
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env)
        except OSError as exc:
            self.failed += 1
            log.error("hook %s for VM %d could not start: %s", argv[0], event.vm_id, exc)
            return
        self.started += 1
        self._children.append((child, event, argv))

    def _reap(self) -> None:
        still = []
        for child, event, argv in list(self._children):
            code = child.poll()
            if code is None:
                still.append((child, event, argv))
            elif code != 0:
                self.failed += 1
                log.warning("%s hook %s for VM %d exited with %d", event.kind, argv[0], event.vm_id, code)
        self._children = still
