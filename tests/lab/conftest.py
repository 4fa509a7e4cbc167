"""Fixtures for tests against the Kubernetes lab (lab/cluster.py).

- ``lab`` (session): control plane + 2 nodes + client, ``--proxy none``. A lab of its own
  (name ``kxlt``, work directory ``$TMPDIR/kxlb-test-lab``, ports shifted by 3000), so
  it never touches a lab a developer runs with ``kxlb lab up``. Cleaned up at the end.
- ``api``: a kubernetes ApiClient (admin).
- ``namespace``: a fresh Kubernetes namespace per test, deleted afterwards.
- ``k8s``: ``kxlb.lab.kube.Namespace`` bound to that namespace: ``deployment()``,
  ``service()``, ``pod()``, ``scale()``, ``ready_pods()``, ``wait_endpoints()``,
  ``set_ready()``, ``endpoints()``, ``delete_pod()``.
- ``kube_proxy``: the session lab with the real kube-proxy (nftables) on every node for
  the duration of the test; back to ``none`` afterwards.
- ``lab_of_its_own(...)`` and ``namespace_in(lab, request)``: context managers for a
  module's own lab, with options the session lab does not have (strict rp_filter, a small
  NodePort range, a small masquerade range), and a Kubernetes namespace in it.
- ``with_proxy``: a function ``with_proxy("kxlb" | "kube-proxy" | "none") -> Lab`` that
  switches the session lab's proxy for this test (fails, never skips, if ``kxlb`` is
  not available); back to ``none`` afterwards. For differential tests::

      @pytest.mark.parametrize("proxy", ["kube-proxy", "kxlb"])
      def test_x(with_proxy, k8s, proxy):
          lab = with_proxy(proxy)

Tests marked ``lab_lifecycle`` tear the session lab down: they run last.

Needs root and the binaries of lab/k8s/build.sh; a cold cache is built first (about 11
minutes on 2 cores, not counted in the tests' own timeouts).
"""
from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from kxlb.lab import controlplane as cpmod
from kxlb.lab import kube
from kxlb.lab.cluster import Lab

TEST_WORKDIR = Path(tempfile.gettempdir()) / "kxlb-test-lab"
TEST_NAME = "kxlt"
TEST_PORT_OFFSET = 3000
BUILD_TIMEOUT = 3600


def make_lab(proxy: str = "none") -> Lab:
    return Lab(TEST_WORKDIR, name=TEST_NAME, nodes=2, proxy=proxy, port_offset=TEST_PORT_OFFSET,
               log=lambda m: print(f"lab: {m}", flush=True))


def pytest_configure(config):
    config.addinivalue_line("markers", "lab_lifecycle: tears the session lab down; runs after every other test")


def pytest_collection_modifyitems(session, config, items):
    last = [i for i in items if i.get_closest_marker("lab_lifecycle")]
    if last:
        items[:] = [i for i in items if not i.get_closest_marker("lab_lifecycle")] + last


@pytest.fixture(scope="session")
def lab_bin_dir() -> Path:
    if os.geteuid() != 0:
        pytest.fail("the lab tests must run as root")
    return cpmod.ensure_binaries(timeout=BUILD_TIMEOUT)


@contextlib.contextmanager
def lab_of_its_own(name: str, port_offset: int, **options) -> Iterator[Lab]:
    """A lab beside the session lab (its own name, work directory and ports), with
    *options* (``Lab``'s: rp_filter, node_port_range, masquerade_ports), no proxy at first;
    down at the end."""
    lab = Lab(Path(tempfile.gettempdir()) / f"kxlb-test-{name}", name=name, nodes=2, proxy="none",
              port_offset=port_offset, log=lambda m: print(f"lab {name}: {m}", flush=True), **options)
    lab.up(build=False)
    try:
        yield lab
    finally:
        lab.down()


@contextlib.contextmanager
def namespace_in(lab: Lab, request) -> Iterator[kube.Namespace]:
    """A fresh Kubernetes namespace of *lab* named after the test; deleted afterwards."""
    api = lab.api_client()
    base = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower().removeprefix("test_"))[:40].strip("-")
    name = kube.create_namespace(api, f"t-{base}-")
    try:
        yield kube.Namespace(api, name)
    finally:
        kube.delete_namespace(api, name)
        api.close()


@pytest.fixture(scope="session")
def lab(lab_bin_dir) -> Lab:
    lab = make_lab()
    lab.up(build=False)
    yield lab
    lab.down()


@pytest.fixture
def api(lab):
    client = lab.api_client()
    yield client
    client.close()


@pytest.fixture
def namespace(lab, api, request) -> str:
    if not lab.status(probe=False)["up"]:
        lab.up(build=False)  # a lifecycle test before us left it down
    base = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower().removeprefix("test_"))[:40].strip("-")
    name = kube.create_namespace(api, f"t-{base}-")
    yield name
    kube.delete_namespace(api, name)


@pytest.fixture
def k8s(api, namespace) -> kube.Namespace:
    return kube.Namespace(api, namespace)


@pytest.fixture
def kube_proxy(lab) -> Lab:
    lab.set_proxy("kube-proxy")
    yield lab
    lab.set_proxy("none")


@pytest.fixture
def with_proxy(lab):
    def use(mode: str) -> Lab:
        actual = lab.set_proxy(mode)
        if actual != mode:
            pytest.fail(f"proxy {mode} is not available (the lab fell back to {actual})")
        return lab
    yield use
    lab.set_proxy("none")


def echo_service_and_client(lab: Lab, k8s: kube.Namespace):
    """3 echo pods behind Service "echo", and a client pod on node 2, all ready and
    published. Returns (cluster IP, pod names, pods, the client pod's netns)."""
    k8s.deployment("echo", 3)
    svc = k8s.service("echo")
    client = k8s.pod("client", ports=[], node_name=lab.node(2).name)
    pods = k8s.ready_pods("echo", 3)
    k8s.ready_pods("app=client", 1)
    k8s.wait_endpoints("echo", [p["status"]["podIP"] for p in pods])
    cns = lab.resolve_target(f"{k8s.name}/{client['metadata']['name']}")[0]
    return svc["spec"]["clusterIP"], {p["metadata"]["name"] for p in pods}, pods, cns
