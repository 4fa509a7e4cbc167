/* SPDX-License-Identifier: GPL-2.0 */
/* Socket-level translation (sock.c) for one address family: the service lookup, the
 * decision (lb.tmpl.h lb_decide()) and sock_rev, written once for both families
 * (family.tmpl.h). sock.c includes it for IPv4 and for IPv6. */
#include "family.tmpl.h"
#include "hash.h"
#include "sock.h"
#include "lb.tmpl.h"
#ifndef KX_(KXLB_SOCK_TMPL_H)
#define KX_(KXLB_SOCK_TMPL_H)

/* Does this socket already use backend `be` for another VIP:port than `sk`'s? Replies
 * from `be` could then only be shown as coming from one of the two. One comparison of
 * the ORed differences, not two branches: sock_pick_unshared() calls this up to nine
 * times in a row, and every branch that goes on to the next call doubles the paths
 * the verifier walks. */
static __always_inline int KX_(sock_rev_taken)(__u64 cookie, const struct KX_(backend) *be,
						 const struct KX_(svc_key) *sk)
{
	struct KX_(sock_rev_key) rk = {.cookie = cookie, .addr = be->addr, .port = be->port};
	struct KX_(sock_rev_value) *rv = KX_(sock_rev).lookup(&rk);

	if (!rv)
		return 0;
	return (KX_DIFF(rv->vip, sk->vip) | (__u32)(rv->port ^ sk->port)) != 0;
}

/* One candidate of sock_pick_unshared(): the i-th slot on from kx_range(hash, n),
 * wrapping (no division: hash.h), of the set's run at `base`. 1: chosen (its backend
 * was free for this VIP), -1: stop looking, 0: try the next. A slot that is not the
 * set's (lb.tmpl.h lb_backend_at: the run changed hands since the entry was read) stops
 * the search there, keeping lb_decide()'s choice. */
static __always_inline int KX_(sock_try_slot)(__u64 cookie, const struct KX_(svc_key) *sk, __u32 base,
					      __u16 tag, __u32 hash, __u32 i, __u16 n, struct KX_(backend) *be)
{
	struct KX_(backend) *alt;

	if (i >= n)
		return -1;
	__u32 slot = kx_range(hash, n) + i;
	alt = KX_(lb_backend_at)(base, slot >= n ? slot - n : slot, tag);
	if (!alt)
		return -1;
	if (KX_(sock_rev_taken)(cookie, alt, sk))
		return 0;
	*be = *alt;
	return 1;
}

/* sock_rev is keyed (socket, backend): one unconnected UDP socket that sends to two
 * VIPs sharing a backend (one resolver querying two DNS Services) would have the
 * second VIP overwrite the first's entry, and replies to the first query would come
 * back from the wrong VIP. A socket cannot have its source port remapped as the
 * packet path does, so the second VIP gets another of its backends instead: up to
 * SOCK_REV_TRIES slots from the hash on, the first whose backend this socket does not
 * already use for another VIP. Any backend of the set is as right as the chosen one.
 * The candidates are plain slots, not lb_decide()'s own pick repeated: they must be
 * distinct backends whatever lb_decide() maps a hash to.
 * When every candidate is taken (the VIPs share their only backend), lb_decide()'s
 * choice stays and its entry is overwritten: the socket's newest destination is the one it
 * waits on, and a resolver that moved on from the first VIP drops a late reply whose
 * source it did not query anyway; refusing the send instead would fail a query that
 * would have worked. Under sessionAffinity the affine backend is kept (kube-proxy's
 * semantics come first), with the same overwrite. */
static __always_inline void KX_(sock_pick_unshared)(__u64 cookie, const struct KX_(svc_key) *sk,
						    const struct svc_value *sv, __u32 hash, struct KX_(backend) *be)
{
	if (!KX_(sock_rev_taken)(cookie, be, sk) || (sv->flags & KXLB_SVC_F_AFFINITY))
		return;
	__u8 set = lb_set_for(sv, KXLB_ORIGIN_NODE);
	__u16 n = set == KXLB_SET_LOCAL ? sv->local_count : sv->count;
	__u32 base = set == KXLB_SET_LOCAL ? sv->local_slots : sv->slots;
	__u16 tag = KXLB_SLOT_TAG(sv->svc_id, sv->gen);

	/* Unrolled by hand (SOCK_REV_TRIES candidates): as a loop, clang derives the
	 * counter from n, the verifier cannot bound it and walks the loop until it gives
	 * up. */
	if (KX_(sock_try_slot)(cookie, sk, base, tag, hash, 0, n, be) ||
	    KX_(sock_try_slot)(cookie, sk, base, tag, hash, 1, n, be) ||
	    KX_(sock_try_slot)(cookie, sk, base, tag, hash, 2, n, be) ||
	    KX_(sock_try_slot)(cookie, sk, base, tag, hash, 3, n, be) ||
	    KX_(sock_try_slot)(cookie, sk, base, tag, hash, 4, n, be) ||
	    KX_(sock_try_slot)(cookie, sk, base, tag, hash, 5, n, be) ||
	    KX_(sock_try_slot)(cookie, sk, base, tag, hash, 6, n, be))
		return;
	KX_(sock_try_slot)(cookie, sk, base, tag, hash, 7, n, be);
}

/* VIP:port (network order, as in the socket address) -> backend for this socket, with
 * lb_decide() as the packet path does, the node as the client (origin node: external
 * frontends short-circuit to the cluster-wide set, as kube-proxy does for local
 * traffic). Writes the backend to *addr/*port and returns 1 when translated; returns 1
 * with nothing written for what is not a service; returns 0 to refuse the call,
 * ECONNREFUSED where kube-proxy rejects, ETIMEDOUT where it drops (the socket would
 * only have waited for that). */
static __always_inline int KX_(sock_translate)(struct bpf_sock_addr *ctx, kx_addr_t *addr, __be16 *port)
{
	struct KX_(svc_key) sk = {};
	struct svc_value *svp;
	struct KX_(lb_choice) c;

	sk.proto = sock_proto(ctx);
	if (!sk.proto)
		return 1;
	sk.vip = *addr;
	sk.port = *port;
	svp = KX_(svc_map).lookup(&sk);
	if (!svp)
		return 1;
	struct svc_value sv = *svp;
	struct KX_(lb_config) *cfg = KX_(lb_config_get)();
	__u64 cookie = bpf_get_socket_cookie(ctx);
	struct KX_(lb_flow) f = {.origin = KXLB_ORIGIN_NODE,
				 .hash = flow_hash((__u32)cookie, (__u32)(cookie >> 32), sk.port, KXLB_HASH_SEED)};

	if (cfg)
		f.client = *KX_(lb_node_addr)(cfg);

	switch (KX_(lb_decide)(&sk, &sv, &f, cfg, &c)) {
	case LB_DEC_BACKEND:
		break;
	case LB_DEC_REJECT:
		kx_set_retval(-ECONNREFUSED_);
		return 0;
	default:
		kx_set_retval(-ETIMEDOUT_);
		return 0;
	}
	KX_(sock_pick_unshared)(cookie, &sk, &sv, f.hash, &c.be);
	struct KX_(sock_rev_key) rk = {.cookie = cookie, .addr = c.be.addr, .port = c.be.port};
	struct KX_(sock_rev_value) rv = {.vip = sk.vip, .port = sk.port};
	KX_(sock_rev).update(&rk, &rv);
	*addr = c.be.addr;
	*port = c.be.port;
	return 1;
}

/* backend -> VIP:port, for replies and the peer name. */
static __always_inline void KX_(sock_untranslate)(struct bpf_sock_addr *ctx, kx_addr_t *addr, __be16 *port)
{
	struct KX_(sock_rev_key) rk = {};
	struct KX_(sock_rev_value) *rv;

	rk.cookie = bpf_get_socket_cookie(ctx);
	rk.addr = *addr;
	rk.port = *port;
	rv = KX_(sock_rev).lookup(&rk);
	if (rv) {
		*addr = rv->vip;
		*port = rv->port;
	}
}

#endif
