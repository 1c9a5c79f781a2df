"""``kvpass bench decode``: per-token decode latency against context length, on CPU (or ``--device cuda``).

For each context: fill each method's cache to it and run ``--warmup`` decode steps (they
include compilation for the compiled methods), then time ``--steps`` single-token decode
steps of each method one by one, in ``--rounds`` turns with the methods alternating, and
report their median (and the 10-90% range). Ratios are to the ``fp`` (eager
``DynamicCache``) median measured in the same run at the same context.

Methods: ``fp`` (eager DynamicCache), ``fp-compiled`` (``torch.compile(backend="eager")``
over a DynamicCache: Dynamo's own per-step overhead, without any kv4 rewrite), ``kv4``
(``torch.compile(model, backend=kvpass.kv4())``, default settings), ``kv4-qr`` (the same with
``k_query_rounded=True``), ``kv4-r0`` (the same with ``refine=0``: no second code plane),
``kv4-inductor`` (the same with ``inner="inductor"``: the rest of the model compiled by Inductor
too), ``quanto`` (HF ``QuantizedCache``, quanto int4, eager). ``--kv4-setting NAME=VALUE`` gives
every kv4 method a ``kvpass.kv4`` keyword of one's own (``bits=8``), under the method's own.

``--fill fast`` (default) fills the kv4 cache eagerly in fp and packs it with
``PackedKV.from_float`` (what kv4's quantize-on-write stores, without kv4's slower CPU
prefill; K's query scales from the keys standing in for the fill's queries); ``--fill real``
prefills through the compiled model.

``--device cuda`` runs the same grid on the GPU (the model and cache there, each timed step
ended by a synchronize); quanto's CUDA path needs its compiled extension.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvpass import arguments, version
from kvpass.cache_argument import kv_layers
from kvpass.tables import render_table

DEFAULT_METHODS = "fp,fp-compiled,kv4,quanto"
_HOW = {"fp": "dynamic", "fp-compiled": "compiled", "kv4": "kv4", "kv4-qr": "kv4", "kv4-r0": "kv4",
        "kv4-inductor": "kv4", "quanto": "quanto"}  # fmt: skip
# kvpass.kv4 settings of the kv4 methods other than the default.
_KV4_SETTINGS = {"kv4-qr": dict(k_query_rounded=True), "kv4-r0": dict(refine=0), "kv4-inductor": dict(inner="inductor")}


def _pack(cache, like, query_heads: int, tokens: int):
    """``cache``'s fp layers, filled with ``tokens`` tokens, stored as the compiled model stored ``like``'s
    (a short prompt's cache), layer by layer and with their specs: what a real prefill would store (MLA
    latents with V's spec, narrow heads' specs, per-layer K bits); a layer left fp16 stays so."""
    from kvpass.packed import PackedKV

    for layer, stored in zip(kv_layers(cache), kv_layers(like)):
        for name in ("keys", "values"):
            fp, spec = getattr(layer, name), getattr(getattr(stored, name), "spec", None)
            if spec is None:
                continue
            # A sliding layer past its window has evicted the prompt's first tokens, its sinks among them:
            # the window's first tokens stand in for them, and leave as they did, so decode starts from
            # the structure a real prefill leaves (no sinks), not one its first steps would change.
            evicted = spec.sinks if fp.shape[2] < tokens else 0
            if evicted:
                fp = torch.cat([fp[:, :, :evicted], fp], dim=2)
            # The fill's queries are gone; the keys stand in for them, so a query-scaled K holds scales
            # and decode reads them as after a real prefill (latency does not depend on their values).
            query = fp.repeat_interleave(query_heads // fp.shape[1], dim=1) if spec.query_scaled else None
            packed = PackedKV.from_float(fp, spec, query)
            setattr(layer, name, packed[:, :, evicted:] if evicted else packed)
    return cache


@torch.no_grad()
def prepare(model, method: str, ctx: int, batch: int = 1, warmup: int = 3, fill: str = "fast", chunk: int = 256,
            stepper: tuple | None = None) -> dict:  # fmt: skip
    """``method``'s cache filled to ``ctx`` tokens and ``warmup`` decode steps taken (compiles included), as
    ``dict(method, step, cache, device, fill_s, warmup_s)`` for :func:`time_steps`; ``stepper``: the
    method's :func:`kvpass.bench.stepper` if made already."""
    from kvpass import bench

    how, settings = _HOW[method], _KV4_SETTINGS.get(method, {})
    step, new_cache = stepper or bench.stepper(model, how, settings)
    vocab, device = model.config.vocab_size, model.device
    if how == "kv4" and fill == "fast":
        stored = bench.fill(step, new_cache(), batch, 2, vocab=vocab, device=device)  # what each layer stores
    t0 = time.perf_counter()
    if how == "kv4" and fill == "fast":
        cache = bench.fill(model, bench.dynamic_cache(model), batch, ctx, chunk=chunk, vocab=vocab, device=device)
        cache = _pack(cache, stored, model.config.num_attention_heads, ctx)
    else:
        cache = bench.fill(step, new_cache(), batch, ctx, chunk=chunk, vocab=vocab, device=device)
    _synchronize(device)
    fill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(warmup):
        cache = bench.decode_step(step, cache, batch, device=device)
    _synchronize(device)
    return dict(method=method, step=step, cache=cache, device=device, fill_s=fill_s,
                warmup_s=time.perf_counter() - t0)  # fmt: skip


@torch.no_grad()
def time_steps(run: dict, steps: int, batch: int = 1) -> list[float]:
    """Seconds of each of ``steps`` single-token decode steps of a ``run`` from :func:`prepare`, whose
    cache they extend; ``run["graphs_compiled"]`` counts the graphs Dynamo compiled while they ran (a
    step that compiles is timed with its compile)."""
    from torch._dynamo.utils import counters

    from kvpass import bench

    device, times = run["device"], []
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(steps):
        t = time.perf_counter()
        run["cache"] = bench.decode_step(run["step"], run["cache"], batch, device=device)
        _synchronize(device)
        times.append(time.perf_counter() - t)
    run["graphs_compiled"] = run.get("graphs_compiled", 0) + counters["stats"]["unique_graphs"] - graphs
    return times


def _synchronize(device: torch.device) -> None:
    # A GPU step returns before its kernels finish; a timed step ends when they have.
    if device.type == "cuda":
        torch.cuda.synchronize()


def summarize(run: dict, times: list[float], ctx: int, batch: int, warmup: int) -> dict:
    """A grid row: the median of ``times`` and their 10-90% range, in ms."""
    from kvpass import bench

    if _HOW[run["method"]] == "kv4":
        from kvpass.packed import PackedKV

        if not isinstance(kv_layers(run["cache"])[0].keys, PackedKV):
            raise RuntimeError("kv4 did not take effect: the cache holds plain tensors")
    times = sorted(times)
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return dict(
        method=run["method"], ctx=ctx, batch=batch, median_ms=1e3 * statistics.median(times), p10_ms=1e3 * q(0.1),
        p90_ms=1e3 * q(0.9), steps=len(times), warmup=warmup, fill_s=run["fill_s"], warmup_s=run["warmup_s"],
        graphs_compiled=run.get("graphs_compiled", 0), stored_bytes=bench.stored_bytes(run["cache"]),
    )  # fmt: skip


def _error_row(method: str, ctx: int, batch: int, exc: Exception) -> dict:
    first = (str(exc).strip().splitlines() or [""])[0]
    return dict(method=method, ctx=ctx, batch=batch, error=f"not run: {type(exc).__name__}: {first}"[:300])


def run_grid(methods, contexts, batch=1, warmup=3, steps=10, fill="fast", dtype=torch.float32, sizes=None, chunk=256,
             progress=False, model=None, device="cpu", rounds=1, kv4_settings=None) -> list[dict]:  # fmt: skip
    """The grid on ``model`` (default: the benchmark model of ``sizes``, :func:`kvpass.bench.build_model`),
    moved to ``device``. At each context every method is filled and warmed up, then each times its
    ``steps`` in ``rounds`` turns, the methods taking turns (in an order rotated every round): a
    machine's load that drifts over minutes then weighs on every method alike, not on whichever ran
    while it was high. ``kv4_settings``: ``kvpass.kv4`` keywords for every kv4 method, under each
    method's own (``kv4-qr`` keeps its ``k_query_rounded=True``)."""
    from tqdm.auto import tqdm

    from kvpass import bench

    if not 1 <= rounds <= steps:
        raise ValueError(f"rounds must be between 1 and steps ({steps}), got {rounds}")
    if len(set(methods)) < len(methods):
        raise ValueError(f"methods must not repeat, got {list(methods)}")
    model = (bench.build_model(dtype, **(sizes or {})) if model is None else model).to(device)
    rows = []
    bar = tqdm(total=len(contexts) * len(methods) * (1 + rounds), disable=not progress, file=sys.stderr,
               desc="decode")  # fmt: skip
    for ctx in contexts:
        # Every stepper before any fill: making a compiled one resets Dynamo, which would drop
        # another's graphs.
        steppers = {m: bench.stepper(model, _HOW[m], {**(kv4_settings or {}), **_KV4_SETTINGS.get(m, {})})
                    for m in methods}  # fmt: skip
        runs, times, failed = {}, {m: [] for m in methods}, {}
        for method in methods:
            try:
                runs[method] = prepare(model, method, ctx, batch, warmup, fill, chunk, steppers[method])
            except Exception as exc:  # noqa: BLE001 - recorded, the grid goes on
                failed[method] = _error_row(method, ctx, batch, exc)
            bar.update()
        for r in range(rounds):
            turn = steps // rounds + (r < steps % rounds)
            for i in range(len(methods)):
                method = methods[(i + r) % len(methods)]
                if method in runs and method not in failed:
                    try:
                        times[method] += time_steps(runs[method], turn, batch)
                    except Exception as exc:  # noqa: BLE001
                        failed[method] = _error_row(method, ctx, batch, exc)
                bar.update()
        for method in methods:
            try:
                row = failed.get(method) or summarize(runs[method], times[method], ctx, batch, warmup)
            except Exception as exc:  # noqa: BLE001
                row = _error_row(method, ctx, batch, exc)
            rows.append(row)
            if progress:  # each row as its context finishes: a run cut short still leaves its numbers
                tqdm.write(f"{method}, ctx {ctx}: " + (f"{row['median_ms']:.1f} ms" if "median_ms" in row else row["error"]),
                           file=sys.stderr)  # fmt: skip
        del runs, steppers
        torch._dynamo.reset()
    bar.close()
    rows.sort(key=lambda r: methods.index(r["method"]))  # stable: each method's contexts in order
    base = {r["ctx"]: r["median_ms"] for r in rows if r["method"] == "fp" and "median_ms" in r}
    for r in rows:
        if "median_ms" in r and r["ctx"] in base:
            r["ratio_fp"] = r["median_ms"] / base[r["ctx"]]
    return rows


def format_table(rows: list[dict], markdown: bool = False) -> str:
    header = ["method", "batch", "ctx", "median ms/token", "p10-p90 ms", "x fp", "fill (s)", "warm-up (s)",
              "graphs compiled while timed"]  # fmt: skip
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["method"], str(r["batch"]), str(r["ctx"]), r["error"]] + [""] * (len(header) - 4))
            continue
        lines.append([
            r["method"], str(r["batch"]), str(r["ctx"]), f"{r['median_ms']:.1f}", f"{r['p10_ms']:.1f}-{r['p90_ms']:.1f}",
            f"{r['ratio_fp']:.2f}" if "ratio_fp" in r else "", f"{r['fill_s']:.1f}", f"{r['warmup_s']:.1f}",
            str(r["graphs_compiled"]),
        ])  # fmt: skip
    return render_table(header, lines, markdown)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", type=arguments.comma_list(arguments.one_of(_HOW, "method"), "methods"),
                        default=DEFAULT_METHODS, help=f"comma-separated, of {', '.join(_HOW)} (default {DEFAULT_METHODS})")
    parser.add_argument("--contexts", type=arguments.token_list, default="1024,4096", help="comma-separated context lengths (default 1024,4096)")
    parser.add_argument("--long", action="store_true", help="add 16384 to the contexts")
    parser.add_argument("--batch", type=arguments.positive_int, default=1)
    parser.add_argument("--warmup", type=arguments.nonnegative_int, default=3,
                        help="untimed decode steps first (default 3)")
    parser.add_argument("--steps", type=arguments.positive_int, default=10, help="timed decode steps (default 10)")
    parser.add_argument("--rounds", type=arguments.positive_int, default=1,
                        help="time each method's steps in this many turns, the methods alternating (at most --steps; "
                             "default 1: one method after another)")  # fmt: skip
    parser.add_argument("--fill", choices=["fast", "real"], default="fast", help="how the kv4 cache is filled")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--model", default=None,
                        help=f"a real model instead of the benchmark model: {arguments.REAL_MODELS}; random tokens "
                             "fill it")  # fmt: skip
    parser.add_argument("--hidden", type=arguments.positive_int, default=1024, help="the benchmark model's (no --model)")
    parser.add_argument("--layers", type=arguments.positive_int, default=2, help="the benchmark model's (no --model)")
    parser.add_argument("--threads", type=arguments.positive_int, default=None)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model and cache live (default cpu)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--markdown", metavar="PATH")
    parser.add_argument("--no-progress", action="store_true")
    arguments.add_kv4_settings(parser, "every kv4 method, under the method's own (kv4-qr keeps k_query_rounded)")


def run(args) -> int:
    from kvpass import bench
    from kvpass.backend import check_settings
    from kvpass.bench import memory

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda, but this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
    contexts = args.contexts + ([16384] if args.long else [])
    kv4_settings = dict(args.kv4_settings)
    check_settings(kv4_settings, "kvpass bench decode")
    dtype = getattr(torch, args.dtype)
    model = None
    if args.model is not None:
        from kvpass.models_zoo.real_model import load_model

        model = load_model(args.model, dtype)[0]
    t0 = time.perf_counter()
    rows = run_grid(args.methods, contexts, args.batch, args.warmup, args.steps, args.fill, dtype,
                    dict(hidden=args.hidden, layers=args.layers), progress=not args.no_progress, model=model,
                    device=args.device, rounds=args.rounds, kv4_settings=kv4_settings)  # fmt: skip
    elapsed = time.perf_counter() - t0
    print(format_table(rows))
    if kv4_settings:
        print(f"\nkv4 methods with {arguments.kv4_settings_text(args.kv4_settings)}")
    print(f"\n{version.cpu()}; {torch.get_num_threads()} threads")  # ratios differ from one CPU to another
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    info = dict(command=bench.command_line("decode"), elapsed_s=elapsed, dtype=args.dtype, model=args.model, device=device,
                threads=torch.get_num_threads(), torch=torch.__version__, allocator=memory.current_allocator(),
                allocator_settings=memory.allocator_settings(), kv4_settings=kv4_settings, rows=rows)  # fmt: skip
    bench.write_results(args, info, format_table(rows, markdown=True))
    return 0
