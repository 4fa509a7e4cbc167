/* SPDX-License-Identifier: GPL-2.0 */
/* Every map of the datapath: layouts, and (for the datapath build) declarations.
 *
 * loader/layout.py mirrors each struct with ctypes; tests/test_layout.py checks sizes and
 * field offsets against the BTF that clang emits for this header. Change both together.
 *
 * The service model. A *service port* (one entry of a Service's spec.ports) has one
 * svc_id and two backend sets: the cluster-wide set and this node's set (traffic
 * policies Local). Clients reach it through *frontends*, one svc_map entry each: the
 * cluster IP, every node address on the nodePort, every externalIP, every load-balancer
 * IP. Every frontend of a service port carries the same svc_id, generation and set
 * sizes; its kind and flags say which set a new flow uses and whether it is masqueraded
 * (lb.h, lb_decide()).
 *
 * IPv6 (docs/datapath.md): parallel per-family maps, as Cilium does. The maps keyed or
 * valued by an address (svc_map, backend_map, ct_map, frag_map, affinity_map,
 * src_range_map, sock_rev) are the IPv4 family's; IPv6 adds its own with 16-byte
 * addresses beside them. What carries no address (svc_value, the counters, the
 * per-service stats) is shared by both families.
 *
 * Consistency of a service (why the generations): backend slots live in backend_map
 * under (svc_id, set, slot, gen). To change a service port's backends, user space
 *   1. writes both new sets under the inactive generation (invisible to packets),
 *   2. replaces every frontend's svc_map entry (set sizes + gen flip atomically: a hash
 *      map update swaps the whole element),
 *   3. deletes the old generation's slots.
 * A packet therefore sees the old sets or the new sets, never a mix. The one window: a
 * packet read an old entry, then step 3 deleted the slot it wants; the datapath
 * re-reads the entry once and picks from the new generation (KXLB_ST_SLOT_RETRY).
 * Adding a service writes slots first, then the entries; deleting removes the entries
 * first, then the slots. */
#ifndef KXLB_MAPS_H
#define KXLB_MAPS_H
#include "consts.h"

/* svc_map key: a frontend, as a client addresses it. A live cluster IP also has a
 * marker entry (port 0, proto 0, kind KXLB_KIND_MARKER): traffic to a port no Service
 * defines on it is rejected, as kube-proxy's cluster-ips set does. */
struct svc_key {
	__be32 vip;
	__be16 port;
	__u8   proto;     /* IPPROTO_TCP / IPPROTO_UDP; 0 for a marker */
	__u8   pad;
};

/* svc_map value: one frontend of a service port. */
struct svc_value {
	__u32 svc_id;      /* 1..KXLB_MAX_SERVICES-1; keys backend_map, affinity, svc_stats */
	__u16 count;       /* slots of the cluster-wide set in the active generation */
	__u16 local_count; /* slots of this node's set in the active generation */
	__u8  gen;         /* active generation of backend slots: 0 or 1 */
	__u8  kind;        /* KXLB_KIND_*: which traffic policy applies */
	__u16 flags;       /* KXLB_SVC_F_* */
	__u32 affinity_s;  /* KXLB_SVC_F_AFFINITY: sessionAffinityConfig timeoutSeconds */
};

/* backend_map key: one slot of a service port's backend set. */
struct backend_key {
	__u32 svc_id;
	__u16 slot;       /* 0..count-1 (or local_count-1) */
	__u8  gen;
	__u8  set;        /* KXLB_SET_CLUSTER / KXLB_SET_LOCAL */
};

/* backend_map value: where the slot sends new flows. */
struct backend {
	__be32 addr;
	__be16 port;
	__u16  pad;
};

/* ct_map key. A flow has two entries: FWD keyed as the client sends (client -> VIP),
 * REV keyed as the backend answers (backend -> client). */
struct ct_key {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8   proto;
	__u8   dir;       /* KXLB_CT_DIR_* */
	__u16  pad;
};

/* ct_map value. The translation is stored in the entry itself (not a backend id), so a
 * flow keeps working when its backend leaves the service or the service is deleted, as
 * Linux conntrack does under kube-proxy. A masqueraded flow (KXLB_CT_F_SNAT) also
 * replaces the client's address: FWD packets leave with snat_addr:snat_port as their
 * source, and REV packets go back to the client at snat_addr:snat_port. Its REV entry
 * is keyed backend -> snat_addr:snat_port. */
struct ct_entry {
	__u64  expires_ns; /* CLOCK_MONOTONIC deadline (bpf_ktime_get_ns) */
	__be32 nat_addr;   /* FWD: backend address; REV: VIP */
	__be16 nat_port;   /* FWD: backend port; REV: service port */
	__u8   flags;      /* KXLB_CT_F_* */
	__u8   pad;
	__u32  svc_id;     /* for per-service counters */
	__u32  created_s;  /* creation time, seconds of CLOCK_MONOTONIC (for `kxlb conntrack`) */
	__be32 snat_addr;  /* KXLB_CT_F_SNAT: FWD: masquerade address; REV: the client */
	__be16 snat_port;  /*   FWD: masquerade port; REV: the client's port */
	__u16  pad2;
};

/* frag_map: lets non-first fragments (which carry no ports) follow their first
 * fragment's translation. Keyed by the datagram as it arrived. */
struct frag_key {
	__be32 saddr;
	__be32 daddr;
	__be16 id;
	__u8   proto;
	__u8   pad;
};

struct frag_value {
	__be32 saddr;      /* the first fragment's new source and destination */
	__be32 daddr;
};

/* affinity_map: sessionAffinity ClientIP. Per service port, backend set and client
 * address: the backend its last new connection went to, and when. kube-proxy keys
 * affinity the same way (source address, service port, whichever frontend was used)
 * and refreshes it on every new connection. LRU: a full table forgets the coldest
 * client (it gets a fresh pick), never refuses a connection. */
struct affinity_key {
	__u32  svc_id;
	__be32 client;
	__u8   set;       /* KXLB_SET_*: a client may hold one backend per set */
	__u8   pad[3];
};

struct affinity_value {
	__u64  last_ns;   /* bpf_ktime_get_ns() of the last new connection */
	__be32 addr;      /* the backend */
	__be16 port;
	__u16  pad;
};

/* src_range_map (LPM trie): loadBalancerSourceRanges. A load-balancer frontend with
 * KXLB_SVC_F_SRC_RANGES admits a new flow only if (svc_id, client) matches an entry.
 * prefixlen counts svc_id's 32 bits too: a CIDR /n is stored with prefixlen 32 + n. */
struct src_range_key {
	__u32  prefixlen;
	__u32  svc_id;    /* always matched whole (prefixlen >= 32): byte order is moot */
	__be32 addr;
};

/* cfg_map (one entry, written by the controller).
 * Masquerade, as kube-proxy does: a new flow is masqueraded to snat_addr when the
 * client is the chosen backend itself (hairpin), when it reaches a cluster IP from
 * outside cluster_cidr (or always, KXLB_CFG_F_MASQUERADE_ALL), and when it reaches an
 * external frontend of a service with externalTrafficPolicy Cluster (so the reply comes
 * back through this node). snat_addr 0: never. cluster_mask 0: no cluster CIDR known,
 * every client counts as external.
 * svc_cidr/svc_mask: the service CIDRs (ServiceCIDR objects). A new flow to an address
 * in them that is not a live cluster IP is dropped (mask 0: unused slot). */
struct lb_config {
	__be32 snat_addr;
	__be32 cluster_cidr;
	__be32 cluster_mask;
	__u32  flags;      /* KXLB_CFG_F_* */
	__be32 svc_cidr[KXLB_MAX_SVC_CIDRS];
	__be32 svc_mask[KXLB_MAX_SVC_CIDRS];
};

/* sock_rev: socket-level translation (sock.c) of host processes. Which VIP:port a
 * socket addressed before its connect/sendmsg went to a backend, so replies and
 * getpeername() show the VIP. */
struct sock_rev_key {
	__u64  cookie;     /* bpf_get_socket_cookie() */
	__be32 addr;       /* backend */
	__be16 port;
	__u16  pad;
};

struct sock_rev_value {
	__be32 vip;
	__be16 port;
	__u16  pad;
};

/* svc_stats value (per CPU, index svc_id). */
struct svc_counters {
	__u64 fwd_packets;
	__u64 fwd_bytes;
	__u64 rev_packets;
	__u64 rev_bytes;
	__u64 new_flows;
};

#ifdef KXLB_DATAPATH
#ifndef KXLB_PIN_DIR
#define KXLB_PIN_DIR "/sys/fs/bpf/kxlb"
#endif
/* Written by user space only. No prealloc: the control plane pays the allocation, and
 * memory follows the number of services rather than the capacity. */
BPF_TABLE_PINNED("hash", struct svc_key, struct svc_value, svc_map,
		 KXLB_MAX_FRONTENDS, KXLB_PIN_DIR "/services", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", struct backend_key, struct backend, backend_map,
		 KXLB_MAX_BACKEND_SLOTS, KXLB_PIN_DIR "/backends", BPF_F_NO_PREALLOC);
/* Written by the datapath. LRU: a full table evicts the coldest flow rather than
 * refusing a new one. */
BPF_TABLE_PINNED("lru_hash", struct ct_key, struct ct_entry, ct_map,
		 KXLB_CT_ENTRIES, KXLB_PIN_DIR "/conntrack");
BPF_TABLE_PINNED("lru_hash", struct frag_key, struct frag_value, frag_map,
		 KXLB_FRAG_ENTRIES, KXLB_PIN_DIR "/frags");
BPF_TABLE_PINNED("percpu_array", __u32, struct svc_counters, svc_stats,
		 KXLB_MAX_SERVICES, KXLB_PIN_DIR "/svc_stats");
BPF_TABLE_PINNED("percpu_array", __u32, __u64, dp_stats,
		 KXLB_ST_MAX, KXLB_PIN_DIR "/dp_stats");
BPF_TABLE_PINNED("lru_hash", struct affinity_key, struct affinity_value, affinity_map,
		 KXLB_AFFINITY_ENTRIES, KXLB_PIN_DIR "/affinity");
BPF_TABLE_PINNED("lpm_trie", struct src_range_key, __u8, src_range_map,
		 KXLB_SRC_RANGE_ENTRIES, KXLB_PIN_DIR "/src_ranges", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("lru_hash", struct sock_rev_key, struct sock_rev_value, sock_rev,
		 KXLB_CT_ENTRIES, KXLB_PIN_DIR "/sock_rev");
BPF_TABLE_PINNED("array", __u32, struct lb_config, cfg_map, 1, KXLB_PIN_DIR "/config");
#endif /* KXLB_DATAPATH */

#endif
