/* SPDX-License-Identifier: GPL-2.0 */
/* Constants shared by the datapath and, through loader/layout.py (which parses the
 * `#define KXLB_*` lines of this file), by the Python side. One source of truth. */
#ifndef KXLB_CONSTS_H
#define KXLB_CONSTS_H

/* Map capacities (overridable at compile time with -D, e.g. for tests of a full map;
 * user space reads the real capacity from the map itself). */
#ifndef KXLB_MAX_SERVICES
#define KXLB_MAX_SERVICES        131072  /* service ports: the svc_id range (svc_stats) */
#endif
#define KXLB_STATS_CHUNK         4096    /* service ports per per-CPU counter array (maps.h svc_stats) */
#ifndef KXLB_MAX_FRONTENDS
#define KXLB_MAX_FRONTENDS       262144  /* svc_map: every way into a service port, and markers */
#endif
#ifndef KXLB_MAX_BACKEND_SLOTS
#define KXLB_MAX_BACKEND_SLOTS   1048576 /* backend slots over all services, both generations */
#endif
#define KXLB_MAX_BACKENDS_PER_SVC 65520  /* slots per set of a service port and generation: the largest
					  * set a Maglev table of KXLB_MAGLEV_MAX_TABLE entries holds
					  * (slot indices and counts are u16). kube-proxy has no limit;
					  * a DaemonSet Service on 5,000 nodes must fit */
#ifndef KXLB_CT_ENTRIES
#define KXLB_CT_ENTRIES          131072  /* conntrack: client sockets (a record holds its flows); the controller sizes it (mapspec.conntrack_cflags) */
#endif
#define KXLB_CT_WAYS             4       /* flows one client socket can have at once (maps.h ct_entry) */
#define KXLB_MASQ_WAYS           4       /* flows one masquerade port can carry, to distinct backends */
#ifndef KXLB_AFFINITY_ENTRIES
#define KXLB_AFFINITY_ENTRIES    65536   /* ClientIP session affinity: (service port, client) pairs */
#endif
#ifndef KXLB_SRC_RANGE_ENTRIES
#define KXLB_SRC_RANGE_ENTRIES   16384   /* loadBalancerSourceRanges over all service ports */
#endif
#ifndef KXLB_CT6_ENTRIES
#define KXLB_CT6_ENTRIES         32768   /* IPv6 conntrack: client sockets, a quarter of IPv4s (preallocated: ~300 bytes each) */
#endif
#ifndef KXLB_AFFINITY6_ENTRIES
#define KXLB_AFFINITY6_ENTRIES   16384   /* IPv6 ClientIP session affinity */
#endif
#ifndef KXLB_FRAG6_ENTRIES
#define KXLB_FRAG6_ENTRIES       2048    /* in-flight fragmented IPv6 datagrams */
#endif
#define KXLB_MAX_SVC_CIDRS       4       /* service CIDRs (ServiceCIDR objects) the datapath knows */
#ifndef KXLB_FRAG_ENTRIES
#define KXLB_FRAG_ENTRIES        8192    /* in-flight fragmented datagrams */
#endif

/* Conntrack lifetimes in seconds (documented in docs/datapath.md). */
#define KXLB_CT_TCP_SYN_S        60      /* TCP flow until its handshake completed (Linux SYN_RECV: 60 s) */
#define KXLB_CT_TCP_EST_S        21600   /* established TCP flow, idle (Cilium's default) */
#define KXLB_CT_TCP_CLOSE_S      10      /* after RST, or FIN seen in both directions */
#define KXLB_CT_TCP_TIME_WAIT_S  60      /* a masquerade port stays taken this long after its TCP flow
					  * ended: the backend holds the 4-tuple in TIME_WAIT (2 MSL) */
#define KXLB_CT_UDP_S            30      /* UDP flow until the backend answered (Linux: 30 s) */
#define KXLB_CT_UDP_REPLIED_S    120     /* UDP flow that saw a reply (Linux "stream": 120 s) */

/* Time in the datapath is counted in ticks of 2^30 ns (1.07 s) of CLOCK_MONOTONIC_COARSE:
 * lifetimes are seconds, a tick is a shift away from the clock's nanoseconds (no 64-bit
 * division on the packet path), and a u32 of ticks lasts 146 years. A lifetime of S
 * seconds is KXLB_TICKS(S) ticks, rounded up. */
#define KXLB_TICK_SHIFT          30
#define KXLB_TICKS(s)            ((__u32)((((__u64)(s) * 1000000000ull) + (1ull << KXLB_TICK_SHIFT) - 1) >> KXLB_TICK_SHIFT))

/* Masquerade under a flood of new flows (a spoofed SYN flood at a masqueraded frontend):
 * a port search that finds no free port may reclaim a port held by a flow that never got
 * past its first exchange (not confirmed both ways) once it is KXLB_FLOOD_HALF_OPEN_TICKS
 * old, as Linux's conntrack drops unconfirmed entries first when full; more than
 * KXLB_FLOOD_NEW_PER_TICK new masqueraded flows in one tick on one CPU make a flood period
 * of a SYN's lifetime, in which a search gives up looking for a free port sooner
 * (KXLB_FLOOD_FREE_TRIES). A free port is always preferred: the backend may still hold a
 * half-open flow's 4-tuple (SYN_RECV, about a minute of SYN-ACK retransmissions), and a
 * new connection's SYN on it looks like a stale duplicate there. Katran's is_under_flood()
 * is the same idea for its LRU. */
#define KXLB_FLOOD_NEW_PER_TICK  1024
#define KXLB_FLOOD_HALF_OPEN_TICKS 2

/* Frontend kinds (struct svc_value.kind): how clients reach a service port. */
#define KXLB_KIND_CLUSTER_IP     0       /* spec.clusterIPs */
#define KXLB_KIND_NODE_PORT      1       /* ports[].nodePort on a node address (--nodeport-addresses) */
#define KXLB_KIND_EXTERNAL_IP    2       /* spec.externalIPs */
#define KXLB_KIND_LOAD_BALANCER  3       /* status.loadBalancer.ingress[].ip */
#define KXLB_KIND_MARKER         4       /* a live cluster IP (port 0): other ports are rejected */

/* Frontend flags (struct svc_value.flags). */
#define KXLB_SVC_F_LOCAL         0x01    /* traffic policy Local: iTP for a cluster IP, eTP otherwise */
#define KXLB_SVC_F_HAS_ENDPOINTS 0x02    /* some usable endpoint exists on some node: an empty set drops */
#define KXLB_SVC_F_AFFINITY      0x04    /* sessionAffinity ClientIP for svc_value.affinity_s seconds */
#define KXLB_SVC_F_SRC_RANGES    0x08    /* loadBalancerSourceRanges: other sources are dropped */

/* Backend sets of a service port (struct backend_key.set). */
#define KXLB_SET_CLUSTER         0       /* cluster-wide endpoints (topology-filtered) */
#define KXLB_SET_LOCAL           1       /* this node's endpoints */

/* Where a new flow comes from, as traffic policies see it. */
#define KXLB_ORIGIN_EXTERNAL     0       /* outside the cluster CIDR */
#define KXLB_ORIGIN_POD          1       /* inside the cluster CIDR (kube-proxy's detect-local) */
#define KXLB_ORIGIN_NODE         2       /* a process on this node (socket hooks) */

/* Configuration flags (struct lb_config.flags). */
#define KXLB_CFG_F_MASQUERADE_ALL 0x01   /* masquerade every new flow to a cluster IP (--masquerade-all) */
#define KXLB_CFG_F_SVC_CIDR_MAP  0x02    /* more service CIDRs than svc_cidr holds: src_range_map has them all */

/* The service id under which src_range_map holds the service CIDRs (no service has it:
 * ids start at 1). */
#define KXLB_SVC_CIDR_ID         0

/* Which way a packet of a tracked flow goes. */
#define KXLB_CT_DIR_FWD          0       /* client -> frontend, as sent by the client */
#define KXLB_CT_DIR_REV          1       /* backend -> client: a reply */

/* Flow state (the low 16 bits of struct ct_flow.claim; maps.h). */
#define KXLB_CT_F_USED           0x0001  /* the way holds a flow (claim != 0) */
#define KXLB_CT_F_REPLIED        0x0002  /* the backend has answered */
#define KXLB_CT_F_FIN_FWD        0x0004  /* client sent FIN */
#define KXLB_CT_F_FIN_REV        0x0008  /* backend sent FIN */
#define KXLB_CT_F_RST            0x0010  /* either side sent RST */
#define KXLB_CT_F_SNAT           0x0020  /* masqueraded: the backend sees the masquerade address */
#define KXLB_CT_F_REMAP          0x0040  /* the client's port was taken on the backend's side: remapped */
#define KXLB_CT_F_FWD_ACK        0x0080  /* a forward packet without SYN (TCP), or after a reply (UDP) */
#define KXLB_CT_F_REV_ACK        0x0100  /* a reply without SYN (TCP) */
#define KXLB_CT_F_DIRECT         0x0200  /* not a service flow: the client talks to a flow's backend
					  * directly on its own port, remapped so the replies differ */
#define KXLB_CT_F_STATE          0x03ff  /* every flag above */

/* Masquerade port way state (the low 8 bits of struct masq_way.claim). */
#define KXLB_MASQ_F_USED         0x01
#define KXLB_MASQ_F_CONFIRMED    0x02    /* its flow is confirmed both ways: never reclaimed early */

/* Datapath counters (index into dp_stats). */
#define KXLB_ST_PASS             0       /* not ours: passed untouched */
#define KXLB_ST_NOT_IP           1       /* neither IPv4 nor IPv6 over Ethernet: passed untouched */
#define KXLB_ST_MALFORMED        2       /* truncated / malformed IPv4 or IPv6: passed untouched */
#define KXLB_ST_NEW_FLOW         3       /* new flow to a service: backend chosen, not masqueraded */
#define KXLB_ST_CT_FWD           4       /* client packet of a tracked flow */
#define KXLB_ST_CT_REV           5       /* backend packet of a tracked flow: reverse NAT */
#define KXLB_ST_ICMP_NAT         6       /* ICMP error about a tracked flow translated */
#define KXLB_ST_FRAG_NAT         7       /* non-first fragment of a translated datagram */
#define KXLB_ST_FRAG_UNKNOWN     8       /* non-first fragment seen before its first: passed */
#define KXLB_ST_NO_BACKEND       9       /* service without any endpoint: rejected (ICMP) */
#define KXLB_ST_SLOT_RETRY       10      /* backend slot vanished under a swap: retried */
#define KXLB_ST_CT_FULL          11      /* conntrack insert failed: dropped */
#define KXLB_ST_SNAT             12      /* new flow, masqueraded (hairpin or from outside) */
#define KXLB_ST_SNAT_NO_PORT     13      /* no free masquerade port: dropped */
#define KXLB_ST_NO_LOCAL         14      /* Local policy without a local endpoint: dropped */
#define KXLB_ST_SRC_RANGE        15      /* source outside loadBalancerSourceRanges: dropped */
#define KXLB_ST_BAD_PORT         16      /* cluster IP on a port no Service defines: rejected */
#define KXLB_ST_UNALLOCATED      17      /* unallocated address of a service CIDR: dropped */
#define KXLB_ST_AFFINITY         18      /* new flow sent to its client's affinity backend */
/* 19, 20: kxlb 0.2's stale-entry and peer-entry counters, gone with its two-entry flows */
#define KXLB_ST_CT_REMAP         21      /* new flow's replies would be ambiguous: its source port remapped */
#define KXLB_ST_NO_PROG          22      /* IPv6 frame, but no IPv6 program loaded: passed untouched */
#define KXLB_ST_SNAT_RECLAIM     23      /* no free masquerade port found: a half-open flow's taken back */
#define KXLB_ST_CT_DIRECT        24      /* direct traffic on a flow's reply tuple: its source port remapped */
#define KXLB_ST_FLOOD            25      /* new masqueraded flows over KXLB_FLOOD_NEW_PER_TICK (a tick, a CPU) */
#define KXLB_ST_PMTU             26      /* masqueraded packet too big for its backend's path: rejected with the MTU (ICMP) */
#define KXLB_ST_CT_RACE          27      /* new flow made by another CPU first (the same first packet): taken as it is */
#define KXLB_ST_MAX              28

#define KXLB_SCTP_LENGTHS        65536   /* sctp_crc_shift: an entry per SCTP packet length */

/* Slots of the tail-call program arrays (kxlb.c tc_progs, xdp_progs). */
#define KXLB_PROG_IPV6           0       /* the IPv6 journey (tc ingress, XDP) */
#define KXLB_PROG_MAX            1

/* Source ports for masqueraded flows, and for flows whose replies would be ambiguous (two
 * frontends sharing a backend, one client socket): outside the node's ip_local_port_range
 * (default 32768-60999), so they never collide with the node's own sockets, and outside
 * the NodePort range and every frontend port on a node address, so a reply is never taken
 * for a new flow to a frontend (the controller checks its range; these are the defaults).
 * A port is claimed in the masquerade port table (maps.h masq_ports), up to
 * KXLB_SRC_PORT_TRIES random ports of the range, each with KXLB_MASQ_WAYS flows to
 * distinct backends. */
#define KXLB_SRC_PORT_MIN        61000
#define KXLB_SRC_PORT_MAX        65535
#define KXLB_SRC_PORT_TRIES      48
/* Tries after those, when every one met a taken port (the range is full for the backend):
 * these may take back a port held by a half-open flow KXLB_FLOOD_HALF_OPEN_TICKS old, flood
 * or not (ct.tmpl.h masq_take). Under a flood, tries may take one back after
 * KXLB_FLOOD_FREE_TRIES tries found no free port. */
#define KXLB_SRC_PORT_LAST_TRIES 8
#define KXLB_FLOOD_FREE_TRIES    16

/* The address filters (filter.h, maps.h front_filter and backend_filter): bitmaps of
 * 2^LOG bits, one bit per address (frontends) or address and port (backends), picked by
 * Fibonacci hashing of the folded address. 128 KiB and 512 KiB: with 100,000 addresses
 * in each, under 10% and 3% of other packets take the slow path (a false positive). */
#define KXLB_FRONT_FILTER_LOG    20
#define KXLB_BACKEND_FILTER_LOG  22
#define KXLB_FRONT_FILTER_WORDS  16384   /* 2^(LOG - 6) u64 words */
#define KXLB_BACKEND_FILTER_WORDS 65536
#define KXLB_FILTER_MUL          0x9e3779b1u
#define KXLB_FILTER_PORT_MUL     0x85ebca6bu

/* Hash seed for backend selection. Any fixed value: every node must agree, so a flow
 * that moves between nodes (ECMP change) still picks the same backend. */
#define KXLB_HASH_SEED           0x6b786c62u /* "kxlb" */

/* Maglev backend choice (lb.h lb_slot(), loader/maglev.py). A backend set's lookup table
 * of M entries (M prime, per set: svc_value.table_size) is stored in chunks of
 * KXLB_MAGLEV_CHUNK slot numbers, so M is a runtime choice and small sets pay for small
 * tables. 480 u16 = 960 bytes: with the kernel's per-element header a chunk is exactly a
 * 1 KiB allocation (256 entries would take the same 1 KiB for half the entries). */
#define KXLB_MAGLEV_CHUNK        480
#ifndef KXLB_MAX_MAGLEV_CHUNKS
#define KXLB_MAX_MAGLEV_CHUNKS   262144  /* table chunks over all services, both generations */
#endif
#define KXLB_MAGLEV_MAX_TABLE    65521   /* largest prime a u16 table size holds */

#endif
