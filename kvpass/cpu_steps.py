"""A CPU decode step's quantization: the reference, compiled by Inductor.

On CPU a ``kv4::`` op runs :mod:`kvpass.reference`, a hundred or more small torch calls, and a
decode step's append quantizes one token, so the calls' fixed cost is nearly all its cost
(SmolLM2: 60 appends a step, each ~1 ms, against a ~100 ms fp step; ``docs/bench-decode.md``).
Inductor turns the same code into a few C++ loops and computes the same numbers: the clipped
scale search sums integers (exact in any order) and Inductor's CPU code rounds each elementwise
op as torch does (told to keep the reference's fp16 roundings inside a fused loop), so codes and scales are the reference's bit for bit
(``tests/test_cpu_steps.py`` checks it on hard values, non-finite ones included).

Only appends of ``STEP_TOKENS`` tokens take this path: a decode step's shapes are fixed for a model,
so each (shape, spec) compiles once (a few seconds, then Inductor's on-disk cache); prompts and
chunks vary in length and their ops are large already, so they stay eager. Where Inductor cannot
compile (no C++ compiler), the failure is logged once and the reference runs eagerly from then on;
an input the reference itself rejects raises its error and leaves the compiled path on.
"""

from __future__ import annotations

import functools
import logging
import types
import warnings

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kvpass import reference

log = logging.getLogger("kvpass")

STEP_TOKENS = 1

# Off in the test suite (tests/conftest.py), where hundreds of shapes would each compile; the
# tests of this module turn it on and compare with the eager reference.
enabled = True


@functools.lru_cache(maxsize=None)
def _compiled(fn, spec):
    # Dynamo keeps at most recompile_limit (8) graphs per code object and every spec is a graph of
    # its own: a process trying many schemes (kvpass eval) would run out and silently fall back.
    # A copy of the code per spec leaves each spec that budget for its shapes (batch sizes, dtypes).
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
    # Inductor would otherwise skip the fp16 round trip of a scale used within the same loop
    # (the clip search divides by fp16-rounded candidates): the codes would change.
    return torch.compile(own, dynamic=False, options={"emulate_precision_casts": True})


def _takes(x: torch.Tensor) -> bool:
    # Inside another trace or a dispatch mode (opcheck's, a fake mode) the eager reference is the
    # one that composes; a subclass or a non-CPU tensor is not what Inductor's CPU code is for.
    return (enabled and x.shape[2] == STEP_TOKENS and type(x) is torch.Tensor and x.device.type == "cpu"
            and not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None)  # fmt: skip


def _run(fn, x, spec, *args):
    global enabled
    try:
        with warnings.catch_warnings():
            # Notes about compiling, not about the numbers: Dynamo traces through the reference's
            # lru_cache'd constants (Hadamard matrix, clip divisors), the same values either way, and
            # Inductor's C++ code for a bf16 model's append converts to fp16 scales in one loop.
            warnings.filterwarnings("ignore", message=r"Dynamo detected a call to a `functools.lru_cache`")
            warnings.filterwarnings("ignore", message=r"bf16 and fp16 are mixed in the scheduler node")
            # One token: its dimension's stride is arbitrary (V's new token arrives with another than
            # K's), and Dynamo would compile a graph for each; a fresh unsqueeze gives one stride.
            return _compiled(fn, spec)(x.squeeze(2).unsqueeze(2), spec, *args)
    except Exception as err:  # noqa: BLE001 - any compile failure leaves the eager reference
        # A bad input raises here again, as it would without compiling, and leaves the path on.
        result = fn(x, spec, *args)
        enabled = False
        log.warning("kvpass: decode-step quantization stays eager on CPU: Inductor failed (%s: %s)",
                    type(err).__name__, err)  # fmt: skip
        return result


def encode(x: torch.Tensor, spec, offset: torch.Tensor | None = None, rounding: torch.Tensor | None = None):
    """:func:`kvpass.reference.encode`, compiled for a decode step's ``x``."""
    if _takes(x):
        return _run(reference.encode, x, spec, offset, reference.quantize, rounding)
    return reference.encode(x, spec, offset, rounding=rounding)


def encode_refined(x: torch.Tensor, spec, offset: torch.Tensor | None = None, rounding: torch.Tensor | None = None):
    """:func:`kvpass.reference.encode_refined`, compiled for a decode step's ``x``."""
    if _takes(x):
        return _run(reference.encode_refined, x, spec, reference.quantize, offset, rounding)
    return reference.encode_refined(x, spec, offset=offset, rounding=rounding)
