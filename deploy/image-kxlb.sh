#!/bin/sh
# The image's `kxlb` (/usr/local/bin/kxlb, first on PATH: deploy/kxlb.yaml's
# `command: [kxlb, controller]` runs it). It chooses the kernel headers BCC compiles the
# datapath against, then runs the venv's kxlb.
#
# BCC reads /lib/modules/$(uname -r)/source when both build/ and source/ are there (the
# split Debian and Ubuntu trees), else build/; without include/linux/kconfig.h there it
# unpacks the kernel's own /sys/kernel/kheaders.tar.xz (CONFIG_IKHEADERS). Both match the
# running kernel, so they win when the pod has them (the DaemonSet mounts the node's
# /lib/modules and /usr/src). Only when neither is there does BCC get the Debian headers
# this image ships, through BCC_KERNEL_SOURCE: the datapath reads only UAPI structures
# (packet headers, the BPF helpers' contexts), which do not change between kernel
# releases, so another release's headers compile a program the running kernel accepts.
# A BCC_KERNEL_SOURCE set by the pod's spec is left as it is.
set -eu
if [ -z "${BCC_KERNEL_SOURCE:-}" ]; then
    modules=/lib/modules/$(uname -r)
    if [ -d "$modules/build" ] && [ -d "$modules/source" ]; then
        node_headers=$modules/source
    else
        node_headers=$modules/build
    fi
    if [ ! -f "$node_headers/include/linux/kconfig.h" ] && [ ! -e /sys/kernel/kheaders.tar.xz ]; then
        export BCC_KERNEL_SOURCE=/usr/lib/kxlb/kernel-headers
    fi
fi
exec /opt/kxlb/bin/kxlb "$@"
