/* SPDX-License-Identifier: GPL-2.0 */
/* The address filters (maps.h front_filter, backend_filter): may this packet belong to a
 * service or a flow? "No" is certain, "maybe" sends it on to the hash lookups. Both
 * families share the bitmaps through their folded addresses (KX_FOLD); loader/filters.py
 * sets the bits with the same arithmetic. */
#ifndef KXLB_FILTER_H
#define KXLB_FILTER_H
#include "maps.h"

_Static_assert(KXLB_FRONT_FILTER_WORDS == 1 << (KXLB_FRONT_FILTER_LOG - 6), "front_filter: one bit per hash value");
_Static_assert(KXLB_BACKEND_FILTER_WORDS == 1 << (KXLB_BACKEND_FILTER_LOG - 6), "backend_filter: one bit per hash value");

/* Which steps of the journey a packet may need (flow.tmpl.h). */
#define MAY_TO_FRONT     0x1
#define MAY_FROM_BACKEND 0x2
#define MAY_TO_BACKEND   0x4

/* Fibonacci hashing: the top LOG bits of the product, which every input bit reaches
 * (addresses of one subnet differ in their low bits). */
static __always_inline __u32 filter_bit(__u32 folded, __be16 port, unsigned int log)
{
	return ((folded ^ ((__u32)port * KXLB_FILTER_PORT_MUL)) * KXLB_FILTER_MUL) >> (32 - log);
}

static __always_inline int filter_word_has(__u64 *word, __u32 bit)
{
	return word && ((*word >> (bit & 63)) & 1);
}

/* May this (address, port) be a backend's? Replies come from one, and a client's direct
 * traffic to a flow's backend goes to one. tc egress asks it alone of a packet the node
 * sends: a host-network backend's reply, from whichever local address the flow was sent
 * to. */
static __always_inline int filter_backend_has(__u32 folded, __be16 port)
{
	__u32 bit = filter_bit(folded, port, KXLB_BACKEND_FILTER_LOG), key = bit >> 6;

	return filter_word_has(backend_filter.lookup(&key), bit);
}

/* Which of the journey's steps a packet may need: MAY_* bits. */
static __always_inline __u8 filter_may(__u32 dst, __be16 dport, __u32 src, __be16 sport)
{
	__u32 bit = filter_bit(dst, 0, KXLB_FRONT_FILTER_LOG), key = bit >> 6;
	__u8 may = 0;

	if (filter_word_has(front_filter.lookup(&key), bit))
		may |= MAY_TO_FRONT;
	if (filter_backend_has(src, sport))
		may |= MAY_FROM_BACKEND;
	if (filter_backend_has(dst, dport))
		may |= MAY_TO_BACKEND;
	return may;
}

#endif
