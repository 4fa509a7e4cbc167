"""An upgrade under load: 10,000 established TCP connections through a VIP and a UDP
stream of one datagram per millisecond, while `kxlb load` swaps the datapath twice with a
conntrack migration each time (a build with another conntrack capacity, then back).

Reported: connections broken (a connection that no longer answers, or answers from
another backend), datagrams lost while the swaps ran, each swap's time and the entries it
migrated. The namespaces are the netlab's (client, node, three backends); the backends
run an asyncio echo server, the client an asyncio client holding every connection.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SERVER = r"""
import asyncio, sys
name = sys.argv[1].encode()
async def tcp(reader, writer):
    try:
        while line := await reader.readline():
            writer.write(name + b" " + line); await writer.drain()
    except ConnectionError:
        pass
class Udp(asyncio.DatagramProtocol):
    def connection_made(self, t): self.t = t
    def datagram_received(self, data, addr): self.t.sendto(name + b" " + data, addr)
async def main():
    server = await asyncio.start_server(tcp, "0.0.0.0", 8080, backlog=4096)
    await asyncio.get_running_loop().create_datagram_endpoint(Udp, local_addr=("0.0.0.0", 8053))
    print("ready", flush=True)
    await server.serve_forever()
asyncio.run(main())
"""

CLIENT = r"""
import asyncio, json, socket, sys
vip, n = sys.argv[1], int(sys.argv[2])
conns, seen = [], set()
async def probe(i):
    r, w = conns[i]
    try:
        w.write(b"x\n"); await w.drain()
        return (await asyncio.wait_for(r.readline(), 10)).split()[0].decode()
    except Exception:
        return "broken"
async def main():
    for i in range(0, n, 200):  # connect in waves: the backlog and the SYN queue stay small
        conns.extend(await asyncio.gather(*(asyncio.open_connection(vip, 80) for _ in range(min(200, n - i)))))
    first = await asyncio.gather(*(probe(i) for i in range(n)))
    print(json.dumps({"connected": len(conns)}), flush=True)
    loop = asyncio.get_running_loop()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.setblocking(False); udp.connect((vip, 53))
    stream = {"sent": 0, "run": False}
    def readable():
        try:
            while True:
                seen.add(udp.recv(64).split()[1])
        except BlockingIOError:
            pass
    loop.add_reader(udp.fileno(), readable)
    async def pinger():
        while stream["run"]:
            udp.send(str(stream["sent"]).encode()); stream["sent"] += 1
            await asyncio.sleep(0.001)
    task = None
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = line.split()
        if cmd[0] == "probe":
            now = await asyncio.gather(*(probe(i) for i in range(n)))
            print(json.dumps({"broken": sum(a != b for a, b in zip(first, now))}), flush=True)
        elif cmd[0] == "stream-on":
            stream["run"] = True; task = asyncio.ensure_future(pinger()); print("{}", flush=True)
        elif cmd[0] == "stream-off":
            stream["run"] = False; await task; await asyncio.sleep(1)
            print(json.dumps({"sent": stream["sent"], "received": len(seen)}), flush=True)
asyncio.run(main())
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=10000)
    args = ap.parse_args()
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, args.connections + 1024), max(hard, args.connections + 1024)))
    from kxlb.lab.netlab import NetLab, sh
    from kxlb.loader import datapath
    from kxlb.loader.maps import Maps
    from kxlb.loader.layout import Backend, ServiceKey
    from kxlb.loader.services import ServiceTable

    vip = "10.96.9.1"
    with NetLab() as lab:
        servers = []
        try:
            for i in range(3):
                p = subprocess.Popen(["ip", "netns", "exec", lab.backend(i), sys.executable, "-c", SERVER, f"be{i}"],
                                     stdout=subprocess.PIPE, text=True)
                servers.append(p)
                assert p.stdout.readline().strip() == "ready"
            datapath.load(lab.node_ifaces, lab.node, pin_dir=lab.pin_dir)
            with Maps.open(lab.pin_dir) as maps:
                t = ServiceTable(maps)
                t.add(ServiceKey(vip, 80, 6), [Backend(lab.backend_ip(i), 8080) for i in range(3)])
                t.add(ServiceKey(vip, 53, 17), [Backend(lab.backend_ip(i), 8053) for i in range(3)])
            for ns in [lab.client] + [lab.backend(i) for i in range(3)]:  # 10k connections per port pair
                sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65000",
                   "net.core.somaxconn=4096", "net.ipv4.tcp_max_syn_backlog=4096")
            client = subprocess.Popen(["ip", "netns", "exec", lab.client, "prlimit", f"--nofile={args.connections + 1024}",
                                       sys.executable, "-c", CLIENT, vip, str(args.connections)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

            def ask(cmd: str) -> dict:
                client.stdin.write(cmd + "\n")
                client.stdin.flush()
                return json.loads(client.stdout.readline())
            t0 = time.perf_counter()
            connected = json.loads(client.stdout.readline())["connected"]
            print(f"{connected} connections established in {time.perf_counter() - t0:.1f} s")
            ask("stream-on")
            swaps = []
            for cflags in (["-DKXLB_CT_ENTRIES=524288"], None):
                t0 = time.perf_counter()
                prepared, _ = datapath.load(lab.node_ifaces, lab.node, pin_dir=lab.pin_dir, extra_cflags=cflags)
                swaps.append((time.perf_counter() - t0, prepared.migrated))
                time.sleep(1)
            stream = ask("stream-off")
            broken = ask("probe")["broken"]
            client.kill()
        finally:
            for p in servers:
                p.kill()
    print(f"\n| upgrade under load ({connected:,} TCP connections, 1 datagram/ms) | result |\n|---|---|")
    for i, (secs, migrated) in enumerate(swaps, 1):
        print(f"| swap {i}: time (compile, migrate, switch) | {secs:.1f} s |")
        print(f"| swap {i}: migrated | {'; '.join(migrated)} |")
    print(f"| connections broken | {broken} of {connected} |")
    print(f"| datagrams lost during the swaps | {stream['sent'] - stream['received']} of {stream['sent']} |")


if __name__ == "__main__":
    main()
