"""The only module that imports pyone: OneCloud, error translation, real timeouts, retries."""

from __future__ import annotations

import http.client
import logging
import select
import socket
import ssl
import threading
import time
import xml.etree.ElementTree as ET
import xmlrpc.client
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from xml.parsers import expat
from xml.parsers.expat import ExpatError

import pyone
import pyone.server_xrpc
import tenacity

from .config import OneConfig
from .errors import (
    ActionRefused,
    CloudAuthError,
    CloudError,
    TransientCloudError,
    VmNotFound,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# oned's error codes (include/Request.h)
AUTHENTICATION, AUTHORIZATION, NO_EXISTS, ACTION = 0x100, 0x200, 0x400, 0x800
XML_RPC_API, INTERNAL, ALLOCATE, LOCKED = 0x1000, 0x2000, 0x4000, 0x8000

# VM STATE and LCM_STATE numbers (include/VirtualMachine.h)
STATE_NAMES = {0: "INIT", 1: "PENDING", 2: "HOLD", 3: "ACTIVE", 4: "STOPPED", 5: "SUSPENDED", 6: "DONE",
               8: "POWEROFF", 9: "UNDEPLOYED", 10: "CLONING", 11: "CLONING_FAILURE"}
PENDING, HOLD, ACTIVE, STOPPED, SUSPENDED, DONE = 1, 2, 3, 4, 5, 6
POWEROFF, UNDEPLOYED, CLONING, CLONING_FAILURE = 8, 9, 10, 11
RUNNING_LCM, UNKNOWN_LCM = 3, 16
# pyone.LCM_STATE stops at 68; oned has BACKUP 69, BACKUP_POWEROFF 70, RESTORE 71.
_EXTRA_LCM = {69: "BACKUP", 70: "BACKUP_POWEROFF", 71: "RESTORE"}
FAILURE_LCM = frozenset(int(s.value) for s in pyone.LCM_STATE if s.name.endswith("FAILURE"))

# Tags we put into every VM's USER_TEMPLATE: identity is NAME plus these.
TAG_CLUSTER = "SLURM_CLUSTER"
TAG_NODE = "SLURM_NODENAME"
TAG_JOBS = "SLURM_JOB_IDS"
TAG_MANAGER = "SLURM_NEBULA_POWER"


def lcm_name(lcm: int) -> str:
    """LCM_STATE number -> oned's name (pyone's enum misses the newest states)."""
    if lcm in _EXTRA_LCM:
        return _EXTRA_LCM[lcm]
    try:
        return str(pyone.LCM_STATE(lcm).name)
    except ValueError:
        return f"LCM_{lcm}"


@dataclass(frozen=True)
class Vm:
    """What the programs need to know of one VM."""

    id: int
    name: str
    state: int
    lcm_state: int
    ip: str | None = None
    host: str | None = None
    stime: int = 0
    user_template: Mapping[str, str] = field(default_factory=dict)

    @property
    def state_name(self) -> str:
        """STATE in words, LCM_STATE too when ACTIVE (e.g. ACTIVE/BOOT_FAILURE)."""
        name = STATE_NAMES.get(self.state, f"STATE_{self.state}")
        return f"{name}/{lcm_name(self.lcm_state)}" if self.state == ACTIVE else name

    @property
    def failed(self) -> bool:
        """In a failure state: it will not come up without help."""
        return self.state == CLONING_FAILURE or (self.state == ACTIVE and self.lcm_state in FAILURE_LCM)

    @property
    def running(self) -> bool:
        """ACTIVE and RUNNING."""
        return self.state == ACTIVE and self.lcm_state == RUNNING_LCM

    @property
    def ready(self) -> bool:
        """The guest reported READY=YES through OneGate."""
        return str(self.user_template.get("READY", "")).upper() == "YES"

    @property
    def sched_message(self) -> str:
        """oned's scheduler message (why a PENDING VM is not placed), if any."""
        return str(self.user_template.get("SCHED_MESSAGE", ""))

    def is_ours(self, cluster: str, node: str) -> bool:
        """Identity: NAME is the node name AND our tags name this cluster and node."""
        return (self.name == node and self.user_template.get(TAG_NODE) == node
                and self.user_template.get(TAG_CLUSTER) == cluster)


# ---- pyone with a real per-call timeout and oned's error code kept --------------------------------


class _Transport(xmlrpc.client.Transport):
    """XML-RPC over http.client: a real per-call timeout, one kept-alive connection, cheap parsing.

    pyone's own transport goes through requests (about 1 ms of CPU per call, and its timeout= is
    ignored); xmlrpc.client's reads answers in 1 KiB pieces and hands expat's text to Python in
    pieces as small as one entity: a 1,000-VM pool document, escaped inside the XML-RPC string,
    made ~900,000 calls into the unmarshaller.  Calls are made once; retries belong to OneCloud.
    """

    accept_gzip_encoding = False  # answers are parsed as they come: never ask for gzip

    def __init__(self, timeout: float, ssl_context: Callable[[], ssl.SSLContext] | None) -> None:
        super().__init__()
        self.timeout = timeout
        self.ssl_context = ssl_context  # None: plain http

    def make_connection(self, host: Any) -> http.client.HTTPConnection:
        """The kept-alive connection, or a new one (a connection the server closed is not reused)."""
        cached_host, conn = self._connection
        if conn is not None and cached_host == host:
            if conn.sock is not None and _closed_by_peer(conn.sock):
                conn.close()  # http.client reconnects on the next request
            return conn
        chost, self._extra_headers, _ = self.get_host_info(host)
        if self.ssl_context is None:
            conn = http.client.HTTPConnection(chost, timeout=self.timeout)
        else:
            conn = http.client.HTTPSConnection(chost, timeout=self.timeout, context=self.ssl_context())
        self._connection = host, conn
        return conn

    def request(self, host: Any, handler: str, request_body: Any, verbose: bool = False) -> Any:
        """One attempt (xmlrpc.client's own request() silently repeats a call after a reset)."""
        return self.single_request(host, handler, request_body, verbose)

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


def _closed_by_peer(sock: socket.socket) -> bool:
    """An idle kept-alive socket that is readable was closed (or garbled) by the server."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _ssl_context(verify: bool) -> Callable[[], ssl.SSLContext]:
    """Built once, on first use: the system's CAs plus certifi's (what requests trusted before)."""
    context: list[ssl.SSLContext] = []
    lock = threading.Lock()

    def get() -> ssl.SSLContext:
        with lock:
            if not context:
                made = ssl.create_default_context()
                if verify:
                    try:
                        import certifi

                        made.load_verify_locations(certifi.where())
                    except (ImportError, OSError):
                        pass
                else:
                    made.check_hostname = False
                    made.verify_mode = ssl.CERT_NONE
                context.append(made)
            return context[0]

    return get


class _Server(pyone.server_xrpc.OneServerXRPC):  # type: ignore[misc]
    """pyone's XML-RPC server object; failures raise our errors with oned's code (pyone drops it)."""

    def __init__(self, config: OneConfig, ssl_context: Callable[[], ssl.SSLContext] | None) -> None:
        super().__init__(config.endpoint, session=config.session)
        # xmlrpc.client.ServerProxy keeps its transport in a private attribute; replace it with ours.
        self._ServerProxy__transport = _Transport(config.timeout, ssl_context)

    def _do_request(self, method: str, params: Any) -> Any:
        try:
            raw = xmlrpc.client.ServerProxy._ServerProxy__request(self, method, params)  # type: ignore[attr-defined]
        except xmlrpc.client.Fault as exc:
            raise CloudError(f"[{method}] XML-RPC fault {exc.faultCode}: {exc.faultString}") from None
        except xmlrpc.client.ProtocolError as exc:
            error = TransientCloudError if exc.errcode >= 500 else CloudError
            raise error(f"[{method}] HTTP {exc.errcode} {exc.errmsg}") from None
        except TimeoutError:
            raise TransientCloudError(f"[{method}] no answer within the timeout") from None
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, closed early, TLS, DNS
            raise TransientCloudError(f"[{method}] connection failed: {type(exc).__name__}") from None
        except (xmlrpc.client.ResponseError, ValueError, ExpatError) as exc:
            raise TransientCloudError(f"[{method}] unreadable answer: {exc}") from None
        if not raw[0]:
            raise _translate(str(raw[1]), int(raw[2]))
        return raw

    def raw(self, method: str, *params: Any) -> Any:
        """Call one.<method> and return the value unparsed (pool documents are parsed by vms_from_xml)."""
        return self._do_request("one." + method, self._cast_parms(params))[1]


def _translate(message: str, code: int) -> CloudError:
    if code in (AUTHENTICATION, AUTHORIZATION):
        return CloudAuthError(message, code)
    if code == NO_EXISTS:
        return VmNotFound(message, code)
    if code == ACTION:
        return ActionRefused(message, code)
    if code in (INTERNAL, LOCKED):
        return TransientCloudError(message, code)
    return CloudError(message, code)


# ---- the cloud ------------------------------------------------------------------------------------


def vms_from_xml(text: str) -> list[Vm]:
    """Parse a VM_POOL (or one VM) document with ElementTree.

    pyone's generated bindings cost about 0.4 ms per VM; a 1,000-VM pool (3 MB of full bodies) is
    read while resume watches its VMs boot, so pool documents are parsed here instead (same fields),
    walking each VM's children once rather than searching it path by path.
    """
    root = ET.fromstring(text)
    return [_vm_from_element(vm) for vm in ([root] if root.tag == "VM" else root.iterfind("VM"))]


_VM_FIELDS = frozenset(("ID", "NAME", "STATE", "LCM_STATE", "STIME"))


def _vm_from_element(vm: ET.Element) -> Vm:
    fields: dict[str, str] = {}
    ip: str | None = None
    host: str | None = None
    tags: dict[str, str] | None = None
    for child in vm:
        tag = child.tag
        if tag in _VM_FIELDS:
            fields.setdefault(tag, child.text or "")
        elif tag == "TEMPLATE":
            # the first TEMPLATE/NIC/IP in document order, as findtext would give it
            for nic in child.iterfind("NIC"):
                ip = ip or nic.findtext("IP") or None
        elif tag == "USER_TEMPLATE" and tags is None:
            tags = {item.tag: item.text or "" for item in child if len(item) == 0}
        elif tag == "HISTORY_RECORDS":
            for name in child.iterfind("HISTORY/HOSTNAME"):
                host = name.text or None  # the last record is where the VM is (or was)
    return Vm(id=int(fields.get("ID") or -1), name=fields.get("NAME") or "",
              state=int(fields.get("STATE") or 0), lcm_state=int(fields.get("LCM_STATE") or 0),
              ip=ip, host=host, stime=int(fields.get("STIME") or 0), user_template=tags or {})


@dataclass
class CallStats:
    """Counts kept for the run summary."""

    calls: int = 0
    retries: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, calls: int = 0, retries: int = 0) -> None:
        with self.lock:
            self.calls += calls
            self.retries += retries


class OneCloud:
    """OpenNebula through pyone: one server object per thread, every call timed out and retried."""

    def __init__(self, config: OneConfig, sleep: Callable[[float], None] = time.sleep,
                 retry_seconds: float | None = None) -> None:
        self.config = config
        self.sleep = sleep
        self.retry_seconds = config.retry_seconds if retry_seconds is None else retry_seconds
        self.stats = CallStats()
        self._local = threading.local()
        self._ssl = _ssl_context(config.https_verify) if config.endpoint.startswith("https") else None

    def _server(self) -> _Server:
        server: _Server | None = getattr(self._local, "server", None)
        if server is None:
            server = self._local.server = _Server(self.config, self._ssl)
        return server

    def call(self, what: str, fn: Callable[[_Server], T], retry: bool = True,
             deadline: float | None = None) -> T:
        """Run one API call, retrying transient failures with exponential backoff and jitter."""
        started = time.monotonic()
        budget = self.retry_seconds
        if deadline is not None:
            budget = max(0.0, min(budget, deadline - started))
        # The first attempt runs outside tenacity (its machinery costs ~45 us a call, and 1,000-node
        # runs make 1,000 calls that nearly all succeed at once); a transient failure is replayed
        # into the same schedule, so delays, budget, counts and log lines are as if tenacity ran it.
        self.stats.add(calls=1)
        try:
            return fn(self._server())
        except TransientCloudError as exc:
            if not retry:
                raise
            failed = [exc]
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(TransientCloudError),
            stop=tenacity.stop_after_delay(max(0.0, budget - (time.monotonic() - started))),
            # retry_backoff, doubling up to 5 s, plus up to 2.5 x retry_backoff of jitter (spreads
            # the retries of many parallel calls that failed together)
            wait=tenacity.wait_exponential(multiplier=self.config.retry_backoff, max=5.0)
            + tenacity.wait_random(0, 2.5 * self.config.retry_backoff),
            sleep=self.sleep,
            reraise=True,
            before_sleep=self._before_sleep(what),
        )
        for attempt in retrying:
            with attempt:
                if failed:
                    raise failed.pop()  # attempt 1, made above
                self.stats.add(calls=1)
                return fn(self._server())
        raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover

    def _before_sleep(self, what: str) -> Callable[[tenacity.RetryCallState], None]:
        def before_sleep(state: tenacity.RetryCallState) -> None:
            self.stats.add(retries=1)
            exc = state.outcome.exception() if state.outcome else None
            log.warning("retrying %s after attempt %d: %s", what, state.attempt_number, exc)

        return before_sleep

    # -- queries --

    def cluster_vms(self, cluster: str) -> list[Vm]:
        """One pool query: our user's live VMs (not DONE) tagged with our cluster, full bodies.

        Filter flag -3 (the caller's own VMs) keeps the answer small on a busy cloud.  oned's
        KEY=VALUE filter argument is not used: it is a MySQL full-text search that fails on SQLite
        front ends.  Identity (name + tags) is checked by the caller on every VM.
        """
        text = self.call("vmpool.infoextended", lambda s: s.raw("vmpool.infoextended", -3, -1, -1, -1))
        return [vm for vm in vms_from_xml(str(text)) if vm.user_template.get(TAG_CLUSTER) == cluster]

    def vm(self, vm_id: int) -> Vm:
        """Full information on one VM."""
        return vms_from_xml(str(self.call(f"vm.info {vm_id}", lambda s: s.raw("vm.info", vm_id))))[0]

    def template_id(self, ref: str | int) -> int:
        """A template's numeric id, from its id or its name (one templatepool query)."""
        if isinstance(ref, int) or ref.isdigit():
            return int(ref)
        pool = self.call("templatepool.info", lambda s: s.templatepool.info(-2, -1, -1))
        matches = [int(t.ID) for t in (pool.VMTEMPLATE or []) if t.NAME == ref]
        if not matches:
            raise VmNotFound(f"no VM template named {ref!r} is visible to user {self.config.user}", NO_EXISTS)
        if len(matches) > 1:
            raise CloudError(f"several VM templates are named {ref!r} (ids {matches}); use the numeric id")
        return matches[0]

    def template(self, template_id: int) -> dict[str, Any]:
        """A template's TEMPLATE section as a dict."""
        obj = self.call(f"template.info {template_id}", lambda s: s.template.info(template_id, False, False))
        body = obj.TEMPLATE
        return dict(body) if isinstance(body, dict) else {}

    # -- actions --

    def instantiate(self, template_id: int, name: str, extra: str, retry: bool = True) -> int:
        """Create a VM from a template with an extra template; returns the new VM id."""
        return int(self.call(f"template.instantiate {name}",
                             lambda s: s.template.instantiate(template_id, name, False, extra, False),
                             retry=retry))

    def action(self, action: str, vm_id: int) -> None:
        """one.vm.action; an action refused for the VM's state raises ActionRefused (never retried)."""
        self.call(f"vm.action {action} {vm_id}", lambda s: s.vm.action(action, vm_id))

    def recover_delete(self, vm_id: int) -> None:
        """one.vm.recover with op 3 (delete): drops a VM in any state and frees its host resources."""
        self.call(f"vm.recover delete {vm_id}", lambda s: s.vm.recover(vm_id, 3))

    def version(self) -> str:
        """oned's version."""
        return str(self.call("system.version", lambda s: s.system.version()))

    def hosts(self) -> Any:
        """The raw host pool (for status and check)."""
        return self.call("hostpool.info", lambda s: s.hostpool.info())
