"""The lab's load-balancer IP allocator: what MetalLB or a cloud controller does, reduced to
its API contract. Every Service of type LoadBalancer (without spec.loadBalancerClass) gets
the next free address of the pool in status.loadBalancer.ingress (ipMode VIP); an address
comes back to the pool when its Service goes or changes type. spec.loadBalancerIP, when set
and inside the pool, is honoured. The client namespace routes the pool via node 1, as a
router in front of a cluster would.

    python -m kxlb.lab.lbpool --kubeconfig FILE [--pool CIDR]
"""
from __future__ import annotations

import argparse
import ipaddress
import logging

log = logging.getLogger("kxlb.lab.lbpool")

DEFAULT_POOL = "10.250.100.0/24"


class Allocator:
    """Watches Services (the controller's list+watch, controller/informer.py) and keeps
    the pool's assignments: a pass per change, over that Service only. Listing every
    Service on a timer instead cost a core at 20,000 Services in this lab, and slowed
    everything else the lab measures."""

    def __init__(self, api, pool: str):
        from kubernetes import client

        self.core = client.CoreV1Api(api)
        self.pool = ipaddress.IPv4Network(pool)
        self.used: dict[str, str] = {}  # "ns/name" -> ip

    def _free(self, want: str | None) -> str | None:
        taken = set(self.used.values())
        if want and ipaddress.IPv4Address(want) in self.pool and want not in taken:
            return want
        return next((str(a) for a in self.pool.hosts() if str(a) not in taken), None)

    def on_service(self, key: str, svc: dict | None) -> None:
        """Assign, keep or release the address of one Service (None: deleted)."""
        spec = (svc or {}).get("spec") or {}
        if spec.get("type") != "LoadBalancer" or spec.get("loadBalancerClass"):
            if key in self.used:
                log.info("%s: released %s", key, self.used.pop(key))
            return
        have = [i["ip"] for i in ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
                if i.get("ip")]
        if have:
            self.used[key] = have[0]
            return
        if key in self.used:  # assigned by an earlier pass; its status is on the way
            return
        ip = self._free(spec.get("loadBalancerIP"))
        if ip is None:
            log.error("pool %s exhausted: %s stays pending", self.pool, key)
            return
        meta = svc["metadata"]
        self.core.patch_namespaced_service_status(meta["name"], meta["namespace"], {
            "status": {"loadBalancer": {"ingress": [{"ip": ip, "ipMode": "VIP"}]}}})
        self.used[key] = ip
        log.info("%s: load-balancer IP %s", key, ip)

    def reconcile(self, services: list[dict]) -> None:
        """A complete state (the first list, a relist): every Service, and releases."""
        seen = set()
        for svc in services:
            key = f"{svc['metadata']['namespace']}/{svc['metadata']['name']}"
            seen.add(key)
            self.on_service(key, svc)
        for key in set(self.used) - seen:
            log.info("%s: released %s", key, self.used.pop(key))

    def run(self) -> None:
        from kxlb.controller.informer import DELETED, Informer

        def on_event(typ: str, key: str, obj: dict) -> None:
            try:
                self.on_service(key, None if typ == DELETED else obj)
            except Exception as exc:  # noqa: BLE001 - a conflict, the API server restarting
                log.warning("%s: %s (the next change or relist retries)", key, exc)

        Informer("services", self.core.list_service_for_all_namespaces, on_event,
                 on_list=self.reconcile).run()


def main(argv: list[str] | None = None) -> None:
    from kubernetes import config

    p = argparse.ArgumentParser(prog="python -m kxlb.lab.lbpool", description=__doc__.split("\n\n")[0])
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--pool", default=DEFAULT_POOL)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    Allocator(config.new_client_from_config(config_file=a.kubeconfig), a.pool).run()


if __name__ == "__main__":
    main()
