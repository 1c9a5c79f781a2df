"""The reference quantizer: error bounds derived from the grid, packing, edge values."""

import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kvpass import ops
from kvpass import reference as R
from kvpass.config import ROUNDED_APPEND_TOKENS, KVConfig, QuantSpec

SPECS = [
    QuantSpec(4, "token", 128),
    QuantSpec(4, "token", 32),
    QuantSpec(4, "channel", 64),
    QuantSpec(4, "channel", 32),
    QuantSpec(8, "token", 64),
    QuantSpec(2, "channel", 64),
    QuantSpec(4, "token", 32, symmetric=False),
    QuantSpec(4, "channel", 64, symmetric=False),
]
ASYM_SPECS = [
    QuantSpec(bits, scheme, group, symmetric=False)
    for bits, scheme, group in [(2, "token", 32), (4, "token", 64), (8, "token", 64), (2, "channel", 32), (4, "channel", 64), (8, "channel", 16)]
]


def _per_element(params, spec, shape):
    B, H, S, D = shape
    if spec.scheme == "token":
        return params.repeat_interleave(D // params.shape[-1], dim=-1)
    return params.repeat_interleave(spec.group, dim=2)


def _scale_per_element(scales, spec, shape):
    return _per_element(scales, spec, shape)


def _bound(scales, spec, shape):
    """Per-element error bound from stored scales (and zero points, asymmetric)."""
    scale, zero = R.split_scales(scales, spec)
    return R.error_bound(
        _per_element(scale, spec, shape), spec, None if zero is None else _per_element(zero, spec, shape)
    )


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.tag)
def test_error_within_half_a_step(spec):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 128, 64) * torch.logspace(-3, 2, 64)  # channels of very different size
    codes, scales = R.quantize(x, spec)
    y = R.dequantize(codes, scales, spec)
    bound = _bound(scales, spec, x.shape)
    assert ((x - y).abs() <= bound).all()
    # the bound is tight: some element lands near half a step from its code
    assert ((x - y).abs() > 0.4 * bound).any()


# --- asymmetric ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("spec", ASYM_SPECS, ids=lambda s: s.tag)
def test_asymmetric_error_bound_and_gain_on_skewed_data(spec, dtype):
    """On one-signed, skewed groups the asymmetric grid uses every level: its error is
    within ``scale/2`` plus the fp16 rounding of scale and zero point, and well below the
    symmetric grid's (which spends half its codes on values the group never takes)."""
    torch.manual_seed(spec.bits)
    x = (torch.randn(2, 3, 128, 64).exp() + 3.0).to(dtype)  # in (3, 60): zero point far from 0
    codes, scales = R.quantize(x, spec)
    assert scales.shape[-1] == 2 and scales.dtype == torch.float16
    y = R.dequantize(codes, scales, spec)
    err = (x.float() - y).abs()
    bound = _bound(scales, spec, x.shape)
    assert (err <= bound).all()
    assert (err > 0.4 * bound).any()
    assert R.unpack_codes(codes, spec.bits, symmetric=False).max() == spec.code_max  # the top code is used
    symmetric = QuantSpec(spec.bits, spec.scheme, spec.group)
    sym_err = (x.float() - R.dequantize(*R.quantize(x, symmetric), symmetric)).abs()
    assert err.pow(2).mean() < 0.5 * sym_err.pow(2).mean()


def test_asymmetric_all_equal_group_decodes_exactly_to_its_value():
    x = torch.randn(1, 2, 64, 64)
    x[0, 0, 3, :32] = -2.75  # one token group
    x[0, 0, 5, 32:] = 0.0  # another
    x[0, 1, :, 40] = 1000.5  # one channel group (fp16-representable)
    for spec in (QuantSpec(4, "token", 32, symmetric=False), QuantSpec(4, "channel", 64, symmetric=False)):
        codes, scales = R.quantize(x, spec)
        y = R.dequantize(codes, scales, spec)
        scale, zero = R.split_scales(scales, spec)
        flat = _per_element(scale, spec, x.shape) == 0
        # scale 0: codes 0, decoded as the zero point, which is the group's value
        assert torch.equal(R.unpack_codes(codes, 4, symmetric=False)[flat], torch.zeros(int(flat.sum()), dtype=torch.uint8))
        if spec.scheme == "token":
            assert scale[0, 0, 3, 0] == 0 and zero[0, 0, 3, 0] == -2.75 and scale[0, 0, 5, 1] == 0
            assert flat.sum() == 64
        else:
            assert scale[0, 1, 0, 40] == 0 and zero[0, 1, 0, 40] == 1000.5
            assert flat.sum() == 64
        assert torch.equal(y[flat], x[flat])
    # not fp16-representable (fp32 input): decodes to fp16(value), within the zero point's rounding
    spec = QuantSpec(4, "token", 32, symmetric=False)
    x32 = torch.full((1, 1, 1, 32), 0.1)
    codes, scales = R.quantize(x32, spec)
    y = R.dequantize(codes, scales, spec)
    assert scales[..., 0].item() == 0 and torch.equal(y, torch.full_like(x32, torch.tensor(0.1).half().item()))
    assert ((x32 - y).abs() <= _bound(scales, spec, x32.shape)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_asymmetric_non_finite_input_poisons_exactly_its_group(bad):
    for spec in (QuantSpec(4, "token", 32, symmetric=False), QuantSpec(2, "channel", 64, symmetric=False)):
        x = torch.randn(1, 1, 64, 64)
        x[0, 0, 3, 5] = bad
        codes, scales = R.quantize(x, spec)
        y = R.dequantize(codes, scales, spec)
        expected = torch.zeros_like(y, dtype=torch.bool)
        if spec.scheme == "token":
            expected[0, 0, 3, :32] = True
        else:
            expected[0, 0, :, 5] = True
        assert torch.equal(y.isnan(), expected)
        assert scales.isnan().sum() == 2  # the group's scale and zero point, nothing else


def test_asymmetric_group_out_of_fp16_range_is_poisoned():
    """bf16/fp32 inputs can hold a minimum or a range fp16 cannot store: NaN, never a wrong finite value."""
    spec = QuantSpec(4, "token", 32, symmetric=False)
    x = torch.randn(1, 1, 3, 32)
    x[0, 0, 1, 0] = -1e5  # zero point overflows fp16
    x[0, 0, 2, 0], x[0, 0, 2, 1] = -6e5, 6e5  # scale (range / 15) overflows fp16
    y = R.dequantize(*R.quantize(x, spec), spec)
    assert y[0, 0, 0].isfinite().all() and y[0, 0, 1:].isnan().all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_asymmetric_pack_round_trip_uses_the_symmetric_fields(bits):
    codes = torch.randint(0, 2**bits, (2, 3, 5, 64), dtype=torch.uint8)
    packed = R.pack_codes(codes, bits, symmetric=False)
    assert packed.shape[-1] == 64 * bits // 8
    assert torch.equal(R.unpack_codes(packed, bits, symmetric=False), codes)
    # same layout: unsigned code c is the field of symmetric code c - 2**(bits-1)
    signed = (codes.to(torch.int16) - 2 ** (bits - 1)).to(torch.int8)
    assert torch.equal(R.pack_codes(signed, bits), packed)


def test_asymmetric_tag_round_trip_and_symmetric_tags_unchanged():
    assert QuantSpec(4, "token", 64, rotate=True).tag == "int4:token:64:rot"
    assert QuantSpec(4, "channel", 64).tag == "int4:channel:64"
    for spec, tag in [
        (QuantSpec(4, "token", 64, rotate=True, symmetric=False), "int4:token:64:rot:asym"),
        (QuantSpec(2, "channel", 32, symmetric=False), "int2:channel:32:asym"),
        (QuantSpec(8, "token", 16, rotate=True), "int8:token:16:rot"),
        (QuantSpec(4, "token", 64, rotate=True, clip=True), "int4:token:64:rot:mse"),
        (QuantSpec(4, "token", 32, clip=True, window=64), "int4:token:32:mse:w64"),
    ]:
        assert spec.tag == tag and QuantSpec.from_tag(tag) == spec
    for bad in ("int4:token:64:asym:rot", "int4:token:64:mse:rot", "int4:token:64:asym:mse", "int4:token:64:rot:rot"):
        with pytest.raises(ValueError, match="bad QuantSpec tag"):
            QuantSpec.from_tag(bad)
    assert QuantSpec(symmetric=False).code_max == 15 and QuantSpec().code_max == 7
    assert (QuantSpec().code_min, QuantSpec(clip=True).code_min, QuantSpec(symmetric=False).code_min) == (-7, -8, 0)
    with pytest.raises(ValueError, match="clip=True needs symmetric=True"):
        QuantSpec(symmetric=False, clip=True)


# --- clipped scales ----------------------------------------------------------------------

CLIPPED = [QuantSpec(4, "token", 64, clip=True), QuantSpec(4, "channel", 32, clip=True), QuantSpec(2, "token", 32, clip=True)]


@pytest.mark.parametrize("spec", CLIPPED, ids=lambda s: s.tag)
def test_clipped_scale_is_the_least_error_candidate_and_within_its_bound(spec):
    torch.manual_seed(spec.bits)
    x = torch.randn(2, 3, 64, 64) * torch.logspace(-2, 1, 64)
    codes, scales = R.quantize(x, spec)
    y = R.dequantize(codes, scales, spec)
    assert ((x - y).abs() <= _bound(scales, spec, x.shape)).all()
    # every candidate's squared error, in float64, per group: the chosen one is the least
    # (to within the integer unit the choice is made in)
    groups = x.double().reshape(2, 3, 64, 64 // spec.group, spec.group) if spec.scheme == "token" else \
        x.double().reshape(2, 3, 64 // spec.group, spec.group, 64).transpose(3, 4)  # fmt: skip
    amax = groups.abs().amax(-1)
    candidates = []
    for t in R.clip_divisors(spec.qmax):
        for sign in (1, -1):
            scale = (amax.float() / t).half().double() * sign
            c = torch.clamp(torch.round(groups / scale[..., None]), spec.code_min, spec.qmax)
            candidates.append(((c * scale[..., None] - groups) ** 2).sum(-1))
    least = torch.stack(candidates).amin(0)
    chosen = ((y.double().reshape(groups.shape) if spec.scheme == "token" else
               y.double().reshape(2, 3, 64 // spec.group, spec.group, 64).transpose(3, 4)) - groups) ** 2  # fmt: skip
    slack = spec.group * amax**2 / R.CLIP_ERROR_UNIT
    assert (chosen.sum(-1) <= least + slack).all()
    assert (scales < 0).any() and (R.unpack_codes(codes, spec.bits) == spec.code_min).any()  # the extra code is used


@pytest.mark.parametrize("spec", CLIPPED, ids=lambda s: s.tag)
def test_clipped_scales_cut_the_mean_error_of_absmax_scales(spec):
    torch.manual_seed(0)
    x = R.rotate(torch.randn(2, 4, 256, 64) + torch.randn(64) * 3)  # rotated K-like rows: near Gaussian
    absmax = dataclasses.replace(spec, clip=False)
    errors = [(x - R.quantize_dequantize(x, s)).pow(2).mean() for s in (spec, absmax)]
    assert errors[0] < 0.85 * errors[1]


def test_clipped_edge_groups_are_those_of_absmax():
    """Zero groups keep scale +0 and decode exactly; non-finite groups decode to NaN; underflow flushes."""
    spec = QuantSpec(4, "token", 32, clip=True)
    x = torch.randn(1, 1, 4, 64)
    x[0, 0, 0] = 0.0
    x[0, 0, 1] = 1e-9
    x[0, 0, 2, 3] = float("inf")
    codes, scales = R.quantize(x, spec)
    y = R.dequantize(codes, scales, spec)
    assert torch.equal(scales[0, 0, 0], torch.zeros(2, dtype=torch.float16)) and not scales[0, 0, 0].signbit().any()
    assert torch.equal(y[0, 0, :2], torch.zeros(2, 64))
    assert y[0, 0, 2, :32].isnan().all() and not y[0, 0, 2, 32:].isnan().any()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip_is_exact(bits):
    qmax = 2 ** (bits - 1) - 1
    codes = torch.randint(-qmax, qmax + 1, (2, 3, 5, 64), dtype=torch.int8)
    packed = R.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8
    assert torch.equal(R.unpack_codes(packed, bits), codes)


@pytest.mark.parametrize(
    "spec, D",
    [
        (QuantSpec(4, "token", 64, clip=True), 128), (QuantSpec(2, "token", 32), 64), (QuantSpec(8, "token", 16), 64),
        (QuantSpec(4, "token", 64), 80), (QuantSpec(2, "token", 2), 64), (QuantSpec(4, "channel", 32), 64),
        (QuantSpec(4, "token", 32, symmetric=False), 64), (QuantSpec(2, "channel", 16, symmetric=False), 96),
    ],
    ids=lambda v: v.tag if isinstance(v, QuantSpec) else f"D{v}",
)  # fmt: skip
def test_field_major_dequantize_is_dequantize_reordered(spec, D):
    """Attention reads blocks field-major: the same values, exactly, in field_order."""
    x = torch.randn(2, 3, 64, D) * 4
    codes, scales = R.quantize(x, spec)
    order = R.field_order(D, spec)
    assert sorted(order.tolist()) == list(range(D))
    assert torch.equal(R.dequantize_field_major(codes, scales, spec), R.dequantize(codes, scales, spec)[..., order])


def test_int4_packs_low_nibble_first():
    codes = torch.tensor([[-7, 7]], dtype=torch.int8)
    # offset binary: -7 -> 1 (low nibble), 7 -> 15 (high nibble)
    assert R.pack_codes(codes, 4).item() == 1 | (15 << 4)


def test_all_zero_group_has_zero_scale_and_decodes_exactly():
    x = torch.zeros(1, 1, 64, 64)
    x[..., 1] = 3.0  # channel 1 (in the first channel group) is nonzero everywhere
    for spec in (QuantSpec(4, "token", 32), QuantSpec(4, "channel", 64)):
        codes, scales = R.quantize(x, spec)
        y = R.dequantize(codes, scales, spec)
        zero_groups = scales == 0
        assert zero_groups.sum() == scales.numel() - (scales.shape[2] if spec.scheme == "token" else 1)
        assert torch.equal(y[..., 32:], x[..., 32:]) and torch.equal(y[..., 0], x[..., 0])


@pytest.mark.parametrize("spec", [QuantSpec(4, "token", 64), QuantSpec(4, "channel", 64)], ids=lambda s: s.tag)
def test_single_huge_outlier_is_kept_and_bounds_only_its_group(spec):
    torch.manual_seed(1)
    x = torch.randn(1, 2, 64, 128)
    x[0, 0, 5, 7] = 1e4
    codes, scales = R.quantize(x, spec)
    y = R.dequantize(codes, scales, spec)
    assert y[0, 0, 5, 7] == pytest.approx(1e4, rel=1e-3)
    bound = R.error_bound(_scale_per_element(scales, spec, x.shape), spec)
    assert ((x - y).abs() <= bound).all()
    # other heads never see the outlier's scale
    assert (x[0, 1] - y[0, 1]).abs().max() < 1.0


def test_subnormal_inputs():
    spec = QuantSpec(4, "token", 64)
    x = torch.full((1, 1, 2, 64), 1e-6)  # amax / 7 is an fp16 subnormal
    x[0, 0, 1] = 1e-9  # amax / 7 underflows fp16: the group flushes to zero
    codes, scales = R.quantize(x, spec)
    y = R.dequantize(codes, scales, spec)
    assert scales[0, 0, 0, 0] > 0 and scales[0, 0, 1, 0] == 0
    bound = R.error_bound(_scale_per_element(scales, spec, x.shape), spec)
    assert ((x - y).abs() <= bound).all()
    assert torch.equal(y[0, 0, 1], torch.zeros(64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_poisons_exactly_its_group(bad):
    for spec in (QuantSpec(4, "token", 32), QuantSpec(4, "channel", 64)):
        x = torch.randn(1, 1, 64, 64)
        x[0, 0, 3, 5] = bad
        codes, scales = R.quantize(x, spec)
        y = R.dequantize(codes, scales, spec)
        poisoned = y.isnan()
        if spec.scheme == "token":
            expected = torch.zeros_like(poisoned)
            expected[0, 0, 3, :32] = True
        else:
            expected = torch.zeros_like(poisoned)
            expected[0, 0, :, 5] = True
        assert torch.equal(poisoned, expected)


def test_channel_scheme_needs_whole_groups():
    with pytest.raises(ValueError, match="whole groups of 64 tokens, got 65"):
        R.quantize(torch.randn(1, 1, 65, 64), QuantSpec(4, "channel", 64))


@pytest.mark.parametrize(
    "spec, H, D, n",
    [
        (QuantSpec(4, "token", 64, span_heads=True), 4, 8, 4),  # 4 heads of 8 channels: 32 values
        (QuantSpec(4, "token", 64, span_heads=True, clip=True), 6, 12, 3),  # 3 heads fit in 64 and divide 6
        (QuantSpec(4, "token", 64, span_heads=True, symmetric=False), 2, 24, 2),
        (QuantSpec(4, "token", 16, span_heads=True), 3, 24, 1),  # wider than the group: one whole head
    ],
    ids=lambda v: v.tag if isinstance(v, QuantSpec) else str(v),
)  # fmt: skip
def test_groups_spanning_heads_take_one_tokens_channels_in_n_heads(spec, H, D, n):
    torch.manual_seed(0)
    x = torch.randn(2, H, 40, D) * torch.logspace(-1, 1, H)[:, None, None]  # heads of different size
    codes, scales = R.quantize(x, spec)
    assert spec.heads_per_group(H, D) == n
    assert scales.shape[:4] == (2, H // n, 40, 1)
    per_head = R.per_head_scales(scales, H)
    scale, zero = R.split_scales(per_head, spec)
    if not spec.clip and spec.symmetric:  # the group's amax is over all n heads' channels
        amax = x.reshape(2, H // n, n, 40, D).abs().amax(dim=(2, 4))
        assert torch.equal(scales[..., 0], (amax / spec.qmax).half())
    y = R.dequantize(codes, scales, spec)
    bound = R.error_bound(scale.expand_as(x), spec, None if zero is None else zero.expand_as(x))
    assert ((x - y).abs() <= bound).all()
    assert spec.clip or ((x - y).abs() > 0.4 * bound).any()  # a clipped scale's bound is looser
    order = R.field_order(D, spec)
    assert torch.equal(R.dequantize_field_major(codes, scales, spec), y[..., order])


def test_groups_under_16_values_keep_8_bit_scales_within_their_bound():
    # One KV head of 8 channels: nothing to span, so the scale shrinks instead (e5m2, 1 bit per value).
    absmax, clipped = QuantSpec(4, "token", 64, span_heads=True), QuantSpec(4, "token", 64, span_heads=True, clip=True)
    assert R.scale_dtype(absmax, 1, 8) == torch.uint8  # float8_e5m2's bits
    assert R.scale_dtype(absmax, 2, 8) == R.scale_dtype(absmax, 1, 16) == torch.float16  # 16 values
    assert R.scale_dtype(dataclasses.replace(absmax, symmetric=False), 1, 8) == torch.float16  # zero points need fp16
    torch.manual_seed(0)
    x = torch.randn(3, 1, 200, 8) * torch.logspace(-3, 3, 200)[:, None]  # fp16's range, both ends
    errors = {}
    for spec in (absmax, clipped):
        codes, scales = R.quantize(x, spec)
        assert scales.dtype == torch.uint8 and scales.shape == (3, 1, 200, 1)
        y = R.dequantize(codes, scales, spec)
        assert ((x - y).abs() <= R.error_bound(scales.expand_as(x), spec)).all()
        errors[spec.clip] = ((x - y) / x.abs().amax(-1, keepdim=True)).square().mean()
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.equal(R.scale_values(R.quantize(x, absmax)[1]), (amax / 7).to(torch.float8_e5m2).float())
    assert errors[True] < errors[False]  # the least-error search still pays off on the coarser grid


def test_span_heads_needs_per_token_groups_and_round_trips_its_tag():
    spec = QuantSpec(4, "token", 64, rotate=True, clip=True, span_heads=True)
    assert spec.tag == "int4:token:64:rot:mse:heads" and QuantSpec.from_tag(spec.tag) == spec
    with pytest.raises(ValueError, match="span_heads=True needs scheme='token'"):
        QuantSpec(4, "channel", 64, span_heads=True)


@pytest.mark.parametrize("D, expected", [(8, QuantSpec(4, "token", 64, True, span_heads=True)),
                                         (16, QuantSpec(4, "token", 64, True)), (32, KVConfig().k)])  # fmt: skip
def test_narrow_heads_drop_the_extras_and_the_narrowest_span_heads(D, expected):
    k = dataclasses.replace(KVConfig().k, clip=False)
    assert k.for_head_dim(D) == dataclasses.replace(expected, clip=False)


def test_token_group_is_clipped_to_what_head_dim_allows():
    assert QuantSpec(4, "token", 128).token_group(64) == 64
    assert QuantSpec(4, "token", 64).token_group(96) == 32
    assert QuantSpec(4, "token", 64).token_group(80) == 16


@pytest.mark.parametrize("n", [64, 80, 96, 128])
def test_hadamard_is_orthonormal_and_involutive(n):
    h = R.hadamard(n)
    assert torch.allclose(h @ h.T, torch.eye(n), atol=1e-6)
    assert torch.equal(h, h.T)
    x = torch.randn(3, n)
    assert torch.allclose(R.rotate(R.rotate(x)), x, atol=1e-5)
    # it mixes: one outlier channel spreads over a whole block
    spike = torch.zeros(n)
    spike[0] = 1.0
    assert (R.rotate(spike).abs() > 0).sum() == n & -n


@pytest.mark.parametrize("n", [64, 80])
def test_rotate_rounds_tokens_alike_whatever_their_layout(n):
    # matmul runs a layout it cannot view as rows as a bmm, whose sums round otherwise: a model's
    # tokens (HF's heads are a projection's columns) and a graph's must store the same values.
    x = torch.randn(9, 3, 1, n, generator=torch.Generator().manual_seed(0)) * 3  # [B, H, 1, D]
    for laid_out in (x.transpose(0, 2).contiguous().transpose(0, 2), x.transpose(1, 2).contiguous().transpose(1, 2)):
        assert torch.equal(R.rotate(laid_out), R.rotate(x))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bits": 3}, "bits must be one of [2, 4, 8], got 3"),
        ({"scheme": "row"}, "scheme must be one of ['channel', 'token'], got 'row'"),
        ({"group": 48}, "group must be a power of two >= 2, got 48"),
        ({"symmetric": 0}, "symmetric must be True or False, got 0"),
    ],
)
def test_bad_spec_names_setting_and_accepted_values(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        QuantSpec(**kwargs)


def test_bad_inner_compiler():
    with pytest.raises(ValueError, match=r"inner must be one of \['eager', 'aot_eager', 'inductor'\], got 'tvm'"):
        KVConfig(inner="tvm")


# --- attention ------------------------------------------------------------------------


def _stored(x, spec):
    B, H, S, D = x.shape
    n = S - S % spec.group if spec.scheme == "channel" else S
    codes, scales = R.encode(x[:, :, :n], spec)
    residual = (R.rotate(x) if spec.rotate else x)[:, :, n:]
    return codes, scales, residual


@pytest.mark.parametrize("past", [0, 1, 63, 64, 65, 300])
@pytest.mark.parametrize(
    "k_spec, v_spec",
    [
        (QuantSpec(4, "channel", 64), QuantSpec(4, "token", 128)),
        (QuantSpec(4, "token", 64, rotate=True), QuantSpec(4, "token", 64, rotate=True)),
        (QuantSpec(4, "channel", 64, symmetric=False), QuantSpec(4, "token", 64, rotate=True, symmetric=False)),
        (QuantSpec(4, "token", 64, rotate=True, span_heads=True),) * 2,
    ],
    ids=["kivi", "rotated", "asym", "span-heads"],
)
@pytest.mark.parametrize("new, causal", [(1, False), (5, True)])
def test_blockwise_attention_equals_sdpa_over_dequantized_cache(past, k_spec, v_spec, new, causal):
    torch.manual_seed(past)
    B, Hq, Hkv, D = 2, 8, 2, 8 if k_spec.span_heads else 64
    k, v = torch.randn(B, Hkv, past, D), torch.randn(B, Hkv, past, D)
    q = torch.randn(B, Hq, new, D)
    k_new, v_new = torch.randn(B, Hkv, new, D), torch.randn(B, Hkv, new, D)
    mask = torch.rand(B, 1, new, past + new) > 0.2
    mask[..., -1] = True  # every row attends to something
    out = R.attention(q, *_stored(k, k_spec), *_stored(v, v_spec), k_new, v_new, mask, 0.1, causal, k_spec, v_spec)
    full_k = torch.cat([R.quantize_dequantize(k, k_spec), k_new], 2)
    full_v = torch.cat([R.quantize_dequantize(v, v_spec), v_new], 2)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, full_k, full_v, attn_mask=mask if not causal else mask & torch.ones(new, past + new).tril().bool(),
        scale=0.1, enable_gqa=True,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_shape", [(2, 8, 5, 305), (8, 5, 305), (5, 305), (1, 1, 1, 305)])
def test_blockwise_attention_reads_a_mask_of_any_broadcast_shape_as_sdpa_does(mask_shape):
    """Masks go in per query head through a view of the scores: per-head, head-shared, 2-D and
    key-only masks, additive, give SDPA's output over the dequantized cache."""
    torch.manual_seed(1)
    spec = QuantSpec(4, "token", 64, rotate=True, clip=True, refine=8)
    B, Hq, Hkv, P, T, D = 2, 8, 2, 300, 5, 64
    k, v = torch.randn(B, Hkv, P, D), torch.randn(B, Hkv, P, D)
    q, k_new, v_new = torch.randn(B, Hq, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    mask = torch.where(torch.rand(mask_shape) > 0.3, torch.randn(mask_shape), float("-inf"))
    mask[..., -1] = 0.0  # every row attends to something
    stored = [(*_stored(x, spec), *R.second_plane(R.rotate(x), *_stored(x, spec)[:2], spec)) for x in (k, v)]
    (kc, ks, kr, kfc, kfs), (vc, vs, vr, vfc, vfs) = stored
    out = R.attention(q, kc, ks, kr, vc, vs, vr, k_new, v_new, mask, 0.1, False, spec, spec, 0.0, kfc, kfs, vfc, vfs)
    full_k = torch.cat([R.quantize_dequantize(k, spec, sinks=0), k_new], 2)
    full_v = torch.cat([R.quantize_dequantize(v, spec, sinks=0), v_new], 2)
    expected = torch.nn.functional.scaled_dot_product_attention(q, full_k, full_v, attn_mask=mask, scale=0.1,
                                                                enable_gqa=True)  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_quantized_attention_error_is_small_against_fp():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 4, 256, 64), torch.randn(1, 4, 256, 64)
    k_spec, v_spec = QuantSpec(4, "channel", 64), QuantSpec(4, "token", 64)
    out = R.attention(
        q, *_stored(k, k_spec), *_stored(v, v_spec), k[:, :, :0], v[:, :, :0], None, 1 / math.sqrt(64), False,
        k_spec, v_spec,
    )  # fmt: skip
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert (out - exact).abs().max() < 0.1


def test_poisoned_stored_group_makes_attention_nan_not_finite():
    spec = QuantSpec(4, "token", 64)
    k = torch.randn(1, 1, 8, 64)
    k[0, 0, 3, 0] = float("nan")
    codes, scales = R.quantize(k, spec)
    empty = k[:, :, :0]
    out = R.attention(
        torch.randn(1, 1, 1, 64), codes, scales, empty, *R.quantize(torch.randn(1, 1, 8, 64), spec), empty,
        empty, empty, None, 0.1, False, spec, spec,
    )  # fmt: skip
    assert out.isnan().all()


@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
def test_blocks_the_mask_excludes_are_not_read(monkeypatch, additive):
    """A static cache's decode: the whole buffer, no new tokens, a mask over the valid slots.
    Blocks no row attends to are poisoned and never dequantized."""
    torch.manual_seed(0)
    spec = QuantSpec(4, "token", 64, rotate=True)
    B, Hq, Hkv, D = 2, 4, 2, 64
    block = R._block_tokens(spec, spec, B * Hkv * D)
    S = 3 * block
    q = torch.randn(B, Hq, 1, D)
    k_codes, k_scales, k_res = _stored(torch.randn(B, Hkv, S, D), spec)
    v_codes, v_scales, v_res = _stored(torch.randn(B, Hkv, S, D), spec)
    keep = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    keep[0, ..., block : block + 40] = True  # left padding of a whole block
    keep[1, ..., block + 7 : 2 * block] = True
    mask = torch.where(keep, 0.0, float("-inf")) if additive else keep
    valid = slice(block, 2 * block)
    expected = R.attention(
        q, k_codes[:, :, valid], k_scales[:, :, valid], k_res, v_codes[:, :, valid], v_scales[:, :, valid], v_res,
        k_res, v_res, mask[..., valid], 0.1, False, spec, spec,
    )  # fmt: skip
    for t in (k_codes, k_scales, v_codes, v_scales):
        t[:, :, :block] = float("nan") if t.is_floating_point() else 255
        t[:, :, 2 * block :] = float("nan") if t.is_floating_point() else 255
    read = []
    original = R.dequantize_field_major
    monkeypatch.setattr(R, "dequantize_field_major", lambda codes, *a: read.append(codes.shape[2]) or original(codes, *a))
    out = R.attention(q, k_codes, k_scales, k_res, v_codes, v_scales, v_res, k_res, v_res, mask, 0.1, False, spec, spec)
    assert read == [block, block]  # K and V of the middle block only
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("heads, head_dim, blocks", [(1, 64, 2), (8, 128, 20)])
def test_blocks_are_bounded_in_elements_not_tokens(monkeypatch, heads, head_dim, blocks):
    """A decode step over one KV head of 64 reads ``BLOCK_ELEMENTS / 64`` tokens a block (every
    block costs the same few dozen ops on CPU, so narrow caches take longer ones); 8 heads of
    128 keep ``MIN_BLOCK_TOKENS``. The result does not depend on the blocking."""
    torch.manual_seed(0)
    spec = QuantSpec(4, "token", 64, rotate=True, clip=True)
    S = 5000
    q = torch.randn(1, 2 * heads, 1, head_dim)
    k, v = torch.randn(1, heads, S, head_dim), torch.randn(1, heads, S, head_dim)
    (kc, ks, kr), (vc, vs, vr) = _stored(k, spec), _stored(v, spec)
    new = torch.randn(1, heads, 1, head_dim)
    read = []
    original = R.dequantize_field_major
    monkeypatch.setattr(R, "dequantize_field_major", lambda codes, *a: read.append(codes.shape[2]) or original(codes, *a))
    out = R.attention(q, kc, ks, kr, vc, vs, vr, new, new, None, 0.1, False, spec, spec)
    block = max(R.MIN_BLOCK_TOKENS, R.BLOCK_ELEMENTS // (heads * head_dim))
    assert read == [min(block, S - start) for start in range(0, S, block) for _ in "kv"]
    assert len(read) == 2 * blocks
    monkeypatch.setattr(R, "BLOCK_ELEMENTS", 0)  # 256-token blocks everywhere
    expected = R.attention(q, kc, ks, kr, vc, vs, vr, new, new, None, 0.1, False, spec, spec)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "specs",
    [
        (KVConfig().k, KVConfig().v),
        (QuantSpec(4, "channel", 64), QuantSpec(4, "token", 128)),
        (QuantSpec(4, "token", 32, True, symmetric=False), QuantSpec(2, "token", 32, True)),
        (QuantSpec(4, "token", 64, True, clip=True, refine=64, sinks=4), QuantSpec(8, "token", 64, True, window=128)),
    ],
    ids=lambda specs: "/".join(s.tag for s in specs),
)  # fmt: skip
def test_attention_does_not_depend_on_its_block_length(monkeypatch, specs):
    """Blocks of any length a budget gives (here 256, 300 and all 700 tokens at once: lengths off the
    groups' multiples, sinks and the second plane inside one block or split, per-channel groups
    kept whole) read the same packed cache to the same attention, up to the softmax's rounding."""
    from kvpass.packed import PackedKV, attention

    torch.manual_seed(0)
    k_spec, v_spec = specs
    P, heads, D = 700, 3, 64
    keys = PackedKV.from_float(torch.randn(1, heads, P, D), k_spec, torch.randn(1, 3 * heads, P, D))
    values = PackedKV.from_float(torch.randn(1, heads, P, D), v_spec)
    q, k_new, v_new = torch.randn(1, 3 * heads, 3, D), torch.randn(1, heads, 3, D), torch.randn(1, heads, 3, D)
    mask = torch.rand(1, 1, 3, P + 3) > 0.2
    outs, original = [], R.dequantize_field_major
    for tokens in (R.MIN_BLOCK_TOKENS, 300, P):
        monkeypatch.setattr(R, "BLOCK_ELEMENTS", tokens * heads * D)  # per token: 3 heads of 64 (9 query rows)
        read = []
        monkeypatch.setattr(R, "dequantize_field_major", lambda c, *a: read.append(c.shape[2]) or original(c, *a))
        outs.append(attention(q, keys, values, k_new, v_new, mask))
        assert max(read) <= tokens and len(read) >= 2 * (P // tokens)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mask_shape", ["per-row", "broadcast", "2-d", "none"])
def test_attention_split_along_the_batch_equals_one_pass(monkeypatch, mask_shape):
    """A batch with more query rows than ``ATTENTION_ROWS`` runs in passes of whole sequences
    (bounded temporaries): the same numbers as one pass, masks shared or split by row."""
    torch.manual_seed(0)
    spec = QuantSpec(4, "token", 64, rotate=True, clip=True, refine=8)
    B, Hq, Hkv, P, T, D = 5, 4, 2, 300, 3, 64
    q = torch.randn(B, Hq, T, D)
    k, v = torch.randn(B, Hkv, P, D), torch.randn(B, Hkv, P, D)
    k_new, v_new = torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    stored = []
    for x in (k, v):
        codes, scales, residual = _stored(x, spec)
        stored.append((codes, scales, residual, R.second_plane(R.rotate(x), codes, scales, spec)))
    (kc, ks, kr, k_fine), (vc, vs, vr, v_fine) = stored
    masks = {
        "per-row": torch.rand(B, 1, T, P + T) > 0.3,
        "broadcast": torch.rand(1, Hq, T, P + T) > 0.3,
        "2-d": torch.where(torch.rand(T, P + T) > 0.3, 0.0, float("-inf")),
        "none": None,
    }
    mask = masks[mask_shape]
    if mask is not None:
        mask[..., -1] = True if mask.dtype == torch.bool else 0.0

    def run():
        return R.attention(q, kc, ks, kr, vc, vs, vr, k_new, v_new, mask, 0.1, mask is None, spec, spec, 0.0,
                           *k_fine, *v_fine)  # fmt: skip

    whole = run()
    passes = []
    original = R._block_tokens
    monkeypatch.setattr(R, "_block_tokens", lambda *a: passes.append(1) or original(*a))
    monkeypatch.setattr(R, "ATTENTION_ROWS", 2 * Hq * T)  # two sequences a pass: 2 + 2 + 1
    split = run()
    assert len(passes) == 3
    assert torch.equal(split, whole)


QUERY_ROUNDED = QuantSpec(4, "token", 64, rotate=True, clip=True, query_rounded=True)


def _concentrated_queries(B, kv_heads, D, directions=2, seed=0):
    """Queries of two query heads per KV head, spread over a few directions per head (as real
    queries are: a handful of directions carry most of their energy)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(B, kv_heads, 1, directions, D, generator=g)
    weights = torch.randn(B, kv_heads, 2 * 24, directions, 1, generator=g)
    q = (weights * basis).sum(3) + 0.05 * torch.randn(B, kv_heads, 2 * 24, D, generator=g)
    return q.reshape(B, kv_heads, 2, 24, D).flatten(1, 2)  # [B, 2 * kv_heads, 24, D]


@pytest.mark.parametrize("spec", [QUERY_ROUNDED, dataclasses.replace(QUERY_ROUNDED, bits=8, group=32),
                                  dataclasses.replace(QUERY_ROUNDED, bits=2, clip=False)], ids=lambda s: s.tag)
def test_query_rounding_moves_the_error_out_of_what_the_queries_read(spec):
    B, H, S, D = 2, 2, 40, 128
    x = R.rotate(torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(1)) * 2)  # stored: rotated
    q = _concentrated_queries(B, H, D)
    shares = R.rounding_coefficients(q, H, None, spec)
    q = R.rotate(q)  # what reads the stored keys
    g = spec.token_group(D)
    assert shares.shape == (B, H, D // g, g, g) and shares.dtype == torch.int64
    assert torch.equal(shares, shares.triu(1))  # a channel passes its error only to later ones
    nearest, rounded = R.quantize(x, spec), R.quantize(x, spec, shares)
    assert torch.equal(nearest[1], rounded[1])  # the same scales, so the same bytes
    codes = R.unpack_codes(rounded[0], spec.bits)
    assert codes.min() >= spec.code_min and codes.max() <= spec.code_max

    def read_error(stored):  # what the queries read of the error, over its size
        e = R.dequantize(*stored, spec) - x
        return (q.reshape(B, H, -1, D) @ e.mT).pow(2).mean() / e.pow(2).mean()

    # The queries' directions carry almost all of their energy: what they read of the error falls far.
    assert read_error(rounded) < 0.2 * read_error(nearest)


def test_a_long_append_rounds_each_token_as_it_would_alone():
    """The reference quantizes a prompt's tokens QUANTIZE_SLICE_ELEMENTS at a time; each token's codes
    are those it takes rounded alone, wherever the slices fall."""
    per_slice = R.QUANTIZE_SLICE_ELEMENTS // (2 * 128)
    S = 2 * per_slice + 37
    x = R.rotate(torch.randn(1, 2, S, 128, generator=torch.Generator().manual_seed(5)) * 2)
    shares = R.rounding_coefficients(_concentrated_queries(1, 2, 128), 2, None, QUERY_ROUNDED)
    codes, scales = R.quantize(x, QUERY_ROUNDED, shares)
    for token in (0, per_slice - 1, per_slice, S - 1):
        alone = R.quantize(x[:, :, token : token + 1], QUERY_ROUNDED, shares)
        assert torch.equal(codes[:, :, token : token + 1], alone[0]) and torch.equal(scales[:, :, token : token + 1], alone[1])
    assert not torch.equal(codes, R.quantize(x, QUERY_ROUNDED)[0])


def test_a_prompts_rounding_shares_are_summed_a_slice_at_a_time_and_equal_the_whole_prompts(monkeypatch):
    """A 600-token prompt's queries (and pads, and query scales) reach the fp64 Hessian a sequence and
    ``ROUNDING_TOKENS`` tokens at a time, so its memory grows with neither the prompt nor the batch;
    the shares are those of the whole prompt at once (fp64 sums in another order, then rounded to
    integers), and of each sequence alone."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 600, 64, generator=gen) * torch.rand(1, 1, 1, 64, generator=gen) * 3
    scales, pads = (torch.rand(2, 2, 1, 64, generator=gen) + 0.5).half(), torch.tensor([0, 170])
    sizes, grouped = [], R._grouped_queries
    monkeypatch.setattr(R, "_grouped_queries", lambda query, *a: sizes.append(query.shape[::2]) or grouped(query, *a))
    sliced = R.rounding_coefficients(q, 2, scales, QUERY_ROUNDED, pads=pads, seen=5)
    assert sizes == [(1, 256), (1, 256), (1, 88)] * 2
    second = R.rounding_coefficients(q[1:], 2, scales[1:], QUERY_ROUNDED, pads=pads[1:], seen=5)
    monkeypatch.setattr(R, "ROUNDING_TOKENS", 600)
    whole = R.rounding_coefficients(q, 2, scales, QUERY_ROUNDED, pads=pads, seen=5)
    assert sizes[9:] == [(1, 600)] * 2 and torch.equal(sliced, whole) and whole.abs().max() > 0
    assert torch.equal(sliced[1:], second)


class _LargestNewStorage(TorchDispatchMode):
    """The bytes of the largest storage an op made (views and in-place results are their inputs')."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_a_prefill_chunks_quantization_temporaries_are_bounded_by_a_slice_whatever_the_batch():
    """A 256-token chunk of 4 sequences (kvpass bench memory's fill) quantized against its queries:
    no temporary is larger than fp64 values of one sequence's ROUNDING_TOKENS queries, of
    QUANTIZE_SLICE_ELEMENTS values or of CLIP_SLICE_ELEMENTS candidates' units, or the shares in fp64.
    The whole chunk in fp64 (8 MiB, four times the largest of these) was a temporary of both."""
    B, H, T, D = 4, 8, 256, 128
    gen = torch.Generator().manual_seed(4)
    x, q = R.rotate(torch.randn(B, H, T, D, generator=gen)), torch.randn(B, H, T, D, generator=gen)
    with _LargestNewStorage() as summing:
        shares = R.rounding_coefficients(q, H, None, QUERY_ROUNDED)
    assert summing.largest <= 8 * H * R.ROUNDING_TOKENS * D < 8 * q.numel()
    with _LargestNewStorage() as quantizing:
        codes, scales = R.quantize(x, QUERY_ROUNDED, shares)
    assert quantizing.largest <= 8 * max(R.QUANTIZE_SLICE_ELEMENTS, R.CLIP_SLICE_ELEMENTS, shares.numel())
    assert 8 * x.numel() >= 4 * quantizing.largest
    alone = [R.quantize(x[i : i + 1], QUERY_ROUNDED, shares[i : i + 1])[0] for i in range(B)]
    assert torch.equal(codes, torch.cat(alone))


def test_a_traced_prompt_length_stays_symbolic_in_the_rounding_shares():
    """Traced with a symbolic length (as an aot_eager or inductor inner compiler traces an append), a
    prompt's queries are one slice: a loop over the length fixed the traced slices to the first
    prompt's (and recompiled a model for every prompt length)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randn(1, 4, T, 64, generator=gen) for T in (300, 310, 530)]
    # ops.rotate, as an append passes it: a traced graph holds no Hadamard matrix as a constant.
    traced = make_fx(lambda q: R.rounding_coefficients(q, 2, None, QUERY_ROUNDED, ops.rotate),
                     tracing_mode="symbolic")(prompts[0])  # fmt: skip
    for q in prompts:
        assert torch.equal(traced(q), R.rounding_coefficients(q, 2, None, QUERY_ROUNDED))


@pytest.mark.parametrize("n, g", [(1, 64), (3, 64), (8, 64), (4, 32), (2, 256)])
def test_gptq_ratios_of_few_queries_are_the_cholesky_ratios(n, g):
    """A decode step's few queries take the low-rank route to GPTQ's ratios; above the diagonal (all
    that the shares use) it is the Cholesky route's result, to fp64 rounding."""
    gen = torch.Generator().manual_seed(n * g)
    rows = (torch.randn(3, 2, n, g, generator=gen) * torch.rand(3, 1, 1, g, generator=gen) * 4).double()
    damping = rows.pow(2).sum((-2, -1)) / (n * g)
    low_rank, full = R._gptq_ratios_low_rank(rows, damping), R._gptq_ratios(rows.mT @ rows, damping)
    above = torch.ones(g, g, dtype=torch.bool).triu(1)
    torch.testing.assert_close(low_rank[..., above], full[..., above], rtol=1e-9, atol=1e-12)
    assert full[..., above].abs().max() > 0.1  # the queries' few directions give real shares


def test_query_rounding_without_a_preferred_direction_is_rounding_to_nearest():
    spec = dataclasses.replace(QUERY_ROUNDED, rotate=False)
    x = torch.randn(1, 2, 9, 64)
    # Queries along every channel alike: an isotropic second moment gives no shares at all.
    isotropic = (torch.eye(64) * 3).expand(1, 4, 64, 64)
    # All-zero (or non-finite) queries say nothing: no shares either.
    for q in (isotropic, torch.zeros(1, 4, 3, 64), torch.full((1, 4, 3, 64), float("nan"))):
        shares = R.rounding_coefficients(q, 2, None, spec)
        assert not shares.any()
        assert torch.equal(R.quantize(x, spec, shares)[0], R.quantize(x, spec)[0])


def test_query_rounding_leaves_zero_and_non_finite_groups_as_rounding_to_nearest_does():
    x = torch.randn(1, 2, 6, 64)
    x[0, 0, 1] = 0
    x[0, 1, 2, 5] = float("inf")
    x[0, 1, 4, 9] = float("nan")
    shares = R.rounding_coefficients(_concentrated_queries(1, 2, 64), 2, None, QUERY_ROUNDED)
    nearest, rounded = R.quantize(x, QUERY_ROUNDED), R.quantize(x, QUERY_ROUNDED, shares)
    for token, head in ((1, 0), (2, 1), (4, 1)):
        assert torch.equal(rounded[0][0, head, token], nearest[0][0, head, token])
    out = R.dequantize(*rounded, QUERY_ROUNDED)
    assert (out[0, 0, 1] == 0).all() and out[0, 1, 2].isnan().all() and out[0, 1, 4].isnan().all()


def test_query_rounding_reads_the_query_that_reads_the_stored_key():
    """With query scales the stored key is ``k * s``, read by ``q / s``: the shares come from that query."""
    q = _concentrated_queries(1, 2, 64)
    s = torch.rand(1, 2, 1, 64).add(0.5).to(torch.float16)
    scaled = R.rounding_coefficients(q, 2, s, QUERY_ROUNDED)
    assert torch.equal(scaled, R.rounding_coefficients(q / s.float().repeat_interleave(2, 1), 2, None, QUERY_ROUNDED))
    assert not torch.equal(scaled, R.rounding_coefficients(q, 2, None, QUERY_ROUNDED))


def test_query_rounded_setting_is_checked_tagged_and_stripped_where_no_queries_come():
    assert QUERY_ROUNDED.tag.endswith(":qr") and QuantSpec.from_tag(QUERY_ROUNDED.tag) == QUERY_ROUNDED
    assert not QUERY_ROUNDED.for_slots.query_rounded and not QUERY_ROUNDED.for_head_dim(16).query_rounded
    # The default rounds appends of 64 tokens or more: True is every append (1), False none (0).
    default = KVConfig().k
    assert default.query_rounded == ROUNDED_APPEND_TOKENS == 64 and default.tag.endswith(":dp:qr64")
    assert QuantSpec.from_tag(default.tag) == default and QUERY_ROUNDED.query_rounded == 1
    assert [default.rounds(n) for n in (1, 63, 64, 2048)] == [False, False, True, True]
    assert QUERY_ROUNDED.rounds(1) and not dataclasses.replace(default, query_rounded=False).rounds(2048)
    assert dataclasses.replace(default, query_rounded=False) == dataclasses.replace(default, query_rounded=0)
    for kwargs in (dict(scheme="channel"), dict(window=64), dict(symmetric=False, clip=False), dict(span_heads=True)):
        with pytest.raises(ValueError, match="query_rounded=1 needs scheme='token', window=0, symmetric=True"):
            dataclasses.replace(QUERY_ROUNDED, **kwargs)
    for bad in (-1, 1.5, "64"):
        with pytest.raises(ValueError, match=r"query_rounded must be an int >= 0 \(the fewest tokens"):
            QuantSpec(query_rounded=bad)
    with pytest.raises(ValueError, match="bad QuantSpec tag"):
        QuantSpec.from_tag("int4:token:64:qr064")
    with pytest.raises(ValueError, match="v.query_rounded=True is not supported"):
        KVConfig(v=QUERY_ROUNDED)


@pytest.mark.parametrize(
    "spec",
    [KVConfig().k, KVConfig().v, QuantSpec(4, "token", 32, rotate=True, symmetric=False, refine=64),
     QuantSpec(8, "token", 32, clip=True, refine=16), QuantSpec(2, "token", 16, rotate=True, refine=64)],
    ids=lambda s: s.tag,
)
@pytest.mark.parametrize("tokens", [1, 9, 70])
def test_encode_refined_from_unpacked_codes_equals_it_from_packed_ones(spec, tokens):
    """The reference takes the plane's error from the codes before packing them; a kernel quantizer's
    are packed, and unpacked for it: the same bits either way, non-finite, zero and rounded groups too."""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(2, 3, tokens, 64, generator=g) * 3
    x[0, 0, 0] = 0.0
    x[1, 2, -1, 5] = float("nan")
    x[0, 1, -1, 7] = float("inf")
    offset = torch.randn(2, 3, 1, 64, generator=g) * 0.1
    rounding = None
    if spec.query_rounded:
        rounding = R.rounding_coefficients(_concentrated_queries(2, 3, 64)[:, :, :tokens], 3, None, spec)
    expected = R.encode_refined(x, spec, lambda *args: R.quantize(*args), offset, rounding)
    got = R.encode_refined(x, spec, offset=offset, rounding=rounding)
    for a, b in zip(got, expected):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bits, so NaN scales compare too
