/* SPDX-License-Identifier: GPL-2.0 */
/* Services: the decision for a new flow to a frontend (kube-proxy semantics), shared by
 * tc, XDP and the socket hooks. A template (family.tmpl.h): written once, instantiated
 * for IPv4 and for IPv6. */
#ifndef KX_(KXLB_LB_TMPL_H)
#define KX_(KXLB_LB_TMPL_H)
#include "family.tmpl.h"
#include "maps.h"
#include "addr6.h"
#include "lb.h"

/* What deciding a new flow needs to know about it, from a packet (kxlb.c) or from a
 * socket call (sock.c). */
struct KX_(lb_flow) {
	kx_addr_t client;  /* source address: affinity, source ranges, hairpin */
	__u32  hash;       /* flow hash: picks the slot */
	__u8   origin;     /* KXLB_ORIGIN_*: which traffic policy applies */
};

struct KX_(lb_choice) {
	struct KX_(backend) be;
	kx_addr_t snat;     /* masquerade address, 0: keep the client's source */
};

/* The node's own address: the source its processes' flows have (source ranges see it),
 * and the address of its host-network backends. */
static __always_inline const kx_addr_t *KX_(lb_node_addr)(const struct KX_(lb_config) *cfg)
{
	return KX_ZERO(cfg->node_addr) ? &cfg->snat_addr : &cfg->node_addr;
}

/* The masquerade address for a new flow (0: none), kube-proxy's rules; see struct
 * lb_config (maps.h). Socket-level flows (origin node) never need one: the kernel picks the
 * source address after translation. Nor does a flow to a host-network backend of this node:
 * the packet is delivered locally, which under kube-proxy never reaches POSTROUTING (so is
 * never masqueraded), and its replies leave through tc egress, where the flow's entry
 * translates them (lb_tc_egress). Masqueraded to the node's own address instead, the
 * reply would be addressed to the node itself and go through lo, past every hook. */
static __always_inline int KX_(lb_masquerade_needed)(const struct KX_(lb_config) *cfg,
						     const struct svc_value *sv,
						     const struct KX_(lb_flow) *f,
						     const struct KX_(backend) *be)
{
	if (!cfg || KX_ZERO(cfg->snat_addr) || f->origin == KXLB_ORIGIN_NODE)
		return 0;
	if (KX_EQ(be->addr, *KX_(lb_node_addr)(cfg)))
		return 0;                                       /* delivered locally */
	if (KX_EQ(f->client, be->addr))
		return 1;                                       /* hairpin */
	if (sv->kind == KXLB_KIND_CLUSTER_IP)                   /* from outside the cluster */
		return (cfg->flags & KXLB_CFG_F_MASQUERADE_ALL) ||
		       (!KX_ZERO(cfg->cluster_mask) && f->origin == KXLB_ORIGIN_EXTERNAL);
	return !(sv->flags & KXLB_SVC_F_LOCAL);                 /* eTP Cluster: may cross nodes;
								 * eTP Local keeps the source */
}

/* The backend in slot `slot` of the run at `base` (struct svc_value.slots) of the set
 * tagged `tag` (KXLB_SLOT_TAG): an array read. NULL for an index past the array, a slot
 * never written (tag 0, which no set has), or one a run given to another set since `base`
 * was read holds (maps.h). The tag alone decides: an address check besides it cost
 * kxlb_tc6 a quarter of a million more verifier instructions (IPv6's 16-byte compare). */
static __always_inline struct KX_(backend) *KX_(lb_backend_at)(__u32 base, __u32 slot, __u16 tag)
{
	__u32 idx = base + slot;
	struct KX_(backend) *b = KX_(backend_map).lookup(&idx);

	if (!b || b->tag != tag)
		return NULL;
	return b;
}

/* One backend of a set, in the generation of `sv` (a copy of the svc_map entry taken
 * once, so sizes, runs, table sizes and gen belong together: see maps.h): table, then
 * slot. If user space deleted the table after flipping the generation, the entry is
 * re-read once: the new generation is complete by then. */
static __always_inline int KX_(lb_slot)(const struct KX_(svc_key) *sk, const struct svc_value *sv, __u8 set,
				   __u32 hash, struct KX_(backend) *out)
{
	int local = set == KXLB_SET_LOCAL;
	struct KX_(backend) *b = NULL;
	struct svc_value *now;
	int slot;

	slot = lb_table_slot(sv->svc_id, sv->gen, set, local ? sv->local_count : sv->count,
			     local ? sv->local_table_size : sv->table_size, hash);
	if (slot >= 0)
		b = KX_(lb_backend_at)(local ? sv->local_slots : sv->slots, slot,
					   KXLB_SLOT_TAG(sv->svc_id, sv->gen));
	if (!b) {
		stat_inc(KXLB_ST_SLOT_RETRY);
		now = KX_(svc_map).lookup((struct KX_(svc_key) *)sk);
		if (!now)
			return -1;
		slot = lb_table_slot(now->svc_id, now->gen, set, local ? now->local_count : now->count,
				     local ? now->local_table_size : now->table_size, hash);
		if (slot < 0)
			return -1;
		b = KX_(lb_backend_at)(local ? now->local_slots : now->slots, slot,
					   KXLB_SLOT_TAG(now->svc_id, now->gen));
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
static __always_inline int KX_(lb_affine_slot)(const struct KX_(svc_key) *sk, const struct svc_value *sv,
					  __u8 set, const struct KX_(lb_flow) *f, struct KX_(backend) *out)
{
	struct KX_(affinity_key) ak = {.svc_id = sv->svc_id, .client = f->client, .set = set};
	struct KX_(affinity_value) *av = KX_(affinity_map).lookup(&ak);
	__u64 now = bpf_ktime_get_ns();

	if (av && now - av->last_ns < (__u64)sv->affinity_s * 1000000000ull) {
		__builtin_memset(out, 0, sizeof(*out));
		out->addr = av->addr;
		out->port = av->port;
		av->last_ns = now;
		stat_inc(KXLB_ST_AFFINITY);
		return 0;
	}
	if (KX_(lb_slot)(sk, sv, set, f->hash, out) < 0)
		return -1;
	struct KX_(affinity_value) nv = {.last_ns = now, .addr = out->addr, .port = out->port};
	KX_(affinity_map).update(&ak, &nv);
	return 0;
}

/* Does src_range_map hold a range under svc_id that contains addr? The LPM key is svc_id
 * then the address: a full-length lookup (32 + the address's bits) finds the longest
 * such range. */
static __always_inline int KX_(src_range_has)(__u32 svc_id, const kx_addr_t *addr)
{
	struct KX_(src_range_key) rk = {.prefixlen = 32 + 8 * sizeof(kx_addr_t), .svc_id = svc_id, .addr = *addr};

	return KX_(src_range_map).lookup(&rk) != NULL;
}

/* The decision for a new flow to frontend `sk` (whose svc_map entry `sv` the caller
 * copied): the one place, shared by tc, XDP and the socket hooks, where kube-proxy's
 * service semantics live. Order as kube-proxy's chains: the load-balancer firewall
 * (source ranges), then the policy's backend set (empty: drop or reject), then
 * affinity or the hash, then masquerade. */
static __always_inline int KX_(lb_decide)(const struct KX_(svc_key) *sk, const struct svc_value *sv,
				     const struct KX_(lb_flow) *f, const struct KX_(lb_config) *cfg,
				     struct KX_(lb_choice) *out)
{
	__u8 set;
	int err;

	if ((sv->flags & KXLB_SVC_F_SRC_RANGES) && sv->kind == KXLB_KIND_LOAD_BALANCER &&
	    !KX_(src_range_has)(sv->svc_id, &f->client)) {
		stat_inc(KXLB_ST_SRC_RANGE);
		return LB_DEC_DROP;
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
		err = KX_(lb_affine_slot)(sk, sv, set, f, &out->be);
	else
		err = KX_(lb_slot)(sk, sv, set, f->hash, &out->be);
	if (err < 0) {
		stat_inc(KXLB_ST_NO_BACKEND);
		return LB_DEC_DROP;  /* the service changed under us and is now empty: retry */
	}
	__builtin_memset(&out->snat, 0, sizeof(out->snat));
	if (KX_(lb_masquerade_needed)(cfg, sv, f, &out->be))
		out->snat = cfg->snat_addr;
	return LB_DEC_BACKEND;
}

/* No frontend matched a packet to an address of a service CIDR: a live cluster IP on a
 * port no Service defines is rejected, an unallocated address dropped (kube-proxy's
 * cluster-ips set and service-CIDR rule). Returns LB_DEC_BACKEND for "not ours". */
static __always_inline int KX_(lb_unknown_service_addr)(const struct KX_(lb_config) *cfg,
							const kx_addr_t *daddr)
{
	int in_cidr = 0;

	if (!cfg)
		return LB_DEC_BACKEND;
#pragma unroll
	for (int i = 0; i < KXLB_MAX_SVC_CIDRS; i++)
		if (!KX_ZERO(cfg->svc_mask[i]) && KX_IN_NET(*daddr, cfg->svc_cidr[i], cfg->svc_mask[i]))
			in_cidr = 1;
	/* More CIDRs than the config holds (rare): one LPM lookup, paid only there. */
	if (!in_cidr && (cfg->flags & KXLB_CFG_F_SVC_CIDR_MAP))
		in_cidr = KX_(src_range_has)(KXLB_SVC_CIDR_ID, daddr);
	if (!in_cidr)
		return LB_DEC_BACKEND;
	struct KX_(svc_key) mk = {.vip = *daddr};
	struct svc_value *m = KX_(svc_map).lookup(&mk);
	if (m && m->kind == KXLB_KIND_MARKER) {
		stat_inc(KXLB_ST_BAD_PORT);
		return LB_DEC_REJECT;
	}
	stat_inc(KXLB_ST_UNALLOCATED);
	return LB_DEC_DROP;
}

static __always_inline struct KX_(lb_config) *KX_(lb_config_get)(void)
{
	__u32 zero = 0;
	return KX_(cfg_map).lookup(&zero);
}

#endif
