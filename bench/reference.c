/* Reference programs for bench/prog_run.py, run the same way in the same run:
 * pass-through programs (the baseline of every ratio), and single kernel primitives
 * the datapath is built from, so the table can be read against this machine's costs. */
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>

BPF_HASH(ref_hash, u64, u64, 262144);
BPF_TABLE("lru_hash", u64, u64, ref_lru, 262144);
BPF_ARRAY(ref_next, u64, 1);

int pass_tc(struct __sk_buff *skb) { return TC_ACT_OK; }
int pass_xdp(struct xdp_md *ctx) { return XDP_PASS; }

/* One helper call. */
int prim_clock(struct xdp_md *ctx) { return bpf_ktime_get_ns() ? XDP_PASS : XDP_DROP; }

/* The coarse clock conntrack reads (one per packet that reaches it). */
int prim_coarse(struct xdp_md *ctx) { return bpf_ktime_get_coarse_ns() ? XDP_PASS : XDP_DROP; }

/* One LRU hash lookup that misses (a packet of no flow looking for its record). */
int prim_lru_miss(struct xdp_md *ctx)
{
	u64 k = 1ULL << 63;
	return ref_lru.lookup(&k) ? XDP_DROP : XDP_PASS;
}

/* One hash map lookup. */
int prim_lookup(struct xdp_md *ctx)
{
	u64 k = 1;
	return ref_hash.lookup(&k) ? XDP_PASS : XDP_DROP;
}

/* One hash map insert of a new key. */
int prim_insert(struct xdp_md *ctx)
{
	int z = 0;
	u64 *n = ref_next.lookup(&z);
	if (!n)
		return XDP_DROP;
	u64 k = ++*n, v = 1;
	ref_hash.update(&k, &v);
	return XDP_PASS;
}

/* One LRU hash insert of a new key (conntrack's map type). */
int prim_lru_insert(struct xdp_md *ctx)
{
	int z = 0;
	u64 *n = ref_next.lookup(&z);
	if (!n)
		return XDP_DROP;
	u64 k = ++*n, v = 1;
	ref_lru.update(&k, &v);
	return XDP_PASS;
}

/* What the datapath's new-flow arithmetic cost before and after it stopped dividing
 * (bpf/hash.h kx_range): 8 dependent steps each, from values clang cannot know (a table
 * size below 2^16, a 32-bit hash). BPF's divide (a modulo here, as `hash % M` was), 64
 * bits wide as clang emits it... */
int prim_mod8(struct xdp_md *ctx)
{
	u64 m = (bpf_get_prandom_u32() & 0xffff) | 1, h = bpf_get_prandom_u32();
#pragma unroll
	for (int i = 0; i < 8; i++)
		h = (h % m + (h << 5)) & 0xffffffff;
	return h == 1 ? XDP_DROP : XDP_PASS;
}

/* ... and the multiply and shift that replaced it. */
int prim_range8(struct xdp_md *ctx)
{
	u64 m = (bpf_get_prandom_u32() & 0xffff) | 1, h = bpf_get_prandom_u32();
#pragma unroll
	for (int i = 0; i < 8; i++)
		h = (((h * m) >> 32) + (h << 5)) & 0xffffffff;
	return h == 1 ? XDP_DROP : XDP_PASS;
}
