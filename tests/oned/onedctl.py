#!/usr/bin/env python3
"""Helpers for start.sh: free ports, config edits, the dummy probe's GPUs, setup over XML-RPC, waits.

Standard library only (the host python may lack pyone).  Subcommands:
  ports N                        N distinct free 127.0.0.1 ports (free for TCP and UDP), one per line
  configure DIR KEY=VALUE...     edit DIR/etc/{oned,monitord,onegate-server,onehem-server}.conf
  probe FILE GPUS                make the dummy host probe report GPUS GPUs (buses 02, 03, ...)
  forced-probe DIR FILE          a VM status probe in DIR reporting the VM states a test writes to FILE
  wait-rpc ENDPOINT AUTH SECONDS PID   wait until oned answers one.system.version
  setup ENDPOINT AUTH HOSTS      markets off, dummy datastores, hosts, network, templates
  wait-ready ENDPOINT AUTH HOSTS GPUS SECONDS   every host MONITORED, datastore 0 TOTAL_MB > 0
"""
from __future__ import annotations

import os
import re
import socket
import sys
import time
import xml.etree.ElementTree as ET
import xmlrpc.client


def die(msg: str) -> None:
    print(f"onedctl: {msg}", file=sys.stderr)
    sys.exit(1)


# ---- ports --------------------------------------------------------------------------------------------

def free_ports(count: int) -> list[int]:
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            tcp.bind(("127.0.0.1", 0))
            port = tcp.getsockname()[1]
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                udp.bind(("127.0.0.1", port))
            except OSError:
                tcp.close()
                udp.close()
                continue
            held += [tcp, udp]
            ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


# ---- config edits -------------------------------------------------------------------------------------

def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def write(path: str, text: str) -> None:
    """Replace path's content, keeping its mode (the probes must stay executable)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, os.stat(path).st_mode & 0o7777)
    os.replace(tmp, path)


def blocks(text: str, name: str) -> list[tuple[int, int, str]]:
    """(start, end, body) of every uncommented `NAME = [ ... ]` block."""
    out = []
    for m in re.finditer(rf"^{name}\s*=\s*\[", text, re.M):
        end = text.index("]", m.end()) + 1
        out.append((m.start(), end, text[m.start():end]))
    return out


def drop_blocks(text: str, name: str, names: set[str]) -> str:
    """Remove NAME = [ ... ] blocks whose NAME attribute is in names."""
    for start, end, body in reversed(blocks(text, name)):
        m = re.search(r'\bNAME\s*=\s*"([^"]*)"', body, re.I)
        if m and m.group(1).lower() in names:
            text = text[:start] + text[end:].lstrip("\n")
    return text


def set_attr(text: str, name: str, value: str) -> str:
    """Set a single-line attribute: drop every uncommented definition, append one at the end."""
    text = re.sub(rf"^[ \t]*{name}[ \t]*=.*\n", "", text, flags=re.M)
    return text.rstrip("\n") + f"\n{name} = {value}\n"


def configure(directory: str, opts: dict[str, str]) -> None:
    etc = os.path.join(directory, "etc")
    oned_port, mon_port = opts["oned_port"], opts["monitord_port"]
    hm_pub, hm_rep, gate_port = opts["hm_pub_port"], opts["hm_rep_port"], opts["onegate_port"]

    # vm_mad=qemu (tests/kvm): oned's stock "qemu" VM_MAD and IM_MAD (libvirt, TCG, over ssh) stay, beside the
    # dummy ones; OneGate listens on every address of the test's namespace and oned tells the VMs its
    # address on their bridge (onegate_addr).
    qemu = opts.get("vm_mad", "dummy") == "qemu"
    keep = {"qemu"} if qemu else set()
    gate_addr = opts.get("onegate_addr", "127.0.0.1")
    path = os.path.join(etc, "oned.conf")
    text = read(path)
    text = drop_blocks(text, "VM_MAD", {"kvm", "qemu", "lxc", "dummy"} - keep)
    grpc = []
    if re.search(r"^GRPC_PORT\s*=", text, re.M):  # 7.4 (built with grpc=no, but keep it off the stock port)
        grpc = [("GRPC_PORT", opts["grpc_port"]), ("GRPC_LISTEN_ADDRESS", '"127.0.0.1"')]
    for name, value in [
        *grpc,
        ("PORT", oned_port),
        ("LISTEN_ADDRESS", '"127.0.0.1"'),
        ("MANAGER_TIMER", "2"),
        ("MONITORING_INTERVAL_DATASTORE", opts.get("ds_interval", "10")),
        ("DRS_INTERVAL", "-1"),
        ("SCRIPTS_REMOTE_DIR", os.path.join(directory, "var", "tmp", "one")),
        ("ONEGATE_ENDPOINT", f'"http://{gate_addr}:{gate_port}"'),
        ("SCHED_MAX_WND_TIME", opts.get("sched_wnd_time", "10")),
        ("SCHED_MAX_WND_LENGTH", opts.get("sched_wnd_length", "7")),
        ("SCHED_RETRY_TIME", opts.get("sched_retry_time", "5")),
        ("MAX_ACTIONS_PER_HOST", "1"),
        ("MAX_ACTIONS_PER_CLUSTER", "30"),
    ]:
        text = set_attr(text, name, value)
    # the hook manager's ZeroMQ publisher (-p) and replier (-l), bound to 127.0.0.1 (-b)
    hm = blocks(text, "HM_MAD")
    if len(hm) != 1:
        die(f"{path}: expected one HM_MAD block, found {len(hm)}")
    start, end, body = hm[0]
    new = re.sub(r'ARGUMENTS\s*=\s*"[^"]*"', f'ARGUMENTS = "-p {hm_pub} -l {hm_rep} -b 127.0.0.1"', body)
    text = text[:start] + new + text[end:]
    text += ('VM_MAD = [ NAME = "dummy", SUNSTONE_NAME = "Testing", EXECUTABLE = "one_vmm_dummy",\n'
             '  TYPE = "xml" ]\n')
    write(path, text)

    path = os.path.join(etc, "monitord.conf")
    text = read(path)
    text = drop_blocks(text, "IM_MAD", {"kvm", "qemu", "lxc", "dummy"} - keep)
    net = blocks(text, "NETWORK")
    if len(net) != 1:
        die(f"{path}: expected one NETWORK block, found {len(net)}")
    start, end, body = net[0]
    new = re.sub(r'(\bADDRESS\s*=\s*)"[^"]*"', r'\g<1>"127.0.0.1"', body)
    new = re.sub(r'(\bMONITOR_ADDRESS\s*=\s*)"[^"]*"', r'\g<1>"127.0.0.1"', new)
    new = re.sub(r'(\bPORT\s*=\s*)\d+', rf'\g<1>{mon_port}', new)
    if new.count("127.0.0.1") != 2 or mon_port not in new:
        die(f"{path}: could not set NETWORK ADDRESS/MONITOR_ADDRESS/PORT")
    text = text[:start] + new + text[end:]
    # The dummy IM runs a Ruby probe per host for each period (STATE_VM every 5 s as shipped): with tens
    # of hosts that is most of the machine.  The dummy driver moves VMs by its deploy answers, not by
    # these probes, so a benchmark with many hosts can stretch them.
    for key, name in (("state_vm", "STATE_VM"), ("monitor_vm", "MONITOR_VM")):
        if opts.get(key):
            text, n = re.subn(rf"(\b{name}\s*=\s*)\d+", rf"\g<1>{int(opts[key])}", text, count=1)
            if n != 1:
                die(f"{path}: could not set PROBES_PERIOD {name}")
    # 7.4 adds EXEC_VM (5 s as shipped): a Ruby probe per host reading the whole VM pool, for the results of
    # `onevm exec` through the QEMU guest agent, which dummy VMs never have.  It was most of the CPU in full
    # runs (three 7.4.0 front ends at once, load average 40 on 2 cores).  7.0 has no such probe.
    if opts.get("exec_vm"):
        text = re.sub(r"(\bEXEC_VM\s*=\s*)\d+", rf"\g<1>{int(opts['exec_vm'])}", text, count=1)
    text = text.rstrip("\n") + ('\nIM_MAD = [\n    NAME          = "dummy",\n    SUNSTONE_NAME = "Dummy",\n'
                                '    EXECUTABLE    = "one_im_sh",\n    ARGUMENTS     = "-r 3 -t 15 -w 90 dummy",\n'
                                '    THREADS       = 0\n]\n')
    write(path, text)

    path = os.path.join(etc, "onegate-server.conf")
    text = read(path)
    text, n1 = re.subn(r"^(\s*):one_xmlrpc:.*$", rf"\g<1>:one_xmlrpc: http://127.0.0.1:{oned_port}/RPC2",
                       text, flags=re.M)
    # 7.0: top-level :host:; 7.4: :server: with :bind: and an indented :port:
    bind = "0.0.0.0" if gate_addr != "127.0.0.1" else "127.0.0.1"  # 0.0.0.0: the test's own namespace only
    text, n2 = re.subn(r"^(\s*):(host|bind):.*$", rf"\g<1>:\g<2>: {bind}", text, count=1, flags=re.M)
    text, n3 = re.subn(r"^(\s*):port:\s*\d+\s*$", rf"\g<1>:port: {gate_port}", text, count=1, flags=re.M)
    if not (n1 and n2 and n3):
        die(f"{path}: could not set :one_xmlrpc:/:host:/:port: ({n1} {n2} {n3})")
    write(path, text)

    if qemu:
        kvm_defaults(os.path.join(etc, "vmm_exec", "vmm_exec_kvm.conf"))

    path = os.path.join(etc, "onehem-server.conf")
    if os.path.exists(path):
        text = read(path)
        text = re.sub(r"^(\s*):subscriber_endpoint:.*$", rf"\g<1>:subscriber_endpoint: 'tcp://127.0.0.1:{hm_pub}'",
                      text, flags=re.M)
        text = re.sub(r"^(\s*):replier_endpoint:.*$", rf"\g<1>:replier_endpoint: 'tcp://127.0.0.1:{hm_rep}'",
                      text, flags=re.M)
        text = re.sub(r"^(\s*):one_xmlrpc:.*$", rf"\g<1>:one_xmlrpc: http://127.0.0.1:{oned_port}/RPC2",
                      text, flags=re.M)
        text = re.sub(r"^(\s*):hook_base_path:.*$",
                      rf"\g<1>:hook_base_path: '{os.path.join(directory, 'var', 'remotes', 'hooks')}'",
                      text, flags=re.M)
        write(path, text)


def kvm_defaults(path: str) -> None:
    """The KVM driver's defaults for a machine without vhost-net, for the worker image's cloud kernel:
    no VIRTIO_QUEUES ("vhost-net was requested ... but is unavailable"), and machine type pc (7.4's default
    q35 puts the context CD on SATA, which a cloud kernel without AHCI never sees)."""
    text = read(path)
    text, n1 = re.subn(r"^OS\s*=\s*\[[^\]]*\]", 'OS = [\n    ARCH = "x86_64",\n    MACHINE = "pc"\n]', text,
                       count=1, flags=re.M)
    text, n2 = re.subn(r"^NIC\s*=\s*\[[^\]]*\]", 'NIC = [\n    MODEL = "virtio"\n]', text, count=1, flags=re.M)
    if not (n1 and n2):
        die(f"{path}: could not set OS and NIC ({n1} {n2})")
    write(path, text)


# ---- dummy probe --------------------------------------------------------------------------------------

def probe(path: str, gpus: int) -> None:
    """Replace the stock probe's one GPU (bus 02) by `gpus` copies on buses 02, 03, ..."""
    text = read(path)
    m = re.search(r'^([ \t]*)PCI = \[ ADDRESS = "0000:02:00:0",.*?^[ \t]*\]\n', text, re.M | re.S)
    if not m:
        die(f"{path}: the stock GPU entry (0000:02:00:0) was not found")
    block = m.group(0)
    copies = []
    for i in range(gpus):
        bus = f"{2 + i:02x}"
        b = block.replace('"0000:02:00:0"', f'"0000:{bus}:00:0"')
        b = b.replace('BUS = "02"', f'BUS = "{bus}"').replace('"02:00.0"', f'"{bus}:00.0"')
        copies.append(b)
    write(path, text[:m.start()] + "".join(copies) + text[m.end():])


FORCED_PROBE = """#!/bin/sh
# The VM states a test forces, as a hypervisor's monitor would report them (tests/oned, onedfix.RealOned
# force_vm_state): lines "<host id> <vm id> <STATE>" in {states}; STATE POWEROFF (a killed qemu), FAILURE
# (oned: UNKNOWN). oned ignores a report within 30 s of the VM's last state change.
cat >/dev/null
[ -f {states} ] || exit 0
exec awk -v host="$2" '$1 == host {{
    printf "VM = [ ID=\\"%s\\", DEPLOY_ID=\\"one-%s\\", STATE=\\"%s\\" ]\\n", $2, $2, $3 }}' {states}
"""


def forced_probe(directory: str, states: str) -> None:
    """The dummy IM runs every executable in vm/status each STATE_VM period (5 s): add one that reports
    the VM states a test forces; no file, no report."""
    path = os.path.join(directory, "forced_states.sh")
    with open(path, "w", encoding="utf-8") as f:
        f.write(FORCED_PROBE.format(states=states))
    os.chmod(path, 0o755)


# ---- XML-RPC ------------------------------------------------------------------------------------------

class One:
    def __init__(self, endpoint: str, auth: str, timeout: float = 10.0):
        self.auth = auth
        self.proxy = xmlrpc.client.ServerProxy(endpoint, transport=_TimeoutTransport(timeout), allow_none=False)

    def call(self, method: str, *args):
        answer = getattr(self.proxy, method)(self.auth, *args)
        if not answer[0]:
            raise RuntimeError(f"{method}: {answer[1]}")
        return answer[1]

    def xml(self, method: str, *args) -> ET.Element:
        return ET.fromstring(self.call(method, *args))


class _TimeoutTransport(xmlrpc.client.Transport):
    def __init__(self, timeout: float):
        super().__init__()
        self._timeout = timeout

    def make_connection(self, host):  # type: ignore[override]
        conn = super().make_connection(host)
        conn.timeout = self._timeout
        return conn


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_rpc(endpoint: str, auth: str, seconds: float, pid: int) -> None:
    one = One(endpoint, auth, timeout=3)
    deadline = time.monotonic() + seconds
    last = ""
    while time.monotonic() < deadline:
        if not alive(pid):
            die(f"oned (pid {pid}) exited before answering on {endpoint}")
        try:
            version = one.call("one.system.version")
            print(version)
            return
        except Exception as exc:
            last = str(exc)
        time.sleep(0.2)
    die(f"oned did not answer on {endpoint} within {seconds:.0f} s (last error: {last})")


def wait_http(url: str, seconds: float, pid: int) -> None:
    """Until url answers HTTP at all (OneGate answers 401 without a token)."""
    import urllib.error
    import urllib.request
    deadline = time.monotonic() + seconds
    last = ""
    while time.monotonic() < deadline:
        if not alive(pid):
            die(f"pid {pid} exited before {url} answered")
        try:
            urllib.request.urlopen(url, timeout=3).close()
            return
        except urllib.error.HTTPError:
            return
        except Exception as exc:
            last = str(exc)
        time.sleep(0.2)
    die(f"{url} did not answer within {seconds:.0f} s (last error: {last})")


def procs(directory: str) -> list[int]:
    """Pids of processes of this instance: ONE_LOCATION=DIR in their environment, or DIR/ in their
    command line; never this process nor its ancestors."""
    skip = set()
    pid = os.getpid()
    while pid > 1:
        skip.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    env_mark = f"ONE_LOCATION={directory}".encode()
    cmd_mark = (directory.rstrip("/") + "/").encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if env_mark in environ or cmd_mark in cmdline:
            found.append(int(entry))
    return found


HOST_STATES = {0: "INIT", 1: "MONITORING_MONITORED", 2: "MONITORED", 3: "ERROR", 4: "DISABLED",
               5: "MONITORING_ERROR", 6: "MONITORING_INIT", 7: "MONITORING_DISABLED", 8: "OFFLINE"}

NET_NAME = "slurm-net"
IMAGE_NAME = "slurm-worker"  # the name `image build` suggests

GPU_TEMPLATE = f'''NAME = "slurm-gpu-worker"
CPU = "0.1"
VCPU = "1"
MEMORY = "128"
PCI = [ VENDOR = "10de", CLASS = "0302" ]
NIC = [ NETWORK = "{NET_NAME}", NETWORK_UNAME = "oneadmin" ]
OS = [ ARCH = "x86_64" ]
CONTEXT = [ NETWORK = "YES", TOKEN = "YES", REPORT_READY = "YES", SET_HOSTNAME = "$NAME" ]
'''

CPU_TEMPLATE = f'''NAME = "slurm-cpu-worker"
CPU = "0.05"
VCPU = "1"
MEMORY = "64"
NIC = [ NETWORK = "{NET_NAME}", NETWORK_UNAME = "oneadmin" ]
OS = [ ARCH = "x86_64" ]
CONTEXT = [ NETWORK = "YES", TOKEN = "YES", REPORT_READY = "YES", SET_HOSTNAME = "$NAME" ]
'''


def setup(endpoint: str, auth: str, hosts: int, net_ip: str, net_size: int) -> None:
    one = One(endpoint, auth)
    # no internet here: the public marketplaces must never be monitored (their drivers are stubbed too)
    for m in one.xml("one.marketpool.info").findall("MARKETPLACE"):
        mid = int(m.findtext("ID", "-1"))
        if m.findtext("STATE", "0") != "1":
            one.call("one.market.enable", mid, False)
    one.call("one.datastore.update", 0, 'TM_MAD = "dummy"', 1)
    for ds in (1, 2):
        one.call("one.datastore.update", ds, 'DS_MAD = "dummy"\nTM_MAD = "dummy"', 1)
    for i in range(hosts):
        one.call("one.host.allocate", f"gpu-host-{i + 1:02d}", "dummy", "dummy", -1)
    one.call("one.vn.allocate",
             f'NAME = "{NET_NAME}"\nVN_MAD = "dummy"\nBRIDGE = "br0"\n'
             f'AR = [ TYPE = "IP4", IP = "{net_ip}", SIZE = "{net_size}" ]\n', -1)
    if os.environ.get("ONED_SLURM_USER", "1") == "0":
        # Left to the test that follows docs/installation.md's steps with the CLI: oneadmin's templates, and
        # the image those steps give the Slurm user.
        image = f'NAME = "{IMAGE_NAME}"\nPATH = "/dev/null"\nTYPE = "OS"\nSIZE = "1"\n'
        one.call("one.image.allocate", image, 1, True)  # True: no capacity check (datastore 1 not monitored yet)
        one.call("one.template.allocate", GPU_TEMPLATE)
        one.call("one.template.allocate", CPU_TEMPLATE)
        print(auth)
        return
    session = slurm_user(one)
    user = One(endpoint, session)  # the templates are the Slurm user's own, as docs/installation.md makes them
    user.call("one.template.allocate", GPU_TEMPLATE)
    user.call("one.template.allocate", CPU_TEMPLATE)
    print(session)


# acl.rb's values: who (#uid, @gid, *), what (object types, with #id or *), rights, zone.
ACL_GID, ACL_ALL = 0x200000000, 0x400000000
ACL_CREATED = (0x1000000000 | 0x8000000000 | 0x20000000000 | 0x400000000000 | 0x1000000000000 | 0x4000000000000
               | 0x20000000000000 | 0x100000000000000)  # VM+IMAGE+TEMPLATE+DOCUMENT+SECGROUP+VROUTER+VMGROUP+BACKUPJOB
ACL_CREATE, ACL_USE, ACL_HOST = 0x8, 0x1, 0x2000000000
SLURM_USER = "slurm"


def slurm_user(one: One) -> str:
    """The OpenNebula user the programs act as, made as docs/installation.md ("The OpenNebula side") makes it:
    its own group (which oned adds to the default VDC: USE of the networks and datastores, MANAGE of the
    hosts), the CREATE rule `onegroup create` adds for a group's users, USE of the hosts (the host pool: the
    VDC's MANAGE does not list them), and recover and deploy (direct placement) at MANAGE. Its session
    `slurm:<password>`."""
    gid = int(one.call("one.group.allocate", SLURM_USER))
    one.call("one.acl.addrule", f"{ACL_GID | gid:x}", f"{ACL_CREATED | ACL_ALL:x}", f"{ACL_CREATE:x}", f"{ACL_ALL:x}")
    one.call("one.acl.addrule", f"{ACL_GID | gid:x}", f"{ACL_HOST | ACL_ALL:x}", f"{ACL_USE:x}", f"{ACL_ALL:x}")
    password = os.urandom(16).hex()
    uid = int(one.call("one.user.allocate", SLURM_USER, password, "core", [gid]))
    one.call("one.user.update", uid, 'VM_MANAGE_OPERATIONS = "recover, deploy"', 1)
    return f"{SLURM_USER}:{password}"


def wait_ready(endpoint: str, auth: str, hosts: int, gpus: int, seconds: float) -> None:
    """Every host MONITORED with its system probe in (CPU > 0, `gpus` GPUs listed), datastore 0 TOTAL_MB > 0."""
    one = One(endpoint, auth)
    deadline = time.monotonic() + seconds
    state = ""
    retried: dict[str, int] = {}
    while time.monotonic() < deadline:
        pool = one.xml("one.hostpool.info")
        ready = 0
        parts = []
        for h in pool.findall("HOST"):
            st = int(h.findtext("STATE", "-1"))
            cpu = int(h.findtext("HOST_SHARE/TOTAL_CPU", "0") or 0)
            ngpu = sum(1 for p in h.findall("HOST_SHARE/PCI_DEVICES/PCI") if p.findtext("CLASS") == "0302")
            parts.append(f"{h.findtext('NAME')}={HOST_STATES.get(st, st)}/cpu {cpu}/gpus {ngpu}")
            name = h.findtext("NAME") or ""
            if st == 3 and retried.get(name, 0) < 3:
                # On a loaded machine a dummy host's first monitoring can time out ("Error parsing start
                # message"); enabling it again (ERROR -> INIT) starts its monitoring again.
                retried[name] = retried.get(name, 0) + 1
                print(f"onedctl: host {name} in ERROR ({h.findtext('TEMPLATE/ERROR')}): enabling it again "
                      f"({retried[name]} of 3)", file=sys.stderr)
                one.call("one.host.status", int(h.findtext("ID", "-1")), 0)
            elif st == 3:
                die(f"host {h.findtext('NAME')} is in ERROR: {h.findtext('TEMPLATE/ERROR')}")
            ready += st == 2 and cpu > 0 and ngpu == gpus
        total = int(one.xml("one.datastore.info", 0).findtext("TOTAL_MB", "0") or 0)
        state = ", ".join(parts) + f"; datastore 0 TOTAL_MB={total}"
        if len(parts) == hosts and ready == hosts and total > 0:
            return
        time.sleep(0.3)
    die(f"not ready within {seconds:.0f} s: {state}")


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        die(__doc__ or "usage")
    cmd, args = argv[1], argv[2:]
    if cmd == "ports":
        print("\n".join(map(str, free_ports(int(args[0])))))
    elif cmd == "configure":
        configure(args[0], dict(a.split("=", 1) for a in args[1:]))
    elif cmd == "probe":
        probe(args[0], int(args[1]))
    elif cmd == "forced-probe":
        forced_probe(args[0], args[1])
    elif cmd == "wait-rpc":
        wait_rpc(args[0], args[1], float(args[2]), int(args[3]))
    elif cmd == "wait-http":
        wait_http(args[0], float(args[1]), int(args[2]))
    elif cmd == "procs":
        print("\n".join(map(str, procs(args[0]))))
    elif cmd == "setup":
        setup(args[0], args[1], int(args[2]), args[3], int(args[4]))
    elif cmd == "wait-ready":
        wait_ready(args[0], args[1], int(args[2]), int(args[3]), float(args[4]))
    else:
        die(f"unknown command {cmd}")


if __name__ == "__main__":
    main(sys.argv)
