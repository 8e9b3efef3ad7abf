#!/usr/bin/env python3
"""End-to-end check of an instance started by start.sh: python3 smoke.py DIR [HOSTS] [GPUS]

Instantiates slurm-gpu-worker HOSTS*GPUS times (all must reach RUNNING with a PCI device and an IP),
one more (must stay PENDING with a SCHED_MESSAGE), then has OneGate write READY=YES with the first VM's
token.  Prints timings; exit 1 on any failure.  Leaves the VMs (stop.sh throws everything away).
"""
from __future__ import annotations

import os
import sys
import time
import urllib.request
import xml.etree.ElementTree as ET
import xmlrpc.client


def env(directory: str) -> dict[str, str]:
    with open(os.path.join(directory, "env")) as f:
        return dict(line.strip().split("=", 1) for line in f if "=" in line)


def main() -> int:
    directory = sys.argv[1]
    hosts = int(sys.argv[2]) if len(sys.argv) > 2 else int(os.environ.get("ONED_HOSTS", "4"))
    gpus = int(sys.argv[3]) if len(sys.argv) > 3 else int(os.environ.get("ONED_GPUS", "1"))
    e = env(directory)
    auth, proxy = e["AUTH"], xmlrpc.client.ServerProxy(e["ENDPOINT"])

    def call(method: str, *args):
        answer = getattr(proxy, method)(auth, *args)
        if not answer[0]:
            raise RuntimeError(f"{method}{args}: {answer[1]}")
        return answer[1]

    def vm(vid: int) -> ET.Element:
        return ET.fromstring(call("one.vm.info", vid))

    print("version", call("one.system.version"))
    tid = int(ET.fromstring(call("one.templatepool.info", -2, -1, -1)).find(
        "VMTEMPLATE[NAME='slurm-gpu-worker']/ID").text)
    n = hosts * gpus
    t0 = time.monotonic()
    ids = [call("one.template.instantiate", tid, f"smoke-{i}", False, "", False) for i in range(n)]
    print(f"{n} instantiates in {time.monotonic() - t0:.2f} s: ids {ids}")
    pending = set(ids)
    deadline = time.monotonic() + 120
    while pending and time.monotonic() < deadline:
        for vid in list(pending):
            x = vm(vid)
            if x.findtext("STATE") == "3" and x.findtext("LCM_STATE") == "3":
                pending.discard(vid)
        time.sleep(0.2)
    if pending:
        print("NOT RUNNING:", sorted(pending))
        return 1
    print(f"all {n} RUNNING {time.monotonic() - t0:.2f} s after the first instantiate")
    seen = set()
    for vid in ids:
        x = vm(vid)
        pci = x.find("TEMPLATE/PCI")
        ip = x.findtext("TEMPLATE/NIC/IP")
        host = x.findtext("HISTORY_RECORDS/HISTORY[last()]/HOSTNAME")
        addr = pci.findtext("SHORT_ADDRESS") if pci is not None else None
        if pci is None or not ip or not addr:
            print(f"VM {vid}: no PCI or IP")
            return 1
        seen.add((host, addr))
        print(f"  VM {vid}: host {host} PCI {addr} ({pci.findtext('VENDOR')}:{pci.findtext('DEVICE')}) IP {ip}")
    if len(seen) != n:
        print("two VMs share a GPU:", seen)
        return 1
    t1 = time.monotonic()
    extra = call("one.template.instantiate", tid, "smoke-extra", False, "", False)
    msg = None
    while time.monotonic() - t1 < 60:
        x = vm(extra)
        msg = x.findtext("USER_TEMPLATE/SCHED_MESSAGE")
        if msg:
            break
        time.sleep(0.1)
    x = vm(extra)
    print(f"extra VM {extra}: STATE {x.findtext('STATE')} LCM {x.findtext('LCM_STATE')} after "
          f"{time.monotonic() - t1:.2f} s, SCHED_MESSAGE {msg!r}, IP {x.findtext('TEMPLATE/NIC/IP')}")
    if x.findtext("STATE") != "1" or not msg:
        return 1
    # OneGate
    first = ids[0]
    token_file = os.path.join(directory, "var", "vms", str(first), "token.txt")
    with open(token_file) as f:
        token = f.read().strip()
    ctx_token = vm(first).findtext("TEMPLATE/CONTEXT/ONEGATE_ENDPOINT")
    req = urllib.request.Request(e["ONEGATE"] + "/vm", data=b"READY=YES", method="PUT",
                                 headers={"X-ONEGATE-TOKEN": token, "X-ONEGATE-VMID": str(first)})
    t2 = time.monotonic()
    with urllib.request.urlopen(req, timeout=10) as r:
        status = r.status
    ready = vm(first).findtext("USER_TEMPLATE/READY")
    print(f"OneGate PUT /vm: HTTP {status} in {time.monotonic() - t2:.2f} s; USER_TEMPLATE/READY={ready!r};"
          f" CONTEXT ONEGATE_ENDPOINT={ctx_token}")
    bad = urllib.request.Request(e["ONEGATE"] + "/vm", data=b"READY=NO", method="PUT",
                                 headers={"X-ONEGATE-TOKEN": "wrong", "X-ONEGATE-VMID": str(first)})
    try:
        urllib.request.urlopen(bad, timeout=10)
        print("wrong token accepted")
        return 1
    except urllib.error.HTTPError as exc:
        print(f"wrong token: HTTP {exc.code}")
    if status != 200 or ready != "YES":
        return 1
    print("SMOKE OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
