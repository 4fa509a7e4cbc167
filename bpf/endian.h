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

#endif
