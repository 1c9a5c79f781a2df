"""How many graphs twelve varied ``generate`` calls compile, kv4 against fp caches.

One process, models_zoo's ``llama_hd128`` (random weights), 40 new tokens a call: prompts of 5, 12,
40, 100 and 300 tokens; batches of 2 and 4; left-padded batches; beam search. Each new prompt class,
batch size or keyword passes a cache's parts through Dynamo's specialisations again, and Dynamo's
default limit of 8 graphs a function was once reached this way (``docs/design.md``). The decode
steps' kv4 ops run the eager reference (``cpu_steps`` off): their own compiled graphs are not the
model's.

    python benchmarks/varied_generates.py [--method kv4|fp] [--threads]

``--threads`` makes each call in a thread of its own, as a server's requests or transformers' streaming
recipe do: Dynamo's settings are per thread, and a limit raised in one thread once reached no other.
"""

from __future__ import annotations

import argparse
import threading

import torch

import kvpass
from kvpass import cpu_steps
from kvpass.cache_argument import returned_cache
from kvpass.models_zoo import build
from kvpass.packed import PackedKV

NEW_TOKENS = 40


def calls(vocab_size: int) -> list[dict]:
    """The twelve calls' ``generate`` arguments, the same tokens every run."""
    gen = torch.Generator().manual_seed(1)

    def ids(batch: int, tokens: int) -> torch.Tensor:
        return torch.randint(3, vocab_size, (batch, tokens), generator=gen)

    out = [dict(input_ids=ids(1, n)) for n in (5, 12, 40, 100, 300)]
    out += [dict(input_ids=ids(2, 40)), dict(input_ids=ids(4, 40)), dict(input_ids=ids(4, 100))]
    for batch, tokens, pads in ((2, 40, 10), (3, 100, 30)):  # every row but the first left-padded
        x, mask = ids(batch, tokens), torch.ones(batch, tokens, dtype=torch.long)
        x[1:, :pads], mask[1:, :pads] = 0, 0
        out.append(dict(input_ids=x, attention_mask=mask))
    out += [dict(input_ids=ids(1, 40), num_beams=2), dict(input_ids=ids(1, 100), num_beams=2)]
    return out


def counting_eager(graphs: list):
    """Dynamo's eager backend, appending each graph it is handed to ``graphs``."""

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=("kv4", "fp"), default="kv4")
    parser.add_argument("--threads", action="store_true", help="each call in a thread of its own")
    args = parser.parse_args()
    cpu_steps.enabled = False
    model = build("llama_hd128")
    graphs = []
    backend = kvpass.kv4() if args.method == "kv4" else counting_eager(graphs)
    model.compile(backend=backend)
    int4 = []

    def generate(kwargs):
        if args.method == "fp":
            # All of fp's graphs counted too: set in the calling thread, as Dynamo's settings are per thread.
            torch._dynamo.config.recompile_limit = kvpass.backend.RECOMPILE_LIMIT
        out = model.generate(**kwargs, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)  # fmt: skip
        int4.append(all(isinstance(layer.keys, PackedKV) for layer in returned_cache(out).layers))

    for kwargs in calls(model.config.vocab_size):
        if args.threads:
            thread = threading.Thread(target=generate, args=(kwargs,))
            thread.start()
            thread.join()
        else:
            generate(kwargs)
    compiled = len(backend.graphs) if args.method == "kv4" else len(graphs)
    where = ", each in a thread of its own," if args.threads else ""
    print(f"{args.method}: 12 generate calls{where} compiled {compiled} graphs; {sum(int4)} returned int4 caches")


if __name__ == "__main__":
    main()
