/* SPDX-License-Identifier: GPL-2.0 */
/* kxlb datapath: service DNAT with conntrack and reverse NAT, for tc (clsact ingress)
 * and XDP. Both hooks run lb_process() on the raw frame and only differ in how they
 * apply the rewrite it plans (nat.h).
 *
 * A packet's journey:
 *   parse (Ethernet/IPv4/L4; anything odd is passed untouched)
 *   -> later fragment?       follow the first fragment's translation (frag_map)
 *   -> ICMP error?           translate it if it quotes a tracked flow
 *   -> FWD conntrack hit?    client packet of a known flow: DNAT to its backend
 *   -> frontend hit?         new flow: lb_decide() (policy, affinity, masquerade),
 *                            track it, DNAT; or reject/drop as kube-proxy would
 *   -> REV conntrack hit?    backend reply: SNAT back to VIP:port
 *   -> service CIDR?         bad port of a cluster IP: reject; unallocated: drop
 *   -> otherwise             not ours: pass untouched */
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/tcp.h>
#include <uapi/linux/udp.h>
#include <uapi/linux/icmp.h>
#include <uapi/linux/pkt_cls.h>

#define KXLB_DATAPATH 1

#include "maps.h"
#include "csum.h"
#include "hash.h"
#include "parse.h"
#include "lb.h"
#include "ct.h"
#include "nat.h"
#include "reject.h"

enum lb_verdict {
	LB_PASS = 0,   /* hand the packet on unchanged */
	LB_NAT,        /* apply the nat_plan, then hand on */
	LB_DONE,       /* already rewritten in place (ICMP error), hand on */
	LB_DROP,
	LB_REJECT,     /* answer with ICMP port unreachable (struct reject_info filled) */
};

/* First fragment of a translated datagram: remember the new addresses for the rest. */
static __always_inline void frag_remember(const struct pkt *p, const struct nat_plan *n)
{
	if (!p->frag)
		return;
	struct frag_key fk = {.saddr = p->saddr, .daddr = p->daddr, .id = p->ip_id, .proto = p->proto};
	struct frag_value fv = {.saddr = n->saddr_new, .daddr = n->daddr_new};
	frag_map.update(&fk, &fv);
}

/* Later fragment: no ports to look at; translate the address like its first fragment
 * did. One that overtook its first fragment is passed untouched (never corrupted). */
static __always_inline int frag_follow(const struct pkt *p, struct nat_plan *n)
{
	struct frag_key fk = {.saddr = p->saddr, .daddr = p->daddr, .id = p->ip_id, .proto = p->proto};
	struct frag_value *fv = frag_map.lookup(&fk);

	if (!fv) {
		stat_inc(KXLB_ST_FRAG_UNKNOWN);
		return LB_PASS;
	}
	nat_plan_init(n, p); /* a later fragment: l4 = 0, addresses only */
	n->saddr_new = fv->saddr;
	n->daddr_new = fv->daddr;
	stat_inc(KXLB_ST_FRAG_NAT);
	return LB_NAT;
}

/* Where a new flow comes from, as traffic policies see it: kube-proxy's detect-local
 * (the cluster CIDR). Without one configured every client counts as external. */
static __always_inline __u8 packet_origin(const struct lb_config *cfg, __be32 saddr)
{
	if (cfg && cfg->cluster_mask && (saddr & cfg->cluster_mask) == cfg->cluster_cidr)
		return KXLB_ORIGIN_POD;
	return KXLB_ORIGIN_EXTERNAL;
}

/* Reject a new flow (ICMP port unreachable), or drop it when it cannot be quoted (a
 * fragment, IP options). */
static __always_inline int reject_or_drop(void *data, void *data_end, const struct pkt *p,
					  struct reject_info *ri)
{
	/* Not a fragment (nothing to quote), and never an ICMP error about an ICMP error
	 * (RFC 1122 3.2.2; the kernel's icmp_send behind kube-proxy's reject refuses too). */
	if (!p->frag && !(p->proto == IPPROTO_ICMP && icmp_is_error(p)) && reject_save(data, data_end, ri) == 0)
		return LB_REJECT;
	return LB_DROP;
}

/* No frontend and no flow: pass, unless it addresses the service CIDR (a cluster IP on
 * a port no Service defines is rejected, an unallocated address dropped). */
static __always_inline int not_a_service(void *data, void *data_end, const struct pkt *p,
					 struct reject_info *ri)
{
	switch (lb_unknown_service_addr(lb_config_get(), p->daddr)) {
	case LB_DEC_REJECT:
		return reject_or_drop(data, data_end, p, ri);
	case LB_DEC_DROP:
		return LB_DROP;
	}
	stat_inc(KXLB_ST_PASS);
	return LB_PASS;
}

/* The rewrite a conntrack entry prescribes for a packet of its direction (maps.h):
 * forward client:port -> front:port becomes src:src_port -> backend:port, and replies
 * the reverse. Fields that keep their value cost nothing (nat.h). */
static __always_inline void ct_plan(__u8 dir, const struct ct_entry *e, const struct pkt *p,
				    struct nat_plan *n)
{
	nat_plan_init(n, p);
	if (dir == KXLB_CT_DIR_FWD) {
		n->saddr_new = e->src_addr;
		n->sport_new = e->src_port;
		n->daddr_new = e->backend_addr;
		n->dport_new = e->backend_port;
	} else {
		n->saddr_new = e->front_addr;
		n->sport_new = e->front_port;
		n->daddr_new = e->client_addr;
		n->dport_new = e->client_port;
	}
}

/* Translate a packet of a tracked flow with its conntrack entry. */
static __always_inline int ct_translate(const struct ct_key *k, struct ct_entry *e,
					const struct pkt *p, __u64 now, struct nat_plan *n)
{
	ct_touch(k, e, p, now);
	ct_plan(k->dir, e, p, n);
	svc_account(e->svc_id, k->dir, p->len, 0);
	stat_inc(k->dir == KXLB_CT_DIR_FWD ? KXLB_ST_CT_FWD : KXLB_ST_CT_REV);
	frag_remember(p, n);
	return LB_NAT;
}

static __always_inline int lb_process(void *data, void *data_end, __u32 len, struct nat_plan *n,
				      struct reject_info *ri)
{
	struct pkt p = {};
	struct ct_entry *e;
	struct svc_value *svp;
	__u64 now;

	switch (parse_ipv4(data, data_end, len, &p)) {
	case PARSE_OK:
		break;
	case PARSE_NOT_IPV4:
		stat_inc(KXLB_ST_NOT_IPV4);
		return LB_PASS;
	default:
		stat_inc(KXLB_ST_MALFORMED);
		return LB_PASS;
	}
	p.len = len;
	if (!p.first_frag)
		return frag_follow(&p, n);

	if (p.proto == IPPROTO_ICMP) {
		now = ct_now();
		if (!p.frag && icmp_error_nat(data, data_end, &p, now)) {
			stat_inc(KXLB_ST_ICMP_NAT);
			return LB_DONE;
		}
		return not_a_service(data, data_end, &p, ri); /* ping to a cluster IP: rejected */
	}
	if (p.proto != IPPROTO_TCP && p.proto != IPPROTO_UDP)
		return not_a_service(data, data_end, &p, ri);

	/* 1. Client packet of a tracked flow: its backend is already decided. */
	struct ct_key k = {.saddr = p.saddr, .daddr = p.daddr, .sport = p.sport,
			   .dport = p.dport, .proto = p.proto, .dir = KXLB_CT_DIR_FWD};
	e = ct_map.lookup(&k);
	now = e ? ct_now() : 0; /* the clock only when an entry is there to judge */
	if (e && ct_usable(e, &p, now))
		return ct_translate(&k, e, &p, now, n);

	/* 2. New flow to a service frontend. */
	struct svc_key sk = {.vip = p.daddr, .port = p.dport, .proto = p.proto};
	svp = svc_map.lookup(&sk);
	if (svp) {
		struct svc_value sv = *svp; /* one snapshot: sizes and gen together */
		struct lb_config *cfg = lb_config_get();
		struct lb_flow f = {.client = p.saddr, .origin = packet_origin(cfg, p.saddr),
				    .hash = flow_hash(p.saddr, p.daddr, ((__u32)p.sport << 16) | p.dport,
						      KXLB_HASH_SEED ^ p.proto)};
		struct lb_choice c = {};

		switch (lb_decide(&sk, &sv, &f, cfg, &c)) {
		case LB_DEC_BACKEND:
			break;
		case LB_DEC_REJECT:
			return reject_or_drop(data, data_end, &p, ri);
		default:
			return LB_DROP;
		}
		if (!now)
			now = ct_now();
		struct ct_entry fe;
		int err = ct_create(&k, &p, &c.be, sv.svc_id, c.snat, f.hash, cfg, now, &fe);
		if (err < 0) {
			stat_inc(err == -2 ? KXLB_ST_SNAT_NO_PORT : KXLB_ST_CT_FULL);
			return LB_DROP;
		}
		ct_plan(KXLB_CT_DIR_FWD, &fe, &p, n); /* as the entry just written says */
		svc_account(sv.svc_id, KXLB_CT_DIR_FWD, len, 1);
		stat_inc(c.snat ? KXLB_ST_SNAT : KXLB_ST_NEW_FLOW);
		frag_remember(&p, n);
		return LB_NAT;
	}

	/* 3. A translated 4-tuple (canonical REV key): from the backend, a reply to bring
	 * back to frontend:port; from the other side, the client talking to the backend
	 * directly, so the entry outlived its flow and must not touch the answers. */
	ct_rev_key(p.saddr, p.sport, p.daddr, p.dport, p.proto, &k);
	e = ct_map.lookup(&k);
	if (e) {
		if (!now)
			now = ct_now();
		if (ct_live(e, p.proto, now)) {
			if (e->backend_addr == p.saddr && e->backend_port == p.sport)
				return ct_translate(&k, e, &p, now, n);
			ct_forget(&k, e);
		}
	}

	return not_a_service(data, data_end, &p, ri);
}

int kxlb_tc(struct __sk_buff *skb)
{
	struct nat_plan n = {};
	int v;

	/* Headers (ICMP errors quote two) must be in the linear area for direct access. */
	if (skb->data_end - skb->data < 128 && skb->len > skb->data_end - skb->data)
		bpf_skb_pull_data(skb, skb->len < 128 ? skb->len : 128);

	struct reject_info ri;
	v = lb_process((void *)(long)skb->data, (void *)(long)skb->data_end, skb->len, &n, &ri);
	if (v == LB_NAT)
		return nat_apply_tc(skb, &n) < 0 ? TC_ACT_SHOT : TC_ACT_OK;
	if (v == LB_REJECT) {
		/* A fresh frame of REJECT_LEN bytes, back out of the interface it came in on.
		 * CHECKSUM_PARTIAL state of the original skb is not reset (no helper does):
		 * harmless on veths, whose receiver trusts it; see docs/datapath.md. */
		if (bpf_skb_change_tail(skb, REJECT_LEN, 0) < 0 ||
		    reject_build((void *)(long)skb->data, (void *)(long)skb->data_end, &ri) < 0)
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

/* tc egress: ICMP errors this node generates about a translated flow leave through
 * here (e.g. "fragmentation needed" when a client's translated packet does not fit the
 * backend's path): their quote shows the translated packet, which the client never
 * sent, so it is translated back (nat.h icmp_error_nat) or path MTU discovery through
 * a VIP would fail. Everything else goes on untouched, to the next filter. */
int kxlb_tc_egress(struct __sk_buff *skb)
{
	struct pkt p = {};

	if (skb->data_end - skb->data < 128 && skb->len > skb->data_end - skb->data)
		bpf_skb_pull_data(skb, skb->len < 128 ? skb->len : 128);
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;

	if (parse_ipv4(data, data_end, skb->len, &p) != PARSE_OK || p.proto != IPPROTO_ICMP || p.frag)
		return TC_ACT_UNSPEC;
	p.len = skb->len;
	if (!icmp_error_nat(data, data_end, &p, ct_now()))
		return TC_ACT_UNSPEC;
	stat_inc(KXLB_ST_ICMP_NAT);
	return TC_ACT_OK;
}

int kxlb_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct nat_plan n = {};
	int v;

	struct reject_info ri;
	v = lb_process(data, data_end, data_end - data, &n, &ri);
	if (v == LB_NAT)
		return nat_apply_xdp(data, data_end, &n) < 0 ? XDP_DROP : XDP_PASS;
	if (v == LB_REJECT) {
		if (bpf_xdp_adjust_tail(ctx, REJECT_LEN - (int)(data_end - data)) < 0)
			return XDP_DROP;
		data = (void *)(long)ctx->data;
		data_end = (void *)(long)ctx->data_end;
		return reject_build(data, data_end, &ri) < 0 ? XDP_DROP : XDP_TX;
	}
	return v == LB_DROP ? XDP_DROP : XDP_PASS;
}
