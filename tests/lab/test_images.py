"""OCI images written by the lab (lab/images.py), checked by tools nobody here wrote:
umoci unpacks the layout into a runtime bundle and runc runs it."""
from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import time
import uuid

import pytest

from kxlb.lab import images
from kxlb.lab.images import Entry, ImageConfig, ImageError, layer_tar, write_layout


def _members(tar: bytes) -> list[tuple[str, int, int, int]]:
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        return [(m.name, m.type[0], m.mode, m.mtime) for m in t.getmembers()]


def test_layers_are_reproducible_rooted_and_refuse_paths_outside_the_image():
    entries = [Entry("/usr/bin/tool", data=b"x", mode=0o755), Entry("etc/hosts", data=b"127.0.0.1 localhost\n"),
               Entry("/bin", link="usr/bin")]
    one, two = layer_tar(entries), layer_tar(list(reversed(entries)))
    assert one == two, "the same files in another order gave another layer"
    got = _members(one)
    assert [m[0] for m in got] == ["bin", "etc", "etc/hosts", "usr", "usr/bin", "usr/bin/tool"]
    assert ("usr", ord("5"), 0o755, 0) in got and ("usr/bin/tool", ord("0"), 0o755, 0) in got
    for bad in ("../etc/passwd", "/a/../../b", "/"):
        with pytest.raises(ImageError, match="not a path inside the image"):
            layer_tar([Entry(bad, data=b"")])
    with pytest.raises(ImageError, match="given twice"):
        layer_tar([Entry("/a", data=b""), Entry("a", data=b"")])


def test_layout_blobs_are_content_addressed_and_the_index_names_the_image(tmp_path):
    layer = layer_tar([Entry("/hello", data=b"hi", mode=0o755)])
    digest = write_layout(tmp_path / "img", "registry.k8s.io/e2e-test-images/x:1.2", [layer],
                          ImageConfig(entrypoint=("/hello",)))
    index = json.loads((tmp_path / "img" / "index.json").read_text())
    (m,) = index["manifests"]
    assert m["digest"] == digest and m["annotations"] == {images.ANN_CONTAINERD_NAME: "registry.k8s.io/e2e-test-images/x:1.2",
                                                          images.ANN_REF_NAME: "1.2"}
    for blob in (tmp_path / "img" / "blobs" / "sha256").iterdir():
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
    with pytest.raises(ImageError, match="no tag"):
        write_layout(tmp_path / "bad", "registry.k8s.io/pause", [layer], ImageConfig())


@pytest.fixture
def container_id():
    cid = f"kxlb-test-{uuid.uuid4().hex[:8]}"
    yield cid
    subprocess.run(["runc", "kill", cid, "KILL"], capture_output=True)
    subprocess.run(["runc", "delete", "--force", cid], capture_output=True)


def test_pause_image_unpacks_with_umoci_and_runs_under_runc(tmp_path, container_id):
    """The sandbox image a kubelet node needs: umoci reads our layout (by its tag), the
    bundle holds /pause as the process, runc runs it in its own namespaces, and SIGTERM
    stops it (how the runtime stops a sandbox)."""
    for tool in ("umoci", "runc"):
        assert shutil.which(tool), f"{tool} is not installed (make setup installs it)"
    layout, _ = images.pause_image(tmp_path / "images")
    tag = images.PAUSE_IMAGE.rsplit(":", 1)[1]
    bundle = tmp_path / "bundle"
    r = subprocess.run(["umoci", "unpack", "--image", f"{layout}:{tag}", str(bundle)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    spec = json.loads((bundle / "config.json").read_text())
    assert spec["process"]["args"] == ["/pause"] and spec["process"]["user"]["uid"] == 65535
    assert (bundle / "rootfs" / "pause").stat().st_mode & 0o111
    spec["process"]["terminal"] = False  # umoci's default is a tty; a runtime runs a sandbox without one
    (bundle / "config.json").write_text(json.dumps(spec))
    # The container inherits runc's stdio: a file, not a pipe that would stay open as long as it runs.
    with open(tmp_path / "runc.out", "w+") as out:
        r = subprocess.run(["runc", "run", "--detach", "--bundle", str(bundle), container_id],
                           stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=60)
        out.seek(0)
        assert r.returncode == 0, out.read()

    def state() -> str:
        out = subprocess.run(["runc", "state", container_id], capture_output=True, text=True).stdout
        return json.loads(out)["status"] if out else "gone"

    assert state() == "running"
    subprocess.run(["runc", "kill", container_id, "TERM"], check=True)
    deadline = time.monotonic() + 10
    while state() == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state() == "stopped", "pause did not end on SIGTERM"


def test_agnhost_userland_runs_the_commands_the_e2e_specs_exec(tmp_path):
    """The e2e specs exec these in agnhost pods and read their output; each must work in
    the image's own userland (chroot into the unpacked layer), against a server on this
    host's loopback. `wget -T` is the one Debian's busybox crashed on."""
    import http.server
    import threading

    root = tmp_path / "rootfs"
    with tarfile.open(fileobj=io.BytesIO(layer_tar(images.userland_entries(
            extra=images.E2E_TOOLS, aliases=images.E2E_ALIASES)))) as t:
        t.extractall(root)  # our own layer: rooted, no links out (test_layers_are_reproducible...)

    class Hostname(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"backend-pod-1")

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostname)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/hostname"
    try:
        def sh(cmd: str) -> subprocess.CompletedProcess:
            return subprocess.run(["chroot", str(root), "/bin/sh", "-c", cmd], capture_output=True,
                                  text=True, timeout=30)

        for cmd in (f"wget -q -O - -T 1 {url}", f"curl -q -s --connect-timeout 1 {url}"):
            r = sh(cmd)
            assert (r.returncode, r.stdout) == (0, "backend-pod-1"), f"{cmd}: {r}"
        r = sh(f"echo hostName | nc -v -t -w 2 127.0.0.1 {server.server_port}")
        assert r.returncode == 0 and "succeeded" in r.stderr and "Bad request" in r.stdout, r
        # a refused connection is an error with nothing on stdout (the specs count hostnames)
        server.shutdown()
        server.server_close()
        r = sh(f"wget -q -O - -T 1 {url}")
        assert r.returncode != 0 and r.stdout == "", r
    finally:
        server.server_close()
