"""Triton kernels against the reference numerics, on CPU through the Triton interpreter.

Quantization must be bit-exact. Attention is compared with tolerances per dtype (see
``TOLERANCE``). Every output is poisoned before the launch so an element the kernel never
writes fails the comparison.
"""

import dataclasses
import os

# The interpreter is chosen when Triton and the kernels are imported, so set it first.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from kvpass import reference  # noqa: E402
from kvpass.config import PREFIX_MIN_TOKENS, SHORT_PREFIX_MIN_TOKENS, QuantSpec  # noqa: E402
from kvpass.kernels.attention import _INTERPRET as KERNELS_INTERPRETED  # noqa: E402

if not KERNELS_INTERPRETED:
    pytest.skip(
        "kvpass.kernels was imported before this module set TRITON_INTERPRET=1; run "
        f"{os.path.basename(__file__)} in its own process or with TRITON_INTERPRET=1",
        allow_module_level=True,
    )

from kvpass.kernels import attention, quantize, quantize_refined  # noqa: E402
from tests.helpers import bits_equal, decode_step_args, hard_values  # noqa: E402

# Tolerances of the fused attention against the fp32 reference, per input dtype:
# - fp32: operands stay fp32 and the dots are IEEE fp32; only summation order and exp
#   differ, a few ulp of outputs that are O(1).
# - fp16: q, the dequantized K/V (exact codes times an fp16 scale, plus the zero point when
#   asymmetric) and the softmax weights are rounded to fp16 (2**-11 relative) before the
#   tensor-core dot, and the output is rounded to fp16; outputs are averages of N(0, 1) values, so |out| < 4 and one fp16 ulp
#   there is 2e-3.
# - bf16: the same roundings at 2**-8 relative; one bf16 ulp at |out| < 4 is 1.6e-2.
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=6e-3, rtol=6e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}

KIVI = (QuantSpec(bits=4, scheme="channel", group=64), QuantSpec(bits=4, scheme="token", group=128))
ROTATED = (QuantSpec(bits=4, scheme="token", group=128, rotate=True), QuantSpec(bits=4, scheme="token", group=128, rotate=True))
INT2_INT8 = (QuantSpec(bits=2, scheme="channel", group=16), QuantSpec(bits=8, scheme="token", group=32))
TOKEN_GROUPS = (QuantSpec(bits=4, scheme="token", group=32), QuantSpec(bits=2, scheme="token", group=64))
# The default's grid: negative scales and the extra code -8 reach the kernel's dequantization.
CLIPPED = (QuantSpec(bits=4, scheme="token", group=64, rotate=True, clip=True),) * 2
SPECS = {"kivi": KIVI, "rotated": ROTATED, "int2_int8": INT2_INT8, "token_groups": TOKEN_GROUPS, "clipped": CLIPPED}
# Asymmetric (zero-point) specs; kept out of SPECS so DECODE_CASES' sample stays as it was.
ASYM = (
    QuantSpec(bits=4, scheme="channel", group=64, symmetric=False),
    QuantSpec(bits=4, scheme="token", group=64, rotate=True, symmetric=False),
)
ASYM_INT2_INT8 = (QuantSpec(bits=2, scheme="token", group=16, symmetric=False), QuantSpec(bits=8, scheme="token", group=32, symmetric=False))
SPECS_ASYM = {"asym": ASYM, "asym_int2_int8": ASYM_INT2_INT8}


# --- quantize --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "spec, shape",
    [
        (QuantSpec(bits=4, scheme="token", group=128), (2, 3, 17, 128)),
        (QuantSpec(bits=4, scheme="token", group=128), (1, 2, 9, 64)),
        (QuantSpec(bits=4, scheme="channel", group=64), (2, 2, 128, 64)),
        (QuantSpec(bits=2, scheme="token", group=2), (1, 2, 8, 96)),
        (QuantSpec(bits=8, scheme="token", group=32), (2, 1, 6, 96)),
        (QuantSpec(bits=2, scheme="channel", group=16), (1, 3, 32, 40)),
        (QuantSpec(bits=8, scheme="channel", group=8), (2, 1, 16, 128)),
        (QuantSpec(bits=4, scheme="token", group=128), (1, 2, 7, 80)),
        (QuantSpec(bits=4, scheme="token", group=64, symmetric=False), (2, 3, 17, 128)),
        (QuantSpec(bits=2, scheme="channel", group=16, symmetric=False), (1, 3, 32, 40)),
        (QuantSpec(bits=8, scheme="token", group=32, symmetric=False), (1, 2, 9, 80)),
        (QuantSpec(bits=4, scheme="token", group=64, clip=True), (2, 3, 17, 128)),
        (QuantSpec(bits=4, scheme="token", group=32, clip=True), (1, 2, 7, 80)),
        (QuantSpec(bits=4, scheme="channel", group=64, clip=True), (2, 2, 128, 64)),
        (QuantSpec(bits=2, scheme="token", group=16, clip=True), (1, 2, 8, 96)),
        (QuantSpec(bits=8, scheme="channel", group=8, clip=True), (2, 1, 16, 128)),
    ],
    ids=lambda v: f"{v.bits}b-{v.scheme}-g{v.group}{'' if v.symmetric else '-asym'}{'-mse' if v.clip else ''}"
    if isinstance(v, QuantSpec)
    else "x".join(map(str, v)),
)
def test_quantize_bit_exact(spec, shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape) + spec.bits)
    # Heads-major storage transposed to a logical [B, H, S, D]: non-contiguous input.
    x = hard_values(shape, dtype, gen).transpose(1, 2).contiguous().transpose(1, 2)
    codes_ref, scales_ref = reference.quantize(x, spec)
    codes = torch.randint(0, 256, codes_ref.shape, dtype=torch.uint8, generator=gen)
    scales = torch.full_like(scales_ref, float("nan"))
    quantize(x, spec, out=(codes, scales))
    assert torch.equal(codes, codes_ref)
    assert bits_equal(scales, scales_ref)


@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_refined_quantize_through_the_kernel_matches_reference(tokens, dtype):
    """What ``kv4::quantize_refined`` runs on CUDA: the kernel's codes, then the plane quantized
    by the kernel too, bit for bit the reference's."""
    spec = QuantSpec(bits=4, scheme="token", group=64, rotate=True, clip=True, refine=64)
    gen = torch.Generator().manual_seed(tokens)
    shape = (2, 3, tokens, 128)
    x = hard_values(shape, dtype, gen) if tokens > 7 else (torch.randn(shape, generator=gen) * 3).to(dtype)
    expected = reference.encode_refined(x, spec)
    launches = []
    got = reference.encode_refined(x, spec, lambda t, s: launches.append(t.shape) or quantize(t, s))
    assert launches == [shape, (2, 3, min(tokens, spec.refine), 128)]  # the codes, then the plane
    assert all(torch.equal(a, b) if a.dtype == torch.uint8 else bits_equal(a, b) for a, b in zip(got, expected))


REFINED = QuantSpec(bits=4, scheme="token", group=64, clip=True, refine=64)


@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "spec, rounded",
    [(REFINED, False), (dataclasses.replace(REFINED, query_rounded=True), True),
     (dataclasses.replace(REFINED, clip=False, refine=8), False), (QuantSpec(8, "token", 32, clip=True, refine=16), False),
     (QuantSpec(2, "token", 16, refine=64), False)],
    ids=lambda v: v.tag if isinstance(v, QuantSpec) else ("rounded" if v else "nearest"),
)  # fmt: skip
def test_fused_refined_quantize_matches_reference(spec, rounded, tokens, dtype):
    """One launch for the codes and the second plane (what ``kv4::quantize_refined`` runs on CUDA), bit
    for bit the reference's, on ties, zeros and non-finite groups, codes rounded against queries or not."""
    gen = torch.Generator().manual_seed(tokens + spec.bits)
    shape = (2, 3, tokens, 64)
    x = hard_values(shape, dtype, gen) if tokens > 7 else (torch.randn(shape, generator=gen) * 3).to(dtype)
    rounding = None
    if rounded:
        rounding = reference.rounding_coefficients(torch.randn(2, 6, 4, 64, generator=gen), 3, None, spec)
    expected = reference.encode_refined(x, spec, rounding=rounding)
    poisoned = [torch.full_like(t, 255 if t.dtype == torch.uint8 else float("nan")) for t in expected]
    got = quantize_refined(x, spec, rounding, out=poisoned)
    assert [t.shape for t in got] == [t.shape for t in expected]
    assert all(torch.equal(a, b) if a.dtype == torch.uint8 else bits_equal(a, b) for a, b in zip(got, expected))


def test_fused_refined_quantize_takes_symmetric_token_groups_only():
    x = torch.randn(1, 2, 3, 64)
    for spec in (dataclasses.replace(REFINED, symmetric=False, clip=False), dataclasses.replace(REFINED, refine=0)):
        with pytest.raises(ValueError, match="the fused second plane needs symmetric per-token groups"):
            quantize_refined(x, spec)


@pytest.mark.parametrize(
    "spec, shape",
    [
        (QuantSpec(bits=4, scheme="token", group=64, rotate=True, clip=True, query_rounded=True), (2, 3, 9, 64)),
        (QuantSpec(bits=4, scheme="token", group=64, clip=True, query_rounded=True), (1, 2, 7, 96)),  # 3 groups of 32
        (QuantSpec(bits=8, scheme="token", group=64, clip=True, query_rounded=True), (1, 2, 6, 256)),
        (QuantSpec(bits=2, scheme="token", group=16, query_rounded=True), (2, 1, 8, 80)),
    ],
    ids=lambda v: v.tag if isinstance(v, QuantSpec) else "x".join(map(str, v)),
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_query_rounded_quantize_bit_exact(spec, shape, dtype):
    """Codes chosen against the queries, channel by channel, equal the reference's to the bit:
    the shares are integers, so no step depends on the kernel's arithmetic order or fusion."""
    gen = torch.Generator().manual_seed(sum(shape) + spec.bits)
    x = hard_values(shape, dtype, gen)
    B, H, _, D = shape
    q = torch.randn(B, 2 * H, 1, D, generator=gen) * 3 + 0.3 * torch.randn(B, 2 * H, 6, D, generator=gen)
    rounding = reference.rounding_coefficients(q, H, None, spec)
    codes_ref, scales_ref = reference.quantize(x, spec, rounding)
    assert not torch.equal(codes_ref, reference.quantize(x, spec)[0])  # the rounding chose other codes
    codes, scales = quantize(x, spec, rounding)
    assert torch.equal(codes, codes_ref)
    assert bits_equal(scales, scales_ref)
    with pytest.raises(ValueError, match=r"rounding must be int64 \[1, 1"):
        quantize(x[:1, :1], spec, rounding)


def test_quantize_into_cache_slice():
    spec = QuantSpec(bits=4, scheme="channel", group=64)
    x = torch.randn(2, 2, 64, 64, dtype=torch.float16)
    codes_buf = torch.zeros(2, 2, 256, 32, dtype=torch.uint8)
    scales_buf = torch.zeros(2, 2, 4, 64, dtype=torch.float16)
    quantize(x, spec, out=(codes_buf[:, :, 128:192], scales_buf[:, :, 2:3]))
    codes_ref, scales_ref = reference.quantize(x, spec)
    assert torch.equal(codes_buf[:, :, 128:192], codes_ref)
    assert torch.equal(scales_buf[:, :, 2:3], scales_ref)
    assert not codes_buf[:, :, :128].any() and not codes_buf[:, :, 192:].any()


def test_quantize_returns_new_tensors_and_rejects_partial_groups():
    x = torch.randn(1, 2, 5, 64)
    codes, scales = quantize(x, QuantSpec(bits=4, scheme="token", group=128))
    assert codes.shape == (1, 2, 5, 32) and scales.shape == (1, 2, 5, 1)
    with pytest.raises(ValueError, match="whole groups of 64 tokens, got 5"):
        quantize(x, QuantSpec(bits=4, scheme="channel", group=64))
    with pytest.raises(ValueError, match="dtype"):
        quantize(x.double(), QuantSpec())
    with pytest.raises(ValueError, match="groups spanning heads are stored by kvpass.reference"):
        quantize(x, QuantSpec(span_heads=True))


# --- attention -------------------------------------------------------------------------


def _store(x, spec):
    """The stored form of ``x`` as the cache holds it: codes, scales and the residual tail."""
    stored = reference.rotate(x) if spec.rotate else x
    if spec.scheme == "channel":
        n_quant = x.shape[2] - x.shape[2] % spec.group
    else:  # the newest window..window+63 tokens stay unquantized
        n_quant = max(x.shape[2] - spec.window, 0) // 64 * 64
    codes, scales = reference.quantize(stored[:, :, :n_quant], spec)
    return codes, scales, stored[:, :, n_quant:].contiguous()


def _inputs(batch, q_heads, kv_heads, q_len, past, new, head_dim, dtype, specs, seed):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(dtype)

    k_spec, v_spec = specs
    k_codes, k_scales, k_res = _store(randn(batch, kv_heads, past, head_dim), k_spec)
    v_codes, v_scales, v_res = _store(randn(batch, kv_heads, past, head_dim), v_spec)
    q = randn(batch, q_heads, q_len, head_dim)
    k_new, v_new = randn(batch, kv_heads, new, head_dim), randn(batch, kv_heads, new, head_dim)
    return q, k_codes, k_scales, k_res, v_codes, v_scales, v_res, k_new, v_new


def _check(args, attn_mask, is_causal, specs, dtype, out=None, softcap=0.0, fine=()):
    q = args[0]
    scale = q.shape[-1] ** -0.5
    expected = reference.attention(*args, attn_mask, scale, is_causal, *specs, softcap, *fine)
    if out is None:
        out = torch.full(expected.shape, float("nan"), dtype=dtype)
    else:
        out.fill_(float("nan"))
    result = attention(*args, attn_mask, scale, is_causal, *specs, softcap, *fine, out=out)
    assert result is out
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    return expected


PASTS = (0, 1, 63, 64, 65, 300)
HEADS = ((2, 2), (8, 2), (16, 2), (4, 1))  # GQA ratios 1, 4, 8 and MQA
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A sample of the cross product: each axis advances with its own period, so every value of
# every axis appears several times and in varied company, in 24 cases instead of 1728.
DECODE_CASES = [
    (
        PASTS[i % 6],
        (64, 128)[(i // 6) % 2],
        HEADS[i % 4],
        (1, 2, 3)[(i // 4) % 3],
        DTYPES[(i // 2) % 3],
        list(SPECS)[(i // 3) % 4],
    )
    for i in range(24)
]


@pytest.mark.parametrize("past, head_dim, heads, batch, dtype, specs", DECODE_CASES)
def test_decode_matches_reference(past, head_dim, heads, batch, dtype, specs):
    q_heads, kv_heads = heads
    args = _inputs(batch, q_heads, kv_heads, 1, past, 1, head_dim, dtype, SPECS[specs], seed=past + head_dim)
    _check(args, None, False, SPECS[specs], dtype)


WINDOWED = (QuantSpec(bits=4, scheme="token", group=32, rotate=True, window=64),) * 2


@pytest.mark.parametrize("past", [0, 63, 130, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_over_an_fp_window(past, dtype):
    """Per-token codes followed by an unquantized tail of 64-127 tokens."""
    args = _inputs(2, 8, 2, 1, past, 1, 64, dtype, WINDOWED, seed=past)
    assert args[3].shape[2] == (past if past < 128 else past - (past - 64) // 64 * 64)
    _check(args, None, False, WINDOWED, dtype)


def test_decode_over_growable_storage():
    """Codes and scales as PackedKV grows them: sequence-major views of storages with spare rows."""
    from kvpass.packed import PackedKV

    spec = WINDOWED[0]
    gen = torch.Generator().manual_seed(3)
    k = PackedKV.from_float(torch.randn(1, 2, 100, 64, generator=gen), spec)
    v = PackedKV.from_float(torch.randn(1, 2, 100, 64, generator=gen), spec)
    for _ in range(70):
        k, v = k.append(torch.randn(1, 2, 1, 64, generator=gen)), v.append(torch.randn(1, 2, 1, 64, generator=gen))
    assert not k.codes.is_contiguous() and k.codes.untyped_storage().nbytes() > k.codes.numel()
    q, new = torch.randn(1, 8, 1, 64, generator=gen), torch.randn(1, 2, 1, 64, generator=gen)
    args = (q, k.codes, k.scales, k.residual, v.codes, v.scales, v.residual, new, new)
    _check(args, None, False, WINDOWED, torch.float32)


REFINED = QuantSpec(bits=4, scheme="token", group=64, rotate=True, clip=True, refine=64)
ASYM_REFINED = QuantSpec(bits=4, scheme="token", group=32, symmetric=False, refine=24)


@pytest.mark.parametrize(
    "past, q_len, dtype, spec",
    [(40, 1, torch.float16, REFINED), (300, 1, torch.float32, REFINED), (1100, 3, torch.bfloat16, REFINED),
     (1100, 1, torch.float32, REFINED), (500, 4, torch.float32, ASYM_REFINED)],
)  # fmt: skip
def test_attention_over_a_refined_plane(past, q_len, dtype, spec):
    """Codes grown by appends plus the second code plane of their newest tokens (``refine``)."""
    from kvpass.packed import PackedKV

    gen = torch.Generator().manual_seed(past)
    k, v = (PackedKV.from_float(torch.randn(2, 2, past - 37, 64, generator=gen).to(dtype), spec) for _ in "kv")
    for step in (30, 1, 5, 1):
        k, v = (t.append(torch.randn(2, 2, step, 64, generator=gen).to(dtype)) for t in (k, v))
    assert k.fine_codes.shape[2] == min(spec.refine, past // 8)
    q = torch.randn(2, 8, q_len, 64, generator=gen).to(dtype)
    new = torch.randn(2, 2, q_len, 64, generator=gen).to(dtype)
    args = (q, k.codes, k.scales, k.residual, v.codes, v.scales, v.residual, new, new)
    refined = _check(args, None, False, (spec, spec), dtype, fine=(k.fine_codes, k.fine_scales, v.fine_codes, v.fine_scales))
    if dtype == torch.float32:  # the plane is read: without it the output moves well past the tolerance
        unrefined = reference.attention(*args, None, 0.125, False, spec, spec)
        assert (refined - unrefined).abs().max() > 100 * TOLERANCE[dtype]["atol"]


SINKS_CENTERED = QuantSpec(bits=4, scheme="token", group=64, rotate=True, clip=True, refine=64, sinks=4, center=True)


@pytest.mark.parametrize(
    "past, q_len, causal, dtype, k_bits",
    [(3, 1, False, torch.float32, 4), (40, 1, False, torch.float16, 4), (70, 1, False, torch.float32, 4),
     (300, 4, True, torch.float32, 4), (1100, 1, False, torch.bfloat16, 4),
     (70, 1, False, torch.float32, 8), (300, 4, True, torch.float16, 8)],  # int8 K, int4 V: k_layer_bits
)  # fmt: skip
def test_attention_over_fp_sinks_and_an_offset(past, q_len, causal, dtype, k_bits):
    """K with fp sinks and quantized minus an offset (``sinks``, ``center``), V refined only:
    positions shift by the sinks in K and not in V, and both extras are read. A first append
    under 64 tokens takes one sink (16 or more) or none, and no offset: an offset of no rows."""
    from kvpass.packed import PackedKV

    k_spec = dataclasses.replace(SINKS_CENTERED, bits=k_bits)
    gen = torch.Generator().manual_seed(past)
    shared = 6 * torch.randn(2, 2, 1, 64, generator=gen)  # a mean direction all keys share
    k = PackedKV.from_float((shared + torch.randn(2, 2, past, 64, generator=gen)).to(dtype), k_spec)
    v = PackedKV.from_float(torch.randn(2, 2, past, 64, generator=gen).to(dtype), REFINED)
    for step in (30, 1):
        k = k.append((shared + torch.randn(2, 2, step, 64, generator=gen)).to(dtype))
        v = v.append(torch.randn(2, 2, step, 64, generator=gen).to(dtype))
    sinks, has_offset = k_spec.prefix(past)
    assert sinks == (4 if past >= PREFIX_MIN_TOKENS else 1 if past >= SHORT_PREFIX_MIN_TOKENS else 0)
    assert k.n_head == sinks and k.codes.shape[2] == past + 31 - sinks and v.codes.shape[2] == past + 31
    assert k.offset.shape == (2, 2, 1 if has_offset else 0, 64)
    assert not has_offset or k.offset.abs().max() > 1
    q = torch.randn(2, 8, q_len, 64, generator=gen).to(dtype)
    new = torch.randn(2, 2, q_len, 64, generator=gen).to(dtype)
    args = (q, k.codes, k.scales, k.residual, v.codes, v.scales, v.residual, new, new)
    extra = (k.fine_codes, k.fine_scales, v.fine_codes, v.fine_scales, k.head, k.offset, None, None)
    out = _check(args, None, causal, (k_spec, REFINED), dtype, fine=extra)
    if dtype == torch.float32 and not causal and has_offset:  # the sinks and the offset are read
        for dropped in (4, 5):
            other = list(extra)
            other[dropped] = torch.zeros_like(other[dropped])
            moved = reference.attention(*args, None, 0.125, causal, k_spec, REFINED, 0.0, *other)
            assert (out - moved).abs().max() > 100 * TOLERANCE[dtype]["atol"]


@pytest.mark.parametrize("held, q_len, dtype", [(1, 1, torch.float32), (40, 1, torch.float16), (63, 3, torch.bfloat16)])
def test_attention_over_a_k_cache_waiting_for_its_prefix(held, q_len, dtype):
    """K whose prefix is deferred (``defer_prefix``) under 64 tokens: no codes, sinks, offset or
    query scales, every token in the residual (rotated), read after no quantized block."""
    from kvpass.packed import PackedKV

    k_spec = dataclasses.replace(SINKS_CENTERED, query_scaled=True, defer_prefix=True)
    gen = torch.Generator().manual_seed(held)
    q = torch.randn(2, 8, q_len, 64, generator=gen).to(dtype)
    k = PackedKV.from_float(torch.randn(2, 2, held, 64, generator=gen).to(dtype), k_spec, q[:, :, :1].expand(-1, -1, held, -1))
    v = PackedKV.from_float(torch.randn(2, 2, held, 64, generator=gen).to(dtype), REFINED)
    assert k.codes.shape[2] == k.n_head == k.offset.shape[2] == 0 and k.residual.shape[2] == held
    new = torch.randn(2, 2, q_len, 64, generator=gen).to(dtype)
    args = (q, k.codes, k.scales, k.residual, v.codes, v.scales, v.residual, new, new)
    extra = (k.fine_codes, k.fine_scales, v.fine_codes, v.fine_scales, k.head, k.offset, None, None)
    _check(args, None, False, (k_spec, REFINED), dtype, fine=extra)


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_with_padding_mask(mask_kind, dtype):
    """Left padding: each sequence of the batch has a different number of valid keys."""
    batch, past = 3, 130
    specs = KIVI
    args = _inputs(batch, 8, 2, 1, past, 1, 64, dtype, specs, seed=7)
    valid = torch.tensor([past + 1, past - 40, 3])
    keep = torch.arange(past + 1)[None, :] >= (past + 1 - valid)[:, None]
    attn_mask = keep[:, None, None, :]
    if mask_kind == "additive":
        attn_mask = torch.where(attn_mask, 0.0, torch.finfo(dtype).min).to(dtype)
    _check(args, attn_mask, False, specs, dtype)


PREFILL_CASES = [
    # past, q_len, heads, head_dim, dtype, specs, mask: "causal" (is_causal), "chunk" (bool
    # mask, new tokens causal among themselves and seeing the whole past), "bias" (float)
    (0, 17, (8, 2), 64, torch.float16, "kivi", "causal"),
    (0, 40, (4, 1), 128, torch.float32, "rotated", "causal"),
    (64, 16, (8, 2), 64, torch.bfloat16, "kivi", "chunk"),
    (65, 9, (2, 2), 128, torch.float16, "int2_int8", "chunk"),
    (63, 33, (16, 2), 64, torch.float32, "token_groups", "chunk"),
    (300, 5, (8, 1), 64, torch.float16, "rotated", "bias"),
    (70, 20, (4, 2), 64, torch.float32, "kivi", "causal"),
    (129, 3, (6, 3), 80, torch.float16, "kivi", "chunk"),
    (130, 1, (8, 2), 64, torch.float16, "clipped", None),
    (65, 7, (4, 2), 128, torch.float32, "clipped", "chunk"),
    (0, 12, (4, 1), 64, torch.bfloat16, "clipped", "causal"),
]


@pytest.mark.parametrize("past, q_len, heads, head_dim, dtype, specs, mask", PREFILL_CASES)
def test_prefill_matches_reference(past, q_len, heads, head_dim, dtype, specs, mask):
    batch = 2
    q_heads, kv_heads = heads
    args = _inputs(batch, q_heads, kv_heads, q_len, past, q_len, head_dim, dtype, SPECS[specs], seed=past + q_len)
    _check(args, _prefill_mask(mask, batch, q_heads, q_len, past, dtype), mask == "causal", SPECS[specs], dtype)


def _prefill_mask(kind, batch, q_heads, q_len, past, dtype):
    """``"chunk"``: a chunk attending to all the past and causally to itself; ``"bias"``: additive noise."""
    total = past + q_len
    if kind == "chunk":
        return torch.arange(total)[None, :] <= torch.arange(q_len)[:, None] + past
    if kind == "bias":
        return torch.randn(batch, q_heads, q_len, total, generator=torch.Generator().manual_seed(3)).to(dtype)
    return None


ASYM_CASES = [
    # past, q_len, heads, head_dim, dtype, specs, mask (as in PREFILL_CASES; q_len 1 is decode)
    (130, 1, (8, 2), 64, torch.float16, "asym", None),
    (300, 1, (4, 1), 128, torch.float32, "asym", None),
    (65, 9, (4, 2), 64, torch.float32, "asym_int2_int8", "chunk"),
    (70, 5, (2, 2), 64, torch.bfloat16, "asym", "causal"),
]


@pytest.mark.parametrize("past, q_len, heads, head_dim, dtype, specs, mask", ASYM_CASES)
def test_asymmetric_matches_reference(past, q_len, heads, head_dim, dtype, specs, mask):
    """Zero points dequantized in registers: ``code * scale + zero``."""
    batch = 2
    q_heads, kv_heads = heads
    specs = SPECS_ASYM[specs]
    args = _inputs(batch, q_heads, kv_heads, q_len, past, q_len, head_dim, dtype, specs, seed=past + q_len)
    # A mostly one-signed K (as after a bias) is where zero points matter: shift it off zero.
    gen = torch.Generator().manual_seed(past)
    k = (torch.randn(batch, kv_heads, past, head_dim, generator=gen) * 0.5 + 1.0).to(dtype)
    args = (args[0], *_store(k, specs[0]), *args[4:])
    _check(args, _prefill_mask(mask, batch, q_heads, q_len, past, dtype), mask == "causal", specs, dtype)


def test_strided_output_and_fully_masked_row():
    """A row with every key masked is zero (as SDPA); ``out`` may be any view."""
    dtype = torch.float32
    args = _inputs(2, 4, 2, 3, 65, 3, 64, dtype, KIVI, seed=11)
    attn_mask = torch.ones(2, 4, 3, 68, dtype=torch.bool)
    attn_mask[1, 2, 0] = False
    out = torch.empty(2, 3, 4, 64, dtype=dtype).transpose(1, 2)
    _check(args, attn_mask, False, KIVI, dtype, out=out)
    assert not out[1, 2, 0].any()


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
def test_non_finite_stored_group_matches_reference():
    dtype = torch.float32
    args = list(_inputs(1, 4, 2, 1, 130, 1, 64, dtype, KIVI, seed=5))
    args[2] = args[2].clone()
    args[2][0, 1, 1, 7] = float("nan")  # one K channel group of the second KV head
    args[5] = args[5].clone()
    args[5][0, 0, 100, 0] = float("nan")  # one V token of the first KV head
    scale = 64**-0.5
    expected = reference.attention(*args, None, scale, False, *KIVI)
    assert expected[0, 2:].isnan().all() and expected[0, :2].isnan().all()  # poison is visible, not hidden
    out = attention(*args, None, scale, False, *KIVI)
    torch.testing.assert_close(out, expected, equal_nan=True, **TOLERANCE[dtype])


def test_attention_rejects_bad_shapes():
    args = list(_inputs(1, 6, 4, 1, 10, 1, 64, torch.float32, KIVI, seed=0))
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of KV heads \(4\)"):
        attention(*args, None, 0.125, False, *KIVI)
    args = list(_inputs(1, 4, 2, 1, 10, 1, 64, torch.float32, KIVI, seed=0))
    with pytest.raises(ValueError, match="does not broadcast"):
        attention(*args, torch.ones(1, 1, 1, 5, dtype=torch.bool), 0.125, False, *KIVI)
    rotated = (QuantSpec(4, "token", 64, rotate=True),) * 2
    args = list(_inputs(1, 4, 2, 1, 10, 1, 64, torch.float32, rotated, seed=0))
    extra = (None,) * 4
    with pytest.raises(ValueError, match=r"k_offset must be \[1, 2, 1, 64\]"):
        attention(*args, None, 0.125, False, *rotated, 0.0, *extra, None, torch.zeros(1, 2, 3, 64))
    with pytest.raises(ValueError, match="v_head must be float"):
        attention(*args, None, 0.125, False, *rotated, 0.0, *extra, None, None, torch.zeros(1, 2, 4, 32))
    span = (rotated[0], dataclasses.replace(rotated[1], span_heads=True))
    with pytest.raises(ValueError, match="groups spanning heads are read by kvpass.reference"):
        attention(*args, None, 0.125, False, *span)


@pytest.mark.parametrize("q_len", [1, 5])
def test_softcap_matches_reference(q_len):
    # Gemma-2 caps scores at 50; a cap of 1 makes the tanh bite on these random scores.
    dtype = torch.float32
    args = _inputs(2, 4, 2, q_len, 70, q_len, 64, dtype, ROTATED, seed=q_len)
    _check(args, None, q_len > 1, ROTATED, dtype, softcap=1.0)
    capped = reference.attention(*args, None, 0.125, q_len > 1, *ROTATED, 1.0)
    assert not torch.allclose(capped, reference.attention(*args, None, 0.125, q_len > 1, *ROTATED))


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_blocks_no_row_attends_are_not_read(mask_kind):
    """A static cache's decode: the whole buffer, no new tokens, the mask hiding what is not
    valid. Blocks excluded for every row of a (batch, head) are poisoned; the output is the
    reference over the clean buffer, so they were never loaded."""
    dtype, specs = torch.float32, ROTATED
    clean = _inputs(2, 4, 2, 1, 128, 0, 64, dtype, specs, seed=13)
    keep = torch.zeros(2, 1, 1, 128, dtype=torch.bool)
    keep[0, ..., :40] = True  # 40 tokens written
    keep[1, ..., 32:60] = True  # left padding of 32, then 28 tokens
    attn_mask = keep if mask_kind == "bool" else torch.where(keep, 0.0, float("-inf"))
    expected = reference.attention(*clean, attn_mask, 0.125, False, *specs)
    poisoned = list(clean)
    for i in (1, 2, 4, 5):  # K and V codes and scales
        poisoned[i] = clean[i].clone()
        for b, excluded in ((0, slice(64, 128)), (1, slice(0, 32)), (1, slice(64, 128))):
            poisoned[i][b, :, excluded] = 255 if i in (1, 4) else float("nan")
    out = attention(*poisoned, attn_mask, 0.125, False, *specs)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_kernels_read_only_the_globals_compiled_triton_accepts():
    # The interpreter runs a kernel as Python and reads any global; compiled Triton accepts only
    # tl.constexpr objects, other jit functions and modules, and stops at anything else (a plain
    # float, a `name: tl.constexpr = value` annotation) with a NameError that only a GPU shows.
    import importlib
    import types

    import triton.language as tl

    bad = []
    for module in (importlib.import_module(f"kvpass.kernels.{file}") for file in ("attention", "quantize")):
        for name, jitted in vars(module).items():
            python = jitted
            while hasattr(python, "fn"):  # an autotuner wraps the jit function, which wraps the Python one
                python = python.fn
            if python is jitted or not isinstance(python, types.FunctionType):
                continue  # not a Triton function
            for read in python.__code__.co_names:  # attribute names too; only the module's globals count
                value = vars(module).get(read)
                if value is not None and not isinstance(value, (tl.constexpr, types.ModuleType)) and not hasattr(value, "fn"):
                    bad.append(f"{module.__name__}.{name} reads {read} = {value!r}")
    assert not bad, bad


# --- the ops' CUDA kernels -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_cuda_kernels_given_cpu_tensors_agree_with_their_cpu_kernels(dtype, monkeypatch):
    """What a GPU would run, checked without one: each op's CUDA kernel (``ops._*_on_cuda``: the specs
    rebuilt from the op's scalars, the arguments passed on) given CPU tensors launches the Triton
    kernels here, through the interpreter (a decode step's calls the attention and quantize_refined ops,
    which go to their CPU kernels), against the op's CPU kernel: codes and scales bit for bit, attention
    within ``TOLERANCE``. The default spec's K: sinks, an offset, query scales, a second plane."""
    from kvpass import kernels, ops
    from kvpass.config import KVConfig
    from kvpass.packed import PackedKV, _attention_args

    launched = []

    def counted(name, kernel):
        return lambda *args: launched.append(name) or kernel(*args)

    for name in ("quantize", "quantize_refined", "attention"):
        monkeypatch.setattr(kernels, name, counted(name, getattr(kernels, name)))
    config = KVConfig()
    gen = torch.Generator().manual_seed(11)
    q_past = torch.randn(2, 4, 70, 64, generator=gen).to(dtype)
    k = PackedKV.from_float(torch.randn(2, 2, 70, 64, generator=gen).to(dtype), config.k, query=q_past)
    v = PackedKV.from_float(torch.randn(2, 2, 70, 64, generator=gen).to(dtype), config.v)
    assert k.n_head == 4 and all(reference.fixed_or_none(t) is not None for t in (k.offset, k.query_scales))
    q, k_new, v_new = (torch.randn(2, heads, 1, 64, generator=gen).to(dtype) for heads in (4, 2, 2))
    x = torch.randn(2, 2, 5, 64, generator=gen).to(dtype)
    for spec, offset in ((config.k, k.offset), (config.v, None)):
        codec = ops.codec_args(spec)
        for on_cuda, on_cpu, args in ((ops._quantize_on_cuda, ops._quantize_on_cpu, (x, *codec, offset)),
                                      (ops._quantize_refined_on_cuda, ops._quantize_refined_on_cpu,
                                       (x, *codec, spec.refine, offset))):  # fmt: skip
            assert all(bits_equal(a, b) for a, b in zip(on_cuda(*args), on_cpu(*args), strict=True))
    mask = torch.rand(2, 1, 1, k.shape[2] + 1, generator=gen) > 0.3
    args = _attention_args(q, k, v, k_new, v_new, mask, None, False, 0.0, None)
    # A kernel gets the arguments as called, also without the optional ones (softcap, planes, sinks,
    # offset): V's spec for K too, which has no sinks to leave out.
    plain_k = PackedKV.from_float(torch.randn(2, 2, 70, 64, generator=gen).to(dtype), config.v)
    required = _attention_args(q, plain_k, v, k_new, v_new, mask, None, False, 0.0, None)[: 12 + 2 * ops.SPEC_ARGS]
    for given in (args, required):
        torch.testing.assert_close(ops._attention_on_cuda(*given), ops._attention_on_cpu(*given), **TOLERANCE[dtype])
    args = decode_step_args(q, k, v, k_new, v_new, mask)
    sunk = (*decode_step_args(q, k, v, k_new, v_new, torch.zeros(mask.shape).masked_fill(~mask, -torch.inf)),
            torch.randn(2, 4, 1, 1, generator=gen).to(dtype))  # an attention sink's logits, with a float mask
    for given in (args, sunk):
        got, expected = ops._decode_step_on_cuda(*given), ops._decode_step_on_cpu(*given)
        assert all(bits_equal(a, b) for a, b in zip(got, expected, strict=True))
    # A launch a call: quantize, then the fused refined quantize, for K's spec and V's; the attention twice.
    # The decode steps' ops went to their CPU kernels.
    assert launched == ["quantize", "quantize_refined", "quantize", "quantize_refined", "attention", "attention"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_attention_over_an_mla_latent_as_k_and_v(dtype):
    """MLA decode attends over its latent (``kvpass/passes.py``, ``_absorb``): one KV head of 512 channels
    read as K and as V alike, 16 query heads, the rotary part of the scores as an additive mask."""
    from kvpass.packed import PackedKV

    spec = QuantSpec(bits=4, scheme="token", group=64, rotate=True, clip=True, refine=64)
    gen = torch.Generator().manual_seed(0)
    latent = PackedKV.from_float(torch.randn(1, 1, 150, 512, generator=gen).to(dtype), spec)
    latent = latent.append(torch.randn(1, 1, 1, 512, generator=gen).to(dtype))
    q = torch.randn(1, 16, 1, 512, generator=gen).to(dtype) * 0.2  # scores of a few units, as the scale makes them
    new = torch.randn(1, 1, 1, 512, generator=gen).to(dtype)
    mask = torch.randn(1, 16, 1, 152, generator=gen).to(dtype)
    stored = (latent.codes, latent.scales, latent.residual)
    fine = (latent.fine_codes, latent.fine_scales) * 2
    _check((q, *stored, *stored, new, new), mask, False, (spec, spec), dtype, fine=fine)
