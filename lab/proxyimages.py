"""The two service proxies' container images, for the DaemonSets of real-kubelet labs.

**kxlb** (deploy/kxlb.yaml's ``kxlb:dev``): the image of deploy/Dockerfile, built by
buildah (lab/imagebuild.py; ``make image`` builds the same) and exported as an OCI
archive: the lab runs what a cluster would, not a recipe of its own. It ships Debian's
kernel headers, so the pod compiles the datapath on a node without any.

**kube-proxy** (``registry.k8s.io/kube-proxy:<version>``, the name kubeadm deploys): the
static binary of the lab's build, with nft and both iptables backends as upstream's
distroless-iptables image has them.

Both are cached by content under ``$KXLB_CACHE/images`` (default /var/cache/kxlb), so a
second lab reuses the archive and only a change to the image's inputs rebuilds kxlb's.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterable

from . import images, imagebuild
from .imagebuild import cache_dir
from .images import Entry, ImageConfig

KXLB_IMAGE = "docker.io/library/kxlb:dev"     # `image: kxlb:dev`, as containerd names it

KUBE_PROXY_REPO = "registry.k8s.io/kube-proxy"
# kube-proxy's userland: nft for the nftables mode (knftables runs it), and both iptables
# backends with their save/restore tools; the xtables modules are dlopened by name.
KUBE_PROXY_TOOLS = ("/usr/sbin/nft", "/usr/sbin/xtables-nft-multi", "/usr/sbin/xtables-legacy-multi")
XTABLES_DIR = Path("/usr/lib/x86_64-linux-gnu/xtables")
LEGACY_DIR = "/usr/local/sbin/iptables-legacy"
IPTABLES_NAMES = ("iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save",
                  "ip6tables-restore")


def _digest_of_files(paths: Iterable[Path], root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


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


def kxlb_image(project: Path, out: Path | None = None, ref: str = KXLB_IMAGE) -> Path:
    """kxlb's image as an OCI archive named *ref*: deploy/Dockerfile built by buildah
    (lab/imagebuild.py), cached by a digest of its inputs; returns its path."""
    return imagebuild.kxlb_image_archive(project, out or cache_dir(), ref)


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
