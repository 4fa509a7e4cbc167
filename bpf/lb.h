/* SPDX-License-Identifier: GPL-2.0 */
/* Services: VIP:port/proto lookup and backend choice for a new flow. */
#ifndef KXLB_LB_H
#define KXLB_LB_H

static __always_inline void stat_inc(__u32 idx)
{
	__u64 *v = dp_stats.lookup(&idx);
	if (v)
		*v += 1;
}

/* Per-service counters; per CPU, so plain adds. */
static __always_inline void svc_account(__u32 svc_id, __u8 dir, __u32 len, int new_flow)
{
	struct svc_counters *c = svc_stats.lookup(&svc_id);

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

/* Pick the backend for a new flow: slot = hash(flow) % count within the service's
 * active generation. `sv` is a copy of the svc_map value taken once, so count and gen
 * belong together (see maps.h). Returns 0 and fills `out`, or -1: no backend. */
static __always_inline int lb_select(const struct svc_key *sk, const struct svc_value *sv,
				     const struct pkt *p, struct backend *out)
{
	__u32 h = flow_hash(p->saddr, p->daddr, ((__u32)p->sport << 16) | p->dport,
			    KXLB_HASH_SEED ^ p->proto);
	struct backend_key bk = {};
	struct backend *b;
	struct svc_value *now;

	if (sv->count == 0)
		return -1;
	bk.svc_id = sv->svc_id;
	bk.slot = h % sv->count;
	bk.gen = sv->gen;
	b = backend_map.lookup(&bk);
	if (!b) {
		/* User space flipped the generation and already removed the slot this
		 * packet read the old entry for: the new generation is complete. */
		stat_inc(KXLB_ST_SLOT_RETRY);
		now = svc_map.lookup((struct svc_key *)sk);
		if (!now || now->count == 0)
			return -1;
		bk.svc_id = now->svc_id;
		bk.slot = h % now->count;
		bk.gen = now->gen;
		b = backend_map.lookup(&bk);
		if (!b)
			return -1;
	}
	*out = *b;
	return 0;
}

#endif
