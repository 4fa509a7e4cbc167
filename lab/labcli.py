"""`kxlb lab`: the Kubernetes lab from the command line.

    kxlb lab up [--nodes N] [--proxy kxlb|kube-proxy|none] [--kubelet] [--rp-filter off|strict|loose]
                [--service-node-port-range LO-HI] [--masquerade-ports LO-HI] [--no-build] [--timeout S]
    kxlb lab status [--json]
    kxlb lab exec node/NAME|client|fabric|NAMESPACE/POD -- CMD...
    kxlb lab kubectl ARGS...
    kxlb lab proxy kxlb|kube-proxy|none
    kxlb lab demo [--proxy ...] [--requests N]
    kxlb lab down [--purge]

Every sub-command takes ``--workdir`` (env ``KXLB_LAB_DIR``, default /var/lib/kxlb/lab).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from kxlb.loader.errors import KxlbError

from .cluster import DEFAULT_WORKDIR, Lab, LabError
from .proxies import PROXIES, PROXY_MODES
from .controlplane import ControlPlaneError


def _lab(a, **kw) -> Lab:
    return Lab.from_workdir(a.workdir, **kw)


def _summary(lab: Lab) -> str:
    st = lab.status(probe=False)
    lines = [f"lab {lab.name} is up (proxy: {st['proxy']}), work directory {lab.workdir}",
             f"  kubeconfig   {lab.kubeconfig}"]
    if st["options"]:
        lines.append(f"  options      {', '.join(f'{k} {v}' for k, v in st['options'].items())}")
    for n in st["nodes"]:
        lines.append(f"  node         {n['name']}: netns {n['netns']}, InternalIP {n['internal_ip']}, "
                     f"podCIDR {n['pod_cidr']}")
    lines.append(f"  client       netns {st['client']['netns']}, {st['client']['ip']} "
                 f"(route {', '.join(st['client']['routes'])})")
    lines.append(f"  logs         {lab.workdir / 'logs'}")
    lines += ["try:", f"  kxlb lab kubectl get nodes -o wide    (or kubectl --kubeconfig {lab.kubeconfig} ...)",
              f"  kxlb lab exec node/{lab.node(1).name} -- ip route",
              "  kxlb lab down"]
    return "\n".join(lines)


RP_FILTER = {"off": 0, "strict": 1, "loose": 2}


def cmd_up(a) -> None:
    kw = {k: v for k, v in (("nodes", a.nodes), ("proxy", a.proxy), ("name", a.name),
                            ("port_offset", a.port_offset), ("kubelet", a.kubelet),
                            ("rp_filter", RP_FILTER.get(a.rp_filter)), ("node_port_range", a.service_node_port_range),
                            ("masquerade_ports", a.masquerade_ports)) if v is not None}
    lab = _lab(a, **kw)
    lab.up(build=not a.no_build, timeout=a.timeout)
    print(_summary(lab))


def cmd_down(a) -> None:
    _lab(a).down(purge=a.purge)


def cmd_status(a) -> None:
    lab = _lab(a)
    st = lab.status()
    if a.json:
        json.dump(st, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        state = lab.read_state()
        if not state:
            print(f"no lab in {lab.workdir}")
        elif state.get("state") == "down":
            print(f"lab {lab.name} in {lab.workdir} is down")
        else:
            print(f"lab {lab.name}: {'up' if st['up'] else 'NOT healthy'}; proxy {st['proxy']}; "
                  f"kubeconfig {st['kubeconfig']}")
            cp = st["controlplane"] or {}
            for comp, c in (cp.get("components") or {}).items():
                print(f"  {comp:24} {'running' if c['running'] else 'stopped'}"
                      f"{'' if c['healthy'] in (None, True) else ' (unhealthy)'}  pid {c['pid']}")
            for n in st["nodes"]:
                print(f"  {n['name']:24} {n['internal_ip']:13} podCIDR {n['pod_cidr']:15} "
                      f"Ready={n['ready']} agent={'running' if n['agent']['running'] else 'stopped'} "
                      f"proxy={n['proxy']['mode']}{'' if n['proxy']['running'] or n['proxy']['mode'] == 'none' else ' (stopped)'}")
            print(f"  client {st['client']['netns']} {st['client']['ip']}")
    if not st["up"]:
        raise SystemExit(3)


def cmd_exec(a) -> None:
    argv = list(a.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise LabError("no command given: kxlb lab exec TARGET -- CMD...")
    _lab(a).exec(a.target, argv)


def cmd_kubectl(a) -> None:
    lab = _lab(a)
    args = list(a.args)
    if args and args[0] == "--":
        args = args[1:]
    kubectl = str(lab.bin_dir / "kubectl")
    os.execv(kubectl, [kubectl, f"--kubeconfig={lab.kubeconfig}", *args])


def cmd_proxy(a) -> None:
    lab = _lab(a)
    if (lab.read_state() or {}).get("state") != "up":
        raise LabError(f"no lab runs in {lab.workdir}: `kxlb lab up` first")
    print(f"proxy: {lab.set_proxy(a.mode)}")


def cmd_demo(a) -> None:
    from . import demo
    demo.run(a.workdir, proxy=a.proxy, requests=a.requests, replicas=a.replicas, build=not a.no_build)


def _wrap(fn):
    def call(a) -> None:
        try:
            fn(a)
        except (LabError, ControlPlaneError) as exc:
            raise KxlbError(str(exc)) from None
    return call


def register(sub) -> None:
    p = sub.add_parser("lab", help="Kubernetes lab: real control plane, lab nodes in network namespaces",
                       description="A Kubernetes lab on this machine: etcd, kube-apiserver, controller-manager "
                                   "and scheduler on loopback, nodes and pods in network namespaces, a pod agent "
                                   "per node (kubelet + CNI), and a service proxy per node.")
    lsub = p.add_subparsers(dest="lab_command", required=True, metavar="COMMAND")

    def add(name: str, fn, helptext: str) -> argparse.ArgumentParser:
        c = lsub.add_parser(name, help=helptext, description=helptext)
        c.add_argument("--workdir", default=os.environ.get("KXLB_LAB_DIR", str(DEFAULT_WORKDIR)),
                       help="lab state, kubeconfigs and logs (env KXLB_LAB_DIR; default %(default)s)")
        c.set_defaults(func=_wrap(fn))
        return c

    c = add("up", cmd_up, "bring the lab up (idempotent); builds the Kubernetes binaries if needed")
    c.add_argument("--nodes", type=int, help="number of lab nodes (default: the running lab's, else 2)")
    c.add_argument("--proxy", choices=PROXIES,
                   help="service proxy on every node (default: the running lab's, else kxlb; kxlb falls back "
                        "to none when `kxlb controller` is missing)")
    c.add_argument("--kubelet", action=argparse.BooleanOptionalAction, default=None,
                   help="real nodes: containerd, runc and a kubelet per node (built from Go modules like the "
                        "control plane), the proxy as a DaemonSet (kxlb from deploy/kxlb.yaml, kube-proxy "
                        "from kubeadm's manifest); --no-kubelet: the pod agent (fast, no images). Default: "
                        "the running lab's, else --no-kubelet")
    c.add_argument("--rp-filter", choices=RP_FILTER,
                   help="reverse-path filtering on every node (net.ipv4.conf.{all,default,IFACE}.rp_filter): "
                        "off (0), strict (1: CIS benchmarks, kind) or loose (2). Default: the running lab's, else off")
    c.add_argument("--service-node-port-range", metavar="LO-HI",
                   help="the API server's NodePort range (kxlb's controller gets the same flag). Default: the "
                        "running lab's, else kube-apiserver's 30000-32767")
    c.add_argument("--masquerade-ports", metavar="LO-HI",
                   help="kxlb's masquerade source ports (`kxlb controller --masquerade-ports`; at least 1024, "
                        "outside the NodePort range and the nodes' ephemeral ports). Default: the running lab's, "
                        "else the controller's choice")
    c.add_argument("--no-build", action="store_true", help="do not run lab/k8s/build.sh")
    c.add_argument("--timeout", type=float, default=180, help="seconds to wait for readiness (default %(default)s)")
    c.add_argument("--name", help=argparse.SUPPRESS)          # a second lab beside the first (tests)
    c.add_argument("--port-offset", type=int, help=argparse.SUPPRESS)

    c = add("down", cmd_down, "stop and remove everything the lab made (idempotent, also after a crash)")
    c.add_argument("--purge", action="store_true", help="also delete the work directory (logs included)")

    c = add("status", cmd_status, "state of the lab (exit status 3 when it is not up)")
    c.add_argument("--json", action="store_true", help="machine-readable output")

    c = add("exec", cmd_exec, "run a command in a lab namespace: node/NAME (also in the node's cgroup), "
                              "client, fabric or NAMESPACE/POD")
    c.add_argument("target", metavar="TARGET")
    c.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...")

    c = add("kubectl", cmd_kubectl, "kubectl with the lab's admin kubeconfig")
    c.add_argument("args", nargs=argparse.REMAINDER)

    c = add("proxy", cmd_proxy, "switch the service proxy of a running lab")
    c.add_argument("mode", choices=PROXIES, help="; ".join(f"{m.name}: {m.help}" for m in PROXY_MODES.values()))

    c = add("demo", cmd_demo, "lab up, a Deployment of echo pods behind a ClusterIP Service, traffic from "
                              "a pod and from the external client; leaves the lab running")
    c.add_argument("--proxy", choices=PROXIES,
                   help="default: the running lab's, else kxlb (falls back to none without `kxlb controller`)")
    c.add_argument("--requests", type=int, default=6, help="requests from each client (default %(default)s)")
    c.add_argument("--replicas", type=int, default=3)
    c.add_argument("--no-build", action="store_true")
