#!/usr/bin/env bash
# kxlb machine set-up: system packages, kernel headers for BCC, bpffs, and the venv.
# Idempotent and cached: a second run only checks stamps and exits in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${KXLB_VENV:-$ROOT/.venv}

log() { printf 'setup: %s\n' "$*" >&2; }
# Root for apt, bpffs and the kernel headers' links: a user with sudo gets it here.
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "setup: run as root (apt, bpffs, BPF and network namespaces need it); there is no sudo here" >&2; exit 1; }
  exec sudo --preserve-env=KXLB_VENV,KXLB_CACHE,KXLB_SKIP_K8S,KXLB_PIP_EXTRAS,KXLB_GO,GOPROXY,PIP_INDEX_URL,PIP_CERT,SSL_CERT_FILE bash "$0" "$@"
fi

# --- 1. Debian packages -------------------------------------------------------------
APT_PKGS=(bpfcc-tools python3-bpfcc libbpfcc bpftool clang llvm linux-headers-amd64
          iproute2 iptables nftables ethtool python3-venv python3-dev gcc make  # gcc, python3-dev: loader/_maglev.c
          iperf3  # throughput through a VIP in `make bench-e2e`
          ruby   # ruby: syntax check of vagrant/Vagrantfile (Vagrant itself cannot run here)
          libbpf1  # libbpf.so.1: loader/bpfsys.py and the Katran anchor of `make bench` (with bpftool)
          libc6-dev umoci runc  # the lab's images (lab/images.py): static pause; umoci and runc check them
          buildah mmdebstrap  # kxlb's image (lab/imagebuild.py): deploy/Dockerfile on Debian bases made here
          busybox-static curl wget netcat-openbsd socat dnsutils)  # the e2e images' userland (lab/images.py)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The Vagrant box (lab/vagrant.py) runs this step alone in a minimal Debian being built.
[ "${KXLB_SETUP_ONLY:-}" != packages ] || exit 0

# --- 2. Kernel headers for BCC --------------------------------------------------------
# BCC compiles against /lib/modules/$(uname -r)/build. This kernel ships no headers, so
# point the links at Debian's generic -amd64 tree (and its -common sibling).
KDIR=/lib/modules/$(uname -r)
if [ ! -e "$KDIR/build/include/linux/kconfig.h" ] && [ ! -e "$KDIR/build/Makefile" ] || [ ! -e "$KDIR/source" ]; then
  amd64=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n1)
  [ -n "$amd64" ] || { echo "setup: no /usr/src/linux-headers-*-amd64 tree after installing linux-headers-amd64" >&2; exit 1; }
  common=${amd64%-amd64}-common
  [ -d "$common" ] || { echo "setup: $common is missing (expected beside $amd64)" >&2; exit 1; }
  mkdir -p "$KDIR"
  [ -e "$KDIR/build" ] || ln -sfn "$amd64" "$KDIR/build"
  [ -e "$KDIR/source" ] || ln -sfn "$common" "$KDIR/source"
  log "kernel headers: $KDIR/build -> $(readlink "$KDIR/build")"
fi

# --- 3. bpffs ---------------------------------------------------------------------------
if ! mountpoint -q /sys/fs/bpf; then
  mount -t bpf bpf /sys/fs/bpf
  log "mounted bpffs on /sys/fs/bpf"
fi

# --- 4. The venv ------------------------------------------------------------------------
# BCC's Python module is Debian's and is built for Debian's /usr/bin/python3, so the venv
# is made from that interpreter. It stays isolated from Debian's dist-packages except
# for bcc itself, which is linked in.
stamp="$VENV/.kxlb-setup-stamp"
# KXLB_PIP_EXTRAS: the extras of pyproject.toml to install (the Vagrant VM leaves out bench).
EXTRAS=${KXLB_PIP_EXTRAS:-lab,test,bench}
want=$( (cat pyproject.toml setup.py loader/_maglev.c; echo "$EXTRAS") | sha256sum | cut -c1-16)  # the C extension is built by pip
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x "$VENV/bin/python" ] || /usr/bin/python3 -m venv "$VENV"
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"
  "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
  "$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"   # lab: the development lab's dependencies (pyproject.toml)
  echo "$want" > "$stamp"
  log "venv ready: $VENV"
fi
"$VENV/bin/python" -c 'import bcc, pyroute2, scapy, kxlb.loader._maglev' || { echo "setup: venv import check failed" >&2; exit 1; }

# --- 5. Go -------------------------------------------------------------------------------
# The lab's binaries are built from Go modules with the Go of lab/k8s/go.mod: the machine's
# if new enough, else the pinned toolchain from the Go module proxy, hash-checked, into
# /var/cache/kxlb/go (a fresh Debian has none, or 1.19).
GO=$(/usr/bin/python3 scripts/go_toolchain.py) || exit 1
export KXLB_GO=$GO

# --- 6. Kubernetes lab binaries ------------------------------------------------------------
# Built once from Go modules into a version-keyed cache outside the checkout (about 11
# minutes cold on 2 cores; instant afterwards). See lab/k8s/build.sh.
if [ "${KXLB_SKIP_K8S:-}" != 1 ]; then
  bash lab/k8s/build.sh >/dev/null
fi
