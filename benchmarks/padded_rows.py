"""What a left-padded row of a batch costs under kv4, against the same sequence alone.

    python benchmarks/padded_rows.py --model smollm2 --text kjv --prompt 100 --windows 4

Batched generation pads the shorter prompts on the left, and K's prefix (its 16-bit sinks, offset
and query scales, taken from a cache's first tokens) then comes from pad tokens. Per window: a
sequence B, whose prompt of ``--prompt`` tokens is followed by ``--continuation`` tokens, runs alone
and as row 1 of a batch beside a 300-token prompt A (so padded by ``300 - prompt``), positions placed
as ``generate`` places them. B's continuation is fed ``--chunk`` tokens at a time with the cache
carried over, and scored (mean NLL, teacher-forced). Both prompts start with the tokenizer's BOS
where it has one (Gemma's), as ``kvpass eval``'s texts do. Prints the perplexity change of kv4
against the unquantized model in both settings, paired over 64-token blocks.
"""

from __future__ import annotations

import argparse
import math

import torch
from transformers import DynamicCache

import kvpass
from kvpass import arguments, text_data
from kvpass.cache_argument import cache_arg
from kvpass.eval import NLL_BLOCK, paired_delta_se, tokenize_text
from kvpass.models_zoo.real_model import load_model

BESIDE = 300  # the unpadded row's prompt
SPACING = 600  # tokens between windows (B spans at most 555); B's text lies 2,000 tokens after A's


@torch.no_grad()
def continuation_nll_blocks(model, backend, ids, prefix, prompt, continuation, chunk, windows, padded) -> list[float]:
    """Summed NLL of B's continuation over every ``NLL_BLOCK`` tokens, window after window; ``prefix``
    (the tokenizer's BOS, if any) starts both prompts, as in ``kvpass eval``."""
    torch._dynamo.reset()
    step = model if backend is None else torch.compile(model, backend=backend)
    blocks = []
    for start in range(0, SPACING * windows, SPACING):
        a = torch.cat([prefix, ids[start : start + BESIDE + continuation - len(prefix)]])
        b = torch.cat([prefix, ids[start + 2000 : start + 2000 + prompt + continuation - len(prefix)]])
        if padded:
            pad = BESIDE - prompt
            prompts = torch.stack([a[:BESIDE], torch.cat([torch.zeros(pad, dtype=b.dtype), b[:prompt]])])
            mask = torch.ones(2, BESIDE, dtype=torch.long)
            mask[1, :pad] = 0
            rest, row = torch.stack([a[BESIDE:], b[prompt:]]), 1
        else:
            prompts, mask, rest, row = b[None, :prompt], torch.ones(1, prompt, dtype=torch.long), b[None, prompt:], 0
        cache = DynamicCache(config=model.config)
        positions = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)  # as generate places pads
        out = step(input_ids=prompts, attention_mask=mask, position_ids=positions, **cache_arg(cache))
        token_nll = []
        for c in range(0, continuation, chunk):
            piece = rest[:, c : c + chunk]
            last = out.logits[:, -1:]
            mask = torch.cat([mask, torch.ones_like(piece)], 1)
            positions = (mask.cumsum(-1) - 1)[:, -piece.shape[1] :]
            out = step(input_ids=piece, attention_mask=mask, position_ids=positions, **cache_arg(cache))
            logits = torch.cat([last, out.logits[:, :-1]], 1)[row].double()
            token_nll.append(-torch.log_softmax(logits, -1).gather(-1, piece[row, :, None])[:, 0])
        token_nll = torch.cat(token_nll)
        blocks += [token_nll[i : i + NLL_BLOCK].sum().item() for i in range(0, continuation, NLL_BLOCK)]
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, a .gguf file or a save_pretrained directory")
    parser.add_argument("--text", default="kjv", help="kjv, code or a text file's path")
    parser.add_argument("--prompt", type=arguments.positive_int, default=100,
                        help=f"B's prompt tokens, under {BESIDE} (padded by {BESIDE} minus this)")
    parser.add_argument("--continuation", type=arguments.positive_int, default=256, help="scored tokens per window")
    parser.add_argument("--chunk", type=arguments.positive_int, default=16)
    parser.add_argument("--windows", type=arguments.positive_int, default=4)
    args = parser.parse_args()
    if args.prompt >= BESIDE or args.continuation % NLL_BLOCK:
        parser.error(f"--prompt must be under {BESIDE} and --continuation a multiple of {NLL_BLOCK}")
    torch.set_flush_denormal(True)  # as kvpass eval does: float32 subnormals are slow on x86
    model, tokenizer = load_model(args.model)
    ids = tokenize_text(tokenizer, text_data.load(args.text), 2000 + SPACING * args.windows + BESIDE + args.continuation)
    prefix = tokenizer("", return_tensors="pt").input_ids[0]  # BOS for Gemma; nothing for SmolLM2
    scored = args.continuation * args.windows
    print(f"{args.model}, {args.text}: B's {args.prompt}-token prompt, padded by {BESIDE - args.prompt} in the batch; "
          f"{scored} scored tokens over {args.windows} windows, fed {args.chunk} at a time")  # fmt: skip
    print("| B | fp perplexity | kv4 perplexity | change |\n|---|---|---|---|")
    blocks = {}
    for padded in (False, True):
        fp, kv4 = blocks[padded] = [continuation_nll_blocks(model, backend, ids, prefix, args.prompt, args.continuation,
                                                            args.chunk, args.windows, padded)
                                    for backend in (None, kvpass.kv4())]  # fmt: skip
        print(f"| {'padded, row 1 of 2' if padded else 'alone'} | {math.exp(sum(fp) / scored):.4f} | "
              f"{math.exp(sum(kv4) / scored):.4f} | {_change(kv4, fp, scored)} |", flush=True)  # fmt: skip
    print(f"kv4 padded against kv4 alone, same tokens: {_change(blocks[True][1], blocks[False][1], scored)}")


def _change(blocks: list[float], base_blocks: list[float], scored: int) -> str:
    change = 100 * (math.exp((sum(blocks) - sum(base_blocks)) / scored) - 1)
    return f"{change:+.2f}% ± {paired_delta_se(blocks, base_blocks, scored):.2f}"


if __name__ == "__main__":
    main()
