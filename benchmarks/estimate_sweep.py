"""``kvpass estimate`` against the bytes a kv4-compiled model stores, for every type ``kvpass coverage``
rewrites (``docs/coverage.json``), or those named.

Each type, shrunk as ``kvpass coverage`` shrinks it and cast to bf16 (fp32 where bf16 fails), is compiled
with kv4 and given a prompt (``--prompt`` tokens, 70 by default) at batch 2 in a subprocess of its own; a
row compares the cache's stored kv4 bytes and their fp16 size with :func:`kvpass.estimate.kv_cache_bytes`
for the same config, context and batch. A type this plain forward cannot drive is a row with the error.

    python benchmarks/estimate_sweep.py [TYPE ...] [--prompt 70] [--jobs 2] [--timeout 240]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
from pathlib import Path

from isolated import last_line  # benchmarks/, beside this script

BATCH = 2
# Transformers' Inkling2 does not run in bf16 (a float matmul meets a bf16 weight). The estimate costs a 16-bit
# model's unquantized tokens, and past 64 prompt tokens no K waits unquantized, so fp32 stores the same bytes.
FLOAT32_TYPES = {"inkling2_text", "inkling2_loop_text"}


def measure(model_type: str, prompt: int) -> dict:
    import torch
    from transformers import DynamicCache

    import kvpass
    from kvpass.cache_argument import cache_arg
    from kvpass.coverage import causal_lm, tiny_config
    from kvpass.estimate import kv_cache_bytes, unquantized_state_bytes
    from kvpass.packed import PackedKV

    config = tiny_config(model_type)
    dtype = torch.float32 if model_type in FLOAT32_TYPES else torch.bfloat16
    model = causal_lm(config).to(dtype).eval()
    step = torch.compile(model, backend=kvpass.kv4())
    vocab = min(config.get_text_config(decoder=True).vocab_size or 256, 256)
    ids = torch.randint(3, vocab, (BATCH, prompt), generator=torch.Generator().manual_seed(0))
    # The cache as passed: models that return it elsewhere (recurrent_gemma) or not at all (the BERT family
    # as decoders) still fill it.
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        step(input_ids=ids, **cache_arg(cache), use_cache=True)
    # A hybrid's recurrent layers hold no K/V; an attention layer's tensors are 4-D, K and V one tensor in
    # DeepSeek-V4's layers (counted once), beside its compressors' state and the sparse-attention indexers'
    # keys, which kvpass leaves as the model writes them.
    tensors = {id(t): t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if isinstance(t, torch.Tensor) and t.dim() == 4}.values()  # fmt: skip
    if not all(isinstance(t, PackedKV) for t in tensors):
        raise TypeError(f"the cache holds {sorted({type(t).__name__ for t in tensors})}, not only PackedKV")
    state = unquantized_state_bytes(cache)
    return {
        "stored": state + sum(t.stored_bytes() for t in tensors),
        "estimate": kv_cache_bytes(config, "kv4", prompt, BATCH),
        "fp16": state + sum(t.numel() * 2 for t in tensors),
        "fp16 estimate": kv_cache_bytes(config, "fp16", prompt, BATCH),
    }


def row(model_type: str, prompt: int, timeout: float) -> str:
    line, why = last_line([__file__, "--one", model_type, "--prompt", str(prompt)], timeout,
                          lambda line: line.startswith("{"))  # fmt: skip
    if line is None:
        return f"| {model_type} | {why} |"
    found = json.loads(line)
    if "error" in found:
        return f"| {model_type} | {found['error']} |"
    same = found["stored"] == found["estimate"] and found["fp16"] == found["fp16 estimate"]
    cells = [found[k] for k in ("stored", "estimate", "fp16", "fp16 estimate")]
    return f"| {model_type} | " + " | ".join(f"{c:,.0f}" for c in cells) + f" | {'yes' if same else 'no'} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every one docs/coverage.json rewrites)")
    parser.add_argument("--prompt", type=int, default=70, help="prompt tokens (the context estimated)")
    parser.add_argument("--jobs", type=int, default=2, help="subprocesses at once")
    parser.add_argument("--timeout", type=float, default=240, help="seconds a type")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a subprocess's type
    args = parser.parse_args()
    if args.one:
        try:
            print(json.dumps(measure(args.one, args.prompt)))
        except Exception as err:  # noqa: BLE001 - the row's finding
            print(json.dumps({"error": f"{type(err).__name__}: {str(err).splitlines()[0][:150] if str(err) else ''}"}))
        return
    matrix = json.loads((Path(__file__).parents[1] / "docs" / "coverage.json").read_text())
    types = args.types or [r["model_type"] for r in matrix["rows"] if r["status"] == "rewritten"]
    print("| model type | kv4 stored | kv4 estimate | fp16 | fp16 estimate | the same |\n|---|---|---|---|---|---|")
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(lambda t: row(t, args.prompt, args.timeout), types):
            print(line, flush=True)


if __name__ == "__main__":
    main()
