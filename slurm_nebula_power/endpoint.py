"""oned's endpoint below the XML-RPC adapter: the TLS it trusts ([opennebula] https_verify and ca_file),
and what a failed connection to it means, in words an administrator can act on."""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import certifi

from .errors import CloudError, EndpointUnresolved, EndpointUntrusted, TransientCloudError


class Tls:
    """An https:// endpoint's TLS: the context, built once on first use, and what it trusts. Without a
    ca_file the system's CAs plus certifi's (what requests trusted before); with one, only the certificates
    in that file (a site's own CA: no public CA can then stand in for the front end)."""

    def __init__(self, verify: bool, ca_file: Path | None = None) -> None:
        self.verify = verify
        self.ca_file = ca_file
        self._context: ssl.SSLContext | None = None
        self._lock = threading.Lock()

    def __call__(self) -> ssl.SSLContext:
        with self._lock:
            if self._context is None:
                if not self.verify:
                    made = ssl.create_default_context()
                    made.check_hostname = False
                    made.verify_mode = ssl.CERT_NONE
                elif self.ca_file is not None:
                    made = ssl.create_default_context(cafile=str(self.ca_file))
                else:
                    made = ssl.create_default_context()
                    made.load_verify_locations(certifi.where())
                self._context = made
            return self._context


# The resolver's answer that a name has no address (getaddrinfo(3)); the other failures (EAI_AGAIN: it could not
# answer now, EAI_FAIL) are retried
_NO_SUCH_NAME = frozenset(getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA", "EAI_ADDRFAMILY")
                          if hasattr(socket, name))
# OpenSSL's verify results (include/openssl/x509_vfy.h): no trust anchor for the chain, or a certificate for
# another name than the endpoint's
_UNTRUSTED = frozenset({2, 18, 19, 20, 21})  # UNABLE_TO_GET_ISSUER_CERT(_LOCALLY), SELF_SIGNED_..., LEAF_SIGNATURE
_OTHER_NAME = frozenset({62, 63, 64})  # HOSTNAME_MISMATCH, EMAIL_MISMATCH, IP_ADDRESS_MISMATCH


@dataclass(frozen=True)
class Peer:
    """The endpoint as the administrator wrote it, for error lines that say what failed in words, never
    only a Python class name ("connection failed: gaierror")."""

    hostname: str
    netloc: str
    ca_file: Path | None = None

    def failure(self, name: str, exc: OSError | http.client.HTTPException) -> CloudError:
        """A connection's failure as our error: what happened, to which host, and where to look."""
        if isinstance(exc, socket.gaierror):
            problem = f"cannot resolve the host name {self.hostname} ({exc.strerror})"
            fix = "check [opennebula] endpoint and the controller's resolver (/etc/hosts, /etc/resolv.conf)"
            if exc.errno in _NO_SUCH_NAME:
                return EndpointUnresolved(name, problem, fix)
            return TransientCloudError(f"[{name}] {problem}: {fix}")
        if isinstance(exc, ssl.SSLCertVerificationError):
            return EndpointUntrusted(name, *self._untrusted(exc))
        if isinstance(exc, ssl.SSLError):
            hint = ": it does not speak TLS (an http:// endpoint?)" if exc.reason == "WRONG_VERSION_NUMBER" else ""
            return TransientCloudError(f"[{name}] connection failed: TLS with {self.netloc} failed "
                                       f"({exc.reason or words(exc)}){hint}")
        if isinstance(exc, ConnectionRefusedError):
            said = f"{self.netloc} refused the connection (is oned running, listening on that port?)"
        elif isinstance(exc, http.client.RemoteDisconnected):
            said = f"{self.netloc} closed the connection without an answer"
        elif isinstance(exc, BrokenPipeError):
            said = f"{self.netloc} closed the connection while the call was sent"
        elif isinstance(exc, ConnectionResetError):
            said = f"{self.netloc} reset the connection"
        elif isinstance(exc, http.client.HTTPException):
            said = f"{self.netloc} answered no HTTP ({words(exc)})"
        else:
            said = f"{exc.strerror or words(exc)} ({self.netloc})"
        return TransientCloudError(f"[{name}] connection failed: {said}")

    def _untrusted(self, exc: ssl.SSLCertVerificationError) -> tuple[str, str]:
        """What is wrong with the endpoint's certificate, and the fix."""
        said = (exc.verify_message or words(exc)).rstrip(".")
        whose = f"the TLS certificate of {self.hostname}"
        if exc.verify_code in _OTHER_NAME:
            return (f"{whose} is for another host name ({said})", "name the front end in [opennebula] endpoint as "
                    f"its certificate does, or give it a certificate for {self.hostname}")
        if exc.verify_code in _UNTRUSTED and self.ca_file is None:
            return f"{whose} is not trusted ({said})", "set [opennebula] ca_file to the PEM file of the CA that " \
                "issued it"
        if exc.verify_code in _UNTRUSTED:
            return (f"{whose} is not trusted by [opennebula] ca_file {self.ca_file} ({said})",
                    "put the certificate of the CA that issued it in that file")
        return f"{whose} failed verification ({said})", "renew or replace it on the front end"


def words(exc: BaseException) -> str:
    """An exception's own words, short and on one line; its class name only when it has none."""
    text = " ".join(str(exc).split())
    return text[:160] if text else type(exc).__name__
