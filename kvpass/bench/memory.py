"""``kvpass bench memory``: stored KV bytes per token and peak process memory against context.

Each configuration (cache kind x context x batch) runs in a fresh Python subprocess, so its
memory belongs to it alone. In the subprocess: build the KV-dominated random-weight Llama of
:mod:`kvpass.bench`, warm up (compile, for kv4) on the chunk sizes the measurement uses, collect
garbage and hand freed memory back to the OS (:func:`release_free_memory`, for whichever allocator
serves the process), read the resident set and reset the kernel's high-water mark to it
(``/proc/self/clear_refs``), then fill a fresh cache to the context in chunks of 256 tokens and
decode a few tokens, and read the high-water mark. Reported: the bytes the cache stores (counted
from its tensors), per token and as a fraction of fp16; the peak resident set while filling and
decoding; and its growth over the resident set before (cache + transients). Where the mark cannot
be reset (no ``/proc``), both are ``ru_maxrss``, whose baseline then includes the warm-up's own peak.

The resident set depends on the allocator as much as on the cache (glibc keeps freed heap memory
resident, docs/bench-memory.md), so each row names the allocator its process ran with and the
allocator settings in its environment; ``--allocator`` preloads jemalloc, tcmalloc or mimalloc into the
configurations' processes.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from kvpass import arguments
from kvpass.tables import render_table

DEFAULT_CACHES = "fp16,bf16,kv4,quanto"
# kv4's peak growth at 16K against the fp16 run's stored KV: the target of docs/bench-memory.md.
PEAK_TARGET = 0.4


class _Preloadable(NamedTuple):
    library: str  # as ctypes.util.find_library takes it
    symbol: str  # exported by it alone: where it resolves, the library serves the process's malloc
    package: str  # Debian's


# Allocators --allocator preloads (LD_PRELOAD) into each configuration's process.
PRELOADABLE_ALLOCATORS = {
    "jemalloc": _Preloadable("jemalloc", "mallctl", "libjemalloc2"),
    "tcmalloc": _Preloadable("tcmalloc_minimal", "MallocExtension_ReleaseFreeMemory", "libtcmalloc-minimal4"),
    "mimalloc": _Preloadable("mimalloc", "mi_collect", "libmimalloc2.0"),
}
# Environment variables that change how an allocator keeps memory (glibc's MALLOC_MMAP_THRESHOLD_,
# jemalloc's MALLOC_CONF, tcmalloc's TCMALLOC_*, mimalloc's MIMALLOC_*): recorded with each row.
ALLOCATOR_VARIABLES = ("MALLOC_", "TCMALLOC_", "MIMALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD")


def _maxrss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _status_mib(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark) of this process, in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise OSError(f"/proc/self/status has no {field}")


def current_allocator() -> str:
    """The allocator serving this process's malloc: a preloaded one of :data:`PRELOADABLE_ALLOCATORS`,
    else ``"glibc"`` where ``malloc_trim`` resolves, else ``"unknown"``."""
    from kvpass import packed

    if os.name != "posix":
        return "unknown"
    process = ctypes.CDLL(None)
    for name, preloadable in PRELOADABLE_ALLOCATORS.items():
        if hasattr(process, preloadable.symbol):
            return name
    return "glibc" if packed._malloc_trim() is not None else "unknown"


def release_free_memory() -> None:
    """Hand the memory this process's allocator holds freed back to the OS, so that a baseline read
    after it holds none the fill could reuse unseen: glibc's ``malloc_trim``, jemalloc's purge of every
    arena (after this thread's cache), tcmalloc's ``ReleaseFreeMemory`` (after this thread's cache),
    mimalloc's forced ``mi_collect``."""
    from kvpass import packed

    kind = current_allocator()
    if kind == "glibc":
        packed._malloc_trim()(0)
    elif kind == "jemalloc":
        for control in (b"thread.tcache.flush", b"arena.4096.purge"):  # 4096: MALLCTL_ARENAS_ALL
            if err := ctypes.CDLL(None).mallctl(control, None, None, None, ctypes.c_size_t(0)):
                raise OSError(err, f"jemalloc's mallctl({control.decode()!r}) failed: a baseline read now "
                                   "would hold the memory it keeps freed")  # fmt: skip
    elif kind == "tcmalloc":
        process = ctypes.CDLL(None)
        # Its page heap, which ReleaseFreeMemory empties, lacks what this thread's cache holds freed:
        # 2-4 MiB, a size that varied from run to run under load (docs/bench-memory.md).
        process.MallocExtension_MarkThreadTemporarilyIdle()
        process.MallocExtension_ReleaseFreeMemory()
    elif kind == "mimalloc":
        # Forced: returned now, not after its delays; still not where live blocks lie among the freed
        # ones (13.7 MiB of 64 kept in tests/test_bench.py's check, docs/bench-memory.md).
        ctypes.CDLL(None).mi_collect(ctypes.c_bool(True))


def allocator_settings() -> dict[str, str]:
    """This process's environment variables of :data:`ALLOCATOR_VARIABLES`."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ALLOCATOR_VARIABLES)}


def preload(name: str) -> str:
    """The library ``LD_PRELOAD`` takes for allocator ``name`` (:data:`PRELOADABLE_ALLOCATORS`)."""
    if name not in PRELOADABLE_ALLOCATORS:
        raise ValueError(f"unknown allocator {name!r}; use one of {sorted(PRELOADABLE_ALLOCATORS)}")
    preloadable = PRELOADABLE_ALLOCATORS[name]
    library = ctypes.util.find_library(preloadable.library)
    if library is None:
        raise ValueError(f"allocator {name!r}: no lib{preloadable.library} on this machine "
                         f"(Debian and Ubuntu package it as {preloadable.package})")  # fmt: skip
    return library


def _resident_baseline_mib() -> float | None:
    """The resident set with freed memory handed back (:func:`release_free_memory`), the high-water
    mark reset to it; None where the mark cannot be reset. A warm-up's peak (compiling, for kv4) left
    in the mark would hide the fill's first megabytes under it: 21 MiB of growth for a 34 MiB cache at
    16K, batch 1."""
    release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # the kernel's code for resetting the peak resident set size
        return _status_mib("VmRSS")
    except OSError:
        return None


def measure(cache: str, ctx: int, batch: int, decode: int = 8, chunk: int = 256, sizes: dict | None = None,
            kv4_settings: dict | None = None) -> dict:  # fmt: skip
    """One configuration, measured in this process (call it in a fresh one for a clean peak);
    ``kv4_settings``: ``kvpass.kv4`` keywords for a kv4 cache."""
    import gc

    import torch
    from torch._dynamo.utils import counters

    from kvpass import bench

    dtype, how = bench.CACHES[cache]
    model = bench.build_model(dtype, **(sizes or {}))
    step, new_cache = bench.stepper(model, how, kv4_settings)
    vocab = model.config.vocab_size
    # Warm-up: every graph kind (first chunk, second chunk, dynamic chunks, the last shorter chunk,
    # decode steps) at the measured sizes, so no graph compiles while measuring: Dynamo's memory
    # would count as the cache's (64-token warm-up chunks left two graphs to the 16K fill of 256-token ones).
    # A context of under three chunks is filled as measured: its chunks come in another order (a short one
    # second, or none after the first), and its decode steps follow them.
    warm = bench.fill(step, new_cache(), batch, min(ctx, 3 * chunk + ctx % chunk), chunk=chunk, vocab=vocab)
    for _ in range(3):
        warm = bench.decode_step(step, warm, batch)
    del warm
    gc.collect()
    base = _resident_baseline_mib()
    resettable = base is not None
    base = base if resettable else _maxrss_mib()
    graphs = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    cache_obj = bench.fill(step, new_cache(), batch, ctx, chunk=chunk, vocab=vocab)
    for _ in range(decode):
        cache_obj = bench.decode_step(step, cache_obj, batch)
    seconds = time.perf_counter() - t0
    peak = _status_mib("VmHWM") if resettable else _maxrss_mib()
    tokens = batch * (ctx + decode)
    stored = bench.stored_bytes(cache_obj)
    fp16 = bench.fp16_bytes_per_token(model.config) * tokens
    return dict(
        cache=cache, ctx=ctx, batch=batch, decode=decode, tokens=tokens, stored_bytes=stored,
        bytes_per_token=stored / tokens, fp16_bytes=fp16, ratio_fp16=stored / fp16,
        peak_rss_mib=peak, warm_rss_mib=base, growth_mib=peak - base, seconds=seconds,
        threads=torch.get_num_threads(), graphs_compiled=counters["stats"]["unique_graphs"] - graphs,
        baseline="resident set before the fill" if resettable else "ru_maxrss after the warm-up",
        allocator=current_allocator(), allocator_settings=allocator_settings(),
    )  # fmt: skip


def measure_in_subprocess(cache: str, ctx: int, batch: int, decode: int = 8, chunk: int = 256,
                          sizes: dict | None = None, timeout: float | None = None,
                          allocator: str | None = None, kv4_settings: dict | None = None) -> dict:  # fmt: skip
    """:func:`measure` in a fresh process; ``allocator``: one of :data:`PRELOADABLE_ALLOCATORS`,
    preloaded there (None: the environment's own)."""
    job = json.dumps(dict(cache=cache, ctx=ctx, batch=batch, decode=decode, chunk=chunk, sizes=sizes,
                          kv4_settings=arguments.kv4_settings_as_literals(kv4_settings or {})))  # fmt: skip
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if allocator is not None:
        env["LD_PRELOAD"] = " ".join(filter(None, (preload(allocator), env.get("LD_PRELOAD"))))
    try:
        proc = subprocess.run([sys.executable, "-m", "kvpass.bench.memory", "--worker", job],
                              capture_output=True, text=True, timeout=timeout, env=env)  # fmt: skip
    except subprocess.TimeoutExpired:
        return dict(cache=cache, ctx=ctx, batch=batch, error=f"not run: timed out after {timeout} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(cache=cache, ctx=ctx, batch=batch, error=f"not run: {tail}"[:300])
    return json.loads(lines[-1])


def format_table(rows: list[dict], markdown: bool = False) -> str:
    header = ["cache", "batch", "ctx", "stored KV", "bytes/token", "x fp16", "peak RSS", "growth", "time (s)",
              "allocator"]  # fmt: skip
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["cache"], str(r["batch"]), str(r["ctx"]), r["error"], "", "", "", "", "", ""])
            continue
        settings = " ".join(f"{k}={v}" for k, v in r.get("allocator_settings", {}).items() if k != "LD_PRELOAD")
        lines.append([
            r["cache"], str(r["batch"]), str(r["ctx"]), f"{r['stored_bytes'] / 2**20:,.1f} MiB",
            f"{r['bytes_per_token']:,.0f}", f"{r['ratio_fp16']:.3f}", f"{r['peak_rss_mib']:,.0f} MiB",
            f"{r['growth_mib']:,.0f} MiB" + (f" ({n} graph{'s' * (n > 1)} compiled in it)" if (n := r.get("graphs_compiled")) else ""),
            f"{r['seconds']:.1f}", " ".join(filter(None, (r.get("allocator", ""), settings))),
        ])  # fmt: skip
    return render_table(header, lines, markdown)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.6), squeeze=False, layout="constrained")
    for ax, batch in zip(axes[0], batches):
        for cache in dict.fromkeys(r["cache"] for r in rows):
            pts = sorted((r["ctx"], r) for r in rows if r["batch"] == batch and r["cache"] == cache and "error" not in r)
            if not pts:
                continue
            xs = [c for c, _ in pts]
            line = ax.plot(xs, [r["growth_mib"] for _, r in pts], marker="o", label=f"{cache} peak RSS growth")[0]
            ax.plot(xs, [r["stored_bytes"] / 2**20 for _, r in pts], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{cache} stored KV")  # fmt: skip
        fp16 = sorted((r["ctx"], r["stored_bytes"]) for r in rows
                      if r["batch"] == batch and r["cache"] == "fp16" and "error" not in r)  # fmt: skip
        if fp16:  # the issue's 16K target for kv4's peak growth
            ax.plot([c for c, _ in fp16], [PEAK_TARGET * b / 2**20 for _, b in fp16], color="grey", linestyle=":",
                    label=f"{PEAK_TARGET}x fp16 stored KV (16K peak target)")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("MiB")
        ax.set_title(f"batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
    # One legend below the panels, where it hides no line (every panel draws the same series).
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncol=5, fontsize=7)
    fig.suptitle("KV-dominated Llama (2 layers, 8 KV heads x 128): peak RSS growth over the resident set before "
                 "the fill, and stored KV")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpass import bench

    parser.add_argument("--caches", type=arguments.comma_list(arguments.one_of(bench.CACHES, "cache"), "caches"),
                        default=DEFAULT_CACHES, help=f"comma-separated (default {DEFAULT_CACHES}); "
                        "also fp32, kv4-bf16, kv4-fp32, quanto-fp32")  # fmt: skip
    parser.add_argument("--contexts", type=arguments.token_list, default="1024,4096", help="comma-separated context lengths (default 1024,4096)")
    parser.add_argument("--long", action="store_true", help="add 16384 to the contexts")
    parser.add_argument("--batches", type=arguments.positive_int_list, default="1,4", help="comma-separated batch sizes (default 1,4)")
    parser.add_argument("--decode", type=arguments.nonnegative_int, default=8,
                        help="tokens decoded after filling (default 8)")
    parser.add_argument("--chunk", type=arguments.positive_int, default=256, help="fill chunk in tokens (default 256)")
    parser.add_argument("--hidden", type=arguments.positive_int, default=1024, help="model width (default 1024; tests use less)")
    parser.add_argument("--layers", type=arguments.positive_int, default=2)
    parser.add_argument("--timeout", type=arguments.positive_float, default=1800, help="seconds per configuration")
    parser.add_argument("--allocator", choices=sorted(PRELOADABLE_ALLOCATORS),
                        help="preload this allocator into each configuration's process (default: the environment's; "
                             "glibc's malloc keeps freed memory resident, which the peak counts)")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the rows here")
    parser.add_argument("--markdown", metavar="PATH", help="write the table and command here")
    parser.add_argument("--plot", metavar="PNG", help="plot memory against context here")
    parser.add_argument("--no-progress", action="store_true")
    arguments.add_kv4_settings(parser, "the kv4 caches")


def run(args) -> int:
    from tqdm.auto import tqdm

    from kvpass import bench
    from kvpass.backend import check_settings

    kv4_settings = dict(args.kv4_settings)
    check_settings(kv4_settings, "kvpass bench memory")
    contexts = args.contexts + ([16384] if args.long else [])
    sizes = dict(hidden=args.hidden, layers=args.layers)
    if args.allocator is not None:
        preload(args.allocator)  # here too: a missing library fails before the first configuration
    rows = []
    t0 = time.perf_counter()
    jobs = [(cache, batch, ctx) for cache in args.caches for batch in args.batches for ctx in contexts]
    for cache, batch, ctx in (bar := tqdm(jobs, disable=args.no_progress, file=sys.stderr, desc="memory")):
        row = measure_in_subprocess(cache, ctx, batch, args.decode, args.chunk, sizes, args.timeout, args.allocator,
                                    kv4_settings)  # fmt: skip
        rows.append(row)
        bar.write(f"  {cache} batch {batch} ctx {ctx}: " + (row.get("error") or
                  f"{row['bytes_per_token']:,.0f} B/token ({row['ratio_fp16']:.3f}x fp16), "
                  f"peak {row['peak_rss_mib']:,.0f} MiB"), file=sys.stderr)  # fmt: skip
    elapsed = time.perf_counter() - t0
    print(format_table(rows))
    if kv4_settings:
        print(f"\nkv4 caches with {arguments.kv4_settings_text(args.kv4_settings)}")
    info = dict(command=bench.command_line("memory"), elapsed_s=elapsed, sizes=sizes, kv4_settings=kv4_settings,
                rows=rows)  # fmt: skip
    bench.write_results(args, info, format_table(rows, markdown=True))
    if args.plot:
        plot(rows, args.plot)
    return 0


def _worker(job: str) -> None:
    spec = json.loads(job)
    settings = arguments.kv4_settings_from_literals(spec.pop("kv4_settings"))
    print(json.dumps(measure(**spec, kv4_settings=settings)), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        parser = argparse.ArgumentParser(prog="kvpass bench memory")
        add_arguments(parser)
        sys.exit(run(parser.parse_args()))
