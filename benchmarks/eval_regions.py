"""Where in its windows a `kvpass eval` row gains or loses against another, from a saved JSON.

    python benchmarks/eval_regions.py docs/eval-windows-2k-kp512-code.json kv4-kp512 kv4 --split 512

Prints the perplexity change of METHOD against BASE (paired block by block, as `--against` does)
over the scored tokens before position SPLIT of each window and over those from it on. Rows keep the
summed NLL of every 64 scored tokens (`nll_blocks`), window after window, so a block's position in
its window follows from the first scored token (the prefill, else one chunk).
"""

from __future__ import annotations

import argparse
import json
import math

from kvpass.eval import NLL_BLOCK, paired_delta_se


def region_changes(rows: list[dict], method: str, base: str, split: int) -> list[tuple[str, int, float, float]]:
    """``(region, scored tokens, change %, standard error %)`` before and from ``split``."""
    by_name = {row["method"]: row for row in rows}
    missing = [name for name in (method, base) if name not in by_name or "nll_blocks" not in by_name[name]]
    if missing:
        raise SystemExit(f"no nll_blocks for {missing}; rows with them: {[r['method'] for r in rows if 'nll_blocks' in r]}")
    row = by_name[method]
    first = row.get("prefill") or row["chunk"]
    per_window = (row["ctx"] - first) // NLL_BLOCK
    blocks, base_blocks = row["nll_blocks"], by_name[base]["nll_blocks"]
    changes = []
    for region, wanted in ((f"tokens {first}-{split - 1}", True), (f"tokens {split}-{row['ctx'] - 1}", False)):
        picked = [i for i in range(len(blocks)) if (first + NLL_BLOCK * (i % per_window) < split) == wanted]
        if not picked:
            continue
        scored = NLL_BLOCK * len(picked)
        mine, theirs = [blocks[i] for i in picked], [base_blocks[i] for i in picked]
        change = 100 * (math.exp((sum(mine) - sum(theirs)) / scored) - 1)
        changes.append((region, scored, change, paired_delta_se(mine, theirs, scored)))
    return changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="a JSON written by kvpass eval --json")
    parser.add_argument("method")
    parser.add_argument("base", help="the method to compare with (fp for the change against the unquantized model)")
    parser.add_argument("--split", type=int, required=True, help="position in each window where the second region starts")
    args = parser.parse_args()
    rows = json.load(open(args.json))["rows"]
    for text, ctx in sorted({(row["text"], row["ctx"]) for row in rows}):
        grid_cell = [row for row in rows if (row["text"], row["ctx"]) == (text, ctx)]
        for region, scored, change, se in region_changes(grid_cell, args.method, args.base, args.split):
            print(f"{text} {ctx}: {args.method} against {args.base}, {region} ({scored} scored): {change:+.2f}% ± {se:.2f}")


if __name__ == "__main__":
    main()
