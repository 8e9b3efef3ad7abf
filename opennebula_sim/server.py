"""XML-RPC over HTTP on a loopback address: a thread per connection, injected latency and transient faults.

Latency and hangs are served without holding the cloud lock, so slow calls overlap like they do on oned.
"""

from __future__ import annotations

import ipaddress
import logging
import random
import socket
import threading
import time
import xmlrpc.client
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opennebula_sim.cloud import Cloud
from opennebula_sim.rpc import Api

log = logging.getLogger(__name__)


def check_loopback(host: str) -> str:
    """The address to bind: only 127.0.0.0/8 (and `localhost`) are accepted."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"--listen address {host!r} is not an IP address; use one in 127.0.0.0/8") from None
    if address.version != 4 or not address.is_loopback:
        raise ValueError(f"refusing to listen on {host}: the simulator only listens on 127.0.0.0/8 addresses")
    return host


# oned.conf's defaults for its XML-RPC server: a kept-alive connection serves at most
# KEEPALIVE_MAX_CONN calls and is closed after KEEPALIVE_TIMEOUT seconds without one.
KEEPALIVE_MAX_CONN = 30
KEEPALIVE_TIMEOUT = 15


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True  # never joined: stop() does not wait for a kept-alive connection's thread
    request_queue_size = 512  # the listen backlog: 64+ clients connect at once
    rpc: RpcServer


class _Handler(BaseHTTPRequestHandler):
    server: _HttpServer
    protocol_version = "HTTP/1.1"  # kept-alive connections, as oned's Abyss server keeps them
    server_version = "xmlrpc-c/1.51 (nebula-simulator)"
    timeout = KEEPALIVE_TIMEOUT  # idle (or stalled) connections are closed

    def setup(self) -> None:
        super().setup()
        # Headers and body are two writes: without this, Nagle holds the body until the client's
        # delayed ACK (40 ms) on a kept-alive connection.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.answered = 0

    def end_headers(self) -> None:
        self.answered += 1
        if self.answered >= KEEPALIVE_MAX_CONN:
            self.send_header("Connection", "close")
        super().end_headers()

    def do_POST(self) -> None:
        if self.path not in ("/RPC2", "/"):
            self._plain(404, "no XML-RPC endpoint here; use /RPC2\n")
            return
        length = int(self.headers.get("Content-Length") or 0)
        try:
            params, method = xmlrpc.client.loads(self.rfile.read(length))
        except Exception:  # any malformed body gets the same answer
            self._plain(400, "malformed XML-RPC request\n")
            return
        self.server.rpc.serve(self, method or "", params)

    def do_GET(self) -> None:
        self._plain(405, "XML-RPC needs POST\n")

    def do_PUT(self) -> None:
        # OneGate's `PUT /vm` (the guest's READY=YES), served beside /RPC2: CONTEXT's ONEGATE_ENDPOINT.
        if self.path.split("?", 1)[0] != "/vm":
            self._plain(404, "only PUT /vm (OneGate) is served\n")
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode("utf-8", errors="replace")
        code, text = self.server.rpc.api.onegate_put_vm(self.headers.get("X-ONEGATE-VMID", ""),
                                                        self.headers.get("X-ONEGATE-TOKEN", ""), body,
                                                        self.headers.get("Content-Type", ""),
                                                        self.path.partition("?")[2])
        self._plain(code, text)

    def _plain(self, code: int, body: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def reply(self, payload: bytes) -> None:
        """Send one XML-RPC response."""
        self.send_response(200)
        self.send_header("Content-Type", "text/xml")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def drop(self) -> None:
        """Close the connection without answering (a transient network failure)."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.rpc.log_requests:  # off by default: in-process runs share the caller's log
            log.info("%s %s", self.address_string(), format % args)


class RpcServer:
    """The listening socket, the per-call fault injection, and the threads that serve and tick."""

    def __init__(self, cloud: Cloud, api: Api, host: str, port: int, log_requests: bool = False) -> None:
        self.cloud = cloud
        self.api = api
        self.log_requests = log_requests
        self.httpd = _HttpServer((check_loopback(host), port), _Handler)
        self.httpd.rpc = self
        host, port = self.address
        cloud.onegate_endpoint = f"http://{host}:{port}"  # OneGate's PUT /vm is served here too
        self.stopping = threading.Event()
        self.unhang = threading.Event()
        self._lock = threading.Lock()
        self._call_seq = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.faults_injected: dict[str, int] = {}
        self._serve_thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                              name="sim-http", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound."""
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        """Accept calls from now on."""
        self._serve_thread.start()

    def stop(self) -> None:
        """Stop accepting, release hung calls, close the socket."""
        self.stopping.set()
        self.unhang.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._serve_thread.join(5)

    def set_hang(self, hang: bool) -> None:
        """Make new calls wait (hang=True) until hang is cleared or the server stops."""
        if hang:
            self.unhang.clear()
        else:
            self.unhang.set()

    def serve(self, handler: _Handler, method: str, params: tuple[Any, ...]) -> None:
        """Answer one call, applying the configured latency and transient faults first."""
        if method == "sim.stats":
            handler.reply(xmlrpc.client.dumps((self.stats(),), methodresponse=True, allow_none=True).encode())
            return
        self.api.count(method)
        with self._lock:
            self._call_seq += 1
            draw = random.Random(f"{self.cloud.cfg.seed}:call:{self._call_seq}")  # noqa: S311 - simulation
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            self._serve(handler, method, params, draw)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _serve(self, handler: _Handler, method: str, params: tuple[Any, ...], draw: random.Random) -> None:
        faults = self.cloud.faults
        if faults.hang:
            while self.cloud.faults.hang and not self.stopping.is_set():
                self.unhang.wait(0.05)
            if self.stopping.is_set():
                handler.drop()
                return
        delay = faults.latency_ms + faults.latency_jitter_ms * (2 * draw.random() - 1)
        if delay > 0:
            time.sleep(delay / 1000.0)
        if draw.random() < faults.transient_rate:
            kind = faults.transient_kinds[int(draw.random() * len(faults.transient_kinds))]
            with self._lock:
                self.faults_injected[kind] = self.faults_injected.get(kind, 0) + 1
            if kind == "http503":
                handler._plain(503, "Service Unavailable\n")
                return
            if kind == "drop":
                handler.drop()
                return
            value: Any = self.api.internal_error(method)
        else:
            try:
                value = self.api.dispatch(method, params)
            except xmlrpc.client.Fault as fault:
                handler.reply(xmlrpc.client.dumps(fault, methodresponse=True).encode())
                return
            except Exception as exc:  # a simulator bug: say so loudly rather than drop the connection
                log.exception("simulator failed serving %s", method)
                bug = xmlrpc.client.Fault(-500, f"simulator bug serving {method}: {exc!r}")
                handler.reply(xmlrpc.client.dumps(bug, methodresponse=True).encode())
                return
        handler.reply(xmlrpc.client.dumps((value,), methodresponse=True).encode())

    def stats(self) -> dict[str, Any]:
        """sim.stats plus the server's own counters."""
        out = self.api.stats()
        with self._lock:
            out["max_in_flight"] = self.max_in_flight
            out["faults_injected"] = dict(self.faults_injected)
        return out

    def reset_stats(self) -> None:
        """Zero the call counts, the in-flight maximum and the fault counts."""
        self.api.reset_stats()
        with self._lock:
            self.max_in_flight = self.in_flight
            self.faults_injected.clear()
