"""Switching a lab's service proxy: stop the one that runs and clean up after it, start
the next on every node, wait until it is healthy.

A proxy runs as a process per node (the pod-agent lab: kxlb's controller, or the real
kube-proxy in the node's namespace) or, on real-kubelet nodes, as a DaemonSet from its
manifest with an image the lab builds and imports. ``lab/proxies.py`` holds the
per-node pieces (modes, command lines, manifests, health, clean-up); this module runs
them across the lab (``Lab.set_proxy``).
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from . import procs, proxies
from .errors import LabError
from .nodes import NodeSpec, netns_exists
from .proxies import PROXIES, PROXY_MODES
from .supervisor import LAB_MARKER, clean_env

if TYPE_CHECKING:
    from .cluster import Lab

REPO = Path(__file__).resolve().parent.parent


def controller_available(python: str = sys.executable) -> bool:
    """Does this checkout have `kxlb controller`?"""
    r = subprocess.run([python, "-m", "kxlb", "controller", "--help"], capture_output=True, text=True,
                       env=clean_env(LAB_MARKER, "probe"), cwd=REPO)
    return r.returncode == 0


class ProxyRunner:
    def __init__(self, lab: "Lab"):
        self.lab = lab

    @property
    def controller_options(self) -> list[str]:
        return proxies.controller_options(self.lab.node_port_range, self.lab.masquerade_ports)

    def set(self, mode: str, *, timeout: float = 120) -> str:
        """Stop the running proxy, clean up after it, start *mode* on every node and wait
        until it is healthy. kxlb falls back to none (with a warning) when this checkout
        has no `kxlb controller`. Returns the mode that runs."""
        lab = self.lab
        if mode not in PROXIES:
            raise ValueError(f"proxy must be one of {', '.join(PROXIES)}")
        lab.proxy_requested = mode
        actual = mode
        kind = PROXY_MODES[mode].kind
        if kind == "kxlb" and not controller_available():
            lab.log("WARNING: `python -m kxlb controller` is not available in this checkout; "
                    "running without a service proxy (--proxy none)")
            actual = "none"
        self.stop()
        lab._write_state({"proxy": "none"})
        if actual == "none":
            return actual
        if lab.kubelet:
            return self._start_daemonset(actual, timeout)
        for n in lab.node_specs:
            if kind == "kxlb":
                lab.sup.spawn(f"proxy-{n.name}",
                              proxies.controller_argv(n, actual, lab.port_offset, lab.kube_proxy_kubeconfig,
                                                      self.controller_options),
                              proxies.log_name(actual, n.name), extra_env={"KXLB_PIN_DIR": n.pin_dir})
            else:
                lab.sup.spawn(f"proxy-{n.name}", proxies.kube_proxy_argv(n, actual, lab.port_offset,
                                                                         lab.kube_proxy_kubeconfig, lab.bin_dir),
                              proxies.log_name(actual, n.name), cgroup=n.cgroup,
                              extra_env=proxies.iptables_env(lab.workdir, PROXY_MODES[actual].iptables))
        lab._write_state({"proxy": actual})
        try:
            self._wait_processes(actual, timeout)
        except BaseException:
            self.stop()
            lab._write_state({"proxy": "none"})
            raise
        lab.log(f"proxy {actual} healthy on {', '.join(n.name for n in lab.node_specs)}")
        return actual

    def _start_daemonset(self, mode: str, timeout: float) -> str:
        """Real-kubelet labs: *mode* as a DaemonSet from its manifest (proxies.py), with the
        image the lab builds and imports into every node; waits for every node's pod to
        answer its health endpoint."""
        lab = self.lab
        t = time.monotonic()
        from . import proxyimages
        if PROXY_MODES[mode].kind == "kxlb":
            ref, archive = proxyimages.KXLB_IMAGE, proxyimages.kxlb_image(REPO)
            docs = proxies.kxlb_daemonset(mode, api_host=lab.advertise_address, api_port=lab.api_port,
                                          cgroup_dir=lab.topology.cgroup_dir, bpffs=lab.topology.bpffs,
                                          options=self.controller_options)
        else:
            version = (lab.read_state() or {})["k8s_version"]
            ref, archive = proxyimages.kube_proxy_image(lab.bin_dir / "kube-proxy", version)
            docs = proxies.kube_proxy_daemonset(mode, image=ref, api_host=lab.advertise_address,
                                                api_port=lab.api_port)
        for n in lab.node_specs:
            lab.kubelet_node(n).import_archive(ref, archive)
        lab.log(f"{ref} built and imported into {len(lab.node_specs)} nodes in {time.monotonic() - t:.1f}s")
        manifest = lab.workdir / f"{proxies.daemonset_name(mode)}.yaml"
        import yaml
        manifest.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        lab.kubectl("apply", "-f", str(manifest))
        lab._write_state({"proxy": mode})
        deadline = time.monotonic() + timeout

        def failure(n: NodeSpec, why: str) -> LabError:
            pods = lab.kubectl("get", "pods", "-n", "kube-system", "-o", "wide", check=False).stdout
            logs = lab.kubectl("logs", "-n", "kube-system", f"daemonset/{proxies.daemonset_name(mode)}",
                               "--tail=20", check=False)
            self.stop()
            lab._write_state({"proxy": "none"})
            return LabError(f"{mode} on {n.name} not healthy after {timeout:.0f}s ({why}); "
                            f"pods:\n{pods}\nlogs:\n{logs.stdout or logs.stderr}")

        self._wait_healthy(lambda n: proxies.daemonset_health(mode, n), timeout, failure)
        # And Ready in the API (the readiness probe's next period), for whoever reads it next.
        left = max(10.0, deadline - time.monotonic())
        lab.kubectl("-n", "kube-system", "rollout", "status", f"daemonset/{proxies.daemonset_name(mode)}",
                    f"--timeout={left:.0f}s", timeout=left + 10)
        lab.log(f"proxy {mode} (DaemonSet {proxies.daemonset_name(mode)}) healthy on "
                f"{', '.join(n.name for n in lab.node_specs)}")
        return mode

    def _wait_processes(self, mode: str, timeout: float) -> None:
        lab = self.lab

        def log_of(name: str) -> Path:
            return lab.sup.log_path(proxies.log_name(mode, name))

        def check(n: NodeSpec) -> tuple[bool, str]:
            if not lab.sup.read(f"proxy-{n.name}"):
                raise LabError(f"{mode} on {n.name} exited; log {log_of(n.name)}:\n{procs.tail(log_of(n.name))}")
            return proxies.health(mode, n, lab.port_offset)

        def failure(n: NodeSpec, why: str) -> LabError:
            return LabError(f"{mode} on {n.name} not healthy after {timeout:.0f}s ({why}); "
                            f"log {log_of(n.name)}:\n{procs.tail(log_of(n.name))}")

        self._wait_healthy(check, timeout, failure)

    def _wait_healthy(self, check: Callable[[NodeSpec], tuple[bool, str]], timeout: float,
                      failure: Callable[[NodeSpec, str], LabError]) -> None:
        """Poll ``check(node)`` -> (healthy?, why not) until every node is healthy; past
        *timeout* raise ``failure(node, why)``. Whatever the proxy runs as."""
        deadline = time.monotonic() + timeout
        pending = list(self.lab.node_specs)
        while pending:
            ok, why = check(pending[0])
            if ok:
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise failure(pending[0], why)
            time.sleep(0.3)

    def stop(self) -> None:
        """Stop proxy processes (with what they forked) and remove what they left in the nodes."""
        lab = self.lab
        lab.sup.stop_roles([f"proxy-{n.name}" for n in lab.node_specs], 5.0)
        st = lab.read_state() or {}
        if lab.kubelet and st.get("state") == "up" and st.get("proxy", "none") != "none":
            # Foreground: returns once the pods are gone (their datapath stays until clear_node).
            for name in ("kxlb", "kube-proxy"):
                lab.kubectl("delete", "daemonset", "-n", "kube-system", name, "--ignore-not-found",
                            "--cascade=foreground", "--timeout=60s", check=False, timeout=90)
        for n in lab.node_specs:
            proxies.clear_node(n)
            if netns_exists(n.netns):
                lab.topology.reset_node_conf(n)  # rp_filter and accept_local as the lab set them
