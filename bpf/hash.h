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

/* A 32-bit value mapped onto 0..n-1 by a multiply and a shift (Lemire's "fast range"),
 * for n >= 1: as even as h % n for a uniform h, without a division. BPF has one divide
 * instruction, which clang emits 64 bits wide here (no alu32: bcc's default) and the JIT
 * turns into a 64-bit `div`: tens of cycles on most x86 cores, several per new flow
 * (the Maglev entry, its chunk, each masquerade port tried). It takes the high bits of h,
 * so h must be mixed in all of them (flow_hash, bpf_get_prandom_u32). */
static __always_inline __u32 kx_range(__u32 h, __u32 n)
{
	return (__u32)(((__u64)h * n) >> 32);
}

#endif
