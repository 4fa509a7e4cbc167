/* SPDX-License-Identifier: GPL-2.0 */
/* kxlb datapath: service DNAT with conntrack and reverse NAT, for tc (clsact ingress)
 * and XDP, IPv4 and IPv6. Both hooks run lb_process() on the raw frame and only differ
 * in how they apply the rewrite it plans (nat.h, nat6.h). The journey is written once
 * (flow.tmpl.h) and instantiated per address family: each family has its own maps
 * (maps.h) and the same steps.
 *
 * A packet's journey:
 *   parse (Ethernet/IPv4 or IPv6/L4; anything odd is passed untouched)
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
#include "addr6.h"
#include "parse.h"
#include "parse6.h"
#include "lb.h"
#include "ct.h"

/* The journey of each family (flow.tmpl.h, which brings in what it builds on): IPv4,
 * then IPv6 with its own parsing, rewrites and reject. */
#define KX_FAM 4
#include "flow.tmpl.h"
#undef KX_FAM
#define KX_FAM 6
#include "flow.tmpl.h"

/* The bytes tc must find in the linear area (data..data_end) for this frame's journey:
 * its headers up to the ports and TCP flags, and for an ICMP(v6) error or an IPv6
 * extension header chain, KXLB_LINEAR (the quote of a second IP header and its ports).
 * Read with bpf_skb_load_bytes, which copies a few bytes and changes nothing: a segment
 * the node sends carries its headers linear and its payload in pages, and pulling
 * KXLB_LINEAR bytes of it for every segment (kxlb 0.1) reallocated and copied the head of
 * every non-linear skb through a hooked device, service traffic or not. */
static __always_inline __u32 tc_headers_len(struct __sk_buff *skb)
{
	struct {
		struct ethhdr eth;
		__u8 l3[20]; /* IPv4's fixed header, or IPv6's first 20 bytes (next header at 6) */
	} h;

	if (bpf_skb_load_bytes(skb, 0, &h, sizeof(h)) < 0)
		return skb->len; /* shorter than that: all of it (a few bytes) */
	if (h.eth.h_proto == bpf_htons(ETH_P_IP)) {
		__u32 l4 = ETH_HLEN_ + (h.l3[0] & 0xf) * 4;
		switch (h.l3[9]) {
		case IPPROTO_TCP: return l4 + 20;
		case IPPROTO_UDP: return l4 + 8;
		case IPPROTO_SCTP: return l4 + SCTP_HLEN_;
		case IPPROTO_ICMP: return KXLB_LINEAR;
		default: return l4;
		}
	}
	if (h.eth.h_proto == bpf_htons(ETH_P_IPV6)) {
		switch (h.l3[6]) {
		case IPPROTO_TCP: return ETH_HLEN_ + 40 + 20;
		case IPPROTO_UDP: return ETH_HLEN_ + 40 + 8;
		case IPPROTO_SCTP: return ETH_HLEN_ + 40 + SCTP_HLEN_;
		default: return KXLB_LINEAR; /* ICMPv6, extension headers */
		}
	}
	return ETH_HLEN_;
}

/* Make the frame's headers linear for direct access, pulling only when they are not
 * (tc_headers_len). Returns the frame's ethertype (0: none). */
static __always_inline __be16 tc_linear_ethertype(struct __sk_buff *skb)
{
#ifdef KXLB_PULL_ALWAYS
	/* kxlb 0.1's pull, KXLB_LINEAR bytes of every non-linear skb: only for bench/veth.py,
	 * which measures what the pull below saves. Never in a build kxlb loads. */
	if (skb->data_end - skb->data < KXLB_LINEAR && skb->len > skb->data_end - skb->data)
		bpf_skb_pull_data(skb, skb->len < KXLB_LINEAR ? skb->len : KXLB_LINEAR);
#else
	__u32 linear = skb->data_end - skb->data;

	if (skb->len > linear) {
		__u32 need = tc_headers_len(skb);

		if (need > skb->len)
			need = skb->len;
		if (need > linear)
			bpf_skb_pull_data(skb, need);
	}
#endif
	struct ethhdr *eth = (void *)(long)skb->data;
	if ((void *)(eth + 1) > (void *)(long)skb->data_end)
		return 0;
	return eth->h_proto;
}

/* IPv6 frames go on in programs of their own, by tail call (as Cilium splits its
 * families): each family's journey then has the 512-byte stack to itself, which the two
 * inlined into one program would exceed. The program arrays are pinned with the maps,
 * so the IPv6 programs stay in them when the loader exits. An empty slot (a loader that
 * did not fill it) makes the tail call fall through: the frame is passed untouched. */
BPF_TABLE_PINNED("prog", __u32, __u32, tc_progs, KXLB_PROG_MAX, KXLB_PIN_DIR "/tc_progs");
BPF_TABLE_PINNED("prog", __u32, __u32, xdp_progs, KXLB_PROG_MAX, KXLB_PIN_DIR "/xdp_progs");

int kxlb_tc(struct __sk_buff *skb)
{
	__be16 proto = tc_linear_ethertype(skb);

	if (proto == bpf_htons(ETH_P_IP))
		return lb_tc(skb);
	if (proto == bpf_htons(ETH_P_IPV6)) {
		tc_progs.call(skb, KXLB_PROG_IPV6);
		stat_inc(KXLB_ST_NO_PROG);
		return TC_ACT_UNSPEC;
	}
	stat_inc(KXLB_ST_NOT_IP);
	return TC_ACT_UNSPEC;
}

int kxlb_tc6(struct __sk_buff *skb)
{
	return lb_tc6(skb);
}

int kxlb_tc_egress(struct __sk_buff *skb)
{
	__be16 proto = tc_linear_ethertype(skb);

	if (proto == bpf_htons(ETH_P_IP))
		return lb_tc_egress(skb);
	if (proto == bpf_htons(ETH_P_IPV6))
		return lb_tc_egress6(skb); /* small enough to share the program with IPv4's */
	return TC_ACT_UNSPEC;
}

int kxlb_xdp(struct xdp_md *ctx)
{
	struct ethhdr *eth = (void *)(long)ctx->data;

	if ((void *)(eth + 1) > (void *)(long)ctx->data_end) {
		stat_inc(KXLB_ST_NOT_IP);
		return XDP_PASS;
	}
	if (eth->h_proto == bpf_htons(ETH_P_IP))
		return lb_xdp(ctx);
	if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		xdp_progs.call(ctx, KXLB_PROG_IPV6);
		stat_inc(KXLB_ST_NO_PROG);
		return XDP_PASS;
	}
	stat_inc(KXLB_ST_NOT_IP);
	return XDP_PASS;
}

int kxlb_xdp6(struct xdp_md *ctx)
{
	return lb_xdp6(ctx);
}
