"""Study: scale K's channels by what the queries read before quantizing it (simulation only).

A query reads a key through ``q . k``, so K's quantization error costs ``q . e``. After the
Hadamard rotation the error is spread evenly over channels, and ``q . e`` grows with the energy of
the queries wherever the keys' energy sits. Storing ``k * s`` and reading it with ``q / s`` leaves
every logit unchanged in exact arithmetic; with ``s_c = (E[q_c^2] / Var[k_c]) ** (1 / 4)`` (the
Cauchy-Schwarz optimum for evenly spread error) the error lands where the queries look least.
Gemma 3 270M's layers 5 and 11 have keys and queries whose energies sit in different channels
(up to 26x less error in their logits, by that estimate).

``s`` comes from the first chunk of the text, as a cache would take it from its first append: per
KV head, queries averaged over the heads that share it, keys after the first ``CENTER_SKIP`` tokens
(sinks). Channels ``c`` and ``c + D/2`` share one scale, so it commutes with rotate-half RoPE and
is applied where the model computes its queries and keys (``q_norm``/``k_norm`` if it has them, else
``q_proj``/``k_proj``), through forward hooks: no kv4 path has it yet. Prints streaming perplexity
(the ``kvpass eval`` protocol) for the unquantized cache, the default scheme through
:class:`kvpass.simulate.SimulatedKVCache`, and the same with scaled keys.

    python benchmarks/query_scaled_keys.py --model smollm2 --text kjv --context 2048 --json docs/x.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from kvpass import text_data
from kvpass.config import CENTER_SKIP
from kvpass.eval import Runner, parse_method, streaming_nll, tokenize_text
from kvpass.models_zoo.real_model import load_model

# Scales are kept within this factor of their geometric mean: a channel no key of the first chunk
# used would otherwise get an unbounded one.
MAX_SCALE = 64.0


def query_key_scales(q: torch.Tensor, k: torch.Tensor, power: float = 0.25) -> torch.Tensor:
    """``s [Hkv, D]`` from one forward's queries ``q [Hq, S, D]`` and keys ``k [Hkv, S, D]``."""
    kv_heads, _, head_dim = k.shape
    q_energy = q.float().pow(2).mean(1).view(kv_heads, -1, head_dim).mean(1)
    k_energy = k[:, CENTER_SKIP:].float().var(1)
    half = head_dim // 2
    q_energy, k_energy = (e[:, :half] + e[:, half:] for e in (q_energy, k_energy))  # RoPE pairs share one
    q_energy, k_energy = (e.clamp_min(1e-6 * e.amax(-1, keepdim=True)) for e in (q_energy, k_energy))
    s = (q_energy / k_energy) ** power
    s = s / s.log().mean(-1, keepdim=True).exp()
    return s.clamp(1 / MAX_SCALE, MAX_SCALE).repeat(1, 2)


class ScaledKeys:
    """Forward hooks on every attention's query and key projections: record them (``record``), or
    multiply K by ``s`` and Q by ``1 / s`` (``scales``, one ``[Hkv, D]`` per layer)."""

    def __init__(self, model):
        config = model.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.q_heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.recorded: dict[tuple[str, int], torch.Tensor] = {}
        self.record, self.scales = False, {}
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            normed = hasattr(attn, "q_norm")  # outputs [B, H, S, D]; projections give [B, S, H * D]
            for kind, module in (("q", attn.q_norm if normed else attn.q_proj), ("k", attn.k_norm if normed else attn.k_proj)):
                module.register_forward_hook(self._hook(kind, i, normed))

    def _hook(self, kind, layer, normed):
        heads = self.q_heads if kind == "q" else self.kv_heads

        def hook(module, args, out):
            x = out if normed else out.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)
            if self.record:
                self.recorded[kind, layer] = x[0].detach()
                return None
            s = self.scales.get(layer)
            if s is None:
                return None
            s = s.repeat_interleave(heads // self.kv_heads, 0) if kind == "q" else s
            x = x / s[:, None] if kind == "q" else x * s[:, None]
            return x if normed else x.transpose(1, 2).flatten(-2)

        return hook

    @torch.no_grad()
    def calibrate(self, model, ids: torch.Tensor) -> None:
        self.scales, self.record = {}, True
        model(ids)
        self.record = False
        layers = len(model.model.layers)
        self.scales = {i: query_key_scales(self.recorded["q", i], self.recorded["k", i]) for i in range(layers)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), a .gguf file or a saved model directory")
    parser.add_argument("--text", default="kjv", help="kjv or code")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as kvpass eval: SmolLM2's float32 subnormals are slow on x86
    start = time.perf_counter()
    model, tokenizer = load_model(args.model)
    prefix = tokenizer("", return_tensors="pt").input_ids[0]  # BOS for Gemma, as kvpass eval feeds it
    ids = torch.cat([prefix, tokenize_text(tokenizer, text_data.load(args.text), args.context)])[: args.context][None]
    hooks = ScaledKeys(model)
    rows = []
    for name, method in (("fp", "fp"), ("default", "sim-kv4"), ("default, scaled K", "sim-kv4")):
        hooks.scales = {}
        if name.endswith("scaled K"):
            hooks.calibrate(model, ids[:, : args.chunk])
        with torch.no_grad():
            nll, scored, _ = streaming_nll(Runner(model, parse_method(method)), ids, args.chunk)
        rows.append(dict(method=name, ppl=math.exp(nll / scored), scored=scored))
        delta = 100 * (rows[-1]["ppl"] / rows[0]["ppl"] - 1)
        print(f"{name:<18} {args.text:<5} ctx {args.context}: ppl {rows[-1]['ppl']:.4f} ({delta:+.2f}%)", flush=True)
    if args.json:
        command = "python benchmarks/query_scaled_keys.py " + " ".join(sys.argv[1:] if argv is None else argv)
        result = dict(command=command, model=args.model, text=args.text, context=args.context, chunk=args.chunk,
                      elapsed_s=round(time.perf_counter() - start, 1), rows=rows)  # fmt: skip
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
