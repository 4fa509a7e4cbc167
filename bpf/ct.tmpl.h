/* SPDX-License-Identifier: GPL-2.0 */
/* Conntrack entries of one address family (ct.h says how a flow lives and dies). A
 * template (family.tmpl.h): written once, instantiated for IPv4 and IPv6. */
#ifndef KX_(KXLB_CT_TMPL_H)
#define KX_(KXLB_CT_TMPL_H)
#include "family.tmpl.h"
#include "maps.h"
#include "hash.h"
#include "KX_(parse).h"
#include "lb.h"
#include "ct.h"

static __always_inline int KX_(ct_live)(const struct KX_(ct_entry) *e, __u8 proto, __u64 now)
{
	return now < e->last_ns + ct_lifetime_ns(proto, e->flags);
}

/* The packet comes from the flow's backend (its REV entry's backend side): a reply. */
static __always_inline int KX_(ct_from_backend)(const struct KX_(ct_entry) *e, const struct KX_(pkt) *p)
{
	return KX_EQ(e->backend_addr, p->saddr) && e->backend_port == p->sport;
}

/* Flags a packet adds to its flow's state. */
static __always_inline __u64 KX_(ct_flags_of)(const struct KX_(pkt) *p, __u8 dir)
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
static __always_inline int KX_(ct_usable)(const struct KX_(ct_entry) *e, const struct KX_(pkt) *p, __u64 now)
{
	if (!KX_(ct_live)(e, p->proto, now))
		return 0;
	if (p->proto == IPPROTO_TCP && (p->tcp_flags & (TCP_SYN_ | TCP_ACK_)) == TCP_SYN_ &&
	    ct_closing(e->flags))
		return 0;
	return 1;
}

/* The REV key of the 4-tuple a <-> b: the lower (address, port) endpoint first, so a
 * packet of either direction finds it. Raw (network order) values compare fine: any
 * fixed total order will do, and loader/conntrack.py uses the same one. */
static __always_inline void KX_(ct_rev_key)(kx_addr_t a, __be16 pa, kx_addr_t b, __be16 pb, __u8 proto,
					    struct KX_(ct_key) *k)
{
	int a_first = KX_LT(a, b) || (KX_EQ(a, b) && pa <= pb);

	k->saddr = a_first ? a : b;
	k->sport = a_first ? pa : pb;
	k->daddr = a_first ? b : a;
	k->dport = a_first ? pb : pa;
	k->proto = proto;
	k->dir = KXLB_CT_DIR_REV;
	k->pad = 0;
}

static __always_inline void KX_(ct_fwd_key_of)(const struct KX_(ct_entry) *e, __u8 proto, struct KX_(ct_key) *k)
{
	k->saddr = e->client_addr;
	k->sport = e->client_port;
	k->daddr = e->front_addr;
	k->dport = e->front_port;
	k->proto = proto;
	k->dir = KXLB_CT_DIR_FWD;
	k->pad = 0;
}

static __always_inline void KX_(ct_rev_key_of)(const struct KX_(ct_entry) *e, __u8 proto, struct KX_(ct_key) *k)
{
	KX_(ct_rev_key)(e->backend_addr, e->backend_port, e->src_addr, e->src_port, proto, k);
}

/* Both entries describe one flow: same client, frontend and backend. */
static __always_inline int KX_(ct_same_flow)(const struct KX_(ct_entry) *a, const struct KX_(ct_entry) *b)
{
	return KX_EQ(a->client_addr, b->client_addr) && a->client_port == b->client_port &&
	       KX_EQ(a->front_addr, b->front_addr) && a->front_port == b->front_port &&
	       KX_EQ(a->backend_addr, b->backend_addr) && a->backend_port == b->backend_port;
}

/* Refresh the flow's other entry with this one (adding `flags`), or put it back if the
 * LRU evicted it. A key that another live flow took meanwhile is left to that flow. */
static __always_inline void KX_(ct_refresh_peer)(const struct KX_(ct_key) *k, struct KX_(ct_entry) *e,
					    __u64 flags, __u64 now)
{
	struct KX_(ct_key) pk;
	struct KX_(ct_entry) *pe;

	if (k->dir == KXLB_CT_DIR_FWD)
		KX_(ct_rev_key_of)(e, k->proto, &pk);
	else
		KX_(ct_fwd_key_of)(e, k->proto, &pk);
	pe = KX_(ct_map).lookup(&pk);
	if (pe) {
		if (!KX_(ct_same_flow)(pe, e))
			return;
		if (flags)
			__sync_fetch_and_or(&pe->flags, flags);
		if (pe->last_ns < now)
			pe->last_ns = now;
		return;
	}
	/* The callers stamped e->last_ns = now already: e is the peer's value as it is. */
	if (KX_(ct_map).insert(&pk, e) == 0)
		stat_inc(KXLB_ST_CT_PEER);
}

/* Account a packet to its flow: new state flags into both entries at once; otherwise
 * a refresh of both, at most every KXLB_CT_REFRESH_S (the cache line stays shared
 * between CPUs in between). */
static __always_inline void KX_(ct_touch)(const struct KX_(ct_key) *k, struct KX_(ct_entry) *e,
				     const struct KX_(pkt) *p, __u64 now)
{
	__u64 add = KX_(ct_flags_of)(p, k->dir) & ~e->flags;

	if (add) {
		__sync_fetch_and_or(&e->flags, add);
		e->last_ns = now;
		KX_(ct_refresh_peer)(k, e, add, now);
		return;
	}
	if (now > e->last_ns + KXLB_CT_REFRESH_S * NSEC_PER_SEC_) {
		e->last_ns = now;
		KX_(ct_refresh_peer)(k, e, 0, now);
	}
}

/* A REV entry whose 4-tuple the client now uses to reach the backend directly: its
 * flow is over (the client's socket moved on), so the entry must not rewrite the
 * backend's answers. Its FWD peer goes with it. */
static __always_inline void KX_(ct_forget)(const struct KX_(ct_key) *k, const struct KX_(ct_entry) *e)
{
	struct KX_(ct_key) fk;
	struct KX_(ct_entry) *fe;

	KX_(ct_fwd_key_of)(e, k->proto, &fk);
	fe = KX_(ct_map).lookup(&fk);
	if (fe && KX_(ct_same_flow)(fe, e))
		KX_(ct_map).delete(&fk);
	KX_(ct_map).delete((struct KX_(ct_key) *)k);
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
static __always_inline int KX_(ct_create)(const struct KX_(ct_key) *fk, const struct KX_(pkt) *p,
				     const struct KX_(backend) *be, __u32 svc_id, kx_addr_t masq_addr,
				     __u32 hash, const struct KX_(lb_config) *cfg, __u64 now,
				     struct KX_(ct_entry) *out)
{
	/* Built in the caller's buffer, which the plan is then made from: one entry on the
	 * stack, not two. */
	out->last_ns = now;
	out->flags = KX_(ct_flags_of)(p, KXLB_CT_DIR_FWD) | (KX_ZERO(masq_addr) ? 0 : KXLB_CT_F_SNAT);
	out->client_addr = p->saddr;
	out->front_addr = p->daddr;
	out->backend_addr = be->addr;
	out->src_addr = KX_ZERO(masq_addr) ? p->saddr : masq_addr;
	out->client_port = p->sport;
	out->front_port = p->dport;
	out->backend_port = be->port;
	out->src_port = p->sport;
	out->svc_id = svc_id;
	out->created_s = now / NSEC_PER_SEC_;
	__u32 lo = KXLB_SRC_PORT_MIN, span = KXLB_SRC_PORT_MAX - KXLB_SRC_PORT_MIN + 1;
	struct KX_(ct_key) rk;
	struct KX_(ct_entry) *old;
	int i;

	/* Remixed: the flow hash also picked the backend slot (hash % count), and ports
	 * taken straight from it would crowd into a fraction of the range per backend. */
	hash = kx_rol32(hash, 13) ^ (hash * 0x9e3779b1u);
	if (cfg && cfg->src_port_min && cfg->src_port_max >= cfg->src_port_min) {
		lo = cfg->src_port_min;
		span = cfg->src_port_max - cfg->src_port_min + 1;
	}
	for (i = KX_ZERO(masq_addr) ? 0 : 1; i <= KXLB_SRC_PORT_TRIES; i++) {
		if (i > 0) {
			out->src_port = bpf_htons(lo + (hash + (__u32)(i - 1) * 7919) % span);
			if (KX_ZERO(masq_addr))
				out->flags |= KXLB_CT_F_REMAP;
		}
		KX_(ct_rev_key_of)(out, p->proto, &rk);
		if (KX_(ct_map).insert(&rk, out) == 0)
			break;
		old = KX_(ct_map).lookup(&rk);
		if (!old || KX_(ct_same_flow)(old, out) || !KX_(ct_live)(old, p->proto, now)) {
			if (KX_(ct_map).update(&rk, out) != 0)
				return -1;
			break;
		}
	}
	if (i > KXLB_SRC_PORT_TRIES)
		return -2;
	if (out->flags & KXLB_CT_F_REMAP)
		stat_inc(KXLB_ST_CT_REMAP);
	if (KX_(ct_map).update((struct KX_(ct_key) *)fk, out) != 0) {
		KX_(ct_map).delete(&rk);
		return -1;
	}
	return 0;
}

#endif
