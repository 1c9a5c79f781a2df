"""How many graphs twelve varied ``generate`` calls compile, kv4 against fp caches.

One process, models_zoo's ``llama_hd128`` (random weights), 40 new tokens a call: prompts of 5, 12,
40, 100 and 300 tokens; batches of 2 and 4; left-padded batches; beam search. Each new prompt class,
batch size or keyword passes a cache's parts through Dynamo's specialisations again, and Dynamo's
default limit of 8 graphs a function was once reached this way (``docs/design.md``). The decode
steps' kv4 ops run the eager reference (``cpu_steps`` off): their own compiled graphs are not the
model's.

    python benchmarks/varied_generates.py [--method kv4|fp]
"""

from __future__ import annotations

import argparse

import torch

import kvpass
from kvpass import cpu_steps
from kvpass.models_zoo import build

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
    args = parser.parse_args()
    cpu_steps.enabled = False
    torch._dynamo.config.recompile_limit = kvpass.backend.RECOMPILE_LIMIT  # the fp run counts all of them too
    model = build("llama_hd128")
    graphs = []
    backend = kvpass.kv4() if args.method == "kv4" else counting_eager(graphs)
    model.compile(backend=backend)
    for kwargs in calls(model.config.vocab_size):
        model.generate(**kwargs, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    compiled = len(backend.graphs) if args.method == "kv4" else len(graphs)
    print(f"{args.method}: 12 generate calls compiled {compiled} graphs")


if __name__ == "__main__":
    main()
