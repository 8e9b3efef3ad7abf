"""A real OpenNebula KVM host for the boot test: this machine, over ssh to 127.0.0.1, inside the test's own
network namespace (../shared/reference/real-kvm.md has the recipe and its pitfalls).

In the session's private network namespace (conftest.py) it makes a bridge for the VMs (BRIDGE at
BRIDGE_ADDR/24), and a private mount namespace (a holder process) where libvirtd's, sshd's and root's ssh
files are the instance's own, bound over /etc/libvirt/qemu.conf, /etc/libvirt/qemu, /run/libvirt,
/var/lib/libvirt, /var/log/libvirt, /var/cache/libvirt and /root/.ssh: nothing of the machine's own
configuration is changed. In that namespace run libvirtd, sshd (127.0.0.1:22 of the test's namespace) and
oned (tests/oned/start.sh with ONED_VM_MAD=qemu: oned's stock qemu driver, and OneGate on the bridge's
address). Then, over XML-RPC: the system and image datastores with the ssh transfer driver, the host
"localhost" with the qemu drivers (TCG), the network on the bridge, the worker image. Nothing leaves the
test's network namespace; stop() ends every process by pid.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import xml.etree.ElementTree as ET
import xmlrpc.client
from pathlib import Path

import onedfix
import vmnet

BRIDGE = "snpbr0"
BRIDGE_ADDR = "10.77.0.1"  # inside the test's network namespace only
FIRST_VM_ADDR = "10.77.0.100"
NEEDED = {"libvirtd": "libvirt-daemon-system", "virsh": "libvirt-clients", "sshd": "openssh-server",
          "ssh": "openssh-client", "ssh-keygen": "openssh-client", "qemu-system-x86_64": "qemu-system-x86",
          "qemu-img": "qemu-utils", "genisoimage": "genisoimage", "xorriso": "xorriso", "nsenter": "util-linux",
          "unshare": "util-linux", "ip": "iproute2", "rsync": "rsync",
          # oned's qemu host probe (im/kvm-probes.d/host/system/pci.rb) runs lspci: without it the host's first
          # monitoring fails and the host goes ERROR (a fresh machine's CI run)
          "lspci": "pciutils",
          # the kvm driver's deploy reads the new domain's name with xmllint: without it oned says "Empty deploy
          # ID for virtual machine" and the VM goes BOOT_FAILURE
          "xmllint": "libxml2-utils",
          # the image datastore's registration reads the image's size with jq (datastore/libfs.sh)
          "jq": "jq"}
QEMU_CONF = """\
# A libvirt for a machine without the usual services (tests/kvmhost.py)
user = "root"
group = "root"
dynamic_ownership = 0
remember_owner = 0
security_driver = "none"
cgroup_controllers = [ ]
namespaces = [ ]
stdio_handler = "file"
"""
SSHD_CONFIG = """\
ListenAddress 127.0.0.1
Port 22
HostKey {d}/sshd/host_ed25519
PidFile {d}/sshd/sshd.pid
AuthorizedKeysFile {d}/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
SetEnv RUBYLIB={d}/one/lib/ruby
"""
SSH_CONFIG = """\
Host localhost 127.0.0.1 {hostname}
    HostName 127.0.0.1
Host *
    User root
    IdentityFile /root/.ssh/id_ed25519
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    BatchMode yes
"""
BINDS = ("/etc/libvirt/qemu.conf", "/etc/libvirt/qemu", "/run/libvirt", "/var/lib/libvirt", "/var/log/libvirt",
         "/var/cache/libvirt", "/root/.ssh")


class KvmUnavailable(Exception):
    """This machine cannot run the KVM host; the message says what to install."""


def missing() -> str | None:
    """What keeps the host from running here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    if os.environ.get(vmnet.NETNS_ENV) != "isolated":
        return "needs the test session's private network namespace (sshd on port 22, a bridge)"
    lacking = sorted({pkg for tool, pkg in NEEDED.items() if shutil.which(tool) is None})
    if lacking:
        return f"needs {', '.join(lacking)}: apt-get install {' '.join(lacking)} (tests/setup-and-run.sh does)"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun (the VMs' tap devices)"
    return None


def kvm_usable() -> bool:
    """KVM acceleration for unmodified guests: /dev/kvm of a real kvm_intel/kvm_amd (kvm_pvm cannot run
    them: reference/real-kvm.md)."""
    return os.path.exists("/dev/kvm") and any(os.path.exists(f"/sys/module/{m}") for m in ("kvm_intel", "kvm_amd"))


def run(argv: list[str], timeout: float = 60, **kw: object) -> subprocess.CompletedProcess[str]:
    """A command that must succeed; its output in the error."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stdout[-500:]} {done.stderr[-800:]}")
    return done


class KvmHost:
    """The front end and the host, under root (a directory of its own)."""

    def __init__(self, root: Path, version: str, image: Path) -> None:
        self.root, self.version, self.image = root, version, image
        self.holder: subprocess.Popen[bytes] | None = None
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.oned: onedfix.RealOned | None = None
        self.console = root / "console.log"
        self.hypervisor = "kvm" if kvm_usable() else "qemu"
        self.image_name = "slurm-worker"
        self.times: dict[str, float] = {}

    # ---- the namespace ----------------------------------------------------------------------------
    def inside(self, argv: list[str]) -> list[str]:
        """argv run in the host's mount namespace."""
        assert self.holder is not None
        return ["nsenter", f"--target={self.holder.pid}", "--mount", "--", *argv]

    def start(self) -> KvmHost:
        """Everything, in order; stop() undoes what was started if any step fails."""
        t0 = time.monotonic()
        try:
            self._bridge()
            self._namespace()
            self._sshd()
            self._libvirtd()
            self.times["host daemons"] = time.monotonic() - t0
            self._oned()
            self.times["front end"] = time.monotonic() - t0
            self._setup()
            self.times["host MONITORED, image READY"] = time.monotonic() - t0
        except BaseException:
            self.stop()
            raise
        return self

    def _bridge(self) -> None:
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        run(["ip", "addr", "add", f"{BRIDGE_ADDR}/24", "dev", BRIDGE])
        run(["ip", "link", "set", BRIDGE, "up"])
        # The session looks in the main table before the local one (tests/vmnet.py): without this the
        # bridge's own address would be routed out onto the bridge rather than delivered here.
        run(["ip", "route", "replace", "local", BRIDGE_ADDR, "dev", BRIDGE, "table", "main"])

    def _namespace(self) -> None:
        d = self.root
        for sub in ("libvirt/qemu", "libvirt/run", "libvirt/lib", "libvirt/log", "libvirt/cache", "ssh", "sshd"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "libvirt/qemu.conf").write_text(QEMU_CONF)
        (d / "libvirt/libvirtd.conf").write_text(
            'unix_sock_group = "root"\nunix_sock_rw_perms = "0700"\nauth_unix_rw = "none"\nauth_unix_ro = "none"\n'
            f'log_outputs = "3:file:{d}/libvirt/libvirtd.log"\n')
        for path in ("/run/libvirt", "/root/.ssh", "/var/cache/libvirt", "/var/log/libvirt", "/var/lib/libvirt"):
            os.makedirs(path, mode=0o700, exist_ok=True)  # mount points (empty, as the packages leave them)
        (d / "ssh").chmod(0o700)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "ssh/id_ed25519")])
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "sshd/host_ed25519")])
        (d / "ssh/authorized_keys").write_text((d / "ssh/id_ed25519.pub").read_text())
        (d / "ssh/config").write_text(SSH_CONFIG.format(hostname=socket.gethostname()))
        (d / "sshd/sshd_config").write_text(SSHD_CONFIG.format(d=d))
        self.holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "infinity"],
                                       start_new_session=True)
        ours = os.readlink("/proc/self/ns/mnt")
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{self.holder.pid}/ns/mnt") == ours:
            if time.monotonic() > deadline:
                raise RuntimeError("the mount namespace's holder did not start")
            time.sleep(0.05)
        sources = {"/etc/libvirt/qemu.conf": d / "libvirt/qemu.conf", "/etc/libvirt/qemu": d / "libvirt/qemu",
                   "/run/libvirt": d / "libvirt/run", "/var/lib/libvirt": d / "libvirt/lib",
                   "/var/log/libvirt": d / "libvirt/log", "/var/cache/libvirt": d / "libvirt/cache",
                   "/root/.ssh": d / "ssh"}
        for target in BINDS:
            run(self.inside(["mount", "--bind", str(sources[target]), target]))

    def _daemon(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc = subprocess.Popen(self.inside(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True, env={**os.environ, **(env or {})})
        self.daemons.append(proc)
        return proc

    def _sshd(self) -> None:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        self._daemon(["/usr/sbin/sshd", "-D", "-e", "-f", str(self.root / "sshd/sshd_config")],
                     self.root / "sshd/sshd.log")
        self._wait(lambda: run(self.inside(["ssh", "127.0.0.1", "true"]), timeout=20), 30, "sshd answers")

    def _libvirtd(self) -> None:
        self._daemon(["/usr/sbin/libvirtd", "--config", str(self.root / "libvirt/libvirtd.conf")],
                     self.root / "libvirt/libvirtd.out")
        self._wait(lambda: run(self.virsh("version"), timeout=20), 60, "libvirtd answers")

    def virsh(self, *args: str) -> list[str]:
        """virsh against this host's libvirtd."""
        return self.inside(["virsh", "--connect", "qemu:///system", *args])

    def _oned(self) -> None:
        env = {"ONE_VERSION": self.version, "ONED_HOSTS": "0", "ONED_VM_MAD": "qemu", "ONED_ONEGATE_ADDR": BRIDGE_ADDR,
               "ONED_NET_IP": FIRST_VM_ADDR, "ONED_NET_SIZE": "20", "ONED_NO_BUILD": "1", "ONED_DS_INTERVAL": "4"}
        argv = self.inside(["bash", str(onedfix.SCRIPTS / "start.sh"), str(self.root / "one")])
        for attempt in (1, 2, 3):  # a start that failed under load (a driver took over 10 s to start): again
            done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
                                  check=False)
            if done.returncode in (0, onedfix.NOT_BUILT) or attempt == 3:
                break
            onedfix.script("stop.sh", self.root / "one")
        if done.returncode == onedfix.NOT_BUILT:
            raise KvmUnavailable(f"oned {self.version} is not built: run bash tests/oned/build.sh {self.version}")
        if done.returncode != 0:
            raise RuntimeError(f"oned {self.version} did not start: {done.stderr[-1500:]}")
        values = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
        self.oned = onedfix.RealOned(self.version, self.root / "one", values["ENDPOINT"], values["AUTH"],
                                     values["ONEGATE"], values["ADMIN_AUTH"])

    # ---- OpenNebula's side ------------------------------------------------------------------------
    def call(self, method: str, *args: object, session: str | None = None) -> object:
        """One XML-RPC call to oned as oneadmin (or `session`); RuntimeError with oned's words when it refuses."""
        assert self.oned is not None
        proxy = xmlrpc.client.ServerProxy(self.oned.endpoint)
        answer = getattr(proxy, method)(session or self.oned.admin, *args)
        if not answer[0]:
            raise RuntimeError(f"{method}: {answer[1]}")
        return answer[1]

    def xml(self, method: str, *args: object) -> ET.Element:
        """An info call's document."""
        return ET.fromstring(str(self.call(method, *args)))

    def _setup(self) -> None:
        remotes = self.root / "one/var/remotes"
        # Remotes that name /var/tmp/one (prediction.py, ...) get this instance's SCRIPTS_REMOTE_DIR.
        here = str(self.root / "one/var/tmp/one")
        for path in remotes.rglob("*"):
            if path.is_file() and not path.is_symlink():
                text = path.read_bytes()
                if b"/var/tmp/one" in text:
                    new = re.sub(rb"(?<![\w./-])/var/tmp/one(?![_\w])", here.encode(), text)
                    if new != text:
                        path.write_bytes(new)
        self.call("one.datastore.update", 0, 'TM_MAD = "ssh"', 1)
        self.call("one.datastore.update", 1, f'DS_MAD = "fs"\nTM_MAD = "ssh"\nSAFE_DIRS = "{self.image.parent}"', 1)
        net = int(self.xml("one.vnpool.info", -2, -1, -1).findtext("VNET/ID", "-1"))
        self.call("one.vn.update", net, f'BRIDGE = "{BRIDGE}"\nNETWORK_MASK = "255.255.255.0"\n'
                  'NETWORK_ADDRESS = "10.77.0.0"', 1)
        host = self._host()
        # The guest's serial console in a file (its boot, readable when it fails); qemu itself: no KVM wrapper.
        self.call("one.host.update", host, f'EMULATOR = "/usr/bin/qemu-system-x86_64"\nRAW = "<devices><serial '
                  f"type='file'><source path='{self.console}' append='on'/><target port='0'/></serial></devices>\"", 1)
        image = int(self.call("one.image.allocate", f'NAME = "{self.image_name}"\nPATH = "{self.image}"\nTYPE = "OS"\n'
                              'DEV_PREFIX = "vd"\nFORMAT = "qcow2"\n', 1, False,  # type: ignore[call-overload]
                              session=self.oned.auth))  # the Slurm user's own image (docs/installation.md)
        self._wait(lambda: self.xml("one.image.info", image).findtext("STATE") == "1" or None, 180, "image READY",
                   why=lambda: self.xml("one.image.info", image).findtext("TEMPLATE/ERROR") or "")

    def _host(self) -> int:
        """Host localhost with the qemu drivers, MONITORED; a host stuck in INIT is made again."""
        for attempt in range(3):
            host = int(self.call("one.host.allocate", "localhost", self.hypervisor, self.hypervisor, -1))  # type: ignore[call-overload]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                doc = self.xml("one.host.info", host)
                state = doc.findtext("STATE")
                if state == "2" and int(doc.findtext("HOST_SHARE/TOTAL_CPU", "0") or 0) > 0:
                    return host
                if state == "3":
                    raise RuntimeError(f"host localhost in ERROR: {doc.findtext('TEMPLATE/ERROR')}")
                time.sleep(1)
            self.call("one.host.delete", host)
            time.sleep(2)
            if attempt == 2:
                break
        raise RuntimeError("host localhost never MONITORED (see one/var/oned.log, monitor.log)")

    @staticmethod
    def _wait(check, seconds: float, what: str, why=lambda: "") -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + seconds
        last = ""
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                last = str(exc)
            time.sleep(0.5)
        raise RuntimeError(f"{what}: not within {seconds:.0f} s ({last} {why()})")

    # ---- the end ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Every domain destroyed, oned, libvirtd, sshd and the holder stopped, the bridge removed."""
        if self.holder is not None and self.holder.poll() is None:
            listed = subprocess.run(self.virsh("list", "--name"), capture_output=True, text=True, timeout=30,
                                    check=False)
            for name in listed.stdout.split():
                subprocess.run(self.virsh("destroy", name), capture_output=True, timeout=60, check=False)
        if self.oned is not None:
            onedfix.script("stop.sh", self.oned.root)
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.daemons:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.daemons.clear()
        # qemu, daemonized by libvirtd: anything left whose command line names this directory.
        for pid in self._strays():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait(5)
            self.holder = None
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)

    def _strays(self) -> list[int]:
        mark = str(self.root).encode()
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if mark in f.read():
                            found.append(int(entry))
                except OSError:
                    continue
        return found
