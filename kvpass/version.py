"""Which kvpass made a result: its installed version and, run from a git checkout, the commit.

Every JSON a command writes records :func:`describe`, so a number in ``docs/`` names the code that
measured it even where the page does not.
"""

from __future__ import annotations

import functools
import importlib.metadata
import subprocess
from pathlib import Path

try:
    __version__ = importlib.metadata.version("kvpass")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

_CHECKOUT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(_CHECKOUT), *args], capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()  # fmt: skip


@functools.cache
def describe() -> str:
    """``__version__``, with ``+git.<commit>`` (and ``.dirty`` where tracked files differ from it) when
    kvpass runs from a git checkout of its own: not from an installed copy inside someone else's."""
    if not (_CHECKOUT / ".git").exists():
        return __version__
    try:
        commit, changes = _git("rev-parse", "--short", "HEAD"), _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):  # no git, or not a repository after all
        return __version__
    return f"{__version__}+git.{commit}" + (".dirty" if changes else "")
