/* SPDX-License-Identifier: GPL-2.0 */
/* IPv6 packet rewrites and ICMPv6 errors: the twin of nat.h. IPv6 has no header
 * checksum: an address change is covered by the L4 checksum alone (its pseudo-header),
 * and by the ICMPv6 checksum, which covers a pseudo-header too. The plan is applied
 * as nat.h applies it: tc through the checksum helpers (CHECKSUM_PARTIAL and COMPLETE
 * skbs), XDP by hand. */
#ifndef KXLB_NAT6_H
#define KXLB_NAT6_H
#include "maps.h"
#include "csum.h"
#include "addr6.h"
#include "parse6.h"
#include "lb.h"
#include "ct.h"
#include "tc_csum.h"
/* IPv6's instances of the templates this file builds on. */
#undef KX_FAM
#define KX_FAM 6
#include "lb.tmpl.h"
#include "ct.tmpl.h"
#include "plan.tmpl.h"

/* New checksum after a 16-byte address of the covered data changed from -> to. */
static __always_inline __u16 csum_update_in6(__u16 sum, const struct kx_in6 *from, const struct kx_in6 *to)
{
#pragma unroll
	for (int i = 0; i < 4; i++)
		sum = csum_update32(sum, from->w[i], to->w[i]);
	return sum;
}

/* tc: the L4 checksum through the helpers (one difference for both addresses, as the
 * pseudo-header sees them), then addresses and ports written directly. */
static __always_inline int nat_apply_tc6(struct __sk_buff *skb, const struct nat_plan6 *n)
{
	__u32 l4_off = n->l4_off;

	if (l4_off > IP6_MAX_L4_OFF)
		return -1;
	if (!kx6_eq(&n->saddr_old, &n->saddr_new) || !kx6_eq(&n->daddr_old, &n->daddr_new)) {
		__s64 d = kx_csum_diff((__be32 *)&n->saddr_old, 16, (__be32 *)&n->saddr_new, 16, 0);
		if (d >= 0)
			d = kx_csum_diff((__be32 *)&n->daddr_old, 16, (__be32 *)&n->daddr_new, 16, (__u32)d);
		if (d < 0)
			return -1;
		if (n->l4 && n->proto != IPPROTO_SCTP) {
			/* The L4 checksum covers the addresses (its pseudo-header). */
			if (tc_l4_csum(skb, n->proto, l4_off, 0, (__u32)d, 0, BPF_F_PSEUDO_HDR) < 0)
				return -1;
		}
		/* A CHECKSUM_COMPLETE skb's sum (a NIC that sums every packet) must end where
		 * the packet's bytes do:
		 *  - with an L4 checksum, the addresses' change and the checksum's cancel out,
		 *    but the helper took the change out of the sum as IPv4 needs it (there the
		 *    IP header checksum cancels the addresses). Adding it back undoes that on
		 *    every kernel; Linux 6.16's BPF_F_IPV6, which tells the helper, is not on
		 *    every node;
		 *  - SCTP has no pseudo-header, and a later fragment no L4 header: nothing in
		 *    the packet compensates the addresses' change, so the sum takes it.
		 * The helper does nothing for the other skbs (tests/test_prog_run_ipv6.py runs
		 * this with the kernel's CHECKSUM_COMPLETE test run, which checks the sum). */
		kx_csum_update(skb, (__u32)d);
	}
	if (n->l4 && n->proto != IPPROTO_SCTP) {
		if (tc_l4_csum(skb, n->proto, l4_off, n->sport_old, n->sport_new, 2, 0) < 0 ||
		    tc_l4_csum(skb, n->proto, l4_off, n->dport_old, n->dport_new, 2, 0) < 0)
			return -1;
	}
	/* The helpers invalidated packet pointers: take them again. */
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ipv6hdr *ip6 = data + ETH_HLEN_;

	if ((void *)(ip6 + 1) > data_end)
		return -1;
	__builtin_memcpy(&ip6->saddr, &n->saddr_new, 16);
	__builtin_memcpy(&ip6->daddr, &n->daddr_new, 16);
	if (n->l4) {
		/* Bounded again where it is used: the compiler keeps l4_off in a stack slot
		 * across the helper calls above, and Linux 6.1's verifier does not carry the
		 * first check over to that copy (it refused kxlb_tc6: "invalid access to
		 * packet"). Hidden from clang first, which would drop a check it proves. */
		asm volatile("" : "+r"(l4_off));
		if (l4_off > IP6_MAX_L4_OFF)
			return -1;
		__be16 *ports = data + l4_off;
		if ((void *)(ports + 2) > data_end)
			return -1;
		if (n->proto == IPPROTO_SCTP) {
			__s64 d = sctp_ports_rewrite(ports, data_end,
						     kx_ntohs_len(ip6->payload_len) + ETH_HLEN_ + IP6_HLEN_ - l4_off,
						     n->frag, n->sport_old, n->dport_old, n->sport_new, n->dport_new);
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

/* XDP: rewrite in place, the L4 checksum by hand. IPv6 UDP must carry a checksum: a
 * computed 0 is sent as 0xffff (udp_csum_fixup). */
static __always_inline int nat_apply_xdp6(void *data, void *data_end, const struct nat_plan6 *n)
{
	struct ipv6hdr *ip6 = data + ETH_HLEN_;
	__u32 l4_off = n->l4_off;
	__u16 *csum;

	if ((void *)(ip6 + 1) > data_end || l4_off > IP6_MAX_L4_OFF)
		return -1;
	if (n->l4 && n->proto == IPPROTO_SCTP) {
		if (sctp_ports_rewrite(data + l4_off, data_end,
				       kx_ntohs_len(ip6->payload_len) + ETH_HLEN_ + IP6_HLEN_ - l4_off, n->frag,
				       n->sport_old, n->dport_old, n->sport_new, n->dport_new) < 0)
			return -1;
	} else if (n->l4) {
		__be16 *ports = data + l4_off;
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
		__u16 c = csum_update_in6(*csum, &n->saddr_old, &n->saddr_new);
		c = csum_update_in6(c, &n->daddr_old, &n->daddr_new);
		c = csum_update16(c, n->sport_old, n->sport_new);
		c = csum_update16(c, n->dport_old, n->dport_new);
		*csum = n->proto == IPPROTO_UDP ? udp_csum_fixup(c) : c;
		ports[0] = n->sport_new;
		ports[1] = n->dport_new;
	}
	__builtin_memcpy(&ip6->saddr, &n->saddr_new, 16);
	__builtin_memcpy(&ip6->daddr, &n->daddr_new, 16);
	return 0;
}

/* The route lookup of a translated packet for its path MTU: nat.h pmtu_params() for
 * IPv6, where no router fragments (every packet is checked). */
static __always_inline __u32 pmtu_params6(struct bpf_fib_lookup *fl, void *data, void *data_end,
					  const struct nat_plan6 *n, __u32 *hdrs)
{
	struct ipv6hdr *ip6 = data + ETH_HLEN_;
	__u32 l4_off = n->l4_off;

	if ((void *)(ip6 + 1) > data_end || l4_off > IP6_MAX_L4_OFF)
		return 0;
	*hdrs = l4_off - ETH_HLEN_ + l4_hdr_len(data + l4_off, data_end, n->proto);
	fl->family = 10; /* AF_INET6 */
	__builtin_memcpy(fl->ipv6_src, &n->saddr_new, 16);
	__builtin_memcpy(fl->ipv6_dst, &n->daddr_new, 16);
	return IP6_HLEN_ + kx_ntohs_len(ip6->payload_len);
}

/* nat.h route_params() for IPv6. */
static __always_inline int route_params6(struct bpf_fib_lookup *fl, void *data, void *data_end,
					 struct kx_in6 was)
{
	struct ipv6hdr *ip6 = data + ETH_HLEN_;

	if ((void *)(ip6 + 1) > data_end)
		return -1;
	fl->family = 10; /* AF_INET6 */
	fl->l4_protocol = ip6->nexthdr;
	__builtin_memcpy(fl->ipv6_src, &ip6->saddr, 16);
	__builtin_memcpy(fl->ipv6_dst, &ip6->daddr, 16);
	return !kx6_eq((const struct kx_in6 *)fl->ipv6_dst, &was);
}

/* An ICMPv6 error message (types below 128, RFC 4443 2.1): never answered with another. */
static __always_inline int icmp_is_error6(const struct pkt6 *p)
{
	return p->icmp_type < 128;
}

/* ICMPv6 beyond echo (neighbour discovery, router discovery, MLD): link-local control
 * traffic, never a service's; passed untouched whatever it addresses. */
static __always_inline int icmp_link_local6(const struct pkt6 *p)
{
	return p->icmp_type > ICMPV6_ECHO_REPLY_;
}

/* Rewrite the IPv6 header an ICMPv6 error quotes to s:sp -> d:dp, and the ICMPv6
 * checksum `*ic` with every word changed in the quote (addresses, ports, the quoted L4
 * checksum `l4c` when the quote reaches it). */
static __always_inline void icmp6_quote_rewrite(__u16 *ic, struct ipv6hdr *in, __u16 *in_ports, __u16 *l4c,
						const struct kx_in6 *s, __be16 sp, const struct kx_in6 *d, __be16 dp)
{
	struct kx_in6 *is = (void *)&in->saddr, *id = (void *)&in->daddr;
	__u16 icsum = *ic;

	if (l4c) {
		__u16 old = *l4c;
		__u16 c = csum_update_in6(old, is, s);
		c = csum_update_in6(c, id, d);
		c = csum_update16(c, in_ports[0], sp);
		c = csum_update16(c, in_ports[1], dp);
		if (in->nexthdr == IPPROTO_UDP)
			c = udp_csum_fixup(c);
		*l4c = c;
		icsum = csum_update16(icsum, old, c);
	}
	icsum = csum_update16(icsum, in_ports[0], sp);
	icsum = csum_update16(icsum, in_ports[1], dp);
	in_ports[0] = sp;
	in_ports[1] = dp;
	icsum = csum_update_in6(icsum, is, s);
	icsum = csum_update_in6(icsum, id, d);
	*is = *s;
	*id = *d;
	*ic = icsum;
}

/* Translate an ICMPv6 error: its quote to s:sp -> d:dp, and the outer addresses that
 * name a party of the quote (never a router's): the quote's old source becomes s, its
 * old destination d. The ICMPv6 checksum covers the outer addresses (pseudo-header). */
static __always_inline void icmp6_translate(struct ipv6hdr *ip6, __u16 *ic, struct ipv6hdr *in, __u16 *in_ports,
					    __u16 *l4c, const struct kx_in6 *s, __be16 sp,
					    const struct kx_in6 *d, __be16 dp)
{
	struct kx_in6 old_s = *(struct kx_in6 *)&in->saddr, old_d = *(struct kx_in6 *)&in->daddr;
	struct kx_in6 *os = (void *)&ip6->saddr, *od = (void *)&ip6->daddr;

	icmp6_quote_rewrite(ic, in, in_ports, l4c, s, sp, d, dp);
	if (kx6_eq(od, &old_s)) {
		*ic = csum_update_in6(*ic, od, s);
		*od = *s;
	}
	if (kx6_eq(os, &old_d)) {
		*ic = csum_update_in6(*ic, os, d);
		*os = *d;
	}
}

/* ICMPv6 error about a tracked flow (destination unreachable, packet too big, time
 * exceeded, parameter problem), translated as nat.h icmp_error_nat() does for IPv4:
 * a quoted reply goes on to the backend, a quoted forward packet back to the client.
 * The quote must name TCP or UDP right after its IPv6 header (a quote with extension
 * headers is passed untouched). Returns 1 when translated, 0 when not ours. */
static __always_inline int icmp_error_nat6(void *data, void *data_end, const struct pkt6 *p, __u32 now)
{
	struct ipv6hdr *ip6 = data + ETH_HLEN_;
	__u32 l4_off = p->l4_off;
	__u16 *l4c;

	if (!icmp_is_error6(p) || l4_off > IP6_MAX_L4_OFF)
		return 0;
	if ((void *)(ip6 + 1) > data_end)
		return 0;
	void *end = (void *)(ip6 + 1) + kx_ntohs_len(ip6->payload_len);
	__u16 *ih = data + l4_off;               /* type, code, checksum, 4 bytes */
	struct ipv6hdr *in = (void *)(ih + 4);
	if ((void *)(in + 1) > data_end || (void *)(in + 1) > end)
		return 0;
	if (!kx_proto_served(in->nexthdr))
		return 0;
	__u16 *in_ports = (void *)(in + 1);
	if ((void *)(in_ports + 2) > data_end || (void *)(in_ports + 2) > end)
		return 0;
	l4c = quoted_l4_csum(in->nexthdr, in_ports, data_end, end, 0);

	/* A quoted reply front:port -> client: the client's flow to that frontend. */
	struct lb_config6 *cfg = lb_config_get6();
	struct kx_in6 qs = *(struct kx_in6 *)&in->saddr, qd = *(struct kx_in6 *)&in->daddr;
	struct ct_flow6 *f = ct_forward6(qd, in_ports[1], in->nexthdr, qs, in_ports[0], now);
	if (f) {
		const struct kx_in6 *src = (f->claim & KXLB_CT_F_SNAT) && cfg ? &cfg->snat_addr : &qd;

		icmp6_translate(ip6, &ih[1], in, in_ports, l4c, &f->backend_addr, f->backend_port, src, f->src_port);
		svc_account(f->svc_id, KXLB_CT_DIR_FWD, p->len, 0);
		return 1;
	}
	/* A quoted forward packet src:port -> backend:port: the flow whose reply would be its
	 * reverse. */
	struct ct_key6 client;
	f = ct_reply6(qd, in_ports[1], qs, in_ports[0], in->nexthdr, cfg, now, &client);
	if (!f)
		return 0;
	icmp6_translate(ip6, &ih[1], in, in_ports, l4c, &client.addr, client.port, &f->front_addr,
			ct_front_port6(f));
	svc_account(f->svc_id, KXLB_CT_DIR_REV, p->len, 0);
	return 1;
}

#endif
