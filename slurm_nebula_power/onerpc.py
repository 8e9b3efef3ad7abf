"""The XML-RPC adapter: oned's API over our own transport, faults translated into our errors.

The only module that imports pyone, and it uses pyone's public helpers only: `pyone.util.cast2one` makes
parameters oned-friendly, `pyone.bindings.parseString` turns documents into pyone's objects. Calls go
through the public `xmlrpc.client.ServerProxy` with a transport of ours (a real per-call timeout, one
kept-alive connection, cheap parsing). Calls are made once; retries belong to cloud.OneCloud.
"""

from __future__ import annotations

import http.client
import select
import socket
import ssl
import threading
import xmlrpc.client
from collections.abc import Callable
from typing import Any
from xml.parsers import expat
from xml.parsers.expat import ExpatError

import certifi
import pyone.bindings
import pyone.util

from . import __version__
from .errors import ActionRefused, CloudAuthError, CloudError, TransientCloudError, VmNotFound

# oned's error codes (include/Request.h)
AUTHENTICATION, AUTHORIZATION, NO_EXISTS, ACTION = 0x100, 0x200, 0x400, 0x800
XML_RPC_API, INTERNAL, ALLOCATE, LOCKED = 0x1000, 0x2000, 0x4000, 0x8000


class Transport(xmlrpc.client.Transport):
    """XML-RPC over http.client: a real per-call timeout, one kept-alive connection, cheap parsing.

    pyone's own transport goes through requests (about 1 ms of CPU per call, and its timeout= is
    ignored); xmlrpc.client's reads answers in 1 KiB pieces and hands expat's text to Python in
    pieces as small as one entity: a 1,000-VM pool document, escaped inside the XML-RPC string,
    made ~900,000 calls into the unmarshaller.  Each call is one attempt (xmlrpc.client's own
    request() silently repeats a call after a reset).
    """

    def __init__(self, timeout: float, ssl_context: Callable[[], ssl.SSLContext] | None) -> None:
        super().__init__()
        self.timeout = timeout
        self.ssl_context = ssl_context  # None: plain http
        self.kept: tuple[str, http.client.HTTPConnection] | None = None

    def connection(self, host: str) -> http.client.HTTPConnection:
        """The kept-alive connection, or a new one (a connection the server closed is not reused)."""
        if self.kept is not None and self.kept[0] == host:
            conn = self.kept[1]
            if conn.sock is not None and _closed_by_peer(conn.sock):
                conn.close()  # http.client reconnects on the next request
            return conn
        self.close()
        if self.ssl_context is None:
            conn = http.client.HTTPConnection(host, timeout=self.timeout)
        else:
            conn = http.client.HTTPSConnection(host, timeout=self.timeout, context=self.ssl_context())
        self.kept = host, conn
        return conn

    def request(self, host: Any, handler: str, request_body: Any, verbose: bool = False) -> Any:
        """POST one call and parse the answer; any failure closes the connection."""
        conn = self.connection(str(host))
        try:
            conn.request("POST", handler, body=request_body,
                         headers={"Content-Type": "text/xml", "User-Agent": f"slurm-nebula-power/{__version__}"})
            response = conn.getresponse()
            if response.status != 200:
                response.read()
                raise xmlrpc.client.ProtocolError(f"{host}{handler}", response.status, response.reason,
                                                  dict(response.getheaders()))
            return self.parse_response(response)
        except BaseException:
            self.close()
            raise

    def parse_response(self, response: Any) -> Any:
        """Read the whole answer, parse it in one go, with expat's text delivered whole."""
        body = response.read()
        unmarshaller = xmlrpc.client.Unmarshaller()
        parser = expat.ParserCreate(None, None)
        parser.StartElementHandler = unmarshaller.start
        parser.EndElementHandler = unmarshaller.end
        parser.CharacterDataHandler = unmarshaller.data
        unmarshaller.xml(None, None)  # type: ignore[arg-type]  # as ExpatParser: expat gives str, not bytes
        parser.buffer_text = True  # adjacent text (entities included) in one callback
        parser.buffer_size = max(len(body), 8192)
        parser.Parse(body, True)
        return unmarshaller.close()

    def close(self) -> None:
        """Close the kept-alive connection."""
        if self.kept is not None:
            self.kept[1].close()
            self.kept = None


def _closed_by_peer(sock: socket.socket) -> bool:
    """An idle kept-alive socket that is readable was closed (or garbled) by the server."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def ssl_context(verify: bool) -> Callable[[], ssl.SSLContext]:
    """Built once, on first use: the system's CAs plus certifi's (what requests trusted before)."""
    context: list[ssl.SSLContext] = []
    lock = threading.Lock()

    def get() -> ssl.SSLContext:
        with lock:
            if not context:
                made = ssl.create_default_context()
                if verify:
                    made.load_verify_locations(certifi.where())
                else:
                    made.check_hostname = False
                    made.verify_mode = ssl.CERT_NONE
                context.append(made)
            return context[0]

    return get


class OneRpc:
    """One connection to oned: `call("vm.info", 42)` sends one.vm.info(session, 42) and returns the value.

    Not thread-safe (one kept-alive connection): cloud.OneCloud keeps one per thread.
    """

    def __init__(self, endpoint: str, session: str, timeout: float,
                 tls: Callable[[], ssl.SSLContext] | None) -> None:
        self.session = session
        self.transport = Transport(timeout, tls)
        self.proxy = xmlrpc.client.ServerProxy(endpoint, transport=self.transport)

    def call(self, method: str, *params: Any) -> Any:
        """Call one.<method>; the value of a successful answer, else our error with oned's code."""
        name = "one." + method
        args = (self.session, *(pyone.util.cast2one(p) for p in params))
        try:
            answer = getattr(self.proxy, name)(*args)
        except xmlrpc.client.Fault as exc:
            raise CloudError(f"[{name}] XML-RPC fault {exc.faultCode}: {exc.faultString}") from None
        except xmlrpc.client.ProtocolError as exc:
            error = TransientCloudError if exc.errcode >= 500 else CloudError
            raise error(f"[{name}] HTTP {exc.errcode} {exc.errmsg}") from None
        except TimeoutError:
            raise TransientCloudError(f"[{name}] no answer within the timeout") from None
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, closed early, TLS, DNS
            raise TransientCloudError(f"[{name}] connection failed: {type(exc).__name__}") from None
        except (xmlrpc.client.ResponseError, ValueError, ExpatError) as exc:
            raise TransientCloudError(f"[{name}] unreadable answer: {exc}") from None
        if not answer[0]:
            raise translate(str(answer[1]), int(answer[2]))
        return answer[1]

    def document(self, method: str, *params: Any) -> Any:
        """Call one.<method> and bind its XML document to pyone's objects (small answers only)."""
        return pyone.bindings.parseString(str(self.call(method, *params)).encode("utf-8"))


def translate(message: str, code: int) -> CloudError:
    """oned's error code -> our error class."""
    if code in (AUTHENTICATION, AUTHORIZATION):
        return CloudAuthError(message, code)
    if code == NO_EXISTS:
        return VmNotFound(message, code)
    if code == ACTION:
        return ActionRefused(message, code)
    if code in (INTERNAL, LOCKED):
        return TransientCloudError(message, code)
    return CloudError(message, code)
