/* SPDX-License-Identifier: GPL-2.0 */
/* What to write into a packet: the decision (flow.tmpl.h) fills a plan, the hook applies
 * it (nat.h for IPv4, nat6.h for IPv6). A template (family.tmpl.h). */
#ifndef KX_(KXLB_PLAN_TMPL_H)
#define KX_(KXLB_PLAN_TMPL_H)
#include "family.tmpl.h"
#include "KX_(parse).h"


/* New source and destination (address and port). Fields whose new value equals the old
 * cost nothing. */
struct KX_(nat_plan) {
	__u32  l3_off;
	__u32  l4_off;
	kx_addr_t saddr_old, saddr_new;
	kx_addr_t daddr_old, daddr_new;
	__be16 sport_old, sport_new;
	__be16 dport_old, dport_new;
	__u8   proto;
	__u8   l4;         /* 1: ports and L4 checksum too; 0: addresses only (later fragment) */
	__u8   frag;       /* 1: the first fragment of a datagram (its full length is unknown) */
	__u8   masq;       /* 1: a forward packet given the masquerade address (the hook checks
			    * its path MTU: the kernel's own error would go to that address) */
};

/* Start a plan that changes nothing. */
static __always_inline void KX_(nat_plan_init)(struct KX_(nat_plan) *n, const struct KX_(pkt) *p)
{
	n->l3_off = p->l3_off;
	n->l4_off = p->l4_off;
	n->proto = p->proto;
	n->l4 = p->first_frag;
	n->frag = p->frag;
	n->masq = 0;
	n->saddr_old = n->saddr_new = p->saddr;
	n->daddr_old = n->daddr_new = p->daddr;
	n->sport_old = n->sport_new = p->sport;
	n->dport_old = n->dport_new = p->dport;
}

#endif
