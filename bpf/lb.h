/* SPDX-License-Identifier: GPL-2.0 */
/* Services: the decision for a new flow to a frontend (kube-proxy semantics), shared by
 * tc, XDP and the socket hooks. */
#ifndef KXLB_LB_H
#define KXLB_LB_H
#include "maps.h"

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

/* What deciding a new flow needs to know about it, from a packet (kxlb.c) or from a
 * socket call (sock.c). */
struct lb_flow {
	__be32 client;     /* source address: affinity, source ranges, hairpin */
	__u32  hash;       /* flow hash: picks the slot */
	__u8   origin;     /* KXLB_ORIGIN_*: which traffic policy applies */
};

enum lb_decision {
	LB_DEC_BACKEND = 0, /* send to lb_choice.be (masqueraded to .snat if non-zero) */
	LB_DEC_DROP,        /* kube-proxy drops: Local policy without a local endpoint,
			     * source outside loadBalancerSourceRanges */
	LB_DEC_REJECT,      /* kube-proxy rejects: the service port has no endpoint at all */
};

struct lb_choice {
	struct backend be;
	__be32 snat;        /* masquerade address, 0: keep the client's source */
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

/* The masquerade address for a new flow (0: none), kube-proxy's rules; see struct
 * lb_config. Socket-level flows (origin node) never need one: the kernel picks the
 * source address after translation. */
static __always_inline __be32 lb_masquerade(const struct lb_config *cfg, const struct svc_value *sv,
					    const struct lb_flow *f, const struct backend *be)
{
	if (!cfg || !cfg->snat_addr || f->origin == KXLB_ORIGIN_NODE)
		return 0;
	if (f->client == be->addr)
		return cfg->snat_addr;                          /* hairpin */
	if (sv->kind == KXLB_KIND_CLUSTER_IP) {
		if ((cfg->flags & KXLB_CFG_F_MASQUERADE_ALL) ||
		    (cfg->cluster_mask && f->origin == KXLB_ORIGIN_EXTERNAL))
			return cfg->snat_addr;                  /* from outside the cluster */
		return 0;
	}
	if (!(sv->flags & KXLB_SVC_F_LOCAL))
		return cfg->snat_addr;                          /* eTP Cluster: may cross nodes */
	return 0;                                               /* eTP Local: keep the source */
}

/* The slot of `hash` in one backend set of one generation: entry hash % M of the set's
 * Maglev table (loader/maglev.py), M = `m`. A set of one backend has no table (m 0).
 * -1: the table is gone (user space deleted this generation after a flip) or does not
 * name a slot of this set. */
static __always_inline int lb_table_slot(__u32 svc_id, __u8 gen, __u8 set, __u16 n, __u16 m,
					 __u32 hash)
{
	if (n == 1)
		return 0;
	if (n == 0 || m == 0)
		return -1;
	__u32 idx = hash % m;
	struct maglev_key mk = {.svc_id = svc_id, .chunk = idx / KXLB_MAGLEV_CHUNK, .gen = gen, .set = set};
	struct maglev_chunk *t = maglev_map.lookup(&mk);
	__u32 off = idx % KXLB_MAGLEV_CHUNK;

	/* The verifier cannot bound a modulo; clang would drop a check it proves redundant,
	 * so hide off from it first. */
	asm volatile("" : "+r"(off));
	if (!t || off >= KXLB_MAGLEV_CHUNK)
		return -1;
	__u16 slot = t->slot[off];
	return slot < n ? slot : -1;
}

/* One backend of a set, in the generation of `sv` (a copy of the svc_map entry taken
 * once, so sizes, table sizes and gen belong together: see maps.h): table, then slot.
 * If user space removed the table or slot after flipping the generation, the entry is
 * re-read once: the new generation is complete by then. */
static __always_inline int lb_slot(const struct svc_key *sk, const struct svc_value *sv, __u8 set,
				   __u32 hash, struct backend *out)
{
	struct backend_key bk = {.svc_id = sv->svc_id, .gen = sv->gen, .set = set};
	int local = set == KXLB_SET_LOCAL;
	struct backend *b = NULL;
	struct svc_value *now;
	int slot;

	slot = lb_table_slot(sv->svc_id, sv->gen, set, local ? sv->local_count : sv->count,
			     local ? sv->local_table_size : sv->table_size, hash);
	if (slot >= 0) {
		bk.slot = slot;
		b = backend_map.lookup(&bk);
	}
	if (!b) {
		stat_inc(KXLB_ST_SLOT_RETRY);
		now = svc_map.lookup((struct svc_key *)sk);
		if (!now)
			return -1;
		slot = lb_table_slot(now->svc_id, now->gen, set, local ? now->local_count : now->count,
				     local ? now->local_table_size : now->table_size, hash);
		if (slot < 0)
			return -1;
		bk.svc_id = now->svc_id;
		bk.gen = now->gen;
		bk.slot = slot;
		b = backend_map.lookup(&bk);
		if (!b)
			return -1;
	}
	*out = *b;
	return 0;
}

/* sessionAffinity ClientIP: the client's backend if its last new connection is less
 * than affinity_s old, else a fresh pick; either way the pick is recorded with the
 * current time (kube-proxy refreshes on every new connection). Stale entries for a
 * backend that left the set are removed by user space (loader/services.py). */
static __always_inline int lb_affine_slot(const struct svc_key *sk, const struct svc_value *sv,
					  __u8 set, const struct lb_flow *f, struct backend *out)
{
	struct affinity_key ak = {.svc_id = sv->svc_id, .client = f->client, .set = set};
	struct affinity_value *av = affinity_map.lookup(&ak);
	__u64 now = bpf_ktime_get_ns();

	if (av && now - av->last_ns < (__u64)sv->affinity_s * 1000000000ull) {
		out->addr = av->addr;
		out->port = av->port;
		out->pad = 0;
		av->last_ns = now;
		stat_inc(KXLB_ST_AFFINITY);
		return 0;
	}
	if (lb_slot(sk, sv, set, f->hash, out) < 0)
		return -1;
	struct affinity_value nv = {.last_ns = now, .addr = out->addr, .port = out->port};
	affinity_map.update(&ak, &nv);
	return 0;
}

/* The decision for a new flow to frontend `sk` (whose svc_map entry `sv` the caller
 * copied): the one place, shared by tc, XDP and the socket hooks, where kube-proxy's
 * service semantics live. Order as kube-proxy's chains: the load-balancer firewall
 * (source ranges), then the policy's backend set (empty: drop or reject), then
 * affinity or the hash, then masquerade. */
static __always_inline int lb_decide(const struct svc_key *sk, const struct svc_value *sv,
				     const struct lb_flow *f, const struct lb_config *cfg,
				     struct lb_choice *out)
{
	__u8 set;
	int err;

	if ((sv->flags & KXLB_SVC_F_SRC_RANGES) && sv->kind == KXLB_KIND_LOAD_BALANCER) {
		struct src_range_key rk = {.prefixlen = 64, .svc_id = sv->svc_id, .addr = f->client};

		if (!src_range_map.lookup(&rk)) {
			stat_inc(KXLB_ST_SRC_RANGE);
			return LB_DEC_DROP;
		}
	}
	set = lb_set_for(sv, f->origin);
	if ((set == KXLB_SET_LOCAL ? sv->local_count : sv->count) == 0) {
		if (sv->flags & KXLB_SVC_F_HAS_ENDPOINTS) {
			stat_inc(KXLB_ST_NO_LOCAL);  /* endpoints exist, none for this policy */
			return LB_DEC_DROP;
		}
		stat_inc(KXLB_ST_NO_BACKEND);
		return LB_DEC_REJECT;
	}
	if (sv->flags & KXLB_SVC_F_AFFINITY)
		err = lb_affine_slot(sk, sv, set, f, &out->be);
	else
		err = lb_slot(sk, sv, set, f->hash, &out->be);
	if (err < 0) {
		stat_inc(KXLB_ST_NO_BACKEND);
		return LB_DEC_DROP;  /* the service changed under us and is now empty: retry */
	}
	out->snat = lb_masquerade(cfg, sv, f, &out->be);
	return LB_DEC_BACKEND;
}

/* No frontend matched a packet to an address of a service CIDR: a live cluster IP on a
 * port no Service defines is rejected, an unallocated address dropped (kube-proxy's
 * cluster-ips set and service-CIDR rule). Returns LB_DEC_BACKEND for "not ours". */
static __always_inline int lb_unknown_service_addr(const struct lb_config *cfg, __be32 daddr)
{
	int in_cidr = 0;

	if (!cfg)
		return LB_DEC_BACKEND;
#pragma unroll
	for (int i = 0; i < KXLB_MAX_SVC_CIDRS; i++)
		if (cfg->svc_mask[i] && (daddr & cfg->svc_mask[i]) == cfg->svc_cidr[i])
			in_cidr = 1;
	if (!in_cidr)
		return LB_DEC_BACKEND;
	struct svc_key mk = {.vip = daddr};
	struct svc_value *m = svc_map.lookup(&mk);
	if (m && m->kind == KXLB_KIND_MARKER) {
		stat_inc(KXLB_ST_BAD_PORT);
		return LB_DEC_REJECT;
	}
	stat_inc(KXLB_ST_UNALLOCATED);
	return LB_DEC_DROP;
}

static __always_inline struct lb_config *lb_config_get(void)
{
	__u32 zero = 0;
	return cfg_map.lookup(&zero);
}

#endif
