#!/usr/bin/env bash
# Host set-up for the Vagrant lab VM (`make vagrant-box`, `make vagrant-test`): Debian's
# vagrant, vagrant-libvirt, QEMU and libvirt, installed without starting anything.
# Idempotent: a second run checks the packages and exits.
#
# Only the daemon and the drivers are installed, not libvirt-daemon-system: that package
# brings libvirt's "default" network, a NAT network that libvirtd would start on its own
# and that adds firewall rules and turns on IP forwarding. The VM's network is made by
# lab/vagrant.py instead (its own bridge, no route out of the machine).
set -euo pipefail

log() { printf 'setup-vagrant: %s\n' "$*" >&2; }
[ "$(id -u)" = 0 ] || { echo "setup-vagrant: must run as root (packages, libvirtd, a bridge)" >&2; exit 1; }

PKGS=(vagrant vagrant-libvirt libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients
      qemu-system-x86 qemu-utils  # QEMU: TCG here, KVM where the host has vmx/svm
      dnsmasq-base                # DHCP on the VM's bridge (no DNS, no router)
      fdisk e2fsprogs rsync openssh-client)  # the box's disk (sfdisk, mke2fs -d); vagrant's rsync share and ssh
# libvirt's QEMU driver: without libvirt-daemon-system there is no qemu.conf and no
# libvirt-qemu user. QEMU runs as root here (the lab's user is root anyway), with no security
# driver (no AppArmor here) and no cgroups (no systemd to place the VM under machine.slice).
# A qemu.conf the machine already has is left alone.
write_qemu_conf() {
  # libvirtd resolves its built-in user before it reads qemu.conf: the account must exist
  # (libvirt-daemon-system's postinst would make it the same way).
  getent group libvirt-qemu >/dev/null || groupadd --system libvirt-qemu
  getent passwd libvirt-qemu >/dev/null || useradd --system --gid libvirt-qemu --no-create-home \
    --home-dir /var/lib/libvirt --shell /usr/sbin/nologin libvirt-qemu
  [ ! -e /etc/libvirt/qemu.conf ] || return 0
  mkdir -p /etc/libvirt
  printf '%s\n' "# Written by kxlb's scripts/setup-vagrant.sh (the Vagrant lab VM); remove it for libvirt's defaults." \
    'user = "root"' 'group = "root"' 'security_driver = "none"' 'cgroup_controllers = [ ]' > /etc/libvirt/qemu.conf
  log "wrote /etc/libvirt/qemu.conf"
}

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then write_qemu_conf; exit 0; fi

log "installing ${missing[*]}"
# Package scripts must not start daemons here (no systemd; lab/vagrant.py starts them).
policy=/usr/sbin/policy-rc.d
made_policy=
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
fi
trap '[ -z "$made_policy" ] || rm -f "$policy"' EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
log "installed"
write_qemu_conf
