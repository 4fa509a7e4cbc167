/* SPDX-License-Identifier: GPL-2.0 */
/* What the socket hooks (sock.c) and their per-family translation (sock.tmpl.h) share,
 * whatever the family: socket constants, the protocol of a socket, the errno a refused
 * call gets. */
#ifndef KXLB_SOCK_H
#define KXLB_SOCK_H
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

#endif
