"""kube-proxy's own packet-flow tables (tests/lab/packetflow.py), replayed with real
packets against the real kube-proxy (nftables) and against kxlb. Node 1 is upstream's
node under test. See docs/packet-flow.md.

Each (proxy, scenario) test creates the scenario's selector-less Services and hand-made
EndpointSlices (pointing at real echo pods, with the conditions the upstream rows use),
then checks every row, retrying while the proxy catches up. The observed table goes to
``<tmp>/packet-flow-results.json`` (and stdout).
"""
from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import time

import pytest

from kxlb.lab import kube
from kxlb.lab.nodes import EXTERNAL_IP_RANGE, SERVICE_CIDR, SERVICE_CIDR6

import packetflow as pf

MANAGED_BY = "kxlb-tests"
FIRST_ROW_TIMEOUT = 25     # seconds for the proxy to program a scenario (first row)
ROW_TIMEOUT = 8            # seconds for each later row
RESULTS: dict = {}         # scenario -> row -> proxy -> {"ok", "observed", ...}

CASES = [(proxy, sc) for proxy in ("kube-proxy", "kxlb") for sc in pf.SCENARIOS]


@pytest.fixture(scope="module")
def flow_lab(lab):
    """Module-wide: one namespace with the echo pods, the proxy switched only when the
    next test wants another one, and a second client address (``blocked``)."""
    api = lab.api_client()
    ns = kube.create_namespace(api, "t-packet-flow-")
    k8s = kube.Namespace(api, ns)
    for p in pf.LOCAL_PODS:
        k8s.pod(p, labels={"app": "pf-echo", "pf": p}, node_name=lab.node(1).name)
    for p in pf.REMOTE_PODS:
        k8s.pod(p, labels={"app": "pf-echo", "pf": p}, node_name=lab.node(2).name)
    k8s.pod(pf.SOURCE_POD, labels={"app": "pf-client"}, ports=[], node_name=lab.node(1).name)
    pods = k8s.ready_pods("app=pf-echo", len(pf.LOCAL_PODS) + len(pf.REMOTE_PODS), timeout=120)
    k8s.ready_pods("app=pf-client", 1, timeout=120)
    ips = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}
    ips6 = {p["metadata"]["name"]: next(a["ip"] for a in p["status"]["podIPs"] if ":" in a["ip"]) for p in pods}
    client_net = ipaddress.ip_interface(f"{lab.client_ip}/24").network
    blocked = str(client_net.network_address + 130)
    subprocess.run(["ip", "-n", lab.client_ns, "addr", "replace", f"{blocked}/32", "dev", "eth0"], check=True)
    state = {"api": api, "k8s": k8s, "ns": ns, "ips": {"IPv4": ips, "IPv6": ips6}, "blocked": blocked,
             "proxy": None}

    def use(mode: str):
        if state["proxy"] != mode:
            actual = lab.set_proxy(mode)
            state["proxy"] = actual
            if actual != mode:
                pytest.fail(f"proxy {mode} is not available (the lab fell back to {actual})")
        return lab
    state["use"] = use
    yield state
    subprocess.run(["ip", "-n", lab.client_ns, "addr", "del", f"{blocked}/32", "dev", "eth0"], check=False)
    lab.set_proxy("none")
    kube.delete_namespace(api, ns)
    api.close()


def _service_body(name: str, svc: pf.Svc, lab, ext_ip: str, family: str) -> dict:
    spec: dict = {"type": svc.type, "ipFamilyPolicy": "SingleStack", "ipFamilies": [family],
                  "ports": [{"name": n, "port": p, "protocol": proto, "targetPort": pf.ECHO_PORT}
                            for n, p, proto in svc.ports]}
    if svc.etp:
        spec["externalTrafficPolicy"] = svc.etp
    if svc.itp:
        spec["internalTrafficPolicy"] = svc.itp
    if svc.external_ip:
        spec["externalIPs"] = [ext_ip]
    if svc.source_ranges:
        spec["loadBalancerSourceRanges"] = [f"{ {'node': lab.node(1).ip, 'external': lab.client_ip}[s] }/32"
                                            for s in svc.source_ranges]
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def _slice_body(name: str, svc_name: str, svc: pf.Svc, endpoints: tuple, lab, ips: dict, family: str) -> dict:
    out = []
    for pod, (ready, serving, terminating) in endpoints:
        out.append({"addresses": [ips[pod]],
                    "nodeName": lab.node(1 if pod.startswith("l") else 2).name,
                    "targetRef": {"kind": "Pod", "name": pod},
                    "conditions": {"ready": ready, "serving": serving, "terminating": terminating}})
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": svc_name,
                                                  "endpointslice.kubernetes.io/managed-by": MANAGED_BY}},
            "addressType": family, "endpoints": out,
            "ports": [{"name": n, "port": pf.ECHO_PORT, "protocol": proto} for n, _, proto in svc.ports]}


def _setup(flow, lab, scenario: pf.Scenario, idx: int) -> tuple[dict, list]:
    """Create the scenario's Services and slices; returns (symbol -> address/port, slices)."""
    from kubernetes import client
    core, disc = client.CoreV1Api(flow["api"]), client.DiscoveryV1Api(flow["api"])
    ns = flow["ns"]
    v6 = scenario.family == "IPv6"
    addr: dict = {"node_ip": lab.node(1).ip6 if v6 else lab.node(1).ip,
                  "unallocated": str(ipaddress.ip_network(SERVICE_CIDR6 if v6 else SERVICE_CIDR).broadcast_address - 7)}
    slices = []
    for j, (short, svc) in enumerate(scenario.services.items()):
        name = f"s{idx}-{short}"
        ext_ip = EXTERNAL_IP_RANGE.replace("0/24", str(20 + idx * 3 + j))
        body = _service_body(name, svc, lab, ext_ip, scenario.family)
        created = kube._json(core.create_namespaced_service(ns, body, _preload_content=False))
        addr[f"cluster_ip:{short}"] = created["spec"]["clusterIP"]
        if svc.external_ip:
            addr[f"external_ip:{short}"] = ext_ip
        if svc.type in ("NodePort", "LoadBalancer"):
            addr[f"np:{short}"] = created["spec"]["ports"][0]["nodePort"]
        if svc.type == "LoadBalancer":
            def assigned(name=name):
                s = kube._json(core.read_namespaced_service(name, ns, _preload_content=False))
                ing = (s.get("status", {}).get("loadBalancer") or {}).get("ingress") or []
                return ing[0]["ip"] if ing else None
            addr[f"lb_ip:{short}"] = kube.wait_for(assigned, 30, f"load-balancer IP for {name}")
        if short in scenario.endpoints:
            sl = _slice_body(f"{name}-manual", name, svc, scenario.endpoints[short], lab,
                             flow["ips"][scenario.family], scenario.family)
            disc.create_namespaced_endpoint_slice(ns, sl, _preload_content=False)
            slices.append(sl["metadata"]["name"])
    return addr, slices


def _teardown(flow, scenario: pf.Scenario, idx: int, slices: list) -> None:
    from kubernetes import client
    core, disc = client.CoreV1Api(flow["api"]), client.DiscoveryV1Api(flow["api"])
    for s in slices:
        try:
            disc.delete_namespaced_endpoint_slice(s, flow["ns"], _preload_content=False)
        except Exception:  # noqa: BLE001
            pass
    for short in scenario.services:
        try:
            core.delete_namespaced_service(f"s{idx}-{short}", flow["ns"], _preload_content=False)
        except Exception:  # noqa: BLE001
            pass


def _probe(lab, flow, row: pf.Row, addr: dict) -> list:
    dest = addr[row.dest]
    port = addr[row.port] if isinstance(row.port, str) else row.port
    want = sorted(row.output) if isinstance(row.output, frozenset) else [row.output]
    expected_sets = isinstance(row.output, frozenset)
    args = {"addr": dest, "port": port, "proto": row.proto, "bind": None,
            "tries": 30 if expected_sets else 2, "min": 12 if expected_sets else 1,
            "timeout": 1.5, "want": want}
    if row.source in ("external", "blocked"):
        target = "client"
        if row.source == "blocked":
            args["bind"] = flow["blocked"]
    elif row.source == "node":
        target = "node/1"
    else:  # a pod
        target = f"{flow['ns']}/{row.source}"
    r = lab.run_in(target, [sys.executable, "-c", pf.PROBE, json.dumps(args)], timeout=120)
    if r.returncode:
        return [["PROBE-FAILED", r.stderr.strip()[-300:], ""]]
    out = json.loads(r.stdout)
    if row.source == "node":
        # upstream's source is the node IP: with socket-level balancing (kxlb) the socket
        # itself already takes the pod-side address, so compare with node 1's IP.
        node_ip = lab.node(1).ip6 if ":" in dest else lab.node(1).ip
        out = [[o, src, node_ip if me else me] for o, src, me in out]
    return out


def _judge(row: pf.Row, results: list) -> tuple[bool, dict]:
    outcomes = {o for o, _, _ in results}
    answered = [(o, src, me) for o, src, me in results
                if o not in (pf.REJECT, pf.DROP) and not o.startswith(("ERROR", "PROBE"))]
    # From node 1's host network to a pod on node 2, masquerading rewrites the source to
    # node 1's address, which it already was: only the local endpoints tell.
    judged = [(src, me) for o, src, me in answered if row.source != "node" or o.startswith("l")]
    masq = sorted({src != me for src, me in judged})
    observed = {"output": sorted(outcomes), "masq": masq, "seen_src": sorted({s for _, s, _ in answered})}
    want = row.output if isinstance(row.output, frozenset) else {row.output}
    ok = outcomes == set(want)
    if isinstance(row.output, frozenset):
        ok = ok and masq == [row.masq]
    return ok, observed


def _fmt(output) -> str:
    return ",".join(sorted(output)) if isinstance(output, frozenset) else output


def _check_rows(lab, flow, proxy, scenario, rows, addr, phase: str, first_timeout: float) -> list:
    failures = []
    table = RESULTS.setdefault(scenario.name, {})
    for i, row in enumerate(rows):
        deadline = time.monotonic() + (first_timeout if i == 0 else ROW_TIMEOUT)
        while True:
            ok, observed = _judge(row, _probe(lab, flow, row, addr))
            if ok or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        key = f"{phase}{row.name}"
        table.setdefault(key, {"expected": {"output": _fmt(row.output), "masq": row.masq}})[proxy] = \
            {"ok": ok, **observed}
        if not ok:
            xfail = row.xfail_kxlb if proxy == "kxlb" else None
            failures.append((key, row, observed, xfail))
    return failures


@pytest.mark.parametrize("proxy,scenario", CASES, ids=[f"{p}-{s.name}" for p, s in CASES])
def test_packet_flow(flow_lab, lab, proxy, scenario, tmp_path_factory):
    flow_lab["use"](proxy)
    idx = pf.SCENARIOS.index(scenario) + (0 if proxy == "kube-proxy" else 40)
    addr, slices = _setup(flow_lab, lab, scenario, idx)
    failures = []
    try:
        failures += _check_rows(lab, flow_lab, proxy, scenario, scenario.rows, addr, "", FIRST_ROW_TIMEOUT)
        if scenario.after_delete:
            from kubernetes import client
            disc = client.DiscoveryV1Api(flow_lab["api"])
            for s in slices:
                disc.delete_namespaced_endpoint_slice(s, flow_lab["ns"], _preload_content=False)
            slices = []
            failures += _check_rows(lab, flow_lab, proxy, scenario, scenario.after_delete, addr,
                                    "after delete: ", FIRST_ROW_TIMEOUT)
    finally:
        _teardown(flow_lab, scenario, idx, slices)
        out = tmp_path_factory.getbasetemp() / "packet-flow-results.json"
        out.write_text(json.dumps(RESULTS, indent=1, sort_keys=True))
        print(f"\n{proxy} {scenario.name} ({scenario.upstream}) -> {out}")
        for key, cols in RESULTS.get(scenario.name, {}).items():
            got = cols.get(proxy, {})
            print(f"  {'ok ' if got.get('ok') else 'BAD'} {key}: expected {cols['expected']} "
                  f"observed {got.get('output')} masq {got.get('masq')} src {got.get('seen_src')}")
    hard = [f for f in failures if not f[3]]
    msg = "\n".join(f"{k}: expected {_fmt(r.output)} masq={r.masq}, observed {o}" for k, r, o, _ in failures)
    assert not hard, f"{proxy}: rows differ from kube-proxy's tables:\n{msg}"
    if failures:
        pytest.xfail(f"kxlb known differences:\n{msg}")
