"""`kxlb controller` destroys the connected UDP sockets of host-network processes whose
endpoint left the Service (controller/socks.py), beside the UDP conntrack cleanup; a
pod's connected UDP socket is not the socket hooks' (they translate the node's
namespace only): its flow is tc's, and the conntrack cleanup moves it on."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import BACKEND_PORT, READY, backend_ips, make_service, put_slice, wait_maps


def run_child(controller, netns: str, code: str, vip: str, meanwhile) -> tuple:
    """Run ``code`` (argument: the VIP) in the node's cgroup and network namespace
    ``netns``: its first JSON line is given to ``meanwhile`` (the change under test),
    then it is told to go on; returns (first line, last line)."""
    # Into the cgroup first (`ip netns exec` remounts /sys), then the namespace.
    child = subprocess.Popen(["sh", "-c", f"echo $$ > {controller.cgroup}/cgroup.procs && exec ip netns exec "
                              f"{netns} {sys.executable} -c \"$0\" \"$@\"", code, vip],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(child.stdout.readline() or "null")
        assert first, child.stderr.read()
        meanwhile(first)
        out, err = child.communicate("go\n", timeout=30)
    finally:
        child.kill()
        child.wait()
    last = json.loads(out.splitlines()[-1]) if out.strip() else None
    assert last, err
    return first, last


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
    left = []

    def remove_the_used(names):
        left.extend(b for i, b in enumerate(backend_ips(lab)) if f"be{i}" not in set(names.values()))
        put_slice(api, ns, "hostdns", [(b, READY) for b in left], [("dns", BACKEND_PORT, "UDP")])

    _, last = run_child(controller, lab.node, CHILD, ip, remove_the_used)
    # Both waiting recv()s were woken by the teardown, well before their 20 s timeout;
    # the reconnects reach the backend that still serves, with the VIP as peer.
    assert last["errors"] == {"v4": "ECONNABORTED", "v6": "ECONNABORTED"}
    remaining = {f"be{i}" for i, b in enumerate(backend_ips(lab)) if b in left}
    for fam in ("v4", "v6"):
        assert last["again"][fam][0] in remaining and last["again"][fam][1] == ip
    assert controller.metric("kxlb_udp_sockets_destroyed_total") >= before + 2


# A pod's process (the lab's client namespace, in the node's cgroup as a real node's root
# cgroup holds its pods): one connected UDP socket to the Service, asking until its
# answer comes from another endpoint than the first (or 15 s pass, or the socket fails).
POD_CHILD = r"""
import errno, json, socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3); s.connect((sys.argv[1], 53))
def ask():
    s.send(b"q"); return s.recv(100).decode().split()[0]
first = ask()
print(json.dumps(first), flush=True)
sys.stdin.readline()                      # the parent removed that endpoint
res, t0 = {"answers": [], "lost": 0}, time.monotonic()
try:
    while time.monotonic() - t0 < 15 and (not res["answers"] or res["answers"][-1] == first):
        try:
            res["answers"].append(ask())
        except TimeoutError:      # an answer lost (below), not the socket failing
            res["lost"] += 1
        time.sleep(0.05)
except OSError as e:
    res["error"] = errno.errorcode.get(e.errno, str(e))
res["took"], res["peer"] = time.monotonic() - t0, s.getpeername()[0]
print(json.dumps(res), flush=True)
"""


def test_a_pods_udp_flow_to_a_removed_endpoint_moves_on(api, ns, lab, controller):
    """The pod's socket is connected to the VIP itself (the socket hooks leave a pod's
    namespace to tc): its datagrams are tc's flow, which the UDP conntrack cleanup
    deletes when the endpoint leaves, so the same socket's next datagram reaches a
    serving endpoint, the socket never failing. (Translated by the hooks as if it were
    the node's, it would stay on the removed endpoint: sock_diag sees only the node's
    namespace, and no conntrack entry exists to flush.)"""
    svc = make_service(api, ns, "poddns", [("dns", 53, "UDP")], [(ip, READY) for ip in backend_ips(lab)])
    ip = svc["spec"]["clusterIP"]
    wait_maps(lab, lambda m: len(m.get(f"{ip}:53/udp", [])) == 3)

    def remove_the_used(name):
        removed = backend_ips(lab)[int(name.removeprefix("be"))]
        put_slice(api, ns, "poddns", [(b, READY) for b in backend_ips(lab) if b != removed],
                  [("dns", BACKEND_PORT, "UDP")])

    first, res = run_child(controller, lab.client, POD_CHILD, ip, remove_the_used)
    assert "error" not in res and res["peer"] == ip
    assert res["answers"] and res["answers"][-1] != first and res["took"] < 10, res
    # At most the one datagram in flight when its flow was flushed: asked through the old
    # flow, answered after it went, that answer is not translated back and the socket
    # (connected to the VIP) drops it. kube-proxy loses it the same way (conntrack -D
    # while a reply is on its way); the resolver asks again, as the child does.
    assert res["lost"] <= 1, res
