"""Benchmarks (``kvpass bench memory|decode``): shared model, caches and cache filling.

The benchmark model is a random-weight Llama whose memory is dominated by its KV cache:
2 layers, hidden 1024, 8 query heads and 8 KV heads of head_dim 128, a 512-token vocab,
so one token of cache is 8 KiB in fp16 (as in Llama-3-8B's per-layer layout) against
about 40 MB of weights.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

from kvpass import version
from kvpass.cache_argument import cache_arg, returned_cache

# name -> (model dtype, how the cache is held)
CACHES = {
    "fp16": (torch.float16, "dynamic"),
    "bf16": (torch.bfloat16, "dynamic"),
    "fp32": (torch.float32, "dynamic"),
    "kv4": (torch.float16, "kv4"),
    "kv4-bf16": (torch.bfloat16, "kv4"),
    "kv4-fp32": (torch.float32, "kv4"),
    "quanto": (torch.float16, "quanto"),
    "quanto-fp32": (torch.float32, "quanto"),
    "fp32-compiled": (torch.float32, "compiled"),
}


def bench_config(layers=2, hidden=1024, heads=8, kv_heads=8, head_dim=128, vocab=512, positions=32768):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=positions, eos_token_id=None, pad_token_id=0, bos_token_id=1,
    )  # fmt: skip


def build_model(dtype=torch.float16, seed=0, **sizes):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(bench_config(**sizes), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def fp16_bytes_per_token(config) -> int:
    """Bytes of K and V per token (all layers) in fp16."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2


def dynamic_cache(model):
    """An empty ``DynamicCache`` laid out by ``model``'s config, as ``generate`` makes one: without the
    config every layer is a full one (a sliding layer keeps every token) and a hybrid's recurrent layers
    are missing."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def stepper(model, how: str, kv4_settings: dict | None = None):
    """``(step, new_cache)`` for a cache kind of :data:`CACHES` (``kv4``: ``kvpass.kv4(**kv4_settings)``)."""
    new_cache = functools.partial(dynamic_cache, model)
    if how == "dynamic":
        return model, new_cache
    if how == "compiled":
        torch._dynamo.reset()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        return torch.compile(model, backend="eager", dynamic=None), new_cache
    if how == "kv4":
        import kvpass

        torch._dynamo.reset()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        return torch.compile(model, backend=kvpass.kv4(**(kv4_settings or {}))), new_cache
    if how == "quanto":
        from transformers import QuantizedCache

        return model, lambda: QuantizedCache(backend="quanto", config=model.config, nbits=4)
    raise ValueError(f"unknown cache kind {how!r}")


@torch.no_grad()
def fill(step, cache, batch: int, tokens: int, chunk: int = 256, seed: int = 0, vocab: int = 512, device="cpu"):
    """Feed ``tokens`` random tokens per row in chunks (small transients); returns the cache."""
    g = torch.Generator().manual_seed(seed)
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        ids = torch.randint(2, vocab, (batch, n), generator=g).to(device)
        out = step(input_ids=ids, **cache_arg(cache), use_cache=True, logits_to_keep=1)
        cache = returned_cache(out)
    return cache


@torch.no_grad()
def decode_step(step, cache, batch: int, token: int = 7, device="cpu"):
    ids = torch.full((batch, 1), token, dtype=torch.long, device=device)
    return returned_cache(step(input_ids=ids, **cache_arg(cache), use_cache=True, logits_to_keep=1))


def stored_bytes(cache) -> int:
    """Bytes the cache holds: kv4 codes + scales + residual, quanto's packed data + residual, fp tensors."""
    from kvpass.eval import cache_bytes

    return cache_bytes(cache)


def command_line(benchmark: str) -> str:
    """The command that reproduces this run, for the results it writes."""
    argv = sys.argv[1:]
    return f"kvpass bench {benchmark} " + " ".join(argv[argv.index(benchmark) + 1 :] if benchmark in argv else argv)


def write_results(args, info: dict, markdown_table: str) -> None:
    """``--json`` gets ``info`` and the machine; ``--markdown`` the command, the CPU and the table."""
    machine = version.machine()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        results = {"kvpass": version.describe(), "machine": machine, **info}
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if args.markdown:
        elapsed = f" ({info['elapsed_s']:.0f} s)" if "elapsed_s" in info else ""
        gpu = f", {machine['gpu']}" if "gpu" in machine else ""
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(f"Command: `{info['command']}`{elapsed}\n\nMachine: {machine['cpu']}{gpu}\n\n"
                                       f"{markdown_table}\n")
