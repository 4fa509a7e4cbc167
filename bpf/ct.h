/* SPDX-License-Identifier: GPL-2.0 */
/* Conntrack: pins a flow to the backend chosen for its first packet.
 *
 * A flow owns two ct_map entries with the same value (maps.h): FWD keyed as the client
 * sends, REV keyed by the translated 4-tuple in canonical order. The flow lives and
 * dies as one:
 *  - state: a packet that changes it (first reply, FIN, RST) ORs its flags into both
 *    entries atomically, so two CPUs seeing a FIN and an RST at once lose neither;
 *  - lifetime: an entry is live until last_ns + ct_lifetime(flags). A packet refreshes
 *    its own entry at most every KXLB_CT_REFRESH_S, and the peer entry with it: a flow
 *    that only sends one way keeps its reply entry, and the peer lookup tells the LRU
 *    that entry is in use;
 *  - eviction: if the LRU evicted the peer anyway, that refresh puts it back (the
 *    value is the whole flow), so a busy flow is repaired within a second.
 * The clock is CLOCK_MONOTONIC_COARSE (bpf_ktime_get_coarse_ns): lifetimes are seconds,
 * and the coarse clock costs a fraction of the precise one per packet. */
#ifndef KXLB_CT_H
#define KXLB_CT_H
#include "maps.h"
#include "endian.h"
#include "hash.h"
#include "parse.h"
#include "lb.h"

#define NSEC_PER_SEC_ 1000000000ull

static __always_inline __u64 ct_now(void)
{
	return bpf_ktime_get_coarse_ns();
}

static __always_inline int ct_closing(__u64 flags)
{
	return (flags & KXLB_CT_F_RST) ||
	       (flags & (KXLB_CT_F_FIN_FWD | KXLB_CT_F_FIN_REV)) ==
		       (KXLB_CT_F_FIN_FWD | KXLB_CT_F_FIN_REV);
}

/* How long a flow in this state lives after its last packet (consts.h). */
static __always_inline __u64 ct_lifetime_ns(__u8 proto, __u64 flags)
{
	__u32 s;

	if (proto == IPPROTO_TCP) {
		if (ct_closing(flags))
			s = KXLB_CT_TCP_CLOSE_S;
		else if (flags & KXLB_CT_F_REPLIED)
			s = KXLB_CT_TCP_EST_S;
		else
			s = KXLB_CT_TCP_SYN_S;
	} else {
		s = (flags & KXLB_CT_F_REPLIED) ? KXLB_CT_UDP_REPLIED_S : KXLB_CT_UDP_S;
	}
	return (__u64)s * NSEC_PER_SEC_;
}

static __always_inline int ct_live(const struct ct_entry *e, __u8 proto, __u64 now)
{
	return now < e->last_ns + ct_lifetime_ns(proto, e->flags);
}

/* Flags a packet adds to its flow's state. */
static __always_inline __u64 ct_flags_of(const struct pkt *p, __u8 dir)
{
	__u64 f = dir == KXLB_CT_DIR_REV ? KXLB_CT_F_REPLIED : 0;

	if (p->proto == IPPROTO_TCP) {
		if (p->tcp_flags & TCP_RST_)
			f |= KXLB_CT_F_RST;
		if (p->tcp_flags & TCP_FIN_)
			f |= dir == KXLB_CT_DIR_REV ? KXLB_CT_F_FIN_REV : KXLB_CT_F_FIN_FWD;
	}
	return f;
}

/* An entry carries this packet if it is live, and (TCP) the packet is not a fresh SYN
 * reusing the ports of a closing flow: that one is a new connection. */
static __always_inline int ct_usable(const struct ct_entry *e, const struct pkt *p, __u64 now)
{
	if (!ct_live(e, p->proto, now))
		return 0;
	if (p->proto == IPPROTO_TCP && (p->tcp_flags & (TCP_SYN_ | TCP_ACK_)) == TCP_SYN_ &&
	    ct_closing(e->flags))
		return 0;
	return 1;
}

/* The REV key of the 4-tuple a <-> b: the lower (address, port) endpoint first, so a
 * packet of either direction finds it. Raw (network order) values compare fine: any
 * fixed total order will do, and loader/conntrack.py uses the same one. */
static __always_inline void ct_rev_key(__be32 a, __be16 pa, __be32 b, __be16 pb, __u8 proto,
				       struct ct_key *k)
{
	int a_first = a < b || (a == b && pa <= pb);

	k->saddr = a_first ? a : b;
	k->sport = a_first ? pa : pb;
	k->daddr = a_first ? b : a;
	k->dport = a_first ? pb : pa;
	k->proto = proto;
	k->dir = KXLB_CT_DIR_REV;
	k->pad = 0;
}

static __always_inline void ct_fwd_key_of(const struct ct_entry *e, __u8 proto, struct ct_key *k)
{
	k->saddr = e->client_addr;
	k->sport = e->client_port;
	k->daddr = e->front_addr;
	k->dport = e->front_port;
	k->proto = proto;
	k->dir = KXLB_CT_DIR_FWD;
	k->pad = 0;
}

static __always_inline void ct_rev_key_of(const struct ct_entry *e, __u8 proto, struct ct_key *k)
{
	ct_rev_key(e->backend_addr, e->backend_port, e->src_addr, e->src_port, proto, k);
}

/* Both entries describe one flow: same client, frontend and backend. */
static __always_inline int ct_same_flow(const struct ct_entry *a, const struct ct_entry *b)
{
	return a->client_addr == b->client_addr && a->client_port == b->client_port &&
	       a->front_addr == b->front_addr && a->front_port == b->front_port &&
	       a->backend_addr == b->backend_addr && a->backend_port == b->backend_port;
}

/* Refresh the flow's other entry with this one (adding `flags`), or put it back if the
 * LRU evicted it. A key that another live flow took meanwhile is left to that flow. */
static __always_inline void ct_refresh_peer(const struct ct_key *k, struct ct_entry *e,
					    __u64 flags, __u64 now)
{
	struct ct_key pk;
	struct ct_entry *pe;

	if (k->dir == KXLB_CT_DIR_FWD)
		ct_rev_key_of(e, k->proto, &pk);
	else
		ct_fwd_key_of(e, k->proto, &pk);
	pe = ct_map.lookup(&pk);
	if (pe) {
		if (!ct_same_flow(pe, e))
			return;
		if (flags)
			__sync_fetch_and_or(&pe->flags, flags);
		if (pe->last_ns < now)
			pe->last_ns = now;
		return;
	}
	struct ct_entry copy = *e;
	copy.last_ns = now;
	if (ct_map.insert(&pk, &copy) == 0)
		stat_inc(KXLB_ST_CT_PEER);
}

/* Account a packet to its flow: new state flags into both entries at once; otherwise
 * a refresh of both, at most every KXLB_CT_REFRESH_S (the cache line stays shared
 * between CPUs in between). */
static __always_inline void ct_touch(const struct ct_key *k, struct ct_entry *e,
				     const struct pkt *p, __u64 now)
{
	__u64 add = ct_flags_of(p, k->dir) & ~e->flags;

	if (add) {
		__sync_fetch_and_or(&e->flags, add);
		e->last_ns = now;
		ct_refresh_peer(k, e, add, now);
		return;
	}
	if (now > e->last_ns + KXLB_CT_REFRESH_S * NSEC_PER_SEC_) {
		e->last_ns = now;
		ct_refresh_peer(k, e, 0, now);
	}
}

/* A REV entry whose 4-tuple the client now uses to reach the backend directly: its
 * flow is over (the client's socket moved on), so the entry must not rewrite the
 * backend's answers. Its FWD peer goes with it. */
static __always_inline void ct_forget(const struct ct_key *k, const struct ct_entry *e)
{
	struct ct_key fk;
	struct ct_entry *fe;

	ct_fwd_key_of(e, k->proto, &fk);
	fe = ct_map.lookup(&fk);
	if (fe && ct_same_flow(fe, e))
		ct_map.delete(&fk);
	ct_map.delete((struct ct_key *)k);
	stat_inc(KXLB_ST_CT_STALE);
}

/* Track a new flow: REV first (it decides the source the backend sees), then FWD.
 * The REV key must be free: another live flow may hold the same backend <-> source
 * 4-tuple (one client port reaching two frontends that share a backend, or a
 * masquerade port in use). Then the source port is remapped to one of the range in
 * lb_config, tried in an order that follows the flow hash, so two CPUs creating the
 * same flow at once meet on the same port (an entry of the same flow is taken over).
 * A masqueraded flow never keeps the client's port: the node's own sockets could hold
 * it. Returns 0, -1 when the table refused an entry, -2 when no port was free. */
static __always_inline int ct_create(const struct ct_key *fk, const struct pkt *p,
				     const struct backend *be, __u32 svc_id, __be32 masq_addr,
				     __u32 hash, const struct lb_config *cfg, __u64 now,
				     struct ct_entry *out)
{
	struct ct_entry e = {
		.last_ns = now,
		.flags = ct_flags_of(p, KXLB_CT_DIR_FWD) | (masq_addr ? KXLB_CT_F_SNAT : 0),
		.client_addr = p->saddr,
		.front_addr = p->daddr,
		.backend_addr = be->addr,
		.src_addr = masq_addr ? masq_addr : p->saddr,
		.client_port = p->sport,
		.front_port = p->dport,
		.backend_port = be->port,
		.src_port = p->sport,
		.svc_id = svc_id,
		.created_s = now / NSEC_PER_SEC_,
	};
	__u32 lo = KXLB_SRC_PORT_MIN, span = KXLB_SRC_PORT_MAX - KXLB_SRC_PORT_MIN + 1;
	struct ct_key rk;
	struct ct_entry *old;
	int i;

	/* Remixed: the flow hash also picked the backend slot (hash % count), and ports
	 * taken straight from it would crowd into a fraction of the range per backend. */
	hash = kx_rol32(hash, 13) ^ (hash * 0x9e3779b1u);
	if (cfg && cfg->src_port_min && cfg->src_port_max >= cfg->src_port_min) {
		lo = cfg->src_port_min;
		span = cfg->src_port_max - cfg->src_port_min + 1;
	}
	for (i = masq_addr ? 1 : 0; i <= KXLB_SRC_PORT_TRIES; i++) {
		if (i > 0) {
			e.src_port = bpf_htons(lo + (hash + (__u32)(i - 1) * 7919) % span);
			if (!masq_addr)
				e.flags |= KXLB_CT_F_REMAP;
		}
		ct_rev_key_of(&e, p->proto, &rk);
		if (ct_map.insert(&rk, &e) == 0)
			break;
		old = ct_map.lookup(&rk);
		if (!old || ct_same_flow(old, &e) || !ct_live(old, p->proto, now)) {
			if (ct_map.update(&rk, &e) != 0)
				return -1;
			break;
		}
	}
	if (i > KXLB_SRC_PORT_TRIES)
		return -2;
	if (e.flags & KXLB_CT_F_REMAP)
		stat_inc(KXLB_ST_CT_REMAP);
	if (ct_map.update((struct ct_key *)fk, &e) != 0) {
		ct_map.delete(&rk);
		return -1;
	}
	*out = e;
	return 0;
}

#endif
