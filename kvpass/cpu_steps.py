"""A CPU decode step's kv4 ops, compiled by Inductor.

On CPU a ``kv4::`` op runs :mod:`kvpass.reference`, a hundred or more small torch calls, and a
decode step appends one token and attends with one query, so the calls' fixed cost is most of the
step (SmolLM2: 60 appends and 30 attentions a step, 30 calls in all since a layer's are one;
``docs/bench-decode.md``). Inductor turns them into a few C++ loops:

- **Quantization** (:func:`encode`, :func:`encode_refined`): the reference's own functions, compiled,
  and the same numbers: the clipped scale search sums integers (exact in any order) and Inductor's
  CPU code rounds each elementwise op as torch does (told to keep the reference's fp16 roundings
  inside a fused loop), so codes and scales are the reference's bit for bit (``tests/test_cpu_steps.py``
  checks it on hard values, non-finite ones included).
- **Attention** (:func:`attention`): :func:`kvpass.reference.attention` for one query token, written
  as reductions over the stored parts so that each code is unpacked and scaled inside the loop that
  reads it: no dequantized block is ever written (the reference writes one per 1365 SmolLM2 tokens),
  and the fp cache is never materialised. Its sums run in another order than the reference's
  matmuls, so it agrees within the fused kernels' tolerances, as the Triton kernel does; kvpass's
  measurements keep the reference (:func:`reference_attention`).
- **A layer's step** (:func:`decode_step`): the attention and both new tokens' quantization as one
  graph, where the model's graph calls them together (``kv4::decode_step``): a compiled call's
  wrappers cost more than one token's work, so one call a layer, not three.

Only decode steps take this path (``STEP_TOKENS`` new tokens; their attention also an attention
sink's zero token after it, ``ATTENDED_NEW_TOKENS``): a model's step has the same shapes but for the
cache's lengths, which the attention graph takes as unbacked symbols (:func:`_unbacked`), so each
structure (spec, shape, which optional parts are present) compiles once for every length (kvpass
calls the graphs itself, :func:`_compile`); prompts and chunks vary in length and their ops are
large already, so they stay eager. Where Inductor cannot build C++ (no working compiler), the
failure is logged once and the reference runs eagerly from then on; where it fails on one
structure's graph, that structure's calls run eagerly (logged once each) and every other structure's
stay compiled; an input the reference itself rejects raises its error and leaves the compiled path
on. With Dynamo disabled, or under a ``torch.compiler.set_stance`` other than the default, nothing
new compiles: graphs already compiled still run, other calls run eagerly (logged once), and
compiling resumes when that is lifted.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import types
import warnings

import torch
import torch._inductor.exc
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kvpass import reference

log = logging.getLogger("kvpass")

STEP_TOKENS = 1
# New tokens a decode step's attention takes fused: the step's own, and after it the zero token that
# stands for an attention sink's logit (GPT-OSS's, passes.py), whose column the mask holds.
ATTENDED_NEW_TOKENS = (STEP_TOKENS, STEP_TOKENS + 1)

def _compiles_by_default(torch_version: str) -> bool:
    return torch.torch_version.TorchVersion(torch_version) >= (2, 13)


# Off in the test suite (tests/conftest.py), where hundreds of shapes would each compile; the
# tests of this module turn it on and compare with the eager reference. Off before torch 2.13:
# under 2.11's Inductor a rotated spec's codes and scales were not the reference's (2 of 864 code
# bytes, 3 of 27 scales, one decode step of 9 x 3 heads), and the eager path costs only time.
enabled = _compiles_by_default(torch.__version__)
# Whether a decode step's attention takes the fused form; off within reference_attention().
fused_attention = True


def _compile(fn, args):
    """``fn`` compiled by Inductor for ``args`` (their marks traced), as a function of the same arguments
    that returns None where the graph's guards reject them.

    Dynamo compiles a copy of ``fn``'s code, a cache entry of its own (no code object reaches Dynamo's
    recompile_limit, past which a process trying many schemes, kvpass eval, would silently run the
    Python eagerly), and kvpass calls the entry's code itself, checking its guards as Dynamo's frame
    hook would: the hook cost 30-100 us of a SmolLM2 decode graph's call (``docs/bench-decode.md``). The
    guards hold what a key (:func:`_run`) leaves out: the dispatch keys and global state a call is
    made in (within an op's dispatch, inference mode), which a graph specialises on too."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
    # Inductor would otherwise skip the fp16 round trip of a scale used within the same loop
    # (the clip search divides by fp16-rounded candidates): the codes would change.
    torch.compile(own, fullgraph=True, dynamic=False, options={"emulate_precision_casts": True})(*args)
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(own)
    if len(entries) != 1:  # Dynamo skipped the frame (a stance, a disabled region)
        raise RuntimeError(f"Dynamo compiled {len(entries)} graphs of {fn.__name__}, not one")
    (entry,) = entries
    graph, guards = types.FunctionType(entry.code, fn.__globals__, fn.__name__, fn.__defaults__), entry.guard_manager
    names = own.__code__.co_varnames[: own.__code__.co_argcount]

    def call(*args):
        return graph(*args) if guards.check(dict(zip(names, args))) else None

    def rejection(*args) -> str:
        """Which of the guards reject ``args``, in Dynamo's words."""
        return "; ".join(guards.check_verbose(dict(zip(names, args))).verbose_code_parts)

    call.rejection = rejection
    return call


# (function, key) -> the key's compiled graphs (_compile), none yet after its first (eager) call.
_compiled = {}
# Graphs a key may compile for the contexts its calls are made in (_compile) before it runs eagerly.
GRAPHS_PER_KEY = 4
# Keys that compiled GRAPHS_PER_KEY graphs and met inputs none of them takes (warned once each).
_overflowing = set()
# Keys whose graph Inductor failed to compile (_contain): their calls run eagerly.
_refused = set()
# function -> the graphs that took its latest calls, latest first (RECENT_GRAPHS at most). A model's
# layers make calls of one or two structures step after step: a call one of these graphs' guards
# take runs it without working out its key (each input's layout, two specs hashed: ~30 us of a warm
# SmolLM2 call, more in a running model; docs/design.md). The guards decide: a graph runs only on
# inputs it is correct for, whichever key it was compiled under.
_recent = {}
RECENT_GRAPHS = 4


def untraced_cpu(*tensors: torch.Tensor | None) -> bool:
    """Whether ``tensors`` are plain CPU tensors (no subclass, fake or functional tensor) used outside
    any trace or dispatch mode (opcheck's, a fake mode)."""
    # is_cpu, not device.type: a device object a tensor, ~20 tensors a decode call, twice (ops.call).
    return (all(type(t) is torch.Tensor and t.is_cpu for t in tensors if t is not None)
            and not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None)  # fmt: skip


def _takes(*tensors: torch.Tensor) -> bool:
    # Elsewhere (another trace, a mode, a subclass, a non-CPU tensor) the eager reference is the one
    # that composes, and not what Inductor's CPU code is for.
    return enabled and untraced_cpu(*tensors)


def _run(fn, args, key, eager, traced=None):
    """``fn(*args)`` compiled, or ``eager()`` where Inductor fails or a key has compiled ``GRAPHS_PER_KEY``
    graphs. A recent graph that takes ``args`` runs first; else the graphs kept under ``key()``, or
    one compiled for it (traced with ``traced()`` where given, else ``args``)."""
    try:
        result = _compiled_result(fn, args, key, traced)
    except Exception as err:  # noqa: BLE001 - any compile failure leaves the eager reference
        # A bad input raises here again, as it would without compiling, and leaves the path on.
        result = eager()
        _contain(err)
        return result
    return eager() if result is None else result


class _GuardsRejected(RuntimeError):
    """A graph's guards rejected the inputs it was just compiled for: the key and the trace left out
    something the guards check (the inputs' ``requires_grad`` did, before the sixty-first run, and
    whether they were inference tensors, before the sixty-second)."""


class _KeyFailed(Exception):
    """Compiling ``fn``'s graph for ``key``, or its first call, failed with the exception this one is raised from."""

    def __init__(self, fn, key):
        super().__init__(fn.__name__)
        self.fn, self.key = fn, key


# Whether a graph has compiled in this process: once one has, the C++ toolchain works, and a C++ error
# (CppCompileError) is that graph's code; before, it is read as the toolchain's, as a missing compiler is.
_built_one = False


def _toolchain_failed(err: BaseException) -> bool:
    if isinstance(err, torch._inductor.exc.InvalidCxxCompiler):
        return True
    return isinstance(err, torch._inductor.exc.CppCompileError) and not _built_one


def _contain(err: Exception) -> None:
    """Keeps a failed compile to what it says: a toolchain that cannot build (:func:`_toolchain_failed`)
    turns the compiled path off; a graph Inductor cannot compile (a guard on a data-dependent length, an
    op it cannot lower, C++ it cannot build), or whose guards reject the inputs it was compiled for, sends
    only its key's calls to the eager reference. One such structure had turned a whole model's compiled
    decode steps off (docs/bench-decode.md, "Attention sinks")."""
    global enabled
    causes = [err.__cause__ if isinstance(err, _KeyFailed) else err]
    while len(causes) < 8 and (inner := causes[-1].__cause__ or getattr(causes[-1], "inner_exception", None)):
        causes.append(inner)  # Dynamo wraps the backend's error (BackendCompilerFailed.inner_exception)
    root = causes[-1]
    # The error's first line: Inductor's go on with the graph's IR, dozens of lines, logged at DEBUG.
    why = f"{type(root).__name__}: {(str(root).splitlines() or [''])[0]}"
    if isinstance(err, _KeyFailed) and not any(map(_toolchain_failed, causes)):
        _refused.add((err.fn, err.key))
        failure = ("its graph rejects the inputs it was compiled for" if isinstance(err.__cause__, _GuardsRejected)
                   else "Inductor failed on its graph")  # fmt: skip
        log.warning("kvpass: %s runs eagerly on CPU for one structure of its inputs: %s (%s)", err.fn.__name__,
                    failure, why)  # fmt: skip
        log.debug("kvpass: the structure of %s refused: %r", err.fn.__name__, err.key, exc_info=root)
        return
    enabled = False
    log.warning("kvpass: decode steps stay eager on CPU: Inductor failed (%s)", why)
    log.debug("kvpass: Inductor's failure", exc_info=root)


def _compiled_result(fn, args, key, traced):
    """:func:`_run`'s compiled result, or None where the call runs eagerly."""
    global _built_one
    recent = _recent.setdefault(fn, [])
    for i, graph in enumerate(recent):
        result = graph(*args)
        if result is not None:
            if i:
                recent.insert(0, recent.pop(i))
            return result
    key = key()
    if (fn, key) in _refused:
        return None
    graphs = _compiled.get((fn, key))
    if graphs is None:
        # The first call of a key runs eagerly: it makes the reference's cached tensors (Hadamard
        # matrix, clip divisors, field orders), which a graph compiled at the next call takes as
        # inputs. Compiled first, the graph would make them at every call.
        _compiled[fn, key] = []
        return None
    for graph in graphs:
        result = graph(*args)
        if result is not None:
            break
    else:
        if len(graphs) == GRAPHS_PER_KEY:
            if (fn, key) not in _overflowing:
                _overflowing.add((fn, key))
                log.warning("kvpass: %s runs eagerly on CPU here: it compiled %d graphs for one key, none of "
                            "which takes these inputs", fn.__name__, GRAPHS_PER_KEY)  # fmt: skip
            return None
        if not _may_compile():
            return None
        with warnings.catch_warnings():
            # A note about compiling, not about the numbers: Inductor's C++ code for a bf16 model's
            # append converts to fp16 scales in one loop.
            warnings.filterwarnings("ignore", message=r"bf16 and fp16 are mixed in the scheduler node")
            try:
                graph = _compile(fn, args if traced is None else traced())
            except Exception as err:
                raise _KeyFailed(fn, key) from err
        _built_one = True
        result = graph(*args)
        if result is None:
            raise _KeyFailed(fn, key) from _GuardsRejected(graph.rejection(*args))
        graphs.append(graph)
    recent[:] = [graph, *recent[: RECENT_GRAPHS - 1]]
    return result


# What _may_compile has warned of (once each).
_refusals_warned = set()


def _may_compile() -> bool:
    """Whether a new graph may compile now: Dynamo is on and ``torch.compiler.set_stance`` is at its
    default. With Dynamo disabled (``TORCHDYNAMO_DISABLE=1``, ``torch._dynamo.config.disable``)
    ``torch.compile`` compiles nothing; the other stances ask for no new compiles (``force_eager``,
    ``eager_on_recompile``, ``fail_on_recompile``) or for another compiler (``eager_then_compile``,
    ``force_backend``), and Dynamo would skip or fail the compile. Neither is Inductor failing: until
    it is lifted, a call that no kept graph takes runs eagerly."""
    stance = torch._dynamo.eval_frame._stance  # set_stance's state, which torch gives no getter
    if os.environ.get("TORCHDYNAMO_DISABLE") == "1" or torch._dynamo.config.disable:
        refusal = "with Dynamo disabled (TORCHDYNAMO_DISABLE=1 or torch._dynamo.config.disable)"
    elif stance.stance == "default" and stance.backend is None:
        return True
    else:
        name = stance.stance if stance.backend is None else f"force_backend={stance.backend!r}"
        refusal = f"under torch.compiler's stance {name}"
    if refusal not in _refusals_warned:
        _refusals_warned.add(refusal)
        log.warning("kvpass: decode steps compile no new graph on CPU %s: calls no compiled graph takes run "
                    "eagerly until it is lifted", refusal)  # fmt: skip
    return False


def _step(x: torch.Tensor) -> torch.Tensor:
    # New tokens: a size-1 dimension's stride is arbitrary (V's new token arrives with another than
    # K's), and Dynamo would compile a graph for each; a fresh unsqueeze gives one stride, and a copy
    # of a few tokens gives them all.
    return x.squeeze(2).unsqueeze(2) if x.shape[2] == 1 else x.clone(memory_format=torch.contiguous_format)


def encode(x: torch.Tensor, spec, offset: torch.Tensor | None = None, rounding: torch.Tensor | None = None):
    """:func:`kvpass.reference.encode`, compiled for a decode step's ``x``."""
    if x.shape[2] == STEP_TOKENS and _takes(x):
        args = (_step(x), spec, offset, reference.quantize, rounding)
        return _run(reference.encode, args, lambda: _encoding(args[0], spec, offset, rounding),
                    lambda: reference.encode(*args))  # fmt: skip
    return reference.encode(x, spec, offset, rounding=rounding)


def encode_refined(x: torch.Tensor, spec, offset: torch.Tensor | None = None, rounding: torch.Tensor | None = None):
    """:func:`kvpass.reference.encode_refined`, compiled for a decode step's ``x``."""
    if x.shape[2] == STEP_TOKENS and _takes(x):
        args = (_step(x), spec, reference.quantize, offset, rounding)
        return _run(reference.encode_refined, args, lambda: _encoding(args[0], spec, offset, rounding),
                    lambda: reference.encode_refined(*args))  # fmt: skip
    return reference.encode_refined(x, spec, offset=offset, rounding=rounding)


def _encoding(x: torch.Tensor, spec, offset: torch.Tensor | None, rounding: torch.Tensor | None):
    # What a decode step's quantization graph specialises on: every input's layout (one token's).
    return spec, *map(_structure, (x, offset, rounding))


# --- attention -------------------------------------------------------------------------


@contextlib.contextmanager
def reference_attention():
    """Attention computed by the reference, decode steps included, within this context (or function,
    as a decorator). kvpass's measurements (``kvpass eval``, ``kvpass coverage``) run in it: the fused
    form's last bits differ from the reference's, and a 4-bit cache's discontinuities (a code, a clip
    candidate or a rounding choice that flips) carry such bits into whole tokens' losses, so a
    chunk-1 perplexity or a greedy agreement would differ from the documented numbers by amounts
    within their standard errors (256 tokens of KJV: +0.22% against +1.59%, SE 1.6%) and would
    not reproduce. The quantization is the reference's bit for bit either way."""
    global fused_attention
    before, fused_attention = fused_attention, False
    try:
        yield
    finally:
        fused_attention = before


@functools.lru_cache(maxsize=64)
def _reading(head_dim: int, spec, device: torch.device) -> torch.Tensor:
    """``M [D, D]`` with ``x @ M`` = ``x`` in the order ``spec``'s stored blocks are read: rotated when
    ``spec.rotate``, then in :func:`kvpass.reference.field_order`. Orthogonal: ``M.T`` reads back."""
    base = reference.hadamard(head_dim, device) if spec.rotate else torch.eye(head_dim, device=device)
    return base[:, reference.field_order(head_dim, spec, device)].contiguous()


def _inner_dims(D: int, spec) -> tuple[int, ...]:
    """The dimensions a part of a ``spec`` cache splits its field-major head dim into for the attention's
    sums: ``(runs, fields, run)`` for a per-token spec within a head (a run is a token group's bytes),
    else ``(D,)``. A flat channel index into a run of packed bytes takes a division and a modulo per
    element, which Inductor's C++ code reads as a gather, one scalar load a byte; with a dimension per
    field and one per byte of a run, each loop reads a run's bytes as one vector (the bench model's
    decode step at 1K tokens 5.1-5.4 -> 3.8-3.9 ms, at 4K 9.7-9.9 -> 5.2-5.3 ms; docs/bench-decode.md)."""
    run = reference.field_run(D, spec)
    if spec.scheme != "token" or spec.span_heads or run == 0:
        return (D,)
    fields = 8 // spec.bits
    return (D // (run * fields), fields, run)


def _fields(codes: torch.Tensor, scales: torch.Tensor, spec) -> torch.Tensor:
    """:func:`kvpass.reference.dequantize_field_major` of a per-token spec's ``codes``, the same numbers
    in :func:`_inner_dims`: ``[B, H, n, runs, fields, run]``, a field a shift of the byte read."""
    bits, fields = spec.bits, 8 // spec.bits
    B, H, S, n_bytes = codes.shape
    runs, _, run = _inner_dims(n_bytes * fields, spec)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device).view(fields, 1)
    q = ((codes.view(B, H, S, runs, 1, run) >> shifts) & ((1 << bits) - 1)).float()
    if spec.symmetric:
        q = q - reference.code_offset(bits, spec.symmetric)
    scale, zero = reference.split_scales(scales, spec)  # [B, H, S, runs]: a scale a run
    q = q * reference.scale_values(scale)[..., None, None]
    return q if zero is None else q + reference.scale_values(zero)[..., None, None]


def _stored_parts(codes, scales, residual, spec, fine_codes, fine_scales, head):
    """A cache's stored tokens, in order, as ``(values [B, H, n, *inner] fp32 field-major, quantized)``
    parts, ``inner`` the dimensions :func:`_inner_dims` splits the head dim into.

    Each part is an expression for Inductor to read inside its reduction, never a block in memory.
    The refined tokens are a part of their own, so their two planes add element by element. Lengths
    are unbacked symbols (:func:`_unbacked`): a part may be empty, and nothing here branches on one."""
    D = residual.shape[-1]
    order, inner = reference.field_order(D, spec, residual.device), _inner_dims(D, spec)
    dequantized = functools.partial(_fields if len(inner) > 1 else reference.dequantize_field_major, spec=spec)
    _check_scales(codes, scales, spec)
    split = codes.shape[2] - (0 if fine_codes is None else fine_codes.shape[2])
    torch._check(split >= 0)
    parts = []
    if head is not None and head.shape[2]:  # a fixed count, not a symbol
        parts.append((head.float()[..., order].unflatten(-1, inner), False))
    parts.append((dequantized(codes[:, :, :split], scales[:, :, :split]), True))
    if fine_codes is not None:
        _check_scales(fine_codes, fine_scales, spec)
        coarse = dequantized(codes[:, :, split:], scales[:, :, split:])
        parts.append((coarse + dequantized(fine_codes, fine_scales), True))
    parts.append((residual.float()[..., order].unflatten(-1, inner), False))
    return parts


def _check_scales(codes: torch.Tensor, scales: torch.Tensor, spec) -> None:
    # Tells the trace how two unbacked lengths relate, which it cannot know from the inputs alone.
    if spec.scheme == "channel":
        torch._check(scales.shape[2] * spec.group == codes.shape[2])
    else:
        torch._check(scales.shape[2] == codes.shape[2])


# Query heads a KV head that read a part in sums of their own: Inductor fuses sums over the same tokens
# into one loop that unpacks each code once, where one broadcast sum unpacks it once per query head
# (docs/design.md). Each head's sum is an expression to compile, so more heads go in groups of at most
# this many, the groups a loop of the same compiled sums: a code is unpacked once a group, and the compile
# does not grow with the heads (benchmarks/row_sums.py).
ROW_SUMS = 16


def _row_groups(x: torch.Tensor) -> torch.Tensor:
    """``x [B, H, rep, ...]`` as ``[B, H, groups, size, ...]``: rows in the fewest groups of at most
    ``ROW_SUMS``, zero rows after the last (a query head of none is a score and a sum of 0, cut off
    by the caller)."""
    rep = x.shape[2]
    groups = -(-rep // ROW_SUMS)
    size = -(-rep // groups)
    if groups * size > rep:
        x = torch.cat([x, x.new_zeros(*x.shape[:2], groups * size - rep, *x.shape[3:])], 2)
    return x.unflatten(2, (groups, size))


def _dots(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q [B, H, rep, D]`` against every token of ``keys [B, H, n, *inner]``: ``[B, H, rep, n]``."""
    inner = keys.shape[3:]
    dims = tuple(range(-len(inner), 0))
    rows, keys = _row_groups(q.unflatten(-1, inner)), keys[:, :, None]
    s = torch.stack([(keys * rows[:, :, :, r, None]).sum(dims) for r in range(rows.shape[3])], 3)
    return s.flatten(2, 3)[:, :, : q.shape[2]]


def _weighted(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``p [B, H, rep, n]`` weighting ``values [B, H, n, *inner]``: ``[B, H, rep, D]``."""
    expand = (...,) + (None,) * (values.dim() - 3)
    rows, values = _row_groups(p), values[:, :, None]
    out = torch.stack([(rows[:, :, :, r][expand] * values).sum(3) for r in range(rows.shape[3])], 3)
    return out.flatten(2, 3)[:, :, : p.shape[2]].flatten(3)


def _decode_attention(q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask,
                      scale, softcap, k_fine_codes, k_fine_scales, v_fine_codes, v_fine_scales, k_head, k_offset,
                      v_head, v_offset, k_reading, v_reading, k_spec, v_spec):  # fmt: skip
    B, Hq, _, D = q.shape
    Hkv, Dv = v_new.shape[1], v_new.shape[-1]
    qf = q.float().reshape(B, Hkv, Hq // Hkv, D)  # [B, Hkv, rep, D]: one query token
    q_stored = qf @ k_reading
    # A centered spec's offset is in every quantized key: its share of the score is one dot product.
    k_offset = reference.fixed_or_none(k_offset)
    k_order, v_order = reference.field_order(D, k_spec, q.device), reference.field_order(Dv, v_spec, q.device)
    q_offset = None if k_offset is None else q_stored @ k_offset.float()[..., k_order].transpose(-1, -2)
    scores = []
    for k, quantized in _stored_parts(k_codes, k_scales, k_residual, k_spec, k_fine_codes, k_fine_scales, k_head):
        s = _dots(q_stored, k)
        scores.append(s + q_offset if quantized and q_offset is not None else s)
    scores.append(_dots(qf, k_new.float()))
    s = torch.cat(scores, -1) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if attn_mask is not None:
        torch._check(attn_mask.shape[-1] == s.shape[-1])
        attn_mask = reference.grouped_mask(attn_mask, Hkv)[:, :, :, 0]  # one query token
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    m = s.amax(-1, keepdim=True)
    # A row whose keys are all masked keeps m = -inf; exp(-inf - -inf) would be NaN.
    p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    denom = p.sum(-1, keepdim=True)
    v_offset = reference.fixed_or_none(v_offset)
    v_parts = _stored_parts(v_codes, v_scales, v_residual, v_spec, v_fine_codes, v_fine_scales, v_head)
    lengths = [v.shape[2] for v, _ in v_parts] + [v_new.shape[2]]
    torch._check(sum(lengths) == p.shape[-1])  # K's parts and V's cover the same tokens
    *p_parts, p_new = torch.split(p, lengths, -1)
    out = 0
    for (v, quantized), p_part in zip(v_parts, p_parts):
        out = out + _weighted(p_part, v)
        if quantized and v_offset is not None:
            out = out + p_part.sum(-1, keepdim=True) * v_offset.float()[..., v_order]
    # Each new token weighted by a slice of p: _weighted's view of p's rows over two new tokens (a sink's
    # zero token) had Inductor guard on the stored lengths, and MiMo-V2-Flash's sink layer failed to compile.
    out = out @ v_reading.T + sum(p_new[..., j : j + 1] * v_new[:, :, None, j].float() for j in range(v_new.shape[2]))
    # A row with every key masked gives zeros, as torch's SDPA does; NaN (a poisoned group) propagates.
    out = (out / denom).masked_fill(denom == 0, 0.0)
    return out.reshape(B, Hq, 1, Dv).to(q.dtype)


def _structure(t: torch.Tensor | None):
    # What a graph specialises on besides the token count, an unbacked symbol. A cache's parts are
    # sequence-major (tokens outermost), whose strides do not depend on the length: those, whatever
    # the length (torch calls a part of 0 or 1 rows contiguous too, and it would be a graph of its own).
    # A contiguous tensor's strides follow from its sizes, symbolic with them (a traced graph's cache
    # is a fresh contiguous tensor every step); any other view has its own.
    if t is None:
        return None
    if t.stride(2) >= max(t.stride(0), t.stride(1)):
        strides = t.stride()
    else:
        strides = "contiguous" if t.is_contiguous() else (t.stride()[:2], t.stride()[3:])
    return t.dtype, t.shape[:2], t.shape[3:], strides


def _rows_outermost(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, a second plane, with the strides a longer plane has: one of 0 or 1 rows may have any row
    stride (an op's output has the contiguous one), which would key and guard a graph of its own,
    though no row past the first is ever read. Only planes: restriding the fp tails too (often of 0 or
    1 rows) made a call 3% slower (``benchmarks/sum_chunk_compiles.py``), for no graph saved."""
    if t is None or t.shape[2] > 1:
        return t
    strides = reference.sequence_major_strides(t.shape)
    if (t.stride(0), t.stride(1), *t.stride()[3:]) != (strides[0], strides[1], *strides[3:]):
        return t
    return t.as_strided(t.shape, strides, t.storage_offset())


def _unbacked(t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
    """An alias of ``t`` whose length ``dim`` a graph takes as an unbacked symbol, so that no value of
    it is a guard and one graph serves a structure at every length: Dynamo specialises backed lengths
    of 0 and 1, and Inductor's CPU code sums more than 4,096 floats in chunks and fewer plainly, a
    choice it guards on (two more graphs, seconds each, as a cache passed 4,096 and ~4,160 keys); on
    unbacked lengths it sums plainly at any length. The hint is what Inductor tunes its loops for:
    hinted far off (4,096 for every part), a step ran 1.3-1.6x slower; hinted near this length, as
    fast at any length (``benchmarks/sum_chunk_compiles.py``). The hint is this length rounded up to a
    power of two: Inductor's on-disk cache keys on it, so processes whose first steps differ by a few
    tokens find one another's code (docs/design.md: 4 s from that cache, 10-18 s cold)."""
    if t is None:
        return None
    alias = _alias(t)
    length = t.shape[dim]
    hint = 1 << max(length - 1, 0).bit_length()
    torch._dynamo.decorators.mark_unbacked(alias, dim % t.dim(), hint_override=hint)
    # The mark the model's graphs want on a cache's own tensors (packed._marked_growing), which a graph's
    # guards take only where its trace had it too (an unbacked mark wins the trace): the graph is then
    # called with the cache's tensors themselves, not aliases.
    alias._dynamo_weak_dynamic_indices = {dim % t.dim()}
    return alias


def _alias(t: torch.Tensor | None) -> torch.Tensor | None:
    # A new tensor object over t's memory, not a view of it: marks set on it, or dropped from it, leave
    # t's own, and a graph traced with it takes the cache's tensors themselves (storage_view). Its
    # requires_grad is t's, and whether it is an inference tensor, which a graph guards on (a float mask
    # made from parameters; a cache made under torch.inference_mode() and stepped outside it, or the
    # reverse), where a new tensor would take them from the mode it is made in.
    if t is None:
        return None
    if t.is_inference() == torch.is_inference_mode_enabled():
        return storage_view(t, t.shape, t.stride(), t.storage_offset()).requires_grad_(t.requires_grad)
    with torch.inference_mode(t.is_inference()):
        return _alias(t)


def storage_view(base: torch.Tensor, shape, stride, offset: int) -> torch.Tensor:
    """A tensor over ``base``'s storage with this geometry that is not a view of ``base``. Dynamo
    fakes a view taken in as a graph input through its base (a symbolic ``as_strided`` of the whole
    storage, checked against it and guarded on the base's length), which cost a SmolLM2 decode graph's
    trace a fifth of its time (docs/design.md); a tensor that is no view is faked from its own sizes."""
    return base.new_empty(0).set_(base.untyped_storage(), offset, shape, stride)


def _at_offset_zero(t: torch.Tensor | None) -> torch.Tensor | None:
    # The fp tail (a few dozen tokens at most) and the second planes a graph compiled whole made are
    # views whose storage offset moves as tokens pass through them; Dynamo specialises an offset of 0
    # or 1, so each would compile again when it came round. A copy of a few KiB starts at 0.
    return t if t is None or t.storage_offset() == 0 else t.clone()


def _fused_args(q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale,
                is_causal, k_spec, v_spec, softcap, k_fine_codes, k_fine_scales, v_fine_codes, v_fine_scales, k_head,
                k_offset, v_head, v_offset):  # fmt: skip
    """``(args, key, traced)`` of :func:`_decode_attention` for a decode step's attention, as :func:`_run`
    takes them (``traced()`` the arguments its graph is traced with, lengths marked unbacked), or None
    where the reference computes it."""
    stored = (k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_fine_codes, k_fine_scales,
              v_fine_codes, v_fine_scales)  # fmt: skip
    rest = (k_head, k_offset, v_head, v_offset)
    # A static cache (no new tokens) holds unwritten rows the reference skips by block; is_causal with
    # one query attends only the first key: both stay with the reference.
    if not (fused_attention and q.shape[2] == STEP_TOKENS and k_new.shape[2] in ATTENDED_NEW_TOKENS and not is_causal
            and _takes(q, *stored, k_new, v_new, attn_mask, *rest)):  # fmt: skip
        return None
    k_residual, v_residual, *fine = map(_at_offset_zero, (k_residual, v_residual, *stored[6:]))
    fine = map(_rows_outermost, fine)  # planes grow from 0 rows in a short prompt's decode
    k_fine_codes, k_fine_scales, v_fine_codes, v_fine_scales = fine
    if v_codes is k_codes:
        # A cache read as both K and V (as DeepSeek-V4 reads its): its graph is traced with an alias in
        # each place, and Dynamo guards that a tensor passed twice is passed twice; aliases in V's places
        # keep the call's apart too.
        v_codes, v_scales, v_residual, v_fine_codes, v_fine_scales = map(
            _alias, (v_codes, v_scales, v_residual, v_fine_codes, v_fine_scales))  # fmt: skip
    stored = (k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_fine_codes, k_fine_scales, v_fine_codes,
              v_fine_scales)  # fmt: skip
    k_new, v_new = _step(k_new), _step(v_new)
    k_reading = _reading(q.shape[-1], k_spec, q.device)
    v_reading = _reading(v_new.shape[-1], v_spec, q.device)

    def key():
        # Sinks, offset and the new tokens hold a fixed count of rows, which the graph takes as a constant.
        fixed_rows = [None if t is None else t.shape[2] for t in (*rest, k_new)]
        return (k_spec, v_spec, scale, softcap, *map(_structure, (q, *stored, k_new, v_new, *rest)), *fixed_rows,
                None if attn_mask is None else (attn_mask.dtype, attn_mask.shape[:-1]))  # fmt: skip

    # The sinks a sliding window's eviction leaves carry its unbacked mark (packed._evicted_head), meant
    # for the model's graph; here their count is a constant, as everywhere else: aliases drop the mark.
    k_head, v_head = _alias(k_head), _alias(v_head)

    def args(stored, k_head, v_head, attn_mask):
        return (q, *stored[:6], k_new, v_new, attn_mask, scale, softcap, *stored[6:], k_head, k_offset, v_head,
                v_offset, k_reading, v_reading, k_spec, v_spec)  # fmt: skip

    def traced():
        # Aliases carry the marks: on the cache's own tensors they would reach the model's next graph.
        return args([_unbacked(t, 2) for t in stored], k_head, v_head, _unbacked(attn_mask, -1))

    return args(stored, k_head, v_head, attn_mask), key, traced


def attention(q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale,
              is_causal, k_spec, v_spec, softcap=0.0, k_fine_codes=None, k_fine_scales=None, v_fine_codes=None,
              v_fine_scales=None, k_head=None, k_offset=None, v_head=None, v_offset=None):  # fmt: skip
    """:func:`kvpass.reference.attention`; for a decode step's one query over one new token, fused and
    compiled (within tolerance of the reference, see the module's docstring)."""
    args = (q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale, is_causal,
            k_spec, v_spec, softcap, k_fine_codes, k_fine_scales, v_fine_codes, v_fine_scales, k_head, k_offset, v_head,
            v_offset)  # fmt: skip

    def eager():
        return reference.attention(*args)

    fused = _fused_args(*args)
    return eager() if fused is None else _run(_decode_attention, *fused[:2], eager, fused[2])


def _decode_step(q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale,
                 softcap, k_fine_codes, k_fine_scales, v_fine_codes, v_fine_scales, k_head, k_offset, v_head, v_offset,
                 k_reading, v_reading, k_spec, v_spec, k_query_scales):  # fmt: skip
    q, k_new = reference.read_with_query_scales(q, k_new, k_query_scales)
    out = _decode_attention(
        q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale, softcap,
        k_fine_codes, k_fine_scales, v_fine_codes, v_fine_scales, k_head, k_offset, v_head, v_offset, k_reading,
        v_reading, k_spec, v_spec,
    )  # fmt: skip
    # A sink's zero token (reference.with_sink) is attended, not stored.
    k_new, v_new = k_new[:, :, :STEP_TOKENS], v_new[:, :, :STEP_TOKENS]
    k_stored = reference.encode_refined(k_new.to(k_residual.dtype), k_spec, reference.quantize, k_offset)
    v_stored = reference.encode_refined(v_new.to(v_residual.dtype), v_spec, reference.quantize, v_offset)
    return out, *k_stored, *v_stored


def decode_step(q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale,
                k_spec, v_spec, softcap, k_fine_codes, k_fine_scales, v_fine_codes, v_fine_scales, k_head, k_offset,
                v_head, v_offset, k_query_scales, sink=None):  # fmt: skip
    """:func:`attention` (not causal) and :func:`encode_refined` of ``k_new`` and ``v_new`` in their caches'
    dtypes, with their caches' offsets (an unrefined spec's second planes: 0 rows): ``(out, *k_stored,
    *v_stored)``, ``q`` and ``k_new`` read with K's ``k_query_scales`` first (None: K has none;
    :func:`kvpass.reference.read_with_query_scales`), and an attention ``sink``'s logit read too (None:
    none; :func:`kvpass.reference.with_sink`). A decode step's three are one compiled graph: a
    compiled call's wrappers (Dynamo's, AOT's) cost more than its one token's work (a SmolLM2 step: 30
    calls, not 90; ``docs/bench-decode.md``), and so did the query scales' products made eagerly before
    it. The codes are the reference's bit for bit, as :func:`encode_refined`'s."""

    def apart():
        q_read, k_read = reference.read_with_query_scales(q, k_new, k_query_scales)
        return (attention(q_read, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual,
                          *reference.with_sink(k_read, v_new, attn_mask, sink), scale, False, k_spec, v_spec, softcap,
                          k_fine_codes, k_fine_scales, v_fine_codes, v_fine_scales, k_head, k_offset, v_head, v_offset),
                *encode_refined(k_read.to(k_residual.dtype), k_spec, k_offset),
                *encode_refined(v_new.to(v_residual.dtype), v_spec, v_offset))  # fmt: skip

    # One new token, as before the fused attention took two: the compiled quantization is checked bit for
    # bit on single tokens (encode_refined compiles no other), and kvpass calls this op with one only.
    # A sink's zero token goes in eagerly, as the fused attention takes it from the model's graph.
    k_read, v_read, read_mask = reference.with_sink(k_new, v_new, attn_mask, sink)
    fused = _takes(k_query_scales, sink) and k_new.shape[2] == STEP_TOKENS and _fused_args(
        q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_read, v_read, read_mask, scale, False,
        k_spec, v_spec, softcap, k_fine_codes, k_fine_scales, v_fine_codes, v_fine_scales, k_head, k_offset, v_head,
        v_offset,
    )  # fmt: skip
    if not fused:
        return apart()
    args, key, traced = fused
    return _run(_decode_step, (*args, k_query_scales), lambda: (key(), _structure(k_query_scales)), apart,
                lambda: (*traced(), k_query_scales))
