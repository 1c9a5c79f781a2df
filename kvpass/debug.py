"""What the backend did, for people: normalised graph code, its diff, and a site table."""

from __future__ import annotations

import difflib
import logging
import os
import re
from pathlib import Path

import torch.fx as fx

log = logging.getLogger("kvpass")

_DEBUG_ENV = "KVPASS_DEBUG"
_DEBUG_DIR_ENV = "KVPASS_DEBUG_DIR"

# Dynamo names a graph input after its access path: l_args_0_modules_model_modules_layers_
# modules_0_..._parameters_weight_. The dotted module path says the same in a third of the width.
_DYNAMO_NAME = re.compile(r"\b[lL]_\w+")
_NAME_PARTS = [
    (re.compile(r"^[lL]_(?:args_0|self)_modules_"), ""),
    (re.compile(r"^[lL]_kwargs_"), ""),
    (re.compile(r"_modules_"), "."),
    (re.compile(r"_(?:parameters|buffers)_"), "."),
    (re.compile(r"_$"), ""),
]


def _short_name(match: re.Match) -> str:
    name = match.group(0)
    for pattern, repl in _NAME_PARTS:
        name = pattern.sub(repl, name)
    return name


def debug_requested(option: bool, save_dir: str | None = None) -> bool:
    """Whether to report each graph: ``option`` or ``KVPASS_DEBUG`` asks for it, and so does a folder to save
    it in (``save_dir`` or ``KVPASS_DEBUG_DIR``)."""
    return bool(option or save_dir or os.environ.get(_DEBUG_DIR_ENV)) or os.environ.get(_DEBUG_ENV, "") not in ("", "0")


def normalize_graph_code(gm: fx.GraphModule) -> str:
    """``gm.code`` with the noise that differs between runs and is not the program removed.

    Drops the placeholder re-binding lines and the ``; x = None`` frees, and shortens
    Dynamo's parameter names to dotted module paths.
    """
    lines = []
    for line in gm.code.strip().splitlines():
        line = line.split(";  ")[0].rstrip()
        if not line.strip() or re.match(r"\s+(\w+) = L_\w+$", line) or line.strip() == "return ()":
            continue
        if line.startswith("def forward"):
            line = "def forward(" + ", ".join(n.name for n in gm.graph.find_nodes(op="placeholder")) + "):"
        line = _DYNAMO_NAME.sub(_short_name, line)
        lines.append(line)
    return "\n".join(lines) + "\n"


def graph_diff(before: str, after: str, name: str = "graph") -> str:
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True), after.splitlines(keepends=True), f"{name} (fp16)", f"{name} (kv4)", n=0
        )
    )


def site_table(reports) -> str:
    rows = [("site", "module", "form", "phase", "kv cache", "reason")]
    for r in reports:
        kv_cache = "int4" if r.rewritten else "fp16" if r.left_fp16 else "none"
        rows.append((str(r.index), r.module, r.form, r.phase, kv_cache, r.reason))
    if len(rows) == 1:
        rows.append(("-", "-", "-", "-", "-", "no attention (SDPA or matmul-softmax-matmul) in this graph"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ("  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths)) + "  " + row[5] for row in rows)
    return "\n".join(line.rstrip() for line in lines) + "\n"


def report(graph_name: str, before: str, after: str, reports, save_dir: str | None) -> None:
    """Log the diff and the site table; also write them under ``save_dir`` when given."""
    diff = graph_diff(before, after, graph_name)
    table = site_table(reports)
    log.info("kvpass: %s\n%s\n%s", graph_name, table, diff or "(graph unchanged)\n")
    save_dir = save_dir or os.environ.get(_DEBUG_DIR_ENV)
    if save_dir:
        folder = Path(save_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{graph_name}.before.py").write_text(before)
        (folder / f"{graph_name}.after.py").write_text(after)
        (folder / f"{graph_name}.diff").write_text(diff)
        (folder / f"{graph_name}.sites.txt").write_text(table)
