/* SPDX-License-Identifier: GPL-2.0 */
/* IPv6 addresses (struct kx_in6, four network-order words): the operations the
 * family-generic datapath (*.tmpl.h) needs, which IPv4 does with plain operators. */
#ifndef KXLB_ADDR6_H
#define KXLB_ADDR6_H
#include "maps.h"
#include "hash.h"

static __always_inline int kx6_eq(const struct kx_in6 *a, const struct kx_in6 *b)
{
	return ((a->w[0] ^ b->w[0]) | (a->w[1] ^ b->w[1]) | (a->w[2] ^ b->w[2]) | (a->w[3] ^ b->w[3])) == 0;
}

/* Nonzero iff a != b: the ORed differences of the words, no branch (sock.tmpl.h). */
static __always_inline __u32 kx6_diff(const struct kx_in6 *a, const struct kx_in6 *b)
{
	return (a->w[0] ^ b->w[0]) | (a->w[1] ^ b->w[1]) | (a->w[2] ^ b->w[2]) | (a->w[3] ^ b->w[3]);
}

static __always_inline int kx6_zero(const struct kx_in6 *a)
{
	return (a->w[0] | a->w[1] | a->w[2] | a->w[3]) == 0;
}

/* A fixed total order (conntrack's canonical REV key): word by word, each word's raw
 * value as IPv4 compares its one word. loader/conntrack.py uses the same order. */
static __always_inline int kx6_lt(const struct kx_in6 *a, const struct kx_in6 *b)
{
	if (a->w[0] != b->w[0])
		return a->w[0] < b->w[0];
	if (a->w[1] != b->w[1])
		return a->w[1] < b->w[1];
	if (a->w[2] != b->w[2])
		return a->w[2] < b->w[2];
	return a->w[3] < b->w[3];
}

/* addr & mask == net (a CIDR test; mask zero: an unused slot matches everything, so
 * callers check kx6_zero(mask) first where that matters). */
static __always_inline int kx6_in_net(const struct kx_in6 *a, const struct kx_in6 *net,
				      const struct kx_in6 *mask)
{
	return (((a->w[0] & mask->w[0]) ^ net->w[0]) | ((a->w[1] & mask->w[1]) ^ net->w[1]) |
		((a->w[2] & mask->w[2]) ^ net->w[2]) | ((a->w[3] & mask->w[3]) ^ net->w[3])) == 0;
}

/* 32 bits of the address for the flow hash (hash.h mixes them). */
static __always_inline __u32 kx6_fold(const struct kx_in6 *a)
{
	return a->w[0] ^ a->w[1] ^ kx_rol32(a->w[2], 7) ^ kx_rol32(a->w[3], 13);
}

#endif
