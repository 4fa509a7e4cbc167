"""Shared fixtures. Tests that need root or BPF fail (never skip) without them."""
from __future__ import annotations

import os
import shutil

import pytest

from kxlb.lab.netlab import NetLab, cleanup_stale, unique_tag


def pytest_configure(config):
    if os.geteuid() != 0:
        raise pytest.UsageError("kxlb tests need root (BPF, network namespaces): run `make test`")


@pytest.fixture(scope="session", autouse=True)
def _stale():
    """Remove namespaces and pins of earlier runs that crashed."""
    cleanup_stale()
    yield


@pytest.fixture(scope="session")
def pin_dirs():
    """Unique bpffs pin directories, removed at the end of the session."""
    made: list[str] = []

    def make() -> str:
        made.append(f"/sys/fs/bpf/{unique_tag()}")
        return made[-1]

    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def netlab():
    with NetLab() as lab:
        yield lab


@pytest.fixture(scope="module")
def dp(pin_dirs):
    """The datapath compiled and loaded once per test module (maps pinned in a unique
    directory), for BPF_PROG_TEST_RUN."""
    from kxlb.loader.compile import compile_datapath
    from kxlb.loader.maps import Maps

    pin = pin_dirs()
    datapath = compile_datapath(pin)
    maps = Maps.open(pin)
    yield datapath, maps
    maps.close()


@pytest.fixture(params=["tc", "xdp"])
def hook(request, dp):
    """Each case on both hooks."""
    from harness import Hook

    datapath, _ = dp
    return Hook(request.param, datapath.tc_fd if request.param == "tc" else datapath.xdp_fd)


@pytest.fixture
def complete(dp):
    """tc ingress with CHECKSUM_COMPLETE skbs (harness.CompleteHook)."""
    from harness import CompleteHook

    return CompleteHook(dp[0].tc_fd)


@pytest.fixture
def egress(dp):
    """The tc egress program (what the node itself sends)."""
    from harness import Hook

    return Hook("tc", dp[0].tc_egress_fd)
