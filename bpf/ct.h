/* SPDX-License-Identifier: GPL-2.0 */
/* Conntrack: pins a flow to the backend chosen for its first packet.
 *
 * A flow owns two ct_map entries, FWD (client -> VIP) and REV (backend -> client).
 * Each carries the translation for its direction, so neither needs svc_map or
 * backend_map again: service updates never move a tracked flow. Lifetimes follow
 * the flow's state (consts.h); TCP RST, or FIN from both sides, shortens both entries
 * to KXLB_CT_TCP_CLOSE_S. Events that change the state (first reply, FIN, RST) update
 * the peer entry too: they are rare, so the extra lookup costs nothing per packet. */
#ifndef KXLB_CT_H
#define KXLB_CT_H

#define NSEC_PER_SEC_ 1000000000ull

static __always_inline __u64 ct_lifetime_ns(__u8 proto, __u8 flags)
{
	__u32 s;

	if (proto == IPPROTO_TCP) {
		if ((flags & KXLB_CT_F_RST) ||
		    (flags & (KXLB_CT_F_FIN_FWD | KXLB_CT_F_FIN_REV)) ==
			    (KXLB_CT_F_FIN_FWD | KXLB_CT_F_FIN_REV))
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

static __always_inline int ct_closing(__u8 flags)
{
	return (flags & KXLB_CT_F_RST) ||
	       (flags & (KXLB_CT_F_FIN_FWD | KXLB_CT_F_FIN_REV)) ==
		       (KXLB_CT_F_FIN_FWD | KXLB_CT_F_FIN_REV);
}

/* Flags a packet adds to its flow's state. */
static __always_inline __u8 ct_flags_of(const struct pkt *p, __u8 dir)
{
	__u8 f = dir == KXLB_CT_DIR_REV ? KXLB_CT_F_REPLIED : 0;

	if (p->proto == IPPROTO_TCP) {
		if (p->tcp_flags & TCP_RST_)
			f |= KXLB_CT_F_RST;
		if (p->tcp_flags & TCP_FIN_)
			f |= dir == KXLB_CT_DIR_REV ? KXLB_CT_F_FIN_REV : KXLB_CT_F_FIN_FWD;
	}
	return f;
}

/* An entry carries this packet if it has not expired, and (TCP) the packet is not a
 * fresh SYN reusing the ports of a closing flow: that one is a new connection. */
static __always_inline int ct_usable(const struct ct_entry *e, const struct pkt *p, __u64 now)
{
	if (e->expires_ns <= now)
		return 0;
	if (p->proto == IPPROTO_TCP && (p->tcp_flags & (TCP_SYN_ | TCP_ACK_)) == TCP_SYN_ &&
	    ct_closing(e->flags))
		return 0;
	return 1;
}

/* The other direction's key of the flow that `k` (an entry `e`) belongs to. */
static __always_inline void ct_peer_key(const struct ct_key *k, const struct ct_entry *e,
					struct ct_key *peer)
{
	__u8 snat = e->flags & KXLB_CT_F_SNAT;

	peer->proto = k->proto;
	peer->pad = 0;
	if (k->dir == KXLB_CT_DIR_FWD) {
		/* FWD client->VIP, nat = backend  =>  REV backend->client (or ->snat) */
		peer->saddr = e->nat_addr;
		peer->sport = e->nat_port;
		peer->daddr = snat ? e->snat_addr : k->saddr;
		peer->dport = snat ? e->snat_port : k->sport;
		peer->dir = KXLB_CT_DIR_REV;
	} else {
		/* REV backend->client (or ->snat), nat = VIP  =>  FWD client->VIP */
		peer->saddr = snat ? e->snat_addr : k->daddr;
		peer->sport = snat ? e->snat_port : k->dport;
		peer->daddr = e->nat_addr;
		peer->dport = e->nat_port;
		peer->dir = KXLB_CT_DIR_FWD;
	}
}

static __always_inline void ct_set_flags(struct ct_entry *e, __u8 flags, __u8 proto, __u64 now)
{
	e->flags = flags;
	e->expires_ns = now + ct_lifetime_ns(proto, flags);
}

/* Account a packet to its entry: merge state flags, extend the deadline. */
static __always_inline void ct_touch(const struct ct_key *k, struct ct_entry *e,
				     const struct pkt *p, __u64 now)
{
	__u8 flags = e->flags | ct_flags_of(p, k->dir);

	if (flags != e->flags) {
		struct ct_key pk = {};
		struct ct_entry *pe;

		ct_set_flags(e, flags, p->proto, now);
		ct_peer_key(k, e, &pk);
		pe = ct_map.lookup(&pk);
		if (pe)
			ct_set_flags(pe, pe->flags | flags, p->proto, now);
		return;
	}
	/* Plain refresh, written at most every KXLB_CT_REFRESH_S to keep the cache line
	 * shared between CPUs. A closing flow is not extended. */
	if (!ct_closing(flags)) {
		__u64 deadline = now + ct_lifetime_ns(p->proto, flags);
		if (deadline > e->expires_ns + KXLB_CT_REFRESH_S * NSEC_PER_SEC_)
			e->expires_ns = deadline;
	}
}

/* Track a new flow: FWD then REV. With `snat_addr` set, the flow is masqueraded: the
 * REV entry is keyed on snat_addr and a source port free there (the client's own if
 * possible, else one of a few hashed ones), which the FWD entry records. Returns 0, or
 * -1 when the table refused an entry, -2 when no masquerade port was free. */
static __always_inline int ct_create(struct ct_key *fk, const struct pkt *p,
				     const struct backend *be, __u32 svc_id, __u64 now,
				     __be32 snat_addr, __u32 hash, struct ct_entry *out)
{
	__u8 flags = ct_flags_of(p, KXLB_CT_DIR_FWD) | (snat_addr ? KXLB_CT_F_SNAT : 0);
	struct ct_entry fe = {
		.expires_ns = now + ct_lifetime_ns(p->proto, flags),
		.nat_addr = be->addr,
		.nat_port = be->port,
		.flags = flags,
		.svc_id = svc_id,
		.created_s = now / NSEC_PER_SEC_,
		.snat_addr = snat_addr,
		.snat_port = fk->sport,
	};
	struct ct_entry re = fe;
	struct ct_key rk = {};
	int i;

	re.nat_addr = fk->daddr;
	re.nat_port = fk->dport;
	re.snat_addr = fk->saddr;
	re.snat_port = fk->sport;
	if (!snat_addr) {
		ct_peer_key(fk, &fe, &rk);
		if (ct_map.update(&rk, &re) != 0)
			return -1;
	} else {
		for (i = 0; i < KXLB_SNAT_PORT_TRIES; i++) {
			if (i > 0)
				fe.snat_port = bpf_htons(KXLB_SNAT_PORT_MIN +
							 (hash + i * 7919) % (65536 - KXLB_SNAT_PORT_MIN));
			ct_peer_key(fk, &fe, &rk);
			if (ct_map.insert(&rk, &re) == 0)
				break;
			/* taken: unless by an expired flow, try another port */
			struct ct_entry *old = ct_map.lookup(&rk);
			if (old && old->expires_ns <= now) {
				ct_map.update(&rk, &re);
				break;
			}
		}
		if (i == KXLB_SNAT_PORT_TRIES)
			return -2;
	}
	if (ct_map.update(fk, &fe) != 0) {
		ct_map.delete(&rk);
		return -1;
	}
	*out = fe;
	return 0;
}

#endif
