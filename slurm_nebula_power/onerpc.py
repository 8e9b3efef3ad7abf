"""The XML-RPC adapter: oned's API over our own transport, faults translated into our errors.

The only module that imports pyone, and it uses pyone's public helpers only: `pyone.util.cast2one` makes
parameters oned-friendly, `pyone.bindings.parseString` turns documents into pyone's objects. Calls go
through the public `xmlrpc.client.ServerProxy` with a transport of ours (a real per-call timeout, one
kept-alive connection, cheap parsing). Calls are made once; retries belong to cloud.OneCloud.
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import re
import select
import socket
import ssl
import threading
import time
import xmlrpc.client
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from xml.parsers import expat
from xml.parsers.expat import ExpatError

import pyone.bindings
import pyone.util

from . import __version__
from .endpoint import Peer, Tls
from .errors import (
    ActionRefused,
    CloudAuthError,
    CloudError,
    CredentialsRefused,
    QuotaExceeded,
    TransientCloudError,
    UnreadableAnswer,
    VmNotFound,
)
from .model import no_declaration, refuse_doctype

# oned's error codes (include/Request.h)
AUTHENTICATION, AUTHORIZATION, NO_EXISTS, ACTION = 0x100, 0x200, 0x400, 0x800
XML_RPC_API, INTERNAL, ALLOCATE, LOCKED = 0x1000, 0x2000, 0x4000, 0x8000
# Quota::check_quota's text (src/um/Quota.cc), after "User [3] " or "Group [1] ": "limit of 0 reached for
# VMS quota in VM"; instantiate answers it with AUTHORIZATION, one.vm.action resume with ACTION.
QUOTA_TEXT = re.compile(r"\blimit of \S+ reached for \S+ quota in ")


class AnswerTooLarge(Exception):
    """An answer above the configured bound (max_answer_mb)."""


class NoConnection(Exception):
    """No connection to the endpoint within CONNECT_TIMEOUT (its host drops packets, or is down)."""


CONNECT_TIMEOUT = 5.0  # seconds to connect: on a reachable front end a connect takes milliseconds


class Transport(xmlrpc.client.Transport):
    """XML-RPC over http.client: a wall-clock bound per call, a bounded answer size, one kept-alive
    connection, cheap parsing.

    pyone's own transport goes through requests (about 1 ms of CPU per call, and its timeout= is
    ignored); xmlrpc.client's reads answers in 1 KiB pieces and hands expat's text to Python in
    pieces as small as one entity: a 1,000-VM pool document, escaped inside the XML-RPC string,
    made ~900,000 calls into the unmarshaller.  A socket timeout bounds each read, not the call: a peer
    that sends a byte a second would hold a call for ever, so the watchdog shuts the socket down when
    the call's time is up.  Each call is one attempt (xmlrpc.client's own request() silently repeats a
    call after a reset).
    """

    def __init__(self, timeout: float, ssl_context: Callable[[], ssl.SSLContext] | None,
                 max_answer: int = 64 << 20) -> None:
        super().__init__()
        self.timeout = timeout
        self.max_answer = max_answer
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
        """POST one call and parse the answer within the timeout; any failure closes the connection."""
        conn = self.connection(str(host))
        alarm = WATCHDOG.arm(conn, self.timeout)
        try:
            if conn.sock is None:
                self._connect(conn)
            conn.request("POST", handler, body=request_body,
                         headers={"Content-Type": "text/xml", "User-Agent": f"slurm-nebula-power/{__version__}"})
            response = conn.getresponse()
            if response.status != 200:
                response.read(65536)
                raise xmlrpc.client.ProtocolError(f"{host}{handler}", response.status, response.reason,
                                                  dict(response.getheaders()))
            return self.parse_response(response)
        except BaseException as exc:
            self.close()
            if alarm.fired:
                raise TimeoutError("no answer within the timeout") from exc
            raise
        finally:
            WATCHDOG.disarm(alarm)

    def _connect(self, conn: http.client.HTTPConnection) -> None:
        """Connect within CONNECT_TIMEOUT (a host that drops packets is known in seconds, not at the end of
        the call's timeout, which bounds reading a large answer), then read with the call's timeout."""
        conn.timeout = min(self.timeout, CONNECT_TIMEOUT)
        try:
            conn.connect()
        except TimeoutError:
            raise NoConnection(f"no connection within {conn.timeout:g}s") from None
        finally:
            conn.timeout = self.timeout
        if conn.sock is not None:
            conn.sock.settimeout(self.timeout)

    def parse_response(self, response: Any) -> Any:
        """Read the whole answer (at most max_answer bytes), parse it in one go, expat's text whole."""
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > self.max_answer:
            raise AnswerTooLarge(f"answer of {int(length)} bytes is above max_answer_mb")
        pieces, size = [], 0
        while piece := response.read(1 << 20):
            size += len(piece)
            if size > self.max_answer:
                raise AnswerTooLarge(f"answer above max_answer_mb ({self.max_answer >> 20} MiB)")
            pieces.append(piece)
        body = b"".join(pieces)
        unmarshaller = xmlrpc.client.Unmarshaller()
        parser = expat.ParserCreate(None, None)
        parser.StartDoctypeDeclHandler = no_declaration  # nor entities: expanded, they would pass max_answer_mb
        parser.EntityDeclHandler = no_declaration
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


class _Alarm:
    __slots__ = ("conn", "deadline", "fired")

    def __init__(self, conn: http.client.HTTPConnection | None, deadline: float) -> None:
        self.conn = conn
        self.deadline = deadline
        self.fired = False


class Watchdog:
    """One thread for the whole process: shuts down the socket of every call whose time is up.

    Cheaper than a timer thread per call (1,000-node runs make 1,000 calls); the blocked read then
    returns at once and the call fails with a timeout.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._alarms: list[tuple[float, int, _Alarm]] = []
        self._count = 0
        self._thread: threading.Thread | None = None

    def arm(self, conn: http.client.HTTPConnection, seconds: float) -> _Alarm:
        """Watch conn for the next `seconds`."""
        alarm = _Alarm(conn, time.monotonic() + seconds)
        with self._cond:
            self._count += 1
            heapq.heappush(self._alarms, (alarm.deadline, self._count, alarm))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="onerpc-watchdog", daemon=True)
                self._thread.start()
            elif self._alarms[0][2] is alarm:
                self._cond.notify()
        return alarm

    def disarm(self, alarm: _Alarm) -> None:
        """The call ended: forget it (its entry is skipped when it comes due). Under the lock, so a socket
        is never shut down after its call has ended (the kept-alive connection serves the next call)."""
        with self._cond:
            alarm.conn = None

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                while self._alarms and (self._alarms[0][2].conn is None or self._alarms[0][0] <= now):
                    _, _, alarm = heapq.heappop(self._alarms)
                    if alarm.conn is None:
                        continue
                    alarm.fired = True
                    if not _shut(alarm.conn):  # still connecting: try again in a moment
                        alarm.deadline = now + 0.05
                        self._count += 1
                        heapq.heappush(self._alarms, (alarm.deadline, self._count, alarm))
                        break
                self._cond.wait(max(0.0, self._alarms[0][0] - now) if self._alarms else None)


def _shut(conn: http.client.HTTPConnection) -> bool:
    """Shut the connection's socket down (a blocked read returns at once); False when it has none yet."""
    sock = conn.sock
    if sock is None:
        return False
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    return True


WATCHDOG = Watchdog()


def _closed_by_peer(sock: socket.socket) -> bool:
    """An idle kept-alive socket that is readable was closed (or garbled) by the server."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def ssl_context(verify: bool, ca_file: Path | None = None) -> Tls:
    """The TLS of an https:// endpoint ([opennebula] https_verify and ca_file), its context made on first use."""
    return Tls(verify, ca_file)


class OneRpc:
    """One connection to oned: `call("vm.info", 42)` sends one.vm.info(session, 42) and returns the value.

    Not thread-safe (one kept-alive connection): cloud.OneCloud keeps one per thread.
    """

    def __init__(self, endpoint: str, session: str, timeout: float,
                 tls: Tls | None, max_answer: int = 64 << 20) -> None:
        self.session = session
        # what an answer must never carry into a log line, an error or a node's Reason: the session, and its
        # secret part alone (a password or token of a few characters would also hide ordinary words)
        secret = session.partition(":")[2]
        self.secrets = tuple(s for s in (session, secret) if len(s) >= 6)
        self.transport = Transport(timeout, tls, max_answer)
        self.proxy = xmlrpc.client.ServerProxy(endpoint, transport=self.transport)
        url = urlsplit(endpoint)
        self.peer = Peer(url.hostname or "", url.netloc.rpartition("@")[2], tls.ca_file if tls else None)

    def call(self, method: str, *params: Any) -> Any:
        """Call one.<method>; the value of a successful answer, else our error with oned's code."""
        name = "one." + method
        args = (self.session, *(pyone.util.cast2one(p) for p in params))
        try:
            answer = getattr(self.proxy, name)(*args)
        except xmlrpc.client.Fault as exc:
            raise CloudError(f"[{name}] XML-RPC fault {exc.faultCode}: {self.outside(exc.faultString)}") from None
        except xmlrpc.client.ProtocolError as exc:
            error = TransientCloudError if exc.errcode >= 500 else CloudError
            raise error(f"[{name}] HTTP {exc.errcode} {self.outside(exc.errmsg, 200)}") from None
        except NoConnection as exc:
            raise TransientCloudError(f"[{name}] {exc}") from None
        except TimeoutError:
            raise TransientCloudError(f"[{name}] no answer within the timeout") from None
        except AnswerTooLarge as exc:
            raise TransientCloudError(f"[{name}] refused: {exc}") from None
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, closed early, TLS, DNS
            raise self.peer.failure(name, exc) from None
        except (xmlrpc.client.ResponseError, ValueError, ExpatError) as exc:  # ResponseError(): no text
            said = self.outside(str(exc), 200) or "not a whole XML-RPC answer"
            raise UnreadableAnswer(f"[{name}] unreadable answer: {said}") from None
        if not isinstance(answer, list) or len(answer) < 2 or not isinstance(answer[0], bool):
            raise TransientCloudError(f"[{name}] unreadable answer: not oned's [success, value, ...] array")
        if not answer[0]:
            code = answer[2] if len(answer) > 2 and type(answer[2]) is int else 0
            raise translate(self.outside(str(answer[1])), code)
        return answer[1]

    def outside(self, text: str, most: int = 1000) -> str:
        """Text an answer brought (a fault, oned's error message), fit to log, raise or give Slurm: cut to `most`
        characters and without the session (an endpoint that echoes the call's parameters would publish it)."""
        text = str(text)[:most + max((len(s) for s in self.secrets), default=0)]
        for secret in self.secrets:
            text = text.replace(secret, "<session>")
        return text[:most]

    def document(self, method: str, *params: Any) -> Any:
        """Call one.<method> and bind its XML document to pyone's objects (small answers only); a document
        pyone cannot bind (an ID that is not a number, a truncated answer) is a failure of the call
        (UnreadableAnswer, not retried), as for the VM and host pools, never a crash of the program."""
        text = str(self.call(method, *params))
        try:  # oned sends none; lxml before 5 resolves a DOCTYPE's file entities
            refuse_doctype(text)
        except ValueError:
            raise UnreadableAnswer(f"[one.{method}] unreadable document (a DOCTYPE, which oned never sends)") from None
        try:
            return pyone.bindings.parseString(text.encode("utf-8"))
        except Exception:  # pyone's generated binder raises its own GDSParseError, the XML parser's; their text
            # may quote the document, which can hold the munge key (a template's CONTEXT): never shown
            raise UnreadableAnswer(f"[one.{method}] unreadable document: pyone cannot bind it (a truncated or "
                                      "altered answer, or one of an OpenNebula release it does not know)") from None


def translate(message: str, code: int) -> CloudError:
    """oned's error code -> our error class."""
    if code in (AUTHORIZATION, ACTION) and QUOTA_TEXT.search(message):
        return QuotaExceeded(message, code)
    if code == AUTHENTICATION:
        return CredentialsRefused(message, code)
    if code == AUTHORIZATION:
        return CloudAuthError(message, code)
    if code == NO_EXISTS:
        return VmNotFound(message, code)
    if code == ACTION:
        return ActionRefused(message, code)
    if code in (INTERNAL, LOCKED):
        return TransientCloudError(message, code)
    return CloudError(message, code)
