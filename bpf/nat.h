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
#include "maps.h"
#include "csum.h"
#include "parse.h"
#include "lb.h"
#include "ct.h"
#include "tc_csum.h"
/* IPv4's instances of the templates this file builds on. */
#undef KX_FAM
#define KX_FAM 4
#include "lb.tmpl.h"
#include "ct.tmpl.h"
#include "plan.tmpl.h"

/* tc: the L4 checksum through the helpers, then the IP checksum, addresses and ports
 * written directly (the IP checksum is never offloaded and its change is neutral for
 * skb->csum). Returns 0, or negative on error. */
static __always_inline int nat_apply_tc(struct __sk_buff *skb, const struct nat_plan *n)
{
	if (n->l4 && n->proto != IPPROTO_SCTP) {
		if (tc_l4_csum(skb, n->proto, n->l4_off, n->saddr_old, n->saddr_new, 4, BPF_F_PSEUDO_HDR) < 0 ||
		    tc_l4_csum(skb, n->proto, n->l4_off, n->daddr_old, n->daddr_new, 4, BPF_F_PSEUDO_HDR) < 0 ||
		    tc_l4_csum(skb, n->proto, n->l4_off, n->sport_old, n->sport_new, 2, 0) < 0 ||
		    tc_l4_csum(skb, n->proto, n->l4_off, n->dport_old, n->dport_new, 2, 0) < 0)
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
		if (n->proto == IPPROTO_SCTP) { /* the IP header's changes compensate each other */
			__s64 d = sctp_ports_rewrite(ports, data_end, kx_ntohs_len(ip->tot_len) - ip->ihl * 4, n->frag,
						     n->sport_old, n->dport_old, n->sport_new, n->dport_new);
			if (d < 0)
				return -1;
			if (d)
				kx_csum_update(skb, (__u32)d);
			return 0;
		}
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
	if (n->l4 && n->proto == IPPROTO_SCTP) {
		ports = (void *)ip + ip->ihl * 4;
		if (sctp_ports_rewrite(ports, data_end, kx_ntohs_len(ip->tot_len) - ip->ihl * 4, n->frag,
				       n->sport_old, n->dport_old, n->sport_new, n->dport_new) < 0)
			return -1;
	} else if (n->l4) {
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

/* The route lookup of a translated packet for its path MTU (flow.tmpl.h masq_path_mtu):
 * its new addresses. Returns the datagram's length and sets `hdrs` to its IP and L4
 * headers' (a GRO segment's length is those plus the segment size); 0 when the packet may
 * be fragmented on its way (no DF: the kernel fragments it after the rewrite, as it
 * would any forwarded packet). */
static __always_inline __u32 pmtu_params(struct bpf_fib_lookup *fl, void *data, void *data_end,
					 const struct nat_plan *n, __u32 *hdrs)
{
	struct iphdr *ip = data + ETH_HLEN_;

	if ((void *)(ip + 1) > data_end || !(ip->frag_off & bpf_htons(IP_DF_)))
		return 0;
	*hdrs = ip->ihl * 4 + l4_hdr_len((void *)ip + ip->ihl * 4, data_end, n->proto);
	fl->family = 2; /* AF_INET */
	fl->tos = ip->tos;
	fl->ipv4_src = n->saddr_new;
	fl->ipv4_dst = n->daddr_new;
	return kx_ntohs_len(ip->tot_len);
}

/* The route lookup of a packet as it now is (flow.tmpl.h reroute): its addresses.
 * Returns 1 when its destination is no longer `was`, 0 when it is, -1 when unreadable. */
static __always_inline int route_params(struct bpf_fib_lookup *fl, void *data, void *data_end, __be32 was)
{
	struct iphdr *ip = data + ETH_HLEN_;

	if ((void *)(ip + 1) > data_end)
		return -1;
	fl->family = 2; /* AF_INET */
	fl->tos = ip->tos;
	fl->l4_protocol = ip->protocol;
	fl->ipv4_src = ip->saddr;
	fl->ipv4_dst = ip->daddr;
	return ip->daddr != was;
}

/* An ICMP error message (RFC 1122 3.2.2: never answered with another ICMP error). */
static __always_inline int icmp_is_error(const struct pkt *p)
{
	return p->icmp_type == ICMP_DEST_UNREACH || p->icmp_type == ICMP_TIME_EXCEEDED ||
	       p->icmp_type == ICMP_PARAMETERPROB;
}

/* IPv4 has no link-local ICMP the service path must leave alone (IPv6: neighbour
 * discovery, nat6.h); an echo request to a cluster IP is rejected as kube-proxy does. */
static __always_inline int icmp_link_local(const struct pkt *p)
{
	return 0;
}

/* Rewrite the header an ICMP error quotes to s:sp -> d:dp. The ICMP checksum covers
 * the quote, so it follows every word changed in it: ports, addresses, the quoted IP
 * checksum and the quoted L4 checksum (`l4c`, when the quote reaches it). */
static __always_inline void icmp_quote_rewrite(struct icmphdr *ih, struct iphdr *in, __u16 *in_ports,
					       __u16 *l4c, __be32 s, __be16 sp, __be32 d, __be16 dp)
{
	__u16 icsum = ih->checksum;
	__u16 old_ic = in->check;

	if (l4c) {
		__u16 old = *l4c;
		__u16 c = csum_update32(old, in->saddr, s);
		c = csum_update32(c, in->daddr, d);
		c = csum_update16(c, in_ports[0], sp);
		c = csum_update16(c, in_ports[1], dp);
		if (in->protocol == IPPROTO_UDP)
			c = udp_csum_fixup(c);
		*l4c = c;
		icsum = csum_update16(icsum, old, c);
	}
	icsum = csum_update16(icsum, in_ports[0], sp);
	icsum = csum_update16(icsum, in_ports[1], dp);
	in_ports[0] = sp;
	in_ports[1] = dp;
	in->check = csum_update32(csum_update32(in->check, in->saddr, s), in->daddr, d);
	icsum = csum_update16(icsum, old_ic, in->check);
	icsum = csum_update32(icsum, in->saddr, s);
	icsum = csum_update32(icsum, in->daddr, d);
	in->saddr = s;
	in->daddr = d;
	ih->checksum = icsum;
}

static __always_inline void ip_set_addr(struct iphdr *ip, __be32 *field, __be32 to)
{
	ip->check = csum_update32(ip->check, *field, to);
	*field = to;
}

/* Translate an ICMP error: its quote to s:sp -> d:dp, and the outer addresses that name a
 * party of the quote (the error's sender or target, never a router on the way) with it:
 * the quote's old source becomes s, its old destination d. */
static __always_inline void icmp_translate(struct iphdr *ip, struct icmphdr *ih, struct iphdr *in,
					   __u16 *in_ports, __u16 *l4c, __be32 s, __be16 sp, __be32 d, __be16 dp)
{
	__be32 old_s = in->saddr, old_d = in->daddr;

	icmp_quote_rewrite(ih, in, in_ports, l4c, s, sp, d, dp);
	if (ip->daddr == old_s)
		ip_set_addr(ip, &ip->daddr, s);
	if (ip->saddr == old_d)
		ip_set_addr(ip, &ip->saddr, d);
}

/* ICMP error about a tracked flow (destination unreachable, fragmentation needed, time
 * exceeded, parameter problem): the quote is one of the flow's packets as the far side
 * saw it, and is translated to what the other side knows, as Linux conntrack's NAT
 * does for kube-proxy:
 *  - a quoted reply front:port -> client (the client, or a router on its way, complains
 *    about a reply): the error goes on to the backend, quote backend -> src;
 *  - a quoted forward packet src -> backend (the backend, a router on its way, or this
 *    node itself at tc egress, e.g. "fragmentation needed" for path MTU discovery):
 *    the error goes back to the client, quote client -> front:port.
 * The outer header changes only where it names a translated party (the error's sender
 * or target), never a router's address. Everything is bounded by the outer IP total
 * length: bytes after it (Ethernet padding) are not part of the message.
 * Returns 1 when translated, 0 when not ours (passed untouched). */
static __always_inline int icmp_error_nat(void *data, void *data_end, const struct pkt *p, __u32 now)
{
	struct iphdr *ip = data + ETH_HLEN_;
	struct icmphdr *ih;
	struct iphdr *in;
	__u16 *in_ports;
	__u16 *l4c;
	void *end;

	if (!icmp_is_error(p))
		return 0;
	if ((void *)(ip + 1) > data_end)
		return 0;
	end = (void *)ip + kx_ntohs_len(ip->tot_len);
	ih = (void *)ip + ip->ihl * 4;
	in = (void *)(ih + 1);
	if ((void *)(in + 1) > data_end || (void *)(in + 1) > end || in->ihl < 5)
		return 0;
	if (!kx_proto_served(in->protocol))
		return 0;
	in_ports = (void *)in + in->ihl * 4;
	if ((void *)(in_ports + 2) > data_end || (void *)(in_ports + 2) > end)
		return 0;
	l4c = quoted_l4_csum(in->protocol, in_ports, data_end, end, 1);

	/* A quoted reply front:port -> client: the client's flow to that frontend. */
	struct lb_config *cfg = lb_config_get();
	struct ct_flow *f = ct_forward(in->daddr, in_ports[1], in->protocol, in->saddr, in_ports[0], now);
	if (f) {
		__be32 src = (f->claim & KXLB_CT_F_SNAT) && cfg ? cfg->snat_addr : in->daddr;

		icmp_translate(ip, ih, in, in_ports, l4c, f->backend_addr, f->backend_port, src, f->src_port);
		svc_account(f->svc_id, KXLB_CT_DIR_FWD, p->len, 0);
		return 1;
	}
	/* A quoted forward packet src:port -> backend:port: the flow whose reply would be its
	 * reverse. */
	struct ct_key client;
	f = ct_reply(in->daddr, in_ports[1], in->saddr, in_ports[0], in->protocol, cfg, now, &client);
	if (!f)
		return 0;
	icmp_translate(ip, ih, in, in_ports, l4c, client.addr, client.port, f->front_addr, ct_front_port(f));
	svc_account(f->svc_id, KXLB_CT_DIR_REV, p->len, 0);
	return 1;
}

#endif
