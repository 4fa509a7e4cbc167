/* SPDX-License-Identifier: GPL-2.0 */
/* The address family of the templates (*.tmpl.h) that follow, set by `#define KX_FAM 4`
 * or `6` before this file is included. A template is written once for both families:
 *  - KX_(name) names the family's own struct, map or function: `name` for IPv4 and
 *    `name6` for IPv6 (svc_map / svc_map6, struct ct_key / struct ct_key6). The loader
 *    substitutes it in the text (loader/compile.py), not the preprocessor: BCC rewrites
 *    map calls only where they are written, never inside a macro;
 *  - kx_addr_t is the family's address type, and the KX_* operations below compare
 *    them (IPv6: addr6.h). Both families' structs have the same field names (maps.h).
 * Included by every template, at each include: no include guard. */
#include "maps.h"
#include "addr6.h"
#undef kx_addr_t
#undef KX_EQ
#undef KX_LT
#undef KX_ZERO
#undef KX_IN_NET
#undef KX_FOLD
#undef KX_DIFF
#undef KX_IPPROTO_ICMP
#undef KX_PMTU_FLOOR
#if KX_FAM == 4
#define kx_addr_t __be32
#define KX_EQ(a, b) ((a) == (b))
#define KX_LT(a, b) ((a) < (b))
#define KX_ZERO(a) ((a) == 0)
#define KX_IN_NET(a, net, mask) (((a) & (mask)) == (net))
#define KX_FOLD(a) ((__u32)(a))
#define KX_DIFF(a, b) ((a) ^ (b)) /* nonzero iff a != b, without a branch */
#define KX_IPPROTO_ICMP IPPROTO_ICMP
#define KX_PMTU_FLOOR 576     /* a datagram every IPv4 path carries (RFC 1122 3.3.3) */
#elif KX_FAM == 6
#define kx_addr_t struct kx_in6
#define KX_EQ(a, b) kx6_eq(&(a), &(b))
#define KX_LT(a, b) kx6_lt(&(a), &(b))
#define KX_ZERO(a) kx6_zero(&(a))
#define KX_IN_NET(a, net, mask) kx6_in_net(&(a), &(net), &(mask))
#define KX_FOLD(a) kx6_fold(&(a))
#define KX_DIFF(a, b) kx6_diff(&(a), &(b))
#define KX_IPPROTO_ICMP IPPROTO_ICMPV6_
#define KX_PMTU_FLOOR 1280    /* IPv6's minimum link MTU (RFC 8200 5) */
#else
#error "KX_FAM must be 4 or 6"
#endif
