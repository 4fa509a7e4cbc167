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
import time

log = logging.getLogger("kxlb.lab.lbpool")

DEFAULT_POOL = "10.250.100.0/24"


class Allocator:
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

    def reconcile(self, services: list) -> None:
        """One pass over every Service: assign, keep, release."""
        seen = set()
        for svc in services:
            key = f"{svc.metadata.namespace}/{svc.metadata.name}"
            if svc.spec.type != "LoadBalancer" or svc.spec.load_balancer_class:
                continue
            seen.add(key)
            have = [i.ip for i in (svc.status.load_balancer.ingress or [])] if svc.status.load_balancer else []
            if have:
                self.used[key] = have[0]
                continue
            ip = self._free(svc.spec.load_balancer_ip)
            if ip is None:
                log.error("pool %s exhausted: %s stays pending", self.pool, key)
                continue
            self.core.patch_namespaced_service_status(svc.metadata.name, svc.metadata.namespace, {
                "status": {"loadBalancer": {"ingress": [{"ip": ip, "ipMode": "VIP"}]}}})
            self.used[key] = ip
            log.info("%s: load-balancer IP %s", key, ip)
        for key in set(self.used) - seen:
            log.info("%s: released %s", key, self.used.pop(key))

    def run(self, period: float = 0.2) -> None:
        while True:
            try:
                self.reconcile(self.core.list_service_for_all_namespaces().items)
            except Exception as exc:  # the API server restarting, a conflict: next pass
                log.warning("pass failed: %s", exc)
            time.sleep(period)


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
