/* SPDX-License-Identifier: GPL-2.0 */
/* Reject: a new flow to a service without any endpoint is answered with ICMP port
 * unreachable from the VIP, as kube-proxy's reject rule does, so clients fail at once
 * (TCP: ECONNREFUSED) instead of retrying into silence. The reply is built in the
 * packet's own buffer and sent back out of the interface it came in on.
 * The same reply, as "fragmentation needed" with the path's MTU, answers a masqueraded
 * packet too big for the path to its backend (flow.tmpl.h masq_path_mtu). */
#ifndef KXLB_REJECT_H
#define KXLB_REJECT_H
#include "csum.h"
#include "parse.h"

#define REJECT_QUOTE 28                               /* the IP header (no options) + 8 bytes */
#define REJECT_LEN (ETH_HLEN_ + 20 + 8 + REJECT_QUOTE) /* the whole reply frame */

/* What the reply needs from the packet, saved before the buffer is resized. */
struct reject_info {
	__u8 client_mac[6];
	__u8 node_mac[6];
	__u8 quote[REJECT_QUOTE];
};

/* Save the packet's addresses and quote; 0, or -1 when it cannot be rejected (IP
 * options, or too short to quote 8 bytes of it). */
static __always_inline int reject_save(void *data, void *data_end, struct reject_info *ri)
{
	struct ethhdr *eth = data;
	struct iphdr *ip = data + ETH_HLEN_;

	if (data + ETH_HLEN_ + REJECT_QUOTE > data_end || ip->ihl != 5)
		return -1;
	__builtin_memcpy(ri->client_mac, eth->h_source, 6);
	__builtin_memcpy(ri->node_mac, eth->h_dest, 6);
	__builtin_memcpy(ri->quote, ip, REJECT_QUOTE);
	return 0;
}

/* The Internet checksum of n 16-bit words, on top of `seed` (a pseudo-header's sum). */
static __always_inline __u16 csum_of(__u32 seed, const __u16 *words, int n)
{
	__u32 sum = seed;

#pragma unroll
	for (int i = 0; i < n; i++)
		sum += words[i];
	return (__u16)~csum_fold32(sum);
}

/* Write the reply over a buffer of exactly REJECT_LEN bytes: port unreachable, or with
 * `mtu` non-zero, fragmentation needed (RFC 1191: the next-hop MTU in the low half of
 * the second word). */
static __always_inline int reject_build(void *data, void *data_end, const struct reject_info *ri, __u32 mtu)
{
	struct ethhdr *eth = data;
	struct iphdr *ip = data + ETH_HLEN_;
	struct icmphdr *ih = (void *)(ip + 1);
	const struct iphdr *orig = (const void *)ri->quote;

	if (data + REJECT_LEN > data_end)
		return -1;
	__builtin_memcpy(eth->h_dest, ri->client_mac, 6);
	__builtin_memcpy(eth->h_source, ri->node_mac, 6);
	eth->h_proto = bpf_htons(ETH_P_IP);

	ip->version = 4;
	ip->ihl = 5;
	ip->tos = 0xc0; /* as Linux sends ICMP errors */
	ip->tot_len = bpf_htons(REJECT_LEN - ETH_HLEN_);
	ip->id = 0;
	ip->frag_off = 0;
	ip->ttl = 64;
	ip->protocol = IPPROTO_ICMP;
	ip->saddr = orig->daddr; /* from the VIP */
	ip->daddr = orig->saddr;
	ip->check = 0;

	ih->type = ICMP_DEST_UNREACH;
	ih->code = mtu ? ICMP_FRAG_NEEDED : ICMP_PORT_UNREACH;
	ih->checksum = 0;
	ih->un.gateway = kx_htonl(mtu & 0xffff);
	__builtin_memcpy((void *)(ih + 1), ri->quote, REJECT_QUOTE);

	ip->check = csum_of(0, (const __u16 *)ip, 10);
	ih->checksum = csum_of(0, (const __u16 *)ih, (8 + REJECT_QUOTE) / 2);
	return 0;
}

#endif
