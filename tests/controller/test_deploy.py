"""deploy/: the DaemonSet and its RBAC against the real API server (kind itself cannot
run here): the manifests pass server-side validation, and the ServiceAccount may do
exactly what the controller does."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kxlb.lab import controlplane as cpmod

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def kubectl(cp, *args):
    return subprocess.run([str(cpmod.default_bin_dir() / "kubectl"), "--kubeconfig", str(cp.admin_kubeconfig), *args],
                          capture_output=True, text=True, timeout=60)


def test_daemonset_manifest_passes_server_side_validation(cp):
    r = kubectl(cp, "apply", "--dry-run=server", "-f", str(DEPLOY / "kxlb.yaml"))
    assert r.returncode == 0, r.stderr
    assert "daemonset.apps/kxlb created (server dry run)" in r.stdout


@pytest.fixture(scope="module")
def applied(cp):
    r = kubectl(cp, "apply", "-f", str(DEPLOY / "kxlb.yaml"))
    assert r.returncode == 0, r.stderr
    yield
    kubectl(cp, "delete", "-f", str(DEPLOY / "kxlb.yaml"), "--wait=false")


@pytest.mark.parametrize("verb, resource, allowed", [
    ("watch", "services", "yes"), ("list", "endpointslices.discovery.k8s.io", "yes"),
    ("watch", "nodes", "yes"), ("create", "events", "yes"), ("watch", "servicecidrs.networking.k8s.io", "yes"),
    ("create", "services", "no"), ("list", "secrets", "no"),
])
def test_rbac_grants_what_the_controller_uses_and_no_more(cp, applied, verb, resource, allowed):
    r = kubectl(cp, "auth", "can-i", verb, resource, "--as", "system:serviceaccount:kube-system:kxlb")
    assert r.stdout.strip() == allowed, (r.stdout, r.stderr)
