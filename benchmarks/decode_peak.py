"""Peak resident growth of a model's decode steps after a long fill: what a step allocates beyond the
cache it reads, for each method (``kvpass bench decode``'s methods), one process per method.

The resident set is read after handing freed memory back to the OS, with its high-water mark reset
there (as ``kvpass bench memory`` does), then ``--steps`` decode steps run and the mark is read again.
A model that rebuilds its whole K and V from a cached latent at each step (MLA on transformers' code,
``docs/bench-decode.md``) allocates them at each step.

    python benchmarks/decode_peak.py /tmp/mla_model --context 16384
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch


def peak_growth(model_path: str, method: str, ctx: int, steps: int) -> tuple[float, float]:
    """``(resident MiB before the steps, the steps' peak growth over it in MiB)`` in this process."""
    from kvpass import bench
    from kvpass.bench import decode, memory
    from kvpass.models_zoo.real_model import load_model

    model = load_model(model_path, torch.float32)[0]
    with torch.no_grad():
        run = decode.prepare(model, method, ctx, warmup=2)
        before = memory._resident_baseline_mib()
        if before is None:
            raise OSError("the resident set's high-water mark cannot be reset here (no /proc/self/clear_refs)")
        for _ in range(steps):
            run["cache"] = bench.decode_step(run["step"], run["cache"], 1)
    return before, memory._status_mib("VmHWM") - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="as kvpass bench decode --model takes it")
    parser.add_argument("--methods", default="fp,kv4,quanto")
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the method a worker process measures
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        before, growth = peak_growth(args.model, args.one, args.context, args.steps)
        print(f"{args.one:<8} {args.context:>7,} {before:>10,.0f} {growth:>12,.0f}")
        return
    print(f"{'method':<8} {'ctx':>7} {'before MiB':>10} {'growth MiB':>12}")
    for method in args.methods.split(","):
        worker = [sys.executable, __file__, args.model, "--one", method, "--context", str(args.context),
                  "--steps", str(args.steps), "--threads", str(args.threads)]  # fmt: skip
        out = subprocess.run(worker, capture_output=True, text=True)
        print(out.stdout.strip() or f"{method:<8} failed: {out.stderr.strip().splitlines()[-1]}", flush=True)


if __name__ == "__main__":
    main()
