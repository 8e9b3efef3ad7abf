"""A hostile OpenNebula endpoint for the security tests: a loopback proxy in front of the simulator that
drips its answers, sends huge ones, or rewrites them."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

Rewrite = Callable[[bytes], bytes]


class HostileEndpoint:
    """mode: "proxy" (forward, apply rewrite), "drip" (one byte a second, for ever), "huge" (an endless body
    of `huge_bytes` without Content-Length). Only loopback; stops with close()."""

    def __init__(self, upstream: str, mode: str = "proxy", rewrite: Rewrite | None = None,
                 huge_bytes: int = 300 << 20) -> None:
        self.upstream = urlsplit(upstream)
        self.mode = mode
        self.rewrite = rewrite
        self.huge_bytes = huge_bytes
        self.requests = 0
        self.stopping = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                owner.requests += 1
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                owner.serve(self, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/RPC2"

    def serve(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        out = handler.wfile
        try:
            if self.mode == "drip":
                for byte in b"HTTP/1.0 200 OK\r\nContent-Type: text/xml\r\n" + b"X-Drip: " + b"z" * 100000:
                    if self.stopping.wait(1.0):
                        return
                    out.write(bytes([byte]))
                    out.flush()
                return
            if self.mode == "huge":
                out.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/xml\r\n\r\n")
                out.write(b"<?xml version='1.0'?><methodResponse><params><param><value><array><data>"
                          b"<value><boolean>1</boolean></value><value><string>")
                chunk = b"&lt;VM&gt;" * 6554  # 64 KiB
                sent = 0
                while sent < self.huge_bytes and not self.stopping.is_set():
                    out.write(chunk)
                    sent += len(chunk)
                return
            answer = self.forward(body)
            if self.rewrite is not None:
                answer = self.rewrite(answer)
            out.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/xml\r\n")
            out.write(f"Content-Length: {len(answer)}\r\n\r\n".encode())
            out.write(answer)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def forward(self, body: bytes) -> bytes:
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=30)
        try:
            conn.request("POST", self.upstream.path or "/RPC2", body=body, headers={"Content-Type": "text/xml"})
            return conn.getresponse().read()
        finally:
            conn.close()

    def close(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
