/* SPDX-License-Identifier: GPL-2.0 */
/* Incremental Internet checksum updates (RFC 1624: HC' = ~(~HC + ~m + m')).
 * Used where the kernel keeps no checksum state of its own: XDP, and ICMP error
 * translation (whose edits are checksum-neutral as a whole, see nat.h). One's
 * complement sums are byte-order independent, so network-order words go in as-is. */
#ifndef KXLB_CSUM_H
#define KXLB_CSUM_H

static __always_inline __u16 csum_fold32(__u32 c)
{
	c = (c & 0xffff) + (c >> 16);
	c = (c & 0xffff) + (c >> 16);
	return (__u16)c;
}

/* New checksum after a 16-bit word of the covered data changed from -> to. */
static __always_inline __u16 csum_update16(__u16 sum, __u16 from, __u16 to)
{
	__u32 c = (__u16)~sum;
	c += (__u16)~from;
	c += to;
	return (__u16)~csum_fold32(c);
}

/* New checksum after a 32-bit word of the covered data changed from -> to. */
static __always_inline __u16 csum_update32(__u16 sum, __u32 from, __u32 to)
{
	__u32 c = (__u16)~sum;
	c += (__u16)~(from & 0xffff);
	c += (__u16)~(from >> 16);
	c += to & 0xffff;
	c += to >> 16;
	return (__u16)~csum_fold32(c);
}

/* UDP: a zero checksum means "none" and stays zero; a computed zero is sent as 0xffff. */
static __always_inline __u16 udp_csum_fixup(__u16 sum)
{
	return sum ? sum : 0xffff;
}

#endif
