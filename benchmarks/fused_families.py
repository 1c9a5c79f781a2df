"""Every models_zoo family, or every type ``kvpass coverage`` rewrites, through kv4's fused CPU decode
attention, against the reference's.

The test suite checks the fused, Inductor-compiled attention a CPU user's decode steps take op by op
and on one llama (``tests/test_cpu_steps.py``), and ``kvpass coverage`` checks one decode step with
the reference attention: neither runs each architecture's decode steps through it. Here each model,
compiled with kv4, greedily generates ``--tokens`` tokens after a 90-token prompt twice: as it runs
by default, and with :func:`kvpass.cpu_steps.reference_attention`. The quantization is the same bit
for bit given the same inputs, so the two differ by the attention's order of sums, and a step's
difference moves later tokens' inputs too, which can flip one of their codes (a 4-bit cache is
discontinuous; the logits then differ by a quantization step's effect). Prints whether the tokens
agree, the largest logit difference of the first decode step (where only that step's order of sums
has moved anything; 0 where each layer's call is its structure's first, which runs eagerly) and of
all, how many calls ran the fused path's compiled graph (a structure's first call runs eagerly; 0: no
decode attention of the model takes it, as an MLA latent's), and how many CPU step structures (the
fused attention's or a quantization's) Inductor failed to compile, whose calls ran the reference
eagerly (``cpu_steps._contain``). Each run starts with no compiled graphs kept. ``--kv4-setting``:
``kvpass.kv4`` settings of one's own in place of the default (an opt-in's decode steps compiled too).

``--coverage`` takes model types instead (all that ``docs/coverage.json`` lists as rewritten, or
those named), each as ``kvpass coverage`` shrinks it (heads of 32 channels: K's spec with all its
extras), in a subprocess of its own with a timeout.

    python benchmarks/fused_families.py [FAMILY ...] [--tokens 12] [--kv4-setting NAME=VALUE ...]
    python benchmarks/fused_families.py --coverage [TYPE ...] [--jobs 2] [--timeout 300]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import time
import unittest.mock
from pathlib import Path

import torch
from isolated import last_line  # benchmarks/, beside this script

import kvpass
from kvpass import arguments, coverage, cpu_steps
from kvpass.models_zoo import ZOO, build

PROMPT_TOKENS = 90
COLUMNS = (f"{'model':<24} {'same tokens':<12} {'step 1 diff':<12} {'max diff':<9} {'fused-path calls':<17} "
           f"{'failed compiles':<16} seconds")
FUSED = (cpu_steps._decode_step, cpu_steps._decode_attention)


def _model(name: str, from_coverage: bool):
    if not from_coverage:
        return build(name)
    torch.manual_seed(0)  # as kvpass coverage builds it
    return coverage.causal_lm(coverage.tiny_config(name)).eval()


@torch.no_grad()
def generate(name: str, tokens: int, fused: bool, from_coverage: bool, kv4_settings: dict):
    """``(output, calls that ran a fused graph, structures whose compile failed)`` of ``name`` compiled with
    ``kvpass.kv4(**kv4_settings)``, generating ``tokens`` greedy tokens."""
    torch._dynamo.reset()
    model = _model(name, from_coverage)
    model.compile(backend=kvpass.kv4(**kv4_settings))
    vocab = min(model.config.get_text_config(decoder=True).vocab_size or 256, 256)
    ids = torch.randint(3, vocab, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    calls, compile_ = [0], cpu_steps._compile

    def counted_compile(fn, args):
        graph = compile_(fn, args)

        def call(*args):
            out = graph(*args)
            calls[0] += fn in FUSED and out is not None  # None: its guards rejected args
            return out

        return call

    # use_cache: some configs turn the cache off (MPT's), and without one kv4 has nothing to do
    settings = dict(max_new_tokens=tokens, do_sample=False, use_cache=True, return_dict_in_generate=True,
                    output_logits=True)  # fmt: skip
    attention = contextlib.nullcontext() if fused else cpu_steps.reference_attention()
    fresh = dict(_compiled={}, _recent={}, _refused=set(), _compile=counted_compile)
    with unittest.mock.patch.multiple(cpu_steps, **fresh), attention:
        output = model.generate(ids, **settings)
        return output, calls[0], len(cpu_steps._refused)


def compare(name: str, tokens: int, from_coverage: bool, kv4_settings: dict) -> str:
    """The table row of one model."""
    start = time.perf_counter()
    (fused, calls, failed), (reference, *_) = (generate(name, tokens, fused, from_coverage, kv4_settings)
                                               for fused in (True, False))  # fmt: skip
    same = torch.equal(fused.sequences, reference.sequences)
    diffs = [(a - b).abs().max().item() for a, b in zip(fused.logits, reference.logits)]
    seconds = time.perf_counter() - start
    # logits[0] is the prompt's, which neither path's decode attention computes.
    return f"{name:<24} {str(same):<12} {diffs[1]:<12.1e} {max(diffs):<9.1e} {calls:<17} {failed:<16} {seconds:.0f}"


def compare_isolated(name: str, tokens: int, timeout: float, kv4_settings: dict) -> str:
    """:func:`compare` of a coverage type in a subprocess: a type that crashes or hangs says so in its row."""
    settings = json.dumps(arguments.kv4_settings_as_literals(kv4_settings))
    line, why = last_line([__file__, "--one", name, "--tokens", str(tokens), "--settings", settings], timeout,
                          lambda line: line.startswith(name))  # fmt: skip
    return line if line is not None else f"{name:<24} failed: {why}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="models_zoo names, or with --coverage model types (default: all)")
    parser.add_argument("--coverage", action="store_true", help="model types as kvpass coverage shrinks them")
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--jobs", type=int, default=2, help="--coverage: subprocesses at once")
    parser.add_argument("--timeout", type=float, default=300, help="--coverage: seconds a type")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a --coverage subprocess's type
    parser.add_argument("--settings", type=json.loads, default={}, help=argparse.SUPPRESS)  # and its settings
    arguments.add_kv4_settings(parser, "every model's backend")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one:
        print(compare(args.one, args.tokens, True, arguments.kv4_settings_from_literals(args.settings)))
        return
    kv4_settings = dict(args.kv4_settings)
    kvpass.backend.check_settings(kv4_settings, "fused_families.py")
    print(COLUMNS, flush=True)
    if not args.coverage:
        for name in args.names or ZOO:
            print(compare(name, args.tokens, False, kv4_settings), flush=True)
        return
    matrix = json.loads((Path(__file__).parents[1] / "docs" / "coverage.json").read_text())
    names = args.names or [row["model_type"] for row in matrix["rows"] if row["status"] == "rewritten"]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for row in pool.map(lambda name: compare_isolated(name, args.tokens, args.timeout, kv4_settings), names):
            print(row, flush=True)


if __name__ == "__main__":
    main()
