"""A documented ``kvpass eval`` JSON against a rerun of its command, row by row: whether each row the two
share (same method, text, context, chunk and first step) reproduced to the last digit, and if not, how far its
change against the unquantized model moved, beside the rerun's standard error of that change, and the rerun's
perplexity change against the documented row itself, paired over the same 64-token blocks (a rerun on another
CPU, whose sums round otherwise, moves every row a little: the paired change says by how much beyond noise).

    python benchmarks/compare_eval.py docs/eval-windows-2k-r43.json /tmp/rerun.json

Exits 1 when a shared row differs, 2 when the two share no row (the rerun ran another command).
"""

from __future__ import annotations

import argparse
import json
import math

from kvpass import eval as kv_eval

# A row reproduces when its measurements do; its timings never do.
MEASURED = ("ppl", "nll_blocks", "top1_match", "agreed_tokens", "kv_bytes_per_token")


def rows_by_setting(path: str) -> dict[tuple, dict]:
    with open(path) as f:
        rows = json.load(f)["rows"]
    # Rows written before --prefill existed have no "prefill": their first step was a chunk.
    return {(r["method"], r["text"], r["ctx"], r["chunk"], r.get("prefill", r["chunk"])): r for r in rows}


def compare(documented: dict[tuple, dict], rerun: dict[tuple, dict]) -> list[tuple[tuple, bool, dict, dict]]:
    """``(setting, reproduced, documented row, rerun row)`` for every setting both hold, in order."""
    return [(key, all(documented[key].get(f) == rerun[key].get(f) for f in MEASURED), documented[key], rerun[key])
            for key in sorted(documented.keys() & rerun.keys(), key=str)]  # fmt: skip


def _agreement(row: dict) -> str:
    return "-" if row.get("agreement") is None else f"{row['agreement']:.3f}"


def _change(row: dict) -> str:
    return kv_eval._change(row.get("delta_pct"), row.get("delta_pct_se")) or "-"


def _paired(old: dict, new: dict) -> str:
    # Rows written before their summed NLL was kept, or over other blocks, have nothing to pair.
    if "nll" not in old or "nll" not in new or len(old["nll_blocks"]) != len(new["nll_blocks"]):
        return "-"
    se = kv_eval.paired_delta_se(new["nll_blocks"], old["nll_blocks"], new["scored"])
    return kv_eval._change(100 * math.expm1(new["nll"] - old["nll"]), se)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("documented", help="the JSON a docs page cites")
    parser.add_argument("rerun", help="the JSON its command wrote again")
    args = parser.parse_args(argv)
    shared = compare(rows_by_setting(args.documented), rows_by_setting(args.rerun))
    if not shared:
        print(f"{args.documented} and {args.rerun} share no (method, text, ctx, chunk, prefill) row")
        return 2
    print("| method | text | ctx | chunk | prefill | reproduced | perplexity | change against fp | rerun against documented, "
          "paired | greedy agreement |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (method, text, ctx, chunk, prefill), same, old, new in shared:
        print(f"| {method} | {text} | {ctx} | {chunk} | {prefill} | {'yes' if same else 'no'} "
              f"| {old['ppl']:.6f} -> {new['ppl']:.6f} | {_change(old)} -> {_change(new)} | {_paired(old, new)} "
              f"| {_agreement(old)} -> {_agreement(new)} |")  # fmt: skip
    return 0 if all(same for _, same, _, _ in shared) else 1


if __name__ == "__main__":
    raise SystemExit(main())
