"""`kxlb lab demo`: a ClusterIP Service on the Kubernetes lab, end to end.

Brings the lab up (proxy kxlb by default; none when this checkout has no controller),
creates namespace ``demo`` with a Deployment of echo pods (each answers with its pod
name) and a ClusterIP Service, a client pod on the last node, then sends requests to the
Service from the client pod (TCP, UDP, HTTP) and from the external client namespace, and
prints which pod answered each one. The lab stays up.

With proxy ``none`` the demo programs the standalone datapath itself on every node
(``kxlb load`` on eth0 and the pod veths, ``kxlb service add`` with the ClusterIP and
the pod IPs the API server and the pod agents allocated).
"""
from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter

from . import kube
from .client import tcp_connect, tcp_exchange, udp_request
from .client import http_get
from .cluster import DEFAULT_WORKDIR, Lab, LabError
from .proxies import PROXY_MODES

NS = "demo"


def _kxlb(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "kxlb", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise LabError(f"kxlb {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def program_standalone(lab: Lab, vip: str, pods: list[dict]) -> None:
    """What a proxy would do, by hand: the datapath on every node, the Service's three
    ports with the pods as backends."""
    for n in lab.node_specs:
        ifaces = ["eth0"] + sorted(
            line.split(":")[1].strip().split("@")[0]
            for line in subprocess.run(["ip", "-n", n.netns, "-o", "link", "show"], capture_output=True,
                                       text=True).stdout.splitlines()
            if line.split(":")[1].strip().startswith("kxp"))
        _kxlb("--pin-dir", n.pin_dir, "load", "--netns", n.netns, *[x for i in ifaces for x in ("--iface", i)])
        ips = [p["status"]["podIP"] for p in pods]
        for svc, port in ((f"{vip}:80/tcp", 8080), (f"{vip}:80/udp", 8080), (f"{vip}:8000/tcp", 80)):
            _kxlb("--pin-dir", n.pin_dir, "service", "add", svc, *[f"{ip}:{port}" for ip in ips])
        print(f"  {n.name}: datapath on {', '.join(ifaces)}; {vip}:80/tcp, :80/udp, :8000/tcp -> "
              f"{', '.join(ips)} (pins in {n.pin_dir})")


def lb_demo(lab: Lab, node_of: dict, requests: int) -> None:
    """Service demo/web (type LoadBalancer over the same pods): the lab's pool gives it an
    IP; the outside client reaches it, and the NodePort of every node, with
    externalTrafficPolicy Cluster (masqueraded), then Local (only the entry node's pods,
    the client's address kept)."""
    api = lab.api_client()
    try:
        kube.create_service(api, NS, "web", selector={"app": "echo"}, type="LoadBalancer",
                            ports=[{"name": "tcp", "port": 80, "targetPort": "tcp", "protocol": "TCP"}])
        svc = kube.wait_for(lambda: (lambda s: s if (s.get("status", {}).get("loadBalancer") or {}).get("ingress")
                                     else None)(kube.read_service(api, NS, "web")), 30, "a load-balancer IP")
        lb_ip, node_port = svc["status"]["loadBalancer"]["ingress"][0]["ip"], svc["spec"]["ports"][0]["nodePort"]
        targets = [(f"LB IP {lb_ip}:80", lb_ip, 80)] + [(f"NodePort {n.ip}:{node_port} ({n.name})", n.ip, node_port)
                                                        for n in lab.node_specs]
        for policy in ("Cluster", "Local"):
            kube.patch_service(api, NS, "web", {"spec": {"externalTrafficPolicy": policy}})
            time.sleep(1.0)  # the proxies' sync
            print(f"\nService demo/web: LoadBalancer {lb_ip} (from the lab's pool), externalTrafficPolicy {policy}; "
                  f"the external client asks each pod which client address it saw:")
            for what, addr, port in targets:
                seen = Counter()
                for _ in range(requests):
                    try:
                        with tcp_connect(lab.client_ns, addr, port, timeout=1.0) as s:
                            who, peer = tcp_exchange(s, "clientip").split()[:2]
                        seen[f"{who} (on {node_of.get(who, '?')}) saw {peer.rsplit(':', 1)[0]}"] += 1
                    except OSError as exc:
                        seen[f"no answer ({type(exc).__name__})"] += 1
                print(f"  {what}:")
                for k, v in sorted(seen.items()):
                    print(f"    {v} x {k}")
        print(f"  (Cluster: any pod, the client masqueraded to a node address; Local: only the entry node's pods, "
              f"the client's own address {lab.client_ip} kept)")
    finally:
        api.close()


def run(workdir=DEFAULT_WORKDIR, proxy: str | None = None, requests: int = 6, replicas: int = 3,
        build: bool = True) -> None:
    """*proxy* None: the running lab's, else kxlb."""
    lab = Lab.from_workdir(workdir, **({"proxy": proxy} if proxy else {}))
    lab.up(build=build)
    mode = lab.proxy
    if PROXY_MODES[lab.proxy_requested].kind == "kxlb" and PROXY_MODES[mode].kind != "kxlb":
        print("note: `kxlb controller` is not available; the demo programs the standalone datapath itself\n")
    api = lab.api_client()
    try:
        kube.delete_namespace(api, NS, wait=True)
        kube.create_namespace(api, NS)
        kube.create_deployment(api, NS, "echo", replicas)
        # PreferDualStack: a cluster IP of each family the cluster has (the lab is dual-stack)
        svc = kube.create_service(api, NS, "echo", ipFamilyPolicy="PreferDualStack")
        last = lab.node_specs[-1]
        kube.create_pod(api, NS, "client", ports=[], node_name=last.name)
        pods = kube.wait_pods_ready(api, NS, "app=echo", replicas)
        kube.wait_pods_ready(api, NS, "app=client", 1)
        kube.wait_endpoints(api, NS, "echo", [a["ip"] for p in pods for a in p["status"]["podIPs"]
                                              if len(svc["spec"]["clusterIPs"]) > 1 or ":" not in a["ip"]])
    finally:
        api.close()
    vip = svc["spec"]["clusterIP"]
    vips = svc["spec"]["clusterIPs"]
    node_of = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods}
    print(f"\nDeployment demo/echo: {replicas} pods (image kxlab/echo, served by the pod agents):")
    for p in pods:
        print(f"  {p['metadata']['name']:28} {' '.join(a['ip'] for a in p['status']['podIPs']):32} "
              f"on {p['spec']['nodeName']}")
    print(f"Service demo/echo: ClusterIPs {', '.join(vips)}, ports 80/tcp (echo), 80/udp (echo), 8000/tcp (http)")
    print(f"client pod demo/client on {last.name}; proxy on the nodes: {mode}\n")
    if mode == "none":
        print("programming the standalone datapath (no proxy runs):")
        program_standalone(lab, vip, pods)
        print()

    client_ns = lab.resolve_target(f"{NS}/client")[0]
    time.sleep(1.0 if PROXY_MODES[mode].kind == "kube-proxy" else 0.3)  # the proxies' first sync after the EndpointSlice

    def tcp(ns: str, vip: str = vip) -> str:
        with tcp_connect(ns, vip, 80, timeout=1.0) as s:
            return tcp_exchange(s, "hello")

    for v in (vips if mode != "none" else [vip]):   # each family's cluster IP (standalone: IPv4's)
        shown = f"[{v}]" if ":" in v else v
        for proto, send in (("tcp", lambda: tcp(client_ns, v)),
                            ("udp", lambda: udp_request(client_ns, v, 80, "hello", timeout=1.0)[0]),
                            ("http", lambda: http_get(v, 8000, "/", ns=client_ns, timeout=1.0)[1])):
            seen = Counter()
            for i in range(requests):
                try:
                    who = send().split()[0]
                    seen[who] += 1
                    print(f"  pod demo/client -> {shown}:{8000 if proto == 'http' else 80}/{proto} #{i}: "
                          f"answered by {who} (on {node_of.get(who, '?')})")
                except OSError as exc:
                    print(f"  pod demo/client -> {shown}/{proto} #{i}: no answer ({exc})")
            print(f"  {shown} {proto}: {dict(sorted(seen.items()))}\n")

    entry = lab.node(1)
    print(f"external client {lab.client_ns} ({lab.client_ip}) -> {vip}:80/tcp, routed via {entry.name} "
          f"({entry.ip}):")
    seen, lost = Counter(), 0
    for i in range(requests):
        try:
            who = tcp(lab.client_ns).split()[0]
            seen[who] += 1
            print(f"  client #{i}: answered by {who} (on {node_of.get(who, '?')})")
        except OSError as exc:
            lost += 1
            print(f"  client #{i}: no answer ({exc})")
    print(f"  external: {dict(sorted(seen.items()))}, unanswered {lost}")
    if PROXY_MODES[mode].kind == "kube-proxy":
        print("  (kube-proxy masquerades ClusterIP traffic from outside the cluster CIDR, so every pod can answer)")
    elif lost:
        print(f"  A ClusterIP is not meant to be reachable from outside the cluster. The client routes it via "
              f"{entry.name}; when the proxy ({mode}) does not SNAT that traffic, a pod on another node answers "
              f"the client directly, not through {entry.name}, and the client drops the reply: only pods on "
              f"{entry.name} answer.")
    if mode != "none":
        lb_demo(lab, node_of, requests)
    kc = lab.kubeconfig
    wd = f" --workdir {lab.workdir}" if str(lab.workdir) != str(DEFAULT_WORKDIR) else ""
    print(f"""
The lab stays up. Try:
  kubectl --kubeconfig {kc} get pods -n {NS} -o wide
  kubectl --kubeconfig {kc} get endpointslices -n {NS}
  kxlb lab exec{wd} {NS}/client -- curl -s http://{vip}:8000/
  kxlb lab exec{wd} client -- python3 -c 'import socket; s=socket.create_connection(("{vip}", 80)); s.sendall(b"hi\\n"); print(s.recv(99))'
  kxlb lab exec{wd} node/{entry.name} -- ip route
  kxlb --pin-dir {entry.pin_dir} list        (kxlb or none: the node's datapath maps)
  kxlb lab status{wd}
  kxlb lab down{wd}""")
