"""The same Service checks through real kube-proxy (nftables) and through kxlb: every
kube-proxy behaviour the lab can show must be kxlb's too."""
from __future__ import annotations

import sys
from collections import Counter

import pytest

from conftest import echo_service_and_client
from kxlb.lab import kube
from kxlb.lab.client import tcp_request, udp_request
from kxlb.lab.client import http_get


@pytest.mark.parametrize("proxy", ["kube-proxy", "kxlb"])
def test_clusterip_from_pods_outside_host_network_and_hairpin(with_proxy, k8s, proxy):
    lab = with_proxy(proxy)
    vip, names, pods, cns = echo_service_and_client(lab, k8s)

    def all_answer(send, what: str) -> Counter:
        seen: Counter = Counter()

        def more():
            try:
                seen[send().split()[0]] += 1
            except OSError:
                pass
            return set(seen) == names
        kube.wait_for(more, 30, f"{proxy}: {what}: every pod answers (so far {dict(seen)})", interval=0.05)
        assert set(seen) <= names
        return seen

    all_answer(lambda: tcp_request(cns, vip, 80)[0], "tcp from a pod")
    all_answer(lambda: udp_request(cns, vip, 80)[0], "udp from a pod")
    all_answer(lambda: http_get(vip, 8000, "/", ns=cns)[1], "http from a pod")
    # From outside the cluster CIDR (via node 1): masqueraded, so pods on node 2 answer too.
    all_answer(lambda: tcp_request(lab.client_ns, vip, 80)[0], "tcp from the external client")
    # Hairpin: a backend reaching its own service; sometimes it picks itself.
    me = pods[0]
    mns = lab.resolve_target(f"{k8s.name}/{me['metadata']['name']}")[0]
    all_answer(lambda: tcp_request(mns, vip, 80)[0], "tcp from a backend (hairpin included)")
    # The host network of a node (kxlb: socket-level hooks in the node's cgroup).
    r = lab.run_in("node/1", [sys.executable, "-c", f"import urllib.request as u; "
                              f"print(u.build_opener(u.ProxyHandler({{}})).open('http://{vip}:8000/').read().decode())"])
    assert r.returncode == 0 and r.stdout.strip() in names, r.stderr
    # A service without endpoints is rejected at once (ICMP port unreachable), not dropped.
    empty = k8s.service("nobody", selector={"app": "nobody"})

    def refused() -> bool:
        try:
            tcp_request(cns, empty["spec"]["clusterIP"], 80, timeout=1)
        except ConnectionRefusedError:
            return True
        except OSError:
            pass
        return False
    kube.wait_for(refused, 30, f"{proxy}: a service without endpoints refuses connections", interval=0.1)


def node_maps(lab, vip: str, port: int = 80) -> list[list[str]]:
    """Backends of VIP:port/tcp in every node's pinned maps."""
    from kxlb.loader.layout import ServiceKey
    from kxlb.loader.maps import Maps
    from kxlb.loader.services import ServiceTable

    out = []
    for i in (1, 2):
        with Maps.open(lab.node(i).pin_dir) as maps:
            st = ServiceTable(maps).get(ServiceKey(vip, port, 6))
            out.append(sorted(b.addr for b in st.backends) if st else None)
    return out


def test_kxlb_follows_deployments_scaling_and_deletion(with_proxy, k8s):
    """Deployments and Services through their life: every node's maps and real traffic
    follow the EndpointSlice controller's view."""
    from kubernetes import client

    lab = with_proxy("kxlb")
    k8s.deployment("web", 3)
    svc = k8s.service("web")
    client_pod = k8s.pod("client", ports=[], node_name=lab.node(1).name)
    k8s.ready_pods("app=client", 1)
    cns = lab.resolve_target(f"{k8s.name}/{client_pod['metadata']['name']}")[0]
    vip = svc["spec"]["clusterIP"]

    def settle(replicas: int) -> set[str]:
        pods = k8s.ready_pods("web", replicas) if replicas else []
        ips = sorted(p["status"]["podIP"] for p in pods)
        kube.wait_for(lambda: node_maps(lab, vip) == [ips, ips], 30, f"both nodes' maps hold {ips}")
        return {p["metadata"]["name"] for p in pods}

    for replicas in (3, 1, 4):
        k8s.scale("web", replicas)
        names = settle(replicas)
        seen = set()
        kube.wait_for(lambda: seen.add(tcp_request(cns, vip, 80)[0].split()[0]) or seen == names, 30,
                      f"{replicas} replicas: every pod answers (so far {seen})", interval=0.02)
        assert seen == names
    k8s.scale("web", 0)
    settle(0)
    with pytest.raises(ConnectionRefusedError):  # no endpoint: rejected at once, as kube-proxy does
        tcp_request(cns, vip, 80, timeout=1)
    client.CoreV1Api(lab.api_client()).delete_namespaced_service("web", k8s.name)
    kube.wait_for(lambda: node_maps(lab, vip) == [None, None], 30, "the service left both nodes' maps")
