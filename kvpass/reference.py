"""Reference numerics: the specification every kernel is tested against.

Group quantization, ``bits`` in {2, 4, 8}, symmetric (the default) or asymmetric.

Symmetric (``spec.symmetric``):

* per group ``scale = fp16(amax / qmax)`` (``qmax = 7`` for int4), and
  ``code = clamp(round(x / scale), -qmax, qmax)``, both with the fp16-rounded scale;
  ``x ~ code * scale``;
* ``spec.clip``: the scale is instead the candidate ``sign * fp16(amax / t)``, ``t`` in
  :func:`clip_divisors` and ``sign`` in (+1, -1) (in that order), whose codes
  ``clamp(round(x / scale), -(qmax + 1), qmax)`` give the least squared error
  ``sum(round((code * scale - x)**2 / amax**2 * 2**20))`` (ties: the earlier candidate). A
  negative scale puts the group's largest element on the extra code ``-(qmax + 1)``;
* codes are stored offset by ``2**(bits-1)`` as unsigned fields, ``8 // bits`` per byte,
  lowest field first, packed along the head dimension;
* an all-zero group has scale 0 and decodes to exact zeros;
* a group whose ``amax / qmax`` underflows fp16 (``amax < 7 * 2**-25`` for int4) is
  flushed to zero: the error is still below the group's ``amax``;
* a group holding NaN or +-inf gets a NaN scale and decodes to all-NaN, so a non-finite
  input is never hidden behind finite numbers (no host sync is needed to detect it); a NaN
  element's code is 0 (its stored field ``2**(bits-1)``).

Asymmetric (``not spec.symmetric``), ``Q = 2**bits - 1`` (15 for int4):

* per group ``scale = fp16((max - min) / Q)`` (the difference and the division in fp32) and
  zero point ``zero = fp16(min)``; ``code = clamp(round((x - zero) / scale), 0, Q)``, with
  the fp16-rounded scale and zero point, all in fp32; ``x ~ code * scale + zero``;
* codes are unsigned, stored as they are (no offset) in the same packed fields;
* a group whose ``(max - min) / Q`` is 0 in fp16 (all-equal, or a range under
  ``Q * 2**-25``) has scale 0 and codes 0, and decodes to its zero point ``fp16(min)``:
  exactly the group's value when all are equal and fp16-representable;
* a group holding NaN or +-inf, or whose scale or zero point overflows fp16 (only
  possible for bf16/fp32 inputs), gets NaN scale and zero point and codes 0, and decodes
  to all-NaN.

The error of every finite element is at most ``scale / 2`` plus the fp16 rounding of the
scale, plus (asymmetric) the fp16 rounding of the zero point (:func:`error_bound`).

Layouts (``B`` batch, ``H`` KV heads, ``S`` tokens, ``D`` head_dim, ``g`` the group):

* codes, both schemes: ``uint8 [B, H, S, D * bits // 8]``
* scales, ``scheme="token"``: ``fp16 [B, H, S, D // g]``
* scales, ``scheme="token"`` with ``span_heads``: ``fp16 [B, H // n, S, 1]``, one group per token
  over all channels of ``n = spec.heads_per_group(H, D)`` consecutive heads; where that is still
  under 16 values (one KV head of 8 channels), symmetric scales are 8-bit, ``float8_e5m2`` numbers
  held as ``uint8`` (:func:`scale_dtype`, :func:`scale_values`): everything above holds with that
  format in place of fp16
* scales, ``scheme="channel"``: ``fp16 [B, H, S // g, D]`` (S a multiple of g)
* asymmetric: the scales tensor gains a trailing dimension of 2, ``[..., 0]`` the scale and
  ``[..., 1]`` the zero point: ``fp16 [B, H, S, D // g, 2]`` or ``fp16 [B, H, S // g, D, 2]``.
  Everything that slices, concatenates or indexes the cache along B or S treats both
  forms alike, and the custom ops keep one ``scales`` argument either way.
* fp sinks (``spec.sinks``): ``[B, H, S_h, D]`` in 16 bits (:func:`sink_dtype`), stored domain,
  the first tokens of the cache, before the codes; a centered spec's offset (``spec.center``, see
  :func:`center_offset`): ``fp16 [B, H, 1, D]`` (``[B, H, 0, D]``: none), subtracted before
  quantizing, added back to every dequantized code (second plane included).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from kvpass.config import CENTER_SKIP, MIN_HEAD_GROUP, QuantSpec

SCALE_DTYPE = torch.float16
# Query scales stay within this factor of their geometric mean (fp16 holds them exactly enough).
QUERY_SCALE_RANGE = 64.0
# Scales of groups narrower than MIN_HEAD_GROUP values (one KV head of 8 channels, nothing to
# span) are float8_e5m2 numbers: fp16's sign, exponent and top two mantissa bits. An fp16 scale per
# 8 values would cost 2 bits per value; this one costs 1, with fp16's range and a step up to 25%
# coarser. They are held as their bits in uint8, which torch's CPU kernels (gather, index_copy) and
# opcheck's comparisons support and float8 does not; :func:`scale_values` reads either kind.
NARROW_SCALE_DTYPE = torch.uint8
_NARROW_SCALE_FORMAT = torch.float8_e5m2


def _made_once(make):
    """``make`` (a small tensor from hashable arguments) cached in a plain dict. A graph compiled
    from a caller (:mod:`kvpass.cpu_steps`) then takes the cached tensor as an input: Dynamo traces
    through an ``lru_cache``, which would redo the making inside every call of the compiled code."""
    made = {}

    def cached(*args):
        if args not in made:
            made[args] = make(*args)
        return made[args]

    return cached


def scale_dtype(spec: QuantSpec, heads: int, head_dim: int) -> torch.dtype:
    """The dtype of ``spec``'s stored scales for ``heads`` KV heads of ``head_dim`` channels: fp16,
    or ``NARROW_SCALE_DTYPE`` (8-bit scales) for symmetric groups spanning whole heads that still
    hold fewer than ``MIN_HEAD_GROUP`` values."""
    narrow = spec.span_heads and spec.symmetric and spec.heads_per_group(heads, head_dim) * head_dim < MIN_HEAD_GROUP
    return NARROW_SCALE_DTYPE if narrow else SCALE_DTYPE


def scale_bits(spec: QuantSpec, heads: int, head_dim: int) -> int:
    """Bits stored once per group: a scale (:func:`scale_dtype`), and a zero point if asymmetric."""
    return scale_dtype(spec, heads, head_dim).itemsize * 8 * (1 if spec.symmetric else 2)


def scale_span(spec: QuantSpec, heads: int, head_dim: int) -> int:
    """Values sharing one scale: channels of a token (in one head, or in several), or tokens of a channel."""
    if spec.scheme != "token":
        return spec.group
    return spec.heads_per_group(heads, head_dim) * head_dim if spec.span_heads else spec.token_group(head_dim)


def bits_per_value(spec: QuantSpec, heads: int, head_dim: int) -> float:
    """Stored bits of one quantized value under ``spec`` (one plane): its code and its share of its
    group's scale and zero point."""
    return spec.bits + scale_bits(spec, heads, head_dim) / scale_span(spec, heads, head_dim)


def _stored_scales(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``values`` rounded to the nearest scale of stored ``dtype``."""
    if dtype == NARROW_SCALE_DTYPE:
        return values.to(_NARROW_SCALE_FORMAT).view(NARROW_SCALE_DTYPE)
    return values.to(dtype)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """Stored scales (or zero points) as fp32 numbers."""
    if scales.dtype == NARROW_SCALE_DTYPE:
        return scales.view(_NARROW_SCALE_FORMAT).float()
    return scales.float()


# --- packing ---------------------------------------------------------------------------


def code_offset(bits: int, symmetric: bool) -> int:
    """What a stored code is offset by: a signed (symmetric) code by ``2**(bits-1)``, an unsigned one by 0."""
    return 1 << (bits - 1) if symmetric else 0


def pack_codes(codes: torch.Tensor, bits: int, symmetric: bool = True) -> torch.Tensor:
    """Integer codes ``[..., D]`` -> ``uint8 [..., D * bits // 8]``.

    Symmetric codes are signed and stored offset by ``2**(bits-1)``; asymmetric codes are
    unsigned (``0..2**bits - 1``) and stored as they are.
    """
    per_byte = 8 // bits
    if codes.shape[-1] % per_byte:
        raise ValueError(f"head_dim {codes.shape[-1]} must be a multiple of {per_byte} to pack {bits}-bit codes")
    # Two's complement wraps a signed code into its field; flipping the top bit adds the offset.
    unsigned = codes.to(torch.uint8)
    if bits < 8:
        unsigned = unsigned & ((1 << bits) - 1)
    if symmetric:
        unsigned = unsigned ^ code_offset(bits, symmetric)
    fields = unsigned.unflatten(-1, (-1, per_byte))
    packed = fields[..., 0]
    for i in range(1, per_byte):
        packed = packed | (fields[..., i] << (bits * i))
    return packed


def _field(packed: torch.Tensor, bits: int, i: int) -> torch.Tensor:
    """Field ``i`` (lowest first) of every byte of ``packed``."""
    shifted = packed >> (bits * i) if i else packed
    return shifted if bits * (i + 1) == 8 else shifted & ((1 << bits) - 1)  # the top field needs no mask


def unpack_codes(packed: torch.Tensor, bits: int, symmetric: bool = True) -> torch.Tensor:
    """``uint8 [..., D * bits // 8]`` -> signed ``int8 [..., D]`` (symmetric) or the
    unsigned fields as ``uint8 [..., D]`` (asymmetric)."""
    unsigned = torch.stack([_field(packed, bits, i) for i in range(8 // bits)], dim=-1).flatten(-2)
    if not symmetric:
        return unsigned
    return (unsigned.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def _unpacked_float(packed: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """:func:`unpack_codes` as float32 (small integers are exact in it), each field converted as it
    is written: fewer passes over a block than unpacking and then converting."""
    per_byte = 8 // bits
    out = torch.empty((*packed.shape, per_byte), device=packed.device)
    for i in range(per_byte):
        out[..., i].copy_(_field(packed, bits, i))
    out = out.flatten(-2)
    return out.sub_(code_offset(bits, symmetric)) if symmetric else out


# --- scales ----------------------------------------------------------------------------


@_made_once
def _divisor(n: int, device: torch.device) -> torch.Tensor:
    # A tensor, not a number: CUDA divides by a host number as a multiply by its reciprocal, and
    # that quotient (one fp32 ulp off now and then) can round to another fp16 scale than the exact
    # one, which the CPU and the kernels compute (seen on an H200: 1 scale in 24000, fp32 input).
    return torch.tensor(float(n), device=device)


def _group_scale(amax: torch.Tensor, qmax: int, dtype: torch.dtype) -> torch.Tensor:
    scale = amax.float() / _divisor(qmax, amax.device)
    return _stored_scales(torch.where(torch.isfinite(amax), scale, float("nan")), dtype)


def _codes_from(x: torch.Tensor, scale: torch.Tensor, code_min: int, code_max: int) -> torch.Tensor:
    """Codes of ``x`` with stored ``scale`` (broadcast to it)."""
    scale = scale_values(scale)
    safe = torch.where((scale == 0) | scale.isnan(), 1.0, scale)
    # NaN's code is 0 by definition: converting NaN to an integer is undefined in C, and compilers differ.
    return torch.round(x.float() / safe).nan_to_num_(0.0).clamp_(code_min, code_max).to(torch.int8)


def clip_divisors(qmax: int) -> tuple[float, ...]:
    """The ``t`` of the scales ``+-fp16(amax / t)`` a ``clip`` spec tries, in the order tried.

    ``qmax`` (absmax, no clipping) up to ``1.5 qmax + 0.5`` in eight steps: 7 to 10.5 for int4.
    """
    step = (qmax + 1) / 16
    return tuple(qmax + k * step for k in range(8))


# Squared errors are compared in units of amax**2 / 2**20, rounded to integers, so the sum over
# a group is exact and the choice cannot depend on the order a kernel adds them in.
CLIP_ERROR_UNIT = 2.0**20
# Elements of the [groups, candidates, group size] error tensor built at once: its few fp32
# temporaries stay near 0.5 MiB each (a prefill chunk at 2**22 held over 100 MiB at its peak).
CLIP_SLICE_ELEMENTS = 2**17


def _clipped(groups: torch.Tensor, dim: int, qmax: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, codes)``: the scale per group (``dim`` reduced), in ``dtype``, with the least squared
    error on the grid ``-(qmax+1)..qmax`` (the first candidate wins a tie), and the groups' codes under
    it (as :func:`_codes_from` gives them, still fp32), which the search has already computed."""
    x = groups.float().movedim(dim, -1)
    rows = x.reshape(-1, x.shape[-1])
    # All candidates of a row at once (a decode step quantizes a handful of groups, and one
    # op per candidate would cost more than the quantization), in slices that bound memory.
    per_slice = max(1, CLIP_SLICE_ELEMENTS // (2 * len(clip_divisors(qmax)) * rows.shape[-1]))
    parts = rows.split(per_slice)
    if len(parts) > 1:
        scale, codes = (torch.cat(chosen) for chosen in zip(*(_least_error_scale(part, qmax, dtype) for part in parts)))
    else:
        scale, codes = _least_error_scale(rows, qmax, dtype)
    return scale.reshape(x.shape[:-1]), codes.reshape(x.shape).movedim(-1, dim)


@_made_once
def _signed_divisors(qmax: int, device: torch.device) -> torch.Tensor:
    # [t0, -t0, t1, -t1, ...]: amax / -t is exactly -(amax / t), so one division gives every
    # candidate in the order tried. Cached: a decode step quantizes a few groups, and building
    # this per call cost as much as using it.
    return torch.tensor([sign * t for t in clip_divisors(qmax) for sign in (1.0, -1.0)], device=device)


def _least_error_scale(rows: torch.Tensor, qmax: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows [N, g]`` (fp32) -> the chosen scale per row, ``[N]`` in ``dtype``, and the rows'
    codes under it, ``[N, g]`` fp32."""
    amax = rows.abs().amax(-1, keepdim=True)
    finite = torch.isfinite(amax)
    unit = torch.where(finite & (amax != 0), amax, 1.0)
    candidates = scale_values(_stored_scales(amax / _signed_divisors(qmax, rows.device), dtype))  # [N, candidates]
    # A zero candidate and a non-finite row's divide by one, as _codes_from's zero or NaN scale
    # does, so the chosen candidate's codes are the codes (a non-finite row's are the same for all).
    divisor = torch.where((candidates != 0) & finite, candidates, 1.0)[:, :, None]
    codes = torch.round(rows[:, None, :] / divisor).nan_to_num_(0.0).clamp_(-qmax - 1, qmax)  # NaN: as _codes_from
    # code * scale is exact in fp32, so the error is one rounding, as a kernel's fma gives.
    e = torch.where(finite[:, :, None], (codes * candidates[:, :, None] - rows[:, None, :]) / unit[:, :, None], 0.0)
    units = (e * e * CLIP_ERROR_UNIT + 0.5).floor_()
    chosen = units.to(torch.int64).sum(-1).argmin(-1, keepdim=True)  # argmin: the first of equal minima
    best = candidates.gather(1, chosen).squeeze(1)
    chosen_codes = codes.gather(1, chosen[:, :, None].expand(-1, 1, codes.shape[-1])).squeeze(1)
    return _stored_scales(torch.where(finite.squeeze(1), best, float("nan")), dtype), chosen_codes


def _asym_params(lo: torch.Tensor, hi: torch.Tensor, non_finite: torch.Tensor, code_max: int):
    """``(scale, zero)`` of asymmetric groups with minimum ``lo`` and maximum ``hi``."""
    # -0.0 becomes +0.0, so the stored bits do not depend on which zero a reduction picked.
    lo = torch.where(lo == 0, 0.0, lo.float())
    hi = torch.where(hi == 0, 0.0, hi.float())
    scale = ((hi - lo) / _divisor(code_max, hi.device)).to(SCALE_DTYPE)
    zero = lo.to(SCALE_DTYPE)
    bad = non_finite | ~torch.isfinite(scale) | ~torch.isfinite(zero)
    nan = torch.full_like(scale, float("nan"))
    return torch.where(bad, nan, scale), torch.where(bad, nan, zero)


def _asym_codes_from(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, code_max: int) -> torch.Tensor:
    empty = (scale == 0) | scale.isnan()  # flushed or poisoned: codes 0
    safe = torch.where(empty, torch.ones_like(scale), scale).float()
    safe_zero = torch.where(empty, torch.zeros_like(zero), zero).float()
    codes = torch.clamp(torch.round((x.float() - safe_zero) / safe), 0, code_max)
    return torch.where(empty, torch.zeros_like(codes), codes).to(torch.uint8)


def _ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of stored scales' (or zero points') numbers at ``|v|``: the smallest subnormal
    (``2**-24`` for fp16) in the subnormal range and at 0."""
    info = torch.finfo(_NARROW_SCALE_FORMAT if v.dtype == NARROW_SCALE_DTYPE else v.dtype)
    smallest = info.tiny * info.eps
    a = scale_values(v).abs()
    return torch.where(
        a > 0,
        (torch.exp2(torch.floor(torch.log2(a.clamp_min(smallest)))) * info.eps).clamp_min(smallest),
        torch.full_like(a, smallest),
    )


def error_bound(scale: torch.Tensor, spec: QuantSpec, zero: torch.Tensor | None = None) -> torch.Tensor:
    """Largest |x - dequantize(quantize(x))| for a finite element of a group with ``scale``
    (and, asymmetric, zero point ``zero``, which is then required).

    Symmetric: round-to-nearest gives ``scale / 2``; rounding ``amax / qmax`` to fp16 can
    push ``amax`` up to ``qmax * ulp(scale) / 2`` past the top code, which then clamps. A
    flushed group (scale 0) has ``amax / qmax`` below half the smallest fp16 subnormal.

    Asymmetric, ``Q = 2**bits - 1``, exact ``lo``/``hi`` the group's min/max, ``s`` and ``z``
    the stored (fp16-rounded) scale and zero point, so ``|s - (hi - lo) / Q| <= ulp(s) / 2``
    and ``|z - lo| <= ulp(z) / 2``. For ``x`` in ``[lo, hi]``:

    * unclamped code: ``|x - (code * s + z)| <= s / 2`` whatever ``z`` is;
    * clamped to 0 (``x < z - s/2``): the error is ``z - x <= z - lo <= ulp(z) / 2``;
    * clamped to Q (``x > z + (Q + 1/2) s``): the error is
      ``x - Q s - z <= hi - (hi - lo - Q ulp(s) / 2) - (lo - ulp(z) / 2) = Q ulp(s) / 2 + ulp(z) / 2``;
    * flushed (``s = 0``, ``hi - lo <= Q * 2**-25``; decodes to ``z``):
      ``|x - z| <= (hi - lo) + |lo - z| <= Q * 2**-24 / 2 + ulp(z) / 2``, ``ulp(0) = 2**-24``.

    All are below ``s / 2 + Q ulp(s) / 2 + ulp(z) / 2``. The fp32 rounding of ``x - z``,
    the division and ``code * s + z`` is relative ``2**-24``, far inside the slack the two fp16
    terms leave in every case (``ulp(z) / 2 >= 2**-12 |z|``).
    """
    if spec.clip:
        # Unclamped: |s| / 2. Clamped at qmax: |x| - qmax |s| with |x| <= amax <= t (|s| + ulp / 2).
        t = clip_divisors(spec.qmax)[-1]
        magnitude = scale_values(scale).abs()
        return torch.maximum(magnitude / 2, (t - spec.qmax) * magnitude) + t * _ulp(scale) / 2
    bound = scale_values(scale) / 2 + spec.code_max * _ulp(scale) / 2
    if spec.symmetric:
        return bound
    if zero is None:
        raise ValueError("an asymmetric spec's error bound needs the zero points")
    return bound + _ulp(zero) / 2


# --- rotation --------------------------------------------------------------------------


@_made_once
def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    # Sylvester's construction needs a power of two; other sizes (head_dim 80, 96) get
    # Hadamard blocks of the largest power of two dividing n along the diagonal.
    block = n & -n
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / math.sqrt(block)] * (n // block)).float().to(device)


def hadamard(n: int, device=None) -> torch.Tensor:
    """Orthonormal, symmetric ``n x n`` (block-)Hadamard matrix, its own inverse, float32.

    Cached per device: a decode step must not copy it host-to-device (nor sync for it).
    """
    return _hadamard(n, torch.device(device or "cpu"))


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` along the last dimension; applying it twice is the identity.

    One ``mm`` over contiguous rows whatever ``x``'s layout: ``matmul`` runs a layout it cannot view as
    rows as a ``bmm``, whose sums (one row a batch) round otherwise, and a graph traced from this code
    makes its own choice between them. Rows always give the same call (Inductor's included), so the
    compiled quantization is this one's bit for bit (``tests/test_cpu_steps.py``)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous().float()
    return (rows @ hadamard(x.shape[-1], x.device)).view(x.shape).to(x.dtype)


# --- quantize / dequantize -------------------------------------------------------------


def split_scales(scales: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(scale, zero)`` from a stored scales tensor; ``zero`` is None for a symmetric spec."""
    if spec.symmetric:
        return scales, None
    return scales[..., 0], scales[..., 1]


def _groups(x: torch.Tensor, spec: QuantSpec):
    """``(groups, dim, expand, ungroup)``: ``x [B, H, S, D]`` viewed as its groups, which are
    reduced over ``dim``; ``expand`` broadcasts a per-group parameter back over a group, and
    ``ungroup`` takes a groups-shaped tensor back to ``[B, H, S, D]``."""
    B, H, S, D = x.shape
    if spec.scheme == "channel":
        g = spec.group
        if S % g:
            raise ValueError(f"per-channel quantization needs whole groups of {g} tokens, got {S} tokens")
        return x.reshape(B, H, S // g, g, D), 3, (lambda p: p[:, :, :, None, :]), (lambda t: t.reshape(B, H, S, D))
    if not spec.span_heads:
        g = spec.token_group(D)
        return x.reshape(B, H, S, D // g, g), 4, (lambda p: p[..., None]), (lambda t: t.reshape(B, H, S, D))
    # One group per token over the channels of n heads: [B, H // n, S, 1, n * D].
    n = spec.heads_per_group(H, D)
    groups = x.reshape(B, H // n, n, S, D).transpose(2, 3).reshape(B, H // n, S, 1, n * D)

    def ungroup(t):  # contiguous, as codes are everywhere else (the reshape may stay a view)
        return t.reshape(B, H // n, S, n, D).transpose(2, 3).reshape(x.shape).contiguous()

    return groups, 4, (lambda p: p[..., None]), ungroup


def per_head_scales(scales: torch.Tensor, heads: int) -> torch.Tensor:
    """``scales`` with one row per head: groups spanning ``n`` heads (``span_heads``) repeated ``n`` times."""
    n = heads // scales.shape[1]
    return scales if n == 1 else scales.repeat_interleave(n, dim=1)


def _quantize_asym(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    code_max = spec.code_max
    groups, dim, expand, ungroup = _groups(x.float(), spec)
    non_finite = ~torch.isfinite(groups).all(dim)
    scale, zero = _asym_params(groups.amin(dim), groups.amax(dim), non_finite, code_max)
    return ungroup(_asym_codes_from(groups, expand(scale), expand(zero), code_max)), torch.stack([scale, zero], dim=-1)


def quantize(x: torch.Tensor, spec: QuantSpec, rounding: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, H, S, D]`` -> ``(codes, scales)`` in the layout of the module docstring. ``rounding``
    (:func:`rounding_coefficients`, per-token symmetric groups within a head) chooses the codes against
    the queries instead of to nearest; the scales are the same either way.

    Rotation is not applied here (see :func:`encode`).
    """
    codes, scales = _quantized(x, spec, rounding)
    return pack_codes(codes, spec.bits, spec.symmetric), scales


# Elements of a per-token ``x`` that one pass of :func:`_quantized` takes: longer appends are searched,
# rounded and coded a slice of tokens at a time (tokens are independent, so the codes do not depend
# on it), which keeps the pass's fp32 and fp64 temporaries (tens of bytes a value when rounding
# against queries) to a few MiB whatever the append's length and batch: a 256-token prefill chunk of 4
# sequences on 8 heads of 128 held 39 MiB of them in one pass, the largest transient of kvpass bench
# memory's fill, and holds 6 MiB in slices (benchmarks/rounding_memory.py).
QUANTIZE_SLICE_ELEMENTS = 2**16


def _quantized(x: torch.Tensor, spec: QuantSpec, rounding: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` with the codes not yet packed: integers ``[B, H, S, D]``."""
    B, H, S, D = x.shape
    per_slice = max(1, QUANTIZE_SLICE_ELEMENTS // (B * H * D))
    if spec.scheme == "token" and S > per_slice:
        rounding = None if rounding is None else rounding.double()  # as _rounded_codes takes it, once
        parts = zip(*(_quantized(part, spec, rounding) for part in x.split(per_slice, dim=2)))
        return tuple(torch.cat(part, dim=2) for part in parts)
    if not spec.symmetric:
        return _quantize_asym(x, spec)
    qmax = spec.qmax
    groups, dim, expand, ungroup = _groups(x, spec)
    dtype = scale_dtype(spec, x.shape[1], x.shape[3])
    if spec.clip:
        scale, nearest = _clipped(groups, dim, qmax, dtype)  # the search has the codes to nearest
    else:
        scale = _group_scale(groups.abs().amax(dim), qmax, dtype)
        nearest = _codes_from(groups, expand(scale), spec.code_min, spec.code_max) if rounding is None else None
    if rounding is None:
        codes = nearest.to(torch.int8)
    else:
        codes = _rounded_codes(groups, scale, rounding, spec.code_min, spec.code_max)
    return ungroup(codes), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, spec: QuantSpec, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize` (up to the quantization error), ``[B, H, S, D]``."""
    return _scaled(_unpacked_float(codes, spec.bits, spec.symmetric), scales, spec, dtype)


def _scaled(q: torch.Tensor, scales: torch.Tensor, spec: QuantSpec, dtype=torch.float32) -> torch.Tensor:
    """Unpacked codes ``q`` (fp32 ``[B, H, S, D]``, overwritten) times their ``scales`` (plus zero points)."""
    B, H, S, D = q.shape
    scale, zero = split_scales(per_head_scales(scales, H), spec)
    if spec.scheme == "token":
        g = D // scale.shape[-1]
        q = q.reshape(B, H, S, D // g, g)

        def expand(p):
            return scale_values(p)[..., None].expand_as(q)
    else:
        g = spec.group
        q = q.reshape(B, H, S // g, g, D)

        def expand(p):
            return scale_values(p)[:, :, :, None, :].expand_as(q)

    # Explicitly expanded operands take torch's fast elementwise path; a size-1 broadcast
    # dimension in the middle is several times slower on CPU.
    x = q.mul_(expand(scale))
    if zero is not None:
        x = x.add_(expand(zero))
    return x.reshape(B, H, S, D).to(dtype)


def field_run(D: int, spec: QuantSpec) -> int:
    """Bytes per run of :func:`field_order`: one token group's (a per-token spec within a head), else a
    whole row."""
    within_head = spec.scheme == "token" and not spec.span_heads
    return (spec.token_group(D) if within_head else D) * spec.bits // 8


@_made_once
def _field_order(D: int, bits: int, run: int, device: torch.device) -> torch.Tensor:
    per_byte = 8 // bits
    return torch.arange(D, device=device).view(-1, run, per_byte).transpose(1, 2).flatten()


def sequence_major_strides(shape) -> tuple[int, ...]:
    """Strides of a cache part ``[B, H, S, ...]`` laid out tokens outermost, as a growing cache stores
    its parts: none depends on ``S``."""
    B, H, _, *rest = shape
    row = math.prod(rest)
    return (H * row, row, B * H * row, *(math.prod(rest[i + 1 :]) for i in range(len(rest))))


def field_order(D: int, spec: QuantSpec, device=None) -> torch.Tensor:
    """Head-dim indices in the order :func:`dequantize_field_major` returns: within each run of
    ``run`` bytes (:func:`field_run`), field 0 of every byte, then field 1, and so on."""
    return _field_order(D, spec.bits, max(field_run(D, spec), 1), torch.device(device or "cpu"))


def dequantize_field_major(codes: torch.Tensor, scales: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``dequantize(codes, scales, spec)[..., field_order(D, spec)]``, fp32, computed directly.

    Writing each field of a group's bytes as one contiguous run, and scaling whole groups at a
    time, is several times cheaper on CPU than interleaving the fields; attention, which only
    takes dot products over the head dim, reads its blocks this way and puts q and its output
    in the same order.
    """
    bits, per_byte = spec.bits, 8 // spec.bits
    B, H, S, n_bytes = codes.shape
    D = n_bytes * per_byte
    run = field_run(D, spec)
    if run == 0:  # groups smaller than a byte's fields
        return dequantize(codes, scales, spec)[..., field_order(D, spec, codes.device)]
    runs = n_bytes // run
    q = torch.empty((B, H, S, runs, per_byte, run), device=codes.device)
    by_run = codes.view(B, H, S, runs, run)
    for i in range(per_byte):
        q[..., i, :].copy_(_field(by_run, bits, i))
    if spec.symmetric:
        q.sub_(code_offset(bits, spec.symmetric))
    scale, zero = split_scales(per_head_scales(scales, H), spec)
    q = q.view(B, H, S, runs, D // runs)
    if spec.scheme == "token":

        def expand(p):
            return scale_values(p)[..., None].expand_as(q)
    else:
        g = spec.group
        q = q.view(B, H, S // g, g, D)
        order = field_order(D, spec, codes.device)

        def expand(p):
            return scale_values(p)[..., order][:, :, :, None, :].expand_as(q)

    q.mul_(expand(scale))
    if zero is not None:
        q.add_(expand(zero))
    return q.view(B, H, S, D)


def masked_pads(mask: torch.Tensor, batch: int) -> torch.Tensor:
    """How many slots open each row of a cache as padding, from the attention ``mask`` of an append
    (bool ``[B or 1, H or 1, T, S]`` over the cache's ``S`` slots, True where a query reads, as
    transformers builds it for SDPA): ``int64 [batch]``, the run of leading slots no query reads.

    ``generate`` pads a batch's shorter prompts on the left and the mask hides the pads from every
    query. A cache's statistics (offset, query scales, the queries rounding reads) taken over them
    would describe the pad, so they start after it. The keys are no sure sign: the pads' are equal in
    a kv4-compiled model, but through transformers' own sdpa call they differ by float noise from the
    second layer on."""
    hidden = ~mask.any(-2).any(1)  # [B or 1, S]
    return hidden.long().cumprod(-1).sum(-1).expand(batch)


# A left-padded row's first tokens are copied into its first pad slots, which no query reads, so a
# cache's first slots (K's fp sinks) hold the row's own first tokens: every query of the row reads
# them. The default spec's sinks; a row with fewer pads, or fewer tokens after them, keeps its pads.
PAD_FILL = 4


def filled_pads(pads: torch.Tensor, length: int) -> torch.Tensor:
    """How a first append of ``length`` slots whose rows open with ``pads`` (:func:`masked_pads`) fills
    them: ``int64 [B, 2]``, each row's pads where it has ``PAD_FILL`` of them and as many tokens after,
    else 0 (nothing copied), and the ``PAD_FILL`` slots its first tokens are copied into
    (:func:`filled_slots`)."""
    fills = (pads >= PAD_FILL) & (length - pads >= PAD_FILL)
    return torch.stack([torch.where(fills, pads, 0), torch.full_like(pads, PAD_FILL)], 1)


def evicted_fill(filled: torch.Tensor, evicted) -> torch.Tensor:
    """``filled`` (:func:`filled_pads`) after a sliding window drops a cache's oldest ``evicted`` slots:
    the row keeps its pads' count (they shift as its tokens do), the copies in the dropped slots go."""
    return torch.stack([filled[:, 0], (filled[:, 1] - evicted).clamp(min=0)], 1) if filled.shape[1] else filled


def filled_slots(filled: torch.Tensor, length: int) -> torch.Tensor:
    """Which of a row's slots each stored slot holds, ``int64 [B, length]``: with ``filled`` pads
    ``(p, n)`` (:func:`filled_pads`), slots ``i < n`` hold copies of the row's tokens ``p + i``
    (its first, behind its pads), every other slot its own token."""
    slot = torch.arange(length, device=filled.device)
    return torch.where(slot < filled[:, 1:], slot + filled[:, :1], slot)


def _copied(filled: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``[B, len(slot)]``: which of ``slot`` hold a row's tokens that have a copy in its pads."""
    return (slot >= filled[:, :1]) & (slot < filled[:, :1] + filled[:, 1:])


def _read_slots(filled: torch.Tensor, length: int) -> torch.Tensor:
    # A copied token reads from its copy; the pad slots holding the copies read them as well.
    slot = torch.arange(length, device=filled.device)
    return torch.where(_copied(filled, slot), slot - filled[:, :1], slot)


def _slots_taken(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    B, H, _, D = x.shape
    return x.gather(2, slots[:, None, :, None].expand(B, H, -1, D))


def with_pads_filled(x: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """Tokens ``x [B, H, T, D]`` as a cache stores them (:func:`filled_slots`); ``x`` itself where no
    row fills its pads (``filled [B, 0]``)."""
    return _slots_taken(x, filled_slots(filled, x.shape[2])) if filled.shape[1] else x


def as_read(x: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """A cache's tokens ``x [B, H, S, D]`` as stored, in their rows' slots as attention reads them: a
    copied token as its copy (a fp sink), the pads holding the copies as the copies (their own values
    are not kept; every query masks them)."""
    return _slots_taken(x, _read_slots(filled, x.shape[2])) if filled.shape[1] else x


def mask_with_filled_pads(mask: torch.Tensor | None, filled: torch.Tensor, queries: int, keys: int,
                          is_causal: bool) -> torch.Tensor:  # fmt: skip
    """An attention mask over ``keys`` slots (as SDPA takes it, ``None`` with ``is_causal`` meaning its
    top-left causal mask) for a cache whose rows fill their pads (:func:`filled_slots`), for a read
    without ``is_causal``: ``[B, H or 1, queries, keys]``. A copy is read as its token was (hidden
    where that token is past ``keys``, a crop's), and the token's own slot is hidden while the copy
    is there."""
    causal = torch.ones(queries, keys, dtype=torch.bool, device=filled.device).tril() if is_causal else None
    if mask is None:
        mask = torch.ones(queries, keys, dtype=torch.bool, device=filled.device) if causal is None else causal
    elif causal is not None:
        mask = mask & causal if mask.dtype == torch.bool else mask.masked_fill(~causal, float("-inf"))
    B = filled.shape[0]
    mask = mask.expand(B, *mask.shape[-3:]) if mask.dim() >= 3 else mask.expand(B, 1, queries, keys)
    slot = torch.arange(keys, device=filled.device)
    source = filled_slots(filled, keys)
    hidden = torch.where(slot < filled[:, 1:], source >= keys, _copied(filled, slot))  # [B, keys]
    read = mask.gather(-1, source.clamp(max=keys - 1)[:, None, None, :].expand(B, *mask.shape[1:3], keys))
    hidden = hidden[:, None, None, :]
    return read & ~hidden if read.dtype == torch.bool else read.masked_fill(hidden, float("-inf"))


def _typical_keys(first: torch.Tensor, spec: QuantSpec, pads=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, weight)``: tokens ``CENTER_SKIP .. CENTER_SKIP + spec.prefix_tokens`` of each row of
    ``first [B, H, T, D]`` after its ``pads`` (:func:`masked_pads`; None: none), ``fp32 [B, H, L, D]``,
    and ``fp32 [B, 1, L, 1]``, 1 where the row holds that token (a padded row's may run past ``T``)."""
    B, H, T, D = first.shape
    # A slice, not a min over the length: no guard in traced graphs.
    position = torch.arange(T, device=first.device)[CENTER_SKIP : CENTER_SKIP + spec.prefix_tokens].expand(B, -1)
    if pads is not None:
        position = pads[:, None] + position
    keys = first.gather(2, position.clamp(max=T - 1)[:, None, :, None].expand(B, H, -1, D)).float()
    return keys, (position < T).float()[:, None, :, None]


def center_offset(first: torch.Tensor, spec: QuantSpec, rotator=None, pads=None) -> torch.Tensor:
    """The offset of a ``spec.center`` cache whose first append is ``first [B, H, T, D]``,
    ``fp16 [B, H, 1, D]`` in the stored domain: the mean of each row's tokens ``CENTER_SKIP ..
    CENTER_SKIP + spec.prefix_tokens`` after its ``pads`` (:func:`masked_pads`) (fp32, then rotated),
    zero when there are none. ``rotator`` is :func:`rotate` or an op computing the same (graphs must
    not trace its constant)."""
    keys, weight = _typical_keys(first, spec, pads)
    mean = (keys * weight).sum(2, keepdim=True) / weight.sum(2, keepdim=True).clamp_min(1)
    return ((rotator or rotate)(mean) if spec.rotate else mean).to(SCALE_DTYPE)


def query_energy(query: torch.Tensor, kv_heads: int, spec: QuantSpec, seen=0, pads=None) -> torch.Tensor:
    """What :func:`query_key_scales` takes from ``query [B, Hq, T, D]`` (query heads grouped as GQA
    reads ``kv_heads`` KV heads), the queries of positions ``seen ..`` of the cache: ``fp64 [B,
    kv_heads, 1, D]``, the sum of squares of those of each row's first ``CENTER_SKIP +
    spec.prefix_tokens`` queries after its ``pads`` (:func:`masked_pads`; None: none), over tokens and
    each KV head's query heads. In fp64 (exact squares of fp32 values) the sums of any split of the
    queries add up to their sum to far below fp32's resolution, where the scales are computed, so a
    cache can gather it over several appends."""
    B, _, T, D = query.shape
    window = CENTER_SKIP + spec.prefix_tokens
    pads = query.new_zeros(B, dtype=torch.long) if pads is None else pads
    # The row's window [pads, pads + window) of positions, as indices into this append's T queries.
    index = torch.arange(T, device=query.device)[:window] + (pads - seen).clamp_min(0)[:, None]
    weight = ((index < T) & (index + seen < (pads + window)[:, None])).double()[:, None, :, None]
    first = query.gather(2, index.clamp(max=T - 1)[:, None, :, None].expand(B, query.shape[1], -1, D))
    return (first.double().pow(2) * weight).sum(2).view(B, kv_heads, -1, D).sum(2, keepdim=True)


def query_key_scales(q_energy: torch.Tensor, first: torch.Tensor, spec: QuantSpec, pads=None) -> torch.Tensor:
    """The per-channel scales of a ``spec.query_scaled`` K cache whose first append is ``first
    [B, Hkv, T, D]``, read by queries of energy ``q_energy`` (:func:`query_energy`):
    ``fp16 [B, Hkv, 1, D]``, ``(E[q_c^2] / Var[k_c]) ** (1/4)`` over each row's tokens
    ``CENTER_SKIP .. CENTER_SKIP + spec.prefix_tokens`` after its ``pads`` (:func:`masked_pads`;
    queries from the first), scaled to a geometric mean of 1 (so the energy's sum stands for its mean).

    A query reads a key through ``q . k``. After the rotation K's error is spread evenly over the
    channels, so ``q . e`` grows with the query's energy wherever the key's sits; storing ``k * s``
    and reading it with ``q / s`` changes no logit, and this ``s`` (the Cauchy-Schwarz optimum)
    puts the error where the queries look least. Channels ``c`` and ``c + D/2`` share a scale: RoPE
    (rotate-half) mixes them by position, so their energy is one statistic.
    """
    D = first.shape[-1]
    q_energy = q_energy[:, :, 0].float()
    keys, weight = _typical_keys(first, spec, pads)
    count = weight.sum(2).clamp_min(1)
    spread = (keys - (keys * weight).sum(2, keepdim=True) / count[..., None]) * weight
    # A row holding its whole window takes torch's variance, as it always has; a padded one the same
    # statistic over the tokens it holds.
    k_energy = torch.where(weight.all(2), keys.var(2, correction=0), spread.pow(2).sum(2) / count)
    q_energy, k_energy = (e[..., : D // 2] + e[..., D // 2 :] for e in (q_energy, k_energy))
    # A channel no first token used (or no query reads) gets a bounded scale, not an infinite one.
    q_energy, k_energy = (e.clamp_min(1e-6 * e.amax(-1, keepdim=True)) for e in (q_energy, k_energy))
    s = (q_energy / k_energy).pow(0.25)
    s = s / s.log().mean(-1, keepdim=True).exp()
    # A head whose first keys do not vary, or that no query reads, has no ratio (0/0, x/0): it stays
    # unscaled rather than storing NaN. So does one whose energies overflow fp32.
    s = torch.where(s.isfinite().all(-1, keepdim=True), s, 1.0).clamp(1 / QUERY_SCALE_RANGE, QUERY_SCALE_RANGE)
    return s.repeat(1, 1, 2)[:, :, None].to(SCALE_DTYPE)


def by_query_scales(x: torch.Tensor | None, query_scales: torch.Tensor | None, power: int) -> torch.Tensor | None:
    """``x [B, H, T, D]`` times (``power=1``) or divided by (``-1``) a query-scaled cache's scales
    (:func:`query_key_scales`), repeated over query heads grouped as GQA reads them; unchanged where
    the cache has none."""
    query_scales = fixed_or_none(query_scales)
    if x is None or query_scales is None:
        return x
    repeats = x.shape[1] // query_scales.shape[1]
    factor = query_scales.float()
    factor = factor if repeats == 1 else factor.repeat_interleave(repeats, dim=1)  # K itself needs no copy
    return (x.float() * factor if power > 0 else x.float() / factor).to(x.dtype)


def read_with_query_scales(q: torch.Tensor, k_new: torch.Tensor | None, query_scales: torch.Tensor | None):
    """``(q / s, k_new * s)`` for a cache whose stored keys are ``k * s`` (:func:`by_query_scales`): the
    query that reads them gives every logit its value, and new keys join them as stored."""
    return by_query_scales(q, query_scales, -1), by_query_scales(k_new, query_scales, 1)


def with_sink(k_new: torch.Tensor, v_new: torch.Tensor, attn_mask: torch.Tensor | None, sink: torch.Tensor | None):
    """``(k_new, v_new, attn_mask)`` that attend as ``sink`` (``[B, H, T, 1]``, one more logit per row, as
    GPT-OSS's attention sinks): one more new token whose key and value are zero and whose mask column is
    the sink, after ``attn_mask``'s broadcast to the sink's rows. No sink: the three as given."""
    if sink is None:
        return k_new, v_new, attn_mask
    if attn_mask is None or not attn_mask.is_floating_point():
        got = None if attn_mask is None else attn_mask.dtype
        raise ValueError(f"an attention sink needs an additive float mask to carry its logit, got {got}")
    zero_k, zero_v = (torch.zeros_like(x[:, :, :1]) for x in (k_new, v_new))
    rows = attn_mask + torch.zeros_like(sink)
    return torch.cat([k_new, zero_k], -2), torch.cat([v_new, zero_v], -2), torch.cat([rows, sink], -1)


# H + ROUNDING_DAMPING * mean(diag H) * I: one append's queries are few samples of the queries that
# will read its tokens (a decode step's are one token's query heads); less damped, H overfits them
# (on Gemma 3's 256-channel heads 0.3 lost perplexity where 1 did not).
ROUNDING_DAMPING = 1.0
# Query rounding works in integers of 2**-ROUNDING_BITS codes, so every implementation chooses the
# same codes whatever order or fusion its arithmetic takes.
ROUNDING_BITS = 14
# Bounds that keep every step exact: values within 2**22 round to integers exactly in fp32 (the
# kernels' way) and convert back and forth exactly (int8's clipped codes reach 190 * 2**14 < 2**22),
# and a block's sum of |error * share| < 4 * 2**45 fits int64 and is exact in fp64 (below 2**53).
ROUNDING_LIMIT = 2**22
ROUNDING_SHARE_LIMIT = 2 ** (ROUNDING_BITS + 8)
# Channels rounded together, passing their errors on to the later blocks: a quarter of the sequential
# steps of one channel at a time (which a decode step's append pays for in op calls on CPU), for nearly
# all of its gain on SmolLM2's keys (what later queries read of the error; eight at a time kept less).
ROUNDING_BLOCK = 4
# Tokens of a sequence whose queries rounding_coefficients takes into its fp64 sums at once.
ROUNDING_TOKENS = 256


def rounding_coefficients(query: torch.Tensor, kv_heads: int, query_scales: torch.Tensor | None,
                          spec: QuantSpec, rotator=None, pads=None, seen=0) -> torch.Tensor:  # fmt: skip
    """How a ``spec.query_rounded`` K append whose queries are ``query [B, Hq, T, D]`` (query heads
    grouped as GQA reads ``kv_heads`` KV heads) rounds its groups: ``int64 [B, kv_heads, D // g, g, g]``
    (``g`` the token group), ``C[..., i, j]`` the share of channel ``i``'s rounding error that channel
    ``j`` of the same group takes on before it is rounded, in units of ``2**-ROUNDING_BITS``; zero unless
    ``j`` is in a later block of ``ROUNDING_BLOCK`` channels than ``i``.

    A query reads a key's error ``e`` through ``q . e``. Rounding the channels block after block, each
    passing its error on to the later ones by these shares (GPTQ's update, with the queries' second
    moment ``H`` in the stored domain, damped, for the Hessian), puts the error where the append's
    queries read little, instead of spreading it evenly as rounding to nearest does. Queries whose
    second moment is not finite and positive give zero shares: rounding to nearest. ``rotator`` is
    :func:`rotate` or an op computing the same (graphs must not trace its constant). The queries
    are of the cache's positions ``seen ..``; those before a row's ``pads`` (:func:`masked_pads`) read
    nothing, and are left out."""
    B, Hq, T, D = query.shape
    g = spec.token_group(D)
    n = Hq // kv_heads * T
    if n * 8 <= g:  # a decode step's few queries: H is a low-rank update of a multiple of I
        rows = _grouped_queries(query, kv_heads, query_scales, spec, rotator, pads, seen)
        squares = rows.pow(2).sum((-2, -1))
    elif isinstance(T, int) and isinstance(B, int):
        # In fp64 a prompt's queries take 8 bytes a value, several copies at once: they are summed a
        # sequence and ROUNDING_TOKENS tokens at a time, so memory grows with neither the prompt nor the
        # batch (a sequence's sums are its own, so the shares do not depend on the batch).
        def row(t, i):
            return t if t is None or t.shape[0] == 1 else t[i : i + 1]

        sums = [_query_sums(query[i : i + 1], kv_heads, row(query_scales, i), spec, rotator, row(pads, i), seen)
                for i in range(B)]  # fmt: skip
        squares, gram = (torch.cat(parts) for parts in zip(*sums))
    else:  # traced with a symbolic length or batch: one slice, as a loop over it would specialise the graph
        squares, gram = _query_sums(query, kv_heads, query_scales, spec, rotator, pads, seen, whole=True)
    # H = q^T q + damping * I: n times the queries' second moment, damped by ROUNDING_DAMPING times
    # its mean diagonal (GPTQ's ratios do not change when H is scaled). Squares of fp32 values cannot
    # overflow fp64, so the sum is finite exactly when every query is; an unusable group gets H = I,
    # which shares nothing.
    damping = ROUNDING_DAMPING * squares / g
    usable = torch.isfinite(damping) & (damping > 0)
    damping = torch.where(usable, damping, 1.0)
    if n * 8 <= g:
        ratios = _gptq_ratios_low_rank(torch.where(usable[..., None, None], rows, 0.0), damping)
    else:
        ratios = _gptq_ratios(torch.where(usable[..., None, None], gram, 0.0), damping)
    shares = ratios.mul_(_later_blocks(g, query.device)).round_()
    return shares.clamp_(-ROUNDING_SHARE_LIMIT, ROUNDING_SHARE_LIMIT).to(torch.int64)


def _query_sums(query: torch.Tensor, kv_heads: int, query_scales: torch.Tensor | None, spec: QuantSpec, rotator,
                pads, seen: int, whole: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(squares, gram)`` of :func:`_grouped_queries` of ``query``: per group, the sum of their squares
    and ``q^T q``, summed ``ROUNDING_TOKENS`` tokens at a time (at once if ``whole``)."""
    slices = (query,) if whole else query.split(ROUNDING_TOKENS, dim=2)
    squares = gram = 0
    for i, part in enumerate(slices):
        part = _grouped_queries(part, kv_heads, query_scales, spec, rotator, pads, seen + i * ROUNDING_TOKENS)
        squares = squares + part.pow(2).sum((-2, -1))
        gram = gram + part.mT @ part
    return squares, gram


def _grouped_queries(query: torch.Tensor, kv_heads: int, query_scales: torch.Tensor | None, spec: QuantSpec,
                     rotator, pads, seen: int) -> torch.Tensor:  # fmt: skip
    """:func:`rounding_coefficients`' queries ``[B, Hq, T, D]`` as they read the stored keys, in fp64,
    grouped as the keys' token groups: ``[B, kv_heads, D // g, Hq // kv_heads * T, g]``."""
    B, Hq, T, D = query.shape
    g = spec.token_group(D)
    q = by_query_scales(query.float(), query_scales, -1)  # the query that reads the stored (scaled) key
    if pads is not None:
        q = q * (torch.arange(T, device=q.device) + seen >= pads[:, None])[:, None, :, None]
    q = ((rotator or rotate)(q) if spec.rotate else q).double()
    return q.reshape(B, kv_heads, Hq // kv_heads, T, D // g, g).permute(0, 1, 4, 2, 3, 5).reshape(B, kv_heads, D // g, -1, g)


def _later_blocks(g: int, device: torch.device) -> torch.Tensor:
    """``2**ROUNDING_BITS`` where channel ``j`` is in a later block than ``i``, else 0: ``fp64 [g, g]``.
    Made on every call: a cached tensor would be a real one inside a compiler's fake-tensor tracing."""
    block = torch.arange(g, device=device) // ROUNDING_BLOCK
    return (block[:, None] < block[None, :]).double() * 2.0**ROUNDING_BITS


def _gptq_ratios(gram: torch.Tensor, damping: torch.Tensor) -> torch.Tensor:
    """GPTQ's update ratios ``U[i, j] / U[i, i]`` for ``H = gram + damping * I`` (``gram [..., g, g]``,
    the queries' ``rows^T rows``; ``damping [...]``), ``U`` the upper Cholesky factor of ``H^-1``:
    ``[..., g, g]``."""
    eye = torch.eye(gram.shape[-1], dtype=torch.float64, device=gram.device)
    hessian = gram + damping[..., None, None] * eye
    # U is the inverse of the lower factor of H with the channel order reversed, reversed back: one
    # factorization and one triangular solve. H is positive definite by construction, so the
    # factorization needs no check (which would sync a GPU).
    lower, _ = torch.linalg.cholesky_ex(hessian.flip(-1, -2))
    factor = torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False).flip(-1, -2)
    return factor / factor.diagonal(dim1=-2, dim2=-1)[..., None]


def _gptq_ratios_low_rank(rows: torch.Tensor, damping: torch.Tensor) -> torch.Tensor:
    """:func:`_gptq_ratios` for few rows (``n`` well under ``g``), in ``O(g n^3 + g^2 n)``, equal above
    the diagonal (the rest is not the ratio, and not used).

    Row ``i`` of ``U`` over ``U[i, i]`` is column ``i`` of the inverse of ``H`` restricted to channels
    ``i..``, over its diagonal entry. With ``c_j`` column ``j`` of ``rows`` and ``M_i = damping * I_n +
    sum_{k > i} c_k c_k^T``, Woodbury and Sherman-Morrison reduce that ratio to ``-c_j . M_i^-1 c_i``:
    ``g`` solves of ``n x n`` systems instead of a ``g x g`` factorization."""
    n = rows.shape[-2]
    cols = rows.mT  # [..., g, n]
    outer = cols[..., :, None] * cols[..., None, :]
    after = outer.flip(-3).cumsum(-3).flip(-3) - outer  # sum over the channels after each one
    eye = torch.eye(n, dtype=torch.float64, device=rows.device)
    solved = torch.linalg.solve_ex(after + damping[..., None, None, None] * eye, cols[..., None])[0]
    return (solved[..., 0] @ rows).neg_()


def _rounded_codes(groups: torch.Tensor, scale: torch.Tensor, coefficients: torch.Tensor, code_min: int,
                   code_max: int) -> torch.Tensor:  # fmt: skip
    """Codes of ``groups [B, H, S, n, g]`` with stored ``scale [B, H, S, n]``, each group's channels
    rounded ``ROUNDING_BLOCK`` at a time, in order, each block passing its errors on by ``coefficients
    [B, H, n, g, g]`` (:func:`rounding_coefficients`; the sum of a block's errors times their shares,
    floored). Groups with a zero or non-finite scale or value round to nearest."""
    unit = 2**ROUNDING_BITS
    s = scale_values(scale)[..., None]
    safe = torch.where((s == 0) | s.isnan(), 1.0, s)
    # x / s is one fp32 division, and times 2**14 exact: the same t in every implementation.
    t = groups.float() / safe * unit
    regular = torch.isfinite(t).all(-1, keepdim=True) & (s != 0) & ~s.isnan()
    t = torch.round(torch.where(regular, t, 0.0).clamp(-ROUNDING_LIMIT, ROUNDING_LIMIT)).double().div_(unit)
    # t in codes, in fp64: at multiples of 2**-14 and this small, a block's errors times shares and their
    # sum are exact (ROUNDING_LIMIT), so a matmul gives the integer arithmetic whatever order it adds in.
    codes = torch.empty_like(t)
    by_group = t.movedim(2, -2)  # [B, H, n, S, g]: one matmul per group for all of the append's tokens
    blocks = (x.unflatten(-1, (-1, ROUNDING_BLOCK)).unbind(-2) for x in (by_group, codes.movedim(2, -2)))
    # Whole rows of shares: what they pass to this block's and earlier channels (nothing, from
    # rounding_coefficients) lands after those codes are taken, so updating all of t rounds as updating
    # the later channels does, in fewer op calls (what a decode step's append pays for).
    share_rows = coefficients.double().unflatten(-2, (-1, ROUNDING_BLOCK)).unbind(-3)
    limit = ROUNDING_LIMIT / unit
    for t_block, code, shares in zip(*blocks, share_rows):
        # copy_, not round(out=code): Inductor takes no strided out= tensor (a decode step's compile failed).
        code.copy_(t_block.round()).clamp_(code_min, code_max)
        passed = (torch.sub(t_block, code) @ shares).floor_()
        by_group.sub_(passed, alpha=1 / unit).clamp_(-limit, limit)
    nearest = _codes_from(groups, scale[..., None], code_min, code_max)
    return torch.where(regular, codes.to(torch.int8), nearest)


def sink_dtype(dtype: torch.dtype) -> torch.dtype:
    """What fp sinks are stored in: the model's dtype when it has 16 bits, else bfloat16 (an fp32
    model's sinks cost what a 16-bit model's do, and keep fp32's range)."""
    return dtype if dtype.itemsize <= 2 else torch.bfloat16


def fixed_or_none(fixed: torch.Tensor | None) -> torch.Tensor | None:
    """What a cache's first append fixes (a centered spec's offset, a query-scaled spec's scales), or
    None where it has none: a tensor of no rows belongs to a cache whose first append was too short
    to fix it (:meth:`QuantSpec.prefix`, :meth:`QuantSpec.takes_query_scales`) or not yet made."""
    return fixed if fixed is not None and fixed.shape[2] else None


def refined_tokens(spec: QuantSpec, stored: int, head_dim: int, n_head: int, offset: torch.Tensor | None):
    """:meth:`QuantSpec.refined_tokens` of a cache of ``head_dim``-channel heads holding ``stored``
    tokens, ``n_head`` of them fp sinks, and ``offset`` (the tensor it stores, or None)."""
    return spec.refined_tokens(stored, head_dim, n_head, fixed_or_none(offset) is not None)


def _centered(stored: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """Stored-domain tokens minus a centered spec's ``offset``, in fp32 (unchanged without one)."""
    offset = fixed_or_none(offset)
    # Type promotion computes in fp32 without a separate fp32 copy of the tokens.
    return stored if offset is None else stored - offset.float()


def encode(x: torch.Tensor, spec: QuantSpec, offset: torch.Tensor | None = None, quantizer=quantize,
           rounding: torch.Tensor | None = None):  # fmt: skip
    """The stored form of ``x``: rotated first when ``spec.rotate``, minus a centered spec's
    ``offset`` (stored domain), then quantized by ``quantizer`` (:func:`quantize` or a kernel
    computing exactly the same), with ``rounding`` if given: ``(codes, scales)``."""
    stored = stored_form(x, spec, offset)
    return quantizer(stored, spec) if rounding is None else quantizer(stored, spec, rounding)


def stored_form(x: torch.Tensor, spec: QuantSpec, offset: torch.Tensor | None = None) -> torch.Tensor:
    """New tokens ``x`` in the domain a cache quantizes them in: rotated when ``spec.rotate``, minus a
    centered spec's ``offset``."""
    return _centered(rotate(x) if spec.rotate else x, offset)


def decode(codes, scales, residual, spec: QuantSpec, dtype, fine_codes=None, fine_scales=None, head=None,
           offset=None) -> torch.Tensor:  # fmt: skip
    """Logical tensor of a stored cache: the ``head`` (fp sinks) if any, the dequantized codes
    (refined, for the newest ``fine_codes.shape[2]`` of them; plus ``offset`` if centered), then
    the residual, unrotated."""
    quantized = _refined(dequantize(codes, scales, spec, torch.float32), fine_codes, fine_scales, spec, 0)
    offset = fixed_or_none(offset)
    if offset is not None:
        quantized = quantized + offset.float()
    parts = [quantized, residual.float()] if head is None else [head.float(), quantized, residual.float()]
    x = torch.cat(parts, dim=-2)
    return (rotate(x) if spec.rotate else x).to(dtype)


def _refined(deq: torch.Tensor, fine_codes, fine_scales, spec: QuantSpec, start: int, n_quant: int | None = None,
             dequantizer=dequantize):  # fmt: skip
    """``deq`` (quantized tokens ``start ..`` of a cache with ``n_quant`` of them, all by default)
    plus the second code plane where it covers them: the newest ``fine_codes.shape[2]`` tokens.
    ``dequantizer`` is the one ``deq`` came from (:func:`dequantize_field_major` keeps its order)."""
    if fine_codes is None or fine_codes.shape[2] == 0:
        return deq
    n_quant = start + deq.shape[2] if n_quant is None else n_quant
    fine_start = n_quant - fine_codes.shape[2]
    lo, hi = max(start, fine_start), start + deq.shape[2]
    if lo >= hi:
        return deq
    rows = slice(lo - fine_start, hi - fine_start)
    # In place: every caller hands over a block it has just dequantized.
    deq[:, :, lo - start :] += dequantizer(fine_codes[:, :, rows], fine_scales[:, :, rows], spec)
    return deq


def quantize_dequantize(x: torch.Tensor, spec: QuantSpec, offset: torch.Tensor | None = None,
                        sinks: int | None = None, quantizer=quantize) -> torch.Tensor:  # fmt: skip
    """What a cache holding ``x`` (built in one go or by appends) gives back; whole groups only for
    channel. Its first ``sinks`` tokens stay unquantized (in :func:`sink_dtype`), the rest are
    quantized minus ``offset`` (a centered spec's, if any) by ``quantizer`` (:func:`quantize`, or the
    codes a query-rounded cache chose for them), the newest :func:`refined_tokens` of them refined.
    Without ``sinks``, both are what a cache whose first append is ``x`` takes
    (:meth:`QuantSpec.prefix`; ``offset`` then defaults to :func:`center_offset`)."""
    B, H, S, D = x.shape
    if sinks is None:
        sinks, takes_offset = spec.prefix(S)
        if takes_offset and offset is None:
            offset = center_offset(x, spec)
    stored = rotate(x) if spec.rotate else x
    n_head = min(sinks, S)
    n_quant = S - S % spec.group if spec.scheme == "channel" else S
    quantized = _centered(stored[:, :, n_head:n_quant], offset)
    codes, scales = quantizer(quantized, spec)
    n_fine = refined_tokens(spec, n_head + quantized.shape[2], D, n_head, offset)
    fine = second_plane(quantized, codes, scales, spec, n_fine) if spec.refine else ()
    head = stored[:, :, :n_head].to(sink_dtype(x.dtype)) if n_head else None
    return decode(codes, scales, stored[:, :, n_quant:], spec, x.dtype, *fine, head=head, offset=offset)


def second_plane(stored: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, spec: QuantSpec,
                 n_fine: int | None = None):  # fmt: skip
    """``(fine_codes, fine_scales)`` of quantized tokens ``stored`` (stored domain) whose
    ``codes``/``scales`` are given: the error of the newest ``n_fine`` (default
    ``spec.refined_tokens(S, D)``), quantized."""
    S = stored.shape[2]
    n_fine = spec.refined_tokens(S, stored.shape[-1]) if n_fine is None else n_fine
    newest = slice(S - n_fine, S)
    return quantize(stored[:, :, newest].float() - dequantize(codes[:, :, newest], scales[:, :, newest], spec), spec)


def encode_refined(x: torch.Tensor, spec: QuantSpec, quantizer=quantize, offset: torch.Tensor | None = None,
                   rounding: torch.Tensor | None = None):  # fmt: skip
    """:func:`encode` of new tokens ``x [B, H, T, D]`` (codes chosen with ``rounding`` if given), and
    the second code plane of the newest ``min(T, spec.refine)`` of them, rounded to nearest:
    ``(codes, scales, fine_codes, fine_scales)``.

    ``quantizer`` is :func:`quantize` or a kernel computing exactly the same.
    """
    stored = stored_form(x, spec, offset)
    T = x.shape[2]
    newest = slice(T - min(T, spec.refine), T)
    if quantizer is quantize:
        # The reference has the codes before packing them: the error needs no unpacking.
        values, scales = _quantized(stored, spec, rounding)
        codes = pack_codes(values, spec.bits, spec.symmetric)
        decoded = _scaled(values[:, :, newest].float(), scales[:, :, newest], spec)
    else:
        codes, scales = quantizer(stored, spec) if rounding is None else quantizer(stored, spec, rounding)
        decoded = dequantize(codes[:, :, newest], scales[:, :, newest], spec)
    return codes, scales, *quantizer(stored[:, :, newest].float() - decoded, spec)


# --- attention -------------------------------------------------------------------------


# Query rows (batch x query heads x new tokens) one pass of :func:`attention` holds: a larger
# input (a prefill chunk of several sequences) is split along the batch, so the fp32 queries,
# accumulators, scores and dequantized blocks of a pass stay those of one sequence's 256-token
# chunk (2 MiB of scores at 8 heads) instead of growing with the batch. Decode steps (one new
# token) and single sequences are never split.
ATTENTION_ROWS = 8 * 256


# Elements a block of :func:`attention` holds per temporary (its dequantized K or V, its scores):
# ~1 MiB of fp32. Each block costs a few dozen small ops whatever its size, so a decode step of
# a model with few KV heads reads longer blocks: SmolLM2's 3 heads of 64 take 1365 tokens a
# block, and an 8K-token decode step's attention ran 2.1x faster on CPU
# (benchmarks/attention_blocks.py). Wide caches keep 256 tokens a block, which measured fastest
# for 8 heads of 128.
BLOCK_ELEMENTS = 2**18
MIN_BLOCK_TOKENS = 256


def _block_tokens(k_spec: QuantSpec, v_spec: QuantSpec, token_elements: int) -> int:
    """Tokens per block for a pass whose block holds ``token_elements`` elements per token in its
    largest temporary: at least ``MIN_BLOCK_TOKENS``, and whole per-channel groups, so each block
    dequantizes independently."""
    groups = [s.group for s in (k_spec, v_spec) if s.scheme == "channel"]
    step = max(groups, default=1)
    target = max(MIN_BLOCK_TOKENS, BLOCK_ELEMENTS // token_elements)
    return max(step, target - target % step)


def grouped_mask(attn_mask: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """An SDPA mask (broadcasting to ``[B, Hq, T, keys]``) against scores viewed per query head,
    ``[B, kv_heads, rep, T, keys]``, as a view: a mask shared by the heads (HF's ``[B, 1, T, P]``)
    broadcasts as it is. Grouping it by KV head copied it for every head (at first the whole mask per
    call, 32 MiB for a 256-token chunk of 32 query heads at 4K; then per block, with its inverse)."""
    attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + attn_mask.shape)
    return attn_mask.unflatten(1, (kv_heads, -1)) if attn_mask.shape[1] > 1 else attn_mask[:, :, None]


def attention(
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
    k_spec: QuantSpec,
    v_spec: QuantSpec,
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
    """SDPA of ``q`` over ``[stored past, new]`` without materialising the fp past.

    ``q [B, Hq, T, D]``; the stored past (codes/scales/residual of K and V, layouts above)
    holds ``P`` tokens; ``k_new``/``v_new [B, Hkv, T_new, D]`` are the exact new tokens.
    ``Hq`` must be a multiple of ``Hkv`` (GQA/MQA). ``attn_mask`` broadcasts to
    ``[B, Hq, T, P + T_new]`` (bool: True attends; float: added). ``is_causal`` is SDPA's
    top-left causal mask over the ``P + T_new`` keys. A row whose keys are all masked is
    zero, as in torch's SDPA. ``softcap > 0`` caps scaled scores to
    ``softcap * tanh(s / softcap)`` before the mask (Gemma-2's logit soft-capping). ``*_fine_*``:
    the second code plane of a refined spec (``QuantSpec.refine``), added to the newest quantized
    tokens it covers. ``*_head``: fp sinks (``QuantSpec.sinks``, stored domain), the first tokens of
    the past, before the codes; ``*_offset``: a centered spec's ``[B, H, 1, D]`` offset, added to
    every dequantized code. The past is dequantized one block of tokens at a time
    (:func:`_block_tokens`) with an online softmax, so memory is O(block), not O(P). A block that the mask (with
    ``is_causal``) excludes for every row is never read, so a static cache's unwritten tail costs nothing and a
    poisoned (NaN) group there stays unseen.
    """
    B, Hq, T, D = q.shape
    per_pass = max(1, ATTENTION_ROWS // (Hq * T))
    if B > per_pass:
        # Batch rows attend independently; each pass gets its rows of every per-sequence input
        # (a mask without a batch dimension, or broadcast along it, is shared as it is).
        def sequences(t, i):
            return t if t is None or (t is attn_mask and (t.dim() < 4 or t.shape[0] == 1)) else t[i : i + per_pass]

        stored = (k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask)
        extra = (k_fine_codes, k_fine_scales, v_fine_codes, v_fine_scales, k_head, k_offset, v_head, v_offset)
        return torch.cat([
            attention(q[i : i + per_pass], *(sequences(t, i) for t in stored), scale, is_causal, k_spec, v_spec,
                      softcap, *(sequences(t, i) for t in extra))
            for i in range(0, B, per_pass)
        ])  # fmt: skip
    Hkv, Dv = v_new.shape[1], v_new.shape[-1]
    rep = Hq // Hkv
    k_stored = _Stored(k_codes, k_scales, k_residual, k_spec, k_fine_codes, k_fine_scales, k_head, k_offset)
    v_stored = _Stored(v_codes, v_scales, v_residual, v_spec, v_fine_codes, v_fine_scales, v_head, v_offset)
    past = k_stored.tokens

    # Scores are invariant under rotating q and k by the same orthogonal matrix, and the
    # rotated V's output is rotated back once at the end.
    qf = q.float().reshape(B, Hkv, rep * T, D)
    q_stored = rotate(qf) if k_spec.rotate else qf
    # Stored blocks come field-major (dequantize_field_major): q meets K in K's order, and the
    # stored part of the output leaves V's order at the end.
    k_order, v_order = field_order(D, k_spec, q.device), field_order(Dv, v_spec, q.device)
    q_stored = q_stored[..., k_order]
    if attn_mask is not None:
        attn_mask = grouped_mask(attn_mask, Hkv)

    def mask_columns(start, stop):
        return attn_mask[..., start:stop]
    positions = torch.arange(T, device=q.device)[:, None]

    m = torch.full((B, Hkv, rep * T, 1), float("-inf"), device=q.device)
    denom = torch.zeros_like(m)
    acc_stored = torch.zeros(B, Hkv, rep * T, Dv, device=q.device)
    # The new tokens' sum, made for their visit: before it, it would only be zeros scaled by each
    # block's correction (zeros, or NaN after a non-finite one, which recurs at that visit).
    acc_plain = None

    def visit(k_blk, v_blk, q_blk, start, acc):
        nonlocal m, denom
        # In place on the block's own scores: one scores-sized tensor per block, not one per step.
        s = (q_blk @ k_blk.float().transpose(-1, -2)).mul_(scale)
        if softcap:
            s = s.div_(softcap).tanh_().mul_(softcap)
        if is_causal or attn_mask is not None:
            by_head = s.view(B, Hkv, rep, T, -1)  # masks go in through this view, in place
        if is_causal:
            cols = torch.arange(start, start + k_blk.shape[2], device=q.device)[None, :]
            by_head.masked_fill_(cols > positions, float("-inf"))
        if attn_mask is not None:
            blk_mask = mask_columns(start, start + k_blk.shape[2])
            by_head.masked_fill_(~blk_mask, float("-inf")) if blk_mask.dtype == torch.bool else by_head.add_(blk_mask)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        # A row that has seen only -inf so far keeps m = -inf; exp(-inf - -inf) would be NaN.
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = s.sub_(m_safe).exp_()
        correction = torch.exp(m - m_safe)
        denom = denom * correction + p.sum(-1, keepdim=True)
        acc_stored.mul_(correction)
        if acc_plain is not None:
            acc_plain.mul_(correction)
        acc.add_(p @ v_blk.float())
        m = m_new

    def attended(start, stop):
        # Host-side, so only for a CPU mask: elsewhere (CUDA without Triton) deciding would
        # sync, which CUDA graphs forbid; reading the block gives the same numbers (bar NaN poison).
        if is_causal and start >= T:
            return False
        if attn_mask is None or attn_mask.device.type != "cpu":
            return True
        blk_mask = mask_columns(start, stop)
        seen = blk_mask if blk_mask.dtype == torch.bool else blk_mask != float("-inf")
        if is_causal:
            seen = seen & (torch.arange(start, stop)[None, :] <= positions)
        return bool(seen.any())

    # Per token of a block: its K and V rows for every KV head, and its scores for every query row.
    block = _block_tokens(k_spec, v_spec, B * Hkv * max(D, Dv, rep * T))
    for start in range(0, past, block):
        stop = min(start + block, past)
        if not attended(start, stop):
            continue  # a block the mask excludes for every row is not read (a static cache's tail)
        visit(k_stored.block(start, stop), v_stored.block(start, stop), q_stored, start, acc_stored)
    del q_stored
    if k_new.shape[2]:
        acc_plain = torch.zeros_like(acc_stored)
        visit(k_new, v_new, qf, past, acc_plain)

    out_stored = torch.empty_like(acc_stored).index_copy_(-1, v_order, acc_stored)  # back to channel order
    out_stored = rotate(out_stored) if v_spec.rotate else out_stored
    # A row with every key masked gives zeros, as torch's SDPA does; NaN (a poisoned
    # stored group) propagates.
    out = out_stored if acc_plain is None else out_stored.add_(acc_plain)  # in place: each is the call's own
    out = out.div_(denom).masked_fill_(denom == 0, 0.0)
    return out.reshape(B, Hq, T, Dv).to(q.dtype)


@dataclasses.dataclass
class _Stored:
    """One stored cache as attention reads it: ``[head | codes (+ fine plane, + offset) | residual]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    residual: torch.Tensor
    spec: QuantSpec
    fine_codes: torch.Tensor | None
    fine_scales: torch.Tensor | None
    head: torch.Tensor | None
    offset: torch.Tensor | None

    @property
    def n_head(self) -> int:
        return 0 if self.head is None else self.head.shape[2]

    @property
    def tokens(self) -> int:
        return self.n_head + self.codes.shape[2] + self.residual.shape[2]

    def block(self, start: int, stop: int) -> torch.Tensor:
        """Tokens ``[start, stop)``, dequantized (still in the stored domain), field-major."""
        spec, n_head, n_quant = self.spec, self.n_head, self.codes.shape[2]
        order = field_order(self.residual.shape[-1], spec, self.residual.device)
        parts = []
        if start < n_head:
            parts.append(self.head[:, :, start : min(stop, n_head), order].float())
        lo, hi = max(start - n_head, 0), min(stop - n_head, n_quant)
        if lo < hi:
            if spec.scheme == "channel":
                g = spec.group
                blk_scales = self.scales[:, :, lo // g : hi // g]
            else:
                blk_scales = self.scales[:, :, lo:hi]
            deq = dequantize_field_major(self.codes[:, :, lo:hi], blk_scales, spec)
            deq = _refined(deq, self.fine_codes, self.fine_scales, spec, lo, n_quant, dequantize_field_major)
            offset = fixed_or_none(self.offset)
            parts.append(deq if offset is None else deq.add_(offset[..., order].float()))
        if stop > n_head + n_quant:
            parts.append(self.residual[:, :, max(start - n_head - n_quant, 0) : stop - n_head - n_quant, order].float())
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
