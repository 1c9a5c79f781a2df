"""How many graphs kv4 compiles for a real model's ``generate``, and how long it takes.

A decode loop should settle on a few graphs; a length the graphs specialise on shows up here as
one graph per generated token (a sliding-window model did so before the twenty-first run).

    python benchmarks/generate_graphs.py --model PATH.gguf --prompt-tokens 100 --new-tokens 40
"""

from __future__ import annotations

import argparse
import time

import torch

import kvpass
from kvpass import text_data
from kvpass.models_zoo.real_model import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, a .gguf file, or a save_pretrained directory")
    parser.add_argument("--prompt-tokens", type=int, default=100, help="prompt: the start of the KJV text")
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    ids = tokenizer(text_data.kjv()[: 20 * args.prompt_tokens], return_tensors="pt").input_ids[:, : args.prompt_tokens]
    backend = kvpass.kv4()
    model.compile(backend=backend)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    window = getattr(model.config, "sliding_window", None)
    print(f"{args.model} ({model.config.model_type}, sliding window {window}): {ids.shape[1]} prompt tokens, "
          f"{out.shape[1] - ids.shape[1]} generated in {seconds:.1f} s with compiling, "
          f"{len(backend.graphs)} graphs compiled, {args.threads} thread(s)")  # fmt: skip
    # Every frame Dynamo compiled: the model's graphs, then the decode steps' own (kvpass.cpu_steps).
    frames = torch._dynamo.utils.compilation_time_metrics.get("_compile.compile_inner", [])
    print(f"Dynamo compiles, in order (s): {' '.join(f'{t:.1f}' for t in frames)}; {sum(frames):.1f} s in all")
    # For comparing two trees' runs: a change to compiling should leave these as they were.
    print(f"generated ids: {out[0, ids.shape[1]:].tolist()}")


if __name__ == "__main__":
    main()
