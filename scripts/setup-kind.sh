#!/usr/bin/env bash
# Host set-up for the kind lab (`make kind`, lab/kind.py): Debian's docker.io (dockerd, the
# docker CLI, and the containerd it runs), installed without starting anything. lab/kind.py
# runs a dockerd of its own (own data root and socket, no firewall rules, no forwarding).
# Idempotent: a second run checks the packages and exits.
#
# Debian's postinst scripts would start docker.service and containerd.service (and with
# them docker0, and iptables rules): a policy-rc.d that refuses every start is in place
# for the install, and the machine's own policy-rc.d, if it has one, is put back after.
set -euo pipefail

log() { printf 'setup-kind: %s\n' "$*" >&2; }
[ "$(id -u)" = 0 ] || { echo "setup-kind: must run as root (packages)" >&2; exit 1; }

PKGS=(docker.io)   # with containerd and runc; mmdebstrap (the node's root) comes from scripts/setup.sh
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
[ ${#missing[@]} -gt 0 ] || exit 0

policy=/usr/sbin/policy-rc.d
saved=
if [ -e "$policy" ]; then saved=$(mktemp); cp -a "$policy" "$saved"; fi
restore() { if [ -n "$saved" ]; then cp -a "$saved" "$policy"; rm -f "$saved"; else rm -f "$policy"; fi; }
trap restore EXIT
printf '#!/bin/sh\n# setup-kind.sh: no service starts while packages install\nexit 101\n' > "$policy"
chmod 755 "$policy"
log "installing ${missing[*]} (nothing is started)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# The packages enable their units: on a host booted with systemd the system's dockerd would
# start at the next boot, with docker0, iptables rules and ip_forward=1. Masked (what
# `systemctl mask` does, which also works here without systemd running); only what this
# script installed, never a Docker the machine had before.
for unit in docker.service docker.socket containerd.service; do
  ln -sfn /dev/null "/etc/systemd/system/$unit"
done
log "masked docker.service, docker.socket and containerd.service (lab/kind.py runs its own dockerd)"
