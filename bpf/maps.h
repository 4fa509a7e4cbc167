/* SPDX-License-Identifier: GPL-2.0 */
/* Every map of the datapath: layouts, and (for the datapath build) declarations.
 *
 * loader/layout.py mirrors each struct with ctypes; tests/test_layout.py checks sizes and
 * field offsets against the BTF that clang emits for this header. Change both together.
 *
 * Consistency of a service (why the generations): a service is one entry in svc_map
 * naming its svc_id, the number of backend slots, and the active generation (0/1);
 * backend slots live in backend_map under (svc_id, slot, gen). To change a service's
 * backends, user space
 *   1. writes the new slots under the inactive generation (invisible to packets),
 *   2. replaces the svc_map entry in one update (count + gen flip atomically: a hash
 *      map update swaps the whole element),
 *   3. deletes the old generation's slots.
 * A packet therefore sees the old set or the new set, never a mix. The one window: a
 * packet read the old svc entry, then step 3 deleted the slot it wants; the datapath
 * re-reads the svc entry once and picks from the new generation (KXLB_ST_SLOT_RETRY).
 * Adding a service writes slots first, then the svc entry; deleting removes the svc
 * entry first, then the slots. */
#ifndef KXLB_MAPS_H
#define KXLB_MAPS_H
#include "consts.h"

/* svc_map key: what a client addresses. */
struct svc_key {
	__be32 vip;
	__be16 port;
	__u8   proto;     /* IPPROTO_TCP / IPPROTO_UDP */
	__u8   pad;
};

/* svc_map value. */
struct svc_value {
	__u32 svc_id;     /* 1..KXLB_MAX_SERVICES-1; keys backend_map and svc_stats */
	__u16 count;      /* backend slots in the active generation; 0 = no backend */
	__u8  gen;        /* active generation of backend slots: 0 or 1 */
	__u8  flags;      /* reserved for service options (affinity, policies) */
};

/* backend_map key: one slot of a service's backend array. */
struct backend_key {
	__u32 svc_id;
	__u16 slot;       /* 0..count-1 */
	__u8  gen;
	__u8  pad;
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

/* cfg_map (one entry, written by the controller): when to masquerade, as kube-proxy
 * does. A new flow is masqueraded to snat_addr when the client is the chosen backend
 * itself (hairpin), or when it comes from outside cluster_cidr (so the reply comes
 * back through this node). snat_addr 0: never. cluster_mask 0: no cluster CIDR known,
 * only hairpin. */
struct lb_config {
	__be32 snat_addr;
	__be32 cluster_cidr;
	__be32 cluster_mask;
	__u32  flags;      /* reserved */
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
		 KXLB_MAX_SERVICES, KXLB_PIN_DIR "/services", BPF_F_NO_PREALLOC);
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
BPF_TABLE_PINNED("lru_hash", struct sock_rev_key, struct sock_rev_value, sock_rev,
		 KXLB_CT_ENTRIES, KXLB_PIN_DIR "/sock_rev");
BPF_TABLE_PINNED("array", __u32, struct lb_config, cfg_map, 1, KXLB_PIN_DIR "/config");
#endif /* KXLB_DATAPATH */

#endif
