"""``kvpass bench append``: the cost of appending one decoded token to a cache, against context.

One layer's K cache (``[batch, kv heads, context, head_dim]``, Llama-3-8B's 8 x 128 by
default) receives single-token appends, each timed on its own; three ways:

* ``fp16 cat``: ``torch.cat([cache, new], dim=2)``, what ``DynamicCache`` does;
* ``kv4 copy``: an int4 append that copies the packed cache every step (what a traced
  graph states, and what kvpass did before caches kept spare rows);
* ``kv4``: :meth:`kvpass.packed.PackedKV.append` on a growable cache, writing the new
  token's codes in place and regrowing the storage by a fraction of itself when full (the default
  spec, which rounds to nearest in appends this short);
* ``kv4-qr``: the same with ``k_query_rounded=True``, each append's codes rounded against its
  token's queries.

The kv4 caches are K caches as decode holds them: their first 64 tokens came with queries (which
fix K's query scales), and every append brings its token's ``QUERIES_PER_KV_HEAD`` query heads per KV head.

The median is the typical step; the mean over enough steps to cross a regrowth includes
the amortized copy. Per-step cost that stays flat as context grows is the claim checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from kvpass import arguments
from kvpass.tables import render_table

METHODS = ("fp16 cat", "kv4 copy", "kv4", "kv4-qr")
COPYING = ("fp16 cat", "kv4 copy")  # copy the whole cache every step; the others grow in place
COPYING_STEPS = 200
QUERIES_PER_KV_HEAD = 4  # Llama-3-8B's 32 query heads over its 8 KV heads


def _appender(method: str, past: torch.Tensor, spec, query: torch.Tensor):
    """``(cache, append)``: the cache holding ``past`` and ``append(cache, new)``, ``query`` each
    append's queries (one token's, ``[B, QUERIES_PER_KV_HEAD * H, 1, D]``)."""
    from kvpass.packed import PackedKV

    if method == "fp16 cat":
        return past, lambda cache, new: torch.cat([cache, new], dim=2)
    # The default rounds only appends of many tokens; kv4-qr rounds each one-token append too.
    spec = dataclasses.replace(spec, query_rounded=True) if method == "kv4-qr" else spec
    # Queries for the first tokens, which fix K's query scales; the rest of the fill needs none.
    first = spec.prefix_tokens
    packed = PackedKV.from_float(past[:, :, :first], spec, query.expand(-1, -1, first, -1)).append(past[:, :, first:])
    if method == "kv4 copy":
        # Dropping the growth bookkeeping makes every append copy into new storage.
        def copying(cache, new):
            return PackedKV(cache.codes, cache.scales, cache.residual, spec, **cache._parts()).append(new, query)

        return packed, copying
    return packed, lambda cache, new: cache.append(new, query)


@torch.no_grad()
def measure(method: str, ctx: int, steps: int, batch: int = 1, heads: int = 8, head_dim: int = 128) -> dict:
    from torch._dynamo.utils import counters

    from kvpass.config import KVConfig
    from kvpass.packed import spare_rows

    g = torch.Generator().manual_seed(0)
    past = torch.randn(batch, heads, ctx, head_dim, generator=g).half()
    new = torch.randn(batch, heads, 1, head_dim, generator=g).half()
    query = torch.randn(batch, QUERIES_PER_KV_HEAD * heads, 1, head_dim, generator=g).half()
    cache, append = _appender(method, past, KVConfig().k, query)
    for _ in range(2):  # warm-up: a CPU step's first call runs eagerly, its second compiles (kvpass.cpu_steps)
        cache = append(cache, new)
    graphs = counters["stats"]["unique_graphs"]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        cache = append(cache, new)
        times.append(time.perf_counter() - t0)
    period = 1 if method in COPYING else spare_rows(ctx)
    return dict(
        method=method, ctx=ctx, batch=batch, heads=heads, head_dim=head_dim, steps=steps,
        median_us=1e6 * statistics.median(times), mean_us=1e6 * statistics.fmean(times),
        max_us=1e6 * max(times), copies_whole_cache_every=period, threads=torch.get_num_threads(),
        graphs_compiled=counters["stats"]["unique_graphs"] - graphs,
        spec=getattr(cache, "spec", None) and cache.spec.tag,
    )  # fmt: skip


def run_grid(methods, contexts, steps: int | None = None, **shape) -> list[dict]:
    from kvpass.packed import spare_rows

    rows = []
    for ctx in contexts:
        for method in methods:
            # The growable cache runs long enough to cross one regrowth, so its mean is amortized;
            # the copying ones cost the same every step.
            default = COPYING_STEPS if method in COPYING else spare_rows(ctx) + 1
            rows.append(measure(method, ctx, steps or default, **shape))
            r = rows[-1]
            print(f"  {method} ctx {ctx}: median {r['median_us']:,.1f} us, mean {r['mean_us']:,.1f} us",
                  file=sys.stderr, flush=True)  # fmt: skip
    return rows


def format_table(rows: list[dict], markdown: bool = False) -> str:
    header = ["method", "ctx", "steps", "median (us)", "mean (us)", "max (us)", "median x at 1st ctx",
              "graphs compiled while timed"]  # fmt: skip
    first = {}
    lines = []
    for r in rows:
        base = first.setdefault(r["method"], r["median_us"])
        lines.append([
            r["method"], f"{r['ctx']:,}", str(r["steps"]), f"{r['median_us']:,.1f}", f"{r['mean_us']:,.1f}",
            f"{r['max_us']:,.0f}", f"{r['median_us'] / base:.2f}", str(r.get("graphs_compiled", "")),
        ])  # fmt: skip
    return render_table(header, lines, markdown)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", type=arguments.comma_list(arguments.one_of(METHODS, "method"), "methods"),
                        default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--contexts", type=arguments.token_list, default="1024,4096,16384,65536", help="comma-separated context lengths")
    parser.add_argument("--steps", type=arguments.positive_int, help=f"appends timed per point (default: {COPYING_STEPS}; "
                        "kv4: enough to cross a regrowth)")  # fmt: skip
    parser.add_argument("--batch", type=arguments.positive_int, default=1)
    parser.add_argument("--heads", type=arguments.positive_int, default=8, help="KV heads (default 8)")
    parser.add_argument("--head-dim", type=arguments.positive_int, default=128)
    parser.add_argument("--json", metavar="PATH", help="write the rows here")
    parser.add_argument("--markdown", metavar="PATH", help="write the table and command here")


def run(args) -> int:
    from kvpass import bench

    rows = run_grid(args.methods, args.contexts, args.steps,
                    batch=args.batch, heads=args.heads, head_dim=args.head_dim)  # fmt: skip
    print(format_table(rows))
    info = dict(command=bench.command_line("append"), torch=torch.__version__, rows=rows)
    bench.write_results(args, info, format_table(rows, markdown=True))
    return 0
