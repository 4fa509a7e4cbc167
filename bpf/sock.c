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
 * The *6 hooks serve IPv6 services, and IPv4-mapped addresses (::ffff:a.b.c.d) of
 * dual-stack AF_INET6 sockets (Java, Go) exactly as the *4 hooks serve AF_INET ones.
 * sock_rev and sock_rev6 (maps.h) remember, per socket and backend, which VIP:port to
 * show. The translation itself is sock.tmpl.h, once per family.
 *
 * Only the host's sockets are translated: the hooks sit on a cgroup (often the root)
 * that holds pods too, and a pod's socket translated here would be judged as the node
 * (loadBalancerSourceRanges, affinity), and its connected UDP sockets would escape the
 * conntrack cleanup. A pod's packets cross the tc hook on its veth instead, which judges
 * them by their real source, as kube-proxy does (Cilium's bpf-lb-sock-hostns-only). */
#include <uapi/linux/bpf.h>
#include <uapi/linux/in.h>
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
#include "sock.h"


/* The host's network namespace, by cookie (bpf_get_netns_cookie): written by the loader
 * into each build's map before its hooks are attached (loader/socklb.py), and carried
 * over from the programs they replace. A private map, not a pinned one: its value
 * belongs to the programs that read it. 0 (not set: hooks attached by a kxlb that did
 * not know the namespace) translates every socket, as kxlb did before. */
BPF_ARRAY(sock_hostns, __u64, 1);

/* Is this socket the host's (to be translated here), or a pod's (left to tc)? */
static __always_inline int sock_in_hostns(struct bpf_sock_addr *ctx)
{
	int zero = 0;
	__u64 *host = sock_hostns.lookup(&zero);

	return !host || !*host || bpf_get_netns_cookie(ctx) == *host;
}

/* The translation of each family: sock_translate()/sock_untranslate() for IPv4
 * services, sock_translate6()/sock_untranslate6() for IPv6 ones. */
#define KX_FAM 4
#include "sock.tmpl.h"
#define KX_FAM 6
#include "sock.tmpl.h"

/* IPv4: the address is user_ip4. The context's address and port are stored whole
 * (4-byte writes: the only size the verifier accepts for them). */
static __always_inline int sock4_translate(struct bpf_sock_addr *ctx)
{
	if (!sock_in_hostns(ctx))
		return 1;
	__be32 addr = ctx->user_ip4;
	__be16 port = (__be16)ctx->user_port;
	int ok = sock_translate(ctx, &addr, &port);

	if (ok) {
		ctx->user_ip4 = addr;
		ctx->user_port = port;
	}
	return ok;
}

/* Replies and peer names are untranslated in every namespace: only a socket the hooks
 * translated has a sock_rev entry, and a pod's socket translated before its namespace
 * was known (an upgrade from a kxlb that translated pods) still needs its VIP shown. */
static __always_inline int sock4_untranslate(struct bpf_sock_addr *ctx)
{
	__be32 addr = ctx->user_ip4;
	__be16 port = (__be16)ctx->user_port;

	sock_untranslate(ctx, &addr, &port);
	ctx->user_ip4 = addr;
	ctx->user_port = port;
	return 1;
}

/* IPv6: ::ffff:a.b.c.d (a dual-stack socket addressing IPv4) is an IPv4 service's,
 * and the kernel sends such a socket's traffic as IPv4, to the address in the last
 * word, which is the one rewritten; any other address is an IPv6 service's. The
 * context's address is read and written a word at a time (the verifier's rule). */
static __always_inline int sock6_v4_mapped(struct bpf_sock_addr *ctx)
{
	return ctx->user_ip6[0] == 0 && ctx->user_ip6[1] == 0 && ctx->user_ip6[2] == V4_MAPPED_WORD;
}

static __always_inline void sock6_read(struct bpf_sock_addr *ctx, struct kx_in6 *a)
{
	a->w[0] = ctx->user_ip6[0];
	a->w[1] = ctx->user_ip6[1];
	a->w[2] = ctx->user_ip6[2];
	a->w[3] = ctx->user_ip6[3];
}

static __always_inline void sock6_write(struct bpf_sock_addr *ctx, const struct kx_in6 *a)
{
	ctx->user_ip6[0] = a->w[0];
	ctx->user_ip6[1] = a->w[1];
	ctx->user_ip6[2] = a->w[2];
	ctx->user_ip6[3] = a->w[3];
}

static __always_inline int sock6_translate(struct bpf_sock_addr *ctx)
{
	if (!sock_in_hostns(ctx))
		return 1;
	__be16 port = (__be16)ctx->user_port;
	int ok;

	if (sock6_v4_mapped(ctx)) {
		__be32 addr = ctx->user_ip6[3];

		ok = sock_translate(ctx, &addr, &port);
		if (ok) {
			ctx->user_ip6[3] = addr;
			ctx->user_port = port;
		}
		return ok;
	}
	struct kx_in6 addr6;

	sock6_read(ctx, &addr6);
	ok = sock_translate6(ctx, &addr6, &port);
	if (ok) {
		sock6_write(ctx, &addr6);
		ctx->user_port = port;
	}
	return ok;
}

static __always_inline int sock6_untranslate(struct bpf_sock_addr *ctx)
{
	__be16 port = (__be16)ctx->user_port;

	if (sock6_v4_mapped(ctx)) {
		__be32 addr = ctx->user_ip6[3];

		sock_untranslate(ctx, &addr, &port);
		ctx->user_ip6[3] = addr;
		ctx->user_port = port;
		return 1;
	}
	struct kx_in6 addr6;

	sock6_read(ctx, &addr6);
	sock_untranslate6(ctx, &addr6, &port);
	sock6_write(ctx, &addr6);
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
