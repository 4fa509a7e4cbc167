/* SPDX-License-Identifier: GPL-2.0 */
/* Flow hash for backend selection: Bob Jenkins' lookup3 final mix over the 4-tuple.
 * Every node computes the same value for the same flow (fixed seed). */
#ifndef KXLB_HASH_H
#define KXLB_HASH_H

static __always_inline __u32 kx_rol32(__u32 w, unsigned int s)
{
	return (w << s) | (w >> (32 - s));
}

static __always_inline __u32 flow_hash(__u32 a, __u32 b, __u32 c, __u32 seed)
{
	a += seed;
	b += seed;
	c += seed;
	c ^= b; c -= kx_rol32(b, 14);
	a ^= c; a -= kx_rol32(c, 11);
	b ^= a; b -= kx_rol32(a, 25);
	c ^= b; c -= kx_rol32(b, 16);
	a ^= c; a -= kx_rol32(c, 4);
	b ^= a; b -= kx_rol32(a, 14);
	c ^= b; c -= kx_rol32(b, 24);
	return c;
}

#endif
