"""Which kvpass made a result, and on what: its installed version and, run from a git checkout, the
commit (:func:`describe`); the machine and library versions (:func:`machine`).

Every JSON a command writes records them, so a number in ``docs/`` names the code and the machine
that measured it even where the page does not.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import platform
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


def _cpu_fields() -> dict[str, str]:
    # The first processor's "key : value" lines; empty where there is no /proc/cpuinfo.
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}


@functools.cache
def cpu() -> str:
    """The CPU, as a timing's reader needs it: its model name, with family, model and stepping where
    the name alone does not say which part it is (a VM's "Intel(R) Xeon(R) Processor"), the CPUs this
    process may run on, and the last-level cache: ``platform.processor()`` is empty on Linux."""
    fields = _cpu_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']} model {fields.get('model')} stepping {fields.get('stepping')})"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
    size = caches[-1].read_text().strip() if caches else ""  # "307200K"
    if size.endswith("K") and size[:-1].isdigit():
        size = f"{int(size[:-1]) / 1024:g} MiB"
    last_level = f", last-level cache {size}" if size else ""
    return f"{name}, {usable} CPUs{last_level}"


def machine() -> dict:
    """What a result was measured on: kvpass, the CPU (:func:`cpu`), the threads torch uses and the
    vector width its CPU kernels run at, the GPU where CUDA is present, and the versions of Python,
    torch and transformers, with the date."""
    import torch
    import transformers

    return {
        "kvpass": describe(),
        "cpu": cpu(),
        "cores": torch.get_num_threads(),  # threads torch uses, whatever the machine has
        # The vector width ATen's kernels were dispatched at: sums round differently at another.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **({"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
