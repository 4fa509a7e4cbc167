"""The lab control plane: up, a real API round trip with the official client, down.

Needs root and the binaries of lab/k8s/build.sh. When the build cache is cold
the fixture builds them first (about 11 minutes on 2 cores, not counted in the
tests' own timeouts); CI had better run ``lab/k8s/build.sh`` as a step of its
own before pytest. With the binaries there the whole file takes ~15 s.

Work directories are fixed paths (not tmp_path), so a run killed half-way is
cleaned up by the next one: up() stops whatever carries its workdir's marker.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from kxlb.lab import controlplane as cpmod, procs
from kxlb.lab.controlplane import APISERVER, ControlPlane, ControlPlaneError, Ports

# Own ports, interface and address, so the test never collides with a lab a developer runs.
TEST_PORTS = Ports().shifted(1000)
TEST_IFACE = "kxlb-apitst0"
TEST_ADDR = "10.254.0.2"
WORKDIRS = Path(tempfile.gettempdir()) / "kxlb-test-controlplane"
BUILD_TIMEOUT = 3600


def _import_client():
    try:
        from kubernetes import client, config  # type: ignore
    except ImportError as e:  # pragma: no cover
        pytest.fail(f"the `kubernetes` Python client is required: {e}")
    return client, config


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    if os.geteuid() != 0:
        pytest.fail("this test must run as root")
    return cpmod.ensure_binaries(timeout=BUILD_TIMEOUT)


def _assert_gone(cp: ControlPlane, pids: list[int]) -> None:
    for pid in pids:
        assert not procs.alive(pid), f"pid {pid} still runs"
    assert procs.marked_pids(cpmod.MARKER_ENV, cp.marker) == []
    assert not Path(f"/sys/class/net/{cp.iface}").exists()


# func_only: a cold build in the fixture is bounded by BUILD_TIMEOUT, not by this.
@pytest.mark.timeout(300, func_only=True)
def test_controlplane_up_service_down(bin_dir: Path) -> None:
    client, config = _import_client()
    workdir = WORKDIRS / "main"
    cp = ControlPlane(workdir, bin_dir, ports=TEST_PORTS, iface=TEST_IFACE, advertise_address=TEST_ADDR)
    cp.down()  # nothing to do (or the leftovers of a killed run): must not fail
    pids: list[int] = []
    try:
        t0 = time.monotonic()
        cp.up()
        up_s = time.monotonic() - t0
        print(f"control plane up in {up_s:.1f}s")

        st = cp.status()
        assert st["up"], json.dumps(st, indent=2)
        assert st["iface"]["present"]
        assert all(c["running"] and c["healthy"] for c in st["components"].values())
        pids = cp.pids()
        assert len(pids) == 4, pids

        # up() again on a healthy plane is a no-op: same processes.
        cp.up()
        assert cp.pids() == pids

        # kube-apiserver --version is the pinned release.
        ver = subprocess.run([str(bin_dir / "kube-apiserver"), "--version"],
                             capture_output=True, text=True).stdout.strip()
        k8s_ver = subprocess.run(["bash", str(cpmod.BUILD_SH), "--versions"], capture_output=True,
                                 text=True, check=True).stdout.splitlines()[0].split("=", 1)[1]
        assert ver == f"Kubernetes {k8s_ver}"

        api = config.new_client_from_config(config_file=str(cp.admin_kubeconfig))
        try:
            core = client.CoreV1Api(api)
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="kxlb-test")))
            svc = core.create_namespaced_service(
                "kxlb-test",
                client.V1Service(
                    metadata=client.V1ObjectMeta(name="web"),
                    spec=client.V1ServiceSpec(
                        type="ClusterIP",
                        selector={"app": "web"},
                        ports=[client.V1ServicePort(name="http", port=80, target_port=8080, protocol="TCP")],
                    ),
                ),
            )
            ip = ipaddress.ip_address(svc.spec.cluster_ip)
            assert ip in ipaddress.ip_network("10.96.0.0/16"), ip
            assert str(ip) != "10.96.0.1"
            got = core.read_namespaced_service("web", "kxlb-test")
            assert got.spec.cluster_ip == svc.spec.cluster_ip

            # The built-in `kubernetes` Service: first IP of the range, endpoint = the advertise address.
            kube = core.read_namespaced_service("kubernetes", "default")
            assert kube.spec.cluster_ip == "10.96.0.1"
            ep = core.read_namespaced_endpoints("kubernetes", "default")
            addrs = [a.ip for s in ep.subsets for a in s.addresses]
            assert addrs == [TEST_ADDR], addrs
            assert ep.subsets[0].ports[0].port == TEST_PORTS.apiserver

            # The controller-manager works: the namespace got its default ServiceAccount.
            deadline = time.monotonic() + 60
            while True:
                names = [s.metadata.name for s in core.list_namespaced_service_account("kxlb-test").items]
                if "default" in names or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert "default" in names
        finally:
            api.close()

        # kubectl from the same cache talks to it with the same kubeconfig.
        out = subprocess.run([str(bin_dir / "kubectl"), f"--kubeconfig={cp.admin_kubeconfig}",
                              "get", "svc", "-n", "kxlb-test", "web", "-o", "jsonpath={.spec.clusterIP}"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout == svc.spec.cluster_ip

        # down() from a *new* instance (as a CLI in another process would), with one
        # pidfile lost as after a crash: the environment marker must still find it.
        (workdir / "run" / "etcd.pid").unlink()
        ControlPlane.from_workdir(workdir).down()
    finally:
        cp.down()

    _assert_gone(cp, pids)
    st = cp.status()
    assert not st["up"] and not any(c["running"] for c in st["components"].values())
    cp.down()  # idempotent
    cp.down(purge=True)
    assert not workdir.exists()


@pytest.mark.timeout(180, func_only=True)
def test_start_failure_names_component_and_log(bin_dir: Path) -> None:
    ports = TEST_PORTS.shifted(100)
    workdir = WORKDIRS / "fail"
    cp = ControlPlane(workdir, bin_dir, ports=ports, iface="kxlb-apitst1", advertise_address="10.254.0.3",
                      extra_args={APISERVER: ["--no-such-flag"]})
    try:
        with pytest.raises(ControlPlaneError) as ei:
            cp.up()
        msg = str(ei.value)
        assert "kube-apiserver exited" in msg, msg
        assert str(cp.log_path(APISERVER)) in msg, msg
        assert "no-such-flag" in msg, msg  # the log tail is in the message
        # A failed up() stopped what it had started (etcd) and removed the interface.
        _assert_gone(cp, [])

        # A port taken by someone else: refused before anything starts, naming it.
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", ports.apiserver))
            s.listen()
            ok = ControlPlane(workdir, bin_dir, ports=ports, iface="kxlb-apitst1",
                              advertise_address="10.254.0.3")
            with pytest.raises(ControlPlaneError) as ei:
                ok.up()
            assert f"kube-apiserver: port 127.0.0.1:{ports.apiserver} is already in use" in str(ei.value)
            _assert_gone(ok, [])
    finally:
        cp.down(purge=True)
