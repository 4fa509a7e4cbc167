/* SPDX-License-Identifier: GPL-2.0 */
/* SCTP (RFC 9260) for both families. Its 12-byte common header has the source and
 * destination ports where TCP and UDP have them, then a verification tag and a CRC32c.
 * The CRC covers the SCTP packet alone, no pseudo-header: translating addresses needs no
 * L4 checksum work at all, but translating a port (a NodePort, a targetPort that is not
 * the port, a masquerade port) changes what the CRC covers, and BPF has no CRC32c helper.
 *
 * Recomputing the CRC over the payload is not needed. A CRC is linear over GF(2): for two
 * messages of the same length, crc(M ^ D) = crc(M) ^ crc0(D), where crc0 is the CRC with
 * no initial value and no final inversion. A port change is a D that is zero outside the
 * first four bytes, and crc0 of such a D over an n-byte packet is d * x^(8n) mod P, with d
 * those four bytes read as a (bit-reflected) polynomial: one table read (x^(8n) for each
 * n, filled by the loader) and 32 shifts and XORs, whatever the payload (zlib's
 * crc32_combine joins two CRCs the same way).
 *
 * Cilium's SCTP (beta) rewrites addresses only and drops a Service whose targetPort
 * differs from its port; kube-proxy (netfilter's SCTP NAT) rewrites ports too, and so
 * does this. */
#ifndef KXLB_SCTP_H
#define KXLB_SCTP_H
#include <linux/types.h>
#include "maps.h"

#ifndef IPPROTO_SCTP
#define IPPROTO_SCTP 132
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "sctp_crc_delta reads the ports and the CRC as little-endian words"
#endif

#define SCTP_HLEN_ 12
#define SCTP_CRC_OFF_ 8                  /* the CRC32c, stored little-endian */
#define CRC32C_POLY_ 0x82f63b78          /* Castagnoli, bit-reflected */

/* a * b mod P, both bit-reflected (bit 31 is x^0), as zlib's multmodp. Branch-free so that
 * the verifier walks one path through its 32 rounds; a loop, not unrolled: 32 unrolled
 * rounds inside the journey push the IPv4 tc program's stack past BPF's 512 bytes. */
static __always_inline __u32 crc32c_mulmod(__u32 a, __u32 b)
{
	__u32 p = 0;

#pragma clang loop unroll(disable)
	for (int i = 0; i < 32; i++) {
		p ^= b & -((a >> (31 - i)) & 1);
		b = (b >> 1) ^ (CRC32C_POLY_ & -(b & 1));
	}
	return p;
}

#ifdef KXLB_DATAPATH
/* The change of the CRC of an SCTP packet of `len` bytes whose first four bytes (source
 * and destination port, as they lie in the packet) go from `old` to `new`: d * x^(8 len),
 * with x^(8 len) from the loader's table (maps.h sctp_crc_shift). Returns 0, or -1 when
 * the table has no entry for `len` (never filled: refused, never a wrong CRC). */
static __always_inline int sctp_crc_delta(__u32 old, __u32 new, __u32 len, __u32 *delta)
{
	__u32 *x8n = sctp_crc_shift.lookup(&len);

	if (!x8n || !*x8n) /* x^k mod P is never 0: a 0 is an entry nobody wrote */
		return -1;
	*delta = crc32c_mulmod(*x8n, old ^ new);
	return 0;
}

/* The ports as the little-endian word sctp_crc_delta() takes. */
static __always_inline __u32 sctp_ports_word(__be16 sport, __be16 dport)
{
	return (__u32)sport | ((__u32)dport << 16);
}

/* The new CRC field of an SCTP packet whose ports change, in *crc: a CRC field of 0 is
 * one the sender has not filled in yet (a Linux socket's packet on a device with SCTP CRC
 * offload, veth among them: CHECKSUM_PARTIAL, computed over the packet with the field at
 * 0 when it leaves through a device without the offload), so it must stay 0. A complete
 * CRC is 0 once in 2^32 packets; such a packet's CRC is left wrong and the receiver drops
 * it, as it would a corrupted one. Returns 0, or -1 (sctp_crc_delta). */
static __always_inline int sctp_crc_after(__u32 *crc, __be16 sport_old, __be16 dport_old, __be16 sport_new,
					  __be16 dport_new, __u32 len)
{
	__u32 delta;

	if (!*crc)
		return 0;
	if (sctp_crc_delta(sctp_ports_word(sport_old, dport_old), sctp_ports_word(sport_new, dport_new), len,
			   &delta) < 0)
		return -1;
	*crc ^= delta;
	return 0;
}

/* Rewrite an SCTP packet's ports and CRC in place (`l4`: its first byte; `len`: the SCTP
 * packet's length), for both hooks and families. Returns what the 16-bit ones'-complement
 * sum of its bytes changed by (tc adds it to a CHECKSUM_COMPLETE skb's sum: no checksum in
 * the packet compensates a CRC change), or -1 when the packet cannot be rewritten: its
 * header is not there, or it is the first fragment of a datagram whose ports change (the
 * CRC change needs the whole datagram's length, which the fragment does not say; sent on
 * untranslated it would be dropped by the backend anyway, so it is refused here). Works on
 * packet pointers, not the stack: the IPv4 tc journey is within bytes of BPF's 512. */
static __always_inline __s64 sctp_ports_rewrite(void *l4, void *data_end, __u32 len, __u8 frag,
						__be16 sport_old, __be16 dport_old, __be16 sport_new,
						__be16 dport_new)
{
	__be16 *ports = l4;
	__u32 *field = l4 + SCTP_CRC_OFF_;
	__u32 crc_old, crc, d;

	if (l4 + SCTP_HLEN_ > data_end)
		return -1;
	if (sport_old == sport_new && dport_old == dport_new)
		return 0;
	if (frag)
		return -1;
	crc = crc_old = *field;
	if (sctp_crc_after(&crc, sport_old, dport_old, sport_new, dport_new, len) < 0)
		return -1;
	ports[0] = sport_new;
	ports[1] = dport_new;
	*field = crc;
	/* The words as they lie in memory: new ones added, old ones subtracted (added
	 * complemented), folded to 16 bits. */
	d = (__u16)~sport_old + (__u32)sport_new + (__u16)~dport_old + (__u32)dport_new +
	    (__u16)~crc_old + (crc & 0xffff) + (__u16)~(crc_old >> 16) + (crc >> 16);
	d = (d & 0xffff) + (d >> 16);
	d = (d & 0xffff) + (d >> 16);
	return d;
}
#endif /* KXLB_DATAPATH */

#endif
