"""controller.settle_memory() after a full pass: the heap pages the pass freed go back to
the kernel (glibc keeps freed memory for reuse, so a sync's transient peak would stay in
the controller's RSS for its whole life)."""
from __future__ import annotations

from kxlb.controller.controller import settle_memory


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_the_pages_a_pass_freed_are_given_back():
    # 100 MB of heap blocks (larger than Python's small-object allocator takes, smaller than
    # glibc's mmap threshold), one in 16 kept: the heap cannot shrink from its top, as
    # after a sync that leaves its long-lived model among the freed transients.
    blocks = [b"x" * 2000 + i.to_bytes(4, "little") for i in range(50_000)]
    kept = blocks[::16]
    del blocks
    before = rss_mb()
    settle_memory()
    after = rss_mb()
    assert before - after > 50, (before, after)
    assert len(kept) == 3125 and kept[1][-4:] == (16).to_bytes(4, "little")   # what was kept is intact
