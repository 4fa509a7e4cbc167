/* SPDX-License-Identifier: GPL-2.0 */
/* Socket-level service translation for processes on the node itself (host network).
 *
 * Their packets never cross a tc ingress hook, so the service is resolved where the
 * socket is addressed instead, in cgroup hooks, from the same svc_map/backend_map as
 * the packet datapath:
 *   connect4      TCP connect() and connected UDP: VIP:port -> backend
 *   sendmsg4      unconnected UDP sendto(VIP:port): per datagram -> backend
 *   recvmsg4      unconnected UDP replies: backend -> VIP:port as the source
 *   getpeername4  a connected socket still names VIP:port as its peer
 * sock_rev (maps.h) remembers, per socket and backend, which VIP:port to show. */
#include <uapi/linux/bpf.h>
#include <uapi/linux/in.h>
/* SOCK_STREAM / SOCK_DGRAM (asm-generic values; x86 uses them) */
#define SOCK_STREAM_ 1
#define SOCK_DGRAM_ 2

#define KXLB_DATAPATH 1
#include "maps.h"
#include "hash.h"

static __always_inline __u8 sock_proto(struct bpf_sock_addr *ctx)
{
	if (ctx->type == SOCK_STREAM_)
		return IPPROTO_TCP;
	if (ctx->type == SOCK_DGRAM_)
		return IPPROTO_UDP;
	return 0;
}

/* VIP:port -> backend for this socket. 1: let the call proceed, 0: refuse it (a
 * service with no backend: fail fast, as kube-proxy's reject does). */
static __always_inline int sock_translate(struct bpf_sock_addr *ctx)
{
	struct svc_key sk = {};
	struct svc_value *sv;
	struct backend_key bk = {};
	struct backend *be;

	sk.proto = sock_proto(ctx);
	if (!sk.proto)
		return 1;
	sk.vip = ctx->user_ip4;
	sk.port = (__be16)ctx->user_port;
	sv = svc_map.lookup(&sk);
	if (!sv)
		return 1;
	if (sv->count == 0)
		return 0;
	__u64 cookie = bpf_get_socket_cookie(ctx);
	bk.svc_id = sv->svc_id;
	bk.gen = sv->gen;
	bk.slot = flow_hash((__u32)cookie, (__u32)(cookie >> 32), sk.port, KXLB_HASH_SEED) % sv->count;
	be = backend_map.lookup(&bk);
	if (!be)
		return 1; /* mid-swap: the packet path has no tc hook here; pass as is */
	struct sock_rev_key rk = {.cookie = cookie, .addr = be->addr, .port = be->port};
	struct sock_rev_value rv = {.vip = sk.vip, .port = sk.port};
	sock_rev.update(&rk, &rv);
	ctx->user_ip4 = be->addr;
	ctx->user_port = be->port;
	return 1;
}

/* backend -> VIP:port, for replies and the peer name. */
static __always_inline int sock_untranslate(struct bpf_sock_addr *ctx)
{
	struct sock_rev_key rk = {};
	struct sock_rev_value *rv;

	rk.cookie = bpf_get_socket_cookie(ctx);
	rk.addr = ctx->user_ip4;
	rk.port = (__be16)ctx->user_port;
	rv = sock_rev.lookup(&rk);
	if (rv) {
		ctx->user_ip4 = rv->vip;
		ctx->user_port = rv->port;
	}
	return 1;
}

int kxlb_connect4(struct bpf_sock_addr *ctx) { return sock_translate(ctx); }
int kxlb_sendmsg4(struct bpf_sock_addr *ctx) { return sock_translate(ctx); }
int kxlb_recvmsg4(struct bpf_sock_addr *ctx) { return sock_untranslate(ctx); }
int kxlb_getpeername4(struct bpf_sock_addr *ctx) { return sock_untranslate(ctx); }
