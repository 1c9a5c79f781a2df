"""The Triton kernels, compiled for the GPU, against the reference on random inputs.

The CPU tests run the same kernels under the Triton interpreter, which cannot see GPU-only
behaviour (approximate division, bf16 tensor-core dots, NaN-dropping max, layouts, which globals
a kernel may read); this runs natively, including odd shapes. Every check runs, each case printed,
and the exit status is non-zero if any failed or raised. Check names as arguments run only those:

    python benchmarks/gpu_check.py [check_quantize check_attention ...]
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback

import torch

from kvpass import reference
from kvpass.cache_argument import cache_arg
from kvpass.config import KVConfig, QuantSpec

# Same tolerances, for the same reasons, as tests/test_kernels.py: operands rounded to the
# input dtype before tensor-core dots with fp32 accumulation.
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=6e-3, rtol=6e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}
KIVI = (QuantSpec(4, "channel", 64), QuantSpec(4, "token", 128))
ROTATED = (QuantSpec(4, "token", 128, rotate=True), QuantSpec(4, "token", 128, rotate=True))
INT2_INT8 = (QuantSpec(2, "channel", 16), QuantSpec(8, "token", 32))
# Clipped scales (negative scales, code -8), a second code plane; K also fp sinks and an offset.
DEFAULT = (KVConfig().k, KVConfig().v)
K8_LAYER = (dataclasses.replace(DEFAULT[0], bits=8), DEFAULT[1])  # a layer kv4(k_layer_bits={i: 8}) names

QUANTIZE_CASES = [
    (QuantSpec(4, "token", 128), (3, 8, 1000, 128)),
    (QuantSpec(4, "token", 128), (2, 4, 17, 80)),
    (QuantSpec(4, "channel", 64), (2, 8, 4096, 128)),
    (QuantSpec(2, "channel", 32), (1, 3, 96, 96)),
    (QuantSpec(8, "token", 32), (2, 2, 33, 64)),
    (QuantSpec(2, "token", 2), (1, 2, 7, 64)),
    (QuantSpec(4, "token", 64, clip=True), (3, 8, 1000, 128)),
    (QuantSpec(4, "channel", 64, clip=True), (2, 8, 4096, 128)),
    (QuantSpec(8, "token", 32, clip=True), (2, 2, 33, 64)),
    # Asymmetric: the reference's (hi - lo) / code_max must divide as the kernel does on CUDA too.
    (QuantSpec(4, "token", 64, symmetric=False), (3, 8, 1000, 128)),
    (QuantSpec(4, "channel", 64, symmetric=False), (2, 8, 4096, 128)),
]
# batch, q heads, kv heads, q_len, past, head_dim, dtype, specs, mask ("causal", "chunk", "pad", None)
ATTENTION_CASES = [
    (1, 32, 8, 1, 4095, 128, torch.float16, KIVI, None),
    (4, 32, 8, 1, 1000, 128, torch.bfloat16, KIVI, "pad"),
    (3, 8, 1, 1, 777, 64, torch.float16, ROTATED, None),
    (2, 12, 12, 1, 129, 64, torch.float32, INT2_INT8, None),
    (2, 10, 2, 1, 300, 80, torch.float16, KIVI, "pad"),
    (1, 32, 8, 1, 0, 128, torch.float16, KIVI, None),
    (2, 32, 8, 300, 0, 128, torch.float16, KIVI, "causal"),
    (2, 28, 4, 77, 513, 128, torch.bfloat16, KIVI, "chunk"),
    (1, 16, 16, 130, 65, 64, torch.float32, ROTATED, "chunk"),
    (1, 14, 2, 64, 4000, 96, torch.float16, KIVI, "causal"),
    (2, 32, 8, 1, 4095, 128, torch.bfloat16, DEFAULT, "pad"),
    (1, 16, 4, 33, 1000, 64, torch.float16, DEFAULT, "chunk"),
    (2, 8, 1, 1, 4095, 256, torch.bfloat16, K8_LAYER, "pad"),
    # An MLA latent's decode (kvpass/passes.py, _absorb): one KV head of 512 channels, V's spec for both.
    (2, 16, 1, 1, 4095, 512, torch.bfloat16, (DEFAULT[1], DEFAULT[1]), "pad"),
]


def _store(x, spec):
    """``(codes, scales, residual)`` and the second code plane (``(None, None)`` without ``refine``)."""
    stored = reference.rotate(x) if spec.rotate else x
    n_quant = x.shape[2] - x.shape[2] % spec.group if spec.scheme == "channel" else x.shape[2]
    codes, scales = reference.quantize(stored[:, :, :n_quant], spec)
    fine = reference.second_plane(stored[:, :, :n_quant], codes, scales, spec) if spec.refine else (None, None)
    return (codes, scales, stored[:, :, n_quant:].contiguous()), fine


def check_quantize(kernels) -> bool:
    ok = True
    for spec, shape in QUANTIZE_CASES:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            x = (torch.randn(shape, device="cuda") * 3).to(dtype)
            x[0, 0, 0] = 0
            x[0, -1, 1, 3] = float("nan")
            x[-1, 0, 2, 1] = float("inf")
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
            codes_ref, scales_ref = reference.quantize(x, spec)
            codes, scales = kernels.quantize(x, spec)
            same = torch.equal(codes, codes_ref) and torch.equal(scales.isnan(), scales_ref.isnan())
            same = same and torch.equal(scales.nan_to_num(0).view(torch.int16), scales_ref.nan_to_num(0).view(torch.int16))
            ok &= same
            print(f"quantize {spec.tag:18} {str(list(shape)):22} {str(dtype)[6:]:8} {'ok' if same else 'MISMATCH'}")
            if not same:
                _describe_mismatch(x, spec, codes, scales, codes_ref, scales_ref)
    return ok


def _describe_mismatch(x, spec, codes, scales, codes_ref, scales_ref) -> None:
    """How many codes and scales differ, and the first differing scale's group (to tell a
    division's or a conversion's rounding from a wrong index)."""
    code_diff = (codes != codes_ref).nonzero()
    scale_diff = ((scales.view(torch.int16) != scales_ref.view(torch.int16)) & ~(scales.isnan() & scales_ref.isnan())).nonzero()
    print(f"    {len(code_diff)} of {codes.numel()} code bytes differ (first {code_diff[:3].tolist()}), "
          f"{len(scale_diff)} of {scales.numel()} scales (first {scale_diff[:3].tolist()})")
    if len(scale_diff):
        where = tuple(scale_diff[0].tolist())
        print(f"    scale at {where}: kernel {scales[where].item()!r} reference {scales_ref[where].item()!r}")
        if spec.scheme == "token":
            b, h, t, g = where[:4]
            group = x[b, h, t, g * spec.group : (g + 1) * spec.group].float()
            print(f"    its group's amax {group.abs().max().item()!r} ({spec.group} values)")


def check_quantize_refined() -> bool:
    """``kv4::quantize_refined`` on CUDA (one Triton launch for the codes and the plane) against the
    reference run on the same CUDA tensors (so both rotate with the same matmul)."""
    from kvpass import ops

    ok = True
    spec = DEFAULT[0]
    for tokens in (1, 5, 100):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            x = (torch.randn(2, 3, tokens, 128, device="cuda") * 3).to(dtype)
            got = ops.quantize_refined(x, *ops.codec_args(spec), spec.refine)
            expected = reference.encode_refined(x, spec)
            same = all(torch.equal(a, b) for a, b in zip(got, expected))
            ok &= same
            print(f"quantize_refined {spec.tag:18} T{tokens:<4} {str(dtype)[6:]:8} {'ok' if same else 'MISMATCH'}")
    return ok


def check_decode_step() -> bool:
    """``kv4::decode_step`` on CUDA (a layer's attention and both appends in one op) against the three
    calls it stands for, on the same caches: equal, as it calls the same kernels. The default's caches
    and the same without a second plane (``refine=0``: quantize's launch, empty planes)."""
    from kvpass import packed
    from kvpass.packed import PackedKV

    ok = True
    unrefined = tuple(dataclasses.replace(spec, refine=0) for spec in DEFAULT)
    for specs, dtype in ((DEFAULT, torch.float16), (DEFAULT, torch.bfloat16), (unrefined, torch.float16)):
        q = torch.randn(2, 24, 300, 128, device="cuda", dtype=dtype)
        k = PackedKV.from_float(torch.randn(2, 8, 300, 128, device="cuda", dtype=dtype), specs[0], query=q)
        v = PackedKV.from_float(torch.randn(2, 8, 300, 128, device="cuda", dtype=dtype), specs[1])
        q, k_new, v_new = (torch.randn(2, heads, 1, 128, device="cuda", dtype=dtype) for heads in (24, 8, 8))
        assert packed._steps_as_one(q, k, v, k_new, False, q)
        out, k_grown, v_grown = packed.attend_and_append(q, k, v, k_new, v_new, query=q)
        same = torch.equal(out, packed.attention(q, k, v, k_new, v_new))
        for grown, appended in ((k_grown, k.append(k_new, query=q)), (v_grown, v.append(v_new))):
            same &= all(torch.equal(getattr(grown, n), getattr(appended, n)) for n in grown.__tensor_flatten__()[0])
        ok &= same
        print(f"decode_step {str(dtype)[6:]:8} refine {specs[1].refine:<3} {'ok' if same else 'MISMATCH'}")
    return ok


def check_sinks_and_offset(kernels) -> bool:
    """A cache built by appends on CUDA with the default's fp K sinks and K offset (a first append
    of 64+ tokens; the 40-token one takes one sink and no offset, the 3-token one neither): the
    refined quantize op with the offset, and attention reading both, against the reference on the
    same tensors."""
    from kvpass import ops
    from kvpass.packed import PackedKV

    ok = True
    k_spec, v_spec = DEFAULT
    cases = ((torch.float16, 1000, 1), (torch.bfloat16, 300, 16), (torch.float16, 40, 1), (torch.float32, 3, 1))
    for dtype, past, T in cases:
        shared = 4 * torch.randn(2, 4, 1, 128, device="cuda")
        k = PackedKV.from_float((shared + torch.randn(2, 4, past, 128, device="cuda")).to(dtype), k_spec)
        v = PackedKV.from_float(torch.randn(2, 4, past, 128, device="cuda").to(dtype), v_spec)
        x = (shared + torch.randn(2, 4, 5, 128, device="cuda")).to(dtype)
        got = ops.quantize_refined(x, *ops.codec_args(k_spec), k_spec.refine, k.offset)
        same = all(torch.equal(a, b) for a, b in zip(got, reference.encode_refined(x, k_spec, offset=k.offset)))
        k, v = k.append(x), v.append(torch.randn(2, 4, 5, 128, device="cuda").to(dtype))
        q = torch.randn(2, 16, T, 128, device="cuda").to(dtype)
        new = torch.randn(2, 4, T, 128, device="cuda").to(dtype)
        args = (q, k.codes, k.scales, k.residual, v.codes, v.scales, v.residual, new, new, None, 128**-0.5, False,
                k_spec, v_spec, 0.0, k.fine_codes, k.fine_scales, v.fine_codes, v.fine_scales, k.head, k.offset)  # fmt: skip
        expected = reference.attention(*args)
        out = kernels.attention(*args)
        try:
            torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
        except AssertionError:
            same = False
        ok &= same
        err = (out.float() - expected.float()).abs().max().item()
        print(f"sinks+offset P{past:<5} T{T:<3} {str(dtype)[6:]:8} max err {err:.2e} {'ok' if same else 'MISMATCH'}")
    return ok


def check_narrow_heads() -> bool:
    """Heads of 8 channels (groups over both KV heads, ``span_heads``): the ``kv4::`` ops on CUDA
    route them to the reference, which must run there and give what it gives on the same tensors."""
    from kvpass import ops

    ok = True
    spec = KVConfig().k.for_head_dim(8)
    for dtype in (torch.float16, torch.bfloat16):
        x = (torch.randn(2, 2, 50, 8, device="cuda") * 3).to(dtype)
        codes, scales = ops.quantize(x, *ops.codec_args(spec))
        same = all(torch.equal(a, b) for a, b in zip((codes, scales), reference.encode(x, spec)))
        q, new = torch.randn(2, 4, 1, 8, device="cuda").to(dtype), torch.randn(2, 2, 1, 8, device="cuda").to(dtype)
        empty = x[:, :, :0]
        args = (q, codes, scales, empty, codes, scales, empty, new, new, None, 8**-0.5, False)
        out = ops.attention(*args, *ops.spec_args(spec), *ops.spec_args(spec))
        same &= torch.equal(out, reference.attention(*args, spec, spec))
        ok &= same
        print(f"narrow heads {spec.tag:24} {str(dtype)[6:]:8} {'ok' if same else 'MISMATCH'}")
    return ok


def check_attention(kernels) -> bool:
    ok = True
    for B, Hq, Hkv, T, past, D, dtype, specs, mask_kind in ATTENTION_CASES:
        def randn(*shape):
            return torch.randn(shape, device="cuda").to(dtype)

        k_spec, v_spec = specs
        stored_k, fine_k = _store(randn(B, Hkv, past, D), k_spec)
        stored_v, fine_v = _store(randn(B, Hkv, past, D), v_spec)
        q, k_new, v_new = randn(B, Hq, T, D), randn(B, Hkv, T, D), randn(B, Hkv, T, D)
        total = past + T
        attn_mask = None
        if mask_kind == "chunk":
            attn_mask = torch.arange(total, device="cuda")[None, :] <= torch.arange(T, device="cuda")[:, None] + past
        elif mask_kind == "pad":
            valid = torch.randint(1, total + 1, (B,), device="cuda")
            attn_mask = (torch.arange(total, device="cuda")[None, :] >= (total - valid)[:, None])[:, None, None, :]
        args = (q, *stored_k, *stored_v, k_new, v_new, attn_mask, D**-0.5, mask_kind == "causal", k_spec, v_spec,
                0.0, *fine_k, *fine_v)  # fmt: skip
        expected = reference.attention(*args)
        out = torch.full_like(expected, float("nan"))
        kernels.attention(*args, out=out)
        err = (out.float() - expected.float()).abs().max().item()
        try:
            torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
            verdict = "ok"
        except AssertionError:
            verdict = "MISMATCH"
            ok = False
        name = f"B{B} Hq{Hq} Hkv{Hkv} T{T} P{past} D{D}"
        print(f"attention {name:34} {str(dtype)[6:]:8} {str(mask_kind):6} max err {err:.2e} {verdict}")
    return ok


QUERY_ROUNDED = dataclasses.replace(DEFAULT[0], query_rounded=True)


def check_query_rounding(kernels) -> bool:
    """Query-rounded K: the native kernel's codes against the reference's (bit for bit: the shares
    are integers), then what a decode step's K append costs with and without it (the shares from
    the step's queries, then the kernel), per call."""
    from kvpass import ops

    ok = True
    for spec, (B, H, G, T, D) in ((QUERY_ROUNDED, (2, 8, 4, 1, 128)), (QUERY_ROUNDED, (1, 8, 4, 777, 128)),
                                  (dataclasses.replace(QUERY_ROUNDED, bits=8), (2, 2, 3, 33, 64)),
                                  (QUERY_ROUNDED, (1, 1, 4, 300, 256))):  # fmt: skip
        for dtype in (torch.float16, torch.bfloat16):
            x = reference.rotate((torch.randn(B, H, T, D, device="cuda") * 3).to(dtype))
            q = torch.randn(B, H * G, T, D, device="cuda", dtype=dtype)
            rounding = reference.rounding_coefficients(q, H, None, spec)
            expected = reference.quantize(x, spec, rounding)
            got = kernels.quantize(x, spec, rounding)
            good = torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
            ok &= good
            print(f"query rounding B{B} H{H} T{T} D{D} {spec.tag:42} {str(dtype)[6:]:8} {'ok' if good else 'MISMATCH'}")
    spec = QUERY_ROUNDED
    x, q = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.float16), torch.randn(1, 32, 1, 128, device="cuda")
    for name, append in (
        ("nearest", lambda: ops.quantize_refined(x, *ops.codec_args(spec), spec.refine)),
        ("query-rounded", lambda: ops.quantize_refined(
            x, *ops.codec_args(spec), spec.refine, None, reference.rounding_coefficients(q, 8, None, spec))),
    ):  # fmt: skip
        for _ in range(10):
            append()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            append()
        torch.cuda.synchronize()
        print(f"decode-step K append (8 KV heads x 128, 32 query heads), {name:13}: "
              f"{(time.perf_counter() - start) / 200 * 1e6:.0f} us per call")
    return ok


def check_eager_sdpa(device: str = "cuda") -> bool:
    """An uncompiled SDPA over PackedKV K and V (generate's eager prefill into a static cache, a
    model run without torch.compile): the fused kernel torch picks for these inputs must be one
    PackedKV implements (no dequantizing fallback), and the output must equal SDPA over the
    dequantized cache."""
    from kvpass import packed
    from kvpass.packed import PackedKV

    picked, fell_back = [], []
    table, fallback = packed._IMPLEMENTATIONS, packed._fallback

    def recorded(op, impl):
        return lambda func, args, kwargs: picked.append(op.__name__) or impl(func, args, kwargs)

    saved = {op: table[op] for op in packed._SDPA_MASK_ARGUMENT}
    table.update({op: recorded(op, impl) for op, impl in saved.items()})
    packed._fallback = lambda func, args, kwargs: fell_back.append(str(func)) or fallback(func, args, kwargs)
    ok = True
    try:
        for dtype in (torch.float16, torch.bfloat16):
            for q_len, mask_kind in ((300, "causal"), (1, "pad"), (33, "pad")):
                picked.clear(), fell_back.clear()
                k, v = (PackedKV.from_float(torch.randn(2, 8, 300, 128, device=device, dtype=dtype), spec)
                        for spec in DEFAULT)  # fmt: skip
                q = torch.randn(2, 32, q_len, 128, device=device, dtype=dtype)
                mask = None
                if mask_kind == "pad":
                    mask = (torch.arange(300, device=device) >= torch.tensor([[0], [57]], device=device))[:, None, None]
                options = dict(attn_mask=mask, is_causal=mask is None, enable_gqa=True)
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **options)
                expected = torch.nn.functional.scaled_dot_product_attention(
                    q.float(), k.dequantize().float(), v.dequantize().float(), **options
                )
                good = torch.allclose(out.float(), expected, **TOLERANCE[dtype]) and not fell_back
                ok &= good
                print(f"eager sdpa {str(dtype):15} q_len {q_len:3} {mask_kind:6} {'ok' if good else 'FAIL'}: "
                      f"kernel {picked or '-'}, fallback {fell_back or '-'}, "
                      f"max err {(out.float() - expected).abs().max().item():.2e}")  # fmt: skip
    finally:
        table.update(saved)
        packed._fallback = fallback
    return ok


def check_cuda_graph_decode() -> bool:
    """Issue 5's CUDA-graph item: static-cache decode through generate's own compile route, kv4
    with inductor inside and ``mode="reduce-overhead"``. Inductor must take CUDA graphs for every
    decode graph (it skips them, and counts the skip, for a host sync, a CPU tensor or a mutated
    input it cannot replay), later calls must allocate nothing new, and the tokens must equal
    the same compile without CUDA graphs."""
    from torch._dynamo.utils import counters
    from transformers import StaticCache
    from transformers.generation import CompileConfig

    import kvpass
    from kvpass.models_zoo import build
    from kvpass.packed import PackedKV

    ids = torch.randint(3, 200, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    tokens, ok = {}, True
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        counters.clear()
        model = build("llama_hd128", dtype=torch.float16).cuda()
        kvpass.int4_static_caches(model)
        model.generation_config.compile_config = CompileConfig(backend=kvpass.kv4(inner="inductor"), mode=mode)
        peaks, times = [], []
        for _ in range(3):  # the first call compiles and records; the others replay
            cache = StaticCache(model.config, max_cache_len=128)
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=48, do_sample=False, **cache_arg(cache))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            peaks.append(torch.cuda.max_memory_allocated())
        int4 = all(isinstance(layer.keys, PackedKV) for layer in cache.layers)
        skips = counters["inductor"]["cudagraph_skips"]
        tokens[mode] = out
        same_peak = peaks[1] == peaks[2]
        ok &= int4 and same_peak and (mode == "default" or skips == 0)
        print(f"cuda graphs {mode:16} int4 buffers {int4}, cudagraph skips {skips}, peak bytes so far "
              f"{peaks}, generate {[f'{t:.2f} s' for t in times]}")  # fmt: skip
    same = torch.equal(tokens["default"], tokens["reduce-overhead"])
    print(f"cuda graphs tokens equal without them: {same}")
    return ok and same


def check_mla_decode() -> bool:
    """DeepSeek-V3's decode attending over its int4 latent (the projections absorbed) on the GPU: every
    decode site absorbed, and the same tokens and logits as K and V projected from the same latents."""
    import kvpass
    from kvpass import passes
    from kvpass.models_zoo import build

    ids = torch.randint(3, 200, (2, 70), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    runs, absorb_site = {}, passes._absorb_site
    for absorbed in (True, False):
        torch._dynamo.reset()
        passes.counters.clear()
        passes._absorb_site = absorb_site if absorbed else lambda *args: None
        try:
            model = build("deepseek_v3", dtype=torch.float16).cuda()
            model.compile(backend=kvpass.kv4())
            out = model.generate(ids, max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
        finally:
            passes._absorb_site = absorb_site
        runs[absorbed] = out, passes.counters["absorbed_latent_site"]
    (got, sites), (expected, _) = runs[True], runs[False]
    same = torch.equal(got.sequences, expected.sequences)
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got.scores, expected.scores))
    print(f"mla decode: {sites} sites absorbed, tokens equal to the expansion's {same}, max logit diff {err:.2e}")
    return sites > 0 and same and err < 2e-2  # fp16 logits of O(1), sums reordered


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; the CPU tests (tests/test_kernels.py) cover the interpreter", file=sys.stderr)
        return 1
    from kvpass import kernels

    torch.manual_seed(0)
    checks = [(check_quantize, kernels), (check_quantize_refined,), (check_decode_step,), (check_attention, kernels),
              (check_sinks_and_offset, kernels), (check_narrow_heads,), (check_query_rounding, kernels),
              (check_eager_sdpa,), (check_cuda_graph_decode,), (check_mla_decode,)]  # fmt: skip
    if len(sys.argv) > 1:  # check names given: run only those
        checks = [c for c in checks if c[0].__name__ in sys.argv[1:]]
    start, failed = time.time(), []
    for check, *args in checks:
        # One call on a lent GPU is all there may be: a check that raises is reported and the rest still run.
        began = time.time()
        try:
            passed = check(*args)
        except Exception:  # noqa: BLE001 - printed, counted as a failure
            traceback.print_exc()
            passed = False
        print(f"-- {check.__name__}: {'passed' if passed else 'FAILED'} in {time.time() - began:.0f} s", flush=True)
        if not passed:
            failed.append(check.__name__)
    print(f"gpu_check {'FAILED: ' + ', '.join(failed) if failed else 'passed'} in {time.time() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
