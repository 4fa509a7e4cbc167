/* SPDX-License-Identifier: GPL-2.0 */
/* Conntrack of one address family (ct.h says how a flow lives and dies; maps.h how the
 * records and the masquerade port table are laid out). A template (family.tmpl.h):
 * written once, instantiated for IPv4 and IPv6.
 *
 * Finding a packet's flow:
 *  - forward (client -> frontend): the record of the packet's source socket, the way of
 *    the packet's frontend (ct_forward);
 *  - reply (backend -> client): to a masquerade port, the port's way names the client
 *    socket (masq_reply); else the record of the packet's destination socket, the way of
 *    the packet's backend (ct_reply). */
#ifndef KX_(KXLB_CT_TMPL_H)
#define KX_(KXLB_CT_TMPL_H)
#include "family.tmpl.h"
#include "maps.h"
#include "hash.h"
#include "KX_(parse).h"
#include "lb.h"
#include "ct.h"

#define CT_IDENT_MASK_ (~(__u64)0xffff)    /* claim bits that name the frontend */
#define MASQ_IDENT_MASK_ (~(__u64)0xff)    /* claim bits that name the backend and protocol */

/* A flow's claim: the frontend (address folded to 32 bits, port) over its state flags. */
static __always_inline __u64 KX_(ct_claim)(kx_addr_t front, __be16 port, __u64 flags)
{
	return ((__u64)KX_FOLD(front) << 32) | ((__u64)port << 16) | flags;
}

/* A masquerade way's claim: the backend (folded, port) and the protocol over its flags. */
static __always_inline __u64 KX_(masq_claim)(kx_addr_t peer, __be16 port, __u8 proto, __u64 flags)
{
	return ((__u64)KX_FOLD(peer) << 32) | ((__u64)port << 16) | ((__u64)proto << 8) | flags;
}

static __always_inline __be16 KX_(ct_front_port)(const struct KX_(ct_flow) *f)
{
	return (__be16)(f->claim >> 16);
}

static __always_inline int KX_(ct_live)(const struct KX_(ct_flow) *f, __u8 proto, __u32 now)
{
	__u64 c = f->claim;

	return (c & KXLB_CT_F_USED) && now - f->last < ct_lifetime(proto, c);
}

/* Flags a packet adds to its flow's state. */
static __always_inline __u64 KX_(ct_flags_of)(const struct KX_(pkt) *p, __u8 dir, __u64 have)
{
	__u64 f = 0;

	if (dir == KXLB_CT_DIR_REV)
		f |= KXLB_CT_F_REPLIED;
	if (p->proto == IPPROTO_TCP) {
		if (!(p->tcp_flags & TCP_SYN_))
			f |= dir == KXLB_CT_DIR_REV ? KXLB_CT_F_REV_ACK : KXLB_CT_F_FWD_ACK;
		if (p->tcp_flags & TCP_RST_)
			f |= KXLB_CT_F_RST;
		if (p->tcp_flags & TCP_FIN_)
			f |= dir == KXLB_CT_DIR_REV ? KXLB_CT_F_FIN_REV : KXLB_CT_F_FIN_FWD;
	} else if (dir == KXLB_CT_DIR_FWD && (have & KXLB_CT_F_REPLIED)) {
		f |= KXLB_CT_F_FWD_ACK;   /* UDP: spoken to again after an answer */
	}
	return f;
}

/* A pure SYN on the ports of a closing flow opens a new connection: a fresh backend. */
static __always_inline int KX_(ct_reopens)(const struct KX_(ct_flow) *f, const struct KX_(pkt) *p)
{
	return p->proto == IPPROTO_TCP && (p->tcp_flags & (TCP_SYN_ | TCP_ACK_)) == TCP_SYN_ &&
	       ct_closing(f->claim);
}

/* The live flow of socket `k`'s record to frontend front:fport (NULL: none). */
static __always_inline struct KX_(ct_flow) *KX_(ct_way_to_front)(struct KX_(ct_entry) *rec, kx_addr_t front,
								 __be16 fport, __u8 proto, __u32 now)
{
	__u64 want = KX_(ct_claim)(front, fport, 0);

#pragma clang loop unroll(disable)
	for (int i = 0; i < KXLB_CT_WAYS; i++) {
		struct KX_(ct_flow) *f = &rec->flow[i];

		if ((f->claim & CT_IDENT_MASK_) == want && KX_EQ(f->front_addr, front) && KX_(ct_live)(f, proto, now))
			return f;
	}
	return NULL;
}

/* The flow of record `rec` (NULL: none) that forward packet p belongs to: the live flow
 * of its frontend, unless p is a SYN opening a new connection on a closing flow's ports. */
static __always_inline struct KX_(ct_flow) *KX_(ct_forward_flow)(struct KX_(ct_entry) *rec,
								const struct KX_(pkt) *p, __u32 now)
{
	struct KX_(ct_flow) *f = rec ? KX_(ct_way_to_front)(rec, p->daddr, p->dport, p->proto, now) : NULL;

	return f && !KX_(ct_reopens)(f, p) ? f : NULL;
}

/* The record of client socket addr:port. */
static __always_inline struct KX_(ct_entry) *KX_(ct_record)(kx_addr_t addr, __be16 port, __u8 proto)
{
	struct KX_(ct_key) k = {.addr = addr, .port = port, .proto = proto};

	return KX_(ct_map).lookup(&k);
}

/* Forward lookup: the flow of client caddr:cport to frontend front:fport. */
static __always_inline struct KX_(ct_flow) *KX_(ct_forward)(kx_addr_t caddr, __be16 cport, __u8 proto,
							   kx_addr_t front, __be16 fport, __u32 now)
{
	struct KX_(ct_entry) *rec = KX_(ct_record)(caddr, cport, proto);

	return rec ? KX_(ct_way_to_front)(rec, front, fport, proto, now) : NULL;
}

/* The live flow of client caddr:cport whose backend is baddr:bport and whose source port
 * (as the backend sees it) is sport; `remapped`: a masqueraded or remapped flow (the
 * reply came to a masquerade port), else one that kept the client's own port. */
static __always_inline struct KX_(ct_flow) *KX_(ct_way_of_backend)(kx_addr_t caddr, __be16 cport, __u8 proto,
								  kx_addr_t baddr, __be16 bport, __be16 sport,
								  int remapped, __u32 now)
{
	struct KX_(ct_entry) *rec = KX_(ct_record)(caddr, cport, proto);
	const __u64 moved = KXLB_CT_F_SNAT | KXLB_CT_F_REMAP | KXLB_CT_F_DIRECT;

	if (!rec)
		return NULL;
#pragma clang loop unroll(disable)
	for (int i = 0; i < KXLB_CT_WAYS; i++) {
		struct KX_(ct_flow) *f = &rec->flow[i];

		if (KX_EQ(f->backend_addr, baddr) && f->backend_port == bport && f->src_port == sport &&
		    !(f->claim & moved) == !remapped && KX_(ct_live)(f, proto, now))
			return f;
	}
	return NULL;
}

/* The masquerade range of lb_config (consts.h defaults when it sets none). */
static __always_inline void KX_(masq_range)(const struct KX_(lb_config) *cfg, __u32 *lo, __u32 *span)
{
	*lo = KXLB_SRC_PORT_MIN;
	*span = KXLB_SRC_PORT_MAX - KXLB_SRC_PORT_MIN + 1;
	if (cfg && cfg->src_port_min && cfg->src_port_max >= cfg->src_port_min) {
		*lo = cfg->src_port_min;
		*span = cfg->src_port_max - cfg->src_port_min + 1;
	}
}

static __always_inline int KX_(masq_way_taken)(const struct KX_(masq_way) *w, __u32 now, int reclaim)
{
	__u64 c = w->claim;

	if (!(c & KXLB_MASQ_F_USED) || !tick_after(w->expires, now))
		return 0;
	/* Reclaiming (no free port found): a port held by a flow that never got confirmed
	 * both ways is taken back once it is a few ticks old (a spoofed SYN's SYN-ACK went
	 * nowhere). */
	if (reclaim && !(c & KXLB_MASQ_F_CONFIRMED) && now - w->born >= KXLB_FLOOD_HALF_OPEN_TICKS)
		return 0;
	return 1;
}

/* Which way of a masquerade port a backend may hold: always the same one, so checking
 * that a port is free for a backend (no other flow of it there: the 4-tuple it sees must
 * be unique) and finding a reply's way each read one way, not every way of the port. */
static __always_inline __u32 KX_(masq_way_index)(kx_addr_t peer, __be16 pport)
{
	__u32 h = KX_FOLD(peer) ^ ((__u32)pport << 16);

	h ^= h >> 16;
	h *= 0x45d9f3bu;
	return (h >> 16) % KXLB_MASQ_WAYS;
}

/* The way of masquerade port `port` held by the flow with backend peer:pport (NULL:
 * none). */
static __always_inline struct KX_(masq_way) *KX_(masq_way_of)(__u32 port, kx_addr_t peer, __be16 pport,
							      __u8 proto, __u32 now)
{
	struct KX_(masq_entry) *e = KX_(masq_map).lookup(&port);
	__u32 j = KX_(masq_way_index)(peer, pport);
	struct KX_(masq_way) *w;

	if (!e || j >= KXLB_MASQ_WAYS)
		return NULL;
	w = &e->way[j];
	if ((w->claim & ~(__u64)KXLB_MASQ_F_CONFIRMED) != KX_(masq_claim)(peer, pport, proto, KXLB_MASQ_F_USED) ||
	    !KX_EQ(w->peer_addr, peer) || !tick_after(w->expires, now))
		return NULL;
	return w;
}

/* A reply from backend baddr:bport to daddr:dport, where dport may be a masquerade port:
 * its way names the client socket, and the flow is the one of that socket with this
 * backend and source port. The destination must be the source the backend was shown:
 * the masquerade address of a masqueraded flow, the client's own of a remapped one. */
static __always_inline struct KX_(ct_flow) *KX_(masq_reply)(kx_addr_t baddr, __be16 bport, kx_addr_t daddr,
							   __be16 dport, __u8 proto, const struct KX_(lb_config) *cfg,
							   __u32 now, struct KX_(ct_key) *client)
{
	__u32 lo, span, port = bpf_ntohs(dport);
	struct KX_(masq_way) *w;
	struct KX_(ct_flow) *f;

	KX_(masq_range)(cfg, &lo, &span);
	if (port - lo >= span)
		return NULL;
	w = KX_(masq_way_of)(port, baddr, bport, proto, now);
	if (!w)
		return NULL;
	f = KX_(ct_way_of_backend)(w->client_addr, w->client_port, proto, baddr, bport, dport, 1, now);
	if (!f)
		return NULL;
	if (f->claim & KXLB_CT_F_SNAT) {
		if (!cfg || !KX_EQ(daddr, cfg->snat_addr))
			return NULL;
	} else if (!KX_EQ(daddr, w->client_addr)) {
		return NULL;
	}
	client->addr = w->client_addr;
	client->port = w->client_port;
	client->proto = proto;
	return f;
}

/* Reply lookup: the flow whose backend baddr:bport sends to daddr:dport, through a
 * masquerade port or to the client's own socket. `client` gets the client socket. */
static __always_inline struct KX_(ct_flow) *KX_(ct_reply)(kx_addr_t baddr, __be16 bport, kx_addr_t daddr,
							 __be16 dport, __u8 proto, const struct KX_(lb_config) *cfg,
							 __u32 now, struct KX_(ct_key) *client)
{
	struct KX_(ct_flow) *f = KX_(masq_reply)(baddr, bport, daddr, dport, proto, cfg, now, client);

	if (f)
		return f;
	f = KX_(ct_way_of_backend)(daddr, dport, proto, baddr, bport, dport, 0, now);
	if (f) {
		client->addr = daddr;
		client->port = dport;
		client->proto = proto;
	}
	return f;
}

/* Account a packet to its flow: new state flags into its claim at once (an atomic OR);
 * otherwise its time, at most once a tick (the cache line stays shared between CPUs in
 * between). A masqueraded or remapped flow's port is kept taken as long: its way is
 * refreshed with it, and marked confirmed once the flow is. */
static __always_inline void KX_(ct_touch)(struct KX_(ct_flow) *f, const struct KX_(pkt) *p, __u8 dir, __u32 now)
{
	__u64 have = f->claim;
	__u64 add = KX_(ct_flags_of)(p, dir, have) & ~have;

	if (!add && f->last == now)
		return;
	if (add)
		__sync_fetch_and_or(&f->claim, add);
	f->last = now;
	if (!(have & (KXLB_CT_F_SNAT | KXLB_CT_F_REMAP | KXLB_CT_F_DIRECT)))
		return;
	struct KX_(masq_way) *w = KX_(masq_way_of)(bpf_ntohs(f->src_port), f->backend_addr, f->backend_port,
						   p->proto, now);
	if (!w)
		return;
	w->expires = now + masq_hold(p->proto, have | add);
	if (add && !ct_confirmed(p->proto, have) && ct_confirmed(p->proto, have | add))
		__sync_fetch_and_or(&w->claim, KXLB_MASQ_F_CONFIRMED);
}

/* Claim a masquerade port for a new flow to backend peer:pport of client caddr:cport:
 * random ports of the range; on each, the backend's own way (masq_way_index): free, or held
 * by a flow that is over, it is taken with compare-and-swap, so of two CPUs claiming it
 * one wins and the other goes on. That way free means no flow to this backend holds the
 * port: the 4-tuple the backend sees is unique. When the tries found no free port (all
 * KXLB_SRC_PORT_TRIES; under a flood, KXLB_FLOOD_FREE_TRIES), the rest (up to
 * KXLB_SRC_PORT_LAST_TRIES more) may take back a port held by a half-open flow
 * KXLB_FLOOD_HALF_OPEN_TICKS old, as Linux's conntrack drops an unconfirmed entry when its
 * table is full (early_drop): a spoofed SYN flood too slow to count as one
 * (KXLB_FLOOD_NEW_PER_TICK) still fills a range within a port's hold time. Only then: the
 * backend may still hold that flow's 4-tuple half open, and would take the new
 * connection's SYN for a stale duplicate (the lab's test_spoofed_syn_flood saw SYNs
 * retransmitted when a search took the first reclaimable port it met). Returns the port
 * (host order), 0 when none was free. */
static __always_inline __u32 KX_(masq_take)(kx_addr_t peer, __be16 pport, __u8 proto, kx_addr_t caddr,
					    __be16 cport, const struct KX_(lb_config) *cfg, __u32 now)
{
	__u64 mine = KX_(masq_claim)(peer, pport, proto, KXLB_MASQ_F_USED);
	__u32 j = KX_(masq_way_index)(peer, pport);
	__u32 lo, span;
	__u32 free_tries = masq_flood(now) ? KXLB_FLOOD_FREE_TRIES : KXLB_SRC_PORT_TRIES;

	KX_(masq_range)(cfg, &lo, &span);
#pragma clang loop unroll(disable)
	for (__u32 i = 0; i < KXLB_SRC_PORT_TRIES + KXLB_SRC_PORT_LAST_TRIES; i++) {
		/* Each try an independent random port: a probe sequence shared by every flow
		 * (a fixed stride) clusters taken ports, and a nearly full range then fails
		 * with ports free; independent tries fail with probability fill^tries. */
		__u32 port = lo + kx_range(bpf_get_prandom_u32(), span);
		int reclaim = i >= free_tries;
		struct KX_(masq_entry) *e = KX_(masq_map).lookup(&port);

		if (!e || j >= KXLB_MASQ_WAYS)
			continue;
		struct KX_(masq_way) *w = &e->way[j];
		__u64 old = w->claim;
		if (KX_(masq_way_taken)(w, now, reclaim))
			continue;
		if (__sync_val_compare_and_swap(&w->claim, old, mine) != old)
			continue;   /* another CPU took it first */
		if (old & KXLB_MASQ_F_USED && tick_after(w->expires, now))
			stat_inc(KXLB_ST_SNAT_RECLAIM);
		w->peer_addr = peer;
		w->client_addr = caddr;
		w->client_port = cport;
		w->born = now;
		w->expires = now + masq_hold(proto, 0);
		return port;
	}
	return 0;
}

/* Give a claimed port back (the flow that took it was not created after all). */
static __always_inline void KX_(masq_release)(__u32 port, kx_addr_t peer, __be16 pport, __u8 proto, __u32 now)
{
	struct KX_(masq_way) *w = KX_(masq_way_of)(port, peer, pport, proto, now);

	if (w)
		w->expires = now;
}

/* Does the record hold a live flow whose replies would come from be:port to the client's
 * own port? A new flow to the same backend must then be remapped, or its replies and the
 * other flow's could not be told apart (one UDP socket asking two DNS Services that share
 * a backend). */
static __always_inline int KX_(ct_backend_in_use)(const struct KX_(ct_entry) *rec, kx_addr_t baddr, __be16 bport,
						  __u8 proto, __u32 now)
{
	const __u64 moved = KXLB_CT_F_SNAT | KXLB_CT_F_REMAP | KXLB_CT_F_DIRECT;

#pragma clang loop unroll(disable)
	for (int i = 0; i < KXLB_CT_WAYS; i++) {
		const struct KX_(ct_flow) *f = &rec->flow[i];

		if (KX_EQ(f->backend_addr, baddr) && f->backend_port == bport && !(f->claim & moved) &&
		    KX_(ct_live)(f, proto, now))
			return 1;
	}
	return 0;
}

/* Write flow `nf` (claim included) into the record: a way of this frontend being
 * reopened, else a free or dead way, taken with compare-and-swap. Returns the way, or
 * NULL when every way holds a live flow of another frontend. */
static __always_inline struct KX_(ct_flow) *KX_(ct_add_way)(struct KX_(ct_entry) *rec,
							   const struct KX_(ct_flow) *nf, __u8 proto, __u32 now)
{
#pragma clang loop unroll(disable)
	for (int i = 0; i < KXLB_CT_WAYS; i++) {
		struct KX_(ct_flow) *f = &rec->flow[i];
		__u64 old = f->claim;
		int same = (old & CT_IDENT_MASK_) == (nf->claim & CT_IDENT_MASK_) && KX_EQ(f->front_addr, nf->front_addr);

		if (KX_(ct_live)(f, proto, now) && !(same && ct_closing(old)))
			continue;
		if (__sync_val_compare_and_swap(&f->claim, old, nf->claim) != old)
			continue;
		f->front_addr = nf->front_addr;
		f->backend_addr = nf->backend_addr;
		f->backend_port = nf->backend_port;
		f->src_port = nf->src_port;
		f->last = nf->last;
		f->svc_id = nf->svc_id;
		return f;
	}
	return NULL;
}

/* A new flow of the packet's client socket, from its first packet. */
static __always_inline void KX_(ct_fill)(struct KX_(ct_flow) *out, const struct KX_(pkt) *p,
					 const struct KX_(backend) *be, __u32 svc_id, __u64 flags, __u32 now)
{
	__builtin_memset(out, 0, sizeof(*out));
	out->claim = KX_(ct_claim)(p->daddr, p->dport, flags);
	out->front_addr = p->daddr;
	out->backend_addr = be->addr;
	out->backend_port = be->port;
	out->src_port = p->sport;
	out->last = now;
	out->svc_id = svc_id;
}

/* A new record's value is built here, not on the stack (the IPv4 journey's stack was at
 * its 512-byte limit without it): per CPU, and only its first way is ever written, so
 * the others stay zero (free ways) without being cleared for every new flow. */
BPF_PERCPU_ARRAY(KX_(ct_new_record), struct KX_(ct_entry), 1);

/* Insert socket k's record holding flow f alone (BPF_NOEXIST). 0, or -1 when the socket
 * has a record already. */
static __always_inline int KX_(ct_insert)(const struct KX_(ct_key) *k, const struct KX_(ct_flow) *f)
{
	__u32 zero = 0;
	struct KX_(ct_entry) *r = KX_(ct_new_record).lookup(&zero);

	if (!r)
		return -1;
	r->flow[0] = *f;
	return KX_(ct_map).insert(k, r) == 0 ? 0 : -1;
}

/* The first flow of a socket with no record as far as the caller knows (none found, or
 * none read: a TCP SYN, see lb_process), not masqueraded: one insert with BPF_NOEXIST
 * makes the record. Returns 0, or -1 when the socket has a record after all (another
 * CPU's, a retransmitted SYN's, another flow's): the caller reads it and goes on as if
 * it had read it first. */
static __always_inline int KX_(ct_insert_first)(const struct KX_(pkt) *p, const struct KX_(ct_key) *k,
						const struct KX_(backend) *be, __u32 svc_id, __u32 now,
						struct KX_(ct_flow) *out)
{
	KX_(ct_fill)(out, p, be, svc_id, KXLB_CT_F_USED | KX_(ct_flags_of)(p, KXLB_CT_DIR_FWD, 0), now);
	return KX_(ct_insert)(k, out);
}

/* Track a new flow of the packet's client socket `k` to backend `be`, masqueraded to
 * masq_addr (zero: not), where the socket's record `rec` (NULL: none) holds no live flow
 * of this frontend (the caller looked). Its source port is the client's own, unless it
 * is masqueraded (the node's own sockets may hold the client's port) or its replies
 * could not be told from another flow's (the same backend on the client's own port):
 * then one of masq_map, taken before the record is written. A record is inserted with
 * BPF_NOEXIST. The loser of a two-CPU race for it re-reads it; when the winner made this
 * very flow (the same first packet on both CPUs at once), the loser gives its port back
 * and returns 1: the caller takes the winner's flow, so a frontend never has two flows in
 * one record, one of them holding a port for nothing. `out` gets the flow made (to plan
 * the packet's rewrite from). Returns 0, 1, -1 (conntrack full: every way of the
 * socket's record live) or -2 (no masquerade port free). */
static __always_inline int KX_(ct_create)(const struct KX_(pkt) *p, const struct KX_(ct_key) *k,
					  struct KX_(ct_entry) *rec, const struct KX_(backend) *be, __u32 svc_id,
					  kx_addr_t masq_addr, const struct KX_(lb_config) *cfg, __u32 now,
					  struct KX_(ct_flow) *out)
{
	__u64 flags = KXLB_CT_F_USED | KX_(ct_flags_of)(p, KXLB_CT_DIR_FWD, 0);
	__u32 port = 0;

	if (!KX_ZERO(masq_addr)) {
		flags |= KXLB_CT_F_SNAT;
	} else if (rec && KX_(ct_backend_in_use)(rec, be->addr, be->port, p->proto, now)) {
		flags |= KXLB_CT_F_REMAP;
		stat_inc(KXLB_ST_CT_REMAP);
	}
	KX_(ct_fill)(out, p, be, svc_id, flags, now);
	if (flags & (KXLB_CT_F_SNAT | KXLB_CT_F_REMAP)) {
		port = KX_(masq_take)(be->addr, be->port, p->proto, p->saddr, p->sport, cfg, now);
		if (!port)
			return -2;
		out->src_port = bpf_htons(port);
	}
	if (!rec) {
		if (KX_(ct_insert)(k, out) == 0)
			return 0;
		rec = KX_(ct_map).lookup(k);  /* another CPU inserted the record first */
		if (KX_(ct_forward_flow)(rec, p, now)) {
			if (port)
				KX_(masq_release)(port, be->addr, be->port, p->proto, now);
			return 1;
		}
	}
	if (rec && KX_(ct_add_way)(rec, out, p->proto, now))
		return 0;
	if (port)
		KX_(masq_release)(port, be->addr, be->port, p->proto, now);
	return -1;
}

/* Direct traffic on a flow's reply tuple: the client's socket now sends to a backend of
 * one of its live flows directly (not through a frontend), on its own port. The
 * backend's answers to it and to the flow would look the same; as Linux's NAT gives such
 * a connection a source port of its own (nf_nat's null binding), the direct one is
 * remapped: a flow whose frontend is the backend itself, through masq_map. `rec`: the
 * client socket's record. Returns the flow, or NULL when the packet needs nothing (or no
 * port was free: then it passes as it is). */
static __always_inline struct KX_(ct_flow) *KX_(ct_direct)(const struct KX_(pkt) *p, struct KX_(ct_entry) *rec,
							  const struct KX_(lb_config) *cfg, __u32 now)
{
	struct KX_(ct_flow) nf = {};
	struct KX_(ct_flow) *f;
	__u32 port;

	if (!rec || !KX_(ct_backend_in_use)(rec, p->daddr, p->dport, p->proto, now))
		return NULL;
	port = KX_(masq_take)(p->daddr, p->dport, p->proto, p->saddr, p->sport, cfg, now);
	if (!port)
		return NULL;
	nf.claim = KX_(ct_claim)(p->daddr, p->dport,
				 KXLB_CT_F_USED | KXLB_CT_F_DIRECT | KX_(ct_flags_of)(p, KXLB_CT_DIR_FWD, 0));
	nf.front_addr = p->daddr;
	nf.backend_addr = p->daddr;
	nf.backend_port = p->dport;
	nf.src_port = bpf_htons(port);
	nf.last = now;
	f = KX_(ct_add_way)(rec, &nf, p->proto, now);
	if (!f) {
		KX_(masq_release)(port, p->daddr, p->dport, p->proto, now);
		return NULL;
	}
	stat_inc(KXLB_ST_CT_DIRECT);
	return f;
}

#endif
