"""The kv4:: custom ops: opcheck (schema, fake, dispatch) and the CPU memory property."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvpass import ops, reference
from kvpass.config import KVConfig, QuantSpec
from tests.helpers import decode_step_args

KIVI = (QuantSpec(4, "channel", 64), QuantSpec(4, "token", 128))
ROTATED = (QuantSpec(4, "token", 64, rotate=True), QuantSpec(4, "token", 64, rotate=True))
ASYM = (QuantSpec(4, "channel", 64, symmetric=False), QuantSpec(4, "token", 64, rotate=True, symmetric=False))


def _stored(x, spec):
    n = x.shape[2] - x.shape[2] % spec.group if spec.scheme == "channel" else x.shape[2]
    stored = reference.rotate(x) if spec.rotate else x
    codes, scales = ops.quantize(x[:, :, :n], *ops.codec_args(spec))
    return codes, scales, stored[:, :, n:]


def _attention_args(past, new, specs, mask=False, dtype=torch.float32):
    torch.manual_seed(past + new)
    k_spec, v_spec = specs
    B, Hq, Hkv, D = 2, 4, 2, 8 if k_spec.span_heads else 64
    q = torch.randn(B, Hq, new, D, dtype=dtype)
    k, v = torch.randn(B, Hkv, past, D, dtype=dtype), torch.randn(B, Hkv, past, D, dtype=dtype)
    k_new, v_new = torch.randn(B, Hkv, new, D, dtype=dtype), torch.randn(B, Hkv, new, D, dtype=dtype)
    attn_mask = torch.rand(B, 1, new, past + new) > 0.3 if mask else None
    return (
        q, *_stored(k, k_spec), *_stored(v, v_spec), k_new, v_new, attn_mask, 0.125, new > 1,
        *ops.spec_args(k_spec), *ops.spec_args(v_spec),
    )  # fmt: skip


@pytest.mark.parametrize(
    "spec",
    [
        KIVI[0], KIVI[1], QuantSpec(2, "token", 32, True), QuantSpec(8, "channel", 32),
        QuantSpec(4, "token", 32, True, symmetric=False), QuantSpec(2, "channel", 32, symmetric=False),
        QuantSpec(4, "token", 64, True, clip=True), QuantSpec(4, "token", 64, True, clip=True, span_heads=True),
    ],
    ids=lambda s: s.tag,
)  # fmt: skip
def test_opcheck_quantize_and_dequantize(spec):
    x = torch.randn(2, 4, 64, 8 if spec.span_heads else 64)
    torch.library.opcheck(ops.quantize, (x, *ops.codec_args(spec)))
    codes, scales = ops.quantize(x, *ops.codec_args(spec))
    torch.library.opcheck(ops.dequantize, (codes, scales, x[:, :, :5], *ops.spec_args(spec)))


SPAN_HEADS = (QuantSpec(4, "token", 64, rotate=True, span_heads=True),) * 2


@pytest.mark.parametrize("specs", [KIVI, ROTATED, ASYM, SPAN_HEADS], ids=["kivi", "rotated", "asym", "span-heads"])
@pytest.mark.parametrize("past, new, mask", [(0, 4, False), (70, 1, False), (130, 3, True)])
def test_opcheck_attention(specs, past, new, mask):
    torch.library.opcheck(ops.attention, _attention_args(past, new, specs, mask))


def test_opcheck_with_8_bit_scales():
    # One KV head of 8 channels: groups of 8 values keep e5m2 scales (reference.scale_dtype).
    spec = QuantSpec(4, "token", 64, rotate=True, clip=True, span_heads=True)
    x = torch.randn(2, 1, 40, 8)
    torch.library.opcheck(ops.quantize, (x, *ops.codec_args(spec)))
    codes, scales = ops.quantize(x, *ops.codec_args(spec))
    assert scales.dtype == torch.uint8  # float8_e5m2's bits
    torch.library.opcheck(ops.dequantize, (codes, scales, x[:, :, :3], *ops.spec_args(spec)))
    k_codes, k_scales = ops.quantize(x.flip(2), *ops.codec_args(spec))
    q, new = torch.randn(2, 4, 3, 8), torch.randn(2, 1, 3, 8)
    args = (q, k_codes, k_scales, new[:, :, :0], codes, scales, new[:, :, :0], new, new.flip(3), None, 0.35, True)
    torch.library.opcheck(ops.attention, (*args, *ops.spec_args(spec), *ops.spec_args(spec)))


def test_opcheck_with_second_code_planes():
    """A refined spec's planes ride as optional trailing tensors of dequantize and attention."""
    from kvpass.packed import PackedKV

    spec = QuantSpec(4, "token", 64, True, clip=True, refine=64)
    k, v = (PackedKV.from_float(torch.randn(2, 2, 300, 64), spec) for _ in "kv")
    assert k.fine_codes.shape[2] == 300 // 8
    torch.library.opcheck(ops.dequantize, (k.codes, k.scales, k.residual, *ops.spec_args(spec), k.fine_codes, k.fine_scales))
    args = list(_attention_args(300, 2, (spec, spec), mask=True))
    args[1:4], args[4:7] = (k.codes, k.scales, k.residual), (v.codes, v.scales, v.residual)
    torch.library.opcheck(ops.attention, (*args, 0.0, k.fine_codes, k.fine_scales, v.fine_codes, v.fine_scales))


def test_opcheck_with_sinks_and_an_offset():
    """fp sinks and a centered spec's offset ride as optional trailing tensors too; quantizing
    with an offset is quantizing the stored tokens minus it."""
    from kvpass.packed import PackedKV

    spec = QuantSpec(4, "token", 64, True, clip=True, refine=56, sinks=4, center=True)
    x = 3 + torch.randn(2, 2, 300, 64)
    k, v = PackedKV.from_float(x, spec), PackedKV.from_float(torch.randn(2, 2, 300, 64), spec)
    torch.library.opcheck(ops.quantize, (x, *ops.codec_args(spec), k.offset))
    torch.library.opcheck(ops.quantize_refined, (x, *ops.codec_args(spec), spec.refine, k.offset))
    shifted = (reference.rotate(x).float() - k.offset.float()).contiguous()
    expected = reference.quantize(shifted, spec)
    assert all(torch.equal(a, b) for a, b in zip(ops.quantize(x, *ops.codec_args(spec), k.offset), expected))
    planes = (k.fine_codes, k.fine_scales)
    torch.library.opcheck(ops.dequantize, (k.codes, k.scales, k.residual, *ops.spec_args(spec), *planes, k.head, k.offset))
    args = list(_attention_args(300, 2, (spec, spec), mask=True))
    args[1:4], args[4:7] = (k.codes, k.scales, k.residual), (v.codes, v.scales, v.residual)
    extra = (*planes, v.fine_codes, v.fine_scales, k.head, k.offset, v.head, v.offset)
    torch.library.opcheck(ops.attention, (*args, 0.0, *extra))


@pytest.mark.parametrize("dtype, refined", [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)])
def test_opcheck_decode_step_and_it_is_attention_and_quantize_refined(dtype, refined):
    """A decode step's op: the attention op's result and quantize_refined's of each new token (in the
    cache's dtype, with its offset), bit for bit; unrefined specs get quantize's and empty planes."""
    from kvpass.packed import PackedKV

    k_spec = QuantSpec(4, "token", 64, True, clip=True, refine=56 if refined else 0, sinks=4, center=True)
    v_spec = QuantSpec(4, "token", 32, True, clip=True, refine=64 if refined else 0)
    k = PackedKV.from_float((3 + torch.randn(2, 2, 300, 64)).to(dtype), k_spec)
    v = PackedKV.from_float(torch.randn(2, 2, 300, 64, dtype=dtype), v_spec)
    q, k_new, v_new = torch.randn(2, 4, 1, 64), torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64, dtype=dtype)
    mask = torch.rand(2, 1, 1, k.shape[2] + 1) > 0.3
    stored = (k.codes, k.scales, k.residual, v.codes, v.scales, v.residual, k_new, v_new, mask, 0.125)
    extra = (0.0, k.fine_codes, k.fine_scales, v.fine_codes, v.fine_scales, k.head, k.offset, v.head, v.offset)
    args = (*stored, *ops.refined_codec_args(k_spec), *ops.refined_codec_args(v_spec), *extra)
    torch.library.opcheck(ops.decode_step, (q, *args, None))
    out, *parts = ops.decode_step(q, *args, None)
    expected = (
        ops.attention(q, *stored, False, *ops.spec_args(k_spec), *ops.spec_args(v_spec), *extra),
        *ops.quantize_refined(k_new.to(dtype), *ops.refined_codec_args(k_spec), k.offset),
        *ops.quantize_refined(v_new, *ops.refined_codec_args(v_spec), v.offset),
    )  # fmt: skip
    assert len(parts) == 8 and all(torch.equal(a, b) for a, b in zip((out, *parts), expected, strict=True))
    if not refined:
        assert all(torch.equal(a, b) for a, b in zip(parts[:2], ops.quantize(k_new, *ops.codec_args(k_spec), k.offset)))
        assert parts[2].shape[2] == parts[3].shape[2] == parts[6].shape[2] == parts[7].shape[2] == 0


def _default_caches_and_a_step(dtype, gen):
    """``(k, v, q, k_new, v_new)``: the default's caches of a 300-token prompt (K query-scaled by its 4
    query heads), and a decode step's query and new tokens."""
    from kvpass.packed import PackedKV

    q = torch.randn(2, 4, 300, 64, generator=gen, dtype=dtype)
    k = PackedKV.from_float(torch.randn(2, 2, 300, 64, generator=gen, dtype=dtype), KVConfig().k, query=q)
    v = PackedKV.from_float(torch.randn(2, 2, 300, 64, generator=gen, dtype=dtype), KVConfig().v)
    return k, v, *(torch.randn(2, heads, 1, 64, generator=gen, dtype=dtype) for heads in (4, 2, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_step_applies_ks_query_scales_as_attention_reads_and_an_append_stores(dtype):
    # q / s against stored keys k * s, and the new key stored as k_new * s: the op given the scales is
    # the op given q and k_new scaled beforehand (as packed.attention scales them), bit for bit.
    gen = torch.Generator().manual_seed(5)
    k, v, q, k_new, v_new = _default_caches_and_a_step(dtype, gen)
    assert reference.fixed_or_none(k.query_scales) is not None
    args = decode_step_args(q, k, v, k_new, v_new)
    got = ops.decode_step(*args)
    q_read, k_read = reference.read_with_query_scales(q, k_new, k.query_scales)
    expected = ops.decode_step(*decode_step_args(q_read, k, v, k_read, v_new)[:-1], None)
    assert not torch.equal(q_read, q)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    torch.library.opcheck(ops.decode_step, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_with_a_sink_attends_to_its_logit_and_stores_the_new_token_alone(dtype):
    # GPT-OSS's attention sink: one more logit per row, read as a zero key and value (reference.with_sink).
    gen = torch.Generator().manual_seed(6)
    k, v, q, k_new, v_new = _default_caches_and_a_step(dtype, gen)
    mask = torch.zeros(2, 1, 1, k.shape[2] + 1, dtype=dtype)
    mask[1, ..., :7] = float("-inf")
    sink = torch.randn(2, 4, 1, 1, generator=gen, dtype=dtype)
    args = (*decode_step_args(q, k, v, k_new, v_new, mask), sink)
    torch.library.opcheck(ops.decode_step, args)
    out, *parts = ops.decode_step(*args)
    q_read, k_read = reference.read_with_query_scales(q, k_new, k.query_scales)
    k_attended, v_attended, sink_mask = reference.with_sink(k_read, v_new, mask, sink)
    assert k_attended.shape[2] == 2 and not k_attended[:, :, 1].any() and sink_mask.shape == (2, 4, 1, k.shape[2] + 2)
    attended = decode_step_args(q_read, k, v, k_attended, v_attended, sink_mask)[:-1]
    assert torch.equal(out, ops.decode_step(*attended, None)[0])
    unsunk = ops.decode_step(*decode_step_args(q, k, v, k_new, v_new, mask))
    assert all(torch.equal(a, b) for a, b in zip(parts, unsunk[1:], strict=True))  # the new tokens alone
    assert not torch.allclose(out, unsunk[0], atol=1e-3)  # the sink takes its share of every row
    with pytest.raises(ValueError, match="an attention sink needs an additive float mask to carry its logit, got "
                                         "torch.bool"):  # fmt: skip
        ops.decode_step(*decode_step_args(q, k, v, k_new, v_new, mask == 0), sink)


@pytest.mark.parametrize("tokens", [1, 5, 100])
def test_quantize_refined_is_quantize_and_the_newest_tokens_second_plane(tokens):
    spec = QuantSpec(4, "token", 32, True, clip=True, refine=8)
    x = torch.randn(2, 3, tokens, 64, dtype=torch.float16)
    torch.library.opcheck(ops.quantize_refined, (x, *ops.codec_args(spec), spec.refine))
    codes, scales, fine_codes, fine_scales = ops.quantize_refined(x, *ops.codec_args(spec), spec.refine)
    assert fine_codes.shape[2] == fine_scales.shape[2] == min(tokens, spec.refine)
    expected_codes, expected_scales = ops.quantize(x, *ops.codec_args(spec))
    assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
    # The plane is the newest tokens' quantization error, quantized with the same spec.
    stored = reference.rotate(x[:, :, -fine_codes.shape[2] :])
    error = stored.float() - reference.dequantize(*reference.quantize(stored, spec), spec)
    expected_planes = reference.quantize(error, spec)
    assert torch.equal(fine_codes, expected_planes[0]) and torch.equal(fine_scales, expected_planes[1])


@pytest.mark.parametrize("tokens", [1, 70])
def test_opcheck_with_query_rounding(tokens):
    """A query-rounded K's append passes its shares (``reference.rounding_coefficients``) as one more
    optional tensor; the codes are the reference's rounded ones, the plane its newest tokens' error."""
    spec = QuantSpec(4, "token", 64, True, clip=True, refine=64, query_rounded=True)
    x = torch.randn(2, 2, tokens, 128)
    q = torch.randn(2, 4, 1, 128) * 2 + 0.2 * torch.randn(2, 4, tokens, 128)
    rounding = reference.rounding_coefficients(q, 2, None, spec)
    offset = torch.randn(2, 2, 1, 128).to(torch.float16)
    torch.library.opcheck(ops.quantize, (x, *ops.codec_args(spec), offset, rounding))
    torch.library.opcheck(ops.quantize_refined, (x, *ops.codec_args(spec), spec.refine, offset, rounding))
    codes, scales, fine_codes, fine_scales = ops.quantize_refined(x, *ops.codec_args(spec), spec.refine, offset, rounding)
    stored = (reference.rotate(x).float() - offset.float()).contiguous()
    expected = reference.quantize(stored, spec, rounding)
    assert torch.equal(codes, expected[0]) and torch.equal(scales, expected[1])
    assert not torch.equal(codes, reference.quantize(stored, spec)[0])
    error = stored[:, :, -fine_codes.shape[2] :] - reference.dequantize(*expected, spec)[:, :, -fine_codes.shape[2] :]
    assert all(torch.equal(a, b) for a, b in zip((fine_codes, fine_scales), reference.quantize(error, spec)))


def test_asymmetric_scales_carry_zero_points_in_a_trailing_dimension():
    x = torch.randn(1, 2, 128, 64) + 5.0
    for spec, shape in [(ASYM[0], (1, 2, 2, 64, 2)), (ASYM[1], (1, 2, 128, 1, 2))]:
        codes, scales = ops.quantize(x, *ops.codec_args(spec))
        assert codes.shape == (1, 2, 128, 32) and scales.shape == shape
        expected = reference.encode(x, spec)
        assert torch.equal(codes, expected[0]) and torch.equal(scales, expected[1])
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake_codes, fake_scales = ops.quantize(mode.from_tensor(x), *ops.codec_args(spec))
        assert fake_scales.shape == shape and fake_codes.shape == codes.shape


def test_cpu_attention_never_dequantizes_more_than_a_block(monkeypatch):
    """The whole fp cache is never materialised: each dequantization covers one block."""
    largest = []
    original = reference.dequantize_field_major

    def recording(codes, *args, **kwargs):
        largest.append(codes.shape[2])
        return original(codes, *args, **kwargs)

    monkeypatch.setattr(reference, "dequantize_field_major", recording)
    block = reference._block_tokens(*KIVI, 2 * 2 * 64)  # _attention_args: 2 sequences, 2 KV heads of 64
    past = 3 * block + 100
    args = _attention_args(past=past, new=1, specs=KIVI)
    out = ops.attention(*args)
    assert len(largest) >= past // block and max(largest) <= block < past
    assert out.shape == (2, 4, 1, 64) and out.isfinite().all()


def test_an_untraced_call_skips_the_dispatcher_and_gives_the_ops_results(monkeypatch):
    """``ops.call`` runs an op's CPU kernel itself only where nothing but that kernel would see the
    call; the dispatcher, made to fail here, must still be reached by a fake, a grad or a mode."""
    spec = QuantSpec(4, "token", 64, True, clip=True, refine=64)
    x = torch.randn(2, 3, 5, 64)
    quantize_args = (x, *ops.codec_args(spec), spec.refine)
    attention_args = _attention_args(70, 1, ROTATED)
    expected = [ops.quantize_refined(*quantize_args), ops.attention(*attention_args)]

    def dispatched(op, *args, **kwargs):
        raise AssertionError(f"{op} went through the dispatcher")

    monkeypatch.setattr(type(ops.attention), "__call__", dispatched)
    got = [ops.call(ops.quantize_refined, *quantize_args), ops.call(ops.attention, *attention_args)]
    assert all(torch.equal(a, b) for a, b in zip(got[0], expected[0])) and torch.equal(got[1], expected[1])
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode, pytest.raises(AssertionError, match="dispatcher"):
        ops.call(ops.quantize_refined, mode.from_tensor(x), *quantize_args[1:])
    with TorchDispatchMode(), pytest.raises(AssertionError, match="dispatcher"):  # plain tensors, a mode watching
        ops.call(ops.quantize_refined, *quantize_args)
    with pytest.raises(AssertionError, match="dispatcher"):
        ops.call(ops.quantize_refined, x.clone().requires_grad_(), *quantize_args[1:])
    with torch.device("cpu"), pytest.raises(AssertionError, match="dispatcher"):
        ops.call(ops.attention, *attention_args)
