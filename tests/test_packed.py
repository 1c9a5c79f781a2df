"""PackedKV: what HF cache code does to a cache tensor, done on int4 storage."""

import dataclasses
import io
import logging
import platform
import re

import pytest
import torch
import torch.nn.functional as F

import kvpass
from kvpass.cache_argument import cache_arg
from kvpass.config import (
    PREFIX_MIN_TOKENS, REFINE_SHARE, ROUNDED_APPEND_TOKENS, SHORT_PREFIX_MIN_TOKENS, KVConfig, QuantSpec,
)
from kvpass import packed, reference
from kvpass.packed import PackedKV
from kvpass.reference import quantize_dequantize
from kvpass.simulate import k_spec_as_stored
from tests.helpers import same_stored_bits

SPECS = [
    QuantSpec(4, "channel", 64),
    QuantSpec(4, "token", 128),
    QuantSpec(4, "token", 32, rotate=True),
    QuantSpec(4, "channel", 64, symmetric=False),
    QuantSpec(4, "token", 64, rotate=True, symmetric=False),
    QuantSpec(4, "token", 64, rotate=True, clip=True, refine=64),
    QuantSpec(4, "token", 64, rotate=True, clip=True, refine=56, sinks=4, center=True),
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
    n_quant = 256 - spec.sinks  # fp sinks are not quantized
    assert p.codes.dtype == torch.uint8 and p.codes.shape == (3, 2, n_quant, 32)
    assert p.head is None if not spec.sinks else (p.head.shape == (3, 2, spec.sinks, 64) and p.head.dtype == x.dtype)
    assert p.offset is None if not spec.center else p.offset.shape == (3, 2, 1, 64) and p.offset.dtype == torch.float16
    if spec.scheme == "channel":
        scales_shape = (3, 2, 4, 64)
    else:
        scales_shape = (3, 2, n_quant, 64 // min(spec.group, 64))
    # asymmetric: (scale, zero point) in a trailing dimension
    assert p.scales.shape == (scales_shape if spec.symmetric else (*scales_shape, 2))
    fp_parts = sum(t.numel() * t.element_size() for t in (p.head, p.offset) if t is not None)
    assert p.stored_bytes() - fp_parts <= 0.30 * x.numel() * 2


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


def test_an_append_of_another_batch_heads_or_head_dim_is_named(spec):
    """A cache handed to another batch or model: a fp cache's cat says "Sizes of tensors must match";
    the cache's own tokens would fail deeper down (a broadcast of head_dims in a fake trace)."""
    x, p = _packed(spec)
    B, H, _, D = x.shape
    for shape in ((B + 1, H, 1, D), (B, H * 2, 1, D), (B, H, 1, D // 2), (B, H, D)):
        with pytest.raises(ValueError, match=re.escape(f"cannot append tokens of shape {shape} to a kv4 cache of "
                                                       f"shape {tuple(p.shape)}: batch, heads and head_dim")):
            torch.cat([p, x.new_zeros(shape)], dim=-2)
    assert torch.cat([p, x[:, :, :1]], dim=-2).shape == (B, H, x.shape[2] + 1, D)


def test_batch_reorder_and_select(spec):
    x, p = _packed(spec)
    ref = quantize_dequantize(x, spec)
    order = torch.tensor([2, 0, 1])
    for reordered in (p.index_select(0, order), p[order]):
        assert isinstance(reordered, PackedKV)
        torch.testing.assert_close(reordered.dequantize(), ref[order], rtol=0, atol=0)
    # transformers' batch_repeat_interleave: the batch rows' stored bits repeated, not requantized
    repeated = p.repeat_interleave(2, dim=0)
    assert isinstance(repeated, PackedKV) and repeated.shape == (6, *p.shape[1:])
    assert all(same_stored_bits(repeated[torch.tensor(rows)], p) for rows in ([0, 2, 4], [1, 3, 5]))
    torch.testing.assert_close(repeated.dequantize(), ref.repeat_interleave(2, dim=0), rtol=0, atol=0)
    # along another dimension it stays a plain tensor, through the fallback
    torch.testing.assert_close(p.repeat_interleave(2, dim=1), ref.repeat_interleave(2, dim=1), rtol=0, atol=0)


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
    names = p.__tensor_flatten__()[0]
    assert len(names) == 4 + 2 * bool(spec.refine) + bool(spec.sinks) + spec.center  # filled_pads always
    for name in names:
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


def _attention_inputs(mask_kind, T=5, S=150):
    """GQA queries (4 heads over 2 KV heads) and a mask of ``mask_kind`` over ``S`` keys."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, T, 64, generator=generator)
    if mask_kind == "causal":
        return q, None
    keep = torch.arange(S)[None, :] >= torch.tensor([0, 7, 40])[:, None]  # left padding per sequence
    if mask_kind == "bool":
        return q, keep[:, None, None, :].expand(3, 1, T, S)
    bias = torch.randn(3, 4, T, S, generator=generator)  # an ALiBi-style additive bias per head
    return q, bias.masked_fill(~keep[:, None, None, :], float("-inf"))


@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive"])
def test_uncompiled_sdpa_reads_the_stored_cache_without_the_fallback(spec, mask_kind, monkeypatch):
    """F.scaled_dot_product_attention over PackedKV K and V (a model run without torch.compile)
    goes through kv4's blockwise attention, not a dequantized copy, and equals SDPA over the
    stored values."""
    torch.manual_seed(0)
    k, v = (PackedKV.from_float(torch.randn(3, 2, 150, 64), spec) for _ in range(2))
    q, mask = _attention_inputs(mask_kind, T=150 if mask_kind == "causal" else 5)
    monkeypatch.setattr(packed, "_fallback", lambda func, *_: pytest.fail(f"{func} went through the fallback"))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.dequantize(), v.dequantize(), attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kernel, mask_argument",
    [
        (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, "attn_mask"),
        (torch.ops.aten._scaled_dot_product_efficient_attention.default, "attn_bias"),
        (torch.ops.aten._scaled_dot_product_cudnn_attention.default, "attn_bias"),
        (torch.ops.aten._scaled_dot_product_flash_attention.default, None),
    ],
)
def test_each_fused_sdpa_kernel_reads_the_stored_cache(kernel, mask_argument):
    """The kernels SDPA picks on CPU and CUDA, called as it calls them: the attention output, and
    the other outputs shaped as the kernel's own meta function gives them."""
    k, v = (PackedKV.from_float(torch.randn(3, 2, 150, 64), KVConfig().k) for _ in range(2))
    q, mask = _attention_inputs("causal" if mask_argument is None else "additive")
    options = {"is_causal": mask is None, "scale": 0.3}
    if mask_argument == "attn_bias":
        options |= {"attn_bias": mask, "compute_log_sumexp": False}
    elif mask_argument:
        options[mask_argument] = mask
    out, *rest = kernel(q, k, v, **options)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.dequantize(), v.dequantize(), attn_mask=mask, is_causal=mask is None, scale=0.3, enable_gqa=True
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    as_meta = {name: t.to("meta") if isinstance(t, torch.Tensor) else t for name, t in options.items()}
    meta = kernel(*(t.to("meta") for t in (q, k.dequantize(), v.dequantize())), **as_meta)
    assert [getattr(t, "shape", t) for t in rest] == [getattr(t, "shape", t) for t in meta[1:]]


@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive"])
def test_sdpa_over_fake_caches_gives_the_output_it_has_for_real(mask_kind):
    # Dynamo's trace of SDPA over kv4 caches computes its output's shape alone (packed._shapes_only).
    from torch._subclasses.fake_tensor import FakeTensorMode

    k, v = (PackedKV.from_float(torch.randn(3, 2, 150, 64), KVConfig().k) for _ in range(2))
    q, mask = _attention_inputs(mask_kind, T=150 if mask_kind == "causal" else 5)
    mode = FakeTensorMode()
    fakes = [None if t is None else mode.from_tensor(t) for t in (q, k, v, mask)]
    with mode:
        fake = torch.nn.functional.scaled_dot_product_attention(*fakes[:3], attn_mask=fakes[3], is_causal=mask is None,
                                                                enable_gqa=True)  # fmt: skip
    real = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                            enable_gqa=True)  # fmt: skip
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


def test_an_op_without_an_int4_form_traced_over_fake_caches_dequantizes_nothing(monkeypatch):
    # transformers' repeat_kv over a cache (sdpa with a mask, as in a chat turn's prefill) reaches the
    # fallback in Dynamo's trace, which needs its output's shape alone.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.models.llama.modeling_llama import repeat_kv

    k = PackedKV.from_float(torch.randn(2, 3, 150, 64), KVConfig().k)
    real = repeat_kv(k, 2)
    torch.testing.assert_close(real, repeat_kv(k.dequantize(), 2), atol=0, rtol=0)
    mode = FakeTensorMode()
    fake_k = mode.from_tensor(k)
    monkeypatch.setattr(PackedKV, "dequantize", lambda self: pytest.fail("a fake cache was dequantized"))
    with mode:
        fake = repeat_kv(fake_k, 2)
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_sdpa_over_packed_inputs_compiles(backend):
    """A graph taking PackedKV inputs that no kv4 pass rewrote: Dynamo and AOTAutograd trace
    through the same implementation (its meta call included)."""
    k, v = (PackedKV.from_float(torch.randn(1, 2, 40, 64), KVConfig().k) for _ in range(2))
    q = torch.randn(1, 4, 3, 64)

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True) * 2

    torch._dynamo.reset()
    out = torch.compile(attend, backend=backend, fullgraph=True)(q, k, v)
    torch.testing.assert_close(out, attend(q, k.dequantize(), v.dequantize()), atol=1e-5, rtol=1e-5)


def test_sdpa_whose_query_needs_a_gradient_takes_the_fallback(caplog):
    """Training through a kv4 cache: the real kernel runs on the dequantized cache, so the backward
    gets the logsumexp it needs. A model called for inference without ``torch.no_grad()`` takes this
    path too, and the warning says how to leave it."""
    k, v = (PackedKV.from_float(torch.randn(1, 2, 20, 64), KVConfig().k) for _ in range(2))
    q = torch.randn(1, 2, 3, 64, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="kvpass"):
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
    assert "its inputs need grad" in caplog.text and "torch.no_grad()" in caplog.text
    expected = torch.randn(1, 2, 3, 64).copy_(q.detach()).requires_grad_()
    torch.nn.functional.scaled_dot_product_attention(expected, k.dequantize(), v.dequantize()).sum().backward()
    torch.testing.assert_close(q.grad, expected.grad)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"must be \[B, H, S, D\], got shape \(4, 8\)"):
        PackedKV.from_float(torch.randn(4, 8), QuantSpec())
    with pytest.raises(ValueError, match="must be floating point, got torch.int64"):
        PackedKV.from_float(torch.zeros(1, 1, 2, 8, dtype=torch.long), QuantSpec())
    with pytest.raises(TypeError, match=r"spec must be a kvpass.QuantSpec, got 'int4' \(str\); QuantSpec.from_tag"):
        PackedKV.from_float(torch.randn(1, 1, 2, 8), "int4")


# --- growth: appends write in place into spare rows -----------------------------------------


def _storage(t):
    return t.untyped_storage().data_ptr()


def test_append_writes_in_place_and_regrows_without_changing_any_view(spec):
    x, _ = _packed(spec, S=700)
    p = PackedKV.from_float(x[:, :, :300], spec)
    views = [p]
    for start in range(300, 700):
        views.append(views[-1].append(x[:, :, start : start + 1]))
    grown = views[-1]
    # Regrowth (300 + 256 spare rows run out at 556) resizes the storage every view shares.
    assert _storage(grown.codes) == _storage(p.codes) and _storage(grown.scales) == _storage(p.scales)
    torch.testing.assert_close(grown.dequantize(), quantize_dequantize(x, spec), rtol=0, atol=0)
    # Earlier views share the storage and still hold exactly their own tokens.
    for view in (views[0], views[100], views[299]):
        n = view.shape[2]
        torch.testing.assert_close(view.dequantize(), quantize_dequantize(x[:, :, :n], spec), rtol=0, atol=0)
    assert grown.reserved_bytes() >= grown.stored_bytes()


def test_token_appends_reuse_storage_until_it_is_full():
    spec = QuantSpec(4, "token", 64, rotate=True)
    x = torch.randn(1, 2, 600, 64)
    p = PackedKV.from_float(x[:, :, :100], spec)
    first = _storage(p.codes)
    storages = set()
    for start in range(100, 600):
        p = p.append(x[:, :, start : start + 1])
        storages.add(_storage(p.codes))
    # 100 rows + 256 spare: in place up to 356; the 357th row regrows to 357 + 256.
    assert first in storages and len(storages) <= 2
    assert p.codes.untyped_storage().nbytes() == (357 + 256) * 2 * 32


def test_stale_view_copies_instead_of_overwriting_the_newer_one(spec):
    x, _ = _packed(spec, S=300)
    base = PackedKV.from_float(x[:, :, :128], spec)
    newer = base.append(x[:, :, 128:200])
    other = torch.randn_like(x[:, :, :72])
    branch = base.append(other)  # base no longer ends at the last written row
    torch.testing.assert_close(newer.dequantize(), quantize_dequantize(x[:, :, :200], spec), rtol=0, atol=0)
    expected = quantize_dequantize(torch.cat([x[:, :, :128], other], dim=2), spec)
    torch.testing.assert_close(branch.dequantize(), expected, rtol=0, atol=0)


def test_sliding_window_eviction_compacts_instead_of_growing_forever():
    spec = QuantSpec(4, "token", 64)
    x = torch.randn(1, 2, 3000, 64)
    window = 100
    p = PackedKV.from_float(x[:, :, :window], spec)
    for start in range(window, 3000):
        p = p.append(x[:, :, start : start + 1])[:, :, 1:]  # DynamicSlidingWindowLayer's update
    assert p.shape[2] == window
    torch.testing.assert_close(p.dequantize(), quantize_dequantize(x[:, :, -window:], spec), rtol=0, atol=0)
    # Live rows + dead front + spare rows stay a small multiple of the window.
    assert p.codes.untyped_storage().nbytes() <= 4 * (window + 256) * 2 * 32


def test_deepcopy_and_save_do_not_share_or_save_spare_rows():
    import copy

    spec = QuantSpec(4, "token", 64)
    x = torch.randn(1, 2, 200, 64)
    p = PackedKV.from_float(x[:, :, :100], spec)
    twin = copy.deepcopy(p)
    grown, twin_grown = p.append(x[:, :, 100:150]), twin.append(x[:, :, 150:200])
    torch.testing.assert_close(grown.dequantize(), quantize_dequantize(x[:, :, :150], spec), rtol=0, atol=0)
    expected = quantize_dequantize(torch.cat([x[:, :, :100], x[:, :, 150:200]], dim=2), spec)
    torch.testing.assert_close(twin_grown.dequantize(), expected, rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(grown, buffer)
    assert buffer.tell() < grown.reserved_bytes()  # 150 rows saved, not 356


def test_compiled_decode_appends_in_place():
    from transformers import DynamicCache

    import kvpass
    from kvpass.models_zoo import build

    torch._dynamo.reset()
    model = build("llama")
    model.compile(backend=kvpass.kv4())
    cache = DynamicCache(config=model.config)
    storages = set()
    with torch.no_grad():
        out = model(torch.arange(2, 22)[None], **cache_arg(cache), use_cache=True)
        for _ in range(12):
            out = model(out.logits[:, -1:].argmax(-1), **cache_arg(cache), use_cache=True)
            storages.add(_storage(cache.layers[0].keys.codes))
    torch._dynamo.reset()
    assert isinstance(cache.layers[0].keys, PackedKV) and cache.layers[0].keys.shape[2] == 32
    assert len(storages) == 1  # every decode step wrote into the prefill's storage


def test_grown_parts_are_no_views_so_a_graph_fakes_them_from_their_own_sizes(spec):
    # Dynamo fakes a view taken in as a graph input through its base (the whole storage), which
    # cost a decode graph's trace a fifth of its time; the parts still share the growing storage.
    x, _ = _packed(spec, S=700)
    p = PackedKV.from_float(x[:, :, :300], spec)
    step = p.append(x[:, :, 300:301])
    grown = step.append(x[:, :, 301:700])  # past the spare rows: regrown
    stale = step.append(x[:, :, 301:302])  # no longer the newest view: a copy
    for cache in (p, step, grown, stale):
        parts = [cache.codes, cache.scales, *cache._fine_planes()]
        assert all(part._base is None for part in parts), [part._base is None for part in parts]
    assert _storage(step.codes) == _storage(p.codes) != _storage(stale.codes)


SHAPE_SPECS = [*SPECS, KVConfig().k]  # the default V is SPECS[5]


@pytest.mark.parametrize("spec", SHAPE_SPECS, ids=lambda s: s.tag)
@pytest.mark.parametrize("prompt", [3, 10, 63, 64, 127, 135, 600])
def test_an_append_on_fake_caches_gives_every_part_the_shape_it_has_for_real(spec, prompt):
    # A graph's shapes come from appends on fake caches, which compute shapes alone
    # (packed._shapes_only); the decode steps that then run must match them part for part.
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    x, q = torch.randn(2, 2, prompt + 5, 64), torch.randn(2, 4, prompt + 5, 64)
    for tokens in (1, 5):
        real = PackedKV.from_float(x[:, :, :prompt], spec, q[:, :, :prompt])
        mode = FakeTensorMode()
        fake, new, query = (mode.from_tensor(t) for t in (real, x[:, :, prompt:].clone(), q[:, :, prompt:].clone()))
        with mode:
            fake = fake.append(new[:, :, :tokens], query[:, :, :tokens])
        real = real.append(x[:, :, prompt : prompt + tokens], q[:, :, prompt : prompt + tokens])
        assert fake.shape == real.shape
        for name in real.__tensor_flatten__()[0]:
            fake_part, real_part = getattr(fake, name), getattr(real, name)
            assert (fake_part.shape, fake_part.dtype) == (real_part.shape, real_part.dtype), (name, tokens)


@pytest.mark.parametrize("spec", [s for s in SHAPE_SPECS if s.scheme == "token"], ids=lambda s: s.tag)
@pytest.mark.parametrize("evicted", [1, 3, 4, 5, 70, 140])
def test_an_eviction_on_fake_caches_gives_every_part_the_shape_it_has_for_real(spec, evicted):
    # A sliding window's eviction in a graph's trace computes shapes alone too, sinks, planes and
    # tail each cut where the range meets them (per-channel groups are not evicted natively).
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    x, q = torch.randn(2, 2, 140, 64), torch.randn(2, 4, 140, 64)
    real = PackedKV.from_float(x[:, :, :130], spec, q[:, :, :130]).append(x[:, :, 130:], q[:, :, 130:])
    mode = FakeTensorMode()
    fake = mode.from_tensor(real)
    with mode:
        fake = fake[:, :, evicted:]
    real = real[:, :, evicted:]
    assert fake.shape == real.shape == (2, 2, 140 - evicted, 64)
    assert real.n_head + real.codes.shape[2] + real.residual.shape[2] == 140 - evicted
    for name in real.__tensor_flatten__()[0]:
        assert getattr(fake, name).shape == getattr(real, name).shape, name


def test_copy_between_packed_caches_copies_the_stored_form(spec):
    x, p = _packed(spec)
    target = PackedKV.from_float(torch.zeros_like(x), spec)
    target.copy_(p)
    assert isinstance(target, PackedKV)
    for name in ("codes", "scales", "residual"):
        assert torch.equal(getattr(target, name), getattr(p, name))



@pytest.mark.parametrize("spec", [*SPECS, KVConfig().k], ids=lambda s: s.tag)
def test_tokens_that_need_grad_are_stored_without_their_autograd_record(spec):
    """A model called without ``torch.no_grad()`` appends tokens and queries that need grad. Quantizing
    has no gradient, and a stored record would keep the forward's activations alive as long as the
    cache: the cache stores the bits it stores for the tokens alone, and no record. The default K holds
    the first 40 tokens unquantized and quantizes all 70 at the second append."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.ones((), requires_grad=True)
    tokens = [(torch.randn(2, 2, n, 64, generator=gen), torch.randn(2, 4, n, 64, generator=gen)) for n in (40, 30, 1)]
    with_grad = [PackedKV.from_float(weight * tokens[0][0], spec, weight * tokens[0][1])]
    alone = [PackedKV.from_float(tokens[0][0], spec, tokens[0][1])]
    for new, query in tokens[1:]:
        with_grad.append(with_grad[-1].append(weight * new, weight * query))
        alone.append(alone[-1].append(new, query))
    for cache, expected in zip(with_grad, alone):
        assert not any(t.requires_grad for t in cache._inner())
        assert same_stored_bits(cache, expected)


def test_autocast_leaves_what_a_cache_stores_and_reads_as_it_is_without_it():
    """A model run under ``torch.autocast`` hands kv4 its tokens as they are; quantizing, reading and the
    fused step then compute as without it (autocast would run the rotation's and the statistics' matmuls
    in 16 bits, and CPU autocast's promotion rejected fp16 scales: a first append raised)."""
    gen = torch.Generator().manual_seed(5)
    spec_k, spec_v = KVConfig().k, KVConfig().v
    q, x, y = (torch.randn(2, heads, 100, 64, generator=gen) for heads in (4, 2, 2))
    q_step, k_step, v_step = (torch.randn(2, heads, 1, 64, generator=gen) for heads in (4, 2, 2))

    def run():
        k, v = PackedKV.from_float(x, spec_k, q), PackedKV.from_float(y, spec_v)
        out, k_grown, v_grown = packed.attend_and_append(q_step, k, v, k_step, v_step, query=q_step)
        return k_grown, v_grown, out, packed.attention(q_step, k, v, k_step, v_step), k_grown.dequantize()

    expected = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run()
    assert same_stored_bits(got[0], expected[0]) and same_stored_bits(got[1], expected[1])
    for a, b in zip(got[2:], expected[2:]):
        assert a.dtype == b.dtype and torch.equal(a, b)


# --- a static sliding-window layer's update: roll, write the last slot, copy back ----------

SLOT_SPECS = [QuantSpec(4, "token", 128), QuantSpec(4, "token", 32, rotate=True, symmetric=False)]


@pytest.mark.parametrize("slot_spec", SLOT_SPECS, ids=lambda s: s.tag)
def test_sliding_static_update_is_exact_in_int4_and_keeps_addresses(slot_spec):
    x, p = _packed(slot_spec, S=40)
    stored = p.dequantize()
    addresses = p.codes.data_ptr(), p.scales.data_ptr()
    rolled = p.roll(-1, dims=-2)
    assert isinstance(rolled, PackedKV)
    new = torch.randn(3, 2, 1, 64, dtype=x.dtype)
    rolled[:, :, torch.tensor([-1])] = new  # torch drops new's leading dims before index_put_
    p.copy_(rolled)
    # whole rows move (nothing requantized) and only the new token is quantized
    assert torch.equal(p.dequantize(), torch.cat([stored[:, :, 1:], quantize_dequantize(new, slot_spec)], dim=2))
    assert (p.codes.data_ptr(), p.scales.data_ptr()) == addresses


@pytest.mark.parametrize("slot_spec", SLOT_SPECS, ids=lambda s: s.tag)
def test_copying_floats_into_a_slot_buffer_quantizes_them_in_place(slot_spec):
    """A sliding layer's first update past its window keeps the newest tokens: ``copy_`` from fp."""
    p = PackedKV.zeros((3, 2, 40, 64), torch.float16, "cpu", slot_spec)
    addresses = p.codes.data_ptr(), p.scales.data_ptr()
    x = torch.randn(3, 2, 40, 64, dtype=torch.float16)
    p.copy_(x)
    assert torch.equal(p.dequantize(), quantize_dequantize(x, slot_spec))
    assert (p.codes.data_ptr(), p.scales.data_ptr()) == addresses


# --- an unquantized window of the newest tokens ---------------------------------------------

WINDOWED = [QuantSpec(4, "token", 64, window=64), QuantSpec(4, "token", 32, rotate=True, window=32)]


def _expected_windowed(x, spec):
    """Oldest whole blocks of 64 beyond the window quantized, the rest exact (stored domain round trip)."""
    S = x.shape[2]
    n_quant = max(S - spec.window, 0) // 64 * 64
    exact = reference_rotate_round_trip(x[:, :, n_quant:], spec)
    head = quantize_dequantize(x[:, :, :n_quant], dataclasses.replace(spec, window=0))
    return n_quant, torch.cat([head, exact], dim=2)


def reference_rotate_round_trip(x, spec):
    from kvpass.reference import rotate

    return rotate(rotate(x.float())).to(x.dtype) if spec.rotate else x


@pytest.mark.parametrize("wspec", WINDOWED, ids=lambda s: s.tag)
@pytest.mark.parametrize("S", [0, 1, 63, 64, 127, 128, 129, 300])
def test_window_keeps_the_newest_tokens_unquantized(wspec, S):
    x = torch.randn(2, 3, S, 64)
    p = PackedKV.from_float(x, wspec)
    n_quant, expected = _expected_windowed(x, wspec)
    assert p.codes.shape[2] == n_quant and p.residual.shape[2] == S - n_quant
    assert wspec.window <= p.residual.shape[2] < wspec.window + 64 or S < wspec.window + 64
    torch.testing.assert_close(p.dequantize(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("wspec", WINDOWED, ids=lambda s: s.tag)
def test_window_appends_match_building_in_one_go(wspec):
    x = torch.randn(1, 2, 400, 64)
    p = PackedKV.from_float(x[:, :, :10], wspec)
    for start in range(10, 400, 7):
        p = p.append(x[:, :, start : start + 7])
    whole = PackedKV.from_float(x, wspec)
    assert torch.equal(p.codes, whole.codes) and torch.equal(p.scales, whole.scales)
    torch.testing.assert_close(p.residual, whole.residual, rtol=0, atol=0)


def test_window_eviction_and_crop_cut_across_codes_and_residual():
    wspec = QuantSpec(4, "token", 64, window=64)
    x = torch.randn(1, 2, 300, 64)
    p = PackedKV.from_float(x, wspec)  # 192 quantized + 108 exact
    full = p.dequantize()
    for sl in (slice(150, 300), slice(200, 300), slice(100, 250)):
        part = p[:, :, sl]
        assert isinstance(part, PackedKV)
        torch.testing.assert_close(part.dequantize(), full[:, :, sl], rtol=0, atol=0)
    cropped = p[..., :-20, :]  # inside the window: the quantized rows are untouched...
    grown = cropped.append(x[:, :, 280:281])
    assert _storage(grown.codes) == _storage(p.codes)  # ...so appends stay in place
    torch.testing.assert_close(grown.dequantize()[:, :, :281], full[:, :, :281], rtol=0, atol=0)


# --- refinement plane (QuantSpec.refine) -----------------------------------------------------

REFINED = QuantSpec(4, "token", 32, clip=True, refine=40)


@pytest.mark.parametrize("S", [0, 15, 16, 200, 640, 641, 1000])
def test_refined_tokens_read_back_within_the_second_planes_bound(S):
    """The newest min(refine, S // 8) tokens carry the plane; their error is that of quantizing
    the first plane's error, so the plane's own scales bound it (unrotated, so per element)."""
    from kvpass.reference import error_bound

    x = torch.randn(2, 3, S, 64)
    p = PackedKV.from_float(x, REFINED)
    n_fine = min(40, S // 8)
    assert p.fine_codes.shape == (2, 3, n_fine, 32) and p.fine_scales.shape == (2, 3, n_fine, 2)
    error = (p.dequantize() - x).abs()
    bound = error_bound(p.fine_scales, REFINED).repeat_interleave(32, dim=-1)
    assert (error[:, :, S - n_fine :] <= bound).all()
    if n_fine:  # about 8-bit accurate, where the others are 4-bit
        assert error[:, :, S - n_fine :].mean() < error[:, :, : S - n_fine].mean() / 8
    unrefined = PackedKV.from_float(x, dataclasses.replace(REFINED, refine=0))
    assert p.stored_bytes() <= (1 + 1 / REFINE_SHARE) * unrefined.stored_bytes()


def test_refined_appends_match_building_in_one_go():
    x = torch.randn(1, 2, 900, 64)
    p = PackedKV.from_float(x[:, :, :10], REFINED)
    for start in range(10, 900, 89):  # a decode step, then a chunk: the plane shifts both ways
        p = p.append(x[:, :, start : start + 1])
        # Its rows start a storage: a graph taking the cache would specialise an offset of 0 and compile again.
        assert p.fine_codes.storage_offset() == p.fine_scales.storage_offset() == 0
        p = p.append(x[:, :, start + 1 : start + 89])
    assert p.shape[2] == 900
    whole = PackedKV.from_float(x, REFINED)
    for name in ("codes", "scales", "fine_codes", "fine_scales"):
        assert torch.equal(getattr(p, name), getattr(whole, name)), name
    assert torch.equal(p.dequantize(), quantize_dequantize(x, REFINED))


def test_eviction_crop_and_beam_select_keep_each_tokens_plane():
    x = torch.randn(3, 2, 700, 64)
    p = PackedKV.from_float(x, REFINED)  # the newest 40 tokens refined
    full = p.dequantize()
    # A sliding window's eviction keeps the newest tokens: the same as a cache built at its length
    # (the newest min(40, length // 8) refined), whatever it held before.
    for sl in (slice(200, 700), slice(680, 700), slice(699, 700)):
        part = p[:, :, sl]
        assert isinstance(part, PackedKV) and part.fine_codes.shape[2] == min(40, (sl.stop - sl.start) // 8)
        assert torch.equal(part.dequantize(), quantize_dequantize(x[:, :, sl], REFINED))
    # A crop keeps the planes its tokens had (never more than that length would have).
    for sl in (slice(0, 670), slice(0, 600), slice(100, 690)):
        part = p[:, :, sl]
        torch.testing.assert_close(part.dequantize(), full[:, :, sl], rtol=0, atol=0)
    # A crop into the plane keeps the surviving rows' planes; the regrown tail is refined anew.
    grown = p[..., :670, :].append(x[:, :, 670:700])
    assert grown.fine_codes.shape[2] == 40
    torch.testing.assert_close(grown.dequantize(), full, rtol=0, atol=0)
    order = torch.tensor([2, 0, 1])
    torch.testing.assert_close(p[order].dequantize(), full[order], rtol=0, atol=0)


def test_refine_needs_per_token_groups_without_a_window_and_static_caches_strip_it():
    with pytest.raises(ValueError, match="refine=8 needs scheme='token' and window=0"):
        QuantSpec(4, "channel", 64, refine=8)
    with pytest.raises(ValueError, match="refine=8 needs scheme='token' and window=0"):
        QuantSpec(4, "token", 64, window=64, refine=8)
    with pytest.raises(ValueError, match="refine must be an int >= 0"):
        QuantSpec(refine=-1)
    assert QuantSpec.from_tag("int4:token:64:rot:mse:r64") == QuantSpec(4, "token", 64, True, clip=True, refine=64)
    assert REFINED.for_slots.refine == 0
    with pytest.raises(ValueError, match="preallocated"):
        PackedKV.zeros((1, 1, 8, 64), torch.float16, "cpu", REFINED)


SINKS_CENTERED = QuantSpec(4, "token", 64, rotate=True, clip=True, refine=56, sinks=4, center=True)


def test_a_prompt_of_64_tokens_or_more_fixes_the_sinks_and_offset_a_shorter_one_its_first_token():
    torch.manual_seed(5)
    shared = 5 * torch.randn(2, 3, 1, 64)  # a mean direction all tokens share
    x = shared + torch.randn(2, 3, 90, 64)
    for first in (2, SHORT_PREFIX_MIN_TOKENS - 1):  # decode from empty, a very short prompt
        p = PackedKV.from_float(x[:, :, :first], SINKS_CENTERED).append(x[:, :, first:])
        assert p.n_head == 0 and p.codes.shape[2] == 90 and p.offset.shape[2] == 0
        assert p.fine_codes.shape[2] == SINKS_CENTERED.refined_tokens(90, 64) == 11  # no sinks to pay for
        torch.testing.assert_close(p.dequantize(), quantize_dequantize(x, SINKS_CENTERED, sinks=0), rtol=0, atol=0)
    for first in (SHORT_PREFIX_MIN_TOKENS, PREFIX_MIN_TOKENS - 1):  # a short prompt: one sink, no offset
        p = PackedKV.from_float(x[:, :, :first], SINKS_CENTERED).append(x[:, :, first:])
        assert p.n_head == 1 and p.codes.shape[2] == 89 and p.offset.shape[2] == 0
        assert torch.equal(p.head, reference.rotate(x[:, :, :1]).bfloat16())
        assert p.fine_codes.shape[2] == SINKS_CENTERED.refined_tokens(90, 64, 1) == 11  # one sink, unpaid at 64
        torch.testing.assert_close(p.dequantize(), quantize_dequantize(x, SINKS_CENTERED, sinks=1), rtol=0, atol=0)
    q = PackedKV.from_float(x[:, :, :PREFIX_MIN_TOKENS], SINKS_CENTERED).append(x[:, :, PREFIX_MIN_TOKENS:])
    assert q.n_head == 4 and q.codes.shape[2] == 86
    assert torch.equal(q.head, reference.rotate(x[:, :, :4]).bfloat16())  # rotated, 16 bits for an fp32 model
    assert torch.equal(q.offset, reference.center_offset(x[:, :, :PREFIX_MIN_TOKENS], SINKS_CENTERED))
    assert q.offset.abs().max() > 1
    whole = PackedKV.from_float(x, SINKS_CENTERED)
    assert torch.equal(whole.dequantize(), quantize_dequantize(x, SINKS_CENTERED))
    # Centering pays: the same tokens quantized minus the shared direction have a smaller error.
    plain = quantize_dequantize(x, dataclasses.replace(SINKS_CENTERED, center=False))
    assert (whole.dequantize() - x).norm() < 0.5 * (plain - x).norm()


@pytest.mark.parametrize("tokens", [64, 200, 1000, 5000])
def test_sinks_and_offset_are_paid_for_by_a_shorter_second_plane(tokens):
    spec = dataclasses.replace(SINKS_CENTERED, refine=64)
    assert spec.plane_cost(4, True, 64) == 15  # (4 sinks x (16 - 4.25) + 16 offset) bits per value / 4.25
    assert spec.plane_cost(0, True, 64) == 15  # an offset outlives its evicted sinks and goes on paying for them
    # A short prompt's one sink: free in groups of 64 channels, one refined token in narrower ones.
    assert [spec.plane_cost(1, False, d) for d in (32, 64, 96, 128, 256)] == [1, 0, 1, 0, 0]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.randn(1, 2, tokens, 64, dtype=dtype)
        with_prefix = PackedKV.from_float(x, spec)
        without = PackedKV.from_float(x, dataclasses.replace(spec, sinks=0, center=False))
        assert with_prefix.head.dtype == (torch.bfloat16 if dtype == torch.float32 else dtype)
        assert with_prefix.fine_codes.shape[2] == max(0, min(64, tokens // 8) - 15)
        if tokens >= 128:  # the plane is long enough to pay in full
            assert with_prefix.stored_bytes() <= without.stored_bytes()


@pytest.mark.parametrize("head_dim, worst_ratio", [(32, 0.34375), (64, 0.3447265625), (128, 0.3447265625)])
def test_short_prompts_sink_keeps_every_cache_length_under_the_sweeps_bound(head_dim, worst_ratio):
    # The default without a deferred prefix: K and V after every prompt of up to 24 tokens and each of
    # 24 decode steps (the short caches a 16-bit sink weighs most in) must stay under the support
    # sweep's 0.35x fp16; the worst case (8 tokens after a 6-token prompt) is the figure
    # docs/design.md gives.
    k_spec = dataclasses.replace(KVConfig().k, defer_prefix=False)
    specs = [spec.for_head_dim(head_dim) for spec in (k_spec, KVConfig().v)]
    worst = 0.0
    for prompt in range(1, 25):
        k, v = (PackedKV.from_float(torch.randn(1, 2, prompt, head_dim, dtype=torch.float16), s) for s in specs)
        assert k.n_head == (prompt >= SHORT_PREFIX_MIN_TOKENS)
        for _ in range(24):
            worst = max(worst, (k.stored_bytes() + v.stored_bytes()) / (2 * k.numel() * 2))
            k, v = (t.append(torch.randn(1, 2, 1, head_dim, dtype=torch.float16)) for t in (k, v))
    assert worst == worst_ratio <= 0.35


def test_sinks_leave_with_a_sliding_window_and_crops_cut_into_them():
    torch.manual_seed(6)
    x = torch.randn(1, 2, 300, 64)
    p = PackedKV.from_float(x, SINKS_CENTERED)
    full = p.dequantize()
    for sl in (slice(0, 2), slice(0, 4), slice(0, 150), slice(2, 300), slice(4, 300), slice(100, 300)):
        part = p[:, :, sl]
        assert part.n_head == max(0, min(4, sl.stop) - sl.start) and torch.equal(part.offset, p.offset)
        if sl.start == 0:  # a crop keeps every surviving value
            torch.testing.assert_close(part.dequantize(), full[:, :, sl], rtol=0, atol=0)
        else:  # eviction also drops second planes a cache of its length would not keep
            kept = part.dequantize()[:, :, : part.n_head + 100]
            torch.testing.assert_close(kept, full[:, :, sl][:, :, : part.n_head + 100], rtol=0, atol=0)
    order = torch.tensor([0, 0])
    torch.testing.assert_close(p[order].dequantize(), full[order], rtol=0, atol=0)


def test_sinks_and_center_settings_are_checked_and_static_caches_strip_them():
    for name, value in (("sinks", 4), ("center", True)):
        with pytest.raises(ValueError, match=f"{name}={value} needs scheme='token' and window=0"):
            QuantSpec(4, "channel", 64, **{name: value})
        with pytest.raises(ValueError, match=f"{name}={value} needs scheme='token' and window=0"):
            QuantSpec(4, "token", 64, window=64, **{name: value})
    with pytest.raises(ValueError, match="center=True needs symmetric=True"):
        QuantSpec(4, "token", 64, symmetric=False, center=True)
    with pytest.raises(ValueError, match="sinks must be an int >= 0"):
        QuantSpec(sinks=-1)
    assert QuantSpec.from_tag(SINKS_CENTERED.tag) == SINKS_CENTERED and SINKS_CENTERED.tag.endswith(":r56:s4:ctr")
    assert SINKS_CENTERED.for_slots == dataclasses.replace(SINKS_CENTERED, refine=0, sinks=0, center=False)
    with pytest.raises(ValueError, match="preallocated"):
        PackedKV.zeros((1, 1, 8, 64), torch.float16, "cpu", SINKS_CENTERED)


# The default's K rounded to nearest: these tests compare codes with from_float's, which would round
# against other queries than the appends did (query rounding's own tests are below).
QUERY_SCALED = dataclasses.replace(KVConfig().k, defer_prefix=False, query_rounded=0)


def _mismatched_queries_and_keys(tokens=120):
    """Keys whose spread sits in channels 0-15 (and their RoPE partners 32-47), queries whose energy
    sits in channels 16-31 (and 48-63): the error int4 spreads over every channel costs most where
    the queries look. Two KV heads, each read by two query heads."""
    g = torch.Generator().manual_seed(7)
    channel = torch.arange(64) % 32
    k_spread, q_spread = torch.where(channel < 16, 4.0, 0.5), torch.where(channel < 16, 0.5, 4.0)
    return torch.randn(2, 4, tokens, 64, generator=g) * q_spread, torch.randn(2, 2, tokens, 64, generator=g) * k_spread


def test_query_scales_are_fixed_by_a_prompt_and_its_queries_and_undone_on_reading():
    q, x = _mismatched_queries_and_keys()
    plain_spec = dataclasses.replace(QUERY_SCALED, query_scaled=False)
    p = PackedKV.from_float(x[:, :, :80], QUERY_SCALED, q[:, :, :80]).append(x[:, :, 80:])
    s = reference.query_key_scales(reference.query_energy(q[:, :, :80], 2, QUERY_SCALED), x[:, :, :80], QUERY_SCALED)
    assert p.query_scales.shape == (2, 2, 1, 64) and torch.equal(p.query_scales, s)
    assert torch.equal(s[..., :32], s[..., 32:]) and s[..., 16:32].min() > 4 * s[..., :16].max()
    # Stored: x * s as the plain spec stores it; read back divided by s.
    expected = PackedKV.from_float(x * s.float(), plain_spec).dequantize() / s.float()
    torch.testing.assert_close(p.dequantize(), expected, rtol=0, atol=1e-6)
    assert p.stored_bytes() == PackedKV.from_float(x, plain_spec).stored_bytes() + s.numel() * 2
    # The attention reads it with the query divided by s: the logits of the dequantized cache.
    v = PackedKV.from_float(torch.randn(2, 2, 120, 64), KVConfig().v)
    q_new, k_new, v_new = torch.randn(2, 4, 3, 64), torch.randn(2, 2, 3, 64), torch.randn(2, 2, 3, 64)
    fused = packed.attention(q_new, p, v, k_new, v_new)
    k_all = torch.cat([p.dequantize(), k_new], 2).repeat_interleave(2, 1)
    v_all = torch.cat([v.dequantize(), v_new], 2).repeat_interleave(2, 1)
    torch.testing.assert_close(fused, torch.nn.functional.scaled_dot_product_attention(q_new, k_all, v_all), rtol=0, atol=1e-5)
    # V is read as stored: a scaled one (K and V one tensor, as DeepSeek-V4's) would be read times s.
    with pytest.raises(ValueError, match="holds query scales: attention reads V as stored"):
        packed.attention(q_new, p, p, k_new, k_new)
    # What it is for: the queries' logits move less than with the plain spec's error.
    plain = PackedKV.from_float(x, plain_spec).dequantize()
    logit_error = [(q @ (k - x).repeat_interleave(2, 1).transpose(-1, -2)).std() for k in (p.dequantize(), plain)]
    assert logit_error[0] < 0.5 * logit_error[1]
    # Beam reordering, eviction, a dtype move and a save keep the scales.
    order = torch.tensor([1, 1])
    torch.testing.assert_close(p[order].dequantize(), p.dequantize()[order], rtol=0, atol=0)
    assert torch.equal(p[:, :, 10:].query_scales, s) and torch.equal(p.to(torch.float16).query_scales, s)
    buffer = io.BytesIO()
    torch.save(p, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer).dequantize(), p.dequantize())


def test_a_head_without_a_ratio_of_energies_stays_unscaled_and_finite():
    """A head whose first keys do not vary (a tiny random ZAYA's keys are all zero) or that no query
    reads has no energy ratio: its scales are 1, where 0/0 used to store NaN keys and NaN logits."""
    q, x = _mismatched_queries_and_keys()
    x[0, 1] = 0.5  # constant keys: no variance in any channel
    q[1, 2:] = 0  # KV head 1 of sequence 1: no query reads it
    s = reference.query_key_scales(reference.query_energy(q[:, :, :80], 2, QUERY_SCALED), x[:, :, :80], QUERY_SCALED)
    assert torch.equal(s[0, 1], torch.ones_like(s[0, 1])) and torch.equal(s[1, 1], torch.ones_like(s[1, 1]))
    assert s[0, 0].min() < 0.5 and s[1, 0].min() < 0.5  # the other heads keep theirs
    p = PackedKV.from_float(torch.zeros_like(x), QUERY_SCALED, q)
    assert torch.equal(p.query_scales, torch.ones_like(p.query_scales)) and torch.equal(p.dequantize(), torch.zeros_like(x))


def test_a_left_padded_row_stores_its_tokens_as_the_row_alone_does():
    """``generate`` pads a batch's shorter prompts on the left, and the mask hides the pads. With the
    pads the mask shows, K's offset, query scales and rounding leave them out, so the row's own tokens
    are stored as without the padding (before, a padding past 68 tokens gave the row a pad's offset,
    and a shorter one mixed pads into both)."""
    q, x = _mismatched_queries_and_keys(130)
    spec, pads = KVConfig().k, torch.tensor([0, 30])
    batch = PackedKV.from_float(x, spec, q, pads)
    alone = PackedKV.from_float(x[1:, :, 30:], spec, q[1:, :, 30:])
    unpadded = PackedKV.from_float(x, spec, q)
    assert torch.equal(batch.offset[1], alone.offset[0]) and torch.equal(batch.query_scales[1], alone.query_scales[0])
    assert torch.equal(batch.offset[0], unpadded.offset[0]) and torch.equal(batch.query_scales[0], unpadded.query_scales[0])
    assert not torch.equal(unpadded.offset[1], alone.offset[0])
    # Past the sinks (the pads' in the batch) and before the refined newest tokens: the same values.
    torch.testing.assert_close(batch.dequantize()[1, :, 34:110], alone.dequantize()[0, :, 4:80], rtol=0, atol=0)
    # A cache that waits for its prefix gathers the same statistics over the appends that bring it there
    # (of the held tokens as read back: equal to fp16's rounding).
    waiting = PackedKV.from_float(x[:, :, :40], spec, q[:, :, :40], pads).append(x[:, :, 40:], q[:, :, 40:], pads)
    assert waiting.query_scales.shape[2] == 1 and torch.equal(waiting.query_scales, batch.query_scales)
    torch.testing.assert_close(waiting.offset, batch.offset, rtol=1e-3, atol=1e-4)


def test_a_left_padded_row_fills_its_pads_with_its_first_tokens():
    """Told to (``fills_pads``, a site whose K and V store every token on its own), a first append
    copies a padded row's first tokens into its first pad slots: K's fp sinks are the row's own first
    tokens, as alone, where they were pads. Read as attention reads them (the copies for their tokens),
    the row's tokens are stored as the row alone stores them; the unpadded row, and rows with too few
    pads or too few tokens after them, as without filling. The attention gives SDPA's output over them."""
    q, x = _mismatched_queries_and_keys(130)
    spec, pads = KVConfig().k, torch.tensor([0, 30])
    filled = PackedKV.from_float(x, spec, q, pads, fills_pads=True)
    kept = PackedKV.from_float(x, spec, q, pads)
    alone = PackedKV.from_float(x[1:, :, 30:], spec, q[1:, :, 30:])
    assert filled.filled_pads.tolist() == [[0, 4], [30, 4]] and kept.filled_pads.shape == (2, 0)
    assert torch.equal(filled.head[1], alone.head[0]) and not torch.equal(kept.head[1], alone.head[0])
    # Up to the refined newest tokens, whose count is the cache's: the row alone's values, sinks included.
    torch.testing.assert_close(filled.dequantize()[1, :, 30:110], alone.dequantize()[0, :, :80], rtol=0, atol=0)
    torch.testing.assert_close(filled.dequantize()[0], kept.dequantize()[0], rtol=0, atol=0)
    for unfilled in (torch.tensor([0, 3]), torch.tensor([0, 127])):  # too few pads, too few tokens after them
        assert PackedKV.from_float(x, spec, q, unfilled, fills_pads=True).filled_pads[:, 0].tolist() == [0, 0]

    v = torch.randn_like(x)
    values = PackedKV.from_float(v, KVConfig().v, None, pads, fills_pads=True)
    q_step, k_new, v_new = torch.randn(2, 4, 1, 64), torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64)
    mask = torch.ones(2, 1, 1, 131, dtype=torch.bool)
    mask[1, ..., :30] = False
    out = packed.attention(q_step, filled, values, k_new, v_new, mask)
    keys, vals = torch.cat([filled.dequantize(), k_new], 2), torch.cat([values.dequantize(), v_new], 2)
    expected = F.scaled_dot_product_attention(q_step, keys, vals, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="filled their rows' pads differently"):
        packed.attention(q_step, filled, PackedKV.from_float(v, KVConfig().v), k_new, v_new, mask)
    with pytest.raises(ValueError, match="cannot fill a row's pads"):
        PackedKV.from_float(x, QuantSpec(bits=4, scheme="channel", group=64), None, pads, fills_pads=True)


def test_a_sliding_window_evicts_the_copies_with_the_oldest_slots():
    """A sliding window's eviction drops a cache's oldest slots, the copies first: a padded row's first
    tokens whose copies leave are read from their own slots again (int4, as without filling), the
    others still from their copies, and the attention reads the mask's columns accordingly."""
    q, x = _mismatched_queries_and_keys(130)
    spec, pads = KVConfig().k, torch.tensor([0, 30])
    filled = PackedKV.from_float(x, spec, q, pads, fills_pads=True)
    kept = PackedKV.from_float(x, spec, q, pads)
    evicted = filled[:, :, 2:]
    assert evicted.filled_pads.tolist() == [[0, 2], [30, 2]] and evicted.n_head == 2
    read, before = evicted.dequantize(), filled.dequantize()[:, :, 2:]
    torch.testing.assert_close(read[1, :, 30:], before[1, :, 30:], rtol=0, atol=0)  # copies 2, 3 and the rest
    torch.testing.assert_close(read[1, :, 28:30], kept.dequantize()[1, :, 30:32], rtol=0, atol=0)  # copies gone
    torch.testing.assert_close(read[0], kept.dequantize()[0, :, 2:], rtol=0, atol=0)
    assert filled[:, :, 10:].filled_pads.tolist() == [[0, 0], [30, 0]]
    values = PackedKV.from_float(torch.randn_like(x), KVConfig().v, None, pads, fills_pads=True)[:, :, 2:]
    q_step, k_new, v_new = torch.randn(2, 4, 1, 64), torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64)
    mask = torch.ones(2, 1, 1, 129, dtype=torch.bool)
    mask[1, ..., :28] = False
    out = packed.attention(q_step, evicted, values, k_new, v_new, mask)
    keys, vals = torch.cat([read, k_new], 2), torch.cat([values.dequantize(), v_new], 2)
    expected = F.scaled_dot_product_attention(q_step, keys, vals, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_crop_into_the_copied_tokens_gives_them_as_read():
    q, x = _mismatched_queries_and_keys(130)
    filled = PackedKV.from_float(x, KVConfig().k, q, torch.tensor([0, 30]), fills_pads=True)
    whole = filled.dequantize()
    kept = filled[:, :, :100]  # past every copied token: still the packed cache
    assert isinstance(kept, PackedKV) and kept.filled_pads.tolist() == [[0, 4], [30, 4]]
    torch.testing.assert_close(kept.dequantize(), whole[:, :, :100], rtol=0, atol=0)
    short = filled[:, :, :32]  # into them (a later append's tokens would take their slots): the fallback's
    assert not isinstance(short, PackedKV)
    torch.testing.assert_close(short, whole[:, :, :32], rtol=0, atol=0)


def test_the_pads_are_the_leading_slots_a_mask_hides_from_every_query():
    keep = torch.ones(3, 1, 5, 8, dtype=torch.bool).tril(3)  # causal over 3 earlier slots
    keep[1, :, :, :2] = False
    keep[2, :, :, :5] = False
    keep[2, :, :, 3] = True  # a hidden slot after a read one is not padding
    assert reference.masked_pads(keep, 3).tolist() == [0, 2, 3]
    assert reference.masked_pads(keep[1:2], 4).tolist() == [2] * 4  # a mask broadcast over the batch


def test_no_query_or_a_short_prompt_leaves_keys_unscaled():
    q, x = _mismatched_queries_and_keys()
    plain = PackedKV.from_float(x, dataclasses.replace(QUERY_SCALED, query_scaled=False)).dequantize()
    for first, query in ((80, None), (PREFIX_MIN_TOKENS - 1, q)):
        p = PackedKV.from_float(x[:, :, :first], QUERY_SCALED, None if query is None else query[:, :, :first])
        p = p.append(x[:, :, first:], q[:, :, first:])  # a later append's queries fix nothing
        assert p.query_scales.shape[2] == 0
        if first == 80:
            torch.testing.assert_close(p.dequantize(), plain, rtol=0, atol=0)
            # The eager twin reads such a cache with the spec kv4 stored it with: unscaled.
            assert not k_spec_as_stored(QUERY_SCALED, [p]).query_scaled
    scaled = PackedKV.from_float(x, QUERY_SCALED, q)
    assert k_spec_as_stored(QUERY_SCALED, [scaled]) == QUERY_SCALED


def test_query_scaled_setting_is_checked_and_static_caches_and_narrow_heads_strip_it():
    with pytest.raises(ValueError, match="query_scaled=True needs scheme='token' and window=0"):
        QuantSpec(4, "channel", 64, query_scaled=True)
    with pytest.raises(ValueError, match="query_scaled must be True or False"):
        QuantSpec(query_scaled=1)
    assert QUERY_SCALED.tag.endswith(":ctr:qs") and QuantSpec.from_tag(QUERY_SCALED.tag) == QUERY_SCALED
    assert not QUERY_SCALED.for_slots.query_scaled and not QUERY_SCALED.for_head_dim(16).query_scaled
    assert KVConfig().k.query_scaled and not KVConfig().v.query_scaled  # K's default


DEFERRED = dataclasses.replace(KVConfig().k, query_rounded=0)


@pytest.mark.parametrize("head_dim, worst_ratio", [(32, 0.3369140625), (64, 0.32080078125), (128, 0.32080078125)])
def test_a_deferred_prefix_keeps_every_cache_from_64_tokens_on_under_the_sweeps_bound(head_dim, worst_ratio):
    """The default's K and V from prompts of 1 to 63 tokens, decoded to 130: under 64 tokens K is
    16-bit (and its queries' energy 64-bit); from 64 on, with all of K's prefix fixed, every length
    stays under the support sweep's 0.35x fp16 (the worst case is the figure docs/design.md gives)."""
    specs = [spec.for_head_dim(head_dim) for spec in (KVConfig().k, KVConfig().v)]
    worst = 0.0
    for prompt in (1, 5, 6, 8, 24, 63):
        q = torch.randn(1, 4, prompt, head_dim, dtype=torch.float16)
        k, v = (PackedKV.from_float(torch.randn(1, 2, prompt, head_dim, dtype=torch.float16), spec, query)
                for spec, query in zip(specs, (q, None)))  # fmt: skip
        while k.shape[2] < 130:
            waiting = k.shape[2] < PREFIX_MIN_TOKENS
            assert k.waiting == waiting and k.n_head == (0 if waiting else 4)
            if waiting:
                assert k.stored_bytes() == k.numel() * 2 + 2 * head_dim * 8
            else:
                worst = max(worst, (k.stored_bytes() + v.stored_bytes()) / (2 * k.numel() * 2))
            new = torch.randn(1, 2, 1, head_dim, dtype=torch.float16)
            k, v = k.append(new, torch.randn(1, 4, 1, head_dim, dtype=torch.float16)), v.append(new)
    assert worst == worst_ratio <= 0.35


def test_a_deferred_prefix_holds_short_prompts_exact_then_quantizes_them_as_one_first_append():
    """``defer_prefix``: appends under 64 tokens in all hold them unquantized (16 bits) with their
    queries' energy; the append that reaches 64 stores what ``from_float`` stores for all the tokens
    held (as they read back) and new, with all their queries."""
    q, x = _mismatched_queries_and_keys()
    x = x.to(torch.bfloat16)
    steps = (8, 1, 30, 20, 5, 7)  # 64 held after five appends
    p, held = PackedKV.from_float(x[:, :, :0], DEFERRED), []
    for start, step in zip(torch.tensor((0, *steps)).cumsum(0).tolist(), steps):
        if p.shape[2] + step >= PREFIX_MIN_TOKENS:
            held = p
        p = p.append(x[:, :, start : start + step], q[:, :, start : start + step])
        if p.shape[2] >= PREFIX_MIN_TOKENS:
            break
        assert p.codes.shape[2] == p.n_head == p.query_scales.shape[2] == p.offset.shape[2] == 0
        assert "waiting for its prefix" in repr(p)
        # Held rotated, as the kernels read a residual: back within bf16's rounding of it.
        torch.testing.assert_close(p.dequantize(), x[:, :, : p.shape[2]], rtol=0.02, atol=0.02)
        energy = 2 * 2 * 64 * 8  # [B, H, 1, D] fp64
        assert p.stored_bytes() == x[:, :, : p.shape[2]].numel() * 2 + energy
    assert p.shape[2] == PREFIX_MIN_TOKENS and p.query_energy.shape[2] == 0
    tokens = torch.cat([held.dequantize(), x[:, :, held.shape[2] : 64]], 2)
    expected = PackedKV.from_float(tokens, DEFERRED, q[:, :, :64])
    assert expected.n_head == 4 and expected.query_scales.shape[2] == expected.offset.shape[2] == 1
    for name in p.__tensor_flatten__()[0]:
        assert torch.equal(getattr(p, name), getattr(expected, name)), name
    # Later appends quantize only their own tokens, as after any first append.
    assert torch.equal(p.append(x[:, :, 64:], q[:, :, 64:]).dequantize(), expected.append(x[:, :, 64:]).dequantize())
    # A first append of 64 or more has nothing to wait for.
    plain = dataclasses.replace(DEFERRED, defer_prefix=False)
    assert torch.equal(PackedKV.from_float(x, DEFERRED, q).dequantize(), PackedKV.from_float(x, plain, q).dequantize())


def test_a_waiting_cache_is_read_reordered_cropped_moved_and_saved_as_held():
    q, x = _mismatched_queries_and_keys(40)
    p = PackedKV.from_float(x, DEFERRED, q)
    v = PackedKV.from_float(torch.randn(2, 2, 40, 64), KVConfig().v)
    q_new, k_new, v_new = torch.randn(2, 4, 3, 64), torch.randn(2, 2, 3, 64), torch.randn(2, 2, 3, 64)
    k_all = torch.cat([p.dequantize(), k_new], 2).repeat_interleave(2, 1)
    v_all = torch.cat([v.dequantize(), v_new], 2).repeat_interleave(2, 1)
    expected = torch.nn.functional.scaled_dot_product_attention(q_new, k_all, v_all)
    torch.testing.assert_close(packed.attention(q_new, p, v, k_new, v_new), expected, rtol=0, atol=1e-5)
    order = torch.tensor([1, 1])
    for moved, read in ((p[order], p.dequantize()[order]), (p[:, :, :30], p.dequantize()[:, :, :30]),
                        (p.to(torch.float16), p.dequantize().half())):  # fmt: skip
        assert moved.waiting and moved.query_energy.shape[2] == 1
        torch.testing.assert_close(moved.dequantize(), read, rtol=0, atol=1e-2 if moved.dtype == torch.float16 else 0)
    assert torch.equal(p[order].query_energy, p.query_energy[order])
    buffer = io.BytesIO()
    torch.save(p, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert torch.equal(loaded.query_energy, p.query_energy) and torch.equal(loaded.dequantize(), p.dequantize())
    # Queries that do not read the new tokens are named.
    with pytest.raises(ValueError, match=r"queries \(2, 4, 5, 64\) do not read the new tokens \(2, 2, 3, 64\)"):
        p.append(k_new, torch.randn(2, 4, 5, 64))
    # Without the queries of every held token, the first append takes no query scales.
    blind = PackedKV.from_float(x, DEFERRED).append(torch.randn(2, 2, 30, 64), torch.randn(2, 4, 30, 64))
    assert blind.n_head == 4 and blind.query_scales.shape[2] == 0


def test_defer_prefix_setting_is_checked_and_static_caches_and_narrow_heads_strip_it():
    with pytest.raises(ValueError, match="defer_prefix=True needs sinks, center or query_scaled"):
        QuantSpec(4, "token", 64, defer_prefix=True)
    assert DEFERRED.tag.endswith(":qs:dp") and QuantSpec.from_tag(DEFERRED.tag) == DEFERRED
    assert not DEFERRED.for_slots.defer_prefix and not DEFERRED.for_head_dim(16).defer_prefix
    assert KVConfig().k.defer_prefix and not KVConfig().v.defer_prefix  # K's default


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_regrowth_can_return_freed_heap_memory_on_glibc():
    # Without it a CPU regrowth's copy lands on top of the freed memory glibc keeps (docs/bench-memory.md).
    assert packed._malloc_trim() is not None


def test_only_storages_of_at_least_trim_min_bytes_trim_the_heap_before_growing(monkeypatch):
    # A trim walks the whole heap (milliseconds); every layer of a model regrows on the same step.
    trims = []
    monkeypatch.setattr(packed, "_malloc_trim", lambda: trims.append)
    spec = QuantSpec(4, "token", 64)
    small = PackedKV.from_float(torch.randn(1, 2, 8, 64), spec)
    for _ in range(packed.MIN_SPARE_ROWS + 1):  # past its spare rows: one regrowth
        small = small.append(torch.randn(1, 2, 1, 64))
    assert small.codes.untyped_storage().nbytes() > packed.MIN_SPARE_ROWS * small.codes.stride(2)
    assert trims == []
    # A first append whose codes storage (with its spare rows) reaches the threshold trims once
    # before allocating it; the scales' storage, 32x smaller, does not.
    tokens = packed.TRIM_MIN_BYTES // (16 * 32) * 8 // 9 + 1
    large = PackedKV.from_float(torch.randn(1, 16, tokens, 64), spec)
    assert large.codes.untyped_storage().nbytes() >= packed.TRIM_MIN_BYTES
    assert large.scales.untyped_storage().nbytes() < packed.TRIM_MIN_BYTES
    assert trims == [0]
    packed._release_freed_heap(torch.device("meta"), packed.TRIM_MIN_BYTES)
    assert trims == [0]


LONG_PREFIX = dataclasses.replace(DEFERRED, prefix_tokens=160)


def test_prefix_tokens_set_the_tokens_k_statistics_come_from_and_how_long_a_deferred_k_waits():
    """``prefix_tokens=160``: the offset and query scales come from tokens 4-163 of a first append
    (a longer one fixes the same, where 64 would have stopped at 67), and a deferring K holds every
    token until 160, then stores what ``from_float`` stores for them."""
    q, x = _mismatched_queries_and_keys(240)
    x = x.to(torch.bfloat16)

    def statistics(n, spec):
        p = PackedKV.from_float(x[:, :, :n], spec, q[:, :, :n])
        return p.offset, p.query_scales

    for spec, tokens in ((dataclasses.replace(LONG_PREFIX, defer_prefix=False), 164), (QUERY_SCALED, 68)):
        assert all(map(torch.equal, statistics(tokens, spec), statistics(240, spec)))
        assert not any(map(torch.equal, statistics(tokens - 1, spec), statistics(240, spec)))
    assert not any(map(torch.equal, statistics(240, LONG_PREFIX), statistics(240, QUERY_SCALED)))
    p = PackedKV.from_float(x[:, :, :0], LONG_PREFIX)
    for start in range(0, 150, 50):  # 0-49, 50-99, 100-149 held
        p = p.append(x[:, :, start : start + 50], q[:, :, start : start + 50])
        assert p.waiting and p.codes.shape[2] == 0 and p.stored_bytes() == p.numel() * 2 + 2 * 2 * 64 * 8
    held = p.dequantize()
    p = p.append(x[:, :, 150:170], q[:, :, 150:170])
    expected = PackedKV.from_float(torch.cat([held, x[:, :, 150:170]], 2), LONG_PREFIX, q[:, :, :170])
    assert not p.waiting and p.n_head == 4
    for name in p.__tensor_flatten__()[0]:
        assert torch.equal(getattr(p, name), getattr(expected, name)), name


def test_prefix_tokens_setting_is_checked_tagged_and_stripped_with_what_uses_it():
    assert LONG_PREFIX.tag.endswith(":qs:p160:dp") and QuantSpec.from_tag(LONG_PREFIX.tag) == LONG_PREFIX
    assert ":p" not in DEFERRED.tag  # 64, the default, keeps the tags measured before
    with pytest.raises(ValueError, match=r"prefix_tokens must be an int >= 64 .* got 32"):
        dataclasses.replace(DEFERRED, prefix_tokens=32)
    with pytest.raises(ValueError, match="prefix_tokens=128 needs center, query_scaled or defer_prefix"):
        QuantSpec(4, "token", 64, sinks=4, prefix_tokens=128)
    assert LONG_PREFIX.for_slots.prefix_tokens == LONG_PREFIX.for_head_dim(16).prefix_tokens == 64
    assert kvpass.kv4(k_prefix_tokens=512).config.k == dataclasses.replace(KVConfig().k, prefix_tokens=512)


QUERY_ROUNDED = dataclasses.replace(KVConfig().k, defer_prefix=False, query_rounded=True)


def _codes_rounded_against(p: PackedKV, tokens: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The codes ``tokens`` (quantized ones, after any sinks) take in ``p`` when rounded against ``query``."""
    rounding = reference.rounding_coefficients(query, tokens.shape[1], p.query_scales, p.spec)
    scaled = reference.by_query_scales(tokens, p.query_scales, 1)
    return reference.encode(scaled, p.spec, p.offset, rounding=rounding)[0]


def test_query_rounded_appends_round_their_tokens_against_their_own_queries():
    """Each append's tokens take codes rounded against that append's queries (the first one's
    after its sinks), at the scales and bytes of rounding to nearest; an append without queries
    rounds to nearest."""
    q, x = _mismatched_queries_and_keys(90)
    nearest = dataclasses.replace(QUERY_ROUNDED, query_rounded=False)
    p, plain = PackedKV.from_float(x[:, :, :80], QUERY_ROUNDED, q[:, :, :80]), PackedKV.from_float(x[:, :, :80], nearest, q[:, :, :80])
    for start, stop, query in ((80, 81, q[:, :, 80:81]), (81, 85, q[:, :, 81:85]), (85, 90, None)):
        p, plain = p.append(x[:, :, start:stop], query), plain.append(x[:, :, start:stop])
        if query is not None:
            # What it is for: an append's own queries (a decode step's: a few directions) read far
            # less of its keys' error than of the nearest codes' (second plane included).
            read = [((query * (k.dequantize()[:, :, start:stop] - x[:, :, start:stop]).repeat_interleave(2, 1))
                     .sum(-1).pow(2).mean()) for k in (p, plain)]  # fmt: skip
            assert read[0] < 0.25 * read[1]
    for name in ("scales", "head", "offset", "query_scales", "fine_scales"):
        assert torch.equal(getattr(p, name), getattr(plain, name)), name
    assert p.stored_bytes() == plain.stored_bytes()
    assert torch.equal(p.codes[:, :, :76], _codes_rounded_against(p, x[:, :, 4:80], q[:, :, :80]))
    assert torch.equal(p.codes[:, :, 76:77], _codes_rounded_against(p, x[:, :, 80:81], q[:, :, 80:81]))
    assert torch.equal(p.codes[:, :, 77:81], _codes_rounded_against(p, x[:, :, 81:85], q[:, :, 81:85]))
    assert torch.equal(p.codes[:, :, 81:], plain.codes[:, :, 81:])  # no queries: to nearest
    assert not torch.equal(p.codes[:, :, :81], plain.codes[:, :, :81])


def test_query_rounding_from_n_tokens_rounds_only_appends_that_bring_n_tokens_of_queries():
    """``query_rounded=4``: appends of 4 tokens or more are rounded against their queries, shorter
    ones (and held tokens quantized by a shorter append) to nearest, so they store what rounding to
    nearest stores; the default's threshold is a prompt's 64 tokens."""
    q, x = _mismatched_queries_and_keys(127)
    spec, nearest = (dataclasses.replace(QUERY_ROUNDED, query_rounded=n) for n in (4, 0))
    p, plain = PackedKV.from_float(x[:, :, :80], spec, q[:, :, :80]), PackedKV.from_float(x[:, :, :80], nearest, q[:, :, :80])
    steps = ((80, 83), (83, 87), (87, 88), (88, 120))
    for start, stop in steps:
        p, plain = p.append(x[:, :, start:stop], q[:, :, start:stop]), plain.append(x[:, :, start:stop])
    assert p.spec.tag.endswith(":qr4") and p.stored_bytes() == plain.stored_bytes()
    assert "rounded against the queries of appends of 4+ tokens" in repr(p) and "rounded" not in repr(plain)
    assert torch.equal(p.codes[:, :, :76], _codes_rounded_against(p, x[:, :, 4:80], q[:, :, :80]))
    for start, stop in steps:
        got = p.codes[:, :, start - 4 : stop - 4]
        if stop - start >= 4:
            assert torch.equal(got, _codes_rounded_against(p, x[:, :, start:stop], q[:, :, start:stop]))
            assert not torch.equal(got, plain.codes[:, :, start - 4 : stop - 4])
        else:
            assert torch.equal(got, plain.codes[:, :, start - 4 : stop - 4])
    # A short deferred prompt quantized by a 1-token append rounds to nearest; by a 64-token one, not.
    default = dataclasses.replace(KVConfig().k, query_rounded=ROUNDED_APPEND_TOKENS)
    for step in (1, 64):
        held = PackedKV.from_float(x[:, :, :63], default, q[:, :, :63])
        p = held.append(x[:, :, 63 : 63 + step], q[:, :, 63 : 63 + step])
        tokens = torch.cat([held.dequantize(), x[:, :, 63 : 63 + step]], 2)
        to_nearest = PackedKV.from_float(tokens, dataclasses.replace(default, query_rounded=0), q[:, :, : 63 + step])
        assert torch.equal(p.codes, to_nearest.codes) == (step == 1)


def test_a_deferred_query_rounded_prefix_is_rounded_against_the_append_that_quantizes_it():
    """The held tokens' queries are not kept (only their energy): the append that reaches 64 tokens
    rounds all of them, held and new, against its own queries."""
    q, x = _mismatched_queries_and_keys(70)
    spec = dataclasses.replace(QUERY_ROUNDED, defer_prefix=True)
    p = PackedKV.from_float(x[:, :, :8], spec, q[:, :, :8]).append(x[:, :, 8:40], q[:, :, 8:40])
    held = p.dequantize()
    p = p.append(x[:, :, 40:70], q[:, :, 40:70])
    tokens = torch.cat([held, x[:, :, 40:70]], 2)
    plain = PackedKV.from_float(tokens, dataclasses.replace(spec, query_rounded=False), q)
    assert torch.equal(p.query_scales, plain.query_scales) and torch.equal(p.offset, plain.offset)
    assert torch.equal(p.codes, _codes_rounded_against(p, tokens[:, :, 4:], q[:, :, 40:70]))


def test_keys_stored_rounded_to_nearest_are_simulated_so():
    """A site that hands K no query stores it with a spec without query rounding: the twin reads
    every layer so, but not for heads too narrow to take it (their spec never has it)."""
    q, x = _mismatched_queries_and_keys(80)
    rounded, nearest = PackedKV.from_float(x, QUERY_ROUNDED, q), PackedKV.from_float(x, QUERY_SCALED, q)
    narrow = PackedKV.from_float(x[..., :16], QUERY_ROUNDED.for_head_dim(16), q[..., :16])
    assert k_spec_as_stored(QUERY_ROUNDED, [rounded, narrow]) == QUERY_ROUNDED
    assert k_spec_as_stored(QUERY_ROUNDED, [rounded, nearest]) == QUERY_SCALED


@pytest.mark.parametrize(
    "specs, head_dim, one_op",
    [
        ((KVConfig().k, KVConfig().v), 64, True),
        # Unrefined per-token caches: the op's second planes come back empty and are dropped.
        ((QuantSpec(4, "token", 32, sinks=4, center=True), QuantSpec(8, "token", 64, symmetric=False)), 64, True),
        ((KVConfig().k.for_head_dim(16), KVConfig().v.for_head_dim(16)), 16, True),  # groups spanning heads
        ((QuantSpec(4, "channel", 64), QuantSpec(4, "token", 128)), 64, False),
        ((QuantSpec(4, "token", 64, window=16), QuantSpec(4, "token", 64)), 64, False),
    ],
    ids=["default", "unrefined-sinks-int8-asym", "head-dim-16", "kivi-three-ops", "window-three-ops"],
)  # fmt: skip
def test_attend_and_append_is_attention_and_both_appends(specs, head_dim, one_op):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 100, head_dim, generator=gen)
    k = PackedKV.from_float(2 + torch.randn(2, 3, 100, head_dim, generator=gen), specs[0], query=q)
    v = PackedKV.from_float(torch.randn(2, 3, 100, head_dim, generator=gen), specs[1])
    q, k_new, v_new = (torch.randn(2, heads, 1, head_dim, generator=gen) for heads in (6, 3, 3))
    assert packed._steps_as_one(q, k, v, k_new, False, q) == one_op
    out, k_grown, v_grown = packed.attend_and_append(q, k, v, k_new, v_new, query=q)
    assert torch.equal(out, packed.attention(q, k, v, k_new, v_new))
    assert same_stored_bits(k_grown, k.append(k_new, query=q)) and same_stored_bits(v_grown, v.append(v_new))
