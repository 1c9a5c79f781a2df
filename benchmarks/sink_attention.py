"""A decode step's kv4 attention with an attention sink on CPU: fused (``kvpass.cpu_steps``) against the
reference, and the same step without the sink; then whole steps, attention and both appends, as one call
and as three.

GPT-OSS's attention sinks reach kv4 as one more new token, key and value zero, whose mask column holds
the sink's logit (``kvpass/passes.py``). ``packed.attention`` is timed on one layer shaped as GPT-OSS's
(8 KV heads x 64, 64 query heads by default) over a cache the default stores as decode would
(``kvpass.bench.attention.case_inputs``): warm, the median of ``--iters`` calls, the methods taking
turns ``--rounds`` times so that drift on a shared machine lands on each alike. A step's forms are timed
over ``--iters`` steps from the context, each appending to the cache the last one returned: one
``packed.attend_and_append`` taking the sink (one ``kv4::decode_step``), against the attention over the
sink's zero token and the two appends apart (the form until the fifty-fourth run).

    python benchmarks/sink_attention.py [--context 1024 4096] [--iters 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from decode_breakdown import alone_ms  # benchmarks/, beside this script

from kvpass import arguments, cpu_steps, packed, reference
from kvpass.bench.attention import case_inputs


def _calls(context: int, args) -> dict:
    """``method -> call`` of one decode step's attention at ``context``."""
    inputs = case_inputs(1, context, args, device="cpu")
    q, keys, values, k_new, v_new, scale = (inputs[n] for n in ("q", "keys", "values", "k_new", "v_new", "scale"))
    k_sunk, v_sunk = (torch.cat([t, torch.zeros_like(t)], 2) for t in (k_new, v_new))
    sink_logits = torch.randn(1, args.q_heads, 1, 1, dtype=q.dtype)
    mask = torch.cat([torch.zeros(1, args.q_heads, 1, keys.shape[2] + 1, dtype=q.dtype), sink_logits], -1)

    def with_sink():
        return packed.attention(q, keys, values, k_sunk, v_sunk, mask, scale)

    def reference_with_sink():
        with cpu_steps.reference_attention():
            return with_sink()

    fused, reference = with_sink(), reference_with_sink()
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=2**-10)  # fp16: test_cpu_steps.TOLERANCE
    return {"fused, sink": with_sink, "reference, sink": reference_with_sink,
            "fused, no sink": lambda: packed.attention(q, keys, values, k_new, v_new, None, scale)}  # fmt: skip


def _step_forms(context: int, args) -> dict:
    """``form -> run(steps)``: ``steps`` decode steps from ``context`` with a sink; each run returns the
    median ms a step (each step's mask is made before its clock starts)."""
    inputs = case_inputs(1, context, args, device="cpu")
    q, keys, values, k_new, v_new, scale = (inputs[n] for n in ("q", "keys", "values", "k_new", "v_new", "scale"))
    sink = torch.randn(1, args.q_heads, 1, 1, dtype=q.dtype)

    def one_call(k, v, mask):
        out, k, v = packed.attend_and_append(q, k, v, k_new, v_new, mask, scale, query=q, sink=sink)
        return k, v

    def three_calls(k, v, mask):
        packed.attention(q, k, v, *reference.with_sink(k_new, v_new, mask, sink), scale)
        return k.append(k_new, query=q), v.append(v_new)

    def timed(form):
        def run(steps):
            k, v, times = keys, values, []
            for _ in range(steps):
                mask = torch.zeros(1, 1, 1, k.shape[2] + 1, dtype=q.dtype)
                start = time.perf_counter()
                k, v = form(k, v, mask)
                times.append(1e3 * (time.perf_counter() - start))
            return statistics.median(times)

        return run

    return {"one call, sink": timed(one_call), "three calls, sink": timed(three_calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=arguments.tokens, nargs="+", default=[1024, 4096])
    parser.add_argument("--q-heads", type=arguments.positive_int, default=64)
    parser.add_argument("--kv-heads", type=arguments.positive_int, default=8)
    parser.add_argument("--head-dim", type=arguments.positive_int, default=64)
    parser.add_argument("--iters", type=arguments.positive_int, default=200)
    parser.add_argument("--rounds", type=arguments.positive_int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    print("| context | method | ms a call, each round |\n|---|---|---|")
    for context in args.context:
        calls = _calls(context, args)
        for call in calls.values():  # a structure's first call runs eagerly, its second compiles
            call(), call()
        times = {method: [] for method in calls}
        for _ in range(args.rounds):
            for method, call in calls.items():
                times[method].append(alone_ms(call, repeats=args.iters))
        for method, ms in times.items():
            print(f"| {context} | {method} | {' / '.join(f'{t:.2f}' for t in ms)} |", flush=True)
    print("\n| context | a step's form | ms a step, each round |\n|---|---|---|")
    for context in args.context:
        forms = _step_forms(context, args)
        for run in forms.values():
            run(3)  # compiles each form's graphs
        times = {form: [] for form in forms}
        for _ in range(args.rounds):
            for form, run in forms.items():
                times[form].append(run(args.iters))
        for form, ms in times.items():
            print(f"| {context} | {form} | {' / '.join(f'{t:.3f}' for t in ms)} |", flush=True)


if __name__ == "__main__":
    main()
