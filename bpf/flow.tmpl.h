/* SPDX-License-Identifier: GPL-2.0 */
/* A packet's journey through one address family, and the tc and XDP hooks that apply
 * its verdict. A template (family.tmpl.h): written once, instantiated for IPv4 and IPv6
 * by kxlb.c, which hands each frame to its family's hook by ethertype. What differs by
 * family (parsing, the NAT of the headers, ICMP errors, the reject) lives in the
 * family's own headers under the same names (parse.h / parse6.h, nat.h / nat6.h,
 * reject.h / reject6.h). */
#ifndef KX_(KXLB_FLOW_TMPL_H)
#define KX_(KXLB_FLOW_TMPL_H)
#include <uapi/linux/pkt_cls.h>
#include "family.tmpl.h"
#include "lb.h"
#include "ct.h"
#include "filter.h"
#include "lb.tmpl.h"
#include "ct.tmpl.h"
#include "plan.tmpl.h"
#include "KX_(nat).h"
#include "KX_(reject).h"


/* First fragment of a translated datagram: remember the new addresses for the rest. */
static __always_inline void KX_(frag_remember)(const struct KX_(pkt) *p, const struct KX_(nat_plan) *n)
{
	if (!p->frag)
		return;
	struct KX_(frag_key) fk = {.saddr = p->saddr, .daddr = p->daddr, .id = p->ip_id, .proto = p->proto};
	struct KX_(frag_value) fv = {.saddr = n->saddr_new, .daddr = n->daddr_new};
	KX_(frag_map).update(&fk, &fv);
}

/* Later fragment: no ports to look at; translate the address like its first fragment
 * did. One whose first fragment was not translated (not ours, or overtaken: the caller
 * counts which) is passed untouched (never corrupted). */
static __always_inline int KX_(frag_follow)(const struct KX_(pkt) *p, struct KX_(nat_plan) *n)
{
	struct KX_(frag_key) fk = {.saddr = p->saddr, .daddr = p->daddr, .id = p->ip_id, .proto = p->proto};
	struct KX_(frag_value) *fv = KX_(frag_map).lookup(&fk);

	if (!fv)
		return LB_PASS;
	KX_(nat_plan_init)(n, p); /* a later fragment: l4 = 0, addresses only */
	n->saddr_new = fv->saddr;
	n->daddr_new = fv->daddr;
	stat_inc(KXLB_ST_FRAG_NAT);
	return LB_NAT;
}

/* Where a new flow comes from, as traffic policies see it: kube-proxy's detect-local
 * (the cluster CIDR). Without one configured every client counts as external. */
static __always_inline __u8 KX_(packet_origin)(const struct KX_(lb_config) *cfg, const kx_addr_t *saddr)
{
	if (cfg && !KX_ZERO(cfg->cluster_mask) && KX_IN_NET(*saddr, cfg->cluster_cidr, cfg->cluster_mask))
		return KXLB_ORIGIN_POD;
	return KXLB_ORIGIN_EXTERNAL;
}

/* Reject a new flow (ICMP port unreachable), or drop it when it cannot be quoted (a
 * fragment, IPv4 options). */
static __always_inline int KX_(reject_or_drop)(void *data, void *data_end, const struct KX_(pkt) *p,
					       struct KX_(reject_info) *ri)
{
	/* Not a fragment (nothing to quote), and never an ICMP error about an ICMP error
	 * (RFC 1122 3.2.2, RFC 4443 2.4; the kernel's icmp_send behind kube-proxy's reject
	 * refuses too). */
	if (!p->frag && !(p->proto == KX_IPPROTO_ICMP && KX_(icmp_is_error)(p)) &&
	    KX_(reject_save)(data, data_end, ri) == 0)
		return LB_REJECT;
	return LB_DROP;
}

/* No frontend and no flow: pass, unless it addresses the service CIDR (a cluster IP on
 * a port no Service defines is rejected, an unallocated address dropped). */
static __always_inline int KX_(not_a_service)(void *data, void *data_end, const struct KX_(pkt) *p,
					      struct KX_(reject_info) *ri)
{
	switch (KX_(lb_unknown_service_addr)(KX_(lb_config_get)(), &p->daddr)) {
	case LB_DEC_REJECT:
		return KX_(reject_or_drop)(data, data_end, p, ri);
	case LB_DEC_DROP:
		return LB_DROP;
	}
	stat_inc(KXLB_ST_PASS);
	return LB_PASS;
}

/* The rewrite a flow prescribes for a packet of its direction (maps.h struct ct_flow):
 * forward client:port -> front:port becomes src:src_port -> backend:port (src the
 * masquerade address of a masqueraded flow, else the client's), and replies the reverse,
 * to `client`. Fields that keep their value cost nothing (nat.h). */
static __always_inline void KX_(ct_plan)(__u8 dir, const struct KX_(ct_flow) *f, const struct KX_(ct_key) *client,
					 const struct KX_(lb_config) *cfg, const struct KX_(pkt) *p,
					 struct KX_(nat_plan) *n)
{
	KX_(nat_plan_init)(n, p);
	if (dir == KXLB_CT_DIR_FWD) {
		if ((f->claim & KXLB_CT_F_SNAT) && cfg) {
			n->saddr_new = cfg->snat_addr;
			n->masq = 1;
		}
		n->sport_new = f->src_port;
		n->daddr_new = f->backend_addr;
		n->dport_new = f->backend_port;
	} else {
		n->saddr_new = f->front_addr;
		n->sport_new = KX_(ct_front_port)(f);
		n->daddr_new = client->addr;
		n->dport_new = client->port;
	}
}

/* Translate a packet of a tracked flow. */
static __always_inline int KX_(ct_translate)(__u8 dir, struct KX_(ct_flow) *f, const struct KX_(ct_key) *client,
					     const struct KX_(lb_config) *cfg, const struct KX_(pkt) *p, __u32 now,
					     struct KX_(nat_plan) *n)
{
	KX_(ct_touch)(f, p, dir, now);
	KX_(ct_plan)(dir, f, client, cfg, p, n);
	svc_account(f->svc_id, dir, p->len, 0);
	stat_inc(dir == KXLB_CT_DIR_FWD ? KXLB_ST_CT_FWD : KXLB_ST_CT_REV);
	KX_(frag_remember)(p, n);
	return LB_NAT;
}

#ifndef KXLB_FIB_SCRATCH
#define KXLB_FIB_SCRATCH
#define KX_GSO_BY_FRAGS 0xffff /* skb->gso_size of an SCTP GSO packet (segments by its frags) */
/* The route lookup's parameters: in a per-CPU map, as the IPv4 journey leaves no room
 * for them on the stack. Looked up only for a packet that needs the lookup. */
BPF_PERCPU_ARRAY(fib_scratch, struct bpf_fib_lookup, 1);

/* This CPU's route lookup parameters, zeroed (NULL never happens for a one-entry array). */
static __always_inline struct bpf_fib_lookup *fib_params(void)
{
	__u32 zero = 0;
	struct bpf_fib_lookup *fl = fib_scratch.lookup(&zero);

	if (fl)
		__builtin_memset(fl, 0, sizeof(*fl));
	return fl;
}
#endif

/* Path MTU of a masqueraded packet. The kernel checks a forwarded packet against its
 * route's MTU and, when it does not fit and may not be fragmented (IPv4's DF; every IPv6
 * packet), answers "fragmentation needed" ("packet too big") to the packet's source. A
 * masqueraded packet's source is the node's masquerade address by then (translated at
 * ingress, before routing), so that error goes to the node itself and is lost: the client
 * never learns the path MTU, and its large packets vanish (an overlay or tunnel between
 * nodes with a smaller MTU than the clients' link). kube-proxy masquerades after routing,
 * so its node's error reaches the client. The hook asks the route the kernel will take
 * (bpf_fib_lookup with the translated addresses) and answers the client itself (reject.h),
 * quoting the packet the client sent. A GRO batch is checked by its segments, as the
 * kernel checks it. Packets that fit every path of their family skip the lookup: a
 * flow's ACKs and small requests cost nothing. Returns the path MTU when the packet does
 * not fit it, else 0. */
static __always_inline __u32 KX_(masq_path_mtu)(void *ctx, void *data, void *data_end,
						const struct KX_(nat_plan) *n, __u32 ifindex, __u32 gso_size)
{
	struct bpf_fib_lookup *fl = fib_params();
	__u32 hdrs = 0;

	if (!fl)
		return 0;
	__u32 len = KX_(pmtu_params)(fl, data, data_end, n, &hdrs);
	if (!len)
		return 0; /* may be fragmented on its way */
	if (gso_size == KX_GSO_BY_FRAGS)
		return 0; /* SCTP's GSO: each chunk sized for the path by its sender */
	if (gso_size)
		len = hdrs + gso_size;
	if (len <= KX_PMTU_FLOOR || len > 0xffff)
		return 0;
	fl->l4_protocol = n->proto;
	fl->sport = n->sport_new;
	fl->dport = n->dport_new;
	fl->tot_len = len;
	fl->ifindex = ifindex;
	if (bpf_fib_lookup(ctx, fl, sizeof(*fl), 0) != BPF_FIB_LKUP_RET_FRAG_NEEDED)
		return 0;
	return fl->mtu_result;
}

/* What one packet's journey works in: the parsed packet, the plan, the reject's saved
 * headers, a new flow (its record, when it needs one, is built in ct_new_record). Per
 * CPU, in a map, not on the stack, for both families. IPv6's would not fit the 512-byte
 * stack beside the rest. IPv4's did, but the verifier tracks what a program keeps on its
 * stack, path by path, and not what it keeps in map memory: with the scratch on the
 * stack, the states reaching the masquerade port search (masq_take, a loop of 56 tries
 * walked try by try) could not be told equal, and kxlb_tc took 936,000 of the 1,000,000
 * instructions a kernel's verifier walks before it gives up (E2BIG; Linux 6.18). In the
 * map, 520,000: headroom for another kernel's verifier, which prunes less (docs/datapath.md,
 * *Verifier budget*). It costs one per-CPU array lookup per packet. */
struct KX_(lb_scratch) {
	struct KX_(pkt) p;
	struct KX_(nat_plan) n;
	struct KX_(reject_info) ri;
	struct KX_(ct_flow) flow;
};

BPF_PERCPU_ARRAY(KX_(lb_scratch_map), struct KX_(lb_scratch), 1);

/* This CPU's scratch (NULL never happens for a one-entry array, but the verifier wants
 * the check), the packet and the plan zeroed, as a journey's locals would be (the rest is
 * written before it is read). */
static __always_inline struct KX_(lb_scratch) *KX_(lb_scratch_get)(void)
{
	__u32 zero = 0;
	struct KX_(lb_scratch) *s = KX_(lb_scratch_map).lookup(&zero);

	if (s) {
		__builtin_memset(&s->p, 0, sizeof(s->p));
		__builtin_memset(&s->n, 0, sizeof(s->n));
	}
	return s;
}

/* A masqueraded packet too big for its path (masq_path_mtu): answered to the client
 * with the path's MTU instead of translated. One that cannot be quoted (IPv4 options)
 * goes on, and the kernel drops it as before. */
static __always_inline int KX_(too_big)(void *data, void *data_end, struct KX_(lb_scratch) *s)
{
	if (KX_(reject_save)(data, data_end, &s->ri) < 0)
		return LB_NAT;
	stat_inc(KXLB_ST_PMTU);
	return LB_REJECT;
}

static __always_inline int KX_(lb_process)(void *data, void *data_end, __u32 len, struct KX_(lb_scratch) *s)
{
	struct KX_(pkt) *p = &s->p;
	struct KX_(nat_plan) *n = &s->n;
	struct KX_(reject_info) *ri = &s->ri;
	struct KX_(lb_config) *cfg;
	struct KX_(ct_entry) *rec;
	struct KX_(ct_flow) *f;
	struct KX_(ct_key) client;
	struct svc_value *svp;
	__u32 now;

	switch (KX_(parse_ip)(data, data_end, len, p)) {
	case PARSE_OK:
		break;
	case PARSE_NOT_IP:
		stat_inc(KXLB_ST_NOT_IP);
		return LB_PASS;
	case PARSE_NOT_OURS:
		stat_inc(KXLB_ST_PASS);
		return LB_PASS;
	default:
		stat_inc(KXLB_ST_MALFORMED);
		return LB_PASS;
	}
	p->len = len;
	if (!p->first_frag) {
		if (KX_(frag_follow)(p, n) == LB_NAT)
			return LB_NAT;
		stat_inc(KXLB_ST_FRAG_UNKNOWN);
		return LB_PASS;
	}

	if (p->proto == KX_IPPROTO_ICMP) {
		if (!p->frag && KX_(icmp_error_nat)(data, data_end, p, ct_now())) {
			stat_inc(KXLB_ST_ICMP_NAT);
			return LB_DONE;
		}
		if (KX_(icmp_link_local)(p)) { /* neighbour discovery and the like: never ours */
			stat_inc(KXLB_ST_PASS);
			return LB_PASS;
		}
		return KX_(not_a_service)(data, data_end, p, ri); /* ping to a cluster IP: rejected */
	}
	if (!kx_proto_served(p->proto))
		return KX_(not_a_service)(data, data_end, p, ri);

	/* 0. The address filters (filter.h): which of the steps below this packet can need.
	 * Every flow's forward packets go to a frontend address, its replies come from a
	 * backend, and traffic to a flow's backend goes to one; a packet that is none of
	 * these (most of a node's own traffic) is passed after two or three array reads, no
	 * hash lookup and no clock. */
	__u8 may = filter_may(KX_FOLD(p->daddr), p->dport, KX_FOLD(p->saddr), p->sport);
	if (!may)
		return KX_(not_a_service)(data, data_end, p, ri);
	now = ct_now();

	/* 1. A client packet of a tracked flow: the record of its source socket, the way of
	 * its frontend. Its backend is decided already. A pure SYN to a frontend address is
	 * most likely its socket's first packet: its record is read only when step 3 needs
	 * it (syn_first), which spares most new flows a lookup that misses. */
	client.addr = p->saddr;
	client.port = p->sport;
	client.proto = p->proto;
	client.pad = 0;
	cfg = KX_(lb_config_get)();
	int syn_first = p->proto == IPPROTO_TCP && (p->tcp_flags & (TCP_SYN_ | TCP_ACK_)) == TCP_SYN_ &&
			may & MAY_TO_FRONT;
	rec = may & (MAY_TO_FRONT | MAY_TO_BACKEND) && !syn_first ? KX_(ct_map).lookup(&client) : NULL;
	f = may & MAY_TO_FRONT ? KX_(ct_forward_flow)(rec, p, now) : NULL;
	if (f)
		goto tracked;

	/* 2. A reply to a masquerade port: before the frontends, so a reply is never taken
	 * for a new flow (the masquerade range holds no frontend port of a node address). */
	struct KX_(ct_key) to;
	if (may & MAY_FROM_BACKEND) {
		f = KX_(masq_reply)(p->saddr, p->sport, p->daddr, p->dport, p->proto, cfg, now, &to);
		if (f)
			return KX_(ct_translate)(KXLB_CT_DIR_REV, f, &to, cfg, p, now, n);
	}

	/* 3. New flow to a service frontend. */
	struct KX_(svc_key) sk = {.vip = p->daddr, .port = p->dport, .proto = p->proto};
	int dec = LB_DEC_DROP;
	svp = may & MAY_TO_FRONT ? KX_(svc_map).lookup(&sk) : NULL;
	if (svp) {
		struct svc_value sv = *svp; /* one snapshot: sizes and gen together */
		__u32 hash = flow_hash(KX_FOLD(p->saddr), KX_FOLD(p->daddr), ((__u32)p->sport << 16) | p->dport,
				       KXLB_HASH_SEED ^ p->proto);
		struct KX_(lb_flow) lf = {.client = p->saddr, .origin = KX_(packet_origin)(cfg, &p->saddr),
					  .hash = hash};
		struct KX_(lb_choice) c = {};

		dec = KX_(lb_decide)(&sk, &sv, &lf, cfg, &c);
		if (dec == LB_DEC_BACKEND) {
			int err = -1;

			if (syn_first && !KX_ZERO(c.snat))  /* its port is taken before the insert */
				rec = KX_(ct_map).lookup(&client);
			if (!rec && KX_ZERO(c.snat)) {
				err = KX_(ct_insert_first)(p, &client, &c.be, sv.svc_id, now, &s->flow);
				if (err < 0)
					rec = KX_(ct_map).lookup(&client);
			}
			f = err < 0 ? KX_(ct_forward_flow)(rec, p, now) : NULL;
			if (f)
				goto tracked;   /* a retransmitted first packet, or another CPU's */
			if (err < 0)
				err = KX_(ct_create)(p, &client, rec, &c.be, sv.svc_id, c.snat, cfg, now, &s->flow);
			/* Another CPU made this flow meanwhile: it is the flow. Read again here, not
			 * handed out of ct_create: that pointer cost kxlb_tc6's verifier 180,000 more
			 * instructions (517k -> 697k on 6.18) for a lookup on a rare path. */
			if (err == 1) {
				stat_inc(KXLB_ST_CT_RACE);
				f = KX_(ct_forward_flow)(KX_(ct_map).lookup(&client), p, now);
				if (f)
					goto tracked;
				err = -1;
			}
			if (err < 0) {
				stat_inc(err == -2 ? KXLB_ST_SNAT_NO_PORT : KXLB_ST_CT_FULL);
				return LB_DROP;
			}
			KX_(ct_plan)(KXLB_CT_DIR_FWD, &s->flow, &client, cfg, p, n); /* as the flow just made says */
			svc_account(sv.svc_id, KXLB_CT_DIR_FWD, len, 1);
			stat_inc(KX_ZERO(c.snat) ? KXLB_ST_NEW_FLOW : KXLB_ST_SNAT);
			KX_(frag_remember)(p, n);
			return LB_NAT;
		}
	}
	if (syn_first) {   /* the record step 1 did not read: a tracked flow outlives its service */
		rec = KX_(ct_map).lookup(&client);
		f = KX_(ct_forward_flow)(rec, p, now);
		if (f)
			goto tracked;
	}
	if (svp)
		return dec == LB_DEC_REJECT ? KX_(reject_or_drop)(data, data_end, p, ri) : LB_DROP;

	/* 4. A reply to a client's own socket: the record of the packet's destination, the
	 * way of its backend. */
	f = may & MAY_FROM_BACKEND ? KX_(ct_way_of_backend)(p->daddr, p->dport, p->proto, p->saddr, p->sport, p->dport, 0, now)
			 : NULL;
	if (f) {
		to.addr = p->daddr;
		to.port = p->dport;
		to.proto = p->proto;
		return KX_(ct_translate)(KXLB_CT_DIR_REV, f, &to, cfg, p, now, n);
	}

	/* 5. The client talking to one of its flows' backends directly, on its own port: that
	 * flow's replies and this traffic's would look alike; this one gets a port of its own
	 * (ct_direct). */
	if (rec && may & MAY_TO_BACKEND) {
		f = KX_(ct_direct)(p, rec, cfg, now);
		if (f)
			goto tracked;
	}

	return KX_(not_a_service)(data, data_end, p, ri);

tracked:   /* a forward packet of flow f */
	return KX_(ct_translate)(KXLB_CT_DIR_FWD, f, &client, cfg, p, now, n);
}

/* The hooks of one family, inlined into kxlb.c's programs: IPv4's into the entry
 * programs, IPv6's into programs of their own, reached by tail call (kxlb.c). */

/* tc ingress, for a frame of this family (kxlb.c made its headers linear). */
static __always_inline int KX_(lb_tc)(struct __sk_buff *skb)
{
	struct KX_(lb_scratch) *s = KX_(lb_scratch_get)();

	if (!s)
		return TC_ACT_UNSPEC;
	int v;

	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	__u32 mtu = 0;

	v = KX_(lb_process)(data, data_end, skb->len, s);
	if (v == LB_NAT && s->n.masq &&
	    (mtu = KX_(masq_path_mtu)(skb, data, data_end, &s->n, skb->ifindex, skb->gso_size)))
		v = KX_(too_big)(data, data_end, s);
	if (v == LB_NAT)
		return KX_(nat_apply_tc)(skb, &s->n) < 0 ? TC_ACT_SHOT : TC_ACT_OK;
	if (v == LB_REJECT) {
		/* A fresh frame of KX_(REJECT_LEN) bytes, back out of the interface it came in
		 * on. CHECKSUM_PARTIAL state of the original skb is not reset (no helper does):
		 * harmless on veths, whose receiver trusts it; see docs/datapath.md. */
		if (bpf_skb_change_tail(skb, KX_(REJECT_LEN), 0) < 0 ||
		    KX_(reject_build)((void *)(long)skb->data, (void *)(long)skb->data_end, &s->ri, mtu) < 0)
			return TC_ACT_SHOT;
		return bpf_redirect(skb->ifindex, 0);
	}
	if (v == LB_DROP)
		return TC_ACT_SHOT;
	/* Not ours: TC_ACT_UNSPEC hands the packet to the next filter on this hook (another
	 * tool's policy, accounting, mirroring) and, with none left, on up the stack as
	 * TC_ACT_OK would. TC_ACT_OK, kept for what we rewrote, ends classification. */
	if (v == LB_DONE)
		return TC_ACT_OK;
	return TC_ACT_UNSPEC;
}

/* A packet this node sends from one of its own addresses may be the reply of one of its
 * host-network backends (a hostNetwork pod, a process of the node, an endpoint on any
 * local address: the node's, or one on lo such as an API server's advertise address): a
 * flow's packets were delivered to it locally, translated at ingress, and its replies
 * start in the node's own stack, so no ingress hook sees them. Its flow translates them
 * as step 4 of lb_process() would (backend:port -> front:port, to the client), and the
 * datagram's later fragments follow its first. Only a backend's address and port can be
 * such a source: every other packet costs the backend filter's one array read. */
BPF_PERCPU_ARRAY(KX_(egress_plan_map), struct KX_(nat_plan), 1);

/* The plan of a packet tc egress translates: in a per-CPU map, not on the stack. The
 * verifier does not track a map value's contents, so every path that planned a rewrite
 * reaches nat_apply_tc() in one state and the rewrite (an SCTP CRC update's 32 rounds
 * among it) is verified once, not once per plan a path left on the stack. Looked up only
 * for a packet that is a flow's. */
static __always_inline struct KX_(nat_plan) *KX_(egress_plan)(void)
{
	__u32 zero = 0;
	return KX_(egress_plan_map).lookup(&zero);
}

static __always_inline int KX_(local_reply_plan)(const struct KX_(pkt) *p, struct KX_(nat_plan) **np)
{
	struct KX_(lb_config) *cfg = KX_(lb_config_get)();
	struct KX_(nat_plan) *n;
	struct KX_(ct_flow) *f;
	struct KX_(ct_key) to;
	__u32 now;

	if (!cfg)
		return LB_PASS;
	if (!p->first_frag) {
		n = *np = KX_(egress_plan)();
		return n ? KX_(frag_follow)(p, n) : LB_PASS; /* rare: one lookup */
	}
	if (!kx_proto_served(p->proto))
		return LB_PASS;
	if (!filter_backend_has(KX_FOLD(p->saddr), p->sport))
		return LB_PASS;
	now = ct_now();
	f = KX_(ct_reply)(p->saddr, p->sport, p->daddr, p->dport, p->proto, cfg, now, &to);
	if (!f)
		return LB_PASS; /* not a reply: the node talking to a client itself */
	n = *np = KX_(egress_plan)();
	return n ? KX_(ct_translate)(KXLB_CT_DIR_REV, f, &to, cfg, p, now, n) : LB_PASS;
}

/* An error translated at egress that now goes to someone else: an error the node sends to
 * a VIP about a reply (e.g. "fragmentation needed" when a backend's reply does not fit
 * the client's path) goes to the backend. The kernel routed it to the VIP (a real node's
 * default route, most likely out of the uplink), which need not lead to the backend: it
 * is sent out of the new destination's route, with that route's link addresses. Without
 * a resolved route (no route, no neighbour entry yet) it goes on as routed. */
static __always_inline int KX_(reroute)(struct __sk_buff *skb, kx_addr_t was)
{
	struct bpf_fib_lookup *fl = fib_params();
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth;

	if (!fl)
		return TC_ACT_OK;
	if (KX_(route_params)(fl, data, data_end, was) <= 0)
		return TC_ACT_OK; /* its destination as routed */
	/* As if it arrived here to be forwarded: an output lookup would be bound to this
	 * device (its ifindex is the lookup's output interface) and miss the route. */
	fl->ifindex = skb->ifindex;
	if (bpf_fib_lookup(skb, fl, sizeof(*fl), 0) != BPF_FIB_LKUP_RET_SUCCESS)
		return TC_ACT_OK;
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	eth = data;
	if ((void *)(eth + 1) > data_end)
		return TC_ACT_OK;
	__builtin_memcpy(eth->h_dest, fl->dmac, 6);
	__builtin_memcpy(eth->h_source, fl->smac, 6);
	return fl->ifindex == skb->ifindex ? TC_ACT_OK : bpf_redirect(fl->ifindex, 0);
}

/* tc egress: what the node itself sends about translated flows.
 *  - The replies of its host-network backends (local_reply_plan).
 *  - ICMP errors it generates about a translated flow (e.g. "fragmentation needed" /
 *    "packet too big" when a client's translated packet does not fit the backend's
 *    path): their quote shows the translated packet, which the client never sent, so it
 *    is translated back (icmp_error_nat) or path MTU discovery through a VIP would fail.
 * Everything else goes on untouched. */
static __always_inline int KX_(lb_tc_egress)(struct __sk_buff *skb)
{
	struct KX_(pkt) p = {};
	struct KX_(nat_plan) *n = NULL;
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;

	if (KX_(parse_ip)(data, data_end, skb->len, &p) != PARSE_OK)
		return TC_ACT_UNSPEC;
	p.len = skb->len;
	if (p.proto == KX_IPPROTO_ICMP && p.first_frag) {
		if (p.frag || !KX_(icmp_error_nat)(data, data_end, &p, ct_now()))
			return TC_ACT_UNSPEC;
		stat_inc(KXLB_ST_ICMP_NAT);
		return KX_(reroute)(skb, p.daddr);
	}
	if (KX_(local_reply_plan)(&p, &n) != LB_NAT || !n)
		return TC_ACT_UNSPEC;
	return KX_(nat_apply_tc)(skb, n) < 0 ? TC_ACT_SHOT : TC_ACT_OK;
}

static __always_inline int KX_(lb_xdp)(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct KX_(lb_scratch) *s = KX_(lb_scratch_get)();

	if (!s)
		return XDP_PASS;
	int v;

	__u32 mtu = 0;

	v = KX_(lb_process)(data, data_end, data_end - data, s);
	if (v == LB_NAT && s->n.masq &&
	    (mtu = KX_(masq_path_mtu)(ctx, data, data_end, &s->n, ctx->ingress_ifindex, 0)))
		v = KX_(too_big)(data, data_end, s);
	if (v == LB_NAT)
		return KX_(nat_apply_xdp)(data, data_end, &s->n) < 0 ? XDP_DROP : XDP_PASS;
	if (v == LB_REJECT) {
		if (bpf_xdp_adjust_tail(ctx, KX_(REJECT_LEN) - (int)(data_end - data)) < 0)
			return XDP_DROP;
		data = (void *)(long)ctx->data;
		data_end = (void *)(long)ctx->data_end;
		return KX_(reject_build)(data, data_end, &s->ri, mtu) < 0 ? XDP_DROP : XDP_TX;
	}
	return v == LB_DROP ? XDP_DROP : XDP_PASS;
}

#endif
