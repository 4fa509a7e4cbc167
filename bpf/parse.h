/* SPDX-License-Identifier: GPL-2.0 */
/* Read-only parsing of Ethernet + IPv4 + TCP/UDP/ICMP into struct pkt. Nothing here
 * writes: a packet that fails any check is passed untouched by the caller. */
#ifndef KXLB_PARSE_H
#define KXLB_PARSE_H
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/tcp.h>
#include <uapi/linux/udp.h>
#include <uapi/linux/icmp.h>
#include "endian.h"

#define ETH_HLEN_ 14
#define IP_MF_ 0x2000
#define IP_OFFSET_ 0x1fff

#define TCP_FIN_ 0x01
#define TCP_SYN_ 0x02
#define TCP_RST_ 0x04
#define TCP_ACK_ 0x10

enum parse_result {
	PARSE_OK = 0,
	PARSE_NOT_IPV4,     /* another ethertype: not ours */
	PARSE_MALFORMED,    /* IPv4 that is truncated or inconsistent */
};

struct pkt {
	__u32  l3_off;      /* offset of the IPv4 header from data */
	__u32  l4_off;      /* offset of the L4 header (first fragment / unfragmented) */
	__u32  len;         /* bytes on the wire (for counters) */
	__be32 saddr;
	__be32 daddr;
	__be16 sport;       /* 0 when no L4 header (non-first fragment, ICMP) */
	__be16 dport;
	__be16 ip_id;
	__u8   proto;
	__u8   tcp_flags;
	__u8   frag;        /* 1: a fragment (MF set or offset != 0) */
	__u8   first_frag;  /* 1: carries the L4 header (offset 0) */
	__u8   icmp_type;
};

/* `len` is the packet's full length: at tc the payload may lie outside the linear
 * area that data..data_end covers (only the headers need to be there). */
static __always_inline int parse_ipv4(void *data, void *data_end, __u32 len, struct pkt *p)
{
	struct ethhdr *eth = data;
	struct iphdr *ip;
	__u32 ihl_bytes, tot_len;
	__u16 frag_off;

	if ((void *)(eth + 1) > data_end)
		return PARSE_NOT_IPV4;
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return PARSE_NOT_IPV4;

	ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end)
		return PARSE_MALFORMED;
	if (ip->version != 4 || ip->ihl < 5)
		return PARSE_MALFORMED;
	ihl_bytes = ip->ihl * 4;
	tot_len = bpf_ntohs(ip->tot_len);
	/* The IP header (options included) must be all there, and the datagram must not
	 * claim more bytes than arrived (trailing Ethernet padding is fine). */
	if ((void *)ip + ihl_bytes > data_end || tot_len < ihl_bytes || tot_len > len - ETH_HLEN_)
		return PARSE_MALFORMED;

	p->l3_off = ETH_HLEN_;
	p->l4_off = ETH_HLEN_ + ihl_bytes;
	p->saddr = ip->saddr;
	p->daddr = ip->daddr;
	p->proto = ip->protocol;
	p->ip_id = ip->id;
	p->sport = 0;
	p->dport = 0;
	p->tcp_flags = 0;
	p->icmp_type = 0;
	frag_off = bpf_ntohs(ip->frag_off);
	p->frag = (frag_off & (IP_MF_ | IP_OFFSET_)) != 0;
	p->first_frag = (frag_off & IP_OFFSET_) == 0;
	if (!p->first_frag)
		return PARSE_OK; /* no L4 header here: handled through frag_map */

	void *l4 = (void *)ip + ihl_bytes;
	/* The L4 header must lie inside the datagram (tot_len), not merely inside the frame:
	 * bytes after tot_len are Ethernet padding, which the receiver trims. A TCP header
	 * whose data offset runs past the segment is cut too (the kernel drops it). */
	void *dgram_end = (void *)ip + tot_len;
	if (p->proto == IPPROTO_TCP) {
		struct tcphdr *th = l4;
		if ((void *)(th + 1) > data_end || (void *)(th + 1) > dgram_end || th->doff < 5 ||
		    l4 + th->doff * 4 > dgram_end)
			return PARSE_MALFORMED;
		p->sport = th->source;
		p->dport = th->dest;
		p->tcp_flags = ((__u8 *)th)[13];
	} else if (p->proto == IPPROTO_UDP) {
		struct udphdr *uh = l4;
		if ((void *)(uh + 1) > data_end || (void *)(uh + 1) > dgram_end)
			return PARSE_MALFORMED;
		p->sport = uh->source;
		p->dport = uh->dest;
	} else if (p->proto == IPPROTO_ICMP) {
		struct icmphdr *ih = l4;
		if ((void *)(ih + 1) > data_end || (void *)(ih + 1) > dgram_end)
			return PARSE_MALFORMED;
		p->icmp_type = ih->type;
	}
	return PARSE_OK;
}

#endif
