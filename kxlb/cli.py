"""kxlb command line: load the datapath and manage services without Kubernetes.

Every command prints one line ``kxlb: error: ...`` and exits 1 on bad input; a failed
command leaves the maps as they were.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import string
import sys

import kxlb
from kxlb.loader import conntrack, datapath
from kxlb.loader.errors import KxlbError
from kxlb.loader.layout import (PROTO_NAMES, Backend, ServiceKey, format_addr_port, parse_addr_port, parse_ip,
                                parse_number)
from kxlb.loader.maps import DEFAULT_PIN_DIR, Maps
from kxlb.loader.services import ServiceTable
from kxlb.loader.writer import writing
from kxlb.loader.svcspec import Frontend, Kind, LbService



def _print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


# --- load / unload --------------------------------------------------------------------------
def cmd_load(a) -> None:
    mode = a.xdp_mode if a.xdp else None
    if a.xdp_trust_checksums and not a.xdp:
        raise KxlbError("--xdp-trust-checksums applies to --xdp only")
    from kxlb.loader.mapspec import conntrack_cflags
    prepared, attached = datapath.load(a.iface, a.netns, mode, a.pin_dir, force=a.force,
                                       xdp_trust_checksums=a.xdp_trust_checksums, wait=a.wait,
                                       extra_cflags=conntrack_cflags(a.conntrack_max) if a.conntrack_max else None)
    if not prepared.compiled:
        print(f"kxlb: the programs pinned in {a.pin_dir} are this build's: attached without compiling")
    for note in prepared.migrated:
        print(f"kxlb: migrated {note}")
    if prepared.reattached:
        print(f"kxlb: {len(prepared.reattached)} earlier attachments now run this build")
    for att in attached:
        where = f" in netns {att.netns}" if att.netns else ""
        print(f"kxlb: {att.hook}{' ' + att.mode if att.mode else ''} attached on {att.iface}{where}; maps in {a.pin_dir}")


def cmd_unload(a) -> None:
    done = datapath.unload(a.pin_dir, a.iface, a.netns, wait=a.wait)
    for att in done.detached:
        print(f"kxlb: detached {att.hook} from {att.iface}" + (f" in netns {att.netns}" if att.netns else ""))
    if not a.iface:
        print(f"kxlb: removed {len(done.pins_removed)} pins kxlb made in {a.pin_dir}")
    for note in done.notes:
        print(f"kxlb: note: {note}")


# --- services -------------------------------------------------------------------------------
def _spec_from_args(a, key: ServiceKey) -> LbService:
    """`service add` arguments -> the service port they describe (the options arrive
    parsed: build_parser gives them types, so that bad ones fail before a map is opened)."""
    cluster, local = tuple(Backend.parse(b) for b in a.backends), tuple(a.local)
    fes = [Frontend(ServiceKey(addr, port, key.proto), Kind.NODE_PORT) for addr, port in a.node_port]
    fes += [Frontend(ServiceKey(ip, key.port, key.proto), Kind.EXTERNAL_IP) for ip in a.external_ip]
    fes += [Frontend(ServiceKey(ip, key.port, key.proto), Kind.LOAD_BALANCER) for ip in a.load_balancer_ip]
    return LbService(key=key, cluster=cluster, local=local, frontends=tuple(fes),
                     internal_local=a.internal_local, external_local=a.external_local,
                     has_endpoints=bool(cluster or local), affinity_s=a.affinity,
                     source_ranges=tuple(a.source_range), name=str(key))


def cmd_service(a) -> None:
    key = ServiceKey.parse(a.service)
    backends = [Backend.parse(b) for b in getattr(a, "backends", [])]
    with writing(a.pin_dir, a.wait) as w:
        if w.repaired:
            print(f"kxlb: note: an earlier writer was killed half way; repaired: {w.repaired}", file=sys.stderr)
        table = ServiceTable(w.maps, journal=w.journal, keyed=True, ids=w.ids)  # no scan of every slot
        if a.action == "add":
            spec = _spec_from_args(a, key)
            if key in table.states:
                raise KxlbError(f"service {key} already exists (use `service set-backends`)")
            st = table.put(spec)
        elif a.action == "set-backends":
            st = table.set_backends(key, backends)
        else:
            table.delete(key)
            print(f"kxlb: service {key} deleted")
            return
    print(f"kxlb: service {key} (id {st.svc_id}) -> {', '.join(map(str, st.backends)) or 'no backends'}")


def cmd_cleanup(a) -> None:
    from kxlb.loader.cleanup import cleanup

    done = cleanup(a.pin_dir, a.netns, a.cgroup, wait=a.wait)
    for att in done.detached:
        print(f"kxlb: detached {att.hook} from {att.iface}" + (f" in netns {att.netns}" if att.netns else ""))
    print(f"kxlb: removed {len(done.pins_removed)} pins in {a.pin_dir}; nothing of kxlb's is left "
          f"{'in netns ' + a.netns if a.netns else 'in this network namespace'}")
    for note in done.notes:
        print(f"kxlb: note: {note}")


def cmd_mount_bpffs(a) -> None:
    from kxlb.loader.mounts import mount_bpffs

    if mount_bpffs(a.dir):
        print(f"kxlb: mounted a bpf filesystem on {a.dir}")
    else:
        print(f"kxlb: {a.dir} is on a bpf filesystem already")


def cmd_status(a) -> None:
    from kxlb.loader.status import status

    st = status(a.pin_dir)
    if a.json:
        _print_json(st)
        return
    print(f"pin directory   {st['pin_dir']}{'' if st['loaded'] else ' (nothing loaded)'}")
    if not st["loaded"]:
        return
    b = st.get("build") or {}
    old = {k: v for k, v in (b.get("layouts") or {}).items() if v != 1}
    print(f"build           {'loaded ' + b['loaded_at'] if b else 'no record (loaded by kxlb 0.1, or never)'}"
          + (f", layouts {', '.join(f'{k} v{v}' for k, v in sorted(old.items()))}" if old else ""))
    w = st.get("writer")
    print(f"writer          {(w.get('what') or 'a command') + ', ' + ', '.join(w['holders']) if w else 'none'}"
          + (f" (health {w['health_check']})" if w and w.get("health_check") else ""))
    if st.get("interrupted_write"):
        print(f"interrupted     {st['interrupted_write']} (the next writer repairs it; or `kxlb gc`)")
    for att in st["attachments"]:
        where = att["where"] + (f" in netns {att['netns']}" if att["netns"] else "")
        print(f"attached        {att['hook']}{' ' + att['mode'] if att['mode'] else ''} on {where}: {att['state']}")
    for name, m in st["maps"].items():
        print(f"map             {name:12} {m['entries']:>9} of {m['capacity']:<9} "
              f"{100 * m['entries'] / m['capacity']:5.1f}%")
    for fam, u in st.get("masquerade_ports", {}).items():
        if u["flows"] or fam == "IPv4":
            print(f"masquerade      {fam} ports {u['range'][0]}-{u['range'][1]}: {u['ports_in_use']} of {u['ports']} "
                  f"in use {100 * u['ports_in_use'] / u['ports']:5.1f}% ({u['flows']} flows)")
    for name, d in st["drops"].items():
        if d["count"]:
            print(f"{d['kind']:15} {name:12} {d['count']}")


def cmd_downgrade(a) -> None:
    from kxlb.loader.downgrade import downgrade

    done = downgrade(a.pin_dir, a.to, wait=a.wait)
    for line in done.converted:
        print(f"kxlb: wrote {line}")
    for pin in done.removed:
        print(f"kxlb: unpinned {pin} (its maps stay with the programs running now)")
    for note in done.notes:
        print(f"kxlb: note: {note}")
    print(f"kxlb: {a.pin_dir} is ready for kxlb {a.to}: load it now (flows that start meanwhile are lost)")


def cmd_gc(a) -> None:
    from kxlb.loader.journal import sweep

    with writing(a.pin_dir, a.wait) as w:
        done = sweep(w.maps)
        if w.ids is not None:
            w.ids.distrust()  # rebuilt from the frontend maps by the next writer
    print(f"kxlb: gc: {done}" + (f" (and an interrupted write repaired: {w.repaired})" if w.repaired else ""))


def _options(spec: LbService) -> list[str]:
    out = []
    if spec.internal_local:
        out.append("internalTrafficPolicy=Local")
    if spec.external_local:
        out.append("externalTrafficPolicy=Local")
    if spec.affinity_s:
        out.append(f"sessionAffinity=ClientIP({spec.affinity_s}s)")
    if spec.source_ranges:
        out.append("sourceRanges=" + ",".join(spec.source_ranges))
    if not spec.has_endpoints:
        out.append("no-endpoints(reject)")
    return out


def cmd_list(a) -> None:
    with Maps.open(a.pin_dir) as maps:
        table = ServiceTable(maps)
        if a.frontend:
            vip, port, proto = _frontend_filter(a.frontend)
            services = table.read_matching(vip, port, proto)
            if not services:
                raise KxlbError(f"no service has a frontend {a.frontend}")
        else:
            services = sorted(table.read_all().values(), key=lambda s: s.key)
    if a.json:
        _print_json([{"service": str(s.key), "vip": s.key.vip, "port": s.key.port,
                      "protocol": PROTO_NAMES[s.key.proto], "id": s.svc_id,
                      "frontends": [{"address": fe.key.vip, "port": fe.key.port, "kind": fe.kind.label}
                                    for fe in s.spec.all_frontends],
                      "internal_traffic_policy": "Local" if s.spec.internal_local else "Cluster",
                      "external_traffic_policy": "Local" if s.spec.external_local else "Cluster",
                      "session_affinity_s": s.spec.affinity_s,
                      "source_ranges": list(s.spec.source_ranges),
                      "has_endpoints": s.spec.has_endpoints,
                      "backends": [str(b) for b in s.backends],
                      "local_backends": [str(b) for b in s.spec.local]} for s in services])
        return
    # IPv6 frontends widen the column (a cluster IP of fd00::/108 with a port is ~20 wide).
    w = max([24] + [len(format_addr_port(fe.key.vip, fe.key.port)) + 1 for s in services for fe in s.spec.all_frontends])
    print(f"Prot {'Frontend':{w}} Kind          Id      Backends (local)  Options")
    for s in services:
        proto = PROTO_NAMES[s.key.proto].upper()
        opts = " ".join(_options(s.spec))
        print(f"{proto:4} {format_addr_port(s.key.vip, s.key.port):{w}} {'ClusterIP':13} {s.svc_id:<7} "
              f"{len(s.backends)} ({len(s.spec.local)}){'':10} {opts}".rstrip())
        for fe in s.spec.frontends:
            print(f"{'':4} {format_addr_port(fe.key.vip, fe.key.port):{w}} {fe.kind.label}")
        for b in s.backends:
            print(f"  -> {b}")
        for b in s.spec.local:
            print(f"  -> {b} (local)")


def _flow_rows(maps: Maps, include_all: bool) -> list[dict]:
    from kxlb.loader.layout import family_of

    now = conntrack.now_ticks()
    snat = {family_of(a): a for a in ServiceTable(maps).read_config().snat_addrs}
    rows = []
    for f in conntrack.flows(maps):
        if not include_all and not f.live(now):
            continue
        source = snat.get(f.family, "?") if f.masqueraded else f.client.addr
        rows.append({
            "protocol": f.protocol,
            "client": str(f.client),
            "frontend": str(f.front),
            "backend": str(f.backend),
            "source": str(conntrack.Endpoint(source, f.source_port)),  # what the backend sees as the client
            "service_id": f.svc_id,
            "expires_in_s": round(f.expires_in_s(now), 1),
            "state": f.state,
        })
    return sorted(rows, key=lambda r: (r["frontend"], r["client"]))


def _frontend_filter(text: str) -> tuple[str, int | None, int | None]:
    """`kxlb list` argument: VIP, VIP:PORT or VIP:PORT/PROTO ([IPv6] with a port)."""
    if "/" in text:
        key = ServiceKey.parse(text)
        return key.vip, key.port, key.proto
    if text.startswith("[") or text.count(":") == 1:
        addr, port = parse_addr_port(text, "frontend", "VIP:PORT")
        return addr, port, None
    return parse_ip(text, "frontend"), None, None


def cmd_conntrack(a) -> None:
    with Maps.open(a.pin_dir) as maps:
        rows = _flow_rows(maps, a.all)
    if a.json:
        _print_json(rows)
        return
    w = max([21] + [len(r[c]) for r in rows for c in ("client", "frontend", "backend")])
    print(f"{'proto':5} {'client':{w}} {'frontend':{w}} {'backend':{w}} {'expires':>8}  state")
    for r in rows:
        via = f" via {r['source']}" if r["source"] != r["client"] else ""
        print(f"{r['protocol']:5} {r['client']:{w}} {r['frontend']:{w}} {r['backend']:{w}} "
              f"{r['expires_in_s']:>7}s  {','.join(r['state']) or '-'}{via}")


def cmd_stats(a) -> None:
    with Maps.open(a.pin_dir) as maps:
        table = ServiceTable(maps)
        services = sorted(table.read_all().values(), key=lambda s: s.key)
        per_svc = []
        for s in services:
            c = table.counters(s.svc_id)
            per_svc.append({"service": str(s.key), "id": s.svc_id,
                            **{name: getattr(c, name) for name, _ in c._fields_}})
        dp = table.datapath_counters()
    if a.json:
        _print_json({"services": per_svc, "datapath": dp})
        return
    w = max([26] + [len(r["service"]) + 1 for r in per_svc])
    print(f"{'service':{w}} {'conns':>8} {'pkts in':>10} {'bytes in':>12} {'pkts out':>10} {'bytes out':>12}")
    for r in per_svc:
        print(f"{r['service']:{w}} {r['new_flows']:>8} {r['fwd_packets']:>10} {r['fwd_bytes']:>12} "
              f"{r['rev_packets']:>10} {r['rev_bytes']:>12}")
    print("\ndatapath counters:")
    for name, v in dp.items():
        print(f"  {name:14} {v}")


# --- version --------------------------------------------------------------------------------
def _layout_version() -> int | None:
    """The datapath's map layout version (kxlb.loader.mapspec), None where that module does
    not exist yet. Imported here only: `kxlb version` must work without it."""
    try:
        mapspec = importlib.import_module("kxlb.loader.mapspec")
    except ModuleNotFoundError as exc:
        if exc.name != "kxlb.loader.mapspec":
            raise
        return None
    return getattr(mapspec, "LAYOUT_VERSION", None)


def version_info() -> dict:
    return {"version": kxlb.version(), "commit": kxlb.git_commit(), "layout_version": _layout_version()}


def version_text() -> str:
    info = version_info()
    lines = [f"kxlb {info['version']}",
             f"commit {info['commit'] or 'unknown (not run from a git checkout)'}"]
    if info["layout_version"] is not None:
        lines.append(f"datapath layout {info['layout_version']}")
    return "\n".join(lines)


def cmd_version(a) -> None:
    if a.json:
        _print_json(version_info())
    else:
        print(version_text())


class _PrintVersion(argparse.Action):
    """--version: the `version` command's text, computed only when asked for (argparse's
    own version action takes a string made with the parser)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


# --- parser ---------------------------------------------------------------------------------
def _conntrack_max(text: str) -> int:
    return parse_number(text, "--conntrack-max", 1024, 1 << 24)


def _wait_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait", type=float, default=10.0, metavar="SECONDS",
                   help="how long to wait for another writer of the pin directory to finish (one writer at a "
                        "time: a running controller holds it for its life; default %(default)s)")


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's contract for bad input, one line `kxlb: error: ...` and
    status 1 (main prints it), where argparse prints its usage and exits 2. Sub-parsers
    are made of the same class (add_subparsers passes type(self) on), those that other
    packages register through _extensions() included."""

    def error(self, message: str):
        command = self.prog.partition(" ")[2]   # "service add" of "kxlb service add"
        # argparse quotes most values it reports, but not unrecognized arguments.
        message = message.replace("\n", "\\n").replace("\r", "\\r")
        raise KxlbError(f"{command}: {message}" if command else message)


_PIN_DIR_CHARS = frozenset(string.ascii_letters + string.digits + "/._-@+:")


def check_pin_dir(path: str, what: str = "--pin-dir") -> str:
    """``path`` if it is fit for a pin directory, else a KxlbError naming ``what``.
    loader/compile.py pastes the path into the datapath's C source as a string literal
    (-DKXLB_PIN_DIR="..."), so a quote, backslash or newline would break the compile with
    compiler noise, or change the program: hence a few safe characters. Absolute and
    without '..', so that it names one directory whatever the working directory."""
    if not path.startswith("/"):
        raise KxlbError(f"{what} {path!r}: must be an absolute path")
    bad = sorted({c for c in path if c not in _PIN_DIR_CHARS})
    if bad:
        raise KxlbError(f"{what} {path!r}: {', '.join(map(repr, bad))} not allowed "
                        "(letters, digits and /._-@+: only)")
    if ".." in path.split("/"):
        raise KxlbError(f"{what} {path!r}: must not contain '..'")
    return path


# Types of the options of `service add`: bad values fail while parsing, naming the option.
def _node_port(text: str) -> tuple[str, int]:
    return parse_addr_port(text, f"--node-port {text!r}", "ADDR:PORT")


def _local_backend(text: str) -> Backend:
    return Backend(*parse_addr_port(text, f"--local {text!r}", "ADDR:PORT"))


def _affinity(text: str) -> int:
    return parse_number(text, "--affinity", 0, 86400)   # kube-proxy's limit, as LbService checks


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kxlb", description=(
        "eBPF/XDP service load balancer. Standalone mode: declare VIP:PORT/PROTO -> backends "
        "like ipvsadm; the kernel datapath does the rest, with no kxlb process running."))
    p.add_argument("--version", action=_PrintVersion, help="print the version and exit")
    p.add_argument("--pin-dir", type=check_pin_dir, default=os.environ.get("KXLB_PIN_DIR", DEFAULT_PIN_DIR),
                   help="bpffs directory of the pinned maps (env KXLB_PIN_DIR; default %(default)s)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ld = sub.add_parser("load", help="compile the datapath and attach it to an interface")
    ld.add_argument("--iface", required=True, action="append",
                    help="interface to attach to (ingress); repeat for several")
    ld.add_argument("--netns", help="network namespace: a name from `ip netns` or a path like /proc/PID/ns/net")
    ld.add_argument("--xdp", action="store_true",
                    help="attach at XDP instead of tc clsact ingress: for the physical uplink (traffic from "
                         "outside: NodePort, LoadBalancer, externalIP). Refused on veths and other virtual "
                         "devices, where packets with partial checksums reach the program (docs/datapath.md)")
    ld.add_argument("--xdp-mode", choices=("generic", "native"), default="generic",
                    help="XDP attach mode with --xdp (default %(default)s)")
    ld.add_argument("--xdp-trust-checksums", action="store_true",
                    help="allow --xdp on a virtual device: you state that every sender on the link finalises "
                         "its checksums (TX checksum offload off), else translated packets get bad checksums")
    ld.add_argument("--force", action="store_true",
                    help="replace an XDP program that kxlb did not attach (by default kxlb refuses)")
    ld.add_argument("--conntrack-max", type=_conntrack_max, metavar="FLOWS",
                    help="flows the conntrack table holds (preallocated; default 131072: kube-proxy's "
                         "nf_conntrack_max on 2 CPUs). A new size is migrated into, flows kept")
    _wait_option(ld)
    ld.set_defaults(func=cmd_load)

    ul = sub.add_parser("unload", help="detach from an interface, or (without --iface) everywhere and remove the "
                                       "pins kxlb made (only programs and pins kxlb recorded; nothing else)")
    ul.add_argument("--iface")
    ul.add_argument("--netns")
    _wait_option(ul)
    ul.set_defaults(func=cmd_unload)

    sv = sub.add_parser("service", help="add, delete or change a service")
    ssub = sv.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, helptext in (("add", "add a service VIP:PORT/tcp|udp|sctp (IPv6: [VIP]:PORT/...) with its backends "
                                   "(of the VIP's family)"),
                           ("set-backends", "replace a service's backends (atomically for packets)")):
        s = ssub.add_parser(name, help=helptext)
        s.add_argument("service", metavar="VIP:PORT/PROTO")
        # default=[]: without one argparse names this optional list among the missing arguments
        s.add_argument("backends", nargs="*", default=[], metavar="BACKEND:PORT", help="IPv6: [ADDR]:PORT")
        s.set_defaults(func=cmd_service)
        _wait_option(s)
        if name != "add":
            continue
        s.add_argument("--node-port", action="append", default=[], metavar="ADDR:PORT", type=_node_port,
                       help="also reachable on this node address and port (a NodePort); repeatable")
        s.add_argument("--external-ip", action="append", default=[], metavar="IP",
                       type=lambda ip: parse_ip(ip, "--external-ip"),
                       help="also reachable on IP at the service port (an externalIP); repeatable")
        s.add_argument("--load-balancer-ip", action="append", default=[], metavar="IP",
                       type=lambda ip: parse_ip(ip, "--load-balancer-ip"),
                       help="also reachable on this load-balancer IP at the service port; repeatable")
        s.add_argument("--local", action="append", default=[], metavar="BACKEND:PORT", type=_local_backend,
                       help="a backend on this node (the set Local traffic policies use); repeatable")
        s.add_argument("--internal-local", action="store_true",
                       help="internalTrafficPolicy Local: the VIP uses only --local backends")
        s.add_argument("--external-local", action="store_true",
                       help="externalTrafficPolicy Local: outside clients of the other frontends use only "
                            "--local backends and keep their source address")
        s.add_argument("--affinity", type=_affinity, default=0, metavar="SECONDS",
                       help="sessionAffinity ClientIP: a client keeps its backend for SECONDS after its last "
                            "new connection")
        s.add_argument("--source-range", action="append", default=[], metavar="CIDR",
                       help="loadBalancerSourceRanges: only these clients reach --load-balancer-ip; repeatable")
    s = ssub.add_parser("del", help="delete a service (tracked flows keep their backend)")
    s.add_argument("service", metavar="VIP:PORT/PROTO")
    s.set_defaults(func=cmd_service)
    _wait_option(s)

    cl = sub.add_parser("cleanup", help="remove every program, hook and pin kxlb made on this node (the "
                                        "registry's and, by name, those it may not know: kube-proxy's --cleanup)")
    cl.add_argument("--netns", help="the network namespace to clean (default: this one)")
    cl.add_argument("--cgroup", help="the cgroup v2 directory of the socket hooks (default: the cgroup2 root)")
    cl.set_defaults(func=cmd_cleanup)
    _wait_option(cl)

    mb = sub.add_parser("mount-bpffs", help="mount a bpf filesystem on DIR unless one is there (the DaemonSet's "
                                            "init container, for nodes that boot without one, as kind's)")
    mb.add_argument("dir", nargs="?", default="/sys/fs/bpf", metavar="DIR", help="default %(default)s")
    mb.set_defaults(func=cmd_mount_bpffs)

    st = sub.add_parser("status", help="what is loaded, attached where, who writes the maps, how full they are, "
                                       "what was dropped")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=cmd_status)

    dg = sub.add_parser("downgrade", help="make the pin directory loadable by an older release, its flows kept: "
                                          "run right before that release's `kxlb load` (docs/operations.md)")
    dg.add_argument("--to", required=True, metavar="RELEASE", help="the release to roll back to, e.g. 0.1.0")
    dg.set_defaults(func=cmd_downgrade)
    _wait_option(dg)

    gc = sub.add_parser("gc", help="remove Maglev tables, source ranges and markers that no service reaches "
                                   "(left by a writer that was killed); backend slots no service names are free "
                                   "already")
    gc.set_defaults(func=cmd_gc)
    _wait_option(gc)

    for name, fn, helptext in (("list", cmd_list, "services and their backends (like ipvsadm -Ln)"),
                               ("conntrack", cmd_conntrack, "tracked flows"),
                               ("stats", cmd_stats, "per-service and datapath counters")):
        c = sub.add_parser(name, help=helptext)
        c.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "list":
            c.add_argument("frontend", nargs="?", metavar="VIP[:PORT[/PROTO]]",
                           help="only the service ports with this frontend (looked up, not a scan of every map)")
        if name == "conntrack":
            c.add_argument("--all", action="store_true", help="include expired flows")
        c.set_defaults(func=fn)

    v = sub.add_parser("version", help="kxlb's version, the commit of a checkout, the datapath's layout version")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=cmd_version)

    for register in _extensions():
        register(sub)
    _accept_after_command(p, "--pin-dir", skip={"lab", "demo", "version", "mount-bpffs"}, type=check_pin_dir,
                          help="same as the global --pin-dir")
    return p


def _accept_after_command(parser: argparse.ArgumentParser, flag: str, skip: set[str], **kw) -> None:
    """Let a global option also follow the sub-command (`kxlb controller --pin-dir X`),
    except in sub-commands that do not use it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                if name in skip:
                    continue
                if flag not in child._option_string_actions:
                    child.add_argument(flag, default=argparse.SUPPRESS, **kw)
                _accept_after_command(child, flag, skip, **kw)


def _extensions():
    """Sub-commands living in other packages: the controller's, and the development lab's
    (demo, lab) where the lab is installed. A checkout's venv has it; the product (the
    image of deploy/Dockerfile) is built without it, and its CLI has no lab commands."""
    from kxlb.controller import main as controller
    try:
        from kxlb.lab import labcli, standalone
    except ModuleNotFoundError as exc:
        if exc.name != "kxlb.lab":   # the lab is there but broken (a dependency missing): say so
            raise
        return [controller.register]
    return [controller.register, standalone.register, labcli.register]


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        args.func(args)
    except KxlbError as exc:
        print(f"kxlb: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
