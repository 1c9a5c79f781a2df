"""A chat's turns: seconds each, and the graphs Dynamo compiles in each, kv4 against fp caches.

SmolLM2 with its chat template, each turn continuing the cache the last one returned (25 greedy
tokens a turn, 2 threads). A turn's prompt over a cache is a prefill graph of its own, and each of K's
states (waiting for its prefix, reaching it, quantized) is another, so the first turns are mostly
compiling: what a user waits for before a chat settles (docs/design.md, "Fake fallbacks in a chat's
prefill"). The graphs counted are the model's and, for kv4, its compiled CPU decode steps'.

    python benchmarks/chat_turns.py [--cache kv4|fp] [--turns 5] [--new-tokens 25] [--compile-times]

``--compile-times`` prints Dynamo's timings of every compile at the end (one column a graph, in order):
``get_fake_value`` is the trace's fake values, where kv4's appends and fallbacks run on fake tensors.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvpass.cache_argument import cache_arg, returned_cache
from kvpass.models_zoo.real_model import load_model

QUESTIONS = ("Tell me about the city of Paris.", "What else should a visitor see?", "And in winter?",
             "How do I get there by train?", "Thank you. Anything to avoid?")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", choices=("kv4", "fp"), default="kv4", help="kv4, or fp caches (backend eager)")
    parser.add_argument("--turns", type=int, default=5, choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--new-tokens", type=int, default=25)
    parser.add_argument("--compile-times", action="store_true", help="print Dynamo's compile timings at the end")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load_model("smollm2")
    model.compile(backend="kv4" if args.cache == "kv4" else "eager")
    messages, cache = [], None
    for turn, question in enumerate(QUESTIONS[: args.turns]):
        messages.append({"role": "user", "content": question})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]  # fmt: skip
        graphs = _graphs_compiled()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, **cache_arg(cache), max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False, return_dict_in_generate=True)  # fmt: skip
        seconds = time.perf_counter() - start
        cache = returned_cache(out)
        answer = tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        print(f"turn {turn}: {seconds:5.1f} s, {_graphs_compiled() - graphs} graphs, prompt {ids.shape[1]} tokens, "
              f"cache {cache.get_seq_length()}: {answer[:40]!r}", flush=True)  # fmt: skip
    if args.compile_times:
        print(torch._dynamo.utils.compile_times())


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


if __name__ == "__main__":
    main()
