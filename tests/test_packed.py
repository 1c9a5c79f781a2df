"""PackedKV: what HF cache code does to a cache tensor, done on int4 storage."""

import io
import logging

import pytest
import torch

from kvpass.config import QuantSpec
from kvpass.packed import PackedKV
from kvpass.reference import quantize_dequantize

SPECS = [
    QuantSpec(4, "channel", 64),
    QuantSpec(4, "token", 128),
    QuantSpec(4, "token", 32, rotate=True),
    QuantSpec(4, "channel", 64, symmetric=False),
    QuantSpec(4, "token", 64, rotate=True, symmetric=False),
]


@pytest.fixture(params=SPECS, ids=lambda s: s.tag)
def spec(request):
    return request.param


def _packed(spec, S=150, dtype=torch.float16):
    torch.manual_seed(0)
    x = torch.randn(3, 2, S, 64, dtype=dtype)
    return x, PackedKV.from_float(x, spec)


def test_inner_tensors_have_documented_shapes_and_bytes(spec):
    x, p = _packed(spec, S=256)
    assert p.shape == x.shape and p.dtype == torch.float16
    assert p.codes.dtype == torch.uint8 and p.codes.shape == (3, 2, 256, 32)
    if spec.scheme == "channel":
        scales_shape = (3, 2, 4, 64)
    else:
        scales_shape = (3, 2, 256, 64 // min(spec.group, 64))
    # asymmetric: (scale, zero point) in a trailing dimension
    assert p.scales.shape == (scales_shape if spec.symmetric else (*scales_shape, 2))
    assert p.stored_bytes() <= 0.30 * x.numel() * 2


def test_dequantize_matches_reference(spec):
    x, p = _packed(spec)
    torch.testing.assert_close(p.dequantize(), quantize_dequantize(x, spec), rtol=0, atol=0)


def test_append_quantizes_only_new_tokens(spec):
    x, _ = _packed(spec, S=200)
    p = PackedKV.from_float(x[:, :, :70], spec)
    old_codes = p.codes.clone()
    for start in range(70, 200, 13):  # appends that cross group boundaries
        p = torch.cat([p, x[:, :, start : start + 13]], dim=-2)
    assert p.shape == x.shape
    assert torch.equal(p.codes[:, :, : old_codes.shape[2]], old_codes)
    torch.testing.assert_close(p.dequantize(), quantize_dequantize(x, spec), rtol=0, atol=0)
    if spec.scheme == "channel":
        assert p.residual.shape[2] == 200 % 64


def test_batch_reorder_and_select(spec):
    x, p = _packed(spec)
    ref = quantize_dequantize(x, spec)
    order = torch.tensor([2, 0, 1])
    for reordered in (p.index_select(0, order), p[order]):
        assert isinstance(reordered, PackedKV)
        torch.testing.assert_close(reordered.dequantize(), ref[order], rtol=0, atol=0)
    # repeat_interleave decomposes before dispatch (unsqueeze/expand): correct through the fallback
    torch.testing.assert_close(p.repeat_interleave(2, dim=0), ref.repeat_interleave(2, dim=0), rtol=0, atol=0)


@pytest.mark.parametrize("length", [0, 1, 63, 64, 65, 128, 149])
def test_crop_keeps_every_surviving_value(spec, length):
    x, p = _packed(spec)
    cropped = p[..., :length, :]
    assert isinstance(cropped, PackedKV) and cropped.shape[2] == length
    torch.testing.assert_close(cropped.dequantize(), p.dequantize()[:, :, :length], rtol=0, atol=0)
    # a cropped cache keeps growing correctly (speculative decoding crops, then appends)
    grown = torch.cat([cropped, x[:, :, length : length + 70]], dim=-2)
    assert grown.shape[2] == min(length + 70, 150)


def test_to_device_and_dtype(spec):
    _, p = _packed(spec)
    moved = p.to("cpu")
    assert isinstance(moved, PackedKV) and torch.equal(moved.codes, p.codes)
    as_bf16 = p.to(torch.bfloat16)
    assert isinstance(as_bf16, PackedKV) and as_bf16.dtype == torch.bfloat16


def test_save_load_round_trip(spec):
    _, p = _packed(spec)
    buffer = io.BytesIO()
    torch.save({"keys": p}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)["keys"]  # weights_only=True: PackedKV is an allowed global
    assert isinstance(loaded, PackedKV) and loaded.spec == p.spec
    for name in ("codes", "scales", "residual"):
        assert torch.equal(getattr(loaded, name), getattr(p, name))


def test_unsupported_op_is_correct_and_warns_once_naming_it(caplog, spec):
    x, p = _packed(spec)
    ref = quantize_dequantize(x, spec)
    with caplog.at_level(logging.WARNING, logger="kvpass"):
        out = p * 2 + 1
        out2 = p * 3
    torch.testing.assert_close(out, ref * 2 + 1)
    torch.testing.assert_close(out2, ref * 3)
    warnings = [r.message for r in caplog.records if "aten.mul.Tensor" in r.message]
    assert len(warnings) <= 1  # once per process; an earlier test may have taken it
    assert not isinstance(out, PackedKV)


def test_in_place_op_writes_back_into_the_cache(spec):
    _, p = _packed(spec)
    p.mul_(0)
    assert isinstance(p, PackedKV) and torch.equal(p.dequantize(), torch.zeros(p.shape, dtype=p.dtype))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"must be \[B, H, S, D\], got shape \(4, 8\)"):
        PackedKV.from_float(torch.randn(4, 8), QuantSpec())
    with pytest.raises(ValueError, match="must be floating point, got torch.int64"):
        PackedKV.from_float(torch.zeros(1, 1, 2, 8, dtype=torch.long), QuantSpec())
