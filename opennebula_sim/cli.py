"""`slurm-nebula-power simulator`: serve the simulator until SIGTERM/SIGINT, printing its endpoint first."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import logging
import shlex
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from opennebula_sim.config import ConfigError, SimConfig, load_sim_config
from opennebula_sim.handle import Simulator

EXIT_OK, EXIT_USAGE, EXIT_CONFIG = 0, 2, 3  # as slurm-nebula-power's programs

log = logging.getLogger(__name__)


def _version() -> str:
    """The installed distribution's version (the simulator imports nothing of the product's package)."""
    try:
        return importlib.metadata.version("slurm-nebula-power")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slurm-nebula-power simulator",
        description="Serve a simulated OpenNebula XML-RPC API (oned) on a loopback address.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    p.add_argument("--listen", default="127.0.0.1:2633", help="ADDRESS:PORT in 127.0.0.0/8; port 0 picks one")
    p.add_argument("--auth", default="oneadmin:secret", help="the only accepted session, user:password")
    p.add_argument("--config", help="sim.toml with hosts, templates, network, durations and faults")
    p.add_argument("--on-running", help="command run when a VM reaches RUNNING (shlex-split, no shell)")
    p.add_argument("--on-stopped", help="command run when a VM leaves RUNNING")
    p.add_argument("--seed", type=int, help="seed for every injected fault")
    p.add_argument("--latency-ms", type=float, help="added to every call")
    p.add_argument("--latency-jitter-ms", type=float, help="+/- this much, uniformly")
    p.add_argument("--transient-rate", type=float, help="share of calls failing with INTERNAL, 503 or a drop")
    p.add_argument("--boot-failure-rate", type=float, help="share of boots ending in BOOT_FAILURE")
    p.add_argument("--stuck-pending-rate", type=float, help="share of VMs that never leave PENDING")
    for phase in ("prolog", "boot", "shutdown", "epilog"):
        p.add_argument(f"--{phase}-seconds", type=float, help=f"duration of each {phase} phase")
    p.add_argument("--list-order", choices=("ASC", "DESC"), default="DESC",
                   help="pool order (oned API_LIST_ORDER)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every request")
    return p


def build_config(args: argparse.Namespace) -> SimConfig:
    """sim.toml (or the defaults) with the command line's overrides applied."""
    cfg = load_sim_config(args.config) if args.config else SimConfig()
    faults = {name: getattr(args, name) for name in ("latency_ms", "latency_jitter_ms", "transient_rate",
                                                     "boot_failure_rate", "stuck_pending_rate")
              if getattr(args, name) is not None}
    phases = ("prolog", "boot", "shutdown", "epilog")
    durations = {phase: getattr(args, f"{phase}_seconds") for phase in phases
                 if getattr(args, f"{phase}_seconds") is not None}
    changes: dict[str, object] = {
        "faults": dataclasses.replace(cfg.faults, **faults),
        "durations": dataclasses.replace(cfg.durations, **durations),
    }
    if args.seed is not None:
        changes["seed"] = args.seed
    for name in ("on_running", "on_stopped"):
        command = getattr(args, name)
        if command:
            changes[name] = tuple(shlex.split(command))
    return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the simulator; return 0 after SIGTERM/SIGINT, 2 for a bad command line, 3 for a bad sim.toml."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s simulator[%(process)d] %(levelname)s %(message)s")
    host, sep, port_text = args.listen.rpartition(":")
    if not sep or not port_text.isdigit():
        print(f"simulator: --listen {args.listen!r} must be ADDRESS:PORT", file=sys.stderr)
        return EXIT_USAGE
    try:
        cfg = build_config(args)
    except ConfigError as exc:
        print(f"simulator: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        sim = Simulator(cfg, args.auth, host, int(port_text), args.list_order, log_requests=args.verbose)
    except (ValueError, OSError) as exc:
        print(f"simulator: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        sim.start()
        print(sim.endpoint, flush=True)
        log.info("serving %s (auth user %s)", sim.endpoint, args.auth.split(":", 1)[0])
        while not stop.wait(0.2):
            pass
    finally:
        sim.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("stopped")
    return EXIT_OK
