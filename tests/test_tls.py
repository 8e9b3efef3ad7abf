"""An https:// endpoint with a site's own CA ([opennebula] ca_file, issue 32): a real TLS proxy on 127.0.0.1
in front of the simulator, its CA and certificates made here with the openssl command. With ca_file the
programs work; without it, or with a certificate for another host name, one line says so and names the fix,
and nothing (no session) reaches the simulator."""

from __future__ import annotations

import json
import select
import shutil
import socket
import ssl
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from reliability_support import run_program
from simfixtures import AUTH
from support import Setup, make_setup, run_env
from test_cli import program

from slurm_nebula_power.errors import EXIT_CONFIG, EXIT_NODES_FAILED, EXIT_OK

OPENSSL = shutil.which("openssl")
pytestmark = pytest.mark.skipif(OPENSSL is None, reason="needs the openssl command (apt-get install openssl)")


@dataclass(frozen=True)
class Pki:
    """A site CA and a server certificate it issued."""

    ca: Path
    cert: Path
    key: Path


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run([str(OPENSSL), *args], cwd=directory, check=True, capture_output=True, timeout=60)


def make_pki(directory: Path, san: str) -> Pki:
    """A CA (EC P-256, two days) and a server certificate for subjectAltName `san` (IP:127.0.0.1 or DNS:...)."""
    directory.mkdir(parents=True)
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(directory, "req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=Test site CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    _openssl(directory, "req", *curve, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=front end")
    (directory / "server.ext").write_text(f"subjectAltName = {san}\nbasicConstraints = CA:FALSE\n"
                                          "keyUsage = digitalSignature\nextendedKeyUsage = serverAuth\n"
                                          "subjectKeyIdentifier = hash\nauthorityKeyIdentifier = keyid\n")
    _openssl(directory, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "server.ext")
    return Pki(directory / "ca.pem", directory / "server.pem", directory / "server.key")


class TlsProxy:
    """TLS on 127.0.0.1 (the given certificate) in front of a plain-HTTP endpoint: each connection whose
    handshake succeeds is forwarded byte for byte; `forwarded` counts them."""

    def __init__(self, backend: str, pki: Pki) -> None:
        host, port = backend.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        self.backend = (host, int(port))
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(pki.cert, pki.key)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.forwarded = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.sock.getsockname()[1]}/RPC2"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            tls = self.context.wrap_socket(raw, server_side=True)  # the client refuses our certificate: ends here
        except (ssl.SSLError, OSError):
            raw.close()
            return
        self.forwarded += 1
        with tls, socket.create_connection(self.backend, timeout=30) as upstream:
            try:
                while True:
                    ready = [tls] if tls.pending() else select.select([tls, upstream], [], [], 30)[0]
                    if not ready:
                        return
                    for side in ready:
                        data = side.recv(65536)
                        if not data:
                            return
                        (upstream if side is tls else tls).sendall(data)
            except (ssl.SSLError, OSError):
                return

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def tls_site(tmp_path, sim):
    """A deployment whose endpoint is the simulator behind a TLS proxy with the site CA's certificate for
    127.0.0.1; `ca_file` not yet set."""
    pki = make_pki(tmp_path / "pki", "IP:127.0.0.1")
    proxy = TlsProxy(sim.endpoint, pki)
    yield make_setup(tmp_path / "site", proxy.endpoint, AUTH), proxy, pki
    proxy.close()


def with_ca_file(setup: Setup, ca: Path) -> Setup:
    setup.config.write_text(setup.config.read_text().replace("timeout = 5\n", f'timeout = 5\nca_file = "{ca}"\n'))
    return setup


def power(setup: Setup, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([program("slurm-nebula-power"), *args], env=run_env(setup), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)


def test_with_the_site_ca_in_ca_file_check_and_resume_work_over_tls(tls_site, sim) -> None:
    setup, proxy, pki = tls_site
    with_ca_file(setup, pki.ca)
    done = power(setup, "check", "--json")
    [reached] = [f for f in json.loads(done.stdout) if f["subject"] == f"OpenNebula {proxy.endpoint}"]
    assert reached["level"] == "ok" and reached["text"].startswith("oned 6.10.0, user oneadmin"), reached
    resumed = run_program(setup, "resume", "gpu01")
    assert resumed.returncode == EXIT_OK, resumed.stderr + setup.log_text()
    assert [vm.name for vm in sim.vms()] == ["gpu01"] and proxy.forwarded > 0


def test_without_ca_file_the_error_says_the_certificate_is_not_trusted_and_names_ca_file(tls_site, sim) -> None:
    setup, proxy, _ = tls_site
    done = power(setup, "status", "--no-slurm")
    assert done.returncode == EXIT_CONFIG, done.stderr  # never retried: the certificate stays what it is
    [line] = done.stderr.splitlines()
    assert line == (f"slurm-nebula-power status: error: OpenNebula at {proxy.endpoint} ({setup.config}): "
                    "[one.vmpool.infoextended] the TLS certificate of 127.0.0.1 is not trusted (unable to get "
                    "local issuer certificate): set [opennebula] ca_file to the PEM file of the CA that issued "
                    "it"), line
    [found] = [f for f in json.loads(power(setup, "check", "--json").stdout)
               if f["subject"] == f"OpenNebula {proxy.endpoint}" and f["level"] == "problem"]
    assert (found["text"], found["fix"]) == ("the TLS certificate of 127.0.0.1 is not trusted (unable to get local "
                                             "issuer certificate)", "set [opennebula] ca_file to the PEM file of the "
                                             "CA that issued it")
    resumed = run_program(setup, "resume", "gpu01")
    assert resumed.returncode == EXIT_NODES_FAILED
    [update] = [u for u in setup.updates() if "State=POWER_DOWN_FORCE" in u]
    assert update[-1].startswith("Reason=nebula: OpenNebula: [one.templatepool.info] the TLS certificate of "
                                 "127.0.0.1 is not trusted"), update
    assert proxy.forwarded == 0 and sum(sim.stats()["calls"].values()) == 0, "the session was never sent"


def test_a_certificate_for_another_host_name_is_said_so(tmp_path, sim) -> None:
    pki = make_pki(tmp_path / "pki", "DNS:frontend.example")  # trusted CA, but not issued for 127.0.0.1
    proxy = TlsProxy(sim.endpoint, pki)
    try:
        setup = with_ca_file(make_setup(tmp_path / "site", proxy.endpoint, AUTH), pki.ca)
        done = power(setup, "status", "--no-slurm")
    finally:
        proxy.close()
    assert done.returncode == EXIT_CONFIG
    [line] = done.stderr.splitlines()
    assert line.endswith("[one.vmpool.infoextended] the TLS certificate of 127.0.0.1 is for another host name "
                         "(IP address mismatch, certificate is not valid for '127.0.0.1'): name the front end in "
                         "[opennebula] endpoint as its certificate does, or give it a certificate for 127.0.0.1"), line
    assert proxy.forwarded == 0 and sum(sim.stats()["calls"].values()) == 0


def test_a_certificate_of_another_ca_than_ca_file_s_is_not_trusted_by_it(tls_site, tmp_path, sim) -> None:
    setup, proxy, _ = tls_site
    other = make_pki(tmp_path / "other", "IP:127.0.0.1")  # ca_file holds a CA, not the one that issued it
    with_ca_file(setup, other.ca)
    done = power(setup, "status", "--no-slurm")
    [line] = done.stderr.splitlines()
    assert f"the TLS certificate of 127.0.0.1 is not trusted by [opennebula] ca_file {other.ca} (" in line, line
    assert line.endswith("put the certificate of the CA that issued it in that file"), line
    assert proxy.forwarded == 0


def test_check_warns_of_a_ca_file_on_a_plain_http_endpoint_and_of_one_others_can_write(tmp_path, sim) -> None:
    pki = make_pki(tmp_path / "pki", "IP:127.0.0.1")
    setup = with_ca_file(make_setup(tmp_path / "site", sim.endpoint, AUTH), pki.ca)
    pki.ca.chmod(0o666)
    found = json.loads(power(setup, "check", "--json").stdout)
    [unused] = [f for f in found if f["level"] == "warning" and "ca_file" in f["text"]]
    assert unused["text"] == f"ca_file {pki.ca} is set, but the endpoint is plain http: the CA is not used"
    [loose] = [f for f in found if f["subject"] == f"[opennebula] ca_file {pki.ca}"]
    assert loose["level"] == "problem" and "other users can change it" in loose["text"], loose
