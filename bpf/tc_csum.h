/* SPDX-License-Identifier: GPL-2.0 */
/* tc: L4 checksum changes through the kernel's helpers, for both address families. */
#ifndef KXLB_TC_CSUM_H
#define KXLB_TC_CSUM_H
#include <uapi/linux/in.h>
#include <uapi/linux/tcp.h>
#include <uapi/linux/udp.h>

#define OFF_(type, field) __builtin_offsetof(type, field)

/* bpf_csum_diff with the kernel's prototype: it returns a 64-bit value, a 32-bit sum or a
 * negative error. BCC declares it `int`, which turns every sum with its top bit set into
 * an "error": kernels that return the sum unfolded (the Vagrant VM's 6.12) dropped about
 * half of all IPv6 address changes at tc; this machine's 6.18 folds it to 16 bits, which
 * hid it here. */
static __s64 (*kx_csum_diff)(void *from, __u32 from_size, void *to, __u32 to_size, __u32 seed) =
	(void *)BPF_FUNC_csum_diff;

/* bpf_csum_update with the kernel's prototype (a 32-bit sum; BCC declares it 16-bit). Adds
 * to the sum of a CHECKSUM_COMPLETE skb, does nothing (an error) for the others. */
static long (*kx_csum_update)(struct __sk_buff *skb, __u32 csum) = (void *)BPF_FUNC_csum_update;

/* tc: one L4 checksum change through the helper (it knows CHECKSUM_PARTIAL/COMPLETE:
 * `pseudo` for address changes, which the partial sum covers, not ports). Size 0: `to`
 * is a checksum difference (bpf_csum_diff) and `from` is 0. Shared by both families. */
static __always_inline int tc_l4_csum(struct __sk_buff *skb, __u8 proto, __u32 l4_off, __u32 from,
				      __u32 to, __u64 size, __u64 pseudo)
{
	__u32 csum_off;
	__u64 zero_flag = 0;

	if (from == to && size)
		return 0;
	if (proto == IPPROTO_TCP) {
		csum_off = l4_off + OFF_(struct tcphdr, check);
	} else {
		/* IPv4: 0 = "no checksum" stays 0. IPv6 (where 0 is invalid): a computed 0 is
		 * still written as 0xffff, never as 0. */
		csum_off = l4_off + OFF_(struct udphdr, check);
		zero_flag = BPF_F_MARK_MANGLED_0;
	}
	return bpf_l4_csum_replace(skb, csum_off, from, to, pseudo | zero_flag | size);
}

#endif
