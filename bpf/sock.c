/* SPDX-License-Identifier: GPL-2.0 */
/* Socket-level service translation for processes on the node itself (host network).
 *
 * Their packets never cross a tc ingress hook, so the service is resolved where the
 * socket is addressed instead, in cgroup hooks, from the same maps and the same
 * decision (lb.h, lb_decide()) as the packet datapath:
 *   connect4/6      TCP connect() and connected UDP: VIP:port -> backend
 *   sendmsg4/6      unconnected UDP sendto(VIP:port): per datagram -> backend
 *   recvmsg4/6      unconnected UDP replies: backend -> VIP:port as the source
 *   getpeername4/6  a connected socket still names VIP:port as its peer
 * The *6 hooks serve IPv4-mapped addresses (::ffff:a.b.c.d) of dual-stack AF_INET6
 * sockets (Java, Go) exactly as the *4 hooks serve AF_INET ones; any other IPv6
 * address is passed untouched (IPv6 services are not programmed yet).
 * sock_rev (maps.h) remembers, per socket and backend, which VIP:port to show. */
#include <uapi/linux/bpf.h>
#include <uapi/linux/in.h>
/* SOCK_STREAM / SOCK_DGRAM (asm-generic values; x86 uses them) */
#define SOCK_STREAM_ 1
#define SOCK_DGRAM_ 2

#define ECONNREFUSED_ 111
#define ETIMEDOUT_ 110

/* How many slots of a service a socket may try when the chosen backend already
 * answers it for another VIP (see sock_pick_unshared()). */
#define SOCK_REV_TRIES 8

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define V4_MAPPED_WORD 0xffff0000u /* htonl(0x0000ffff): ::ffff:0:0/96's third word */
#else
#define V4_MAPPED_WORD 0x0000ffffu
#endif

#define KXLB_DATAPATH 1
#include "maps.h"
#include "hash.h"
#include "addr6.h"
#include "lb.h"
/* IPv4 services (IPv6 ones are not translated at the socket level yet). */
#define KX_FAM 4
#include "lb.tmpl.h"

static __always_inline __u8 sock_proto(struct bpf_sock_addr *ctx)
{
	if (ctx->type == SOCK_STREAM_)
		return IPPROTO_TCP;
	if (ctx->type == SOCK_DGRAM_)
		return IPPROTO_UDP;
	return 0;
}

/* Fail the socket call with `err` (a negative errno) instead of the hook's EPERM:
 * ECONNREFUSED is what a rejected connection gives a client under kube-proxy. */
static long (*kx_set_retval)(int retval) = (void *)BPF_FUNC_set_retval;

/* Does this socket already use backend `be` for another VIP:port than `sk`'s? Replies
 * from `be` could then only be shown as coming from one of the two. One comparison of
 * the ORed differences, not two branches: sock_pick_unshared() calls this up to nine
 * times in a row, and every branch that goes on to the next call doubles the paths
 * the verifier walks. */
static __always_inline int sock_rev_taken(__u64 cookie, const struct backend *be, const struct svc_key *sk)
{
	struct sock_rev_key rk = {.cookie = cookie, .addr = be->addr, .port = be->port};
	struct sock_rev_value *rv = sock_rev.lookup(&rk);

	if (!rv)
		return 0;
	return ((rv->vip ^ sk->vip) | (__u32)(rv->port ^ sk->port)) != 0;
}

/* One candidate of sock_pick_unshared(): slot (hash + i) % n. 1: chosen (its backend
 * was free for this VIP), -1: stop looking, 0: try the next. A missing slot means user
 * space is replacing the set right now: the search stops there, keeping lb_decide()'s
 * choice. */
static __always_inline int sock_try_slot(__u64 cookie, const struct svc_key *sk, struct backend_key *bk,
					 __u32 hash, __u32 i, __u16 n, struct backend *be)
{
	struct backend *alt;

	if (i >= n)
		return -1;
	bk->slot = (hash + i) % n;
	alt = backend_map.lookup(bk);
	if (!alt)
		return -1;
	if (sock_rev_taken(cookie, alt, sk))
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
static __always_inline void sock_pick_unshared(__u64 cookie, const struct svc_key *sk, const struct svc_value *sv,
					       __u32 hash, struct backend *be)
{
	if (!sock_rev_taken(cookie, be, sk) || (sv->flags & KXLB_SVC_F_AFFINITY))
		return;
	__u8 set = lb_set_for(sv, KXLB_ORIGIN_NODE);
	__u16 n = set == KXLB_SET_LOCAL ? sv->local_count : sv->count;
	struct backend_key bk = {.svc_id = sv->svc_id, .gen = sv->gen, .set = set};

	/* Unrolled by hand (SOCK_REV_TRIES candidates): as a loop, clang derives the
	 * counter from n, the verifier cannot bound it and walks the loop until it gives
	 * up. */
	if (sock_try_slot(cookie, sk, &bk, hash, 0, n, be) ||
	    sock_try_slot(cookie, sk, &bk, hash, 1, n, be) ||
	    sock_try_slot(cookie, sk, &bk, hash, 2, n, be) ||
	    sock_try_slot(cookie, sk, &bk, hash, 3, n, be) ||
	    sock_try_slot(cookie, sk, &bk, hash, 4, n, be) ||
	    sock_try_slot(cookie, sk, &bk, hash, 5, n, be) ||
	    sock_try_slot(cookie, sk, &bk, hash, 6, n, be))
		return;
	sock_try_slot(cookie, sk, &bk, hash, 7, n, be);
}

/* VIP:port (network order, as in the socket address) -> backend for this socket, with
 * lb_decide() as the packet path does, the node as the client (origin node: external
 * frontends short-circuit to the cluster-wide set, as kube-proxy does for local
 * traffic). Writes the backend to *addr/*port and returns 1 when translated; returns 1
 * with nothing written for what is not a service; returns 0 to refuse the call,
 * ECONNREFUSED where kube-proxy rejects, ETIMEDOUT where it drops (the socket would
 * only have waited for that). */
static __always_inline int sock_translate(struct bpf_sock_addr *ctx, __be32 *addr, __be16 *port)
{
	struct svc_key sk = {};
	struct svc_value *svp;
	struct lb_choice c;

	sk.proto = sock_proto(ctx);
	if (!sk.proto)
		return 1;
	sk.vip = *addr;
	sk.port = *port;
	svp = svc_map.lookup(&sk);
	if (!svp)
		return 1;
	struct svc_value sv = *svp;
	struct lb_config *cfg = lb_config_get();
	__u64 cookie = bpf_get_socket_cookie(ctx);
	struct lb_flow f = {.client = cfg ? (cfg->node_addr ? cfg->node_addr : cfg->snat_addr) : 0,
			    .origin = KXLB_ORIGIN_NODE,
			    .hash = flow_hash((__u32)cookie, (__u32)(cookie >> 32), sk.port, KXLB_HASH_SEED)};

	switch (lb_decide(&sk, &sv, &f, cfg, &c)) {
	case LB_DEC_BACKEND:
		break;
	case LB_DEC_REJECT:
		kx_set_retval(-ECONNREFUSED_);
		return 0;
	default:
		kx_set_retval(-ETIMEDOUT_);
		return 0;
	}
	sock_pick_unshared(cookie, &sk, &sv, f.hash, &c.be);
	struct sock_rev_key rk = {.cookie = cookie, .addr = c.be.addr, .port = c.be.port};
	struct sock_rev_value rv = {.vip = sk.vip, .port = sk.port};
	sock_rev.update(&rk, &rv);
	*addr = c.be.addr;
	*port = c.be.port;
	return 1;
}

/* backend -> VIP:port, for replies and the peer name. */
static __always_inline void sock_untranslate(struct bpf_sock_addr *ctx, __be32 *addr, __be16 *port)
{
	struct sock_rev_key rk = {};
	struct sock_rev_value *rv;

	rk.cookie = bpf_get_socket_cookie(ctx);
	rk.addr = *addr;
	rk.port = *port;
	rv = sock_rev.lookup(&rk);
	if (rv) {
		*addr = rv->vip;
		*port = rv->port;
	}
}

/* IPv4: the address is user_ip4. The context's address and port are stored whole
 * (4-byte writes: the only size the verifier accepts for them). */
static __always_inline int sock4_translate(struct bpf_sock_addr *ctx)
{
	__be32 addr = ctx->user_ip4;
	__be16 port = (__be16)ctx->user_port;
	int ok = sock_translate(ctx, &addr, &port);

	if (ok) {
		ctx->user_ip4 = addr;
		ctx->user_port = port;
	}
	return ok;
}

static __always_inline int sock4_untranslate(struct bpf_sock_addr *ctx)
{
	__be32 addr = ctx->user_ip4;
	__be16 port = (__be16)ctx->user_port;

	sock_untranslate(ctx, &addr, &port);
	ctx->user_ip4 = addr;
	ctx->user_port = port;
	return 1;
}

/* IPv6: only ::ffff:a.b.c.d is ours; the kernel sends such a socket's traffic as
 * IPv4, to the address in the last word, which is the one rewritten. */
static __always_inline int sock6_v4_mapped(struct bpf_sock_addr *ctx)
{
	return ctx->user_ip6[0] == 0 && ctx->user_ip6[1] == 0 && ctx->user_ip6[2] == V4_MAPPED_WORD;
}

static __always_inline int sock6_translate(struct bpf_sock_addr *ctx)
{
	if (!sock6_v4_mapped(ctx))
		return 1;
	__be32 addr = ctx->user_ip6[3];
	__be16 port = (__be16)ctx->user_port;
	int ok = sock_translate(ctx, &addr, &port);

	if (ok) {
		ctx->user_ip6[3] = addr;
		ctx->user_port = port;
	}
	return ok;
}

static __always_inline int sock6_untranslate(struct bpf_sock_addr *ctx)
{
	if (!sock6_v4_mapped(ctx))
		return 1;
	__be32 addr = ctx->user_ip6[3];
	__be16 port = (__be16)ctx->user_port;

	sock_untranslate(ctx, &addr, &port);
	ctx->user_ip6[3] = addr;
	ctx->user_port = port;
	return 1;
}

int kxlb_connect4(struct bpf_sock_addr *ctx) { return sock4_translate(ctx); }
int kxlb_sendmsg4(struct bpf_sock_addr *ctx) { return sock4_translate(ctx); }
int kxlb_recvmsg4(struct bpf_sock_addr *ctx) { return sock4_untranslate(ctx); }
int kxlb_getpeername4(struct bpf_sock_addr *ctx) { return sock4_untranslate(ctx); }
int kxlb_connect6(struct bpf_sock_addr *ctx) { return sock6_translate(ctx); }
int kxlb_sendmsg6(struct bpf_sock_addr *ctx) { return sock6_translate(ctx); }
int kxlb_recvmsg6(struct bpf_sock_addr *ctx) { return sock6_untranslate(ctx); }
int kxlb_getpeername6(struct bpf_sock_addr *ctx) { return sock6_untranslate(ctx); }
