"""The pod agent: the lab's kubelet and CNI for one lab node.

    python -m kxlb.lab.podagent --workdir DIR --node NAME

One process per node, started by ``kxlb lab up`` (``lab/cluster.py``); its
configuration is the lab's ``lab.json`` in DIR. It

- registers the Node (podCIDR, InternalIP, capacity/allocatable, labels, Ready) and
  keeps it alive: a Lease renewal in ``kube-node-lease`` and a status heartbeat every
  10 s, so the node lifecycle controller never taints it;
- watches the Pods bound to its node with the controller's informer
  (``controller/informer.py``: watch-list or list, watch with bookmarks and read timeouts,
  relist on 410 Gone, client-go's backoff on other errors);
- gives each pod a network namespace ``<lab>-pod-<uid8>``, a veth whose node side is
  ``kxp<uid8>`` (plain L3 routing, see ``lab/nodes.py``) and an address from the node's
  podCIDR (round-robin, released on delete); ``hostNetwork`` pods run in the node's
  namespace and cgroup with the node's address;
- runs the workload: ``lab/echo.py`` answering with the pod's name on every
  containerPort the pod declares (TCP, UDP; HTTP for TCP ports named ``http*``),
  restarted (restartCount + 1) when it dies;
- patches ``pods/status``: podIP(s), hostIP(s), phase Running, conditions, container
  statuses;
- on deletion (deletionTimestamp set) keeps serving until the grace period ends, as a
  server draining its connections would, then kills the workload, removes the
  namespace and veth, and deletes the Pod with grace period 0, as a kubelet does. Like
  a kubelet whose readiness probe still passes, it keeps the Ready condition during
  termination, so the EndpointSlice shows the endpoint ``serving`` and ``terminating``
  (KEP-1669); annotate ``kxlab.io/ready-while-terminating: "false"`` to drop Ready as
  soon as termination starts;
- honours the annotation ``kxlab.io/ready: "false"`` (Ready=False while set): that is
  the lab's readiness probe (see ``kube.set_pod_ready``);
- relays TCP from 127.0.0.1:<apiserver port> inside the node's namespace to the API
  server on the host's loopback, so host-network processes of the node (kube-proxy,
  ``kubectl`` in ``kxlb lab exec node/...``) reach it with the usual kubeconfigs.

State lives in ``DIR/nodes/<node>/`` (one JSON file per pod, the IPAM cursor), so a
restarted agent adopts running pods. On SIGTERM the agent exits and leaves pods
running; ``kxlb lab down`` removes everything.
"""
from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from .procs import proc_stat
from .relay import Endpoint, TcpRelay
from .nodes import NodeSpec, Topology

log = logging.getLogger("kxlab.agent")

ANN_READY = "kxlab.io/ready"
ANN_READY_TERMINATING = "kxlab.io/ready-while-terminating"
HEARTBEAT_S = 10.0
LEASE_DURATION_S = 40
SMP = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
CAPACITY = {"cpu": "8", "memory": "16Gi", "pods": "110", "ephemeral-storage": "100Gi"}


def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(s: str) -> float:
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def _status(exc: BaseException) -> Optional[int]:
    return getattr(exc, "status", None)


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def proc_start(pid: int) -> Optional[int]:
    """Start time of a live (not zombie) process, to tell a reused pid apart."""
    st = proc_stat(pid)
    return None if st is None or st[0] in ("Z", "X") else st[1]


def workload_ports(pod: dict) -> list[tuple[str, int]]:
    """(kind, port) for every declared containerPort: kind is tcp, udp or http."""
    out: list[tuple[str, int]] = []
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            proto = (p.get("protocol") or "TCP").upper()
            port = p.get("containerPort")
            if not port:
                continue
            if proto == "TCP":
                kind = "http" if (p.get("name") or "").startswith("http") else "tcp"
            elif proto == "UDP":
                kind = "udp"
            else:
                continue  # SCTP: not served
            if (kind, port) not in out:
                out.append((kind, port))
    return out


# ------------------------------------------------------------------------------ IPAM
class Ipam:
    def __init__(self, cidr: str, gateway: str, path: Path):
        net = ipaddress.ip_network(cidr)
        self.pool = [str(h) for h in net.hosts() if str(h) != gateway]
        self.path = path
        self.used: dict[str, str] = {}  # ip -> uid
        self.lock = threading.Lock()
        try:
            self.cursor = int(json.loads(path.read_text()).get("cursor", -1))
        except (OSError, ValueError):
            self.cursor = -1

    def claim(self, ip: str, uid: str) -> bool:
        with self.lock:
            if ip not in self.pool or self.used.get(ip, uid) != uid:
                return False
            self.used[ip] = uid
            return True

    def allocate(self, uid: str, preferred: Optional[str] = None) -> str:
        if preferred and self.claim(preferred, uid):
            return preferred
        with self.lock:
            n = len(self.pool)
            for step in range(1, n + 1):  # round robin: a freed address is reused last
                i = (self.cursor + step) % n
                if self.pool[i] not in self.used:
                    self.cursor = i
                    self.used[self.pool[i]] = uid
                    _write_json(self.path, {"cursor": i})
                    return self.pool[i]
        raise RuntimeError("podCIDR exhausted")

    def release(self, ip: Optional[str], uid: str) -> None:
        with self.lock:
            if ip and self.used.get(ip) == uid:
                del self.used[ip]


# ------------------------------------------------------------------------------ pods
class PodWorker(threading.Thread):
    """Owns one pod from first sight to deletion."""

    def __init__(self, agent: "Agent", uid: str, state: Optional[dict] = None):
        super().__init__(daemon=True, name=f"pod-{uid[:8]}")
        self.agent, self.uid = agent, uid
        self.cond = threading.Condition()
        self.latest: Optional[dict] = None
        self.gone = False
        self.dirty = True
        self.state: Optional[dict] = state       # persisted: ip, netns, pid, ...
        self.proc: Optional[subprocess.Popen] = None
        self.failures = 0
        self.last_sig: Optional[str] = None
        self.last_patch = 0.0
        self.finished = False

    # -- events from the watch
    def update(self, obj: Optional[dict], gone: bool = False) -> None:
        with self.cond:
            if obj is not None:
                self.latest = obj
            self.gone = self.gone or gone
            self.dirty = True
            self.cond.notify()

    @property
    def state_file(self) -> Path:
        return self.agent.pods_dir / f"{self.uid}.json"

    def run(self) -> None:
        while not self.agent.stopping.is_set():
            with self.cond:
                if not self.dirty:
                    self.cond.wait(timeout=self._tick())
                self.dirty = False
                obj, gone = self.latest, self.gone
            try:
                if self.step(obj, gone):
                    break
                self.failures = 0
            except Exception as exc:  # noqa: BLE001 - keep the pod's loop alive
                self.failures += 1
                log.warning("pod %s: %s", self._label(obj), exc, exc_info=self.failures == 1)
                time.sleep(min(5.0, 0.2 * 2 ** min(self.failures, 5)))
        self.finished = True
        self.agent.worker_done(self.uid)

    def _tick(self) -> float:
        obj = self.latest or {}
        dts = (obj.get("metadata") or {}).get("deletionTimestamp")
        if dts:
            return max(0.05, min(0.5, parse_time(dts) - time.time()))
        return 1.0

    @staticmethod
    def _label(obj: Optional[dict]) -> str:
        md = (obj or {}).get("metadata") or {}
        return f"{md.get('namespace')}/{md.get('name')}"

    # -- one reconcile pass; True when the pod is finished
    def step(self, obj: Optional[dict], gone: bool) -> bool:
        if gone or obj is None:
            self.teardown("deleted")
            return True
        phase = (obj.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            self.teardown(f"phase {phase}")
            return True
        md = obj["metadata"]
        dts = md.get("deletionTimestamp")
        if dts and time.time() >= parse_time(dts):
            self.teardown("grace period over")
            self.delete(obj)
            return True
        if not self.is_set_up():
            self.setup(obj)
        elif not self.workload_alive():
            self.state["restarts"] = self.state.get("restarts", 0) + 1
            log.warning("pod %s: workload died; restarting it (restart %d)", self._label(obj), self.state["restarts"])
            self.start_workload(obj)
        self.sync_status(obj)
        return False

    # -- network and workload
    def is_set_up(self) -> bool:
        st = self.state
        if not st:
            return False
        if not st.get("host_network") and not os.path.exists(f"/var/run/netns/{st['netns']}"):
            return False
        return True

    def workload_alive(self) -> bool:
        st = self.state or {}
        if not st.get("ports"):
            return True
        if self.proc is not None:
            return self.proc.poll() is None
        pid = st.get("pid")
        return bool(pid) and proc_start(pid) == st.get("start")

    def setup(self, obj: dict) -> None:
        a = self.agent
        md, spec = obj["metadata"], obj.get("spec") or {}
        host_net = bool(spec.get("hostNetwork"))
        old = self.state or {}
        self.kill_workload()
        if host_net:
            ip, ip6, ns, veth = a.node.ip, a.node.ip6 or None, a.node.netns, None
        else:
            preferred = old.get("ip") or (obj.get("status") or {}).get("podIP")
            ip = a.ipam.allocate(self.uid, preferred)
            ip6 = a.node.pod_ip6(ip) if a.node.pod_cidr6 else None   # dual-stack: the same host number
            try:
                ns, veth = a.topo.add_pod(a.node, self.uid, ip, ip6)
            except BaseException:
                a.ipam.release(ip, self.uid)
                raise
        self.state = {
            "uid": self.uid, "namespace": md["namespace"], "name": md["name"], "node": a.node.name,
            "ip": ip, "ip6": ip6, "netns": ns, "veth": veth, "host_network": host_net,
            "restarts": old.get("restarts", 0),
            "started_at": old.get("started_at") or now_rfc3339(),
            "ports": [f"{k}/{p}" for k, p in workload_ports(obj)],
        }
        _write_json(self.state_file, self.state)
        self.start_workload(obj)
        log.info("pod %s: %s on %s%s, serving %s", self._label(obj), ip, ns, f" ({veth})" if veth else "",
                 ", ".join(self.state["ports"]) or "nothing")

    def start_workload(self, obj: dict) -> None:
        st = self.state
        self.kill_workload()
        st["pid"] = st["start"] = None
        if st["ports"]:
            argv = [sys.executable, "-m", "kxlb.lab.echo", "--name", st["name"], "--netns", st["netns"]]
            if st.get("ip6"):
                argv.append("--ipv6")
            for kp in st["ports"]:
                kind, port = kp.split("/")
                argv += [f"--{kind}", port]
            logf = self.agent.pod_log(st)
            cg = self.agent.node.cgroup if st["host_network"] else None

            def into_cgroup() -> None:
                if cg:
                    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                        f.write("0")

            with open(logf, "ab") as lf:
                p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=lf,
                                     start_new_session=True, close_fds=True, preexec_fn=into_cgroup)
            ready = select.select([p.stdout], [], [], 20)[0] and p.stdout.readline().strip() == b"ready"
            p.stdout.close()
            if not ready:
                p.kill()
                p.wait()
                raise RuntimeError(f"echo server did not start (see {logf})")
            self.proc = p
            st["pid"], st["start"] = p.pid, proc_start(p.pid)
            st["started_at"] = now_rfc3339()
        _write_json(self.state_file, st)

    def kill_workload(self) -> None:
        st = self.state or {}
        pid = st.get("pid")
        if self.proc is not None:
            pid = self.proc.pid
        if pid and (self.proc is not None or proc_start(pid) == st.get("start")):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc is not None:
            self.proc.wait()
            self.proc = None

    def teardown(self, why: str) -> None:
        a = self.agent
        st = self.state or {}
        self.kill_workload()
        if not st.get("host_network"):
            a.topo.del_pod(a.node, self.uid)
        a.ipam.release(st.get("ip"), self.uid)
        self.state_file.unlink(missing_ok=True)
        if st:
            log.info("pod %s/%s: removed (%s); %s released", st.get("namespace"), st.get("name"), why, st.get("ip"))
        self.state = None

    def delete(self, obj: dict) -> None:
        md = obj["metadata"]
        try:
            a = self.agent
            a.core.delete_namespaced_pod(md["name"], md["namespace"], grace_period_seconds=0,
                                         body={"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
                                         _preload_content=False)
        except Exception as exc:  # noqa: BLE001
            if _status(exc) not in (404, 409):
                raise

    # -- status
    def desired_status(self, obj: dict) -> dict:
        st = self.state
        md, spec = obj["metadata"], obj.get("spec") or {}
        cur = obj.get("status") or {}
        ann = md.get("annotations") or {}
        ready = ann.get(ANN_READY, "true").lower() != "false" and self.workload_alive()
        if md.get("deletionTimestamp") and ann.get(ANN_READY_TERMINATING, "true").lower() == "false":
            ready = False
        have = {c.get("type"): c for c in cur.get("conditions") or []}
        now = now_rfc3339()

        def cond(kind: str, ok: bool) -> dict:
            s = "True" if ok else "False"
            old = have.get(kind) or {}
            c = {"type": kind, "status": s,
                 "lastTransitionTime": old.get("lastTransitionTime") if old.get("status") == s else now}
            if kind in ("Ready", "ContainersReady") and not ok:
                c["reason"] = "ContainersNotReady"
                c["message"] = "kxlab: not ready (annotation kxlab.io/ready or workload down)"
            else:
                c["reason"], c["message"] = None, None
            return c

        tag = self.uid.replace("-", "")[:12]
        statuses = []
        for c in spec.get("containers") or []:
            statuses.append({
                "name": c["name"], "image": c.get("image") or "kxlab/echo",
                "imageID": f"kxlab/{c.get('image') or 'echo'}", "containerID": f"kxlab://{tag}-{c['name']}",
                "ready": ready, "started": True, "restartCount": st.get("restarts", 0),
                "state": {"running": {"startedAt": st.get("started_at")}},
            })
        init = [{
            "name": c["name"], "image": c.get("image") or "kxlab/echo", "imageID": f"kxlab/{c.get('image')}",
            "containerID": f"kxlab://{tag}-{c['name']}", "ready": True, "started": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                     "startedAt": st.get("started_at"), "finishedAt": st.get("started_at")}},
        } for c in spec.get("initContainers") or []]
        out = {
            "phase": "Running",
            "hostIP": self.agent.node.ip,
            "hostIPs": [{"ip": a} for a in (self.agent.node.ip, self.agent.node.ip6) if a],
            "podIP": st["ip"], "podIPs": [{"ip": a} for a in (st["ip"], st.get("ip6")) if a],
            "startTime": cur.get("startTime") or st.get("started_at"),
            "conditions": [cond("PodReadyToStartContainers", True), cond("Initialized", True),
                           cond("PodScheduled", True), cond("ContainersReady", ready), cond("Ready", ready)],
            "containerStatuses": statuses,
        }
        if init:
            out["initContainerStatuses"] = init
        return out

    @staticmethod
    def _signature(status: dict) -> str:
        conds = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        cs = [(c.get("name"), c.get("ready"), c.get("restartCount"), c.get("containerID"))
              for c in status.get("containerStatuses") or []]
        return json.dumps([status.get("phase"), status.get("podIP"), status.get("hostIP"),
                           sorted(conds.items()), cs])

    def sync_status(self, obj: dict) -> None:
        want = self.desired_status(obj)
        sig = self._signature(want)
        if sig == self._signature(obj.get("status") or {}):
            self.last_sig = sig
            return
        if sig == self.last_sig and time.monotonic() - self.last_patch < 5:
            return  # patched already; the watch event is on its way
        md = obj["metadata"]
        self.agent.core.patch_namespaced_pod_status(md["name"], md["namespace"], {"status": want},
                                                    _content_type=SMP, _preload_content=False)
        self.last_sig, self.last_patch = sig, time.monotonic()
        ready = next(c["status"] for c in want["conditions"] if c["type"] == "Ready")
        log.info("pod %s: status Running, Ready=%s, podIP %s", self._label(obj), ready, want["podIP"])


# ------------------------------------------------------------------------------ the agent
class Agent:
    def __init__(self, workdir: str | os.PathLike, node_name: str):
        self.workdir = Path(workdir)
        self.cfg = json.loads((self.workdir / "lab.json").read_text())
        nodes = {n["name"]: n for n in self.cfg["topology"]["nodes"]}
        if node_name not in nodes:
            raise SystemExit(f"podagent: node {node_name!r} is not in {self.workdir / 'lab.json'}")
        self.node = NodeSpec(**{k: v for k, v in nodes[node_name].items() if k in NodeSpec.__dataclass_fields__})
        t = self.cfg["topology"]
        self.topo = Topology(t["name"], len(t["nodes"]), cgroup_root=t["cgroup_root"])
        self.state_dir = self.workdir / "nodes" / node_name
        self.pods_dir = self.state_dir / "pods"
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        self.ipam = Ipam(self.node.pod_cidr, self.node.gateway, self.state_dir / "ipam.json")
        self.stopping = threading.Event()
        self.workers: dict[str, PodWorker] = {}
        self.finished: dict[str, float] = {}   # uid -> when; later events for it are ignored
        self.lock = threading.Lock()
        self._api_down_since: Optional[float] = None

        from kubernetes import client, config
        self.api = config.new_client_from_config(config_file=self.cfg["admin_kubeconfig"])
        self.core = client.CoreV1Api(self.api)
        self.coord = client.CoordinationV1Api(self.api)

    def pod_log(self, st: dict) -> Path:
        d = self.workdir / "logs" / "pods" / self.node.name
        d.mkdir(parents=True, exist_ok=True)
        return d / f"{st['namespace']}_{st['name']}.log"

    # -- node registration and heartbeats
    def node_object(self) -> dict:
        n = self.node
        return {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": n.name, "labels": {
                "kubernetes.io/hostname": n.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                "topology.kubernetes.io/zone": n.zone, "kxlab.io/lab": self.topo.name}},
            "spec": {"podCIDR": n.pod_cidr, "podCIDRs": [c for c in (n.pod_cidr, n.pod_cidr6) if c]},
        }

    def node_status(self, since: str) -> dict:
        """The whole status, sent as a JSON merge patch (lists replaced whole): a strategic
        merge patch keys status.addresses by type, and a dual-stack node has two
        InternalIPs, which it refuses (422)."""
        now = now_rfc3339()
        n = self.node

        def cond(kind, status, reason, msg):
            return {"type": kind, "status": status, "reason": reason, "message": msg,
                    "lastHeartbeatTime": now, "lastTransitionTime": since}

        return {"status": {
            "capacity": CAPACITY, "allocatable": CAPACITY,
            "addresses": [{"type": "InternalIP", "address": a} for a in (n.ip, n.ip6) if a]
                         + [{"type": "Hostname", "address": n.name}],
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "kxlab"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "kxlab"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "kxlab"),
                cond("Ready", "True", "KubeletReady", "kxlab pod agent is posting ready status"),
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "machineID": n.name, "systemUUID": n.name, "bootID": self.cfg.get("created_id", n.name),
                "kernelVersion": os.uname().release, "osImage": "kxlab", "containerRuntimeVersion": "kxlab://0.1",
                "kubeletVersion": self.cfg.get("k8s_version", "v0.0.0"), "kubeProxyVersion": "",
                "operatingSystem": "linux", "architecture": "amd64",
            },
        }}

    def register(self) -> None:
        try:
            self.core.create_node(self.node_object(), _preload_content=False)
            log.info("node %s registered", self.node.name)
        except Exception as exc:  # noqa: BLE001
            if _status(exc) != 409:
                raise
        self.ready_since = now_rfc3339()
        self.core.patch_node_status(self.node.name, self.node_status(self.ready_since), _content_type=MERGE,
                                    _preload_content=False)
        self.renew_lease()

    def renew_lease(self) -> None:
        name, ns = self.node.name, "kube-node-lease"
        spec = {"holderIdentity": name, "leaseDurationSeconds": LEASE_DURATION_S, "renewTime": now_micro()}
        try:
            self.coord.patch_namespaced_lease(name, ns, {"spec": spec}, _content_type=MERGE, _preload_content=False)
            return
        except Exception as exc:  # noqa: BLE001
            if _status(exc) != 404:
                raise
        node = json.loads(self.core.read_node(name, _preload_content=False).data)
        owner = [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": node["metadata"]["uid"]}]
        self.coord.create_namespaced_lease(ns, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                                "metadata": {"name": name, "namespace": ns, "ownerReferences": owner},
                                                "spec": spec}, _preload_content=False)

    def heartbeat_loop(self) -> None:
        while not self.stopping.is_set():
            ok = True
            try:
                self.renew_lease()
                self.core.patch_node_status(self.node.name, self.node_status(self.ready_since), _content_type=MERGE,
                                            _preload_content=False)
            except Exception as exc:  # noqa: BLE001
                ok = False
                if _status(exc) == 404:  # someone deleted our Node: register again, as a kubelet does
                    try:
                        self.register()
                        ok = True
                    except Exception as exc2:  # noqa: BLE001
                        exc = exc2
                if not ok:
                    self._api_error("heartbeat", exc)
            if ok:
                self._api_ok()
            self.stopping.wait(HEARTBEAT_S if ok else 2.0)

    def _api_error(self, what: str, exc: BaseException) -> None:
        if self._api_down_since is None:
            self._api_down_since = time.monotonic()
            log.warning("%s: API error (%s); retrying", what, str(exc).splitlines()[0][:200])

    def _api_ok(self) -> None:
        if self._api_down_since is not None:
            log.info("API reachable again after %.1fs", time.monotonic() - self._api_down_since)
            self._api_down_since = None

    # -- pods
    def worker_done(self, uid: str) -> None:
        with self.lock:
            self.workers.pop(uid, None)
            self.finished[uid] = time.monotonic()

    def dispatch(self, obj: dict, gone: bool = False) -> None:
        uid = obj["metadata"]["uid"]
        with self.lock:
            w = self.workers.get(uid)
            if w is None:
                if uid in self.finished or gone:
                    return
                w = self.workers[uid] = PodWorker(self, uid)
                w.update(obj)
                w.start()
                return
        w.update(obj, gone)

    def adopt(self) -> None:
        """Workers for the pods a previous agent left (state files)."""
        for f in sorted(self.pods_dir.glob("*.json")):
            try:
                st = json.loads(f.read_text())
            except (OSError, ValueError):
                f.unlink(missing_ok=True)
                continue
            if st.get("ip") and not st.get("host_network"):
                self.ipam.claim(st["ip"], st["uid"])
            self.workers[st["uid"]] = PodWorker(self, st["uid"], st)

    def resync(self, items: list[dict]) -> None:
        """After a (re)list: the listed pods are current, any other worker's pod is gone."""
        seen = {p["metadata"]["uid"] for p in items}
        for p in items:
            self.dispatch(p)
        with self.lock:
            stale = [w for u, w in self.workers.items() if u not in seen]
        for w in stale:
            w.update(None, gone=True)
            if not w.is_alive() and not w.finished:
                w.start()
        cutoff = time.monotonic() - 600
        with self.lock:
            for u in [u for u, t in self.finished.items() if t < cutoff]:
                del self.finished[u]

    def watch_loop(self) -> None:
        """The pods bound to this node, through the controller's informer (watch-list or
        list at resourceVersion "0", watch with bookmarks and read timeouts, relist on 410,
        client-go's backoff). Every complete state goes to resync(), watch events to dispatch()."""
        from kxlb.controller.informer import DELETED, Informer

        def on_restart(_resource: str, reason: str) -> None:
            if reason != "gone":
                self._api_error("pod watch", RuntimeError(reason))

        def on_list(items: list[dict]) -> None:
            self._api_ok()
            self.resync(items)

        self.informer = Informer("pods", self.core.list_pod_for_all_namespaces,
                                 lambda typ, _key, obj: self.dispatch(obj, gone=typ == DELETED),
                                 {"field_selector": f"spec.nodeName={self.node.name}"},
                                 on_restart=on_restart, on_list=on_list)
        self.informer.run()

    # -- main
    def run(self) -> None:
        t = self.cfg["topology"]
        log.info("pod agent for %s (%s, podCIDR %s) starting", self.node.name, self.node.ip, self.node.pod_cidr)
        api_port = int(self.cfg["api_port"])
        self.relay = TcpRelay(Endpoint(self.node.netns, "127.0.0.1", api_port), Endpoint(None, "127.0.0.1", api_port))
        deadline = time.monotonic() + 120
        while True:
            try:
                self.register()
                break
            except Exception as exc:  # noqa: BLE001
                if time.monotonic() > deadline:
                    raise
                self._api_error("node registration", exc)
                time.sleep(1)
        self._api_ok()
        threading.Thread(target=self.heartbeat_loop, daemon=True, name="heartbeat").start()
        self.adopt()
        log.info("node %s ready; lab %s; %d pods adopted", self.node.name, t["name"], len(self.workers))
        self.watch_loop()

    def stop(self) -> None:
        self.stopping.set()
        if getattr(self, "informer", None) is not None:
            self.informer.stop()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kxlb.lab.podagent", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--log-level", default="info")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)-7s %(threadName)s: %(message)s")
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    agent = Agent(a.workdir, a.node)

    def on_term(*_):
        agent.stop()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        agent.run()
    except SystemExit:
        log.info("stopping; pods keep running")
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
