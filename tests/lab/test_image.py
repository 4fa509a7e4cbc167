"""kxlb's image: deploy/Dockerfile built by buildah (lab/imagebuild.py), the one the lab runs.

The image is built once for the module (or found: it is cached by its inputs; cold, with
the Debian bases, about 6 minutes, not counted in the tests' timeouts) and looked at with
the container tool: buildah runs commands in it, runc runs it privileged, as the
DaemonSet does, for the compile.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest

from kxlb.lab import imagebuild, images, proxyimages
from kxlb.lab.imagebuild import ImageBuild

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)

# The image unpacked, and where it goes (measured 2026-11-26, 559 MB): the runtime base
# 342 MB, of it BCC's compiler (libLLVM 105, libclang-cpp 57, and libicu 36 and libz3 23
# that libLLVM links) 225 MB, Python 3.11 35 MB, the rest Debian's essential packages
# (dpkg, coreutils, bash, ...); the kernel headers 57 MB; the venv 171 MB, of it the
# kubernetes client 126 MB (v37 ships an asyncio copy of the whole API, 68 MB, that kxlb
# does not import). 600 MB leaves 7% for dependencies to grow; more is a change to look at.
MAX_SIZE = 600e6
MAX_ARCHIVE = 180e6   # the gzip layers containerd imports (and a registry would store): 156 MB


@pytest.fixture(scope="module")
def image():
    for tool in ("buildah", "mmdebstrap", "runc"):
        assert subprocess.run(["which", tool], capture_output=True).returncode == 0, \
            f"{tool} is not installed (make setup installs it)"
    archive, built = ImageBuild(REPO).archive()
    assert imagebuild.image_exists(built.name), f"{built.name}: the archive is there, the image is not"
    return archive, built


@pytest.fixture
def container(image):
    """A buildah working container of the image (its own root file system); removed after."""
    made = []

    def make(*opts: str) -> str:
        made.append(imagebuild.buildah("from", "--pull=never", "--name", f"kxlb-test-{uuid.uuid4().hex[:8]}",
                                       *opts, image[1].name).strip())
        return made[-1]

    yield make
    for c in made:
        subprocess.run(["buildah", "umount", c], capture_output=True)
        subprocess.run(["buildah", "rm", c], capture_output=True)


def run_in(ctr: str, script: str, *opts: str) -> subprocess.CompletedProcess:
    """`sh -c script` in the container, without a network (a namespace of its own: lo only)."""
    return subprocess.run(["buildah", "run", "--network", "none", *opts, ctr, "--", "sh", "-c", script],
                          capture_output=True, text=True, timeout=300)


def test_the_image_is_the_dockerfiles_built_by_buildah_and_the_lab_imports_it(image):
    archive, built = image
    info = imagebuild.image_info(built.name)
    cfg = info["OCIv1"]["config"]
    assert cfg["Entrypoint"] == ["/usr/local/bin/kxlb"] and cfg["Labels"]["io.kxlb.inputs"] == built.key
    # The runtime stage's FROM is the base made here: its one layer is the image's first.
    base = imagebuild.image_info(ImageBuild(REPO).base_name("base"))
    assert info["OCIv1"]["rootfs"]["diff_ids"][0] == base["OCIv1"]["rootfs"]["diff_ids"][0]
    steps = " ".join(h.get("created_by", "") for h in info["History"])
    assert "COPY" in steps and "/opt/kxlb" in steps, steps
    # The lab's archive (what its nodes import) is this image, named as the DaemonSet asks.
    assert proxyimages.kxlb_image(REPO) == archive
    with tarfile.open(archive) as t:
        (m,) = json.load(t.extractfile("index.json"))["manifests"]
        manifest = json.load(t.extractfile(f"blobs/sha256/{m['digest'].split(':')[1]}"))
        config = json.load(t.extractfile(f"blobs/sha256/{manifest['config']['digest'].split(':')[1]}"))
    assert m["annotations"][images.ANN_CONTAINERD_NAME] == proxyimages.KXLB_IMAGE == "docker.io/library/kxlb:dev"
    assert config["rootfs"]["diff_ids"] == info["OCIv1"]["rootfs"]["diff_ids"]
    assert config["config"]["Labels"]["io.kxlb.inputs"] == built.key


def test_runtime_image_has_no_compiler_pip_scapy_or_lab(image, container):
    ctr = container()
    r = run_in(ctr, "dpkg-query -W -f='${Package}\\n'")
    assert r.returncode == 0, r.stderr
    packages = set(r.stdout.split())
    args = imagebuild.dockerfile_args(REPO / "deploy" / "Dockerfile")
    assert set(args["RUNTIME_PACKAGES"].split()) <= packages
    unwanted = {p for p in packages if p.startswith(("gcc", "cpp", "clang", "llvm", "linux-headers", "libc6-dev",
                                                     "python3-pip", "python3-venv", "python3-setuptools"))
                and p != "gcc-12-base"   # libgcc-s1's copyright file, no compiler
                or p.endswith("-dev")}
    assert not unwanted, f"build packages in the runtime image: {sorted(unwanted)}"
    r = run_in(ctr, "for c in cc gcc gcc-12 c++ clang clang-14 llc pip pip3 x86_64-linux-gnu-gcc-12; do "
                    "command -v $c; done; ls /opt/kxlb/bin")
    found = [line for line in r.stdout.split() if "/" in line]
    assert not found, f"compilers or pip in the image: {found}"
    assert not any(n.startswith(("pip", "scapy")) for n in r.stdout.split()), r.stdout
    r = run_in(ctr, "/opt/kxlb/bin/python -c 'import importlib.util as u; "
                    "print([m for m in (\"scapy\", \"cryptography\", \"pip\", \"setuptools\", \"kxlb.lab\") "
                    "if u.find_spec(m)])'")
    assert (r.returncode, r.stdout.strip()) == (0, "[]"), r
    r = run_in(ctr, "kxlb lab status")
    assert r.returncode == 1 and "kxlb: error:" in r.stderr and "invalid choice: 'lab'" in r.stderr, r


def test_image_size_is_bounded(image):
    archive, built = image
    assert 0 < built.size < MAX_SIZE, f"{built.name}: {built.size / 1e6:.0f} MB unpacked (bound {MAX_SIZE / 1e6:.0f})"
    assert archive.stat().st_size < MAX_ARCHIVE, f"{archive}: {archive.stat().st_size / 1e6:.0f} MB"


def test_kxlb_version_and_help_run_in_the_image(container):
    ctr = container()
    r = run_in(ctr, "kxlb version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"kxlb {project_version()}\n") and "datapath layout" in r.stdout, r.stdout
    r = run_in(ctr, "kxlb --help")
    assert r.returncode == 0 and re.search(r"^\s+controller\s", r.stdout, re.M), r.stdout
    assert not re.search(r"^\s+(lab|demo)\s", r.stdout, re.M), f"the lab's commands in the product:\n{r.stdout}"


def project_version() -> str:
    """The version pyproject.toml gives (the image's kxlb must say the same)."""
    import tomllib
    with open(Path(__file__).resolve().parents[2] / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def _chosen_headers(ctr: str, env: str = "", *opts: str) -> str:
    """What the image's kxlb (deploy/image-kxlb.sh) sets BCC_KERNEL_SOURCE to: the script
    itself, with the final exec replaced by a print."""
    r = run_in(ctr, "sed 's|^exec /opt/kxlb/bin/kxlb .*|echo \"BCC_KERNEL_SOURCE=${BCC_KERNEL_SOURCE:-}\"|' "
                    f"/usr/local/bin/kxlb > /tmp/choose && {env} sh /tmp/choose", *opts)
    assert r.returncode == 0 and r.stdout.startswith("BCC_KERNEL_SOURCE="), r
    return r.stdout.strip().split("=", 1)[1]


def test_the_node_headers_win_over_the_images_own(container):
    """The node's headers (the DaemonSet mounts /lib/modules and /usr/src) match its kernel:
    used when they are there; the image's only without them; a pod's own setting kept."""
    ctr = container()
    release = os.uname().release
    host = Path("/lib/modules") / release
    assert (host / "build" / "include").exists() or (host / "source" / "include").exists(), \
        f"this machine has no kernel headers under {host} (make setup links Debian's)"
    assert not os.path.exists("/sys/kernel/kheaders.tar.xz"), "kheaders loaded: the image's headers are not reached"
    assert _chosen_headers(ctr) == "/usr/lib/kxlb/kernel-headers"
    assert _chosen_headers(ctr, "", "-v", "/lib/modules:/lib/modules:ro", "-v", "/usr/src:/usr/src:ro") == ""
    assert _chosen_headers(ctr, "BCC_KERNEL_SOURCE=/opt/mine") == "/opt/mine"


def test_bcc_compiles_the_datapath_in_the_image_without_host_headers(image, container, tmp_path):
    """`kxlb load` in the image, run by runc as the DaemonSet runs it (privileged: every
    capability, no seccomp filter, writable /proc/sys), in a network namespace of its own
    and on a bpffs of its own, with no /lib/modules and an empty /usr/src: BCC compiles
    bpf/kxlb.c against the headers the image ships, the kernel takes the programs, a
    service is written and read back."""
    ctr = container()
    rootfs = imagebuild.buildah("mount", ctr).strip()
    spec = _privileged_spec(rootfs, [
        "sh", "-c", "ls -A /usr/src; test ! -e /lib/modules && test ! -e /sys/kernel/kheaders.tar.xz && "
                    "kxlb load --iface lo && kxlb service add 10.96.0.10:80/tcp 10.1.0.11:8080 && "
                    "kxlb list --json && tc filter show dev lo ingress"])
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(spec))
    cid = f"kxlb-image-test-{uuid.uuid4().hex[:8]}"
    try:
        r = subprocess.run(["runc", "run", "--bundle", str(bundle), cid], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["runc", "delete", "--force", cid], capture_output=True)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    listing = r.stdout[r.stdout.index("["):r.stdout.rindex("]") + 1]
    (svc,) = json.loads(listing)
    assert svc["service"] == "10.96.0.10:80/tcp" and svc["backends"] == ["10.1.0.11:8080"], svc
    assert "kxlb_tc" in r.stdout and "direct-action" in r.stdout, r.stdout


def _privileged_spec(rootfs: str, argv: list[str]) -> dict:
    """An OCI runtime spec like a privileged pod's: *rootfs* writable, fresh pid, mount,
    network, ipc and uts namespaces, all capabilities, no seccomp, /proc/sys writable,
    and a bpffs of its own at /sys/fs/bpf (nothing pinned on the host's)."""
    spec = _runc_default_spec()
    caps = _all_capabilities()
    spec["process"].update(args=argv, terminal=False, cwd="/",
                           env=["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                           capabilities={k: caps for k in ("bounding", "effective", "permitted", "ambient")},
                           noNewPrivileges=False)
    spec["process"].pop("rlimits", None)
    spec["root"] = {"path": rootfs, "readonly": False}
    spec["hostname"] = "kxlb-image-test"
    spec["mounts"] = [m for m in spec["mounts"] if m["destination"] != "/sys"] + [
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys/fs/bpf", "type": "bpf", "source": "bpf", "options": ["nosuid", "noexec", "nodev"]},
    ]
    linux = spec["linux"]
    for k in ("maskedPaths", "readonlyPaths", "seccomp"):
        linux.pop(k, None)
    linux["namespaces"] = [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]
    return spec


def _runc_default_spec() -> dict:
    """`runc spec` writes config.json into a directory: the default spec, read back."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(["runc", "spec", "--bundle", d], check=True, capture_output=True)
        return json.loads((Path(d) / "config.json").read_text())


def _all_capabilities() -> list[str]:
    """Every capability this process has (a privileged pod gets the runtime's; root here
    lacks a few, CAP_SYS_RESOURCE among them, and runc cannot grant more than it has)."""
    names = ("CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE "
             "NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT "
             "SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE "
             "AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ "
             "PERFMON BPF CHECKPOINT_RESTORE").split()
    status = Path("/proc/self/status").read_text()
    have = int(re.search(r"^CapEff:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
    return ["CAP_" + n for bit, n in enumerate(names) if have >> bit & 1]


def _host_network_state() -> dict:
    def out(*argv: str) -> str:
        r = subprocess.run(argv, capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else f"<{argv[0]} failed: {r.stderr.strip()}>"

    state = {name: out(*argv) for name, argv in (
        ("iptables", ("iptables-save",)), ("ip6tables", ("ip6tables-save",)),
        ("iptables-legacy", ("iptables-legacy-save",)), ("nft", ("nft", "list", "ruleset")),
        ("links", ("ip", "-o", "link", "show")))}
    # iptables-save prints the time it ran: not a change.
    state = {k: "\n".join(line for line in v.splitlines() if not line.startswith("#")) for k, v in state.items()}
    for f in ("/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/ipv6/conf/all/forwarding"):
        state[f] = Path(f).read_text()
    state["netns"] = os.readlink("/proc/self/ns/net")
    return state


def test_a_build_changes_nothing_in_the_hosts_network(image, tmp_path):
    """RUN steps built as every kxlb build runs them (imagebuild.bud) run in the host's own
    network namespace, and no firewall rule, interface or forwarding setting of the host
    changes: no CNI network is made for the build."""
    built = image[1]
    marker = uuid.uuid4().hex
    (tmp_path / "Dockerfile").write_text(
        "ARG BASE\nFROM ${BASE}\n"
        f"RUN echo {marker} > /marker && readlink /proc/self/ns/net > /netns && cat /proc/sys/net/ipv4/ip_forward\n")
    before = _host_network_state()
    tag = f"localhost/kxlb-test-netns:{marker[:12]}"
    try:
        imagebuild.bud(tmp_path, tmp_path / "Dockerfile", [tag], {"BASE": ImageBuild(REPO).base_name("base")})
        ctr = imagebuild.buildah("from", "--pull=never", tag).strip()
        try:
            r = run_in(ctr, "cat /marker /netns")
        finally:
            subprocess.run(["buildah", "rm", ctr], capture_output=True)
    finally:
        subprocess.run(["buildah", "rmi", tag], capture_output=True)
    assert r.stdout.split() == [marker, before["netns"]], "the RUN step ran in another network namespace"
    after = _host_network_state()
    assert after == before
    assert built.name.startswith(imagebuild.REPOSITORY)


def test_dockerignore_lets_in_what_the_dockerfile_copies_and_nothing_else(tmp_path):
    """The context as buildah sends it (a Dockerfile that copies all of it) is what
    imagebuild.context_files computes for the cache key: the Dockerfile's COPY sources,
    and no .git, .venv, build output, lab or docs."""
    (tmp_path / "Dockerfile").write_text("FROM scratch\nCOPY . /ctx/\n")
    tag = f"localhost/kxlb-test-context:{uuid.uuid4().hex[:12]}"
    imagebuild.buildah("bud", "--pull=never", "-f", str(tmp_path / "Dockerfile"), "-t", tag, str(REPO),
                       what="buildah bud (context)")
    ctr = imagebuild.buildah("from", "--pull=never", tag).strip()
    try:
        root = Path(imagebuild.buildah("mount", ctr).strip()) / "ctx"
        sent = sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())
    finally:
        subprocess.run(["buildah", "umount", ctr], capture_output=True)
        subprocess.run(["buildah", "rm", ctr], capture_output=True)
        subprocess.run(["buildah", "rmi", tag], capture_output=True)
    patterns = imagebuild.read_ignorefile(REPO / ".dockerignore")
    assert sent == imagebuild.context_files(REPO, patterns)
    tops = {p.split("/")[0] for p in sent}
    assert tops == {"pyproject.toml", "setup.py", "README.md", "kxlb", "loader", "controller", "bpf", "deploy"}, tops
    assert [p for p in sent if p.startswith("deploy/")] == ["deploy/image-kxlb.sh"]
    assert not [p for p in sent if "__pycache__" in p or p.endswith((".pyc", ".so"))]
    # What the Dockerfile copies from the context is all there.
    for line in (REPO / "deploy" / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for src in line.split()[1:-1]:
                assert any(p == src or p.startswith(src + "/") for p in sent), f"{line}: {src} is not in the context"


def test_dockerignore_matching_follows_dockers_rules():
    """The matcher behind the cache key, on the cases .dockerignore files use."""
    pats = imagebuild.read_ignorefile
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"kxlb-ignore-{uuid.uuid4().hex[:8]}"
    tmp.write_text("# c\n*\n!kxlb\n!deploy/x.sh\n**/__pycache__\n**/*.pyc\nbuild?/\n[ab].txt\n!/keep/**/y\n")
    try:
        p = pats(tmp)
    finally:
        tmp.unlink()
    ignored = imagebuild._ignored
    assert ignored(".venv/lib/x.py", p) and ignored(".git", p) and ignored("deploy/kxlb.yaml", p)
    assert not ignored("kxlb/cli.py", p) and not ignored("deploy/x.sh", p)
    assert ignored("kxlb/__pycache__/cli.cpython-311.pyc", p) and ignored("kxlb/a/b.pyc", p)
    assert ignored("build1", p) and ignored("a.txt", p)
    assert not ignored("keep/y", p) and not ignored("keep/m/n/y", p) and ignored("keep/z", p)
