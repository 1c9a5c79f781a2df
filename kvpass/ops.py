"""The ``kv4::`` custom ops: the only places where KV numerics run.

One op name per operation for every device: the FX pass emits these and never branches
on device. CPU runs :mod:`kvpass.reference` (a decode step's quantization and attention compiled
by Inductor, :mod:`kvpass.cpu_steps`); CUDA runs the Triton kernels of
``kvpass.kernels`` when Triton is importable, else the same reference (which also serves
specs whose groups span heads, ``QuantSpec.span_heads``: test-size heads only).
``kv4::decode_step`` is a layer's decode attention and both appends' quantization in one op: on
CPU one compiled graph, on CUDA the other ops' kernels in turn.

A :class:`~kvpass.config.QuantSpec` crosses the op boundary as six scalars
(``bits, scheme, group, rotate, symmetric, span_heads``) because custom-op schemas take no
dataclasses; the ops that quantize take ``clip`` after them (:func:`codec_args`), the
ones that only read do not need it (a clipped scale decodes like any other). An asymmetric
spec's zero points travel inside ``scales`` (a trailing dimension of 2, see
:mod:`kvpass.reference`), so the tensor arguments are the same for both.
"""

from __future__ import annotations

import functools
import logging

import torch

from kvpass import cpu_steps, reference
from kvpass.config import QuantSpec

log = logging.getLogger("kvpass")


SPEC_ARGS = 6  # scalars per QuantSpec in an op's arguments


def spec_args(spec: QuantSpec) -> tuple[int, str, int, bool, bool, bool]:
    """What reading a stored ``spec`` needs (``dequantize``, ``attention``)."""
    return spec.bits, spec.scheme, spec.group, spec.rotate, spec.symmetric, spec.span_heads


def codec_args(spec: QuantSpec) -> tuple[int, str, int, bool, bool, bool, bool]:
    """What writing ``spec`` needs (``quantize``, ``write_``): the layout and how scales are chosen."""
    return (*spec_args(spec), spec.clip)


# One object per spec, made once: an op builds its specs at every call, and a SmolLM2 decode step
# makes 60 (docs/bench-decode.md). Typed: True and 1 are equal keys, but only one is a valid field.
@functools.lru_cache(maxsize=None, typed=True)
def _spec(bits, scheme, group, rotate, symmetric, span_heads, **more) -> QuantSpec:
    """The :class:`QuantSpec` of :func:`spec_args` (and ``more`` of its fields)."""
    return QuantSpec(bits, scheme, group, rotate, symmetric, span_heads=span_heads, **more)


@functools.lru_cache(maxsize=None)
def _triton_kernels():
    try:
        from kvpass import kernels

        kernels.quantize, kernels.attention  # noqa: B018 - fail here if the launchers are absent
        return kernels
    except (ImportError, AttributeError) as err:
        log.warning("kvpass: Triton kernels unavailable (%s); CUDA tensors use the torch reference", err)
        return None


def _kernels_for(*specs: QuantSpec):
    """The Triton kernels, or None where the reference serves these specs (groups over whole heads)."""
    return None if any(spec.span_heads for spec in specs) else _triton_kernels()


def _quantizer_for(spec: QuantSpec):
    """The Triton quantizer where it serves ``spec``, else :func:`kvpass.reference.quantize`."""
    kernels = _kernels_for(spec)
    return reference.quantize if kernels is None else kernels.quantize


# --- quantize --------------------------------------------------------------------------


def _quantize_on_cpu(
    x: torch.Tensor, bits: int, scheme: str, group: int, rotate: bool, symmetric: bool, span_heads: bool, clip: bool,
    offset: torch.Tensor | None = None, rounding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Stored form of ``x [B, H, S, D]``: ``(codes, scales)`` (see :mod:`kvpass.reference`);
    a centered spec passes its stored-domain ``offset [B, H, 1, D]``, a query-rounded one its
    append's ``rounding`` (:func:`kvpass.reference.rounding_coefficients`)."""
    spec = _spec(bits, scheme, group, rotate, symmetric, span_heads, clip=clip)
    return cpu_steps.encode(x.contiguous(), spec, offset, rounding)


quantize = torch.library.custom_op("kv4::quantize", _quantize_on_cpu, mutates_args=())


def _stored_like(x: torch.Tensor, bits: int, scheme: str, group: int, rotate: bool, symmetric: bool, span_heads: bool):
    """Empty ``(codes, scales)`` shaped as :func:`quantize` returns them for ``x``."""
    B, H, S, D = x.shape
    codes = x.new_empty((B, H, S, D * bits // 8), dtype=torch.uint8)
    spec = _spec(bits, scheme, group, rotate, symmetric, span_heads)
    if span_heads:
        scales_shape = (B, H // spec.heads_per_group(H, D), S, 1)
    elif scheme == "token":
        scales_shape = (B, H, S, D // spec.token_group(D))
    else:
        scales_shape = (B, H, S // group, D)
    if not symmetric:
        scales_shape = (*scales_shape, 2)  # (scale, zero point)
    return codes, x.new_empty(scales_shape, dtype=reference.scale_dtype(spec, H, D))


@quantize.register_fake
def _(x, bits, scheme, group, rotate, symmetric, span_heads, clip, offset=None, rounding=None):
    return _stored_like(x, bits, scheme, group, rotate, symmetric, span_heads)


@quantize.register_kernel("cuda")
def _quantize_on_cuda(x, bits, scheme, group, rotate, symmetric, span_heads, clip, offset=None, rounding=None):
    spec = _spec(bits, scheme, group, rotate, symmetric, span_heads, clip=clip)
    return reference.encode(x.contiguous(), spec, offset, _quantizer_for(spec), rounding)


# --- quantize with a second code plane ----------------------------------------------------


def _quantize_refined_on_cpu(
    x: torch.Tensor, bits: int, scheme: str, group: int, rotate: bool, symmetric: bool, span_heads: bool, clip: bool,
    refine: int,
    offset: torch.Tensor | None = None, rounding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`quantize` of new tokens ``x [B, H, T, D]`` and the second code plane
    (``QuantSpec.refine``) of the newest ``min(T, refine)``: ``(codes, scales, fine_codes, fine_scales)``.
    One op, not four: a decode step appends one token, and each op call costs more than its work."""
    spec = _spec(bits, scheme, group, rotate, symmetric, span_heads, clip=clip, refine=refine)
    return cpu_steps.encode_refined(x.contiguous(), spec, offset, rounding)


quantize_refined = torch.library.custom_op("kv4::quantize_refined", _quantize_refined_on_cpu, mutates_args=())


def _refined_like(x: torch.Tensor, bits: int, scheme: str, group: int, rotate: bool, symmetric: bool,
                  span_heads: bool, clip: bool, refine: int):  # fmt: skip
    """Empty ``(codes, scales, fine_codes, fine_scales)`` shaped as :func:`quantize_refined` returns them."""
    T = x.shape[2]
    newest = x[:, :, T - torch.sym_min(T, refine) :]
    layout = (bits, scheme, group, rotate, symmetric, span_heads)
    return *_stored_like(x, *layout), *_stored_like(newest, *layout)


@quantize_refined.register_fake
def _(x, bits, scheme, group, rotate, symmetric, span_heads, clip, refine, offset=None, rounding=None):
    return _refined_like(x, bits, scheme, group, rotate, symmetric, span_heads, clip, refine)


@quantize_refined.register_kernel("cuda")
def _quantize_refined_on_cuda(x, bits, scheme, group, rotate, symmetric, span_heads, clip, refine, offset=None,
                              rounding=None):  # fmt: skip
    spec = _spec(bits, scheme, group, rotate, symmetric, span_heads, clip=clip, refine=refine)
    if not refine:  # a plane of 0 rows: quantize's launch alone
        layout = (bits, scheme, group, rotate, symmetric, span_heads)
        return *quantize(x, *layout, clip, offset, rounding), *_stored_like(x[:, :, :0], *layout)
    kernels = _kernels_for(spec)
    if kernels is not None and scheme == "token" and symmetric:
        # The codes and the plane in one launch: a decode step's append pays launches, not work.
        return kernels.quantize_refined(reference.stored_form(x, spec, offset), spec, rounding)
    return reference.encode_refined(x.contiguous(), spec, _quantizer_for(spec), offset, rounding)


# --- write (static caches) -------------------------------------------------------------


@torch.library.custom_op("kv4::write_", mutates_args=("codes", "scales"))
def write_(
    codes: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, x: torch.Tensor,
    bits: int, scheme: str, group: int, rotate: bool, symmetric: bool, span_heads: bool, clip: bool,
) -> None:  # fmt: skip
    """Quantize ``x [B, H, T, D]`` into token slots ``index`` of a preallocated per-token cache."""
    new_codes, new_scales = quantize(x, bits, scheme, group, rotate, symmetric, span_heads, clip)
    codes.index_copy_(2, index, new_codes)
    scales.index_copy_(2, index, new_scales)


@write_.register_fake
def _(codes, scales, index, x, bits, scheme, group, rotate, symmetric, span_heads, clip):
    return None


# --- rotate ---------------------------------------------------------------------------


@torch.library.custom_op("kv4::rotate", mutates_args=())
def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` over the last dimension (:func:`kvpass.reference.rotate`), its own inverse."""
    # An op, not inline torch code, so tracing never meets the cached Hadamard constant.
    # Contiguous whatever x's layout (the matmul would follow it), as the fake kernel says.
    return reference.rotate(x).contiguous()


@rotate.register_fake
def _(x):
    return x.new_empty(x.shape)  # contiguous, as the matmul that computes it


# --- dequantize ------------------------------------------------------------------------


@torch.library.custom_op("kv4::dequantize", mutates_args=())
def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    residual: torch.Tensor,
    bits: int,
    scheme: str,
    group: int,
    rotate: bool,
    symmetric: bool,
    span_heads: bool,
    fine_codes: torch.Tensor | None = None,
    fine_scales: torch.Tensor | None = None,
    head: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole logical ``[B, H, S, D]`` tensor; used only off the hot path."""
    spec = _spec(bits, scheme, group, rotate, symmetric, span_heads)
    return reference.decode(codes, scales, residual, spec, residual.dtype, fine_codes, fine_scales, head, offset)


@dequantize.register_fake
def _(codes, scales, residual, bits, scheme, group, rotate, symmetric, span_heads, fine_codes=None, fine_scales=None,
      head=None, offset=None):  # fmt: skip
    B, H, S, _ = codes.shape
    n_head = 0 if head is None else head.shape[2]
    return residual.new_empty((B, H, n_head + S + residual.shape[2], residual.shape[3]))


# --- attention -------------------------------------------------------------------------


def _attention_on_cpu(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    k_residual: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    v_residual: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    k_bits: int,
    k_scheme: str,
    k_group: int,
    k_rotate: bool,
    k_symmetric: bool,
    k_span_heads: bool,
    v_bits: int,
    v_scheme: str,
    v_group: int,
    v_rotate: bool,
    v_symmetric: bool,
    v_span_heads: bool,
    softcap: float = 0.0,
    k_fine_codes: torch.Tensor | None = None,
    k_fine_scales: torch.Tensor | None = None,
    v_fine_codes: torch.Tensor | None = None,
    v_fine_scales: torch.Tensor | None = None,
    k_head: torch.Tensor | None = None,
    k_offset: torch.Tensor | None = None,
    v_head: torch.Tensor | None = None,
    v_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA over ``[stored past, exact new tokens]``; see :func:`kvpass.reference.attention` (on CPU a
    decode step's runs fused, :func:`kvpass.cpu_steps.attention`). ``*_fine_*``: the second code
    plane of a refined spec (``QuantSpec.refine``), if any; ``*_head``: fp sinks
    (``QuantSpec.sinks``); ``*_offset``: a centered spec's offset."""
    return cpu_steps.attention(
        q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale, is_causal,
        _spec(k_bits, k_scheme, k_group, k_rotate, k_symmetric, k_span_heads),
        _spec(v_bits, v_scheme, v_group, v_rotate, v_symmetric, v_span_heads), softcap,
        k_fine_codes, k_fine_scales, v_fine_codes, v_fine_scales, k_head, k_offset, v_head, v_offset,
    )  # fmt: skip


attention = torch.library.custom_op("kv4::attention", _attention_on_cpu, mutates_args=())


@attention.register_fake
def _(q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale, is_causal, *rest):
    return q.new_empty((*q.shape[:-1], v_new.shape[-1]))


@attention.register_kernel("cuda")
def _attention_on_cuda(q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale,
                       is_causal, *rest):  # fmt: skip
    n = SPEC_ARGS
    # A registered kernel gets the arguments as called, the schema's defaults not filled in.
    k_spec, v_spec = _spec(*rest[:n]), _spec(*rest[n : 2 * n])
    softcap, *extra = rest[2 * n :] or (0.0,)
    kernels = _kernels_for(k_spec, v_spec)
    run = kernels.attention if kernels is not None else reference.attention
    return run(
        q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale, is_causal,
        k_spec, v_spec, softcap, *extra,
    )  # fmt: skip


# --- a decode step: attention and both appends' quantization ----------------------------------


def refined_codec_args(spec: QuantSpec) -> tuple[int, str, int, bool, bool, bool, bool, int]:
    """What :func:`quantize_refined` and :func:`decode_step` take to write ``spec``: :func:`codec_args`
    and ``refine`` (0: no second plane)."""
    return (*codec_args(spec), spec.refine)


def _decode_step_on_cpu(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    k_residual: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    v_residual: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    k_bits: int,
    k_scheme: str,
    k_group: int,
    k_rotate: bool,
    k_symmetric: bool,
    k_span_heads: bool,
    k_clip: bool,
    k_refine: int,
    v_bits: int,
    v_scheme: str,
    v_group: int,
    v_rotate: bool,
    v_symmetric: bool,
    v_span_heads: bool,
    v_clip: bool,
    v_refine: int,
    softcap: float,
    k_fine_codes: torch.Tensor,
    k_fine_scales: torch.Tensor,
    v_fine_codes: torch.Tensor,
    v_fine_scales: torch.Tensor,
    k_head: torch.Tensor | None,
    k_offset: torch.Tensor | None,
    v_head: torch.Tensor | None,
    v_offset: torch.Tensor | None,
    k_query_scales: torch.Tensor | None,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:  # fmt: skip
    """One decode step of a layer whose K and V are quantized a token at a time (``QuantSpec.tokens_apart``):
    :func:`attention` over the stored past and the new tokens (not causal), and :func:`quantize_refined`
    of each new token in its cache's dtype with its cache's offset (``refine`` 0: no second plane, 0 rows
    of it): ``(out, *k_stored, *v_stored)``, each four tensors. A query-scaled K's scales
    (``k_query_scales``, else None) divide ``q`` and multiply ``k_new`` first, as attention reads a stored
    key and an append stores one (:func:`kvpass.reference.read_with_query_scales`). ``sink`` (``[B, H, T,
    1]``, else None): one more logit per row, which attention reads and nothing stores
    (:func:`kvpass.reference.with_sink`).
    One op, not three: the work is one token's, and on CPU each call costs more than its work
    (:func:`kvpass.cpu_steps.decode_step` compiles the three as one graph)."""
    return cpu_steps.decode_step(
        q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale,
        _spec(k_bits, k_scheme, k_group, k_rotate, k_symmetric, k_span_heads, clip=k_clip, refine=k_refine),
        _spec(v_bits, v_scheme, v_group, v_rotate, v_symmetric, v_span_heads, clip=v_clip, refine=v_refine), softcap,
        k_fine_codes, k_fine_scales, v_fine_codes, v_fine_scales, k_head, k_offset, v_head, v_offset, k_query_scales,
        sink,
    )  # fmt: skip


decode_step = torch.library.custom_op("kv4::decode_step", _decode_step_on_cpu, mutates_args=())

_REFINED_ARGS = SPEC_ARGS + 2  # a spec's scalars in decode_step: spec_args, clip, refine


@decode_step.register_fake
def _(q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale, *rest):
    n = _REFINED_ARGS
    k_args, v_args = rest[:n], rest[n : 2 * n]
    return q.new_empty((*q.shape[:-1], v_new.shape[-1])), *_refined_like(k_new, *k_args), *_refined_like(v_new, *v_args)


@decode_step.register_kernel("cuda")
def _decode_step_on_cuda(q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask,
                         scale, *rest):  # fmt: skip
    n = _REFINED_ARGS
    k_args, v_args, tail = rest[:n], rest[n : 2 * n], rest[2 * n :]
    # softcap, the 4 second-plane tensors, the fp heads and offsets, K's query scales, an attention sink if given
    softcap, planes, (k_head, k_offset, v_head, v_offset, k_query_scales), sink = (
        tail[0], tail[1:5], tail[5:10], tail[10] if len(tail) > 10 else None
    )  # fmt: skip
    q, k_new = reference.read_with_query_scales(q, k_new, k_query_scales)
    k_read, v_read, attn_mask = reference.with_sink(k_new, v_new, attn_mask, sink)
    out = attention(q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_read, v_read, attn_mask, scale,
                    False, *k_args[:SPEC_ARGS], *v_args[:SPEC_ARGS], softcap, *planes, k_head, k_offset, v_head,
                    v_offset)  # fmt: skip
    k_stored = quantize_refined(k_new.to(k_residual.dtype), *k_args, k_offset)
    v_stored = quantize_refined(v_new.to(v_residual.dtype), *v_args, v_offset)
    return out, *k_stored, *v_stored


# --- calls from eager code ----------------------------------------------------------------

# The kernel each op runs on CPU (its default), for call().
_CPU_KERNELS = {quantize: _quantize_on_cpu, quantize_refined: _quantize_refined_on_cpu, attention: _attention_on_cpu,
                decode_step: _decode_step_on_cpu}


def call(op, *args):
    """``op(*args)``, as :class:`~kvpass.packed.PackedKV` calls the ops a decode step makes. Where the
    dispatcher would only hand the call to the op's CPU kernel (plain CPU tensors, none requiring
    grad, no trace, dispatch mode or torch-function mode), the kernel is called directly: the
    dispatcher's Python layers (autograd, backend, a Dynamo-disable context, an aliasing check) cost
    ~50 us a call, and a SmolLM2 decode step makes 30 of them (one ``decode_step`` a layer). Traced,
    fake and checked calls (``opcheck``) reach the op, and so does a tensor requiring grad, whose
    output the op marks as having no backward (the kernel alone would record the reference's autograd
    graph)."""
    kernel = _CPU_KERNELS.get(op)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if (kernel is not None and not torch._C._is_torch_function_mode_enabled()
            and not any(t.requires_grad for t in tensors) and cpu_steps.untraced_cpu(*tensors)):  # fmt: skip
        return kernel(*args)
    return op(*args)
