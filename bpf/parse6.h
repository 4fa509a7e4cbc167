/* SPDX-License-Identifier: GPL-2.0 */
/* Read-only parsing of Ethernet + IPv6 (extension headers walked) + TCP/UDP/SCTP/ICMPv6 into
 * struct pkt6, the IPv6 twin of parse.h's struct pkt (same field names, so the journey
 * of flow.tmpl.h reads both). Nothing here writes. */
#ifndef KXLB_PARSE6_H
#define KXLB_PARSE6_H
#include <uapi/linux/ipv6.h>
#include "maps.h"
#include "parse.h"


/* Next-header values (uapi/linux/in6.h names, which that header guards awkwardly). */
#define IPPROTO_HOPOPTS_  0
#define IPPROTO_ROUTING_  43
#define IPPROTO_FRAGMENT_ 44
#define IPPROTO_AH_       51
#define IPPROTO_ICMPV6_   58
#define IPPROTO_NONE_     59
#define IPPROTO_DSTOPTS_  60

#define IP6_HLEN_ 40
/* Extension headers walked before the L4 header; a packet with more is passed
 * untouched. Linux's own limit is larger, but a service packet carries none or one. */
#define IP6_MAX_EXT 4
/* Offset of the L4 header from the frame's start is at most this (the walk stops
 * otherwise): bounds the variable offsets the verifier must accept. */
#define IP6_MAX_L4_OFF 256

/* ICMPv6 types (RFC 4443; neighbour discovery RFC 4861). Errors are types < 128. */
#define ICMPV6_DEST_UNREACH_   1
#define ICMPV6_PKT_TOOBIG_     2
#define ICMPV6_TIME_EXCEED_    3
#define ICMPV6_PARAMPROB_      4
#define ICMPV6_ECHO_REQUEST_   128
#define ICMPV6_ECHO_REPLY_     129
#define ICMPV6_PORT_UNREACH_   4   /* code of a destination unreachable */

struct pkt6 {
	__u32  l3_off;      /* offset of the IPv6 header from data */
	__u32  l4_off;      /* offset of the L4 header (after the extension headers) */
	__u32  len;         /* bytes on the wire (for counters) */
	struct kx_in6 saddr;
	struct kx_in6 daddr;
	__be16 sport;       /* 0 when no L4 header (non-first fragment, ICMPv6) */
	__be16 dport;
	__be32 ip_id;       /* the fragment header's identification (0: none) */
	__u8   proto;       /* the upper-layer protocol, after the extension headers */
	__u8   tcp_flags;
	__u8   frag;        /* 1: a fragment (M set or offset != 0); an atomic fragment is not */
	__u8   first_frag;  /* 1: carries the L4 header (offset 0) */
	__u8   icmp_type;
};

struct ip6_ext_ {
	__u8 nexthdr;
	__u8 hdrlen;        /* in 8-byte units, not counting the first 8 */
	__u8 type;          /* routing header: routing type */
	__u8 segments_left; /* routing header */
};

struct ip6_frag_ {
	__u8   nexthdr;
	__u8   reserved;
	__be16 frag_off;    /* offset << 3 | M */
	__be32 identification;
};

/* `len` is the packet's full length (at tc the payload may lie outside the linear
 * area). A datagram that claims more than arrived, a jumbogram (payload length 0 with a
 * hop-by-hop jumbo option), and extension headers beyond IP6_MAX_EXT are malformed for
 * us: passed untouched. A routing header with segments left means the packet is still
 * on its way to another hop (the destination address is not its final one), and AH
 * authenticates the addresses NAT would rewrite: both are not ours. */
static __always_inline int parse_ip6(void *data, void *data_end, __u32 len, struct pkt6 *p)
{
	struct ethhdr *eth = data;
	struct ipv6hdr *ip6;
	__u32 plen, off;
	__u8 nexthdr;

	if ((void *)(eth + 1) > data_end)
		return PARSE_NOT_IP;
	if (eth->h_proto != bpf_htons(ETH_P_IPV6))
		return PARSE_NOT_IP;
	ip6 = (void *)(eth + 1);
	if ((void *)(ip6 + 1) > data_end)
		return PARSE_MALFORMED;
	if (ip6->version != 6)
		return PARSE_MALFORMED;
	plen = kx_ntohs_len(ip6->payload_len);
	if (plen == 0 || plen > len - ETH_HLEN_ - IP6_HLEN_)
		return PARSE_MALFORMED;

	p->l3_off = ETH_HLEN_;
	__builtin_memcpy(&p->saddr, &ip6->saddr, 16);
	__builtin_memcpy(&p->daddr, &ip6->daddr, 16);
	p->sport = 0;
	p->dport = 0;
	p->ip_id = 0;
	p->tcp_flags = 0;
	p->icmp_type = 0;
	p->frag = 0;
	p->first_frag = 1;

	void *dgram_end = (void *)(ip6 + 1) + plen;
	nexthdr = ip6->nexthdr;
	off = ETH_HLEN_ + IP6_HLEN_;
#pragma unroll
	for (int i = 0; i < IP6_MAX_EXT; i++) {
		if (nexthdr == IPPROTO_FRAGMENT_) {
			struct ip6_frag_ *fh = data + off;
			if ((void *)(fh + 1) > data_end || (void *)(fh + 1) > dgram_end)
				return PARSE_MALFORMED;
			__u16 fo = bpf_ntohs(fh->frag_off);
			p->frag = (fo & 0xfff9) != 0;        /* offset or M: RFC 6946 atomic ones are whole */
			p->first_frag = (fo & 0xfff8) == 0;
			p->ip_id = fh->identification;
			nexthdr = fh->nexthdr;
			off += sizeof(*fh);
			if (!p->first_frag) {
				p->proto = nexthdr;
				p->l4_off = off;
				return PARSE_OK; /* no L4 header here: handled through frag_map6 */
			}
			continue;
		}
		if (nexthdr != IPPROTO_HOPOPTS_ && nexthdr != IPPROTO_ROUTING_ && nexthdr != IPPROTO_DSTOPTS_)
			break;
		struct ip6_ext_ *eh = data + off;
		if ((void *)(eh + 1) > data_end || (void *)(eh + 1) > dgram_end)
			return PARSE_MALFORMED;
		if (nexthdr == IPPROTO_ROUTING_ && eh->segments_left)
			return PARSE_NOT_OURS;
		nexthdr = eh->nexthdr;
		off += (eh->hdrlen + 1) * 8;
		if (off > IP6_MAX_L4_OFF)
			return PARSE_MALFORMED;
	}
	if (nexthdr == IPPROTO_AH_)
		return PARSE_NOT_OURS;
	if (nexthdr == IPPROTO_HOPOPTS_ || nexthdr == IPPROTO_ROUTING_ || nexthdr == IPPROTO_DSTOPTS_ ||
	    nexthdr == IPPROTO_FRAGMENT_)
		return PARSE_MALFORMED; /* more extension headers than we walk */
	if (off > IP6_MAX_L4_OFF)
		return PARSE_MALFORMED;
	p->proto = nexthdr;
	p->l4_off = off;

	return parse_l4(data + off, data_end, dgram_end, nexthdr, IPPROTO_ICMPV6_, &p->sport, &p->dport,
			&p->tcp_flags, &p->icmp_type);
}

#endif
