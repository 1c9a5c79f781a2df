"""Where a real model's kv4 decode step goes on CPU: SmolLM2 compiled with kv4, a prompt of
``--context`` KJV tokens, then ``--steps`` greedy decode steps, each timed whole, with timers
around the kv4 ops the graph calls (``graph_ops.kv4_decode``, a layer's attention and appends,
and inside it ``cpu_steps.decode_step``, their one compiled graph; where a site keeps them apart,
``graph_ops.kv4_append`` and, inside it, the quantization ``cpu_steps.encode_refined``, and
``graph_ops.kv4_sdpa``; compiled unless ``--eager-steps``) and the eager model for reference. Then the same calls on
the first layer's cache alone: back to back, and each after reading as many bytes as the model's
weights (what a decode step streams between two layers' kv4 calls), which evicts the CPU caches the
calls' many small ops would otherwise find warm. Then the first layer's decode call, warm, and what is
inside it (the op, its compiled graph, the attention's arguments). Last, a warm V append taken apart
by the layers of its call (the append; the ``kv4::`` op through the dispatcher, and called as the
append calls it, ``ops.call``, which skips the dispatcher; the op's CPU body; the compiled
quantization alone; and the append with the op's outputs given): what each layer adds to a call
whose work is one token.

    python benchmarks/decode_breakdown.py [--context 2000] [--steps 20] [--eager-steps] [--profile-graph]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import time
import unittest.mock

import torch
from transformers import DynamicCache

from kvpass import cpu_steps, graph_ops, ops, packed, reference, text_data
from kvpass.bench import dynamic_cache
from kvpass.cache_argument import cache_arg
from kvpass.models_zoo.real_model import load_model

spent, calls = collections.Counter(), collections.Counter()
# Before main() wraps it in a timer: the layered timing below calls the op's body as the op does.
encode_refined = cpu_steps.encode_refined


def timed(module, name: str) -> None:
    """Replace ``module.name`` by a wrapper adding its wall time to ``spent[name]``."""
    fn = getattr(module, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
            calls[name] += 1

    setattr(module, name, wrapper)


@torch.no_grad()
def step_ms(forward, prompt: torch.Tensor, steps: int) -> tuple[list[float], DynamicCache]:
    """Milliseconds of each of ``steps`` greedy decode steps after ``prompt`` (and 5 untimed ones), and the cache."""
    cache = dynamic_cache(forward)
    token = forward(input_ids=prompt, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
    for _ in range(5):
        token = forward(input_ids=token, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
    spent.clear(), calls.clear()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        token = forward(input_ids=token, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
        times.append(1e3 * (time.perf_counter() - start))
    return times, cache


def alone_ms(call, before=None, repeats: int = 50) -> float:
    """Median milliseconds of ``call()``, each run after an untimed ``before()`` if given."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        call()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


@torch.no_grad()
def print_calls_alone(model, cache: DynamicCache) -> None:
    """The first layer's K append and attention, called alone, warm and after streaming the weights."""
    keys, values = cache.layers[0].keys, cache.layers[0].values
    B, H, _, D = keys.shape
    new = torch.randn(B, H, 1, D)
    query = torch.randn(B, model.config.num_attention_heads, 1, D)
    weights = torch.ones(sum(p.numel() for p in model.parameters()))  # written, so reading it streams memory
    stored = [keys]

    def append():  # chained, as decode steps append, so the buffer grows in place
        stored[0] = stored[0].append(new)

    calls = {"K append": append,
             "attention": lambda: packed.attention(query, keys, values, new, new, None, None, False, 0.0, None)}  # fmt: skip
    print(f"the first layer's calls alone ({weights.numel() * 4 / 2**20:.0f} MiB of weights streamed before each, or not):")
    for name, call in calls.items():
        warm, cold = alone_ms(call), alone_ms(call, weights.sum)
        print(f"  {name:<10} {warm:5.2f} ms warm, {cold:5.2f} ms after the weights")


@torch.no_grad()
def print_append_layers(cache: DynamicCache, repeats: int = 2000) -> None:
    """The first layer's V append, warm, and each layer of its call alone: the difference between two
    lines is what the outer layer adds."""
    values = cache.layers[0].values
    spec, (B, H, S, D) = values.spec, values.shape
    new = torch.randn(B, H, 1, D)
    stored = [values]

    def append():  # chained, as decode steps append
        stored[0] = stored[0].append(new)

    layers = {
        "PackedKV.append": append,
        "kv4::quantize_refined, dispatched": lambda: ops.quantize_refined(new, *ops.codec_args(spec), spec.refine),
        "ops.call of it (what append calls)": lambda: ops.call(ops.quantize_refined, new, *ops.codec_args(spec), spec.refine),
        "cpu_steps.encode_refined (its body)": lambda: encode_refined(new, spec),
    }
    if cpu_steps.enabled:  # not with --eager-steps
        args = (cpu_steps._step(new), spec, reference.quantize, None, None)
        for _ in range(2):  # a key's first call runs eagerly, its second compiles (or a recent graph takes it)
            encode_refined(new, spec)
        # The graph that took the calls made as the op's body makes them (the dispatched line compiles another).
        graph = cpu_steps._recent[reference.encode_refined][0]
        layers["the compiled quantization alone"] = lambda: graph(*args)
    print(f"the first layer's V append at {S} tokens, warm, by the layers of its call (median of {repeats}):")
    for name, call in layers.items():
        print(f"  {name:<36} {1e3 * alone_ms(call, repeats=repeats):6.1f} us")
    # The append's own Python without the op in between: set against the first two lines, what
    # the two cost together beyond the sum of their parts.
    outputs = ops.quantize_refined(new, *ops.codec_args(spec), spec.refine)
    with unittest.mock.patch.object(ops, "quantize_refined", lambda *args: outputs):
        print(f"  {'PackedKV.append, the op outputs given':<36} {1e3 * alone_ms(append, repeats=repeats):6.1f} us")


# Calls a chained decode call makes before starting again from the prompt's caches.
CHAIN = 20


@torch.no_grad()
def print_decode_layers(model, cache: DynamicCache, repeats: int = 1000, profile: bool = False) -> None:
    """The first layer's decode call (its attention and both appends, ``packed.attend_and_append``),
    warm, and what is inside it: the op as the call makes it (``ops.call`` of ``kv4::decode_step``),
    its compiled graph alone, the attention's arguments, and the call with the op's outputs given (its
    own Python, most of it growing both caches after the op). The call is more than the op's line and
    its Python together: the op costs more handed a longer cache and new tensors each call."""
    keys, values = cache.layers[0].keys, cache.layers[0].values
    B, H, S, D = keys.shape
    q = torch.randn(B, model.config.num_attention_heads, 1, D)
    k_new, v_new = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
    stored, calls_made = [keys, values], [0]

    def step():
        # Chained, as decode steps grow the caches, and back to the prompt's caches every CHAIN calls:
        # a chain of `repeats` calls would time the op at up to S + repeats keys (it grows with them)
        # while the lines below time it at S. A restart copies its cache (not the view its storage
        # ends at), one call in CHAIN, which the median leaves out.
        if calls_made[0] % CHAIN == 0:
            stored[:] = keys, values
        calls_made[0] += 1
        _, stored[0], stored[1] = packed.attend_and_append(q, *stored, k_new, v_new, query=q)

    # A structure's first call runs eagerly and its second compiles (cpu_steps._run): then one call with
    # the op and the compiled graph recorded, to call them again with the same arguments.
    for _ in range(2):
        packed.attend_and_append(q, keys, values, k_new, v_new, query=q)
    seen = {}
    call, run = ops.call, cpu_steps._run

    def recorded_call(op, *args):
        outputs = call(op, *args)
        seen.setdefault(op, (args, outputs))
        return outputs

    def recorded_run(fn, args, *rest):  # (function, arguments, key, eager fallback, traced arguments)
        seen.setdefault("graph", (fn, args))
        return run(fn, args, *rest)

    with unittest.mock.patch.object(ops, "call", recorded_call), unittest.mock.patch.object(cpu_steps, "_run",
                                                                                            recorded_run):  # fmt: skip
        packed.attend_and_append(q, keys, values, k_new, v_new, query=q)
    layers = {"packed.attend_and_append": step}
    if ops.decode_step in seen:  # not where the layer's caches keep three calls
        layers["ops.call of kv4::decode_step"] = lambda: call(ops.decode_step, *seen[ops.decode_step][0])
    if "graph" in seen:  # not with --eager-steps
        fn, args = seen["graph"]
        graph = cpu_steps._recent[fn][0]  # the graph that took the call
        layers["the compiled graph alone"] = lambda: graph(*args)
    layers["packed._attention_args"] = lambda: packed._attention_args(q, keys, values, k_new, v_new, None, None, False,
                                                                      0.0, None)  # fmt: skip
    print(f"the first layer's decode call at {S} tokens ({S}-{S + CHAIN - 1} chained), warm, and what is inside it "
          f"(median of {repeats}):")  # fmt: skip
    for name, layer in layers.items():
        print(f"  {name:<36} {1e3 * alone_ms(layer, repeats=repeats):6.1f} us")
    if profile and "graph" in seen:
        # Where the compiled graph's call goes: its guards, AOT's wrapper, Inductor's
        # Python wrapper and its C++ loops (cProfile, which sees the wrapper's allocations by name).
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(200):
                layers["the compiled graph alone"]()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [layers["the compiled graph alone"]() for _ in range(500)])
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    if ops.decode_step in seen:
        # The call's own Python without the op: set against the first two lines, what the two cost
        # together beyond the sum of their parts.
        with unittest.mock.patch.object(ops, "call", lambda op, *args: seen[ops.decode_step][1]):
            print(f"  {'the call, the op outputs given':<36} {1e3 * alone_ms(step, repeats=repeats):6.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile-graph", action="store_true",
                        help="profile the first layer's compiled decode graph (torch.profiler, cProfile)")
    parser.add_argument("--eager-steps", action="store_true", help="run decode steps' kv4 ops eagerly (kvpass.cpu_steps off)")
    args = parser.parse_args()
    cpu_steps.enabled = not args.eager_steps
    timed_calls = ((graph_ops, "kv4_decode"), (cpu_steps, "decode_step"), (graph_ops, "kv4_append"),
                   (graph_ops, "kv4_sdpa"), (cpu_steps, "encode_refined"))  # fmt: skip
    for module, name in timed_calls:
        timed(module, name)
    model, tokenizer = load_model("smollm2", torch.float32)
    prompt = tokenizer(text_data.load("kjv"), return_tensors="pt").input_ids[:, : args.context]
    fp, _ = step_ms(model, prompt, args.steps)
    kv4, cache = step_ms(torch.compile(model, backend="kv4"), prompt, args.steps)
    steps = "eager" if args.eager_steps else "compiled"
    print(f"SmolLM2, {args.context}-token prompt, median of {args.steps} decode steps, {torch.get_num_threads()} threads, "
          f"decode steps' kv4 ops {steps}")  # fmt: skip
    print(f"eager fp step: {statistics.median(fp):.1f} ms; kv4 step: {statistics.median(kv4):.1f} ms")
    for _, name in timed_calls:
        if not calls[name]:  # a site fused into kv4_decode calls no kv4_append or kv4_sdpa
            continue
        per_step = 1e3 * spent[name] / args.steps
        print(f"  {name:<15} {per_step:6.1f} ms a step, {calls[name] // args.steps} calls, "
              f"{per_step * args.steps / calls[name]:.2f} ms each")  # fmt: skip
    print_calls_alone(model, cache)
    print_decode_layers(model, cache, profile=args.profile_graph)
    print_append_layers(cache)


if __name__ == "__main__":
    main()
