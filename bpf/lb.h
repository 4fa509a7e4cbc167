/* SPDX-License-Identifier: GPL-2.0 */
/* Services: what deciding a new flow needs that does not depend on the address family
 * (the decision itself: lb.tmpl.h), shared by tc, XDP and the socket hooks. */
#ifndef KXLB_LB_H
#define KXLB_LB_H
#include "maps.h"
#include "hash.h"

static __always_inline void stat_inc(__u32 idx)
{
	__u64 *v = dp_stats.lookup(&idx);
	if (v)
		*v += 1;
}

/* Per-service counters; per CPU, so plain adds. */
static __always_inline void svc_account(__u32 svc_id, __u8 dir, __u32 len, int new_flow)
{
	void *chunk = svc_stats.lookup(&svc_id);
	__u32 idx = svc_id % KXLB_STATS_CHUNK;
	struct svc_counters *c;

	if (!chunk)
		return;
	c = bpf_map_lookup_elem(chunk, &idx);
	if (!c)
		return;
	if (dir == KXLB_CT_DIR_FWD) {
		c->fwd_packets += 1;
		c->fwd_bytes += len;
	} else {
		c->rev_packets += 1;
		c->rev_bytes += len;
	}
	if (new_flow)
		c->new_flows += 1;
}

/* What a packet's journey (flow.tmpl.h) ends in. */
enum lb_verdict {
	LB_PASS = 0,   /* hand the packet on unchanged */
	LB_NAT,        /* apply the nat_plan, then hand on */
	LB_DONE,       /* already rewritten in place (ICMP error), hand on */
	LB_DROP,
	LB_REJECT,     /* answer with ICMP port unreachable (struct reject_info filled) */
};

enum lb_decision {
	LB_DEC_BACKEND = 0, /* send to lb_choice.be (masqueraded to .snat if non-zero) */
	LB_DEC_DROP,        /* kube-proxy drops: Local policy without a local endpoint,
			     * source outside loadBalancerSourceRanges */
	LB_DEC_REJECT,      /* kube-proxy rejects: the service port has no endpoint at all */
};

/* Which backend set serves a new flow: kube-proxy's policy chains. A cluster IP uses
 * the local set under internalTrafficPolicy Local. An external frontend (NodePort,
 * externalIP, load-balancer IP) uses it under externalTrafficPolicy Local, but only for
 * clients from outside the cluster: pods and the node itself short-circuit to the
 * cluster-wide set, as if they had gone out to the load balancer and come back. */
static __always_inline __u8 lb_set_for(const struct svc_value *sv, __u8 origin)
{
	if (!(sv->flags & KXLB_SVC_F_LOCAL))
		return KXLB_SET_CLUSTER;
	if (sv->kind == KXLB_KIND_CLUSTER_IP || origin == KXLB_ORIGIN_EXTERNAL)
		return KXLB_SET_LOCAL;
	return KXLB_SET_CLUSTER;
}

/* Entry x of a Maglev table lives in chunk x / KXLB_MAGLEV_CHUNK (struct maglev_key):
 * that quotient as a multiply by the rounded-up reciprocal and a shift (hash.h kx_range:
 * no division), exact for every x below 2^16 (a table's size is a __u16): the reciprocal's
 * excess, times 2^16, stays under 2^KX_CHUNK_SHIFT. */
#define KX_CHUNK_SHIFT 24
#define KX_CHUNK_RECIP ((1u << KX_CHUNK_SHIFT) / KXLB_MAGLEV_CHUNK + 1)
_Static_assert(((__u64)KX_CHUNK_RECIP * KXLB_MAGLEV_CHUNK - (1u << KX_CHUNK_SHIFT)) << 16 <= (1u << KX_CHUNK_SHIFT),
	       "KX_CHUNK_RECIP is not exact for every Maglev entry");

static __always_inline __u32 lb_maglev_chunk(__u32 x)
{
	return (__u32)(((__u64)x * KX_CHUNK_RECIP) >> KX_CHUNK_SHIFT);
}

/* The slot of `hash` in one backend set of one generation: entry kx_range(hash, M) of the
 * set's Maglev table (loader/maglev.py table_index), M = `m`. A set of one backend has no
 * table (m 0). -1: the table is gone (user space deleted this generation after a flip) or
 * does not name a slot of this set. */
static __always_inline int lb_table_slot(__u32 svc_id, __u8 gen, __u8 set, __u16 n, __u16 m,
					 __u32 hash)
{
	if (n == 1)
		return 0;
	if (n == 0 || m == 0)
		return -1;
	__u32 idx = kx_range(hash, m);
	__u32 chunk = lb_maglev_chunk(idx);
	struct maglev_key mk = {.svc_id = svc_id, .chunk = chunk, .gen = gen, .set = set};
	struct maglev_chunk *t = maglev_map.lookup(&mk);
	__u32 off = idx - chunk * KXLB_MAGLEV_CHUNK;

	/* The verifier cannot bound off from the arithmetic above; clang would drop a check it
	 * proves redundant, so hide off from it first. */
	asm volatile("" : "+r"(off));
	if (!t || off >= KXLB_MAGLEV_CHUNK)
		return -1;
	__u16 slot = t->slot[off];
	return slot < n ? slot : -1;
}

#endif
