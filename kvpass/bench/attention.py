"""Decode attention time: fp16 SDPA vs the fused kv4 kernel vs dequantize-then-SDPA, over a cache
stored as the default stores it (:func:`case_inputs`: fp sinks, offset, query scales, second plane).

Decode is memory-bound, so each row also reports achieved bytes/s and the fraction of the
memory roofline: the bytes the method's cache format forces it to read, over the
device-to-device copy bandwidth measured in the same run. Both kv4 methods read the same
int4 cache, so they share a roofline; dequantize-then-SDPA (what HF's QuantizedCache does)
shows how far from it a non-fused path lands.

    kvpass bench attention [--batch 1 8] [--context 4096 16384 32768 65536] [--output results.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from kvpass import arguments, version
from kvpass.config import PREFIX_MIN_TOKENS, KVConfig

# Larger than any L2 (H200: 50 MiB), rewritten before every timed call so no method is
# timed reading a cache that the previous iteration left in L2.
L2_FLUSH_BYTES = 256 << 20


def add_arguments(parser):
    parser.add_argument("--batch", type=arguments.positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=arguments.tokens, nargs="+", default=[4096, 16384, 32768, 65536])
    parser.add_argument("--q-heads", type=arguments.positive_int, default=32)
    parser.add_argument("--kv-heads", type=arguments.positive_int, default=8)
    parser.add_argument("--head-dim", type=arguments.positive_int, default=128)
    parser.add_argument("--warmup", type=arguments.nonnegative_int, default=5)
    parser.add_argument("--iters", type=arguments.positive_int, default=30)
    parser.add_argument("--output", help="also write the results here: .json for records, anything else as markdown")


def _time_ms(fn, warmup, iters, flush):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def copy_bandwidth(flush, warmup, iters) -> float:
    """Device-to-device copy bandwidth in bytes/s (a copy reads and writes each byte)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), warmup, iters, flush)
    return 2 * src.numel() / (ms * 1e-3)


def _nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def case_inputs(batch: int, context: int, args, device: str = "cuda") -> dict:
    """One decode step's inputs at ``context``: the query and the new token, and the past both as the
    default stores it (``PackedKV``: a 64-token prompt with its queries fixes K's sinks, offset and
    query scales, the rest is appended as decode appends it, with the second code plane on the newest
    tokens) and as fp16 tensors."""
    from kvpass.packed import PackedKV

    config = KVConfig()
    B, Hq, Hkv, D = batch, args.q_heads, args.kv_heads, args.head_dim
    past, prompt = context - 1, min(PREFIX_MIN_TOKENS, context - 1)

    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float16, device=device)

    k_past, v_past = randn(B, Hkv, past, D), randn(B, Hkv, past, D)
    keys = PackedKV.from_float(k_past[:, :, :prompt], config.k, randn(B, Hq, prompt, D)).append(k_past[:, :, prompt:])
    values = PackedKV.from_float(v_past[:, :, :prompt], config.v).append(v_past[:, :, prompt:])
    k_new, v_new = randn(B, Hkv, 1, D), randn(B, Hkv, 1, D)
    return dict(q=randn(B, Hq, 1, D), keys=keys, values=values, k_new=k_new, v_new=v_new,
                k_full=torch.cat([k_past, k_new], dim=2), v_full=torch.cat([v_past, v_new], dim=2),
                scale=D**-0.5)  # fmt: skip


def methods(inputs: dict) -> dict:
    """``name -> (call, bytes it must read)``: fp16 SDPA over the fp16 cache, kv4's fused attention over
    the packed one, and dequantize-then-SDPA over the same packed one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kvpass import packed

    q, keys, values, k_new, v_new, scale = (inputs[n] for n in ("q", "keys", "values", "k_new", "v_new", "scale"))

    def sdpa(k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    def dequant_then_sdpa():
        return sdpa(torch.cat([keys.dequantize(), k_new], dim=2), torch.cat([values.dequantize(), v_new], dim=2))

    small = _nbytes(q, k_new, v_new) + _nbytes(q)  # the query, the new token, the output
    kv4_bytes = keys.stored_bytes() + values.stored_bytes() + small
    return {
        "sdpa fp16 (flash)": (lambda: sdpa(inputs["k_full"], inputs["v_full"]),
                              _nbytes(inputs["k_full"], inputs["v_full"]) + 2 * _nbytes(q)),
        "kv4 fused": (lambda: packed.attention(q, keys, values, k_new, v_new, None, scale), kv4_bytes),
        "kv4 dequant+sdpa": (dequant_then_sdpa, kv4_bytes),
    }  # fmt: skip


def bench_case(batch, context, args, bandwidth, flush):
    timed = methods(case_inputs(batch, context, args))
    # Autotuning picks among configs by speed alone; check the winner still computes the
    # same attention as the unfused path before timing it.
    torch.testing.assert_close(timed["kv4 fused"][0](), timed["kv4 dequant+sdpa"][0](), atol=6e-3, rtol=6e-3)
    rows = []
    for method, (fn, must_read) in timed.items():
        ms = _time_ms(fn, args.warmup, args.iters, flush)
        achieved = must_read / (ms * 1e-3)
        rows.append(
            dict(
                method=method, batch=batch, context=context, ms=ms, bytes=must_read,
                gbytes_per_s=achieved / 1e9, roofline_fraction=achieved / bandwidth,
            )
        )
    return rows


def _markdown(rows, bandwidth, device_name):
    lines = [
        f"decode attention on {device_name}; copy bandwidth {bandwidth / 1e9:.0f} GB/s",
        "",
        "| method | batch | context | ms | MB read | GB/s | roofline |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['batch']} | {r['context']} | {r['ms']:.3f} | {r['bytes'] / 1e6:.1f} "
            f"| {r['gbytes_per_s']:.0f} | {r['roofline_fraction']:.2f} |"
        )
    return "\n".join(lines)


def run(args) -> int:
    if not torch.cuda.is_available():
        print("kvpass bench attention: no CUDA device; this benchmark times GPU kernels and has nothing to measure on CPU", file=sys.stderr)
        return 1
    if args.q_heads % args.kv_heads:
        print(f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads ({args.kv_heads})", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    bandwidth = copy_bandwidth(flush, args.warmup, args.iters)
    rows = []
    for batch in args.batch:
        for context in args.context:
            case_rows = bench_case(batch, context, args, bandwidth, flush)
            # Each case as it finishes: a run cut short by a time limit still leaves its numbers.
            for r in case_rows:
                print(f"{r['method']}, batch {batch}, context {context}: {r['ms']:.3f} ms", file=sys.stderr, flush=True)
            rows.extend(case_rows)
            torch.cuda.empty_cache()
    table = _markdown(rows, bandwidth, torch.cuda.get_device_name())
    print(table)
    if args.output:
        with open(args.output, "w") as f:
            if args.output.endswith(".json"):
                json.dump(dict(kvpass=version.describe(), machine=version.machine(),
                               device=torch.cuda.get_device_name(), copy_bytes_per_s=bandwidth, rows=rows),
                          f, indent=2)  # fmt: skip
            else:
                f.write(table + "\n")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
