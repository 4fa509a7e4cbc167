#!/bin/sh
# Writes deploy/kxlb.yaml, the single-file manifest for `kubectl apply -f`: the kustomize
# base with the kind overlay, rendered. tests/controller/test_deploy.py runs this to a
# temporary file and fails if deploy/kxlb.yaml differs, so that deploy/base and
# deploy/overlays/kind stay the one source. KUBECTL names the kubectl (default: the PATH's).
#   deploy/render.sh [OUTPUT]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/kxlb.yaml}
rendered=$("${KUBECTL:-kubectl}" kustomize "$here/overlays/kind")
cat >"$out" <<HEADER
# kxlb on a kind cluster in one file, for \`kubectl apply -f deploy/kxlb.yaml\`: the kustomize
# base (deploy/base: the DaemonSet, its RBAC and ConfigMap, with the reasons for each
# setting) and the kind overlay (deploy/overlays/kind), rendered by deploy/render.sh.
# Do not edit: change those and run deploy/render.sh. Other clusters: an overlay of their
# own (docs/operations.md, "Installing kxlb as a DaemonSet").
$rendered
HEADER
