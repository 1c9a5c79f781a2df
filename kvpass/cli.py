"""``kvpass`` command line: demo, explain, estimate, eval, coverage, sensitivity, bench."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from typing import Callable

import torch

from kvpass import arguments, version
from kvpass.cache_argument import kv_layers, returned_cache

log = logging.getLogger("kvpass")

# This module's name, also where it runs as ``python -m kvpass.cli`` (its __name__ then "__main__").
_THIS = "kvpass.cli"
# subcommand -> (module providing add_arguments(parser) and run(args), help)
SUBCOMMANDS = {
    "demo": (_THIS, "compile a built-in tiny model with kv4, generate, show bytes and sites"),
    "explain": (_THIS, "print the graph diffs and site table kv4 produces for a models_zoo or real model"),
    "estimate": ("kvpass.estimate", "KV-cache bytes of a model at given contexts and batch sizes"),
    "eval": ("kvpass.eval", "streaming perplexity and greedy agreement on a real model"),
    "coverage": ("kvpass.coverage", "support matrix over transformers' causal-LM architectures"),
    "sensitivity": ("kvpass.sensitivity", "what int4 keys cost in each layer of a real model, one layer at a time"),
}
BENCHMARKS = {
    "memory": ("kvpass.bench.memory", "stored KV bytes and peak memory against context length"),
    "decode": ("kvpass.bench.decode", "per-token decode latency against context length"),
    "append": ("kvpass.bench.append", "cost of appending one token to a cache against context length"),
    "attention": ("kvpass.bench.attention", "GPU decode-attention kernel time against the memory roofline"),
}
DEMO_PROMPT_TOKENS = 300
BENCH_HELP = f"benchmarks ({', '.join(BENCHMARKS)})"
DESCRIPTION = ("kvpass stores Hugging Face models' KV caches in int4 through torch.compile(model, backend=\"kv4\"); "
               "these commands show what it does to a model and measure it.")


def _demo_arguments(parser):
    parser.add_argument(
        "--model", default="llama_hd128",
        help=f"a models_zoo name (default: llama_hd128, random weights) or a model kvpass eval loads "
             f"({arguments.REAL_MODELS}), whose prompt and continuations are shown as text",
    )  # fmt: skip
    parser.add_argument("--prompt-tokens", type=arguments.positive_int,
                        help=f"the prompt's length, its first tokens of --text (default: {DEMO_PROMPT_TOKENS})")
    parser.add_argument("--new-tokens", type=arguments.positive_int, default=40)
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--text", help="a real model's prompt: kjv, code (the standard library's source; the "
                                       "default) or a file")  # fmt: skip
    prompt.add_argument("--prompt", metavar="TEXT", help="a real model's prompt as given, all its tokens")
    arguments.add_kv4_settings(parser, "the kv4 run")


def _demo_prompt_ids(args, text: str | None, model, tokenizer) -> torch.Tensor:
    """``[1, S]`` prompt ids: random for a models_zoo model, else ``--prompt`` or the start of ``text``
    (``--text``'s; the standard library's source when None)."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(2, model.config.vocab_size, (1, args.prompt_tokens or DEMO_PROMPT_TOKENS),
                             generator=generator)  # fmt: skip
    if args.prompt is not None:
        if args.prompt_tokens is not None:
            raise ValueError("--prompt-tokens takes the first tokens of --text; --prompt is used whole")
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        if ids.shape[1] == 0:
            raise ValueError(f"--prompt {args.prompt!r} has no tokens")
        return ids
    from kvpass import text_data

    want = args.prompt_tokens or DEMO_PROMPT_TOKENS
    # A few characters a token: enough text, then exactly the tokens asked for.
    ids = tokenizer((text or text_data.load("code"))[: 20 * want], return_tensors="pt").input_ids
    if ids.shape[1] < want:
        raise ValueError(f"--prompt-tokens {want} is more than the {ids.shape[1]} tokens of --text")
    return ids[:, :want]


@torch.no_grad()
def run_demo(args) -> None:
    from kvpass import text_data
    from kvpass.debug import site_table
    from kvpass.models_zoo import ZOO
    from kvpass.packed import PackedKV

    given = [name for name, value in (("--text", args.text), ("--prompt", args.prompt)) if value is not None]
    if args.model in ZOO and given:
        raise ValueError(f"{given[0]} is a real model's prompt; models_zoo {args.model} has random weights and no "
                         "tokenizer")  # fmt: skip
    text = None if args.text is None else text_data.load(args.text)  # refused before a real model's load
    model, tokenizer = _model_and_tokenizer(args.model)
    ids = _demo_prompt_ids(args, text, model, tokenizer)
    fp_out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, return_dict_in_generate=True)
    backend = _kv4(args)
    model.compile(backend=backend)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, return_dict_in_generate=True)
    seconds = time.perf_counter() - start

    fp_layers, layers = kv_layers(returned_cache(fp_out)), kv_layers(returned_cache(out))
    fp_bytes = sum(t.numel() * 2 for layer in fp_layers for t in (layer.keys, layer.values))
    stored = sum(t.stored_bytes() for layer in layers for t in (layer.keys, layer.values))
    # Only the generated tokens: the prompt is equal by construction. Either run may end its sequence
    # early (a real model's end-of-sequence token), and not at the same step.
    new, fp_new = out.sequences[0, ids.shape[1] :], fp_out.sequences[0, ids.shape[1] :]
    both = min(len(new), len(fp_new))
    differs = (new[:both] != fp_new[:both]).nonzero()
    agreed = int(differs[0]) if len(differs) else both
    source = f"models_zoo {args.model} ({model.config.model_type}, random weights)" if tokenizer is None else \
        f"{args.model} ({model.config.model_type})"
    ended = "" if len(new) == args.new_tokens else f" (of {args.new_tokens} asked: it ended the sequence)"
    print(f"model: {source}, {ids.shape[1]} prompt + {len(new)} generated tokens{ended}, "
          f"kvpass.kv4({arguments.kv4_settings_text(args.kv4_settings)})")  # fmt: skip
    # A cache still waiting for K's prefix (under 64 tokens) holds K exact and can be larger.
    size = f"{fp_bytes / stored:.2f}x smaller" if stored < fp_bytes else f"{stored / fp_bytes:.2f}x larger"
    print(f"KV cache: fp16 {fp_bytes:,} bytes -> kv4 {stored:,} bytes ({stored / fp_bytes:.3f}x, {size}), "
          "counted from the stored tensors")  # fmt: skip
    print(f"keys of the first layer that holds K and V: {layers[0].keys!r}")
    waiting = [layer.keys for layer in layers if isinstance(layer.keys, PackedKV) and layer.keys.waiting]
    if waiting:
        print(f"K is held unquantized until a cache holds {waiting[0].spec.prefix_tokens} tokens, which fix its "
              "sinks, offset and query scales: a longer prompt or more new tokens stores it in int4")  # fmt: skip
    # A graph per decode step would mean a length the graphs specialise on: say how many there were.
    print(f"kv4 generate: {seconds:.1f} s with compiling, {len(backend.graphs)} graphs compiled for "
          f"{len(new)} generated tokens")  # fmt: skip
    caveat = " (random weights give near-flat logits, so an early difference says little)" if tokenizer is None else ""
    print(f"generated tokens equal to the unquantized model's before the first difference: {agreed} of {len(new)}"
          f"{caveat}")  # fmt: skip
    if tokenizer is not None:
        print(f"prompt ends:      {tokenizer.decode(ids[0, -40:])!r}")
        print(f"fp16 cache wrote: {tokenizer.decode(fp_new)!r}")
        print(f"kv4 cache wrote:  {tokenizer.decode(new)!r}")
    print("attention sites of the last compiled graph:")
    print(site_table(backend.graphs[-1].sites))


def _explain_arguments(parser):
    parser.add_argument(
        "model", nargs="?", default="llama",
        help=f"a models_zoo name (default: llama) or a model kvpass eval loads ({arguments.REAL_MODELS})",
    )  # fmt: skip
    parser.add_argument("--new-tokens", type=arguments.positive_int, default=3, help="decode steps (3 shows every graph kind)")
    parser.add_argument("--save", metavar="DIR", help="also write each graph's code, diff and site table here")
    arguments.add_kv4_settings(parser, "the backend (debug_dir is --save)")


def run_explain(args) -> None:
    from kvpass import debug

    model = _model_and_tokenizer(args.model)[0]
    backend = _kv4(args, debug_dir=args.save)
    model.compile(backend=backend)
    model.generate(torch.arange(2, 12)[None], max_new_tokens=args.new_tokens, do_sample=False)
    for graph in backend.graphs:
        print(f"===== {graph.name}")
        print(debug.site_table(graph.sites))
        print(graph.diff or "(graph unchanged)\n")


def _kv4(args, **own):
    """``kvpass.kv4`` with ``--kv4-setting``'s keywords and the command's ``own``."""
    from kvpass.backend import check_settings, kv4

    settings = dict(args.kv4_settings)
    check_settings(settings, f"kvpass {args.command}", taken=tuple(own))
    return kv4(**settings, **own)


def _model_and_tokenizer(name: str):
    """The models_zoo model ``name`` and None, or the real model it names and its tokenizer: what kv4
    does to a user's own model is what ``explain`` and ``demo`` show."""
    from kvpass.models_zoo import ZOO, build
    from kvpass.models_zoo.real_model import load_model

    if name in ZOO:
        return build(name), None
    try:
        return load_model(name)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err}; nor is it a models_zoo name: {sorted(ZOO)}") from None


_LOCAL = {"demo": (_demo_arguments, run_demo), "explain": (_explain_arguments, run_explain)}


def _load(module_name: str, command: str):
    if module_name == _THIS:
        return _LOCAL[command]
    module = importlib.import_module(module_name)
    return module.add_arguments, module.run


def build_parser(lazy: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpass", description=DESCRIPTION,
                                     epilog="kvpass COMMAND --help: a command's options")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what kvpass does (INFO)")
    parser.add_argument("--version", action="version", version=f"kvpass {version.describe()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text).set_defaults(_module=module)
    bench = sub.add_parser("bench", help=BENCH_HELP, description=BENCH_HELP)
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        bench_sub.add_parser(name, help=help_text, description=help_text).set_defaults(_module=module)
    return parser


def parse(argv: list[str]) -> tuple[argparse.Namespace, Callable, argparse.ArgumentParser]:
    """``argv``'s arguments, its subcommand's ``run`` and that subcommand's parser (for its errors);
    bad arguments exit as argparse does, naming them."""
    parser = build_parser()
    # Two passes: the first finds the subcommand, whose module then defines its own options;
    # importing every subcommand's module up front would make `kvpass demo` pay for all.
    # --help waits for the second pass, which knows the subcommand's options.
    wants_help = [a for a in argv if a in ("-h", "--help")]
    rest = [a for a in argv if a not in wants_help]
    if wants_help and rest in ([], ["bench"]):  # no subcommand whose options to add: argparse's help
        parser.parse_args(argv)
    known, _ = parser.parse_known_args(rest)
    command = known.benchmark if known.command == "bench" else known.command
    add_arguments, run = _load(known._module, command)
    sub_parser = _subparser(parser, known)
    add_arguments(sub_parser)
    return parser.parse_args(argv), run, sub_parser


def main(argv=None) -> int:
    args, run, sub_parser = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        result = run(args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        if args.verbose:
            raise
        # Bad input (a value, a path, a model whose optional package is missing: its message names
        # the install command): argparse's form, usage and the reason, exit status 2.
        sub_parser.error(str(err))
    return int(result or 0)


def _subparser(parser, known):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = action.choices[known.command]
    if known.command == "bench":
        bench_action = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction))
        return bench_action.choices[known.benchmark]
    return sub


if __name__ == "__main__":
    sys.exit(main())
