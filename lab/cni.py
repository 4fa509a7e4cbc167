"""The lab's CNI plugin: the routed-veth layout of ``lab/nodes.py`` for pods that a real
kubelet and containerd run (``kxlb lab up --kubelet``).

    containerd --(CNI_COMMAND=ADD, CNI_NETNS=..., config on stdin)--> kxlb-cni

It gives the pod the same network as the pod agent's pods: a veth whose node side is
``kxp<sandbox id[:8]>`` (the name kxlb's controller attaches its tc programs to), the
pods' gateway address on it, a host route to the pod, and inside the pod ``eth0`` with
one address per family from the node's podCIDRs and a default route via the gateway.
No bridge, no NAT: node routing, as in ``lab/nodes.py``.

Addresses come from a file-per-address pool in the node's CNI state directory:
``ipam/<address>`` holds the sandbox id that owns it, created with O_EXCL, so two
plugin processes never hand out one address; a cursor makes the allocation round
robin (a freed address is reused last, as host-local does). ``containers/<id>.json``
remembers what ADD made, so DEL removes exactly that and nothing of a newer sandbox,
and is idempotent (the runtime retries it, also after the namespace is gone).

The same executable answers ``"type": "loopback"`` (containerd's CRI always asks for a
loopback network before the pod's own): it sets ``lo`` up in the pod's namespace.

CNI spec 1.0 (and 1.1's STATUS and GC): ADD, DEL, CHECK, VERSION. Errors go to stdout as
the spec's error object (code, msg, details) with exit status 1; a log of every call
goes to ``<stateDir>/cni.log``.

Configuration (written by ``lab/kubelet.py``)::

    {"cniVersion": "1.0.0", "name": "kxlab", "plugins": [{"type": "kxlb-cni",
      "stateDir": "...", "node": {NodeSpec fields}}]}
"""
from __future__ import annotations

import datetime as dt
import fcntl
import ipaddress
import json
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Optional

from .nodes import LabNetError, NodeSpec, Topology, run, wire_pod

SUPPORTED_VERSIONS = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
# Error codes of the CNI spec.
E_INCOMPATIBLE = 1
E_UNSUPPORTED_FIELD = 2
E_CONTAINER_UNKNOWN = 3
E_INVALID_ENV = 4
E_IO = 5
E_DECODE = 6
E_INVALID_CONFIG = 7
E_TRY_LATER = 11


class CniError(Exception):
    def __init__(self, code: int, msg: str, details: str = ""):
        super().__init__(msg)
        self.code, self.msg, self.details = code, msg, details


def node_from_config(conf: dict) -> NodeSpec:
    raw = conf.get("node")
    if not isinstance(raw, dict):
        raise CniError(E_INVALID_CONFIG, "config: 'node' (the lab node's spec) is missing")
    names = {f.name for f in fields(NodeSpec)}
    try:
        return NodeSpec(**{k: v for k, v in raw.items() if k in names})
    except TypeError as exc:
        raise CniError(E_INVALID_CONFIG, f"config: 'node': {exc}") from None


class FilePool:
    """The podCIDR's addresses, one file per address in use (content: the owner)."""

    def __init__(self, cidr: str, gateway: str, state: Path):
        self.net = ipaddress.ip_network(cidr)
        self.gateway = ipaddress.ip_address(gateway)
        self.dir = state / "ipam"
        self.dir.mkdir(parents=True, exist_ok=True)

    def _cursor(self) -> Path:
        return self.dir / f"cursor-v{self.net.version}"

    def allocate(self, owner: str) -> str:
        hosts = [h for h in self.net.hosts() if h != self.gateway]
        with open(self.dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                last = int(self._cursor().read_text())
            except (OSError, ValueError):
                last = -1
            for step in range(1, len(hosts) + 1):
                i = (last + step) % len(hosts)
                try:
                    fd = os.open(self.dir / str(hosts[i]), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    continue
                with os.fdopen(fd, "w") as f:
                    f.write(owner)
                self._cursor().write_text(str(i))
                return str(hosts[i])
        raise CniError(E_TRY_LATER, f"podCIDR {self.net} has no free address")

    def claim(self, address: str, owner: str) -> None:
        """Record *owner* for an address chosen elsewhere (the IPv6 twin of an IPv4 one)."""
        (self.dir / address).write_text(owner)

    def release(self, owner: str) -> list[str]:
        freed = []
        for f in self.dir.iterdir():
            if f.name.startswith((".", "cursor-")):
                continue
            try:
                if f.read_text() == owner:
                    f.unlink()
                    freed.append(f.name)
            except FileNotFoundError:
                pass
        return freed

    def owners(self) -> dict[str, str]:
        out = {}
        for f in self.dir.iterdir():
            if not f.name.startswith((".", "cursor-")):
                try:
                    out[f.name] = f.read_text()
                except FileNotFoundError:
                    pass
        return out


class Plugin:
    def __init__(self, conf: dict, env: dict):
        self.conf, self.env = conf, env
        self.version = conf.get("cniVersion", "1.0.0")
        if self.version not in SUPPORTED_VERSIONS:
            raise CniError(E_INCOMPATIBLE, f"cniVersion {self.version} is not one of {SUPPORTED_VERSIONS}")
        self.type = conf.get("type", "kxlb-cni")

    def need(self, var: str) -> str:
        val = self.env.get(var, "")
        if not val:
            raise CniError(E_INVALID_ENV, f"{var} is not set")
        return val

    # ---- the pod's own network ----------------------------------------------------------------
    @property
    def node(self) -> NodeSpec:
        return node_from_config(self.conf)

    @property
    def state(self) -> Path:
        d = self.conf.get("stateDir")
        if not d:
            raise CniError(E_INVALID_CONFIG, "config: 'stateDir' is missing")
        return Path(d)

    def _record(self, cid: str) -> Path:
        return self.state / "containers" / f"{cid}.json"

    def add(self) -> dict:
        cid, ns, ifname = self.need("CNI_CONTAINERID"), self.need("CNI_NETNS"), self.need("CNI_IFNAME")
        if self.type == "loopback":
            run("nsenter", f"--net={ns}", "ip", "link", "set", "lo", "up")
            return {"cniVersion": self.version, "interfaces": [{"name": "lo", "sandbox": ns}],
                    "ips": [], "dns": {}}
        node = self.node
        veth = Topology.pod_veth(cid)
        pool = FilePool(node.pod_cidr, node.gateway, self.state)
        ip = pool.allocate(cid)
        ip6 = node.pod_ip6(ip) if node.pod_cidr6 else None
        try:
            if ip6:  # the twin of the IPv4 address, so a pod's two addresses read alike
                pool.claim(ip6, cid)
            run("ip", "link", "del", veth, check=False)  # a leftover of a crashed ADD
            wire_pod(node, None, ns, veth, ip, ip6, ifname)
            self._record(cid).parent.mkdir(parents=True, exist_ok=True)
            self._record(cid).write_text(json.dumps({"veth": veth, "netns": ns, "ifname": ifname,
                                                     "ips": [a for a in (ip, ip6) if a]}))
        except BaseException:
            run("ip", "link", "del", veth, check=False)
            pool.release(cid)
            raise
        ips = [{"address": f"{ip}/32", "gateway": node.gateway, "interface": 1}]
        routes = [{"dst": "0.0.0.0/0", "gw": node.gateway}]
        if ip6:
            ips.append({"address": f"{ip6}/128", "gateway": node.gateway6, "interface": 1})
            routes.append({"dst": "::/0", "gw": node.gateway6})
        return {"cniVersion": self.version,
                "interfaces": [{"name": veth}, {"name": ifname, "sandbox": ns}],
                "ips": ips, "routes": routes, "dns": {}}

    def delete(self) -> None:
        cid = self.need("CNI_CONTAINERID")
        if self.type == "loopback":
            return  # the namespace goes with the sandbox
        rec = self._record(cid)
        try:
            veth = json.loads(rec.read_text())["veth"]
        except (OSError, ValueError, KeyError):
            veth = None
        if veth:
            run("ip", "link", "del", veth, check=False)
        FilePool(self.node.pod_cidr, self.node.gateway, self.state).release(cid)
        rec.unlink(missing_ok=True)

    def check(self) -> None:
        cid = self.need("CNI_CONTAINERID")
        if self.type == "loopback":
            return
        try:
            veth = json.loads(self._record(cid).read_text())["veth"]
        except (OSError, ValueError, KeyError):
            raise CniError(E_CONTAINER_UNKNOWN, f"no attachment of container {cid}") from None
        if run("ip", "link", "show", veth, check=False).returncode:
            raise CniError(E_IO, f"container {cid}: its veth {veth} is gone")

    def gc(self) -> None:
        """Remove every attachment the runtime no longer lists (CNI 1.1 GC)."""
        if self.type == "loopback":
            return
        valid = {a.get("containerID") for a in self.conf.get("cni.dev/valid-attachments", [])}
        pool = FilePool(self.node.pod_cidr, self.node.gateway, self.state)
        owners = set(pool.owners().values())
        recs = {p.stem for p in (self.state / "containers").glob("*.json")}
        for cid in (owners | recs) - valid:
            self.env = dict(self.env, CNI_CONTAINERID=cid)
            self.delete()


def _log(conf: dict, line: str) -> None:
    d = conf.get("stateDir")
    if not d:
        return
    try:
        with open(Path(d) / "cni.log", "a") as f:
            f.write(f"{dt.datetime.now().isoformat(timespec='milliseconds')} {line}\n")
    except OSError:
        pass


def main(stdin: str, env: dict) -> tuple[int, Optional[dict]]:
    cmd = env.get("CNI_COMMAND", "")
    if cmd == "VERSION":
        return 0, {"cniVersion": "1.0.0", "supportedVersions": SUPPORTED_VERSIONS}
    try:
        conf = json.loads(stdin or "{}")
    except ValueError as exc:
        return 1, {"cniVersion": "1.0.0", "code": E_DECODE, "msg": f"config is not JSON: {exc}"}
    version = conf.get("cniVersion", "1.0.0") if isinstance(conf, dict) else "1.0.0"
    try:
        if not isinstance(conf, dict):
            raise CniError(E_DECODE, "config is not a JSON object")
        plugin = Plugin(conf, env)
        _log(conf, f"{cmd} {env.get('CNI_CONTAINERID', '')} {env.get('CNI_NETNS', '')} {plugin.type}")
        if cmd == "ADD":
            return 0, plugin.add()
        if cmd == "DEL":
            plugin.delete()
        elif cmd == "CHECK":
            plugin.check()
        elif cmd == "GC":
            plugin.gc()
        elif cmd == "STATUS":
            node_from_config(conf) if plugin.type != "loopback" else None
        else:
            raise CniError(E_INVALID_ENV, f"CNI_COMMAND {cmd!r} is not ADD, DEL, CHECK, GC, STATUS or VERSION")
        return 0, None
    except CniError as exc:
        err = {"cniVersion": version, "code": exc.code, "msg": exc.msg, "details": exc.details}
    except (LabNetError, OSError) as exc:
        err = {"cniVersion": version, "code": E_IO, "msg": str(exc)}
    _log(conf if isinstance(conf, dict) else {}, f"{cmd} failed: {err['msg']}")
    return 1, err


if __name__ == "__main__":
    rc, out = main(sys.stdin.read(), dict(os.environ))
    if out is not None:
        sys.stdout.write(json.dumps(out) + "\n")
    sys.exit(rc)
