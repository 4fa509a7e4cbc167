#!/usr/bin/env python3
"""Print the path of a ``go`` command new enough for the lab's Go modules; fetch one if needed.

The lab's binaries (lab/k8s/build.sh) need the Go of lab/k8s/go.mod's ``go`` line. A machine
with that Go or a newer one on PATH (or in $KXLB_GO) uses it. Otherwise the toolchain pinned in
lab/k8s/go-toolchain.sum is taken from the Go module proxy, the same module ``GOTOOLCHAIN=auto``
would fetch (golang.org/toolchain), and verified against the pinned go.sum hash before it is
unpacked into $KXLB_CACHE/go/<version> (default /var/cache/kxlb). A fresh Debian 12 has no Go,
or 1.19, which predates GOTOOLCHAIN; this needs only Python's standard library.

Usage: go_toolchain.py [--check] -- prints the go command on stdout (``--check``: exit 1
instead of fetching). Environment: KXLB_GO, KXLB_CACHE, GOPROXY (first URL entry is used).
"""
from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GO_MOD = HERE.parent / "lab" / "k8s" / "go.mod"
PIN = HERE.parent / "lab" / "k8s" / "go-toolchain.sum"
MODULE = "golang.org/toolchain"
ARCHES = {"x86_64": "amd64", "aarch64": "arm64"}


class ToolchainError(Exception):
    pass


def version_tuple(v: str) -> tuple[int, ...]:
    """go1.26.8 / 1.26.0 / go1.26rc1 -> (1, 26, 8) / (1, 26, 0) / (1, 26, 0)."""
    m = re.match(r"(?:go)?(\d+)\.(\d+)(?:\.(\d+))?", v)
    if not m:
        raise ToolchainError(f"not a Go version: {v!r}")
    return tuple(int(x or 0) for x in m.groups())


def required() -> str:
    """The ``go`` line of lab/k8s/go.mod: the oldest Go that builds the lab."""
    m = re.search(r"^go (\S+)$", GO_MOD.read_text(), re.M)
    if not m:
        raise ToolchainError(f"{GO_MOD}: no go line")
    return m.group(1)


def pinned(arch: str) -> tuple[str, str]:
    """(version, h1 hash) of the pinned toolchain for *arch* (go.sum format)."""
    for line in PIN.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == MODULE and parts[1].endswith(f".linux-{arch}"):
            return parts[1], parts[2]
    raise ToolchainError(f"{PIN}: no {MODULE} line for linux-{arch}")


def go_version(go: str) -> str | None:
    """``go env GOVERSION`` of *go* without letting it switch toolchains, or None."""
    try:
        out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "GOTOOLCHAIN": "local"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.startswith("go") else None


def dirhash_h1(z: zipfile.ZipFile) -> str:
    """Go's dirhash.HashZip (the ``h1:`` of go.sum): SHA-256 over the sorted "sha256  name" lines."""
    lines = []
    for name in sorted(z.namelist()):
        if "\n" in name:
            raise ToolchainError(f"file name with a newline in the toolchain zip: {name!r}")
        lines.append(f"{hashlib.sha256(z.read(name)).hexdigest()}  {name}\n")
    return "h1:" + base64.b64encode(hashlib.sha256("".join(lines).encode()).digest()).decode()


def proxy_url() -> str:
    for entry in re.split(r"[,|]", os.environ.get("GOPROXY", "https://proxy.golang.org")):
        if entry.startswith(("https://", "http://", "file://")):
            return entry.rstrip("/")
    raise ToolchainError(f"GOPROXY={os.environ.get('GOPROXY')!r} names no proxy URL to fetch the Go toolchain from")


def fetch(version: str, h1: str, dest: Path) -> None:
    """Download *version* of the toolchain module, check *h1*, unpack it as *dest*."""
    url = f"{proxy_url()}/{MODULE}/@v/{version}.zip"
    print(f"go_toolchain: fetching {url}", file=sys.stderr)
    try:
        with urllib.request.urlopen(url, timeout=600) as r:
            data = r.read()
    except OSError as e:
        raise ToolchainError(f"fetching {url}: {e}") from e
    z = zipfile.ZipFile(io.BytesIO(data))
    got = dirhash_h1(z)
    if got != h1:
        raise ToolchainError(f"{url}: hash {got} is not the pinned {h1} ({PIN})")
    prefix = f"{MODULE}@{version}/"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for info in z.infolist():
            if not info.filename.startswith(prefix) or ".." in Path(info.filename).parts:
                raise ToolchainError(f"{url}: unexpected entry {info.filename!r}")
            rel = info.filename[len(prefix):]
            if not rel or info.is_dir():
                continue
            out = tmp / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(info))
            # Module zips carry no modes: Go's own unpacking makes bin/ and pkg/tool/ executable.
            if rel.startswith("bin/") or rel.startswith("pkg/tool/"):
                out.chmod(0o755)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)  # whole or not at all: a killed fetch leaves only a dot-dir
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"go_toolchain: {version} verified ({h1}) and unpacked in {dest}", file=sys.stderr)


def find_go(check_only: bool = False) -> str:
    need = required()
    candidates = [os.environ["KXLB_GO"]] if os.environ.get("KXLB_GO") else []
    candidates += [c for c in (shutil.which("go"), "/usr/local/go/bin/go") if c]
    for go in candidates:
        v = go_version(go)
        if v and version_tuple(v) >= version_tuple(need):
            return go
    arch = ARCHES.get(os.uname().machine)
    if not arch:
        raise ToolchainError(f"no Go >= {need} on this machine and no pinned toolchain for {os.uname().machine}")
    version, h1 = pinned(arch)
    dest = Path(os.environ.get("KXLB_CACHE", "/var/cache/kxlb")) / "go" / version.split("-", 1)[1]
    go = dest / "bin" / "go"
    if not go.exists():
        if check_only:
            raise ToolchainError(f"no Go >= {need} on this machine (the set-up fetches {version})")
        fetch(version, h1, dest)
    return str(go)


def main(argv: list[str]) -> int:
    try:
        print(find_go(check_only="--check" in argv))
    except ToolchainError as e:
        print(f"go_toolchain: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
