"""Every models_zoo family through kv4's fused CPU decode attention, against the reference's.

The test suite checks the fused, Inductor-compiled attention a CPU user's decode steps take op by op
and on one llama (``tests/test_cpu_steps.py``), and ``kvpass coverage`` checks one decode step with
the reference attention: neither runs each architecture's decode steps through it. Here each
family's tiny model, compiled with kv4, greedily generates ``--tokens`` tokens after a 90-token
prompt twice: as it runs by default, and with :func:`kvpass.cpu_steps.reference_attention`. The
quantization is the same bit for bit either way, so the two differ only by the attention's order of
sums; prints whether the tokens agree, the largest logit difference, and how many calls took the
fused path (a structure's first runs eagerly, the rest its compiled graph; 0: the family's sites
never reach it, as MLA's latent).

    python benchmarks/fused_families.py [FAMILY ...] [--tokens 12]
"""

from __future__ import annotations

import argparse
import time
import unittest.mock

import torch

from kvpass import cpu_steps
from kvpass.models_zoo import ZOO, build


@torch.no_grad()
def generate(name: str, tokens: int, fused: bool):
    """``(output, calls on the fused path)`` of a kv4-compiled ``name`` generating ``tokens`` greedy tokens."""
    torch._dynamo.reset()
    model = build(name)
    model.compile(backend="kv4")
    ids = torch.randint(3, model.config.vocab_size, (1, 90), generator=torch.Generator().manual_seed(0))
    calls, run = [0], cpu_steps._run

    def counted_run(fn, *rest):
        calls[0] += fn in (cpu_steps._decode_step, cpu_steps._decode_attention)
        return run(fn, *rest)

    settings = dict(max_new_tokens=tokens, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with unittest.mock.patch.object(cpu_steps, "_run", counted_run):
        if fused:
            return model.generate(ids, **settings), calls[0]
        with cpu_steps.reference_attention():
            return model.generate(ids, **settings), calls[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=list(ZOO), help=f"models_zoo names (default: all {len(ZOO)})")
    parser.add_argument("--tokens", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'family':<14} {'same tokens':<12} {'max logit diff':<15} {'fused-path calls':<17} seconds")
    for name in args.families:
        start = time.perf_counter()
        (fused, calls), (reference, _) = generate(name, args.tokens, True), generate(name, args.tokens, False)
        same = torch.equal(fused.sequences, reference.sequences)
        diff = max((a - b).abs().max().item() for a, b in zip(fused.logits, reference.logits))
        print(f"{name:<14} {str(same):<12} {diff:<15.2e} {calls:<17} {time.perf_counter() - start:.0f}")


if __name__ == "__main__":
    main()
