/* SPDX-License-Identifier: GPL-2.0 */
/* Conntrack: pins a flow to the backend chosen for its first packet (maps.h ct_map, one
 * record per client socket, and masq_map, the masquerade port table).
 *
 * A flow is one way of its client socket's record: `claim` (frontend, state flags) and
 * the rest of struct ct_flow. Both directions of the flow read the same way, so they live
 * and die together; an LRU eviction takes the whole record. State flags go into `claim`
 * with an atomic OR, so two CPUs seeing a FIN and an RST at once lose neither.
 *
 * Lifetimes (consts.h) follow the state: a TCP flow is established only once its
 * handshake completed (a packet without SYN seen in each direction), so a half-open flow
 * (SYN and SYN-ACK, no ACK: a spoofed SYN) lives a minute, not six hours.
 *
 * The clock is CLOCK_MONOTONIC_COARSE (bpf_ktime_get_coarse_ns) counted in ticks of 2^30
 * ns: lifetimes are seconds, the coarse clock costs a fraction of the precise one, and a
 * tick is a shift away (no 64-bit division on the packet path). This header holds what
 * does not depend on the address family; the flows themselves are ct.tmpl.h's. */
#ifndef KXLB_CT_H
#define KXLB_CT_H
#include "maps.h"
#include "endian.h"
#include "hash.h"
#include "parse.h"
#include "lb.h"

static __always_inline __u32 ct_now(void)
{
	return bpf_ktime_get_coarse_ns() >> KXLB_TICK_SHIFT;
}

static __always_inline int ct_closing(__u64 flags)
{
	return (flags & KXLB_CT_F_RST) ||
	       (flags & (KXLB_CT_F_FIN_FWD | KXLB_CT_F_FIN_REV)) ==
		       (KXLB_CT_F_FIN_FWD | KXLB_CT_F_FIN_REV);
}

/* Confirmed both ways: TCP's handshake completed (a packet without SYN each way); UDP
 * answered, then spoken to again. A spoofed source never gets there. */
static __always_inline int ct_confirmed(__u8 proto, __u64 flags)
{
	if (proto == IPPROTO_TCP)
		return (flags & (KXLB_CT_F_FWD_ACK | KXLB_CT_F_REV_ACK)) == (KXLB_CT_F_FWD_ACK | KXLB_CT_F_REV_ACK);
	return (flags & (KXLB_CT_F_REPLIED | KXLB_CT_F_FWD_ACK)) == (KXLB_CT_F_REPLIED | KXLB_CT_F_FWD_ACK);
}

/* How many ticks a flow in this state lives after its last packet (consts.h). */
static __always_inline __u32 ct_lifetime(__u8 proto, __u64 flags)
{
	if (proto == IPPROTO_TCP) {
		if (ct_closing(flags))
			return KXLB_TICKS(KXLB_CT_TCP_CLOSE_S);
		if (ct_confirmed(proto, flags))
			return KXLB_TICKS(KXLB_CT_TCP_EST_S);
		return KXLB_TICKS(KXLB_CT_TCP_SYN_S);
	}
	return (flags & KXLB_CT_F_REPLIED) ? KXLB_TICKS(KXLB_CT_UDP_REPLIED_S) : KXLB_TICKS(KXLB_CT_UDP_S);
}

/* How long a masquerade port stays taken after its flow's last packet: the flow's
 * lifetime, and for TCP the backend's TIME_WAIT after it (a port reused sooner would meet
 * the old connection's 4-tuple there). */
static __always_inline __u32 masq_hold(__u8 proto, __u64 flags)
{
	return ct_lifetime(proto, flags) +
	       (proto == IPPROTO_TCP ? KXLB_TICKS(KXLB_CT_TCP_TIME_WAIT_S) : 0);
}

/* `t` is in the future of `now` (ticks wrap after 146 years; compared as a difference). */
static __always_inline int tick_after(__u32 t, __u32 now)
{
	return (__s32)(t - now) > 0;
}

/* New masqueraded flows on this CPU: how many this tick, and until when the node counts
 * as under a flood. More than KXLB_FLOOD_NEW_PER_TICK in one tick starts (or extends) a
 * flood period of a SYN's lifetime: while it lasts, a port search gives up looking for a
 * free port sooner (KXLB_FLOOD_FREE_TRIES) and takes back a port held by a half-open flow
 * (consts.h), so a flood's own packets cost little more with its half-open flows filling
 * the range. Counted per CPU (no shared cache line written on the path); the period, once
 * a CPU starts it, holds for every CPU (flood_until: written once per flood tick, read by
 * each new masqueraded flow), as a new connection may land on a CPU the flood missed. */
struct flood_count {
	__u32 tick;
	__u32 count;
};
BPF_PERCPU_ARRAY(flood_map, struct flood_count, 1);
BPF_ARRAY(flood_until, __u32, 1);

static __always_inline int masq_flood(__u32 now)
{
	__u32 zero = 0;
	struct flood_count *f = flood_map.lookup(&zero);
	__u32 *until = flood_until.lookup(&zero);

	if (!f || !until)
		return 0;
	if (f->tick != now) {
		f->tick = now;
		f->count = 0;
	}
	f->count += 1;
	if (f->count == KXLB_FLOOD_NEW_PER_TICK + 1) {
		*until = now + KXLB_TICKS(KXLB_CT_TCP_SYN_S);
		stat_inc(KXLB_ST_FLOOD);
	}
	return tick_after(*until, now);
}

#endif
