/* SPDX-License-Identifier: GPL-2.0 */
/* Socket-level service translation for processes on the node itself (host network).
 *
 * Their packets never cross a tc ingress hook, so the service is resolved where the
 * socket is addressed instead, in cgroup hooks, from the same maps and the same
 * decision (lb.h, lb_decide()) as the packet datapath:
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

#define ECONNREFUSED_ 111
#define ETIMEDOUT_ 110

#define KXLB_DATAPATH 1
#include "maps.h"
#include "hash.h"
#include "lb.h"

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

/* VIP:port -> backend for this socket, with lb_decide() as the packet path does, the
 * node as the client (origin node: external frontends short-circuit to the cluster-wide
 * set, as kube-proxy does for local traffic). 1: let the call proceed; 0: refuse it,
 * ECONNREFUSED where kube-proxy rejects, ETIMEDOUT where it drops (the socket would
 * only have waited for that). */
static __always_inline int sock_translate(struct bpf_sock_addr *ctx)
{
	struct svc_key sk = {};
	struct svc_value *svp;
	struct lb_choice c;

	sk.proto = sock_proto(ctx);
	if (!sk.proto)
		return 1;
	sk.vip = ctx->user_ip4;
	sk.port = (__be16)ctx->user_port;
	svp = svc_map.lookup(&sk);
	if (!svp)
		return 1;
	struct svc_value sv = *svp;
	struct lb_config *cfg = lb_config_get();
	__u64 cookie = bpf_get_socket_cookie(ctx);
	struct lb_flow f = {.client = cfg ? cfg->snat_addr : 0, .origin = KXLB_ORIGIN_NODE,
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
	struct sock_rev_key rk = {.cookie = cookie, .addr = c.be.addr, .port = c.be.port};
	struct sock_rev_value rv = {.vip = sk.vip, .port = sk.port};
	sock_rev.update(&rk, &rv);
	ctx->user_ip4 = c.be.addr;
	ctx->user_port = c.be.port;
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
