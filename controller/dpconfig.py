"""The datapath's node configuration (loader/services.py DatapathConfig) from what the
controller knows of the node and the cluster: a pure function, testable without a kernel."""
from __future__ import annotations

from typing import Iterable

from kxlb.loader.services import DatapathConfig


def datapath_config(node_ips: Iterable[str | None], masquerade_address: str | None, pod_cidrs: Iterable[str],
                    service_cidrs: Iterable[str], masquerade_all: bool, src_ports: tuple[int, int] | None,
                    not_held: frozenset[str] = frozenset()) -> DatapathConfig:
    """The config (service CIDRs sorted: the first of each family go into the config
    entry itself, loader/services.py DatapathConfig).

    - node_addrs: the node IP of each family (hairpin and local-backend checks);
    - snat_addrs: what masqueraded flows leave with: the node IP of each family, but
      ``not_held`` (node IPs taken from an ExternalIP that no interface of the node holds:
      a cloud's NAT address would send replies nowhere), the --masquerade-address
      replacing its own family's;
    - cluster_cidrs: the pods (clients outside them are masqueraded)."""
    node_addrs = tuple(a for a in node_ips if a)
    masq = masquerade_address
    own = tuple(a for a in node_addrs if a not in not_held)
    snat = tuple(a for a in own if not masq or (":" in a) != (":" in masq)) + ((masq,) if masq else ())
    return DatapathConfig(snat_addrs=snat, cluster_cidrs=tuple(pod_cidrs), service_cidrs=tuple(sorted(set(service_cidrs))),
                          masquerade_all=masquerade_all, src_ports=src_ports or None, node_addrs=node_addrs)
