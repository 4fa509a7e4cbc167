"""kxlb."""
from __future__ import annotations

from pathlib import Path

# The repository root when kxlb runs from a checkout; site-packages in an installed image.
_ROOT = Path(__file__).resolve().parent.parent


def version() -> str:
    """The installed package's version, else (a checkout never installed) pyproject.toml's."""
    from importlib import metadata
    try:
        return metadata.version("kxlb")
    except metadata.PackageNotFoundError:
        import tomllib
        try:
            with open(_ROOT / "pyproject.toml", "rb") as f:
                return tomllib.load(f)["project"]["version"]
        except OSError:
            return "unknown"


def git_commit() -> str | None:
    """The commit checked out when kxlb runs from a git checkout, else None (an installed
    image has no .git). Read from the files, no git process: HEAD holds a ref (or, detached,
    the commit), and the ref's commit is in its own file or, once packed, in packed-refs."""
    git = _ROOT / ".git"
    try:
        if git.is_file():  # a linked worktree: .git names its git directory
            git = _ROOT / git.read_text().removeprefix("gitdir:").strip()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head.removeprefix("ref: ")
        # A linked worktree keeps its own HEAD, but the refs live in the common directory.
        common = git / (git / "commondir").read_text().strip() if (git / "commondir").exists() else git
        if (common / ref).exists():
            return (common / ref).read_text().strip()
        for line in (common / "packed-refs").read_text().splitlines():
            commit, _, name = line.partition(" ")
            if name == ref:
                return commit
    except OSError:
        pass
    return None
