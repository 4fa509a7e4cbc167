#!/usr/bin/env bash
# Build the Kubernetes control-plane binaries the lab needs, from Go modules.
#
#   kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl
#       from k8s.io/kubernetes (module in this directory: go.mod pins one
#       release and replaces every staging module by its published k8s.io/*
#       v0.X.Y version)
#   etcd
#       from go.etcd.io/etcd/server/v3 (separate module in ./etcd, so its
#       dependency graph does not fight with Kubernetes')
#
# The binaries go to a cache OUTSIDE the checkout, keyed by the versions:
#   ${KXLB_CACHE:-/var/cache/kxlb}/k8s/<k8s-version>-<etcd-version>/bin/
# A run whose binaries all exist does nothing (warm run: well under a second).
# The last line on stdout is always the bin dir; everything else goes to stderr.
#
# Usage: lab/k8s/build.sh [--force] [--print-bin-dir] [--versions]
#   --force          rebuild even if the binaries exist
#   --print-bin-dir  print the bin dir and exit (no build, no go needed)
#   --versions       print K8S_VERSION=... ETCD_VERSION=... and exit
# Environment:
#   KXLB_CACHE       cache root (default /var/cache/kxlb)
#   KXLB_GO          go command (default: go)
#   KXLB_BUILD_P     go build -p (default 2; the lab machines have 2 cores)
#   GOTOOLCHAIN      default "auto": a go older than the modules' go line
#                    fetches the right toolchain from the module proxy
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

K8S_BINS=(kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl)
ETCD_BINS=(etcd)

# Versions come from the go.mod files: they are the single source of truth.
modver() { # modver <go.mod> <module path>
    awk -v m="$2" '
        $1 == m && $2 ~ /^v/ { print $2; exit }
        $1 == "require" && $2 == m && $3 ~ /^v/ { print $3; exit }
    ' "$1"
}
K8S_VERSION="$(modver "$HERE/go.mod" k8s.io/kubernetes)"
ETCD_VERSION="$(modver "$HERE/etcd/go.mod" go.etcd.io/etcd/server/v3)"
if [[ -z "$K8S_VERSION" || -z "$ETCD_VERSION" ]]; then
    echo "build.sh: cannot read versions from $HERE/go.mod / $HERE/etcd/go.mod" >&2
    exit 1
fi

CACHE_ROOT="${KXLB_CACHE:-/var/cache/kxlb}"
KEY="${K8S_VERSION}-${ETCD_VERSION}"
OUT="$CACHE_ROOT/k8s/$KEY"
BIN_DIR="$OUT/bin"

force=0
for a in "$@"; do
    case "$a" in
        --force) force=1 ;;
        --print-bin-dir) echo "$BIN_DIR"; exit 0 ;;
        --versions) echo "K8S_VERSION=$K8S_VERSION"; echo "ETCD_VERSION=$ETCD_VERSION"; exit 0 ;;
        -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build.sh: unknown argument: $a" >&2; exit 2 ;;
    esac
done

all_present() {
    local b
    for b in "${K8S_BINS[@]}" "${ETCD_BINS[@]}"; do
        [[ -x "$BIN_DIR/$b" ]] || return 1
    done
    [[ -f "$OUT/BUILD-OK" ]]
}

if [[ $force == 0 ]] && all_present; then
    echo "build.sh: k8s $K8S_VERSION / etcd $ETCD_VERSION already built" >&2
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

GO="${KXLB_GO:-go}"
if ! command -v "$GO" >/dev/null 2>&1; then
    echo "build.sh: '$GO' not found; install Go >= 1.26 (apt/golang.org) or set KXLB_GO" >&2
    exit 1
fi
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
echo "build.sh: building k8s $K8S_VERSION + etcd $ETCD_VERSION into $BIN_DIR ($("$GO" version), -p $P)" >&2

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
pkgs=()
for b in "${K8S_BINS[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
(
    cd "$HERE"
    # Tags as upstream's non-debug build (hack/lib/golang.sh).
    "$GO" build -p "$P" -trimpath -tags selinux,notest,grpcnotrace \
        -ldflags "${ld[*]}" -o "$STAGE/" "${pkgs[@]}"
)
echo "build.sh: kubernetes done after $(( $(date +%s) - start ))s" >&2

# --- etcd -------------------------------------------------------------------
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

mkdir -p "$BIN_DIR"
rm -f "$OUT/BUILD-OK"
for b in "${K8S_BINS[@]}" "${ETCD_BINS[@]}"; do
    mv -f "$STAGE/$b" "$BIN_DIR/$b"
done
{
    echo "K8S_VERSION=$K8S_VERSION"
    echo "ETCD_VERSION=$ETCD_VERSION"
    echo "BUILT=$build_date"
    echo "GO=$("$GO" env GOVERSION)"
    echo "SECONDS=$(( $(date +%s) - start ))"
} > "$OUT/BUILD-OK"
echo "build.sh: done in $(( $(date +%s) - start ))s" >&2
echo "$BIN_DIR"
