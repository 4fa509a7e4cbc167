/* SPDX-License-Identifier: GPL-2.0 */
/* Reject, IPv6: a new flow to a service without any endpoint is answered with ICMPv6
 * destination unreachable, port unreachable (kube-proxy's icmp6-port-unreachable) from
 * the VIP. The IPv6 twin of reject.h: built in the packet's own buffer, sent back out
 * of the interface it came in on; with an MTU, "packet too big" (reject.h). */
#ifndef KXLB_REJECT6_H
#define KXLB_REJECT6_H
#include "csum.h"
#include "parse6.h"
#include "reject.h"

#define REJECT_QUOTE6 48                                      /* the IPv6 header + 8 bytes */
#define REJECT_LEN6 (ETH_HLEN_ + IP6_HLEN_ + 8 + REJECT_QUOTE6) /* the whole reply frame */

struct reject_info6 {
	__u8 client_mac[6];
	__u8 node_mac[6];
	__u8 quote[REJECT_QUOTE6];
};

/* Save the packet's addresses and quote; 0, or -1 when it is too short to quote. */
static __always_inline int reject_save6(void *data, void *data_end, struct reject_info6 *ri)
{
	struct ethhdr *eth = data;

	if (data + ETH_HLEN_ + REJECT_QUOTE6 > data_end)
		return -1;
	__builtin_memcpy(ri->client_mac, eth->h_source, 6);
	__builtin_memcpy(ri->node_mac, eth->h_dest, 6);
	__builtin_memcpy(ri->quote, data + ETH_HLEN_, REJECT_QUOTE6);
	return 0;
}

/* Write the reply over a buffer of exactly REJECT_LEN6 bytes: port unreachable, or with
 * `mtu` non-zero, packet too big (RFC 4443 3.2: the MTU in the second word). */
static __always_inline int reject_build6(void *data, void *data_end, const struct reject_info6 *ri, __u32 mtu)
{
	struct ethhdr *eth = data;
	struct ipv6hdr *ip6 = data + ETH_HLEN_;
	__u8 *ih = (void *)(ip6 + 1);
	const struct ipv6hdr *orig = (const void *)ri->quote;

	if (data + REJECT_LEN6 > data_end)
		return -1;
	__builtin_memcpy(eth->h_dest, ri->client_mac, 6);
	__builtin_memcpy(eth->h_source, ri->node_mac, 6);
	eth->h_proto = bpf_htons(ETH_P_IPV6);

	*(__be32 *)ip6 = kx_htonl(0x60000000); /* version 6, traffic class 0, no flow label */
	ip6->payload_len = bpf_htons(8 + REJECT_QUOTE6);
	ip6->nexthdr = IPPROTO_ICMPV6_;
	ip6->hop_limit = 64;
	__builtin_memcpy(&ip6->saddr, &orig->daddr, 16); /* from the VIP */
	__builtin_memcpy(&ip6->daddr, &orig->saddr, 16);

	ih[0] = mtu ? ICMPV6_PKT_TOOBIG_ : ICMPV6_DEST_UNREACH_;
	ih[1] = mtu ? 0 : ICMPV6_PORT_UNREACH_;
	*(__u16 *)(ih + 2) = 0;
	*(__u32 *)(ih + 4) = kx_htonl(mtu);
	__builtin_memcpy(ih + 8, ri->quote, REJECT_QUOTE6);

	/* The checksum covers a pseudo-header (RFC 8200 8.1): the upper-layer length and the
	 * next header, and both addresses, which lie right before the message. */
	*(__u16 *)(ih + 2) = csum_of(bpf_htons(8 + REJECT_QUOTE6) + bpf_htons(IPPROTO_ICMPV6_),
				     (const __u16 *)&ip6->saddr, (32 + 8 + REJECT_QUOTE6) / 2);
	return 0;
}

#endif
