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
 * src_range_map, cfg_map) are the IPv4 family's; IPv6 has its own beside them, named
 * the same with a 6 (svc_map6, struct svc_key6, ...), with the same fields holding
 * 16-byte addresses (struct kx_in6), so one text of the datapath serves both families
 * (the *.tmpl.h files, instantiated per family). What carries no address (svc_value,
 * the Maglev tables, the counters, the per-service stats) is shared: both
 * families draw svc_ids from one range, and a dual-stack Service is two service ports
 * (one per cluster IP family) with two svc_ids.
 *
 * Consistency of a service (why the generations): a backend set lives in backend_map as
 * a run of slots, [slots, slots + count) (struct svc_value), and its Maglev table in
 * maglev_map under (svc_id, set, gen). To change a service port's backends, user space
 *   1. writes both new sets into free runs of backend_map, and their Maglev tables under
 *      the inactive generation (invisible to packets: no frontend names them yet),
 *   2. replaces every frontend's svc_map entry (set sizes, runs, gen flip atomically: a
 *      hash map update swaps the whole element),
 *   3. deletes the old generation's tables, and frees the old runs for reuse only after a
 *      quarantine (loader/slots.py): a packet that read the old entry just before the flip
 *      still reads the old run, which holds the old backends until then.
 * A packet therefore sees the old sets or the new sets, never a mix. The one window: a
 * packet read an old entry, then step 3 deleted the table it wants; the datapath
 * re-reads the entry once and picks from the new generation (KXLB_ST_SLOT_RETRY).
 * Adding a service writes slots first, then the entries; deleting removes the entries
 * first, then frees the slots. */
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
	__u16 table_size;  /* M of the cluster-wide set's Maglev table (prime; 0: no table, */
	__u16 local_table_size; /* at most one slot) and of this node's set, active gen */
	__u32 slots;       /* backend_map index of the cluster-wide set's slot 0 (its run of */
	__u32 local_slots; /* `count` slots), and of this node's set's (0: an empty set) */
};

/* backend_map (an array, index: the slot): where a slot sends new flows. An array, as
 * Katran's reals, not a hash keyed by (service, set, slot): a new flow reads its slot
 * with an index, no key to hash and compare (about 20 ns less per new flow). A set's
 * slots are a run of it, allocated by user space (loader/slots.py); slot 0 of the array
 * is never used. A freed run keeps its contents until it is given to another set, after a
 * quarantine; `tag` names the set a slot was written for, so a packet still holding an
 * entry from before a run changed hands finds another tag and re-reads the entry. A
 * tag's high bit is always set: a slot never written (all zero) is no set's. */
#define KXLB_SLOT_TAG(svc_id, gen) ((__u16)((((svc_id) << 1) | (gen)) | 0x8000))
struct backend {
	__be32 addr;
	__be16 port;
	__u16  tag;       /* KXLB_SLOT_TAG(svc_id, gen) of the set whose run holds the slot */
};

/* maglev_map key: one chunk of a backend set's Maglev lookup table, under the same
 * generation as its slots (written before the flip, deleted after: see above). Entry i
 * of the table is slot[i % KXLB_MAGLEV_CHUNK] of chunk i / KXLB_MAGLEV_CHUNK. */
struct maglev_key {
	__u32 svc_id;
	__u16 chunk;
	__u8  gen;
	__u8  set;        /* KXLB_SET_* */
};

/* maglev_map value: table entries -> slot numbers of the set (its run's offset), loader/maglev.py. */
struct maglev_chunk {
	__u16 slot[KXLB_MAGLEV_CHUNK];
};

/* ct_map (layout 2): conntrack, one record per client socket (address, port, protocol).
 * Why the client socket: a flow's forward packets carry it as their source, and a reply
 * that is not masqueraded or remapped carries it as its destination, so one lookup with
 * one 8-byte key finds the flow from either direction, both directions live and die
 * together by construction, and an LRU eviction removes whole flows. (Layout 1 kept two
 * entries per flow, one per direction, and paid a second insert for every new flow.)
 * A record holds up to KXLB_CT_WAYS flows of its socket: one UDP socket asking several
 * VIPs, or a port the kernel reused towards several destinations at once.
 * Masqueraded and remapped flows' replies come to a port of the masquerade port table
 * (masq_map below), whose way names the client socket. */
struct ct_key {
	__be32 addr;      /* the client: the source of its forward packets */
	__be16 port;
	__u8   proto;
	__u8   pad;
};

/* One flow of a client socket. `claim` identifies it and holds its state in one word,
 * which a new flow claims with compare-and-swap and a packet updates with an atomic OR
 * (ct.tmpl.h ct_claim()): the frontend (its address folded to 32 bits, its port) and the
 * KXLB_CT_F_* flags in the low 16 bits (KXLB_CT_F_USED always: 0 is a free way). Forward
 * packets client:port -> front:port become src:src_port -> backend:port, where src is the
 * client (or the masquerade address, KXLB_CT_F_SNAT); replies the reverse. A flow keeps
 * its backend when the backend leaves the service or the service is deleted, as Linux
 * conntrack does under kube-proxy: nothing here points back to svc_map or backend_map. */
struct ct_flow {
	__u64  claim;
	__be32 front_addr;   /* the frontend the client addressed (cluster IP, node, ...) */
	__be32 backend_addr;
	__be16 backend_port;
	__be16 src_port;     /* the source port the backend sees: the client's own unless
			      * masqueraded or remapped (then a port of masq_map) */
	__u32  last;         /* tick (consts.h KXLB_TICK_SHIFT) of the flow's last packet */
	__u32  svc_id;       /* for per-service counters */
	__u32  pad;
};

struct ct_entry {
	struct ct_flow flow[KXLB_CT_WAYS];
};

/* masq_map (array, index: the port): the masquerade port table. A masqueraded flow
 * (source: the node's address) or a remapped one (its client's own address, another
 * port) owns a way of one port P, which makes (P, backend, protocol) unique without a map
 * insert; a reply to P is looked up here before anything else (no frontend on a node
 * address is ever in the masquerade range), and the way names the client socket whose
 * ct_map record holds the flow. A port carries up to KXLB_MASQ_WAYS flows to distinct
 * backends. `claim`: the backend (address folded, port), the protocol and KXLB_MASQ_F_*
 * in the low 8 bits, claimed with compare-and-swap. A way is free once `expires` passed
 * (its flow's lifetime, plus TIME_WAIT for TCP: the backend keeps the 4-tuple that long),
 * or, to a port search that found no free way, when its flow never got confirmed both
 * ways and is KXLB_FLOOD_HALF_OPEN_TICKS old (`born`). */
struct masq_way {
	__u64  claim;
	__be32 peer_addr;    /* the backend */
	__be32 client_addr;  /* the client socket whose flow this is */
	__be16 client_port;
	__u16  pad;
	__u32  born;         /* tick the flow claimed the port */
	__u32  expires;      /* tick the port is free again (refreshed with the flow) */
	__u32  pad2;
};

struct masq_entry {
	struct masq_way way[KXLB_MASQ_WAYS];
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
 * prefixlen counts svc_id's 32 bits too: a CIDR /n is stored with prefixlen 32 + n.
 * Under svc_id KXLB_SVC_CIDR_ID it also holds every service CIDR of a family that has
 * more than lb_config.svc_cidr holds (KXLB_CFG_F_SVC_CIDR_MAP): kube-proxy takes any
 * number of ServiceCIDR objects, and this map already answers "which CIDR holds this
 * address" for any number, so no map or layout is added for them. */
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
 * in them that is not a live cluster IP is dropped (mask 0: unused slot). A family with
 * more than KXLB_MAX_SVC_CIDRS has its first ones here (compared without a lookup, on
 * every packet that is no service's) and all of them in src_range_map
 * (KXLB_CFG_F_SVC_CIDR_MAP). */
struct lb_config {
	__be32 snat_addr;
	__be32 cluster_cidr;
	__be32 cluster_mask;
	__u32  flags;      /* KXLB_CFG_F_* */
	__be32 svc_cidr[KXLB_MAX_SVC_CIDRS];
	__be32 svc_mask[KXLB_MAX_SVC_CIDRS];
	__u16  src_port_min; /* source ports given to masqueraded and remapped flows: a */
	__u16  src_port_max; /* range no socket of the node uses (0: KXLB_SRC_PORT_MIN/MAX) */
	__be32 node_addr;    /* the node's own address: the client of its processes' flows
			      * (socket hooks) as source ranges see it (0: snat_addr) */
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

/* --- IPv6: the same structs with 16-byte addresses (field names as above) ---------- */

/* An IPv6 address as four network-order words: assignable as a whole, compared word
 * by word (addr6.h). */
struct kx_in6 {
	__be32 w[4];
};

struct svc_key6 {
	struct kx_in6 vip;
	__be16 port;
	__u8   proto;
	__u8   pad;
};

struct backend6 {
	struct kx_in6 addr;
	__be16 port;
	__u16  tag;       /* as struct backend's */
};

struct ct_key6 {
	struct kx_in6 addr;
	__be16 port;
	__u8   proto;
	__u8   pad;
};

struct ct_flow6 {
	__u64  claim;
	struct kx_in6 front_addr;
	struct kx_in6 backend_addr;
	__be16 backend_port;
	__be16 src_port;
	__u32  last;
	__u32  svc_id;
	__u32  pad;
};

struct ct_entry6 {
	struct ct_flow6 flow[KXLB_CT_WAYS];
};

struct masq_way6 {
	__u64  claim;
	struct kx_in6 peer_addr;
	struct kx_in6 client_addr;
	__be16 client_port;
	__u16  pad;
	__u32  born;
	__u32  expires;
	__u32  pad2;
};

struct masq_entry6 {
	struct masq_way6 way[KXLB_MASQ_WAYS];
};

/* The fragment header's identification is 32 bits in IPv6. */
struct frag_key6 {
	struct kx_in6 saddr;
	struct kx_in6 daddr;
	__be32 id;
	__u8   proto;
	__u8   pad[3];
};

struct frag_value6 {
	struct kx_in6 saddr;
	struct kx_in6 daddr;
};

struct affinity_key6 {
	__u32  svc_id;
	struct kx_in6 client;
	__u8   set;
	__u8   pad[3];
};

struct affinity_value6 {
	__u64  last_ns;
	struct kx_in6 addr;
	__be16 port;
	__u16  pad;
	__u32  pad2;
};

struct src_range_key6 {
	__u32  prefixlen;  /* 32 + the CIDR's prefix length */
	__u32  svc_id;
	struct kx_in6 addr;
};

struct sock_rev_key6 {
	__u64  cookie;
	struct kx_in6 addr;  /* backend */
	__be16 port;
	__u16  pad;
	__u32  pad2;
};

struct sock_rev_value6 {
	struct kx_in6 vip;
	__be16 port;
	__u16  pad;
};

/* The IPv6 family's configuration. flags and the source port range are the family-free
 * settings, written the same in both entries by user space: the datapath of a family
 * reads its own entry only. */
struct lb_config6 {
	struct kx_in6 snat_addr;
	struct kx_in6 cluster_cidr;
	struct kx_in6 cluster_mask;
	__u32  flags;
	struct kx_in6 svc_cidr[KXLB_MAX_SVC_CIDRS];
	struct kx_in6 svc_mask[KXLB_MAX_SVC_CIDRS];
	__u16  src_port_min;
	__u16  src_port_max;
	struct kx_in6 node_addr;
};

#ifdef KXLB_DATAPATH
#ifndef KXLB_PIN_DIR
#define KXLB_PIN_DIR "/sys/fs/bpf/kxlb"
#endif
/* Written by user space only. No prealloc: the control plane pays the allocation, and
 * memory follows the number of services rather than the capacity. */
BPF_TABLE_PINNED("hash", struct svc_key, struct svc_value, svc_map,
		 KXLB_MAX_FRONTENDS, KXLB_PIN_DIR "/services_v2", BPF_F_NO_PREALLOC);
/* An array (preallocated): 8 MB for IPv4's 1M slots, the size of the bucket array a hash
 * map of that capacity allocates anyway. */
BPF_TABLE_PINNED("array", __u32, struct backend, backend_map,
		 KXLB_MAX_BACKEND_SLOTS, KXLB_PIN_DIR "/backends_v2");
BPF_TABLE_PINNED("hash", struct maglev_key, struct maglev_chunk, maglev_map,
		 KXLB_MAX_MAGLEV_CHUNKS, KXLB_PIN_DIR "/maglev", BPF_F_NO_PREALLOC);
/* Written by user space only, bits set and never cleared: approximate sets (a Bloom
 * filter of one hash) of every address that is or was a frontend's, and of every backend
 * (address, port) that is or was a slot's, both families. A flow is only ever made to a
 * frontend and a backend a writer put in the maps, so every packet of a flow finds its
 * bit: the forward ones by destination address, the replies by source, traffic to a
 * flow's backend by destination. A packet that finds none is no flow's and no service's
 * (filter.h), and skips every hash lookup: a node's own traffic pays two array reads.
 * A stale bit costs a lookup, never a wrong answer. */
BPF_TABLE_PINNED("array", __u32, __u64, front_filter, KXLB_FRONT_FILTER_WORDS, KXLB_PIN_DIR "/front_filter");
BPF_TABLE_PINNED("array", __u32, __u64, backend_filter, KXLB_BACKEND_FILTER_WORDS, KXLB_PIN_DIR "/backend_filter");
/* Written by the datapath. LRU: a full table evicts the coldest client socket (its
 * flows) rather than refusing a new one. */
BPF_TABLE_PINNED("lru_hash", struct ct_key, struct ct_entry, ct_map,
		 KXLB_CT_ENTRIES, KXLB_PIN_DIR "/conntrack_v2");
/* Preallocated (an array): 65536 ports, whatever the range in use. */
BPF_TABLE_PINNED("array", __u32, struct masq_entry, masq_map, 65536, KXLB_PIN_DIR "/masq_ports");
BPF_TABLE_PINNED("lru_hash", struct frag_key, struct frag_value, frag_map,
		 KXLB_FRAG_ENTRIES, KXLB_PIN_DIR "/frags");
/* Per-service counters, per CPU (plain adds on the packet path), in chunks: svc_stats
 * maps a svc_id to the per-CPU array of its chunk of KXLB_STATS_CHUNK ids (index
 * svc_id % KXLB_STATS_CHUNK), created by user space when the chunk's first id is used
 * (loader/maps.py SvcStats). One array sized to the svc_id range would hold 5 MB per
 * possible CPU from the start (640 MB on a 128-CPU node); chunks hold 160 KB per CPU
 * per 4096 service ports, following the highest count of service ports seen. Two
 * array lookups (~20 ns); a per-CPU hash keyed by svc_id measured ~55 ns more per
 * packet. svc_stats_chunk is only the template the verifier checks inner maps against. */
BPF_TABLE("percpu_array", __u32, struct svc_counters, svc_stats_chunk, KXLB_STATS_CHUNK);
BPF_TABLE_PINNED("array_of_maps$svc_stats_chunk", __u32, __u32, svc_stats,
		 KXLB_MAX_SERVICES, KXLB_PIN_DIR "/svc_stats");
BPF_TABLE_PINNED("percpu_array", __u32, __u64, dp_stats,
		 KXLB_ST_MAX, KXLB_PIN_DIR "/dp_stats");
BPF_TABLE_PINNED("lru_hash", struct affinity_key, struct affinity_value, affinity_map,
		 KXLB_AFFINITY_ENTRIES, KXLB_PIN_DIR "/affinity");
BPF_TABLE_PINNED("lpm_trie", struct src_range_key, __u8, src_range_map,
		 KXLB_SRC_RANGE_ENTRIES, KXLB_PIN_DIR "/src_ranges", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("lru_hash", struct sock_rev_key, struct sock_rev_value, sock_rev,
		 KXLB_CT_ENTRIES, KXLB_PIN_DIR "/sock_rev");
BPF_TABLE_PINNED("lru_hash", struct sock_rev_key6, struct sock_rev_value6, sock_rev6,
		 KXLB_CT6_ENTRIES, KXLB_PIN_DIR "/sock_rev6");
BPF_TABLE_PINNED("array", __u32, struct lb_config, cfg_map, 1, KXLB_PIN_DIR "/config");

/* The IPv6 family's maps, as the IPv4 ones above. Its LRU tables (preallocated) are
 * sized on their own (consts.h): a node that serves no IPv6 pays little for them. */
BPF_TABLE_PINNED("hash", struct svc_key6, struct svc_value, svc_map6,
		 KXLB_MAX_FRONTENDS, KXLB_PIN_DIR "/services6_v2", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("array", __u32, struct backend6, backend_map6,
		 KXLB_MAX_BACKEND_SLOTS, KXLB_PIN_DIR "/backends6_v2");
BPF_TABLE_PINNED("lru_hash", struct ct_key6, struct ct_entry6, ct_map6,
		 KXLB_CT6_ENTRIES, KXLB_PIN_DIR "/conntrack6_v2");
BPF_TABLE_PINNED("array", __u32, struct masq_entry6, masq_map6, 65536, KXLB_PIN_DIR "/masq_ports6");
BPF_TABLE_PINNED("lru_hash", struct frag_key6, struct frag_value6, frag_map6,
		 KXLB_FRAG6_ENTRIES, KXLB_PIN_DIR "/frags6");
BPF_TABLE_PINNED("lru_hash", struct affinity_key6, struct affinity_value6, affinity_map6,
		 KXLB_AFFINITY6_ENTRIES, KXLB_PIN_DIR "/affinity6");
BPF_TABLE_PINNED("lpm_trie", struct src_range_key6, __u8, src_range_map6,
		 KXLB_SRC_RANGE_ENTRIES, KXLB_PIN_DIR "/src_ranges6", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("array", __u32, struct lb_config6, cfg_map6, 1, KXLB_PIN_DIR "/config6");

/* Constant: x^(8n) mod P (CRC32c) for every SCTP packet length n, written by the loader
 * before it loads the programs (loader/sctp.py), read by a port translation's CRC update
 * (sctp.h). Not pinned: each compile gets its own, which its programs keep alive. A table
 * because computing the power (16 multiplications) on every path the verifier walks into
 * a rewrite exceeds its budget for the tc egress program. 256 KB. */
BPF_TABLE("array", __u32, __u32, sctp_crc_shift, KXLB_SCTP_LENGTHS);
#endif /* KXLB_DATAPATH */

#endif
