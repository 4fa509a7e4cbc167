/* SPDX-License-Identifier: GPL-2.0 */
/* Read-only parsing of Ethernet + IPv4 + TCP/UDP/SCTP/ICMP into struct pkt (IPv6: parse6.h).
 * Nothing here writes: a packet that fails any check is passed untouched by the caller. */
#ifndef KXLB_PARSE_H
#define KXLB_PARSE_H
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/tcp.h>
#include <uapi/linux/udp.h>
#include <uapi/linux/icmp.h>
#include "endian.h"
#include "sctp.h"

#define ETH_HLEN_ 14
#define IP_DF_ 0x4000
#define IP_MF_ 0x2000
#define IP_OFFSET_ 0x1fff

#define TCP_FIN_ 0x01
#define TCP_SYN_ 0x02
#define TCP_RST_ 0x04
#define TCP_ACK_ 0x10

/* Bytes of a frame tc makes linear before parsing: Ethernet, IPv6 with a few extension
 * headers, and an ICMP error's quote of a second IP header and its ports. */
#define KXLB_LINEAR 192

enum parse_result {
	PARSE_OK = 0,
	PARSE_NOT_IP,       /* another ethertype: not ours */
	PARSE_MALFORMED,    /* truncated or inconsistent: passed untouched */
	PARSE_NOT_OURS,     /* well formed, but nothing a service proxy may touch (IPv6:
			     * a routing header with segments left, AH) */
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

/* The L4 header at `l4` of a datagram ending at `dgram_end`, for both families (`icmp`:
 * the family's ICMP protocol number; ICMP and ICMPv6 headers both start with the type
 * byte and take 8 bytes).
 * The header must lie inside the datagram, not merely inside the frame: bytes after it
 * are Ethernet padding, which the receiver trims. A TCP header whose data offset runs
 * past the segment is cut too (the kernel drops it). */
static __always_inline int parse_l4(void *l4, void *data_end, void *dgram_end, __u8 proto, __u8 icmp,
				    __be16 *sport, __be16 *dport, __u8 *tcp_flags, __u8 *icmp_type)
{
	if (proto == IPPROTO_TCP) {
		struct tcphdr *th = l4;
		if ((void *)(th + 1) > data_end || (void *)(th + 1) > dgram_end || th->doff < 5 ||
		    l4 + th->doff * 4 > dgram_end)
			return PARSE_MALFORMED;
		*sport = th->source;
		*dport = th->dest;
		*tcp_flags = ((__u8 *)th)[13];
	} else if (proto == IPPROTO_UDP) {
		struct udphdr *uh = l4;
		if ((void *)(uh + 1) > data_end || (void *)(uh + 1) > dgram_end)
			return PARSE_MALFORMED;
		*sport = uh->source;
		*dport = uh->dest;
	} else if (proto == IPPROTO_SCTP) {
		__be16 *sh = l4; /* ports, then the verification tag and the CRC (sctp.h) */
		if ((void *)sh + SCTP_HLEN_ > data_end || (void *)sh + SCTP_HLEN_ > dgram_end)
			return PARSE_MALFORMED;
		*sport = sh[0];
		*dport = sh[1];
	} else if (proto == icmp) {
		__u8 *ih = l4; /* the 8-byte header of ICMP and of ICMPv6 */
		if ((void *)(ih + 8) > data_end || (void *)(ih + 8) > dgram_end)
			return PARSE_MALFORMED;
		*icmp_type = ih[0];
	}
	return PARSE_OK;
}

/* The transport protocols a Service port can have, as kube-proxy serves them: TCP, UDP
 * and SCTP. Anything else to a service address is rejected or dropped (not_a_service). */
static __always_inline int kx_proto_served(__u8 proto)
{
	return proto == IPPROTO_TCP || proto == IPPROTO_UDP || proto == IPPROTO_SCTP;
}

/* The length of a parsed TCP, UDP or SCTP packet's L4 header at `l4` (a GRO segment's
 * headers, flow.tmpl.h masq_path_mtu). */
static __always_inline __u32 l4_hdr_len(void *l4, void *data_end, __u8 proto)
{
	if (proto == IPPROTO_TCP) {
		struct tcphdr *th = l4;
		if ((void *)(th + 1) > data_end)
			return 20;
		return th->doff * 4;
	}
	return proto == IPPROTO_UDP ? 8 : SCTP_HLEN_;
}

/* Where the L4 checksum of a header an ICMP error quotes lies, if the quote reaches it (it
 * may be cut short), else 0. `in_ports`: the quoted L4 header; `end`: the end of the
 * quote. UDP over IPv4 may say 0, "no checksum" (`v4`); IPv6 has no such value. SCTP's CRC
 * covers the whole quoted packet, which an error quotes in part: it stays as quoted (Linux
 * matches an SCTP error by its ports and verification tag, not by its CRC). */
static __always_inline __u16 *quoted_l4_csum(__u8 proto, __u16 *in_ports, void *data_end, void *end, int v4)
{
	if (proto == IPPROTO_UDP) {
		if ((void *)(in_ports + 4) <= data_end && (void *)(in_ports + 4) <= end && (!v4 || in_ports[3]))
			return &in_ports[3];
	} else if (proto == IPPROTO_TCP) {
		if ((void *)(in_ports + 9) <= data_end && (void *)(in_ports + 9) <= end)
			return &in_ports[8]; /* tcphdr.check at byte 16 */
	}
	return 0;
}

/* `len` is the packet's full length: at tc the payload may lie outside the linear
 * area that data..data_end covers (only the headers need to be there). */
static __always_inline int parse_ip(void *data, void *data_end, __u32 len, struct pkt *p)
{
	struct ethhdr *eth = data;
	struct iphdr *ip;
	__u32 ihl_bytes, tot_len;
	__u16 frag_off;

	if ((void *)(eth + 1) > data_end)
		return PARSE_NOT_IP;
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return PARSE_NOT_IP;

	ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end)
		return PARSE_MALFORMED;
	if (ip->version != 4 || ip->ihl < 5)
		return PARSE_MALFORMED;
	ihl_bytes = ip->ihl * 4;
	tot_len = kx_ntohs_len(ip->tot_len);
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

	return parse_l4((void *)ip + ihl_bytes, data_end, (void *)ip + tot_len, p->proto, IPPROTO_ICMP,
			&p->sport, &p->dport, &p->tcp_flags, &p->icmp_type);
}

#endif
