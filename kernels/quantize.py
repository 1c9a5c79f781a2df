"""Group quantization of ``x [B, H, S, D]`` into packed codes and fp16 scales (and, for a refined
spec, the second code plane of the newest tokens in the same launch: :func:`quantize_refined`).

Bit-exact with :func:`kvpass.reference.quantize`: same fp32 division (correctly rounded,
not the approximate division Triton emits for ``/``), same fp16 scale rounding, same
round-half-to-even, same codes for non-finite groups, for the symmetric grid (absmax or
clipped scales) and the asymmetric one (scale and zero point per group, stored as ``scales[..., 0]`` and
``scales[..., 1]``).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from kvpass.config import QuantSpec
from kvpass.reference import CLIP_ERROR_UNIT, ROUNDING_BITS, ROUNDING_BLOCK, ROUNDING_LIMIT

SCALE_DTYPE = torch.float16
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Adding then subtracting 1.5 * 2**23 rounds an fp32 of magnitude < 2**22 to the nearest
# integer, ties to even: torch.round's rule, with no libdevice call (the interpreter and
# every backend agree on it).
# Globals a kernel reads must be constexpr objects: compiled Triton rejects plain ones and
# constexpr annotations (the interpreter accepts both, so only a GPU run catches it).
_ROUND_MAGIC = tl.constexpr(12582912.0)
_CLIP_ERROR_UNIT = tl.constexpr(CLIP_ERROR_UNIT)
_ROUNDING_BITS = tl.constexpr(ROUNDING_BITS)
_ROUNDING_UNIT = tl.constexpr(1 << ROUNDING_BITS)
_ROUNDING_LIMIT = tl.constexpr(ROUNDING_LIMIT)
_ROUNDING_BLOCK = tl.constexpr(ROUNDING_BLOCK)


@triton.jit
def _div_rn(a, b):
    # Triton lowers fp32 "/" to an approximate division on NVIDIA GPUs; the reference divides
    # exactly, and one ulp decides a rounding tie.
    return tl.math.div_rn(a, b)


@triton.jit
def _scale_from(amax, non_finite, QMAX: tl.constexpr):
    scale = _div_rn(amax, QMAX * 1.0).to(tl.float16)
    return tl.where(non_finite, float("nan"), scale)


@triton.jit
def _non_finite(x, AXIS: tl.constexpr):
    # Which groups (AXIS reduced) hold a NaN or an infinity: tl.max may drop NaN (GPU max.f32
    # does), so they are counted rather than read off the maximum.
    return tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=AXIS) > 0


@triton.jit
def _codes_from(x, scale, CODE_MIN: tl.constexpr, CODE_MAX: tl.constexpr):
    scale = scale.to(tl.float32)
    safe = tl.where((scale == 0) | (scale != scale), 1.0, scale)
    y = _div_rn(x, safe)
    # Clamping before rounding equals rounding before clamping (the bounds are integers) and
    # keeps inf inside the range where the magic-number rounding is exact. NaN -> 0, as
    # the reference defines it.
    y = tl.minimum(tl.maximum(y, CODE_MIN * 1.0), CODE_MAX * 1.0)
    y = (y + _ROUND_MAGIC) - _ROUND_MAGIC
    return tl.where(x != x, 0, y.to(tl.int32))


@triton.jit
def _clipped_scale(x, non_finite, QMAX: tl.constexpr, AXIS: tl.constexpr):
    """The least-squared-error scale of :func:`kvpass.reference.clip_divisors`' candidates per
    group (``AXIS`` reduced), errors in integer units so the sum is exact in any order."""
    amax = tl.max(tl.abs(x), axis=AXIS)
    unit = tl.expand_dims(tl.where((amax == 0) | non_finite, 1.0, amax), AXIS)
    finite = tl.expand_dims(~non_finite, AXIS)
    STEP: tl.constexpr = (QMAX + 1) / 16
    best = amax.to(tl.float16)
    best_error = tl.full(amax.shape, 2147483647, tl.int32)  # every candidate's error is below 2**29
    for k in tl.static_range(8):
        for negative in tl.static_range(2):
            scale = _div_rn(amax, QMAX + k * STEP).to(tl.float16)
            if negative:
                scale = -scale
            scale32 = tl.expand_dims(scale.to(tl.float32), AXIS)
            codes = _codes_from(x, scale32, -QMAX - 1, QMAX)
            # code * scale is exact in fp32: an fma or two roundings give the same error
            e = _div_rn(codes.to(tl.float32) * scale32 - x, unit)
            units = (tl.where(finite, e * e, 0.0) * _CLIP_ERROR_UNIT + 0.5).to(tl.int32)  # floor: units >= 0
            error = tl.sum(units, axis=AXIS)
            better = error < best_error
            best = tl.where(better, scale, best)
            best_error = tl.where(better, error, best_error)
    return tl.where(non_finite, float("nan"), best)


@triton.jit
def _rounded_codes(groups, scale, R, n_groups, CODE_MIN: tl.constexpr, CODE_MAX: tl.constexpr,
                   BLOCK_S: tl.constexpr, N_GROUPS: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """Codes of ``groups [BLOCK_S, N_GROUPS, GROUP]`` with fp16 ``scale [BLOCK_S, N_GROUPS]``, rounded
    against the queries as :func:`kvpass.reference._rounded_codes` does: ``ROUNDING_BLOCK`` channels at
    a time, each block passing its errors on by the shares at ``R`` (one append's ``[n_groups, GROUP,
    GROUP]``, contiguous), in integers of ``2**-ROUNDING_BITS`` codes so that no step depends on how
    arithmetic is ordered or fused. Also returns which groups are regular (finite values, a finite
    non-zero scale): the others take the nearest codes."""
    RB: tl.constexpr = _ROUNDING_BLOCK
    N_BLOCKS: tl.constexpr = GROUP // RB
    scale = scale.to(tl.float32)
    empty = (scale == 0) | (scale != scale)
    t = _div_rn(groups, tl.expand_dims(tl.where(empty, 1.0, scale), 2)) * _ROUNDING_UNIT
    bad = tl.max(((t != t) | (tl.abs(t) == float("inf"))).to(tl.int32), axis=2) > 0
    regular = ~(bad | empty)
    t = tl.where(tl.expand_dims(regular, 2), t, 0.0)
    t = tl.minimum(tl.maximum(t, -_ROUNDING_LIMIT * 1.0), _ROUNDING_LIMIT * 1.0)
    t = tl.reshape(((t + _ROUND_MAGIC) - _ROUND_MAGIC).to(tl.int64), [BLOCK_S, N_GROUPS, N_BLOCKS, RB])
    offs_g = tl.arange(0, N_GROUPS)
    offs_r = tl.arange(0, RB)
    offs_j = tl.arange(0, GROUP)
    block_of = tl.broadcast_to(tl.arange(0, N_BLOCKS)[None, None, :, None], [BLOCK_S, N_GROUPS, N_BLOCKS, RB])
    codes = tl.zeros([BLOCK_S, N_GROUPS, N_BLOCKS, RB], dtype=tl.int64)
    for k in range(N_BLOCKS):
        t_k = tl.sum(tl.where(block_of == k, t, 0), axis=2)  # [BLOCK_S, N_GROUPS, RB]
        code = (t_k.to(tl.float32) * (1.0 / _ROUNDING_UNIT) + _ROUND_MAGIC) - _ROUND_MAGIC
        code = tl.minimum(tl.maximum(code, CODE_MIN * 1.0), CODE_MAX * 1.0).to(tl.int64)
        codes = tl.where(block_of == k, tl.expand_dims(code, 2), codes)
        error = t_k - code * _ROUNDING_UNIT
        rows = offs_g[:, None, None] * GROUP * GROUP + (k * RB + offs_r[None, :, None]) * GROUP + offs_j[None, None, :]
        shares = tl.load(R + rows, mask=offs_g[:, None, None] < n_groups, other=0)  # [N_GROUPS, RB, GROUP]
        passed = tl.sum(tl.expand_dims(error, 3) * tl.expand_dims(shares, 0), axis=2) >> _ROUNDING_BITS
        t = t - tl.reshape(passed, [BLOCK_S, N_GROUPS, N_BLOCKS, RB])
        t = tl.minimum(tl.maximum(t, -_ROUNDING_LIMIT), _ROUNDING_LIMIT)
    return tl.reshape(codes, [BLOCK_S, N_GROUPS, GROUP]).to(tl.int32), regular


@triton.jit
def _asym_params(lo, hi, non_finite, QMAX: tl.constexpr):
    """``(scale, zero)`` in fp16 of groups with minimum ``lo`` and maximum ``hi`` (fp32)."""
    # -0.0 becomes +0.0, whichever zero the min/max reductions picked.
    lo = tl.where(lo == 0, 0.0, lo)
    hi = tl.where(hi == 0, 0.0, hi)
    scale = _div_rn(hi - lo, QMAX * 1.0).to(tl.float16)
    zero = lo.to(tl.float16)
    scale32 = scale.to(tl.float32)
    zero32 = zero.to(tl.float32)
    # A scale or zero point that overflows fp16 poisons its group like a non-finite input.
    bad = non_finite | (scale32 != scale32) | (tl.abs(scale32) == float("inf"))
    bad = bad | (zero32 != zero32) | (tl.abs(zero32) == float("inf"))
    return tl.where(bad, float("nan"), scale), tl.where(bad, float("nan"), zero)


@triton.jit
def _asym_codes_from(x, scale, zero, QMAX: tl.constexpr):
    scale = scale.to(tl.float32)
    empty = (scale == 0) | (scale != scale)  # flushed or poisoned: codes 0
    safe = tl.where(empty, 1.0, scale)
    safe_zero = tl.where(empty, 0.0, zero.to(tl.float32))
    y = _div_rn(x - safe_zero, safe)
    y = tl.minimum(tl.maximum(y, 0.0), QMAX * 1.0)
    y = (y + _ROUND_MAGIC) - _ROUND_MAGIC
    return tl.where(empty, 0, y.to(tl.int32))


@triton.jit
def _pack(codes, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr):
    """Codes ``[ROWS, BLOCK_D]`` -> unsigned fields, ``8 // BITS`` per byte, lowest first.

    Signed (symmetric) codes are offset by ``2**(BITS-1)``; unsigned ones are stored as they are."""
    PER_BYTE: tl.constexpr = 8 // BITS
    if SIGNED:
        unsigned = codes + (1 << (BITS - 1))
    else:
        unsigned = codes
    fields = tl.reshape(unsigned, [ROWS, BLOCK_D // PER_BYTE, PER_BYTE])
    shifts = tl.arange(0, PER_BYTE) * BITS
    # Disjoint bit fields: their sum is their bitwise or.
    return tl.sum(fields << shifts[None, None, :], axis=2).to(tl.uint8)


@triton.jit
def _quantize_token_kernel(
    X, stride_xb, stride_xh, stride_xs, stride_xd,
    C, stride_cb, stride_ch, stride_cs, stride_cd,
    SC, stride_sb, stride_sh, stride_ss, stride_sg, stride_sp,
    R, H, S, D, n_groups,
    FC, stride_fcb, stride_fch, stride_fcs, stride_fcd,
    FSC, stride_fsb, stride_fsh, stride_fss, stride_fsg,
    first_fine,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ASYM: tl.constexpr,
    CLIP: tl.constexpr, ROUNDED: tl.constexpr, REFINE: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    QMAX: tl.constexpr = (1 << BITS) - 1 if ASYM else (1 << (BITS - 1)) - 1
    CODE_MIN: tl.constexpr = -QMAX - 1 if CLIP else -QMAX
    PER_BYTE: tl.constexpr = 8 // BITS
    N_GROUPS: tl.constexpr = BLOCK_D // GROUP

    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_s < S
    x = tl.load(
        X + b * stride_xb + h * stride_xh + offs_s[:, None] * stride_xs + offs_d[None, :] * stride_xd,
        mask=row_ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    ).to(tl.float32)

    groups = tl.reshape(x, [BLOCK_S, N_GROUPS, GROUP])
    non_finite = _non_finite(groups, 2)
    offs_g = tl.arange(0, N_GROUPS)
    scale_ptrs = SC + b * stride_sb + h * stride_sh + offs_s[:, None] * stride_ss + offs_g[None, :] * stride_sg
    scale_mask = row_ok[:, None] & (offs_g[None, :] < n_groups)
    if ASYM:
        scale, zero = _asym_params(tl.min(groups, axis=2), tl.max(groups, axis=2), non_finite, QMAX)
        tl.store(scale_ptrs, scale, mask=scale_mask)
        tl.store(scale_ptrs + stride_sp, zero, mask=scale_mask)
        scale_per_elem = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_S, N_GROUPS, GROUP]), [BLOCK_S, BLOCK_D])
        zero_per_elem = tl.reshape(tl.broadcast_to(zero[:, :, None], [BLOCK_S, N_GROUPS, GROUP]), [BLOCK_S, BLOCK_D])
        packed = _pack(_asym_codes_from(x, scale_per_elem, zero_per_elem, QMAX), BLOCK_S, BLOCK_D, BITS, False)
    else:
        if CLIP:
            scale = _clipped_scale(groups, non_finite, QMAX, 2)
        else:
            scale = _scale_from(tl.max(tl.abs(groups), axis=2), non_finite, QMAX)
        tl.store(scale_ptrs, scale, mask=scale_mask)
        scale_per_elem = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_S, N_GROUPS, GROUP]), [BLOCK_S, BLOCK_D])
        codes = _codes_from(x, scale_per_elem, CODE_MIN, QMAX)
        if ROUNDED:
            rounded, regular = _rounded_codes(groups, scale, R + pid_bh * n_groups * GROUP * GROUP, n_groups,
                                              CODE_MIN, QMAX, BLOCK_S, N_GROUPS, GROUP)  # fmt: skip
            regular = tl.reshape(tl.broadcast_to(regular[:, :, None], [BLOCK_S, N_GROUPS, GROUP]), [BLOCK_S, BLOCK_D])
            codes = tl.where(regular, tl.reshape(rounded, [BLOCK_S, BLOCK_D]), codes)
        packed = _pack(codes, BLOCK_S, BLOCK_D, BITS, True)
    offs_byte = tl.arange(0, BLOCK_D // PER_BYTE)
    tl.store(
        C + b * stride_cb + h * stride_ch + offs_s[:, None] * stride_cs + offs_byte[None, :] * stride_cd,
        packed,
        mask=row_ok[:, None] & (offs_byte[None, :] < D // PER_BYTE),
    )
    if REFINE:
        # The second code plane of rows first_fine..S: their error, quantized to nearest. code * scale
        # is exact in fp32, so the error is one rounding however it is computed (symmetric grids only).
        error = x - codes.to(tl.float32) * scale_per_elem.to(tl.float32)
        error_groups = tl.reshape(error, [BLOCK_S, N_GROUPS, GROUP])
        error_non_finite = _non_finite(error_groups, 2)
        if CLIP:
            fine_scale = _clipped_scale(error_groups, error_non_finite, QMAX, 2)
        else:
            fine_scale = _scale_from(tl.max(tl.abs(error_groups), axis=2), error_non_finite, QMAX)
        fine_rows = offs_s - first_fine
        fine_ok = row_ok & (fine_rows >= 0)
        tl.store(FSC + b * stride_fsb + h * stride_fsh + fine_rows[:, None] * stride_fss + offs_g[None, :] * stride_fsg,
                 fine_scale, mask=fine_ok[:, None] & (offs_g[None, :] < n_groups))  # fmt: skip
        fine_per_elem = tl.reshape(tl.broadcast_to(fine_scale[:, :, None], [BLOCK_S, N_GROUPS, GROUP]), [BLOCK_S, BLOCK_D])
        tl.store(
            FC + b * stride_fcb + h * stride_fch + fine_rows[:, None] * stride_fcs + offs_byte[None, :] * stride_fcd,
            _pack(_codes_from(error, fine_per_elem, CODE_MIN, QMAX), BLOCK_S, BLOCK_D, BITS, True),
            mask=fine_ok[:, None] & (offs_byte[None, :] < D // PER_BYTE),
        )


@triton.jit
def _quantize_channel_kernel(
    X, stride_xb, stride_xh, stride_xs, stride_xd,
    C, stride_cb, stride_ch, stride_cs, stride_cd,
    SC, stride_sb, stride_sh, stride_ss, stride_sd, stride_sp,
    H, D,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr, ASYM: tl.constexpr, CLIP: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    group_idx = tl.program_id(1)
    QMAX: tl.constexpr = (1 << BITS) - 1 if ASYM else (1 << (BITS - 1)) - 1
    CODE_MIN: tl.constexpr = -QMAX - 1 if CLIP else -QMAX
    PER_BYTE: tl.constexpr = 8 // BITS

    offs_s = group_idx * GROUP + tl.arange(0, GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    x = tl.load(
        X + b * stride_xb + h * stride_xh + offs_s[:, None] * stride_xs + offs_d[None, :] * stride_xd,
        mask=offs_d[None, :] < D,
        other=0.0,
    ).to(tl.float32)

    non_finite = _non_finite(x, 0)
    scale_ptrs = SC + b * stride_sb + h * stride_sh + group_idx * stride_ss + offs_d * stride_sd
    if ASYM:
        scale, zero = _asym_params(tl.min(x, axis=0), tl.max(x, axis=0), non_finite, QMAX)
        tl.store(scale_ptrs, scale, mask=offs_d < D)
        tl.store(scale_ptrs + stride_sp, zero, mask=offs_d < D)
        packed = _pack(_asym_codes_from(x, scale[None, :], zero[None, :], QMAX), GROUP, BLOCK_D, BITS, False)
    else:
        if CLIP:
            scale = _clipped_scale(x, non_finite, QMAX, 0)
        else:
            scale = _scale_from(tl.max(tl.abs(x), axis=0), non_finite, QMAX)
        tl.store(scale_ptrs, scale, mask=offs_d < D)
        packed = _pack(_codes_from(x, scale[None, :], CODE_MIN, QMAX), GROUP, BLOCK_D, BITS, True)
    offs_byte = tl.arange(0, BLOCK_D // PER_BYTE)
    tl.store(
        C + b * stride_cb + h * stride_ch + offs_s[:, None] * stride_cs + offs_byte[None, :] * stride_cd,
        packed,
        mask=offs_byte[None, :] < D // PER_BYTE,
    )


def output_shapes(x_shape, spec: QuantSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of ``(codes, scales)`` for an input of ``x_shape``, as the reference lays them out."""
    B, H, S, D = x_shape
    codes_shape = (B, H, S, D * spec.bits // 8)
    if spec.scheme == "token":
        scales_shape = (B, H, S, D // spec.token_group(D))
    else:
        scales_shape = (B, H, S // spec.group, D)
    return codes_shape, scales_shape if spec.symmetric else (*scales_shape, 2)


def _check_out(name, tensor, shape, dtype, device):
    if tuple(tensor.shape) != shape or tensor.dtype != dtype or tensor.device != device:
        raise ValueError(
            f"out {name} must be {dtype} {list(shape)} on {device}, "
            f"got {tensor.dtype} {list(tensor.shape)} on {tensor.device}"
        )


def quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    rounding: torch.Tensor | None = None,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, H, S, D]`` -> ``(codes uint8, scales fp16)`` exactly as :func:`kvpass.reference.quantize`,
    codes rounded against the queries where ``rounding`` (:func:`kvpass.reference.rounding_coefficients`,
    ``int64 [B, H, D // g, g, g]``) is given.

    An asymmetric spec's ``scales`` has a trailing dimension of 2: ``(scale, zero point)``.

    ``x`` may have any strides. ``out`` (any strides, e.g. a slice of a preallocated cache)
    receives the result in place of new tensors. Rotation is not applied here.
    """
    rounding = _checked(x, spec, rounding)
    codes_shape, scales_shape = output_shapes(x.shape, spec)
    if out is None:
        codes = torch.empty(codes_shape, dtype=torch.uint8, device=x.device)
        scales = torch.empty(scales_shape, dtype=SCALE_DTYPE, device=x.device)
    else:
        codes, scales = out
        _check_out("codes", codes, codes_shape, torch.uint8, x.device)
        _check_out("scales", scales, scales_shape, SCALE_DTYPE, x.device)
    _launch(x, spec, rounding, codes, scales)
    return codes, scales


def quantize_refined(
    x: torch.Tensor,
    spec: QuantSpec,
    rounding: torch.Tensor | None = None,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize` of ``x`` and, in the same launch, the second code plane of its newest
    ``min(S, spec.refine)`` tokens (their error, quantized to nearest): ``(codes, scales, fine_codes,
    fine_scales)`` exactly as :func:`kvpass.reference.encode_refined` of the stored form ``x``. A decode
    step's append is one launch instead of the ten or so of quantizing, dequantizing and quantizing again.
    Symmetric per-token groups only (the error of an asymmetric grid's code is two roundings, which a
    GPU may fuse into one). ``out``, as :func:`quantize`'s, receives all four."""
    if spec.scheme != "token" or not spec.symmetric or not spec.refine:
        raise ValueError(f"{spec.tag}: the fused second plane needs symmetric per-token groups and refine > 0")
    rounding = _checked(x, spec, rounding)
    B, H, S, D = x.shape
    shapes = [*output_shapes(x.shape, spec), *output_shapes((B, H, min(S, spec.refine), D), spec)]
    dtypes = (torch.uint8, SCALE_DTYPE) * 2
    if out is None:
        out = tuple(torch.empty(shape, dtype=dtype, device=x.device) for shape, dtype in zip(shapes, dtypes))
    for name, tensor, shape, dtype in zip(("codes", "scales", "fine_codes", "fine_scales"), out, shapes, dtypes):
        _check_out(name, tensor, shape, dtype, x.device)
    _launch(x, spec, rounding, *out)
    return out


def _checked(x: torch.Tensor, spec: QuantSpec, rounding: torch.Tensor | None) -> torch.Tensor | None:
    """Raise on what the kernels do not take; ``rounding`` as the kernel reads it."""
    if x.dim() != 4:
        raise ValueError(f"x must be [B, H, S, D], got shape {list(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"x dtype must be one of {INPUT_DTYPES}, got {x.dtype}")
    if spec.span_heads:
        raise ValueError(
            f"{spec.tag}: groups spanning heads are stored by kvpass.reference; the kernel's are within a head"
        )
    B, H, S, D = x.shape
    per_byte = 8 // spec.bits
    if D % per_byte:
        raise ValueError(f"head_dim {D} must be a multiple of {per_byte} to pack {spec.bits}-bit codes")
    if spec.scheme == "channel" and S % spec.group:
        raise ValueError(f"per-channel quantization needs whole groups of {spec.group} tokens, got {S} tokens")
    if rounding is None:
        return None
    if spec.scheme != "token" or not spec.symmetric:
        raise ValueError(f"{spec.tag}: query rounding needs symmetric per-token groups")
    group = spec.token_group(D)
    shape = (B, H, D // group, group, group)
    if tuple(rounding.shape) != shape or rounding.dtype != torch.int64 or rounding.device != x.device:
        raise ValueError(f"rounding must be int64 {list(shape)} on {x.device}, got {rounding.dtype} "
                         f"{list(rounding.shape)} on {rounding.device}")  # fmt: skip
    return rounding.contiguous()


def _launch(x, spec: QuantSpec, rounding, codes, scales, fine_codes=None, fine_scales=None) -> None:
    """Quantize ``x`` into ``codes``/``scales`` (and the newest tokens' second plane into
    ``fine_codes``/``fine_scales``, per-token groups)."""
    if codes.numel() == 0:
        return
    B, H, S, D = x.shape
    block_d = triton.next_power_of_2(D)
    asym = not spec.symmetric
    # Symmetric scales have no (scale, zero) dimension; its stride is then never used.
    scale_strides = scales.stride() if asym else (*scales.stride(), 0)
    if spec.scheme == "token":
        group = spec.token_group(D)
        n_groups = D // group
        # About 4K elements per program: enough rows to hide latency at head_dim 64-256.
        block_s = min(triton.next_power_of_2(S), max(1, 4096 // block_d))
        grid = (B * H, triton.cdiv(S, block_s))
        refine = fine_codes is not None
        # Without a plane its pointers are never read: the codes stand in for them.
        fine = (fine_codes, *fine_codes.stride(), fine_scales, *fine_scales.stride()) if refine else (codes, 0, 0, 0, 0) * 2
        _quantize_token_kernel[grid](
            x, *x.stride(), codes, *codes.stride(), scales, *scale_strides,
            codes if rounding is None else rounding, H, S, D, n_groups,
            *fine, S - fine_codes.shape[2] if refine else S,
            BITS=spec.bits, GROUP=group, BLOCK_S=block_s, BLOCK_D=block_d, ASYM=asym, CLIP=spec.clip,
            ROUNDED=rounding is not None, REFINE=refine,
        )  # fmt: skip
    else:
        grid = (B * H, S // spec.group)
        _quantize_channel_kernel[grid](
            x, *x.stride(), codes, *codes.stride(), scales, *scale_strides,
            H, D,
            BITS=spec.bits, GROUP=spec.group, BLOCK_D=block_d, ASYM=asym, CLIP=spec.clip,
        )
