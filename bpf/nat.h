/* SPDX-License-Identifier: GPL-2.0 */
/* Packet rewrites. The decision (lb_process) fills a struct nat_plan; each hook applies
 * it its own way, because checksum state differs:
 *  - tc: the skb may be CHECKSUM_PARTIAL (veth from a local socket: the L4 field holds
 *    only the pseudo-header sum) or CHECKSUM_COMPLETE (skb->csum must follow). The
 *    bpf_l3/l4_csum_replace helpers know both cases; hand-made arithmetic would not.
 *  - XDP: raw frame with full checksums, updated incrementally by hand (csum.h).
 * ICMP error translation is the same code for both hooks: every change it makes inside
 * the ICMP message is compensated by the ICMP checksum and the outer address by the IP
 * checksum, so the packet's total sum (skb->csum) is unchanged. */
#ifndef KXLB_NAT_H
#define KXLB_NAT_H

#define OFF_(type, field) __builtin_offsetof(type, field)

/* What to write into a packet: new source and destination (address and port). Fields
 * whose new value equals the old cost nothing. */
struct nat_plan {
	__u32  l3_off;
	__u32  l4_off;
	__be32 saddr_old, saddr_new;
	__be32 daddr_old, daddr_new;
	__be16 sport_old, sport_new;
	__be16 dport_old, dport_new;
	__u8   proto;
	__u8   l4;         /* 1: ports and L4 checksum too; 0: addresses only (later fragment) */
	__u8   pad[2];
};

/* Start a plan that changes nothing. */
static __always_inline void nat_plan_init(struct nat_plan *n, const struct pkt *p)
{
	n->l3_off = p->l3_off;
	n->l4_off = p->l4_off;
	n->proto = p->proto;
	n->l4 = p->first_frag;
	n->saddr_old = n->saddr_new = p->saddr;
	n->daddr_old = n->daddr_new = p->daddr;
	n->sport_old = n->sport_new = p->sport;
	n->dport_old = n->dport_new = p->dport;
}

/* tc: one L4 checksum change through the helper (it knows CHECKSUM_PARTIAL/COMPLETE:
 * `pseudo` for address changes, which the partial sum covers, not ports). */
static __always_inline int tc_l4_csum(struct __sk_buff *skb, const struct nat_plan *n, __u32 from,
				      __u32 to, __u64 size, __u64 pseudo)
{
	__u32 csum_off;
	__u64 zero_flag = 0;

	if (from == to)
		return 0;
	if (n->proto == IPPROTO_TCP) {
		csum_off = n->l4_off + OFF_(struct tcphdr, check);
	} else {
		csum_off = n->l4_off + OFF_(struct udphdr, check);
		zero_flag = BPF_F_MARK_MANGLED_0; /* 0 = "no checksum" stays 0 */
	}
	return bpf_l4_csum_replace(skb, csum_off, from, to, pseudo | zero_flag | size);
}

/* tc: the L4 checksum through the helpers, then the IP checksum, addresses and ports
 * written directly (the IP checksum is never offloaded and its change is neutral for
 * skb->csum). Returns 0, or negative on error. */
static __always_inline int nat_apply_tc(struct __sk_buff *skb, const struct nat_plan *n)
{
	if (n->l4) {
		if (tc_l4_csum(skb, n, n->saddr_old, n->saddr_new, 4, BPF_F_PSEUDO_HDR) < 0 ||
		    tc_l4_csum(skb, n, n->daddr_old, n->daddr_new, 4, BPF_F_PSEUDO_HDR) < 0 ||
		    tc_l4_csum(skb, n, n->sport_old, n->sport_new, 2, 0) < 0 ||
		    tc_l4_csum(skb, n, n->dport_old, n->dport_new, 2, 0) < 0)
			return -1;
	}
	/* The helpers invalidated packet pointers: take them again. */
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + ETH_HLEN_;
	__be16 *ports;

	if ((void *)(ip + 1) > data_end)
		return -1;
	ip->check = csum_update32(csum_update32(ip->check, n->saddr_old, n->saddr_new),
				  n->daddr_old, n->daddr_new);
	ip->saddr = n->saddr_new;
	ip->daddr = n->daddr_new;
	if (n->l4) {
		ports = (void *)ip + ip->ihl * 4;
		if ((void *)(ports + 2) > data_end)
			return -1;
		ports[0] = n->sport_new;
		ports[1] = n->dport_new;
	}
	return 0;
}

/* XDP: rewrite in place, checksums by hand. Offsets are re-derived from the packet so
 * the verifier can bound them. Returns 0, or -1 if the packet is not what the plan was
 * made from. */
static __always_inline int nat_apply_xdp(void *data, void *data_end, const struct nat_plan *n)
{
	struct iphdr *ip = data + ETH_HLEN_;
	__be16 *ports;
	__u16 *csum;

	if ((void *)(ip + 1) > data_end)
		return -1;
	if (n->l4) {
		ports = (void *)ip + ip->ihl * 4;
		if (n->proto == IPPROTO_TCP) {
			struct tcphdr *th = (void *)ports;
			if ((void *)(th + 1) > data_end)
				return -1;
			csum = &th->check;
		} else {
			struct udphdr *uh = (void *)ports;
			if ((void *)(uh + 1) > data_end)
				return -1;
			csum = &uh->check;
		}
		if (n->proto == IPPROTO_TCP || *csum) {
			__u16 c = csum_update32(*csum, n->saddr_old, n->saddr_new);
			c = csum_update32(c, n->daddr_old, n->daddr_new);
			c = csum_update16(c, n->sport_old, n->sport_new);
			c = csum_update16(c, n->dport_old, n->dport_new);
			*csum = n->proto == IPPROTO_UDP ? udp_csum_fixup(c) : c;
		}
		ports[0] = n->sport_new;
		ports[1] = n->dport_new;
	}
	ip->check = csum_update32(csum_update32(ip->check, n->saddr_old, n->saddr_new),
				  n->daddr_old, n->daddr_new);
	ip->saddr = n->saddr_new;
	ip->daddr = n->daddr_new;
	return 0;
}

/* ICMP error about a tracked flow (destination unreachable, time exceeded, parameter
 * problem): the embedded header is the flow's packet as the far side saw it. Looking
 * it up reversed gives the flow's entry in the direction the error travels:
 *  - FWD hit: a client complains about a reply from VIP:port. The error goes to the
 *    backend: inner source VIP:port -> backend, outer destination VIP -> backend.
 *  - REV hit: a backend (or a router on its way) complains about a packet the client
 *    sent: inner destination backend -> VIP:port, outer source backend -> VIP.
 * Returns 1 when translated, 0 when not ours (passed untouched). */
/* An ICMP error message (RFC 1122 3.2.2: never answered with another ICMP error). */
static __always_inline int icmp_is_error(const struct pkt *p)
{
	return p->icmp_type == ICMP_DEST_UNREACH || p->icmp_type == ICMP_TIME_EXCEEDED ||
	       p->icmp_type == ICMP_PARAMETERPROB;
}

static __always_inline int icmp_error_nat(void *data, void *data_end, const struct pkt *p, __u64 now)
{
	struct iphdr *ip = data + ETH_HLEN_;
	struct icmphdr *ih;
	struct iphdr *in;
	__u16 *in_ports;
	struct ct_key k = {};
	struct ct_entry *e;
	__u8 fwd;

	if (!icmp_is_error(p))
		return 0;
	if ((void *)(ip + 1) > data_end)
		return 0;
	ih = (void *)ip + ip->ihl * 4;
	in = (void *)(ih + 1);
	if ((void *)(in + 1) > data_end || in->ihl < 5)
		return 0;
	if (in->protocol != IPPROTO_TCP && in->protocol != IPPROTO_UDP)
		return 0;
	in_ports = (void *)in + in->ihl * 4;
	if ((void *)(in_ports + 4) > data_end) /* ports + UDP length/checksum or TCP seq */
		return 0;

	k.saddr = in->daddr;
	k.daddr = in->saddr;
	k.sport = in_ports[1];
	k.dport = in_ports[0];
	k.proto = in->protocol;
	k.dir = KXLB_CT_DIR_FWD;
	e = ct_map.lookup(&k);
	if (!e || e->expires_ns <= now) {
		k.dir = KXLB_CT_DIR_REV;
		e = ct_map.lookup(&k);
		if (!e || e->expires_ns <= now)
			return 0;
	}
	if (e->flags & KXLB_CT_F_SNAT)
		return 0; /* masqueraded flows: not translated (docs/datapath.md) */
	fwd = k.dir == KXLB_CT_DIR_FWD;

	__be32 new_addr = e->nat_addr;
	__be16 new_port = e->nat_port;
	__be32 old_addr = fwd ? in->saddr : in->daddr;
	__u16 port_idx = fwd ? 0 : 1;
	__be16 old_port = in_ports[port_idx];
	__u16 icsum = ih->checksum;

	/* Inner L4 checksum, when the quoted bytes include it. */
	__u16 *l4c = 0;
	if (in->protocol == IPPROTO_UDP)
		l4c = &in_ports[3];
	else if ((void *)(in_ports + 9) <= data_end)
		l4c = &in_ports[8]; /* tcphdr.check at byte 16 */
	if (l4c && (void *)(l4c + 1) <= data_end && (in->protocol == IPPROTO_TCP || *l4c)) {
		__u16 old = *l4c;
		__u16 c = csum_update16(csum_update32(old, old_addr, new_addr), old_port, new_port);
		if (in->protocol == IPPROTO_UDP)
			c = udp_csum_fixup(c);
		*l4c = c;
		icsum = csum_update16(icsum, old, c);
	}
	/* Inner port, inner address and the inner IP checksum. */
	in_ports[port_idx] = new_port;
	icsum = csum_update16(icsum, old_port, new_port);
	__u16 old_ic = in->check;
	in->check = csum_update32(in->check, old_addr, new_addr);
	icsum = csum_update16(icsum, old_ic, in->check);
	if (fwd)
		in->saddr = new_addr;
	else
		in->daddr = new_addr;
	icsum = csum_update32(icsum, old_addr, new_addr);
	ih->checksum = icsum;

	/* Outer header: only where it names the translated party itself. */
	if (fwd && ip->daddr == old_addr) {
		ip->check = csum_update32(ip->check, old_addr, new_addr);
		ip->daddr = new_addr;
	} else if (!fwd && ip->saddr == old_addr) {
		ip->check = csum_update32(ip->check, old_addr, new_addr);
		ip->saddr = new_addr;
	}
	svc_account(e->svc_id, k.dir, p->len, 0);
	return 1;
}

#endif
