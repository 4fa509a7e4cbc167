/* SPDX-License-Identifier: GPL-2.0 */
/* What the socket hooks (sock.c) and their per-family translation (sock.tmpl.h) share,
 * whatever the family: socket constants, the protocol of a socket, the errno a refused
 * call gets. */
#ifndef KXLB_SOCK_H
#define KXLB_SOCK_H
#include <uapi/linux/bpf.h>
#include <uapi/linux/in.h>

#define ECONNREFUSED_ 111
#define ETIMEDOUT_ 110

/* How many slots of a service a socket may try when the chosen backend already
 * answers it for another VIP (see sock_pick_unshared()). */
#define SOCK_REV_TRIES 8

/* The service protocol a socket speaks: its protocol, not its type (an SCTP socket is
 * SOCK_STREAM or SOCK_SEQPACKET, and UDP-Lite's is SOCK_DGRAM; kxlb 0.2 looked them up as
 * TCP and UDP Services). 0: none of a Service's, the call goes on untouched. */
static __always_inline __u8 sock_proto(struct bpf_sock_addr *ctx)
{
	__u32 proto = ctx->protocol;

	if (proto == IPPROTO_TCP || proto == IPPROTO_UDP || proto == 132 /* IPPROTO_SCTP */)
		return proto;
	return 0;
}

/* Fail the socket call with `err` (a negative errno) instead of the hook's EPERM:
 * ECONNREFUSED is what a rejected connection gives a client under kube-proxy. */
static long (*kx_set_retval)(int retval) = (void *)BPF_FUNC_set_retval;

#endif
