"""Container images without a registry: OCI image layouts written by the project.

No registry is reachable from the lab, so the images a real-kubelet node needs (pause,
agnhost, kxlb's own) are packed here and imported into each node's containerd under the
names the Kubernetes e2e framework expects (``registry.k8s.io/pause:3.10.2``, ...).

What is written follows the OCI image-spec v1.1 image layout: ``oci-layout``,
``index.json`` and content-addressed ``blobs/sha256/``: one manifest, its config
(architecture, os, rootfs diff_ids, entrypoint, env) and uncompressed tar layers. The
index names the image twice, as containerd and the OCI tools read it:
``io.containerd.image.name`` (the full reference, used by ``ctr images import``) and
``org.opencontainers.image.ref.name`` (the tag, used by umoci and skopeo).

Layers are reproducible: entries sorted, owned by root, mtime 0, parent directories
written before their children, so the same inputs give the same digests (the cache key)
on every machine.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterable, Optional

OCI_LAYOUT_VERSION = "1.0.0"
MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar"
ANN_CONTAINERD_NAME = "io.containerd.image.name"
ANN_REF_NAME = "org.opencontainers.image.ref.name"

# The e2e framework's names (k8s.io/kubernetes test/utils/image/manifest.go, v1.37.1).
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.2"
PAUSE_SOURCE = Path(__file__).resolve().parent / "pause" / "pause.c"


class ImageError(RuntimeError):
    """An image could not be built or packed; the message names the image and the step."""


@dataclass(frozen=True)
class Entry:
    """One file of a layer: a regular file (``data`` or ``source``), a directory, or a
    symlink (``link``)."""
    path: str                       # inside the image, absolute or relative to /
    data: Optional[bytes] = None
    source: Optional[Path] = None   # a file on this machine, read when the layer is made
    mode: Optional[int] = None      # default 0755 for directories, 0644 for files
    link: Optional[str] = None
    directory: bool = False

    @property
    def name(self) -> str:
        """The tar member name: relative, normalised, never escaping the root."""
        p = PurePosixPath("/", self.path)
        parts = [x for x in p.parts[1:] if x not in ("", ".")]
        if not parts or ".." in parts:
            raise ImageError(f"layer entry {self.path!r}: not a path inside the image")
        return "/".join(parts)


@dataclass(frozen=True)
class ImageConfig:
    """What the runtime reads from the image's config (OCI image-spec ``config``)."""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)
    workdir: str = "/"
    user: str = ""
    labels: dict = field(default_factory=dict)


def _split_reference(ref: str) -> tuple[str, str]:
    """``registry/name:tag`` -> (``registry/name``, ``tag``). Digests are not for us."""
    if "@" in ref:
        raise ImageError(f"image reference {ref!r}: a tag is needed, not a digest")
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon <= slash or colon == len(ref) - 1:
        raise ImageError(f"image reference {ref!r}: no tag (want registry/name:tag)")
    return ref[:colon], ref[colon + 1:]


def layer_tar(entries: Iterable[Entry]) -> bytes:
    """An uncompressed, reproducible tar layer of *entries* (parents made as needed)."""
    files: dict[str, tuple[Entry, bytes | None]] = {}
    for e in entries:
        name = e.name
        if name in files:
            raise ImageError(f"layer entry {e.path!r} given twice")
        if e.link is None and not e.directory:
            if (e.data is None) == (e.source is None):
                raise ImageError(f"layer entry {e.path!r}: give data or source (one of them)")
            try:
                body = e.data if e.data is not None else Path(e.source).read_bytes()
            except OSError as exc:
                raise ImageError(f"layer entry {e.path!r}: cannot read {e.source}: {exc.strerror}") from None
        else:
            body = None
        files[name] = (e, body)
    dirs = {"/".join(n.split("/")[:i]) for n in files for i in range(1, n.count("/") + 1)}
    names = sorted(set(files) | dirs)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            e, body = files.get(name, (Entry(name, directory=True, mode=0o755), None))
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = e.mode if e.mode is not None else (0o755 if e.directory else 0o644)
            if e.directory:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif e.link is not None:
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, e.link, 0o777
                tar.addfile(info)
            else:
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    return buf.getvalue()


def _blob(dest: Path, data: bytes) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = dest / "blobs" / "sha256" / digest.split(":", 1)[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.rename(path)
    return {"digest": digest, "size": len(data)}


def _json(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_layout(dest: Path, ref: str, layers: list[bytes], config: ImageConfig,
                 arch: str = "amd64") -> str:
    """Write an OCI image layout of one image to directory *dest* (replaced); returns
    the manifest's digest."""
    _, tag = _split_reference(ref)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    layer_descs = [{"mediaType": MT_LAYER, **_blob(dest, t)} for t in layers]
    cfg = {"architecture": arch, "os": "linux",
           "rootfs": {"type": "layers", "diff_ids": [d["digest"] for d in layer_descs]},
           "config": {k: v for k, v in (("Entrypoint", list(config.entrypoint)), ("Cmd", list(config.cmd)),
                                         ("Env", list(config.env)), ("WorkingDir", config.workdir),
                                         ("User", config.user), ("Labels", dict(config.labels))) if v}}
    manifest = {"schemaVersion": 2, "mediaType": MT_MANIFEST,
                "config": {"mediaType": MT_CONFIG, **_blob(dest, _json(cfg))}, "layers": layer_descs}
    mdesc = {"mediaType": MT_MANIFEST, **_blob(dest, _json(manifest)),
             "annotations": {ANN_CONTAINERD_NAME: ref, ANN_REF_NAME: tag},
             "platform": {"architecture": arch, "os": "linux"}}
    (dest / "oci-layout").write_bytes(_json({"imageLayoutVersion": OCI_LAYOUT_VERSION}))
    (dest / "index.json").write_bytes(_json({"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": [mdesc]}))
    return mdesc["digest"]


def build_pause(out_dir: Path, cc: str = "cc") -> Path:
    """The pause binary, static, from lab/pause/pause.c (rebuilt when the source changes)."""
    src = PAUSE_SOURCE.read_bytes()
    binary = out_dir / f"pause-{hashlib.sha256(src).hexdigest()[:12]}"
    if binary.exists():
        return binary
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_suffix(".tmp")
    r = subprocess.run([cc, "-static", "-O2", "-Wall", "-Werror", "-o", str(tmp), str(PAUSE_SOURCE)],
                       capture_output=True, text=True)
    if r.returncode:
        raise ImageError(f"pause: {cc} -static failed (libc6-dev has the static libc):\n{r.stderr.strip()}")
    os.replace(tmp, binary)
    return binary


def pause_image(out_dir: Path, ref: str = PAUSE_IMAGE) -> tuple[Path, str]:
    """The pod sandbox image: /pause alone. Returns (layout directory, manifest digest)."""
    binary = build_pause(out_dir / "build")
    layer = layer_tar([Entry("/pause", source=binary, mode=0o755)])
    layout = out_dir / "pause"
    return layout, write_layout(layout, ref, [layer], ImageConfig(entrypoint=("/pause",), env=(), user="65535:65535"))


# ---- agnhost --------------------------------------------------------------------------------
# The e2e framework's agnhost (test/utils/image/manifest.go, v1.37.1; the binary's own
# test/images/agnhost/VERSION).
AGNHOST_IMAGE = "registry.k8s.io/e2e-test-images/agnhost:2.66.1"
BUSYBOX = Path("/bin/busybox")   # Debian's busybox-static
CURL = Path("/usr/bin/curl")
# What the e2e tests run in agnhost beyond busybox, as upstream's image installs it
# (alpine's bind-tools curl netcat-openbsd iproute2 bash socat): the tests call nc with
# OpenBSD's flags (-v -t -u -z), dig, socat and ip; and `wget -q -O - -T 1`, which
# Debian's busybox 1.35 answers with a segfault (its -T), so wget is GNU wget.
E2E_TOOLS = tuple(Path(p) for p in ("/usr/bin/curl", "/usr/bin/wget", "/usr/bin/nc.openbsd", "/usr/bin/socat", "/usr/bin/dig",
                                    "/usr/bin/nslookup", "/usr/bin/host", "/usr/bin/ip", "/usr/bin/bash"))
# sh is bash: Debian's busybox-static runs its own applets before PATH (FEATURE_SH_STANDALONE),
# so its ash would run busybox's nc whatever PATH says.
E2E_ALIASES = {"/usr/bin/nc": "nc.openbsd", "/bin/sh": "/usr/bin/bash"}


def shared_libraries(binary: Path) -> list[Path]:
    """What the dynamic loader maps for *binary* (``ldd``), the loader included, as the
    paths it opens them by."""
    r = subprocess.run(["ldd", str(binary)], capture_output=True, text=True)
    if r.returncode:
        raise ImageError(f"ldd {binary}: {(r.stderr or r.stdout).strip()}")
    out = []
    for line in r.stdout.splitlines():
        parts = line.split()
        if "=>" in parts:
            path = parts[parts.index("=>") + 1]
        elif parts and parts[0].startswith("/"):
            path = parts[0]
        else:
            continue  # linux-vdso: the kernel's
        if not path.startswith("/"):
            raise ImageError(f"ldd {binary}: a library is not found: {line.strip()}")
        out.append(Path(path))
    return out


def with_libraries(paths: Iterable[Path], seen: set[str]) -> list[Entry]:
    """*paths* (executables or shared objects of this machine) at their own paths, with
    every library the loader maps for them; paths in *seen* are skipped, and added."""
    entries = []
    for binary in paths:
        if not Path(binary).exists():
            raise ImageError(f"{binary} is missing")
        for p in [Path(binary), *shared_libraries(binary)]:
            if str(p) not in seen:
                entries.append(Entry(str(p), source=p.resolve(), mode=0o755))
                seen.add(str(p))
    return entries


def userland_entries(busybox: Path = BUSYBOX, extra: Iterable[Path] = (CURL,),
                     aliases: Optional[dict[str, str]] = None) -> list[Entry]:
    """A small Debian userland: busybox-static with a link per applet (sh, nc, nslookup,
    wget, cat, ...), *extra* binaries with their libraries at the paths the loader opens
    (they win over busybox's applets), *aliases* (path: link target), and the /etc files
    a name lookup reads."""
    if not os.access(busybox, os.X_OK):
        raise ImageError(f"{busybox} is missing (Debian package busybox-static)")
    applets = subprocess.run([str(busybox), "--list-full"], capture_output=True, text=True, check=True).stdout.split()
    entries = [Entry("/bin/busybox", source=busybox, mode=0o755)]
    files = {"/bin/busybox"}
    entries += with_libraries(extra, files)
    for path, target in (aliases or {}).items():
        entries.append(Entry(path, link=target))
        files.add(path)
    for applet in applets:
        path = "/" + applet
        if path not in files:
            entries.append(Entry(path, link="/bin/busybox"))
            files.add(path)
    entries += [
        Entry("/etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"),
        Entry("/etc/group", data=b"root:x:0:\nnogroup:x:65534:\n"),
        Entry("/etc/nsswitch.conf", data=b"hosts: files dns\n"),
        Entry("/tmp", directory=True, mode=0o1777),
        Entry("/root", directory=True, mode=0o700),
    ]
    return entries


def agnhost_image(out_dir: Path, agnhost: Path, ref: str = AGNHOST_IMAGE) -> tuple[Path, str]:
    """The e2e tests' image: /agnhost (ENTRYPOINT, CMD pause, as upstream's Dockerfile)
    on the userland of ``userland_entries``, in two layers. Returns (layout, digest)."""
    base = layer_tar(userland_entries(extra=E2E_TOOLS, aliases=E2E_ALIASES))
    top = layer_tar([Entry("/agnhost", source=agnhost, mode=0o755)])
    layout = out_dir / "agnhost"
    return layout, write_layout(layout, ref, [base, top], ImageConfig(entrypoint=("/agnhost",), cmd=("pause",)))


# The two other images the network tests run (manifest.go, v1.37.1): the DNS tests' querier
# (upstream: Debian with dnsutils; here the same userland as agnhost, which has dig) and
# busybox (upstream: busybox alone).
GLIBC_DNS_TESTING_IMAGE = "registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1"
BUSYBOX_IMAGE = "registry.k8s.io/e2e-test-images/busybox:1.37.0-2"


def dns_testing_image(out_dir: Path, ref: str = GLIBC_DNS_TESTING_IMAGE) -> tuple[Path, str]:
    layout = out_dir / "glibc-dns-testing"
    return layout, write_layout(layout, ref, [layer_tar(userland_entries(extra=E2E_TOOLS, aliases=E2E_ALIASES))],
                                ImageConfig(cmd=("/bin/sh",)))


def busybox_image(out_dir: Path, ref: str = BUSYBOX_IMAGE) -> tuple[Path, str]:
    layout = out_dir / "busybox"
    return layout, write_layout(layout, ref, [layer_tar(userland_entries(extra=()))], ImageConfig(cmd=("sh",)))


# The conntrack spec's image (test/images/regression-issue-74839): the static binary alone
# (upstream puts it on debian-base; it runs nothing else).
REGRESSION_74839_IMAGE = "registry.k8s.io/e2e-test-images/regression-issue-74839:1.5"


def regression_74839_image(out_dir: Path, binary: Path, ref: str = REGRESSION_74839_IMAGE) -> tuple[Path, str]:
    layout = out_dir / "regression-issue-74839"
    return layout, write_layout(layout, ref, [layer_tar([Entry("/regression-issue-74839", source=binary, mode=0o755)])],
                                ImageConfig(entrypoint=("/regression-issue-74839",)))


# ---- CoreDNS --------------------------------------------------------------------------------
COREDNS_IMAGE = "registry.k8s.io/coredns/coredns:v1.15.0"   # lab/addons/coredns.yaml names it


def coredns_image(out_dir: Path, coredns: Path, ref: str = COREDNS_IMAGE) -> tuple[Path, str]:
    """The cluster DNS: /coredns alone (static), as upstream's distroless image, run as
    nobody. Returns (layout, digest)."""
    layer = layer_tar([Entry("/coredns", source=coredns, mode=0o755),
                       Entry("/etc/passwd", data=b"nobody:x:65534:65534:nobody:/:/bin/false\n")])
    layout = out_dir / "coredns"
    return layout, write_layout(layout, ref, [layer], ImageConfig(entrypoint=("/coredns",), env=(),
                                                                  user="65534:65534"))


# ---- static binaries as images ---------------------------------------------------------------
def binary_image(out_dir: Path, binary: Path, ref: str) -> tuple[Path, str]:
    """An image of one static binary at /usr/local/bin/<name>, on PATH, run as root: what
    kubeadm's static pods run (kube-apiserver, kube-controller-manager, kube-scheduler,
    etcd: their manifests name the command, not a path). Returns (layout, digest)."""
    layer = layer_tar([Entry(f"/usr/local/bin/{binary.name}", source=binary, mode=0o755)])
    layout = out_dir / binary.name
    return layout, write_layout(layout, ref, [layer], ImageConfig(entrypoint=(f"/usr/local/bin/{binary.name}",)))


def archive_digest(archive: Path) -> str:
    """The manifest digest an OCI archive's index names (``sha256:...``)."""
    try:
        with tarfile.open(archive) as tar:
            f = tar.extractfile("index.json")
            return json.load(f)["manifests"][0]["digest"]
    except (OSError, KeyError, IndexError, ValueError, tarfile.TarError) as exc:
        raise ImageError(f"{archive}: not an OCI archive with one image ({exc})") from None


def write_archive(layout: Path, dest: Path) -> Path:
    """An OCI archive (the layout directory as a tar), what ``ctr images import`` reads."""
    tmp = dest.with_suffix(".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(layout.rglob("*")):
            info = tar.gettarinfo(str(p), arcname=str(p.relative_to(layout)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if p.is_file():
                with open(p, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    os.replace(tmp, dest)
    return dest
