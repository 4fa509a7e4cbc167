#!/usr/bin/env bash
# mmdebstrap customize hook of the kxlb/debian12 box (lab/vagrant.py): makes the minimal
# Debian in $1 a Vagrant box, then runs the project's own set-up (its package step) in it,
# as a newcomer would on a fresh machine. $2 is the project checkout.
set -euo pipefail
root=$1
project=$2
in_root() { chroot "$root" "$@"; }

# --- a Vagrant box: the vagrant user, sudo without password, the insecure key (replaced by
# vagrant on first up), ssh without DNS lookups
in_root useradd --create-home --shell /bin/bash --groups sudo vagrant
echo 'vagrant:vagrant' | in_root chpasswd
echo 'vagrant ALL=(ALL) NOPASSWD: ALL' > "$root/etc/sudoers.d/vagrant"
chmod 0440 "$root/etc/sudoers.d/vagrant"
key=$(ls /usr/share/rubygems-integration/all/gems/vagrant-*/keys/vagrant.pub 2>/dev/null | head -n1)
[ -n "$key" ] || { echo "box-customize: vagrant's insecure public key not found (is vagrant installed?)" >&2; exit 1; }
install -d -m 700 -o 1000 -g 1000 "$root/home/vagrant/.ssh"
install -m 600 -o 1000 -g 1000 "$key" "$root/home/vagrant/.ssh/authorized_keys"
echo 'UseDNS no' > "$root/etc/ssh/sshd_config.d/vagrant.conf"

# --- boot: by label (the disk is made by mke2fs -L root), serial console, short menu
printf '127.0.0.1 localhost\n127.0.1.1 kxlb-lab\n::1 localhost ip6-localhost ip6-loopback\n' > "$root/etc/hosts"
echo 'LABEL=root / ext4 errors=remount-ro 0 1' > "$root/etc/fstab"
cat > "$root/etc/default/grub" <<'EOF'
GRUB_DEFAULT=0
GRUB_TIMEOUT=1
GRUB_DISTRIBUTOR=Debian
GRUB_CMDLINE_LINUX_DEFAULT=""
GRUB_CMDLINE_LINUX="console=tty0 console=ttyS0,115200n8 net.ifnames=0"
GRUB_TERMINAL="console serial"
GRUB_SERIAL_COMMAND="serial --speed=115200"
GRUB_DISABLE_OS_PROBER=true
EOF

# --- network: DHCP on every NIC (the host's bridge gives an address, QEMU's user-mode NIC the
# route and DNS to package registries)
mkdir -p "$root/etc/systemd/network"
printf '[Match]\nName=en* eth*\n\n[Network]\nDHCP=yes\n' > "$root/etc/systemd/network/80-dhcp.network"
in_root systemctl enable systemd-networkd systemd-resolved ssh serial-getty@ttyS0 >/dev/null 2>&1

# --- each VM its own ssh host keys (made at first boot, not shared by every copy of the box)
rm -f "$root"/etc/ssh/ssh_host_*
cat > "$root/etc/systemd/system/ssh-hostkeys.service" <<'EOF'
[Unit]
Description=ssh host keys for this instance
Before=ssh.service
ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A

[Install]
WantedBy=multi-user.target
EOF
in_root systemctl enable ssh-hostkeys >/dev/null 2>&1

# --- the project's set-up on this fresh Debian: its package step, for real (apt in the chroot).
# systemd-resolved made resolv.conf a link to its stub, which does not run here: the host's for now.
cp --remove-destination /etc/resolv.conf "$root/etc/resolv.conf"
mkdir -p "$root/tmp/kxlb-setup/scripts"
cp "$project/scripts/setup.sh" "$root/tmp/kxlb-setup/scripts/"
in_root env KXLB_SETUP_ONLY=packages bash /tmp/kxlb-setup/scripts/setup.sh
rm -rf "$root/tmp/kxlb-setup"

# --- small: no package lists or archives in the image
in_root apt-get clean
rm -rf "$root"/var/lib/apt/lists/*
# (hostname and resolv.conf are written after mmdebstrap, which replaces both at its end)
