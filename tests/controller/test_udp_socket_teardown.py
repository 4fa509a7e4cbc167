"""`kxlb controller` destroys the connected UDP sockets of host-network processes whose
endpoint left the Service (controller/socks.py), beside the UDP conntrack cleanup."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import BACKEND_PORT, READY, backend_ips, make_service, put_slice, wait_maps

# A host-network process of the node: one AF_INET and one dual-stack AF_INET6 socket
# (::ffff:VIP) connected to the Service, each waiting in recv() as a resolver would;
# once those fail, connect again and ask.
CHILD = r'''
import errno, json, socket, sys, threading
vip = sys.argv[1]
def sock(fam):
    if fam == "v4":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); a = vip
    else:
        s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); a = "::ffff:" + vip
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.settimeout(3); s.connect((a, 53)); return s
def ask(s):
    s.send(b"q"); return s.recv(100).decode().split()[0]
socks = {fam: sock(fam) for fam in ("v4", "v6")}
names = {fam: ask(s) for fam, s in socks.items()}
res = {}
def wait(fam):
    socks[fam].settimeout(20)
    try: res[fam] = "data " + socks[fam].recv(100).decode()
    except OSError as e: res[fam] = errno.errorcode.get(e.errno, str(e))
ts = [threading.Thread(target=wait, args=(f,)) for f in socks]
for t in ts: t.start()
print(json.dumps(names), flush=True)
for t in ts: t.join()
again = {}
for fam in socks:
    s = sock(fam); again[fam] = [ask(s), s.getpeername()[0].removeprefix("::ffff:")]
print(json.dumps({"errors": res, "again": again}), flush=True)
'''


def test_host_udp_sockets_to_a_removed_endpoint_are_destroyed(api, ns, lab, controller):
    svc = make_service(api, ns, "hostdns", [("dns", 53, "UDP")], [(ip, READY) for ip in backend_ips(lab)])
    ip = svc["spec"]["clusterIP"]
    wait_maps(lab, lambda m: len(m.get(f"{ip}:53/udp", [])) == 3)
    before = controller.metric("kxlb_udp_sockets_destroyed_total")
    # Into the node's cgroup first (`ip netns exec` remounts /sys), then its netns.
    child = subprocess.Popen(["sh", "-c", f"echo $$ > {controller.cgroup}/cgroup.procs && exec ip netns exec "
                              f"{lab.node} {sys.executable} -c \"$0\" \"$@\"", CHILD, ip],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        names = json.loads(child.stdout.readline() or "null")
        assert names, child.stderr.read()
        used = set(names.values())
        left = [b for i, b in enumerate(backend_ips(lab)) if f"be{i}" not in used]
        put_slice(api, ns, "hostdns", [(b, READY) for b in left], [("dns", BACKEND_PORT, "UDP")])
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
        child.wait()
    last = json.loads(out.splitlines()[-1]) if out.strip() else None
    assert last, err
    # Both waiting recv()s were woken by the teardown, well before their 20 s timeout;
    # the reconnects reach the backend that still serves, with the VIP as peer.
    assert last["errors"] == {"v4": "ECONNABORTED", "v6": "ECONNABORTED"}
    remaining = {f"be{i}" for i, b in enumerate(backend_ips(lab)) if b in left}
    for fam in ("v4", "v6"):
        assert last["again"][fam][0] in remaining and last["again"][fam][1] == ip
    assert controller.metric("kxlb_udp_sockets_destroyed_total") >= before + 2
