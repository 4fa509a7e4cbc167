"""The two service proxies' container images, for the DaemonSets of real-kubelet labs.

**kxlb** (deploy/kxlb.yaml's ``kxlb:dev``): what deploy/Dockerfile installs, built without
a registry or a container engine. The Dockerfile installs Debian's python3 and BCC, then
``pip install`` of the project. Here the Debian part is taken from this machine's own
packages (the same Debian release and the same ``python3-bpfcc`` the venv runs with):
the files of the Python and BCC packages (``dpkg -L``), plus every shared library that
the interpreter, BCC, libbpf and bpftool load (``ldd``). The project part is a real
``pip install --target`` of this checkout, with its runtime dependencies. Kernel headers
are not in the image; the DaemonSet mounts the node's /lib/modules and /usr/src, as
Cilium's and BCC's images do.

**kube-proxy** (``registry.k8s.io/kube-proxy:<version>``, the name kubeadm deploys): the
static binary of the lab's build, with nft and both iptables backends as upstream's
distroless-iptables image has them.

Both are cached by content under ``$KXLB_CACHE/images`` (default /var/cache/kxlb), so a
second lab reuses the archive and only a change to the project's sources rebuilds kxlb's.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterable

from . import images
from .images import Entry, ImageConfig, ImageError

KXLB_IMAGE = "docker.io/library/kxlb:dev"     # `image: kxlb:dev`, as containerd names it
PYTHON = Path("/usr/bin/python3.11")           # Debian's, the one python3-bpfcc is built for
# The Debian packages whose files the kxlb image carries (deploy/Dockerfile installs them).
KXLB_DEBIAN_PACKAGES = ("python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib",
                        "python3-bpfcc")
# Libraries loaded with dlopen (ldd of the binaries does not list them).
KXLB_DLOPENED = (Path("/usr/lib/x86_64-linux-gnu/libbcc.so.0"), Path("/usr/lib/x86_64-linux-gnu/libbpf.so.1"))
BPFTOOL = Path("/usr/sbin/bpftool")            # cgroup detach of the socket programs
# What pip installs: the project's importable sources and build files.
PROJECT_SOURCES = ("kxlb", "loader", "controller", "lab", "bpf")
PROJECT_FILES = ("pyproject.toml", "setup.py", "README.md")
SITE = "/usr/local/lib/python3.11/dist-packages"   # on Debian python's sys.path

KUBE_PROXY_REPO = "registry.k8s.io/kube-proxy"
# kube-proxy's userland: nft for the nftables mode (knftables runs it), and both iptables
# backends with their save/restore tools; the xtables modules are dlopened by name.
KUBE_PROXY_TOOLS = ("/usr/sbin/nft", "/usr/sbin/xtables-nft-multi", "/usr/sbin/xtables-legacy-multi")
XTABLES_DIR = Path("/usr/lib/x86_64-linux-gnu/xtables")
LEGACY_DIR = "/usr/local/sbin/iptables-legacy"
IPTABLES_NAMES = ("iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save",
                  "ip6tables-restore")


def cache_dir() -> Path:
    return Path(os.environ.get("KXLB_CACHE", "/var/cache/kxlb")) / "images"


def _digest_of_files(paths: Iterable[Path], root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def project_key(project: Path) -> str:
    """A digest of what ``pip install`` of *project* reads (caches ignored)."""
    files = [project / f for f in PROJECT_FILES if (project / f).is_file()]
    for d in PROJECT_SOURCES:
        files += [p for p in (project / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix in (".py", ".c", ".h", ".yaml", ".toml", ".sh")]
    return _digest_of_files(files, project)


def dpkg_files(package: str) -> list[Path]:
    """The files (not directories) *package* installed, without its docs."""
    r = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True)
    if r.returncode:
        raise ImageError(f"dpkg -L {package}: {r.stderr.strip()} (is the package installed? setup.sh installs it)")
    out = []
    for line in r.stdout.splitlines():
        p = Path(line)
        if line.startswith(("/usr/share/doc/", "/usr/share/man/", "/usr/share/lintian/")):
            continue
        if p.is_symlink() or p.is_file():
            out.append(p)
    return out


def _host_files(paths: Iterable[tuple[str, Path]], seen: set[str]) -> list[Entry]:
    """Entries for (path in the image, file of this machine) pairs: symlinks stay symlinks;
    paths in *seen* are skipped, and added."""
    out = []
    for path, p in paths:
        if path in seen:
            continue
        seen.add(path)
        out.append(Entry(path, link=os.readlink(p)) if p.is_symlink()
                   else Entry(path, source=p, mode=p.stat().st_mode & 0o7777))
    return out


def _tree(src: Path, dest: str) -> list[tuple[str, Path]]:
    """Every file under directory *src*, as (its path under *dest*, the file)."""
    return [(f"{dest}/{p.relative_to(src)}", p) for p in sorted(src.rglob("*"))
            if p.is_symlink() or not p.is_dir()]


def pip_install(project: Path, dest: Path, python: str = sys.executable) -> Path:
    """``pip install --target`` of *project* with its runtime dependencies (what the
    Dockerfile's ``pip install /opt/kxlb`` does), into *dest*; kept when it exists."""
    if (dest / ".complete").exists():
        return dest
    stage = dest.with_name(dest.name + ".stage")
    shutil.rmtree(stage, ignore_errors=True)
    r = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--no-compile", "--no-warn-script-location", "--target", str(stage), str(project)],
                       capture_output=True, text=True)
    if r.returncode:
        raise ImageError(f"kxlb image: pip install of {project} failed:\n{(r.stderr or r.stdout).strip()[-3000:]}")
    shutil.rmtree(stage / "bin", ignore_errors=True)   # scripts with this machine's venv in their #!
    (stage / ".complete").write_text("")
    shutil.rmtree(dest, ignore_errors=True)
    stage.rename(dest)
    return dest


KXLB_ENTRYPOINT = b"""#!/usr/bin/python3
import sys
from kxlb.cli import main
sys.exit(main())
"""


def kxlb_image(project: Path, out: Path | None = None, ref: str = KXLB_IMAGE) -> Path:
    """kxlb's image as an OCI archive (cached by the project's content); returns its path."""
    out = out or cache_dir()
    key = project_key(project)
    archive = out / f"kxlb-{key}.tar"
    if archive.exists():
        return archive
    out.mkdir(parents=True, exist_ok=True)
    site = pip_install(project, out / "build" / f"kxlb-site-{key}")
    # Layer 1, Debian: busybox (sh for `kubectl exec`), the interpreter, BCC and bpftool with
    # the libraries they and every extension module load.
    base = images.userland_entries(extra=(PYTHON, BPFTOOL, *KXLB_DLOPENED))
    seen = {"/" + e.name for e in base}
    debian = [f for pkg in KXLB_DEBIAN_PACKAGES for f in dpkg_files(pkg)]
    base += images.with_libraries([f for f in debian if ".so" in f.name and not f.is_symlink()], seen)
    # The extension modules go to the image with pip's tree below; here only their libraries.
    extensions = [p for p in site.rglob("*.so*") if p.is_file()]
    base += [e for e in images.with_libraries(extensions, set(seen)) if not e.path.startswith(str(site))]
    seen.update("/" + e.name for e in base)
    base += _host_files(((str(f), f) for f in debian), seen)
    base += [Entry("/usr/bin/python3", link="python3.11")] if "/usr/bin/python3" not in seen else []
    # Layer 2, the project: pip's install, and the `kxlb` command the DaemonSet runs.
    app = _host_files(_tree(site, SITE), seen) + [Entry("/usr/local/bin/kxlb", data=KXLB_ENTRYPOINT, mode=0o755)]
    layout = out / "build" / f"kxlb-{key}"
    images.write_layout(layout, ref, [images.layer_tar(base), images.layer_tar(app)],
                        ImageConfig(labels={"org.opencontainers.image.source": "kxlb", "kxlb.project-key": key}))
    images.write_archive(layout, archive)
    shutil.rmtree(layout)
    _prune(out, "kxlb-*.tar", keep=archive)
    _prune(out / "build", "kxlb-site-*", keep=site)
    return archive


def _prune(d: Path, pattern: str, keep: Path, n: int = 2) -> None:
    """Keep the *n* newest of *pattern* in *d* (each kxlb image is ~400 MB)."""
    old = sorted((p for p in d.glob(pattern) if p != keep), key=lambda p: p.stat().st_mtime, reverse=True)
    for p in old[n - 1:]:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def kube_proxy_image(kube_proxy: Path, version: str, out: Path | None = None) -> tuple[str, Path]:
    """registry.k8s.io/kube-proxy:<version> as an OCI archive; returns (reference, path)."""
    ref = f"{KUBE_PROXY_REPO}:{version}"
    out = out or cache_dir()
    tools = [Path(t) for t in KUBE_PROXY_TOOLS]
    xt = sorted(XTABLES_DIR.glob("*.so"))
    key = _digest_of_files([kube_proxy, *tools], Path("/"))
    archive = out / f"kube-proxy-{version}-{key}.tar"
    if archive.exists():
        return ref, archive
    out.mkdir(parents=True, exist_ok=True)
    base = images.userland_entries(extra=tools)
    base += _host_files(((str(f), f) for f in xt), {"/" + e.name for e in base})
    # The iptables names as Debian's alternatives point them, one set per backend; the
    # plain names are the nf_tables backend, as in upstream's image (the lab's legacy
    # mode, like kind's iptables-wrapper, is chosen per node by the lab, not here).
    for name in IPTABLES_NAMES:
        base += [Entry(f"/usr/sbin/{name}", link="xtables-nft-multi"),
                 Entry(f"/usr/sbin/{name.replace('tables', 'tables-nft', 1)}", link="xtables-nft-multi"),
                 Entry(f"/usr/sbin/{name.replace('tables', 'tables-legacy', 1)}", link="xtables-legacy-multi")]
    for name in IPTABLES_NAMES:   # first on PATH for the legacy backend (KUBE_PROXY_LEGACY_PATH)
        base.append(Entry(f"{LEGACY_DIR}/{name}", link="/usr/sbin/xtables-legacy-multi"))
    top = images.layer_tar([Entry("/usr/local/bin/kube-proxy", source=kube_proxy, mode=0o755)])
    layout = out / "build" / f"kube-proxy-{key}"
    images.write_layout(layout, ref, [images.layer_tar(base), top],
                        ImageConfig(entrypoint=("/usr/local/bin/kube-proxy",)))
    images.write_archive(layout, archive)
    shutil.rmtree(layout)
    return ref, archive
