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
