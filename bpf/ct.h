/* SPDX-License-Identifier: GPL-2.0 */
/* Conntrack: pins a flow to the backend chosen for its first packet.
 *
 * A flow owns two ct_map entries with the same value (maps.h): FWD keyed as the client
 * sends, REV keyed by the translated 4-tuple in canonical order. The flow lives and
 * dies as one:
 *  - state: a packet that changes it (first reply, FIN, RST) ORs its flags into both
 *    entries atomically, so two CPUs seeing a FIN and an RST at once lose neither;
 *  - lifetime: an entry is live until last_ns + ct_lifetime(flags). A packet refreshes
 *    its own entry at most every KXLB_CT_REFRESH_S, and the peer entry with it: a flow
 *    that only sends one way keeps its reply entry, and the peer lookup tells the LRU
 *    that entry is in use;
 *  - eviction: if the LRU evicted the peer anyway, that refresh puts it back (the
 *    value is the whole flow), so a busy flow is repaired within a second.
 * The clock is CLOCK_MONOTONIC_COARSE (bpf_ktime_get_coarse_ns): lifetimes are seconds,
 * and the coarse clock costs a fraction of the precise one per packet.
 * This header holds what does not depend on the address family; the flow's entries
 * are handled in ct.tmpl.h, written once for IPv4 and IPv6. */
#ifndef KXLB_CT_H
#define KXLB_CT_H
#include "maps.h"
#include "endian.h"
#include "hash.h"
#include "parse.h"
#include "lb.h"

#define NSEC_PER_SEC_ 1000000000ull

static __always_inline __u64 ct_now(void)
{
	return bpf_ktime_get_coarse_ns();
}

static __always_inline int ct_closing(__u64 flags)
{
	return (flags & KXLB_CT_F_RST) ||
	       (flags & (KXLB_CT_F_FIN_FWD | KXLB_CT_F_FIN_REV)) ==
		       (KXLB_CT_F_FIN_FWD | KXLB_CT_F_FIN_REV);
}

/* How long a flow in this state lives after its last packet (consts.h). */
static __always_inline __u64 ct_lifetime_ns(__u8 proto, __u64 flags)
{
	__u32 s;

	if (proto == IPPROTO_TCP) {
		if (ct_closing(flags))
			s = KXLB_CT_TCP_CLOSE_S;
		else if (flags & KXLB_CT_F_REPLIED)
			s = KXLB_CT_TCP_EST_S;
		else
			s = KXLB_CT_TCP_SYN_S;
	} else {
		s = (flags & KXLB_CT_F_REPLIED) ? KXLB_CT_UDP_REPLIED_S : KXLB_CT_UDP_S;
	}
	return (__u64)s * NSEC_PER_SEC_;
}

#endif
