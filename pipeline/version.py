"""``specray --version``: the package version, and the git commit when specray runs from a checkout.

    specray 0.1.0 (git 1a2b3c4d5e6f)                        a checkout at that commit
    specray 0.1.0 (git 1a2b3c4d5e6f, uncommitted changes)   tracked files differ from it
    specray 0.1.0                                           an installed package
"""

from __future__ import annotations

import subprocess
from importlib.metadata import version
from pathlib import Path


def version_string(root: Path | None = None) -> str:
    """``specray 0.1.0 (git 1a2b3c4d5e6f)`` from a checkout (``, uncommitted changes`` when its tracked files
    differ from the commit); ``specray 0.1.0`` for an installed package. ``root``: the folder holding pipeline/."""
    text = f"specray {version('specray')}"
    commit = _checkout_commit(root or Path(__file__).resolve().parents[1])
    return f"{text} (git {commit})" if commit else text


def _checkout_commit(root: Path) -> str | None:
    """The commit of the checkout at ``root``: None unless ``root`` is the top of a git work tree holding
    specray's pyproject.toml (an installed package inside some other repository reports no commit)."""
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or 'name = "specray"' not in pyproject.read_text():
        return None

    def git(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True, timeout=30)

    try:
        top = git("rev-parse", "--show-toplevel")
    except FileNotFoundError:  # no git on this machine: the version alone
        return None
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root.resolve():
        return None
    commit = git("rev-parse", "--short=12", "HEAD").stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return commit + (", uncommitted changes" if dirty else "") if commit else None
