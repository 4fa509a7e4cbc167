/* Baseline for bench/prog_run.py: the cheapest possible programs, run the same way. */
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>

int pass_tc(struct __sk_buff *skb) { return TC_ACT_OK; }
int pass_xdp(struct xdp_md *ctx) { return XDP_PASS; }
