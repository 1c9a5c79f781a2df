"""A decode step's kv4 attention with an attention sink on CPU: fused (``kvpass.cpu_steps``) against the
reference, and the same step without the sink.

GPT-OSS's attention sinks reach kv4 as one more new token, key and value zero, whose mask column holds
the sink's logit (``kvpass/passes.py``). ``packed.attention`` is timed on one layer shaped as GPT-OSS's
(8 KV heads x 64, 64 query heads by default) over a cache the default stores as decode would
(``kvpass.bench.attention.case_inputs``): warm, the median of ``--iters`` calls, the methods taking
turns ``--rounds`` times so that drift on a shared machine lands on each alike.

    python benchmarks/sink_attention.py [--context 1024 4096] [--iters 200] [--rounds 2]
"""

from __future__ import annotations

import argparse

import torch
from decode_breakdown import alone_ms  # benchmarks/, beside this script

from kvpass import arguments, cpu_steps, packed
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


if __name__ == "__main__":
    main()
