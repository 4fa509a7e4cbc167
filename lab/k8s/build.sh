#!/usr/bin/env bash
# Build the Kubernetes binaries the lab needs, from Go modules.
#
# Control plane (default target):
#   kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl
#       from k8s.io/kubernetes (module in this directory: go.mod pins one
#       release and replaces every staging module by its published k8s.io/*
#       v0.X.Y version)
#   etcd
#       from go.etcd.io/etcd/server/v3 (separate module in ./etcd, so its
#       dependency graph does not fight with Kubernetes')
# Real-kubelet nodes (--node):
#   kubelet agnhost regression-issue-74839
#       from the same k8s.io/kubernetes module (agnhost is the e2e tests' image
#       binary, test/images/agnhost; regression-issue-74839 the conntrack spec's
#       sender of an out-of-window packet)
#   containerd containerd-shim-runc-v2 ctr
#       from github.com/containerd/containerd/v2 (module in ./containerd)
#   coredns
#       from github.com/coredns/coredns (module in ./coredns): the cluster DNS
# kind clusters (--kind; lab/kind.py, `make kind`):
#   kubeadm
#       from the same k8s.io/kubernetes module: kind's nodes run it
#   kind
#       sigs.k8s.io/kind (module in ./kind)
# Upstream e2e tests (--e2e):
#   e2e.test
#       `go test -c` of ./e2e: the network tests of k8s.io/kubernetes/test/e2e at the
#       same release, with the upstream framework (lab/e2e.py runs it)
#   ginkgo
#       the ginkgo CLI at the version e2e.test links: it runs e2e.test's specs in
#       parallel processes, as upstream's hack/ginkgo-e2e.sh does
#
# The binaries go to a cache OUTSIDE the checkout, keyed by the versions:
#   ${KXLB_CACHE:-/var/cache/kxlb}/k8s/<k8s-version>-<etcd-version>/bin/
#   ${KXLB_CACHE:-/var/cache/kxlb}/node/<k8s-version>-<containerd-version>-<coredns-version>/bin/
#   ${KXLB_CACHE:-/var/cache/kxlb}/e2e/<k8s-version>-<digest of ./e2e>/bin/
#   ${KXLB_CACHE:-/var/cache/kxlb}/kind/<k8s-version>-<kind-version>/bin/
# A run whose binaries all exist does nothing (warm run: well under a second).
# The last line on stdout is always the bin dir; everything else goes to stderr.
#
# Usage: lab/k8s/build.sh [--node|--e2e|--kind] [--force] [--print-bin-dir] [--versions]
#   --node           the node set instead of the control plane
#   --e2e            the e2e test binary instead of the control plane
#   --kind           kind and kubeadm instead of the control plane
#   --force          rebuild even if the binaries exist
#   --print-bin-dir  print the bin dir and exit (no build, no go needed)
#   --versions       print K8S_VERSION=... ETCD_VERSION=... CONTAINERD_VERSION=... and exit
# Environment:
#   KXLB_CACHE       cache root (default /var/cache/kxlb)
#   KXLB_GO          go command (default: go on PATH if new enough, else the toolchain
#                    pinned in go-toolchain.sum, fetched by scripts/go_toolchain.py)
#   KXLB_BUILD_P     go build -p (default 2; the lab machines have 2 cores)
#   GOTOOLCHAIN      default "auto": a go older than the modules' go line
#                    fetches the right toolchain from the module proxy
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

K8S_BINS=(kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl)
ETCD_BINS=(etcd)
NODE_K8S_BINS=(kubelet agnhost regression-issue-74839)
CONTAINERD_BINS=(containerd containerd-shim-runc-v2 ctr)
COREDNS_BINS=(coredns)
KIND_BINS=(kubeadm kind)

# Versions come from the go.mod files: they are the single source of truth.
modver() { # modver <go.mod> <module path>
    awk -v m="$2" '
        $1 == m && $2 ~ /^v/ { print $2; exit }
        $1 == "require" && $2 == m && $3 ~ /^v/ { print $3; exit }
    ' "$1"
}
K8S_VERSION="$(modver "$HERE/go.mod" k8s.io/kubernetes)"
ETCD_VERSION="$(modver "$HERE/etcd/go.mod" go.etcd.io/etcd/server/v3)"
CONTAINERD_VERSION="$(modver "$HERE/containerd/go.mod" github.com/containerd/containerd/v2)"
COREDNS_VERSION="$(modver "$HERE/coredns/go.mod" github.com/coredns/coredns)"
KIND_VERSION="$(modver "$HERE/kind/go.mod" sigs.k8s.io/kind)"
if [[ -z "$K8S_VERSION" || -z "$ETCD_VERSION" || -z "$CONTAINERD_VERSION" || -z "$COREDNS_VERSION" || -z "$KIND_VERSION" ]]; then
    echo "build.sh: cannot read versions from the go.mod files in $HERE" >&2
    exit 1
fi

CACHE_ROOT="${KXLB_CACHE:-/var/cache/kxlb}"

force=0
target=control
actions=()
for a in "$@"; do
    case "$a" in
        --force) force=1 ;;
        --node) target=node ;;
        --e2e) target=e2e ;;
        --kind) target=kind ;;
        --print-bin-dir|--versions) actions+=("$a") ;;
        -h|--help) sed -n '2,50p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build.sh: unknown argument: $a" >&2; exit 2 ;;
    esac
done
if [[ $target == node ]]; then
    KEY="${K8S_VERSION}-${CONTAINERD_VERSION}-${COREDNS_VERSION}"
    OUT="$CACHE_ROOT/node/$KEY"
    BINS=("${NODE_K8S_BINS[@]}" "${CONTAINERD_BINS[@]}" "${COREDNS_BINS[@]}")
elif [[ $target == kind ]]; then
    KEY="${K8S_VERSION}-${KIND_VERSION}"
    OUT="$CACHE_ROOT/kind/$KEY"
    BINS=("${KIND_BINS[@]}")
elif [[ $target == e2e ]]; then
    # Keyed by the suite's own source too: a change to ./e2e is a new binary.
    KEY="${K8S_VERSION}-$(cat "$HERE"/e2e/*.go "$HERE/go.sum" | sha256sum | cut -c1-12)"
    OUT="$CACHE_ROOT/e2e/$KEY"
    BINS=(e2e.test ginkgo)
else
    KEY="${K8S_VERSION}-${ETCD_VERSION}"
    OUT="$CACHE_ROOT/k8s/$KEY"
    BINS=("${K8S_BINS[@]}" "${ETCD_BINS[@]}")
fi
BIN_DIR="$OUT/bin"
for a in "${actions[@]}"; do
    case "$a" in
        --print-bin-dir) echo "$BIN_DIR"; exit 0 ;;
        --versions) echo "K8S_VERSION=$K8S_VERSION"; echo "ETCD_VERSION=$ETCD_VERSION"
                    echo "CONTAINERD_VERSION=$CONTAINERD_VERSION"; echo "COREDNS_VERSION=$COREDNS_VERSION"
                    echo "KIND_VERSION=$KIND_VERSION"; exit 0 ;;
    esac
done

all_present() {
    local b
    for b in "${BINS[@]}"; do
        [[ -x "$BIN_DIR/$b" ]] || return 1
    done
    [[ -f "$OUT/BUILD-OK" ]]
}

if [[ $force == 0 ]] && all_present; then
    echo "build.sh: the $target set ($KEY) is already built" >&2
    echo "$BIN_DIR"
    exit 0
fi

mkdir -p "$OUT"
# One builder at a time per version key (CI and a developer may race).
exec 9>"$OUT/.lock"
if ! flock -n 9; then
    echo "build.sh: another build of $KEY is running; waiting for it" >&2
    flock 9
fi
if [[ $force == 0 ]] && all_present; then
    echo "$BIN_DIR"
    exit 0
fi

# A go at least as new as go.mod's go line: $KXLB_GO or PATH's, else the pinned toolchain
# from the module proxy, hash-checked (scripts/go_toolchain.py; Debian 12's go 1.19 is too old
# even to switch toolchains by itself).
GO=$(python3 "$HERE/../../scripts/go_toolchain.py") || exit 1
export GOTOOLCHAIN="${GOTOOLCHAIN:-auto}"
# go.mod/go.sum are complete (go mod tidy is a no-op): never let a build rewrite them.
export GOFLAGS=-mod=readonly
export GOWORK=off
export CGO_ENABLED=0          # upstream builds these binaries static, too
P="${KXLB_BUILD_P:-2}"

# Stage into a fresh dir, then move binaries into place: a killed build never
# leaves a bin dir that looks complete.
STAGE="$(mktemp -d "$OUT/.stage.XXXXXX")"
trap 'rm -rf "$STAGE"' EXIT

start=$(date +%s)
echo "build.sh: building the $target set ($KEY) into $BIN_DIR ($("$GO" version), -p $P)" >&2

# --- Kubernetes -------------------------------------------------------------
# Same version stamping as hack/lib/version.sh (kube::version::ldflags).
minor="${K8S_VERSION#v}"; major="${minor%%.*}"; minor="${minor#*.}"; minor="${minor%%.*}"
build_date="$(date -u ${SOURCE_DATE_EPOCH:+--date=@$SOURCE_DATE_EPOCH} +%Y-%m-%dT%H:%M:%SZ)"
ld=(-s -w)
for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ld+=(-X "'$pkg.gitVersion=$K8S_VERSION'"
         -X "'$pkg.gitMajor=$major'"
         -X "'$pkg.gitMinor=$minor'"
         -X "'$pkg.gitTreeState=clean'"
         -X "'$pkg.buildDate=$build_date'")
done
if [[ $target == e2e ]]; then
    (
        cd "$HERE"
        "$GO" test -c -p "$P" -trimpath -tags selinux,grpcnotrace \
            -ldflags "${ld[*]}" -o "$STAGE/e2e.test" ./e2e
        "$GO" build -p "$P" -trimpath -o "$STAGE/ginkgo" github.com/onsi/ginkgo/v2/ginkgo
    )
    echo "build.sh: e2e.test done after $(( $(date +%s) - start ))s" >&2
    got="$("$STAGE/e2e.test" --version 2>&1 || true)"
    if [[ "$got" != "$K8S_VERSION" ]]; then
        echo "build.sh: e2e.test --version says '$got', want '$K8S_VERSION'" >&2
        exit 1
    fi
fi
pkgs=()
if [[ $target == node ]]; then
    pkgs=(k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/test/images/agnhost
          k8s.io/kubernetes/test/images/regression-issue-74839)
elif [[ $target == control ]]; then
    for b in "${K8S_BINS[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
elif [[ $target == kind ]]; then
    pkgs=(k8s.io/kubernetes/cmd/kubeadm)
fi
if [[ ${#pkgs[@]} -gt 0 ]]; then
    (
        cd "$HERE"
        # Tags as upstream's non-debug build (hack/lib/golang.sh). The kubelet is
        # static too: nothing it links needs cgo on Linux without the dockershim.
        "$GO" build -p "$P" -trimpath -tags selinux,notest,grpcnotrace \
            -ldflags "${ld[*]}" -o "$STAGE/" "${pkgs[@]}"
    )
    echo "build.sh: kubernetes done after $(( $(date +%s) - start ))s" >&2
fi

if [[ $target == kind ]]; then
    # --- kind -----------------------------------------------------------------
    (
        cd "$HERE/kind"
        "$GO" build -p "$P" -trimpath -ldflags "-s -w" -o "$STAGE/kind" sigs.k8s.io/kind
    )
    echo "build.sh: kind done after $(( $(date +%s) - start ))s" >&2
    got="$("$STAGE/kind" version 2>&1 || true)"
    if [[ "$got" != "kind ${KIND_VERSION} "* ]]; then
        echo "build.sh: kind version says '$got', want 'kind $KIND_VERSION ...'" >&2
        exit 1
    fi
fi
if [[ $target == node ]]; then
    # --- containerd -----------------------------------------------------------
    # Static, as upstream's release builds of the shim: the snapshotters that need
    # cgo or host libraries (btrfs, devmapper, zfs) are left out; the lab uses overlayfs.
    cpkg=github.com/containerd/containerd/v2
    (
        cd "$HERE/containerd"
        "$GO" build -p "$P" -trimpath -tags "no_btrfs no_devmapper no_zfs urfave_cli_no_docs" \
            -ldflags "-s -w -X $cpkg/version.Version=$CONTAINERD_VERSION -X $cpkg/version.Package=$cpkg" \
            -o "$STAGE/" "$cpkg/cmd/containerd" "$cpkg/cmd/containerd-shim-runc-v2" "$cpkg/cmd/ctr"
    )
    echo "build.sh: containerd done after $(( $(date +%s) - start ))s" >&2
    # --- CoreDNS --------------------------------------------------------------
    (
        cd "$HERE/coredns"
        "$GO" build -p "$P" -trimpath -ldflags "-s -w" -o "$STAGE/coredns" github.com/coredns/coredns
    )
    echo "build.sh: coredns done after $(( $(date +%s) - start ))s" >&2
    # Sanity: the kubelet must report the pinned version (the API server's version
    # skew checks and the e2e framework read it).
    got="$("$STAGE/kubelet" --version 2>&1 || true)"
    if [[ "$got" != "Kubernetes $K8S_VERSION" ]]; then
        echo "build.sh: kubelet --version says '$got', want 'Kubernetes $K8S_VERSION'" >&2
        exit 1
    fi
elif [[ $target == control ]]; then
    # --- etcd -----------------------------------------------------------------
    (
        cd "$HERE/etcd"
        "$GO" build -p "$P" -trimpath \
            -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$ETCD_VERSION" \
            -o "$STAGE/etcd" go.etcd.io/etcd/server/v3
    )
    echo "build.sh: etcd done after $(( $(date +%s) - start ))s" >&2
    # Sanity: the apiserver must report the pinned version.
    got="$("$STAGE/kube-apiserver" --version 2>&1 || true)"
    if [[ "$got" != "Kubernetes $K8S_VERSION" ]]; then
        echo "build.sh: kube-apiserver --version says '$got', want 'Kubernetes $K8S_VERSION'" >&2
        exit 1
    fi
fi

mkdir -p "$BIN_DIR"
rm -f "$OUT/BUILD-OK"
for b in "${BINS[@]}"; do
    mv -f "$STAGE/$b" "$BIN_DIR/$b"
done
{
    echo "TARGET=$target"
    echo "K8S_VERSION=$K8S_VERSION"
    echo "ETCD_VERSION=$ETCD_VERSION"
    echo "CONTAINERD_VERSION=$CONTAINERD_VERSION"
    echo "COREDNS_VERSION=$COREDNS_VERSION"
    echo "KIND_VERSION=$KIND_VERSION"
    echo "BUILT=$build_date"
    echo "GO=$("$GO" env GOVERSION)"
    echo "SECONDS=$(( $(date +%s) - start ))"
} > "$OUT/BUILD-OK"
echo "build.sh: done in $(( $(date +%s) - start ))s" >&2
echo "$BIN_DIR"
