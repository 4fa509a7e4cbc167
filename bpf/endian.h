/* SPDX-License-Identifier: GPL-2.0 */
/* Byte order of the wire, for the packet headers (BCC gives no bpf_endian.h). */
#ifndef KXLB_ENDIAN_H
#define KXLB_ENDIAN_H

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define bpf_htons(x) __builtin_bswap16(x)
#define kx_htonl(x) __builtin_bswap32(x)
#else
#define bpf_htons(x) (x)
#define kx_htonl(x) (x)
#endif
#define bpf_ntohs(x) bpf_htons(x)

/* A 16-bit length field of a header in host order, for pointer arithmetic on the packet.
 * Older verifiers (Debian 12's 6.1 among them) lose a register's bounds through
 * a byte swap and then refuse to add it to a packet pointer ("math between pkt pointer and
 * register with unbounded min value"); the mask bounds it again. Clang knows a swapped u16
 * needs no mask and would drop it: the empty asm hides the value from it first. */
static __always_inline __u32 kx_ntohs_len(__u16 wire)
{
	__u32 v = bpf_ntohs(wire);

	asm volatile("" : "+r"(v));
	return v & 0xffff;
}

#endif
