"""kxlb's container image: deploy/Dockerfile built by buildah, on Debian bases made here.

The image the lab runs (the DaemonSet's ``kxlb:dev``) and the one ``make image`` builds
are the same: deploy/Dockerfile, built by a container tool, with the repository's root as
the build context and .dockerignore choosing what goes in. No registry is reachable from
this machine, so nothing is pulled (``--pull=never``): the Dockerfile's FROM lines take
their bases by build argument, and the bases are made here.

**Bases**: ``localhost/kxlb-base:bookworm-<key>`` (the runtime stage) and
``localhost/kxlb-build-base:bookworm-<key>`` (the build stage): Debian 12 root file
systems made by mmdebstrap (variant essential: no apt; man pages, docs and locales left
out, copyright files kept) with exactly the packages the Dockerfile's
``RUNTIME_PACKAGES`` and ``BUILD_PACKAGES`` name, read from the Dockerfile itself, so the
Dockerfile's install steps find everything installed and need no network. A base's key
is a digest of its package list, the Debian mirror and suites, and the month: a month
later the next build takes Debian's updates (``KXLB_DEBIAN_DATE`` overrides the month,
any other value forces new bases). The tarballs are kept under
``$KXLB_CACHE/images/bases`` (default /var/cache/kxlb), so a wiped container store
re-imports them without the network.

**The image**: ``localhost/kxlb:<key>``, also tagged ``localhost/kxlb:dev``; its key is a
digest of the Dockerfile, .dockerignore, every file of the build context and the bases'
names. buildah's layer cache (``--layers``) makes a rebuild after a change to the sources
redo only the steps after the changed COPY; the store keeps the layers of the latest
build and the bases, and drops the rest of what these builds made. The image is exported
as an OCI archive, ``$KXLB_CACHE/images/kxlb-<key>.tar`` (two kept), named
``docker.io/library/kxlb:dev`` the way ``ctr images import`` reads it (lab/images.py).

**The host**: buildah runs rootful with its default store (/var/lib/containers/storage).
Its RUN steps run in the host's network namespace (``--network host``): no network
namespace, bridge, CNI plugin, iptables or nftables rule and no ip_forward change is made
for them, and only the build stage's pip step uses the network (PyPI). The host's CA
bundle is bind-mounted read-only into the RUN steps for that TLS (where an egress proxy
re-signs traffic, its CA is there); it is not part of any image. mmdebstrap runs in its
own user and mount namespaces (``--mode=unshare``) and reaches only the Debian mirror.
"""
from __future__ import annotations

import argparse
import datetime
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from . import images
from .images import ImageError

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = Path("deploy/Dockerfile")          # relative to the project (the build context)
IGNOREFILE = Path(".dockerignore")
REPOSITORY = "localhost/kxlb"                     # buildah's name for an image without a registry
DEV_TAG = f"{REPOSITORY}:dev"
CONTAINERD_REF = "docker.io/library/kxlb:dev"     # deploy/kxlb.yaml's `image: kxlb:dev`, as containerd names it

# Debian 12, the release BCC's packages and the venv's interpreter come from.
DEBIAN_SUITE = "bookworm"
DEBIAN_SOURCES = ("deb http://deb.debian.org/debian bookworm main",
                  "deb http://deb.debian.org/debian bookworm-updates main",
                  "deb http://deb.debian.org/debian-security bookworm-security main")
# What a container never reads: left out of the bases as debian:bookworm-slim does it.
DPKG_EXCLUDES = ("path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
                 "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/info/*",
                 "path-exclude=/usr/share/locale/*")
BASES = {"base": "RUNTIME_PACKAGES", "build-base": "BUILD_PACKAGES"}   # image name suffix: the Dockerfile ARG
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
KEEP_ARCHIVES = 2


def cache_dir() -> Path:
    return Path(os.environ.get("KXLB_CACHE", "/var/cache/kxlb")) / "images"


def content_digest(*parts: bytes) -> str:
    """16 hex digits of SHA-256 over *parts*, each length-prefixed (no two part lists that
    differ give the same input): the cache keys of images built here."""
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "big") + p)
    return h.hexdigest()[:16]


# ---- the Dockerfile's own facts -------------------------------------------------------------
_ARG = re.compile(r'^ARG\s+([A-Za-z_][A-Za-z0-9_]*)=(?:"([^"]*)"|(\S*))\s*$')


def dockerfile_args(dockerfile: Path) -> dict[str, str]:
    """The global build arguments (``ARG NAME=value`` before the first FROM) and their defaults."""
    args = {}
    for line in dockerfile.read_text().splitlines():
        if line.upper().startswith("FROM"):
            break
        m = _ARG.match(line.strip())
        if m:
            args[m.group(1)] = m.group(2) if m.group(2) is not None else m.group(3)
    return args


# ---- .dockerignore --------------------------------------------------------------------------
# Docker's rules (moby/patternmatcher, what buildah uses too): patterns are paths relative to
# the context, cleaned, in Go's filepath.Match syntax plus `**` (any number of directories);
# a pattern that matches a directory matches everything under it; `!` lets back in what an
# earlier pattern left out; the last matching pattern decides.
@dataclass(frozen=True)
class _Pattern:
    text: str
    regex: re.Pattern
    include: bool        # a `!` pattern


def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            if pattern.startswith("**", i):
                i += 1
                if pattern.startswith("/", i + 1):      # `**/`: zero or more directories
                    i += 1
                    out += "(?:.*/)?"
                else:
                    out += ".*"
            else:
                out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                raise ImageError(f".dockerignore: pattern {pattern!r}: unclosed [")
            body = pattern[i + 1:end]
            out += "[" + ("^" + body[1:] if body[:1] in ("^", "!") else body) + "]"
            i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out)


def read_ignorefile(path: Path) -> list[_Pattern]:
    patterns = []
    if not path.exists():
        return patterns
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        text = os.path.normpath(line[1:].strip() if include else line).lstrip("/")
        if text in ("", "."):
            continue
        patterns.append(_Pattern(text, _pattern_regex(text), include))
    return patterns


def _ignored(rel: str, patterns: list[_Pattern]) -> bool:
    parents = [rel]
    while "/" in parents[-1]:
        parents.append(parents[-1].rsplit("/", 1)[0])
    verdict = False
    for p in patterns:
        if any(p.regex.fullmatch(x) for x in parents):
            verdict = not p.include
    return verdict


def context_files(root: Path, patterns: list[_Pattern]) -> list[str]:
    """The files of the build context (paths relative to *root*) that *patterns* let in,
    sorted. An excluded directory is entered only if a `!` pattern may let something
    under it back in, so .venv and .git are never walked."""
    def may_reenter(rel: str) -> bool:
        return any(p.include and (p.text.startswith(rel + "/") or p.text.startswith("*")) for p in patterns)

    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        base = os.path.relpath(dirpath, root)
        base = "" if base == "." else base + "/"
        dirnames[:] = sorted(d for d in dirnames
                             if not os.path.islink(os.path.join(dirpath, d))
                             and (not _ignored(base + d, patterns) or may_reenter(base + d)))
        links = [d for d in os.listdir(dirpath) if os.path.islink(os.path.join(dirpath, d))
                 and os.path.isdir(os.path.join(dirpath, d))]
        out += [base + f for f in [*filenames, *links] if not _ignored(base + f, patterns)]
    return sorted(out)


# ---- buildah --------------------------------------------------------------------------------
def _run(argv: list[str], what: str, log: Path | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise ImageError(f"{what}: {argv[0]} is not installed (make setup installs buildah and mmdebstrap)") from None
    except subprocess.TimeoutExpired:
        raise ImageError(f"{what}: {shlex.join(argv[:3])} ... took more than {timeout:.0f}s") from None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ {shlex.join(argv)}\n{r.stdout}\n{r.stderr}")
    if r.returncode:
        where = f" (log {log})" if log else ""
        raise ImageError(f"{what} failed{where}:\n{(r.stderr or r.stdout).strip()[-3000:]}")
    return r


def buildah(*args: str, what: str = "buildah", log: Path | None = None, timeout: float = 600) -> str:
    return _run(["buildah", *args], what, log, timeout).stdout


def image_exists(name: str) -> bool:
    r = subprocess.run(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", name],
                       capture_output=True, text=True)
    return r.returncode == 0


def image_info(name: str) -> dict:
    return json.loads(buildah("inspect", "--type", "image", name, what=f"buildah inspect {name}"))


def image_size(name: str) -> int:
    """What the image takes unpacked, its layers added up, as `buildah images` shows it
    (three digits: "559 MB")."""
    for img in json.loads(buildah("images", "--json", name, what=f"buildah images {name}") or "[]"):
        num, unit = img["size"].split()
        return int(float(num) * {"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9}[unit])
    raise ImageError(f"{name}: not in buildah's store")


def _rmi(ids: Iterable[str]) -> None:
    """Remove these images, children before parents (buildah refuses a parent first), and
    none that a container uses; what cannot go stays."""
    left = list(ids)
    while left:
        failed = [i for i in left if subprocess.run(["buildah", "rmi", i], capture_output=True).returncode]
        if len(failed) == len(left):
            return
        left = failed


def bud(context: Path, dockerfile: Path, tags: list[str], build_args: dict[str, str],
        labels: dict[str, str] | None = None, log: Path | None = None) -> str:
    """``buildah bud`` as every kxlb build runs it; returns its output. Nothing is pulled;
    RUN steps run in the host's network namespace, so the build creates no network
    namespace, interface, CNI network or firewall rule on the host; the host's CA bundle
    is mounted read-only for pip's TLS to PyPI (and is in no layer)."""
    argv = ["bud", "--pull=never", "--layers", "--network", "host", "-f", str(dockerfile)]
    for k, v in build_args.items():
        argv += ["--build-arg", f"{k}={v}"]
    for k, v in (labels or {}).items():
        argv += ["--label", f"{k}={v}"]
    for t in tags:
        argv += ["-t", t]
    if CA_BUNDLE.exists():
        argv += ["-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro"]
    return buildah(*argv, str(context), what=f"buildah bud -f {dockerfile}", log=log, timeout=1800)


def debian_rootfs(packages: list[str], tarball: Path, log: Path) -> None:
    """A Debian root file system (the essential packages and *packages*, of DEBIAN_SUITE) as
    a tarball, made by mmdebstrap in a user namespace: nothing runs as the host's root, and
    nothing is pulled from a registry. mmdebstrap's output goes to *log*."""
    tarball.parent.mkdir(parents=True, exist_ok=True)
    tmp = tarball.with_suffix(".tmp")
    argv = ["mmdebstrap", "--mode=unshare", "--variant=essential", "--format=tar",
            # /usr merged before the essential packages unpack: usr-is-merged, not the
            # usrmerge converter (and the whole of perl it depends on).
            "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
            "--include=" + ",".join(packages), *[f"--dpkgopt={o}" for o in DPKG_EXCLUDES],
            DEBIAN_SUITE, "-", *DEBIAN_SOURCES]
    log.parent.mkdir(parents=True, exist_ok=True)
    # The device nodes mmdebstrap puts in /dev go: a runtime mounts its own /dev.
    with open(tmp, "wb") as f, open(log, "w") as err:
        mm = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err)
        tar = subprocess.run(["tar", "--delete", "--wildcards", "./dev/?*"], stdin=mm.stdout, stdout=f,
                             stderr=subprocess.PIPE)
        mm.stdout.close()
        rc = mm.wait(timeout=1800)
    if rc or tar.returncode:
        tmp.unlink(missing_ok=True)
        raise ImageError(f"mmdebstrap of {' '.join(packages)} failed (log {log}):\n"
                         f"{log.read_text().strip()[-2000:]}{tar.stderr.decode().strip()}")
    os.replace(tmp, tarball)


@dataclass(frozen=True)
class Built:
    name: str        # localhost/kxlb:<key>
    key: str
    size: int        # bytes, unpacked
    seconds: float   # what building (or finding) it took
    cached: bool     # found in the store, not built


class ImageBuild:
    """Bases, the image and its archive for one project checkout (the build context)."""

    def __init__(self, project: Path = REPO, out: Path | None = None,
                 log: Callable[[str], None] = lambda msg: None):
        self.project = project.resolve()
        self.out = out or cache_dir()
        self.log = log
        self.dockerfile = self.project / DOCKERFILE
        self.args = dockerfile_args(self.dockerfile)
        missing = [a for a in BASES.values() if not self.args.get(a)]
        if missing:
            raise ImageError(f"{self.dockerfile}: no global ARG {', '.join(missing)} with the stage's packages")

    # -- locking: one build at a time on this machine (the lab and `make image` may race) --
    def _lock(self):
        self.out.mkdir(parents=True, exist_ok=True)
        f = open(self.out / ".kxlb-image.lock", "w")
        fcntl.flock(f, fcntl.LOCK_EX)
        return f

    # -- bases ----------------------------------------------------------------------------
    def debian_date(self) -> str:
        return os.environ.get("KXLB_DEBIAN_DATE") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m")

    def base_name(self, kind: str) -> str:
        packages = self.args[BASES[kind]].split()
        key = content_digest(json.dumps({"packages": sorted(packages), "suite": DEBIAN_SUITE, "sources": DEBIAN_SOURCES,
                                  "dpkg": DPKG_EXCLUDES, "variant": "essential+merged-usr",
                                  "date": self.debian_date()}, sort_keys=True).encode())
        return f"localhost/kxlb-{kind}:{DEBIAN_SUITE}-{key}"

    def ensure_base(self, kind: str) -> str:
        name = self.base_name(kind)
        if image_exists(name):
            return name
        tag = name.rsplit(":", 1)[1]
        bases = self.out / "bases"
        tarball = bases / f"kxlb-{kind}-{tag}.tar"
        if not tarball.exists():
            t = time.monotonic()
            self._mmdebstrap(self.args[BASES[kind]].split(), tarball)
            self.log(f"{name}: Debian root file system made by mmdebstrap in {time.monotonic() - t:.0f}s")
        self._import(tarball, name, kind)
        for old in bases.glob(f"kxlb-{kind}-*.tar"):
            if old != tarball:
                old.unlink()
        return name

    def _mmdebstrap(self, packages: list[str], tarball: Path) -> None:
        debian_rootfs(packages, tarball, self.out / "build" / f"{tarball.stem}.mmdebstrap.log")

    def _import(self, tarball: Path, name: str, kind: str) -> None:
        """A single-layer image of *tarball* (what ``docker import`` makes)."""
        ctr = buildah("from", "--pull=never", "scratch", what="buildah from scratch").strip()
        try:
            buildah("add", ctr, str(tarball), "/", what=f"buildah add {tarball}")
            buildah("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "--cmd", "/bin/bash", "--label", f"io.kxlb.debian={DEBIAN_SUITE} {self.debian_date()}",
                    "--label", f"io.kxlb.packages={self.args[BASES[kind]]}", ctr, what="buildah config")
            buildah("commit", "--rm", ctr, name, what=f"buildah commit {name}")
        except BaseException:
            subprocess.run(["buildah", "rm", ctr], capture_output=True)
            raise

    # -- the image ----------------------------------------------------------------------------
    def key(self, bases: dict[str, str] | None = None) -> str:
        """A digest of everything the build reads: the Dockerfile, .dockerignore, the files
        of the build context, and the bases."""
        bases = bases or {kind: self.base_name(kind) for kind in BASES}
        patterns = read_ignorefile(self.project / IGNOREFILE)
        parts = [self.dockerfile.read_bytes(), (self.project / IGNOREFILE).read_bytes()
                 if (self.project / IGNOREFILE).exists() else b"", json.dumps(bases, sort_keys=True).encode()]
        for rel in context_files(self.project, patterns):
            p = self.project / rel
            if p.is_symlink():
                parts += [rel.encode(), b"->" + os.readlink(p).encode()]
            else:
                parts += [rel.encode(), oct(p.stat().st_mode & 0o111).encode(), p.read_bytes()]
        return content_digest(*parts)

    def build(self) -> Built:
        """The image of this checkout, built unless the store has it already."""
        t = time.monotonic()
        bases = {kind: self.ensure_base(kind) for kind in BASES}
        key = self.key(bases)
        name = f"{REPOSITORY}:{key}"
        if image_exists(name):
            buildah("tag", name, DEV_TAG, what=f"buildah tag {name}")
            return Built(name, key, image_size(name), time.monotonic() - t, True)
        out = bud(self.project, self.dockerfile, [name, DEV_TAG],
                  {"BASE": bases["base"], "BUILD_BASE": bases["build-base"]}, {"io.kxlb.inputs": key},
                  log=self.out / "build" / f"kxlb-{key}.build.log")
        self._prune_store(out, keep={name, DEV_TAG, *bases.values()})
        return Built(name, key, image_size(name), time.monotonic() - t, False)

    def _prune_store(self, bud_output: str, keep: set[str]) -> None:
        """Drop what earlier builds left in the store (each change to the sources leaves a
        few hundred MB of intermediate images, each month a pair of bases): the images of
        this build's steps stay, for the next build to reuse, with *keep*. Images that do
        not descend from a kxlb base are never looked at."""
        used = re.findall(r"^--> (?:Using cache )?([0-9a-f]{10,64})\s*$", bud_output, re.M)
        listing = json.loads(buildah("images", "--all", "--json", what="buildah images") or "[]")
        ours, roots = [], set()
        for img in listing:
            names = img.get("names") or []
            if any(n.rsplit(":", 1)[0] in (f"localhost/kxlb-{kind}" for kind in BASES) for n in names):
                roots.add(image_info(img["id"])["OCIv1"]["rootfs"]["diff_ids"][0])
        mine = {REPOSITORY, *(f"localhost/kxlb-{kind}" for kind in BASES)}
        for img in listing:
            names = set(img.get("names") or [])
            if names & keep or any(img["id"][:10] == u[:10] for u in used) \
                    or any(n.rsplit(":", 1)[0] not in mine for n in names):
                continue
            info = subprocess.run(["buildah", "inspect", "--type", "image", img["id"]], capture_output=True, text=True)
            if info.returncode == 0 and (json.loads(info.stdout)["OCIv1"]["rootfs"].get("diff_ids") or [""])[0] in roots:
                ours.append(img["id"])
        _rmi(ours)

    def archive(self, ref: str = CONTAINERD_REF) -> tuple[Path, Built]:
        """The image as an OCI archive named *ref*, cached by the image's key (built and
        exported when missing). Returns the archive and the image."""
        t = time.monotonic()
        with self._lock():
            key = self.key()
            archive = self.out / f"kxlb-{key}.tar"
            name = f"{REPOSITORY}:{key}"
            if archive.exists():
                return archive, Built(name, key, image_size(name) if image_exists(name) else 0,
                                      time.monotonic() - t, True)
            built = self.build()
            layout = self.out / "build" / f"kxlb-{key}.oci"
            shutil.rmtree(layout, ignore_errors=True)
            buildah("push", "--quiet", built.name, f"oci:{layout}:{ref.rsplit(':', 1)[1]}",
                    what=f"buildah push {built.name}")
            name_layout(layout, ref)
            images.write_archive(layout, archive)
            shutil.rmtree(layout)
            _prune_archives(self.out, archive)
            self.log(f"{built.name} {'found in the store' if built.cached else 'built'} in {built.seconds:.0f}s; "
                     f"archive {archive} in {time.monotonic() - t - built.seconds:.0f}s")
            return archive, built


def name_layout(layout: Path, ref: str) -> None:
    """Name the layout's one image *ref* as containerd and the OCI tools read it (lab/images.py:
    the full reference for ``ctr images import``, the tag for umoci and skopeo)."""
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text())
    if len(index.get("manifests", [])) != 1:
        raise ImageError(f"{layout}: expected one image, found {len(index.get('manifests', []))}")
    index["manifests"][0].setdefault("annotations", {}).update(
        {images.ANN_CONTAINERD_NAME: ref, images.ANN_REF_NAME: ref.rsplit(":", 1)[1]})
    index_path.write_text(json.dumps(index, sort_keys=True, separators=(",", ":")))


def _prune_archives(out: Path, keep: Path, n: int = KEEP_ARCHIVES) -> None:
    old = sorted((p for p in out.glob("kxlb-*.tar") if p != keep), key=lambda p: p.stat().st_mtime, reverse=True)
    for p in old[n - 1:]:
        p.unlink()
    for p in (out / "build").glob("kxlb-*.log"):
        if p.stat().st_mtime < time.time() - 7 * 86400:
            p.unlink()


def kxlb_image_archive(project: Path = REPO, out: Path | None = None, ref: str = CONTAINERD_REF) -> Path:
    """What the lab imports into its nodes: the archive of deploy/Dockerfile's image."""
    return ImageBuild(project, out).archive(ref)[0]


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kxlb.lab.imagebuild",
                                description="Build kxlb's image from deploy/Dockerfile with buildah (cached), "
                                            "on Debian bases made with mmdebstrap; export it for containerd.")
    p.add_argument("--project", type=Path, default=REPO, help="the checkout (build context); default this one")
    a = p.parse_args(list(argv) if argv is not None else None)
    t = time.monotonic()
    try:
        archive, built = ImageBuild(a.project, log=lambda msg: print(f"image: {msg}", file=sys.stderr)).archive()
    except ImageError as exc:
        print(f"image: error: {exc}", file=sys.stderr)
        return 1
    size = _mb(built.size) if built.size else "not in buildah's store (the archive is)"
    print(f"{built.name} (also {DEV_TAG}): {size}; {'cached' if built.cached else 'built'} in "
          f"{time.monotonic() - t:.1f}s")
    print(f"archive for containerd ({CONTAINERD_REF}): {archive} ({_mb(archive.stat().st_size)} compressed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
