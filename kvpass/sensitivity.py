"""``kvpass sensitivity``: what int4 keys cost in each layer, one layer at a time.

For each attention layer, the streaming perplexity of ``kvpass eval`` with only that layer's K
stored as kv4 stores it (the simulation of :mod:`kvpass.simulate`; every other layer, and every
V, exact), against the unquantized run. Int4 keys cost a model little in most layers and most
of its loss in a few (Gemma 3 270M: 5 of 18 layers, ``docs/eval.md``); those few are the ones
worth storing in int8, through ``kvpass.kv4(k_layer_bits={layer: 8, ...})``. (A model whose cache
holds an MLA latent stores it with V's settings, so per-layer K bits do not apply to it.)
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from kvpass import arguments, version
from kvpass.config import QuantSpec
from kvpass.tables import render_table


class _Run:
    """What :func:`kvpass.eval.streaming_nll` runs: the model, over caches from ``new_cache``."""

    def __init__(self, model, new_cache):
        from kvpass.simulate import observing_queries

        self.step, self.new_cache = observing_queries(model), new_cache

    def check(self, cache) -> None:
        pass  # simulated caches hold fp tensors: nothing to check


def attention_layers(config) -> list[int]:
    """Indices of the cache layers that hold attention K/V (not recurrent state)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return [i for i, layer in enumerate(DynamicCache(config=config).layers) if isinstance(layer, DynamicLayer)]


@torch.no_grad()
def layer_costs(model, ids: torch.Tensor, chunk: int, k_spec: QuantSpec, progress: bool = False) -> list[dict]:
    """Per attention layer: perplexity of ``ids [1, N]`` with only that layer's K stored as
    ``k_spec``, and its change over the unquantized run in percent."""
    from transformers import DynamicCache

    from kvpass.eval import progress_bar, streaming_nll
    from kvpass.simulate import SimulatedKVCache

    def perplexity(new_cache):
        nll, count, _ = streaming_nll(_Run(model, new_cache), ids, chunk)
        return math.exp(nll / count)

    config = model.config
    fp = perplexity(lambda: DynamicCache(config=config))
    types = getattr(config, "layer_types", None)
    layers = attention_layers(config)
    rows = []
    bar = progress_bar(len(layers), "layers", progress)
    for layer in layers:
        ppl = perplexity(lambda: SimulatedKVCache(config, k_spec, None, layers={layer}))
        rows.append(dict(layer=layer, type=types[layer] if types else "attention", ppl=ppl, fp_ppl=fp,
                         delta_pct=100 * (ppl / fp - 1)))  # fmt: skip
        bar.update(1)
    bar.close()
    return rows


def costly_layers(rows: list[dict], threshold_pct: float) -> list[int]:
    return [r["layer"] for r in rows if r["delta_pct"] > threshold_pct]


def format_table(rows: list[dict], markdown: bool = False) -> str:
    body = [[str(r["layer"]), r["type"], f"{r['ppl']:.4f}", f"{r['delta_pct']:+.2f}%"] for r in rows]
    return render_table(["layer", "type", "ppl, this layer's K quantized", "delta vs fp"], body, markdown)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help=f"{arguments.REAL_MODELS} (default: smollm2)")
    parser.add_argument("--text", default="kjv", help="kjv (default), code, or a text file's path")
    parser.add_argument("--context", type=arguments.tokens, default=1024, help="tokens of the text (default 1024)")
    parser.add_argument("--chunk", type=arguments.positive_int, default=64, help="tokens fed per step (default 64)")
    parser.add_argument("--threshold", type=arguments.nonnegative_float, default=0.25,
                        help="suggest int8 keys for layers costing more than this many percent (default 0.25)")
    parser.add_argument("--threads", type=arguments.positive_int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    arguments.add_kv4_settings(parser, "K's spec (K's settings only: not V's, nor k_layer_bits, which this chooses)",
                               taken=_not_k_settings())  # fmt: skip


def _not_k_settings() -> tuple[str, ...]:
    from kvpass.backend import SETTINGS

    return tuple(name for name in SETTINGS if name.startswith("v_")) + ("k_layer_bits", "inner", "debug", "debug_dir")


def run(args) -> int:
    from kvpass import text_data
    from kvpass.backend import check_settings, kv4
    from kvpass.eval import tokenize_text
    from kvpass.models_zoo.real_model import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as kvpass eval does: float32 subnormals are slow on x86
    if args.chunk >= args.context:
        raise ValueError(f"--chunk must be under --context {args.context}, got {args.chunk}")
    settings = dict(args.kv4_settings)
    check_settings(settings, "kvpass sensitivity", taken=_not_k_settings())
    start = time.perf_counter()
    text = text_data.load(args.text)
    model, tokenizer = load_model(args.model, dtype=torch.float32)
    prefix = tokenizer("", return_tensors="pt").input_ids[0]  # BOS where the tokenizer has one
    ids = torch.cat([prefix, tokenize_text(tokenizer, text, args.context)])[: args.context][None]
    k_spec = kv4(**settings).config.k
    rows = layer_costs(model, ids, args.chunk, k_spec, progress=not args.no_progress)
    layers = costly_layers(rows, args.threshold)
    print(format_table(rows))
    print(f"\nfp perplexity {rows[0]['fp_ppl']:.4f}; K stored as {k_spec.tag} in one layer at a time, "
          f"{args.text} text, {ids.shape[1]} tokens in chunks of {args.chunk}; {time.perf_counter() - start:.0f} s")
    if layers:
        call = arguments.kv4_settings_text([*settings.items(), ("k_layer_bits", dict.fromkeys(layers, 8))])
        eval_settings = "".join(f" --kv4-setting {shlex.quote(arguments.kv4_settings_text([item]))}"
                                for item in settings.items())  # fmt: skip
        print(f"layers over +{args.threshold}%: {layers}; try kvpass.kv4({call}), and measure it with all layers "
              f"together: kvpass eval --model {args.model} --methods fp,kv4,kv4-k8@{'.'.join(map(str, layers))}"
              f"{eval_settings}")  # fmt: skip
    else:
        print(f"no layer costs more than +{args.threshold}%")
    if args.json:
        command = "kvpass " + " ".join(sys.argv[sys.argv.index("sensitivity") :] if "sensitivity" in sys.argv else [])
        info = dict(command=command, model=args.model, text=args.text, tokens=ids.shape[1], chunk=args.chunk,
                    k_spec=k_spec.tag, threshold_pct=args.threshold, costly_layers=layers, machine=version.machine(),
                    elapsed_s=round(time.perf_counter() - start, 1), rows=rows)  # fmt: skip
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(info, indent=1) + "\n")
    return 0
