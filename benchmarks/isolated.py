"""A script's run of one case in a subprocess of its own, for sweeps over model types: a case that
crashes, hangs or prints nothing says so in its row instead of ending the sweep."""

from __future__ import annotations

import subprocess
import sys


def last_line(argv: list[str], timeout: float, wanted) -> tuple[str | None, str]:
    """``(line, "")``: the last line of ``python *argv``'s output that ``wanted(line)`` accepts, or
    ``(None, why)``: over ``timeout`` seconds, a failed exit or no such line (the last line of its
    stderr)."""
    try:
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"over {timeout:g} s"
    lines = [line for line in done.stdout.splitlines() if wanted(line)]
    if done.returncode < 0:  # killed: SIGKILL is the kernel's out-of-memory killer's
        return None, f"killed by signal {-done.returncode}" + (" (out of memory?)" if done.returncode == -9 else "")
    if done.returncode or not lines:
        return None, (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
    return lines[-1], ""
