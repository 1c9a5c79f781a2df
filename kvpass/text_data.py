"""Evaluation text that every machine has without a network: English (KJV) and Python code.

* ``kjv()``: the King James Bible from Debian's ``bible-kjv`` package (public domain),
  printed by its ``bible`` command, with chapter headings and verse numbers stripped.
* ``python_code()``: a fixed list of modules from the running Python's standard library,
  concatenated in a fixed order.
* ``from_file(path)``: any UTF-8 text file.

``load(name)`` picks one by name (``"kjv"``, ``"code"``) or a path.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

KJV_RANGE = "Gen1:1-Rev22:21"
INSTALL_BIBLE = "apt-get install bible-kjv"

# Plain, long, stable modules; files missing from some Python version are skipped.
STDLIB_FILES = (
    "argparse.py", "dataclasses.py", "textwrap.py", "fractions.py", "heapq.py",
    "shlex.py", "calendar.py", "difflib.py", "configparser.py", "string.py",
    "functools.py", "bisect.py", "statistics.py", "pprint.py", "tokenize.py",
    "json/decoder.py", "json/encoder.py", "csv.py", "gettext.py", "ipaddress.py",
)  # fmt: skip

_VERSE = re.compile(r"^\s+\d+\s+")  # "  12 And ..." (continuation lines start in column 0)
_HEADING = re.compile(r"^\S.*\s\d+$")  # "Genesis 1", "1 Kings 3", "Song of Solomon 2"


def strip_kjv(raw: str) -> str:
    """Plain text of ``bible`` output: headings dropped, verse numbers removed.

    Verses of a chapter are joined into one paragraph; chapters are separated by a blank line.
    """
    chapters: list[list[str]] = []
    verse: list[str] = []
    previous_blank = True
    for line in raw.splitlines():
        stripped = line.strip()
        heading = previous_blank and _HEADING.match(line)
        previous_blank = not stripped
        if not stripped:
            continue
        if heading:
            if verse:
                chapters[-1].append(" ".join(verse))
                verse = []
            chapters.append([])
            continue
        if _VERSE.match(line):
            if verse:
                chapters[-1].append(" ".join(verse))
            verse = [_VERSE.sub("", line).strip()]
        else:
            verse.append(stripped)
        if not chapters:
            chapters.append([])
    if verse:
        chapters[-1].append(" ".join(verse))
    return "\n\n".join(" ".join(c) for c in chapters if c) + "\n"


def kjv(passage: str = KJV_RANGE) -> str:
    """The King James Bible (``passage`` in the ``bible`` command's syntax) as plain text."""
    exe = shutil.which("bible")
    if exe is None:
        raise FileNotFoundError(f"the `bible` command is missing; install it with: {INSTALL_BIBLE}")
    raw = subprocess.run([exe, passage], check=True, capture_output=True, text=True).stdout
    return strip_kjv(raw)


def python_code(files=STDLIB_FILES) -> str:
    """Source of standard-library modules, each preceded by a ``# file:`` comment line."""
    root = Path(sysconfig.get_path("stdlib"))
    parts = []
    for name in files:
        path = root / name
        if path.is_file():
            parts.append(f"# file: {name}\n{path.read_text(encoding='utf-8')}")
    if not parts:
        raise FileNotFoundError(f"none of the standard-library files were found under {root}")
    return "\n".join(parts)


def from_file(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"cannot read text file {str(path)!r}: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"text file {str(path)!r} is not UTF-8 text ({err})") from err


TEXTS = {"kjv": kjv, "code": python_code}


def load(name: str) -> str:
    """Text by name (``kjv``, ``code``) or, failing that, the contents of the file ``name``."""
    if name in TEXTS:
        return TEXTS[name]()
    if Path(name).is_file():
        return from_file(name)
    raise ValueError(f"unknown text {name!r}: use one of {sorted(TEXTS)} or a file path")
