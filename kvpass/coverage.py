"""``kvpass coverage``: the support matrix over every causal-LM type in the installed transformers.

For each model type: shrink its default config to a tiny random-weight model, generate
eagerly, then run the same prompt through ``torch.compile(backend=kvpass.kv4())`` and
compare the first decode step with :class:`kvpass.simulate.SimulatedKVCache` (the eager
model reading the same quantized past). Each type runs in its own subprocess with a time
limit, so one model's crash or hang costs only its own row.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("kvpass")

# The sizes every tiny config gets, where the config has the attribute (attribute_map
# translates the standard names, e.g. n_layer for GPT-2).
TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
    "sliding_window": 32,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
PROMPT_TOKENS = 70


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    text = config.get_text_config(decoder=True)
    for name, value in TINY.items():
        if hasattr(text, name) and getattr(text, name) is not None:
            setattr(text, name, value)
    # Per-layer lists were sized for the real depth.
    for name in ("layer_types", "layers_block_type", "block_types"):
        value = getattr(text, name, None)
        if isinstance(value, list) and len(value) > TINY["num_hidden_layers"]:
            # keep one of each kind where the real model mixes kinds
            kinds = list(dict.fromkeys(value))
            setattr(text, name, (kinds * TINY["num_hidden_layers"])[: TINY["num_hidden_layers"]])
    text.eos_token_id = None
    text.pad_token_id = 0
    return config


def check_one(model_type: str) -> dict:
    """The row of one model type; runs in a subprocess (see :func:`run`)."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.cache_utils import DynamicLayer

    import kvpass
    from kvpass.packed import PackedKV
    from kvpass.simulate import SimulatedKVCache

    row = {"model_type": model_type}
    try:
        config = tiny_config(model_type)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    except Exception as err:  # noqa: BLE001 - any failure is this row's finding
        return {**row, "status": "no tiny model", "reason": _short(err)}
    vocab = min(model.config.get_text_config(decoder=True).vocab_size or 256, 256)
    ids = torch.randint(3, vocab, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    nxt = torch.randint(3, vocab, (1, 1), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False)
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    except Exception as err:  # noqa: BLE001
        return {**row, "status": "eager generation fails", "reason": _short(err)}
    if not any(isinstance(layer, DynamicLayer) for layer in cache.layers) or cache.get_seq_length() == 0:
        return {**row, "status": "no attention KV cache", "reason": "the cache holds no growing K/V tensors"}

    backend = kvpass.kv4()
    try:
        with torch.no_grad():
            step = torch.compile(model, backend=backend)
            cache = DynamicCache(config=model.config)
            step(input_ids=ids, past_key_values=cache, use_cache=True)
            got = step(input_ids=nxt, past_key_values=cache, use_cache=True).logits
            defaults = backend.config
            reference = SimulatedKVCache(model.config, defaults.k, defaults.v)
            model(input_ids=ids, past_key_values=reference, use_cache=True)
            expected = model(input_ids=nxt, past_key_values=reference, use_cache=True).logits
            model.compile(backend=kvpass.kv4())
            model.generate(ids, max_new_tokens=4, do_sample=False)
    except Exception as err:  # noqa: BLE001
        return {**row, "status": "kv4 fails", "reason": _short(err)}

    sites = [site for graph in backend.graphs for site in graph.sites]
    rewritten = sum(site.rewritten for site in sites)
    tensors = [t for layer in cache.layers if isinstance(layer, DynamicLayer) for t in (layer.keys, layer.values)]
    packed = [t for t in tensors if isinstance(t, PackedKV)]
    reasons = sorted({site.reason for site in sites if not site.rewritten})
    if not sites:
        status, reasons = "no site found", ["no SDPA or eager attention found in the graphs"]
    elif rewritten == len(sites) and len(packed) == len(tensors):
        status = "rewritten"
    elif rewritten:
        status = "partly rewritten"
    else:
        status = "left fp16"
    return {
        **row,
        "status": status,
        "sites": f"{rewritten}/{len(sites)}",
        "bytes_ratio": (
            round(sum(t.stored_bytes() for t in packed) / sum(t.numel() * 2 for t in packed), 3) if packed else None
        ),
        "logits_error": float((got - expected).abs().max()) if packed else None,
        "reason": "; ".join(reasons),
    }


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


def _run_isolated(model_type: str, timeout: float) -> dict:
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvpass.coverage", "--one", model_type],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"model_type": model_type, "status": "timed out", "reason": f"over {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return {"model_type": model_type, "status": "crashed", "reason": tail}
    row = json.loads(lines[-1])
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def summarize(rows: list[dict]) -> dict:
    with_cache = [r for r in rows if r["status"] in ("rewritten", "partly rewritten", "left fp16", "no site found", "kv4 fails")]
    rewritten = [r for r in with_cache if r["status"] == "rewritten"]
    return {
        "types": len(rows),
        "with_attention_cache_running_eagerly": len(with_cache),
        "fully_rewritten": len(rewritten),
        "fraction": round(len(rewritten) / len(with_cache), 3) if with_cache else None,
    }


def markdown(rows: list[dict], summary: dict, command: str) -> str:
    import torch
    import transformers

    lines = [
        "# Support matrix",
        "",
        f"Made by `{command}` with torch {torch.__version__} and transformers {transformers.__version__}.",
        "Each model type's default config shrunk to 2 layers (hidden 128, head_dim 32 where the",
        f"config has these), a {PROMPT_TOKENS}-token prompt, one decode step compared with the eager model",
        "reading the same quantized past (`logits error`, max abs); `bytes` is stored / fp16 bytes of",
        "the packed layers. Rows are this machine's findings, not claims about the real models.",
        "",
        f"**{summary['fully_rewritten']} of {summary['with_attention_cache_running_eagerly']}** types that have an "
        f"attention KV cache and run eagerly are fully rewritten ({summary['fraction']:.0%}); "
        f"{summary['types']} causal-LM types in all.",
        "",
        "| model type | status | sites | bytes | logits error | reason |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        err = f"{r['logits_error']:.1e}" if r.get("logits_error") is not None else ""
        ratio = f"{r['bytes_ratio']:.3f}" if r.get("bytes_ratio") is not None else ""
        reason = r.get("reason", "").replace("|", "\\|")
        lines.append(f"| {r['model_type']} | {r['status']} | {r.get('sites', '')} | {ratio} | {err} | {reason} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser) -> None:
    parser.add_argument("model_types", nargs="*", help="model types to check (default: every causal-LM type)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per model type")
    parser.add_argument("--jobs", type=int, default=2, help="model types checked at once")
    parser.add_argument("--output", default="docs/coverage.md", help="markdown file to write")
    parser.add_argument("--json", help="also write the rows as JSON here")


def run(args) -> int:
    from tqdm import tqdm

    types = args.model_types or causal_lm_types()
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(_run_isolated, t, args.timeout): t for t in types}
        rows = [f.result() for f in tqdm(concurrent.futures.as_completed(futures), total=len(types), desc="model types")]
    rows.sort(key=lambda r: r["model_type"])
    summary = summarize(rows)
    command = "kvpass " + " ".join(sys.argv[sys.argv.index("coverage"):]) if "coverage" in sys.argv else "kvpass coverage"
    text = markdown(rows, summary, command)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        logging.basicConfig(level=logging.ERROR)
        print(json.dumps(check_one(sys.argv[2])))
