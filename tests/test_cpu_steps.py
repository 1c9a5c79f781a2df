"""A CPU decode step's kv4 ops compiled by Inductor (kvpass.cpu_steps): the quantization gives the eager
reference's codes and scales bit for bit, the attention agrees with the reference within the rounding
its other order of sums allows; each is taken only where it composes, and eager again where it cannot
compile."""

import contextlib
import dataclasses
import logging
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from transformers import DynamicCache

from kvpass import cpu_steps, ops, packed, reference
from kvpass.cache_argument import cache_arg
from kvpass.config import KVConfig, QuantSpec
from kvpass.packed import PackedKV
from tests.helpers import bits_equal, decode_step_args, hard_values, kv_heavy_llama, same_stored_bits

DEFAULT = KVConfig()


@pytest.fixture
def compiled_steps(monkeypatch):
    """The compiled path on, with no graphs yet; the list of functions whose compiled code ran, one
    entry a call (a key's first call runs eagerly)."""
    monkeypatch.setattr(cpu_steps, "enabled", True)
    monkeypatch.setattr(cpu_steps, "_compiled", {})
    monkeypatch.setattr(cpu_steps, "_recent", {})
    monkeypatch.setattr(cpu_steps, "_refused", set())
    monkeypatch.setattr(cpu_steps, "_built_one", False)
    ran = []
    compile_ = cpu_steps._compile

    def recording(fn, args):
        compiled = compile_(fn, args)

        def call(*args):
            out = compiled(*args)
            if out is not None:  # None: the graph's guards rejected args, and it did not run
                ran.append(fn)
            return out

        call.rejection = compiled.rejection
        return call

    monkeypatch.setattr(cpu_steps, "_compile", recording)
    return ran


def _second(call):
    """``call()``'s result the second time: the first call of a graph's key runs eagerly."""
    call()
    return call()


def _decode_steps(batch, heads, head_dim, dtype, seed):
    """``hard_values``' tokens as the single new tokens of ``batch`` sequences: ``[batch, heads, 1, head_dim]``."""
    return hard_values((1, heads, batch, head_dim), dtype, torch.Generator().manual_seed(seed)).transpose(0, 2)


@pytest.mark.parametrize(
    "spec, dtype",
    [
        (DEFAULT.k, torch.float16),
        (DEFAULT.k, torch.bfloat16),
        (DEFAULT.k, torch.float32),
        (DEFAULT.v, torch.float16),
        (QuantSpec(bits=4, scheme="token", group=32, symmetric=False), torch.float16),
        (QuantSpec(bits=2, scheme="token", group=16, clip=True), torch.float32),
        (QuantSpec(bits=8, scheme="token", group=64, clip=True, refine=8), torch.bfloat16),
    ],
    ids=lambda v: v.tag if isinstance(v, QuantSpec) else str(v).removeprefix("torch."),
)
def test_a_decode_steps_compiled_quantization_is_the_references_bit_for_bit(compiled_steps, spec, dtype):
    x = _decode_steps(9, 3, 64, dtype, seed=spec.bits + spec.group)
    offset = torch.randn(9, 3, 1, 64, generator=torch.Generator().manual_seed(0)).half() if spec.center else None
    refined = spec.refine > 0
    encode = cpu_steps.encode_refined if refined else cpu_steps.encode
    expected = (reference.encode_refined(x, spec, offset=offset) if refined
                else reference.encode(x, spec, offset))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # compiling is silent: a user sees none of it
        got = _second(lambda: encode(x, spec, offset))
    assert compiled_steps == [reference.encode_refined if refined else reference.encode]
    assert len(got) == len(expected)
    for out, ref in zip(got, expected):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert torch.equal(out, ref) if out.dtype == torch.uint8 else bits_equal(out, ref)
    assert any(s.isnan().any() for s in got[1::2]), "the hard values' non-finite tokens are in the batch"


def test_a_query_rounded_decode_steps_quantization_compiles_and_is_the_references_bit_for_bit(compiled_steps, caplog):
    # Its rounding wrote each block's codes through round(out=) into a strided view, which Inductor
    # refuses: every kvpass.kv4(k_query_rounded=True) decode step ran the reference eagerly, with a warning.
    spec = dataclasses.replace(DEFAULT.k, query_rounded=1)
    x = _decode_steps(9, 3, 64, torch.float32, seed=5)
    offset = torch.randn(9, 3, 1, 64, generator=torch.Generator().manual_seed(0)).half()
    query = torch.randn(9, 12, 1, 64, generator=torch.Generator().manual_seed(1))
    rounding = reference.rounding_coefficients(query, 3, None, spec)
    expected = reference.encode_refined(x, spec, offset=offset, rounding=rounding)
    with caplog.at_level(logging.WARNING, logger="kvpass"):
        got = _second(lambda: cpu_steps.encode_refined(x, spec, offset, rounding))
    assert compiled_steps == [reference.encode_refined] and "runs eagerly" not in caplog.text
    for out, ref in zip(got, expected, strict=True):
        assert torch.equal(out, ref) if out.dtype == torch.uint8 else bits_equal(out, ref)


@pytest.mark.parametrize("layout", ["contiguous", "batch-outermost", "heads-of-a-projection"])
def test_a_decode_steps_quantization_is_the_same_whatever_its_tokens_layout(compiled_steps, layout):
    # The rotation's sums round as the matmul's kernel adds them, and matmul runs a layout it cannot
    # view as rows as a bmm: the reference computed on a batch-outermost token (this layout) differed
    # from the graph traced for it, and from itself on the same values laid out as rows, in fp32 codes
    # or scales at the first of these 8 offsets.
    x = _decode_steps(9, 3, 64, torch.float32, seed=5).contiguous()  # [B, H, 1, D]
    laid_out = {
        "contiguous": x,
        "batch-outermost": x.transpose(0, 2).contiguous().transpose(0, 2),
        "heads-of-a-projection": x.transpose(1, 2).contiguous().transpose(1, 2),  # HF: [B, 1, H * D] viewed
    }[layout]
    assert torch.equal(laid_out.view(torch.int32), x.view(torch.int32))  # the same values, NaNs included
    offsets = [torch.randn(9, 3, 1, 64, generator=torch.Generator().manual_seed(seed)).half() for seed in range(8)]
    cpu_steps.encode_refined(laid_out, DEFAULT.k, offsets[0])  # a key's first call runs eagerly
    for offset in offsets:
        expected = reference.encode_refined(x, DEFAULT.k, offset=offset)
        for got in (reference.encode_refined(laid_out, DEFAULT.k, offset=offset),
                    cpu_steps.encode_refined(laid_out, DEFAULT.k, offset)):  # fmt: skip
            assert all(bits_equal(a, b) if a.is_floating_point() else torch.equal(a, b) for a, b in zip(got, expected))
    assert compiled_steps == [reference.encode_refined] * len(offsets)


@pytest.mark.parametrize(
    "spec",
    [
        DEFAULT.k,
        QuantSpec(bits=4, scheme="token", group=32, symmetric=False),
        QuantSpec(bits=4, scheme="token", group=8),  # narrow groups: 8-bit scales
        QuantSpec(bits=2, scheme="token", group=16, clip=True),
        QuantSpec(bits=8, scheme="token", group=64),
    ],
    ids=lambda spec: spec.tag,
)
@pytest.mark.parametrize("head_dim", [64, 80, 128])  # 80: groups clipped to 16 channels (QuantSpec.token_group)
def test_the_attentions_fields_are_the_references_field_major_values_bit_for_bit(spec, head_dim):
    x = hard_values((1, 3, 9, head_dim), torch.float32, torch.Generator().manual_seed(spec.bits + spec.group))
    codes, scales = reference.quantize(reference.rotate(x) if spec.rotate else x, spec)
    got = cpu_steps._fields(codes, scales, spec)
    runs, fields, run = cpu_steps._inner_dims(head_dim, spec)
    assert got.shape == (1, 3, 9, runs, fields, run) and runs * fields * run == head_dim and fields == 8 // spec.bits
    assert bits_equal(got.flatten(3), reference.dequantize_field_major(codes, scales, spec))
    assert got.isnan().any(), "a poisoned group of the hard values is among them"


def test_specs_whose_groups_are_no_byte_runs_of_a_head_keep_its_flat_dimension():
    channels, spanning = QuantSpec(4, "channel", 64), QuantSpec(4, "token", 64, span_heads=True)
    assert cpu_steps._inner_dims(64, channels) == cpu_steps._inner_dims(64, spanning) == (64,)


@pytest.mark.parametrize("version, compiles", [("2.11.0", False), ("2.12.1+cu126", False), ("2.13.0", True),
                                               ("2.13.0+cpu", True), ("2.14.0.dev20261201", True)])  # fmt: skip
def test_the_compiled_path_is_on_by_default_from_torch_2_13(version, compiles):
    # Under 2.11's Inductor a rotated spec's codes and scales were not the reference's (the module's note).
    assert cpu_steps._compiles_by_default(version) is compiles


def test_equal_specs_share_one_compiled_graph(compiled_steps):
    # Equal specs need not be one object (a spec built apart, a copy): the graph guards on values.
    x = torch.randn(2, 3, 1, 64)
    _second(lambda: cpu_steps.encode_refined(x, DEFAULT.v))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for spec in (DEFAULT.v, dataclasses.replace(DEFAULT.v), QuantSpec.from_tag(DEFAULT.v.tag)):
        cpu_steps.encode_refined(x, spec)
    assert compiled_steps == [reference.encode_refined] * 4
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_a_call_a_recent_graph_takes_runs_it_without_working_out_its_key(compiled_steps, monkeypatch):
    x = torch.randn(1, 2, 1, 64)
    _second(lambda: cpu_steps.encode_refined(x, DEFAULT.v))
    keys, encoding = [], cpu_steps._encoding
    monkeypatch.setattr(cpu_steps, "_encoding", lambda *args: keys.append(args) or encoding(*args))
    y = torch.randn(1, 2, 1, 64)
    got = cpu_steps.encode_refined(y, DEFAULT.v)
    assert keys == [] and compiled_steps == [reference.encode_refined] * 2
    assert all(torch.equal(a, b) for a, b in zip(got, reference.encode_refined(y, DEFAULT.v)))


def test_a_structure_no_recent_graph_takes_finds_its_graph_by_its_key(compiled_steps, monkeypatch):
    # Two structures alternating past a recent list of one: each call misses it, and the graph its
    # key holds runs (no graph compiled again, no eager step).
    monkeypatch.setattr(cpu_steps, "RECENT_GRAPHS", 1)
    steps = [torch.randn(batch, 2, 1, 64) for batch in (1, 2)]
    for x in steps:
        _second(lambda: cpu_steps.encode_refined(x, DEFAULT.v))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for x in steps * 2:
        got = cpu_steps.encode_refined(x, DEFAULT.v)
        assert all(torch.equal(a, b) for a, b in zip(got, reference.encode_refined(x, DEFAULT.v)))
        assert len(cpu_steps._recent[reference.encode_refined]) == 1
    assert compiled_steps == [reference.encode_refined] * 6
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_only_plain_cpu_decode_steps_take_the_compiled_path(compiled_steps, monkeypatch):
    step = torch.randn(1, 2, 1, 64)
    assert cpu_steps._takes(step)
    with FakeTensorMode() as mode:
        assert not cpu_steps._takes(mode.from_tensor(step))
    monkeypatch.setattr(cpu_steps, "enabled", False)
    assert not cpu_steps._takes(step)


def test_a_toolchain_that_cannot_build_turns_the_compiled_path_off_and_says_so(compiled_steps, caplog):
    # Inductor's own failure, not a stand-in: no compiler it can run. Every graph would fail alike.
    x = torch.randn(1, 2, 1, 64)
    with caplog.at_level(logging.WARNING, logger="kvpass"), torch._inductor.config.patch({"cpp.cxx": ("no-such-cxx",)}):
        got = _second(lambda: cpu_steps.encode_refined(x, DEFAULT.v))
    assert all(torch.equal(a, b) for a, b in zip(got, reference.encode_refined(x, DEFAULT.v)))
    assert not cpu_steps.enabled and compiled_steps == []
    assert "decode steps stay eager on CPU: Inductor failed (InvalidCxxCompiler: No working C++ compiler" in caplog.text


def test_a_structure_inductor_fails_on_runs_eagerly_and_the_others_stay_compiled(compiled_steps, monkeypatch, caplog):
    # As a sink layer's guard on a data-dependent length failed one structure's compile: that had
    # turned every other structure's compiled calls off with it.
    compile_, tried = cpu_steps._compile, []

    def fails_on_two_heads(fn, args):
        tried.append(args[0].shape[1])
        if args[0].shape[1] == 2:
            raise RuntimeError("Inductor cannot lower this graph\n  target: aten.select.int (the graph's IR)")
        return compile_(fn, args)

    monkeypatch.setattr(cpu_steps, "_compile", fails_on_two_heads)
    steps = [torch.randn(1, heads, 1, 64) for heads in (2, 3)]
    with caplog.at_level(logging.DEBUG, logger="kvpass"):
        got = [cpu_steps.encode_refined(x, DEFAULT.v) for _ in range(4) for x in steps]
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert cpu_steps.enabled and tried == [2, 3]  # each key compiled once, the failed one never again
    assert compiled_steps == [reference.encode_refined] * 3  # the 3-head calls after their first
    assert warned.count("encode_refined runs eagerly on CPU for one structure of its inputs: Inductor failed "
                        "on its graph (RuntimeError: Inductor cannot lower this graph)") == 1  # fmt: skip
    assert "decode steps stay eager" not in warned
    assert "the graph's IR" not in warned and "the graph's IR" in caplog.text  # the whole error at DEBUG
    for i, out in enumerate(got):
        assert all(torch.equal(a, b) for a, b in zip(out, reference.encode_refined(steps[i % 2], DEFAULT.v)))


def test_a_graph_whose_guards_reject_its_own_inputs_leaves_that_structure_eager_and_names_the_guard(
    compiled_steps, monkeypatch, caplog
):
    # As the aliases a graph is traced with once dropped requires_grad: a float mask made from parameters
    # met a graph traced without it. That had turned the compiled path off for the process, naming Inductor.
    def alias_without_grad(t):
        return None if t is None else cpu_steps.storage_view(t, t.shape, t.stride(), t.storage_offset())

    monkeypatch.setattr(cpu_steps, "_alias", alias_without_grad)
    k, v, k_new, v_new, q = _caches((DEFAULT.k, DEFAULT.v), 3, 2, 150, torch.float32, seed=7)
    learned_mask = torch.zeros((), requires_grad=True) + torch.zeros(3, 1, 1, k.shape[2] + 1)
    with caplog.at_level(logging.WARNING, logger="kvpass"):
        got = [_second(lambda: packed.attention(q, k, v, k_new, v_new, mask)) for mask in (learned_mask, None)]
    assert cpu_steps.enabled and compiled_steps.count(cpu_steps._decode_attention) == 1  # the maskless structure's
    assert caplog.text.count("_decode_attention runs eagerly on CPU for one structure of its inputs: its graph rejects "
                             "the inputs it was compiled for (_GuardsRejected: tensor 'L['attn_mask']' requires_grad "
                             "mismatch") == 1  # fmt: skip
    monkeypatch.setattr(cpu_steps, "enabled", False)
    assert torch.equal(got[0], packed.attention(q, k, v, k_new, v_new, learned_mask.detach()))  # the reference's
    torch.testing.assert_close(got[1], packed.attention(q, k, v, k_new, v_new), **TOLERANCE[torch.float32])


def test_a_cpp_error_is_the_toolchains_until_a_graph_has_built(compiled_steps, monkeypatch, caplog):
    # Before any graph has built, a C++ compile error may be a toolchain every graph would fail on (no
    # headers, a broken compiler); after one has, it is the failing graph's code.
    compile_ = cpu_steps._compile

    def cpp_error_on_two_heads(fn, args):
        if args[0].shape[1] == 2:
            raise torch._inductor.exc.CppCompileError(["c++", "graph.cpp"], "graph.cpp: error: invalid code")
        return compile_(fn, args)

    monkeypatch.setattr(cpu_steps, "_compile", cpp_error_on_two_heads)
    two, three = torch.randn(1, 2, 1, 64), torch.randn(1, 3, 1, 64)
    with caplog.at_level(logging.WARNING, logger="kvpass"):
        _second(lambda: cpu_steps.encode_refined(three, DEFAULT.v))
        got = _second(lambda: cpu_steps.encode_refined(two, DEFAULT.v))
    assert cpu_steps.enabled and compiled_steps == [reference.encode_refined]
    assert "encode_refined runs eagerly on CPU for one structure of its inputs: Inductor failed on its graph " \
           "(CppCompileError: C++ compile error" in caplog.text  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(got, reference.encode_refined(two, DEFAULT.v)))
    for name, fresh in (("_built_one", False), ("_compiled", {}), ("_recent", {}), ("_refused", set())):
        monkeypatch.setattr(cpu_steps, name, fresh)  # as in a process where nothing has built yet
    with caplog.at_level(logging.WARNING, logger="kvpass"):
        _second(lambda: cpu_steps.encode_refined(two, DEFAULT.v))
    assert not cpu_steps.enabled
    assert "decode steps stay eager on CPU: Inductor failed (CppCompileError: C++ compile error" in caplog.text


@pytest.mark.parametrize(
    "stance, named",
    [
        (dict(stance="force_eager"), "force_eager"),
        (dict(stance="eager_on_recompile"), "eager_on_recompile"),
        (dict(stance="fail_on_recompile"), "fail_on_recompile"),
        (dict(stance="eager_then_compile"), "eager_then_compile"),
        (dict(force_backend="eager"), "force_backend='eager'"),
    ],
)
def test_a_stance_against_compiling_runs_eagerly_until_it_is_lifted(compiled_steps, monkeypatch, caplog, stance, named):
    # Dynamo skips or fails a compile under these stances: no Inductor failure, so the path stays on.
    monkeypatch.setattr(cpu_steps, "_refusals_warned", set())
    x = torch.randn(1, 2, 1, 64)
    expected = reference.encode_refined(x, DEFAULT.v)
    with caplog.at_level(logging.WARNING, logger="kvpass"), torch.compiler.set_stance(**stance):
        held = [cpu_steps.encode_refined(x, DEFAULT.v) for _ in range(3)]
    assert compiled_steps == [] and cpu_steps.enabled
    assert caplog.text.count(f"compile no new graph on CPU under torch.compiler's stance {named}:") == 1
    assert "Inductor failed" not in caplog.text
    got = cpu_steps.encode_refined(x, DEFAULT.v)
    assert compiled_steps == [reference.encode_refined]
    assert all(torch.equal(a, b) for out in (*held, got) for a, b in zip(out, expected))


@pytest.mark.parametrize("disable", ["environment", "config"])
def test_disabled_dynamo_runs_eagerly_until_it_is_enabled(compiled_steps, monkeypatch, caplog, disable):
    # torch.compile compiles nothing then: read as Inductor failing, it turned the path off for good.
    monkeypatch.setattr(cpu_steps, "_refusals_warned", set())
    x = torch.randn(1, 2, 1, 64)
    expected = reference.encode_refined(x, DEFAULT.v)
    with contextlib.ExitStack() as off, caplog.at_level(logging.WARNING, logger="kvpass"):
        if disable == "environment":
            off.enter_context(monkeypatch.context()).setenv("TORCHDYNAMO_DISABLE", "1")
        else:  # Dynamo's config.patch, not monkeypatch.setattr: see tests/test_backend.py
            off.enter_context(torch._dynamo.config.patch(disable=True))
        held = [cpu_steps.encode_refined(x, DEFAULT.v) for _ in range(3)]
    assert compiled_steps == [] and cpu_steps.enabled
    assert caplog.text.count("compile no new graph on CPU with Dynamo disabled") == 1
    assert "Inductor failed" not in caplog.text
    got = cpu_steps.encode_refined(x, DEFAULT.v)
    assert compiled_steps == [reference.encode_refined]
    assert all(torch.equal(a, b) for out in (*held, got) for a, b in zip(out, expected))


def test_a_kept_graph_runs_under_any_stance(compiled_steps):
    x = torch.randn(1, 2, 1, 64)
    _second(lambda: cpu_steps.encode_refined(x, DEFAULT.v))
    with torch.compiler.set_stance("force_eager"):
        got = cpu_steps.encode_refined(x, DEFAULT.v)
    assert compiled_steps == [reference.encode_refined] * 2
    assert all(torch.equal(a, b) for a, b in zip(got, reference.encode_refined(x, DEFAULT.v)))


def test_an_input_the_reference_rejects_raises_its_error_and_keeps_the_compiled_path(compiled_steps):
    for _ in range(2):  # eagerly, then through the compiled code
        with pytest.raises(ValueError, match="head_dim 7 must be a multiple of 2"):
            cpu_steps.encode(torch.randn(1, 2, 1, 7), QuantSpec(4, "token", 16))
    assert cpu_steps.enabled


def test_a_call_in_another_dispatch_context_compiles_a_graph_of_its_own(compiled_steps):
    # Inference tensors carry other dispatch keys than the graph was traced with: its guards reject
    # them, and the key compiles a second graph rather than running the first on them.
    x = torch.randn(1, 2, 1, 64)
    _second(lambda: cpu_steps.encode_refined(x, DEFAULT.v))
    with torch.inference_mode():
        got = cpu_steps.encode_refined(x.clone(), DEFAULT.v)
    (graphs,) = cpu_steps._compiled.values()
    assert len(graphs) == 2 and compiled_steps == [reference.encode_refined] * 2
    assert all(torch.equal(a, b) for a, b in zip(got, reference.encode_refined(x, DEFAULT.v)))


def test_a_key_out_of_graphs_runs_eagerly_and_says_so_once(compiled_steps, monkeypatch, caplog):
    monkeypatch.setattr(cpu_steps, "GRAPHS_PER_KEY", 1)
    monkeypatch.setattr(cpu_steps, "_overflowing", set())
    x = torch.randn(1, 2, 1, 64)
    _second(lambda: cpu_steps.encode_refined(x, DEFAULT.v))
    with caplog.at_level(logging.WARNING, logger="kvpass"), torch.inference_mode():
        got = [cpu_steps.encode_refined(x.clone(), DEFAULT.v) for _ in range(2)]
    assert compiled_steps == [reference.encode_refined] and cpu_steps.enabled
    assert caplog.text.count("encode_refined runs eagerly on CPU here: it compiled 1 graphs for one key") == 1
    assert all(torch.equal(a, b) for out in got for a, b in zip(out, reference.encode_refined(x, DEFAULT.v)))


def test_opcheck_with_the_compiled_path(compiled_steps):
    x = torch.randn(2, 3, 1, 64)
    torch.library.opcheck(ops.quantize_refined, (x, *ops.codec_args(DEFAULT.v), DEFAULT.v.refine))
    torch.library.opcheck(ops.quantize, (x, *ops.codec_args(QuantSpec(bits=4, scheme="token", group=32))))
    k, v = (PackedKV.from_float(torch.randn(2, 3, 70, 64), spec) for spec in (DEFAULT.k.for_slots, DEFAULT.v))
    args = (torch.randn(2, 6, 1, 64), k.codes, k.scales, k.residual, v.codes, v.scales, v.residual,
            torch.randn(2, 3, 1, 64), torch.randn(2, 3, 1, 64), None, 0.125, False,
            *ops.spec_args(k.spec), *ops.spec_args(v.spec), 0.0, None, None, v.fine_codes, v.fine_scales)  # fmt: skip
    torch.library.opcheck(ops.attention, args)
    k = PackedKV.from_float(torch.randn(2, 3, 70, 64), dataclasses.replace(DEFAULT.k.for_slots, refine=64))
    q, k_new, v_new = torch.randn(2, 6, 1, 64), torch.randn(2, 3, 1, 64), torch.randn(2, 3, 1, 64)
    torch.library.opcheck(ops.decode_step, decode_step_args(q, k, v, k_new, v_new))
    # opcheck calls the real kernel on plain tensors too, more than once: the later calls went
    # through the compiled code.
    assert {reference.encode_refined, reference.encode, cpu_steps._decode_attention, cpu_steps._decode_step} <= set(
        compiled_steps
    )  # fmt: skip


# The modes a user's own loop runs the prompt and the steps in. Grad mode, without torch.no_grad(): its
# caches once stored the tokens' autograd record, and the compiled step's graphs, traced without it,
# rejected them and turned the compiled path off for the process. A prompt under torch.inference_mode()
# (a prefix cache) makes inference tensors, which graphs traced outside it had rejected.
MODES = {
    "no-grad": (torch.no_grad, torch.no_grad),
    "grad-mode": (torch.enable_grad, torch.enable_grad),
    "prompt-in-inference-mode": (torch.inference_mode, torch.no_grad),
}


@pytest.mark.parametrize("modes", MODES.values(), ids=MODES)
def test_a_kv4_model_decodes_through_the_compiled_path(compiled_steps, monkeypatch, modes):
    model = kv_heavy_llama()
    ids = torch.randint(0, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(0))
    prompt_mode, step_mode = modes
    ran = compiled_steps
    logits, caches = {}, {}
    for enabled in (False, True):
        monkeypatch.setattr(cpu_steps, "enabled", enabled)
        torch._dynamo.reset()
        step, cache, token, logits[enabled] = torch.compile(model, backend="kv4"), DynamicCache(), ids, []
        for i in range(4):
            with (prompt_mode if i == 0 else step_mode)():
                out = step(input_ids=token, **cache_arg(cache), use_cache=True).logits[:, -1]
            assert out.requires_grad == (step_mode is torch.enable_grad)
            logits[enabled].append(out.detach())
            token = out.argmax(-1, keepdim=True)
        caches[enabled] = cache
    assert cpu_steps.enabled
    stored = [t for layer in caches[True].layers for cache in (layer.keys, layer.values) for t in cache._inner()]
    assert not any(t.requires_grad for t in stored), "a cache keeps no autograd record"
    # 3 decode steps of 2 layers, each layer's attention and appends one graph. A key's first call (the
    # first step's first layer's) runs the three apart, each its key's first call, so eagerly.
    assert ran.count(cpu_steps._decode_step) == len(ran) == 2 * 3 - 1
    # The cache holds the same bits both ways; the logits move by the attention's order of sums only.
    for on, off in zip(caches[True].layers, caches[False].layers):
        assert same_stored_bits(on.keys, off.keys) and same_stored_bits(on.values, off.values)
    for a, b in zip(logits[True], logits[False]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_an_attention_sink_model_decodes_through_the_fused_attention(compiled_steps):
    """GPT-OSS's sinks reach kv4's decode step as a logit it reads after the new token (passes.py), in the
    fused attention: a model-level check that the rewritten graph hands it that form."""
    from transformers import AutoModelForCausalLM

    from kvpass.coverage import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gpt_oss")).eval()
    # Past K's 64-token prefix, so that the attention reads int4 codes, not only the fp tail.
    ids = torch.randint(0, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(0))
    logits = {}
    for fused in (True, False):
        torch._dynamo.reset()
        step, cache, token, logits[fused] = torch.compile(model, backend="kv4"), DynamicCache(), ids, []
        with contextlib.nullcontext() if fused else cpu_steps.reference_attention():
            for _ in range(4):
                out = step(input_ids=token, **cache_arg(cache), use_cache=True).logits[:, -1]
                logits[fused].append(out)
                token = out.argmax(-1, keepdim=True)
    # 3 decode steps of 2 layers (a sliding one and a full one, whose caches and masks are alike in all
    # the graph keys on: one structure, whose first call ran its three parts eagerly), each one graph with
    # its appends (kv4_decode takes the sink, reference.with_sink).
    steps = [key for fn, key in cpu_steps._compiled if fn is cpu_steps._decode_step]
    assert len(steps) == 1 and not cpu_steps._refused
    assert compiled_steps.count(cpu_steps._decode_step) == 2 * 3 - 1
    for a, b in zip(logits[True], logits[False]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_attentions_marks_stay_off_the_models_graphs(monkeypatch):
    # The fused attention marks its lengths unbacked on aliases: on the cache's own tensors the marks
    # reached the model's next graph (a 10-token prompt's compiles again when V's plane reaches 2 rows),
    # whose trace broke on them (33 graphs for 20 steps of an 8-layer Llama).
    model = kv_heavy_llama()
    monkeypatch.setattr(cpu_steps, "enabled", True)
    monkeypatch.setattr(cpu_steps, "_compiled", {})
    monkeypatch.setattr(cpu_steps, "_recent", {})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step, cache = torch.compile(model, backend="kv4"), DynamicCache()
    token = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    for _ in range(8):
        token = step(input_ids=token, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
    assert cache.layers[0].values.fine_codes.shape[2] >= 2
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


@torch._dynamo.config.patch(recompile_limit=2)  # not monkeypatch.setattr: see tests/test_backend.py
def test_more_specs_than_dynamos_recompile_limit_all_run_compiled(compiled_steps):
    # kvpass eval tries a dozen schemes in one process, and Dynamo keeps recompile_limit (8) graphs per
    # code object: here a limit of 2 against 3 specs, which is cheaper to compile.
    x = torch.randn(1, 2, 1, 64)
    specs = [QuantSpec(4, "token", group) for group in (16, 32, 64)]
    torch._dynamo.reset()  # a spec another test compiled compiles again here
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for spec in specs:
        got = _second(lambda: cpu_steps.encode(x, spec))
        assert all(torch.equal(a, b) for a, b in zip(got, reference.encode(x, spec)))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + len(specs)


def test_a_tokens_stride_does_not_compile_another_graph(compiled_steps):
    # A one-token dimension's stride is arbitrary: V's new token arrives with another than K's.
    x = torch.randn(1, 1, 3, 64).transpose(1, 2)  # [1, 3, 1, 64], the token dimension's stride 192
    spec = QuantSpec(4, "token", 16, symmetric=False)
    assert x.is_contiguous() and x.stride(2) != torch.randn(1, 3, 1, 64).stride(2)
    _second(lambda: cpu_steps.encode(x.contiguous(), spec))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    y = torch.randn(1, 3, 1, 64)
    got = cpu_steps.encode(y, spec)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert all(torch.equal(a, b) for a, b in zip(got, reference.encode(y, spec)))


# --- attention -------------------------------------------------------------------------

# The fused decode attention against the reference, per query dtype. Both sum in fp32, in other
# orders (a few ulp of outputs that are O(1)), and round the output to the query's dtype once, where
# those ulp can move it by one step of that dtype: its epsilon, relative.
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-5, rtol=2**-10),
    torch.bfloat16: dict(atol=1e-5, rtol=2**-7),
}
KIVI = (QuantSpec(bits=4, scheme="channel", group=32), QuantSpec(bits=4, scheme="token", group=64, rotate=True))
ASYM_INT2_INT8 = (QuantSpec(bits=2, scheme="token", group=16, symmetric=False), QuantSpec(bits=8, scheme="token", group=32))


def _caches(specs, batch, heads, past, dtype, seed, rep=3, head_dim=64):
    """K and V caches of ``past`` tokens built as a model builds them (a prompt, then decode steps),
    so every extra of their specs is there, and the queries (``rep`` per KV head) that read them."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(dtype)

    shared = 4 * randn(batch, heads, 1, head_dim)  # a direction all keys share, which a centered K takes out
    prompt = past - 3
    q = randn(batch, rep * heads, prompt, head_dim)
    k = PackedKV.from_float(shared + randn(batch, heads, prompt, head_dim), specs[0], query=q)
    v = PackedKV.from_float(randn(batch, heads, prompt, head_dim), specs[1])
    for _ in range(3):
        k = k.append(shared + randn(batch, heads, 1, head_dim), query=randn(batch, rep * heads, 1, head_dim))
        v = v.append(randn(batch, heads, 1, head_dim))
    k_new, v_new = shared + randn(batch, heads, 1, head_dim), randn(batch, heads, 1, head_dim)
    return k, v, k_new, v_new, randn(batch, rep * heads, 1, head_dim)


@pytest.mark.parametrize(
    "specs, dtype, mask, softcap, rep, head_dim",
    [
        ((DEFAULT.k, DEFAULT.v), torch.float32, None, 0.0, 3, 64),
        (KIVI, torch.float16, "bool", 30.0, 3, 64),
        (ASYM_INT2_INT8, torch.bfloat16, "float", 0.0, 3, 64),
        ((DEFAULT.k, DEFAULT.v), torch.float32, None, 0.0, cpu_steps.ROW_SUMS, 64),  # a sum a head, at the most
        ((DEFAULT.k, DEFAULT.v), torch.float32, None, 0.0, cpu_steps.ROW_SUMS + 1, 64),  # one sum for every head
        # Two groups of 64 a head (the bench model's), and groups clipped to 16 channels (QuantSpec.token_group)
        # in five runs of a head: sums over more than one run, under a block-Hadamard rotation at 80.
        ((DEFAULT.k, DEFAULT.v), torch.float32, None, 0.0, 4, 128),
        ((DEFAULT.k, DEFAULT.v), torch.bfloat16, "bool", 0.0, 2, 80),
    ],
    ids=["default-fp32", "kivi-fp16-bool-mask-softcap", "asym-int2-int8-bf16-float-mask", "default-fp32-row-sums-heads",
         "default-fp32-many-heads",
         "default-fp32-head-dim-128", "default-bf16-bool-mask-head-dim-80"],
)  # fmt: skip
def test_a_decode_steps_fused_attention_agrees_with_the_reference(compiled_steps, monkeypatch, specs, dtype, mask,
                                                                  softcap, rep, head_dim):  # fmt: skip
    k, v, k_new, v_new, q = _caches(specs, 3, 2, 150, dtype, seed=specs[0].bits, rep=rep, head_dim=head_dim)
    assert k.codes.shape[2] and (mask is not None or (k.head.shape[2] and k.offset.shape[2] and v.fine_codes.shape[2]))
    assert mask is None or specs[0].scheme != "channel" or k.residual.shape[2], "K's waiting tail is read"
    keys = k.shape[2] + 1
    if mask is None:
        attn_mask = None
    else:  # row 0 sees every key, row 1 misses its first 5 (left padding), row 2 none (zeros out)
        seen = torch.ones(3, 1, 1, keys, dtype=torch.bool)
        seen[1, ..., :5] = False
        seen[2] = False
        attn_mask = seen if mask == "bool" else torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, float("-inf"))

    def attend():
        return packed.attention(q, k, v, k_new, v_new, attn_mask, None, False, softcap)

    got = _second(attend)
    assert compiled_steps.count(cpu_steps._decode_attention) == 1
    monkeypatch.setattr(cpu_steps, "enabled", False)
    expected = attend()
    assert got.dtype == expected.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    if mask is not None:
        assert not got[2].any(), "a row with every key masked is zeros, as SDPA's"


@pytest.mark.parametrize("rep, group", [(1, 1), (5, 5), (16, 16), (17, 9), (71, 15), (128, 16)])
def test_query_heads_sum_in_groups_so_the_compile_does_not_grow_with_them(monkeypatch, rep, group):
    """Each query head's scores and output are the plain products', and the sums to compile are one
    group's: the fewest groups of at most ``ROW_SUMS`` heads (71 heads, Falcon-7B's: 5 of 15)."""
    monkeypatch.setattr(cpu_steps, "ROW_SUMS", 16)
    g = torch.Generator().manual_seed(rep)
    q = torch.randn(2, 3, rep, 64, generator=g)
    keys = torch.randn(2, 3, 10, 2, 4, 8, generator=g)  # a per-token part's [runs, fields, run]
    p = torch.rand(2, 3, rep, 10, generator=g)
    torch.testing.assert_close(cpu_steps._dots(q, keys), q @ keys.flatten(3).transpose(-1, -2))
    torch.testing.assert_close(cpu_steps._weighted(p, keys), p @ keys.flatten(3))
    for fn, args in ((cpu_steps._dots, (q, keys)), (cpu_steps._weighted, (p, keys))):
        graph = make_fx(fn)(*args).graph
        assert sum(n.target is torch.ops.aten.sum.dim_IntList for n in graph.nodes) == group, fn.__name__


# One query head a KV head over a rotated cache and no extras: MiMo-V2-Flash's sink layers, whose compile
# had failed (Inductor guarded on the stored lengths where the new tokens' probabilities were read).
ROTATED = QuantSpec(4, "token", 64, rotate=True)


@pytest.mark.parametrize(
    "specs, dtype, batch, rep, head_dim",
    [((DEFAULT.k, DEFAULT.v), torch.float32, 1, 2, 64), ((DEFAULT.k, DEFAULT.v), torch.bfloat16, 1, 2, 64),
     ((ROTATED, ROTATED), torch.float32, 1, 1, 32), ((DEFAULT.k, DEFAULT.v), torch.float32, 3, 2, 64)],
    ids=["default-fp32", "default-bf16", "rotated-one-query-head", "default-fp32-batch-3-left-padded"],
)  # fmt: skip
def test_an_attention_sinks_zero_token_takes_the_fused_attention(compiled_steps, monkeypatch, specs, dtype, batch,
                                                                 rep, head_dim):  # fmt: skip
    """GPT-OSS's attention sinks reach kv4 as one more new token, key and value zero, whose mask column
    is the sink's logit (passes.py): a decode step's attention over two new tokens, fused like one."""
    k, v, k_new, v_new, q = _caches(specs, batch, 2, 150, dtype, seed=11, rep=rep, head_dim=head_dim)
    k_new, v_new = (torch.cat([t, torch.zeros_like(t)], 2) for t in (k_new, v_new))
    sink_logits = torch.randn(batch, 2 * rep, 1, 1, generator=torch.Generator().manual_seed(12)).to(dtype)
    rows = torch.zeros(batch, 2 * rep, 1, k.shape[2] + 1, dtype=dtype)
    for row in range(1, batch):  # later rows left-padded, as generate pads a batch
        rows[row, :, :, : 7 * row] = float("-inf")
    attn_mask = torch.cat([rows, sink_logits], -1)

    def attend():
        return packed.attention(q, k, v, k_new, v_new, attn_mask, None, False)

    got = _second(attend)
    assert compiled_steps.count(cpu_steps._decode_attention) == 1 and not cpu_steps._refused
    monkeypatch.setattr(cpu_steps, "enabled", False)
    expected = attend()
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    # The sink takes its share of every row: without its column the output is another.
    assert not torch.allclose(got, packed.attention(q, k, v, k_new[:, :, :1], v_new[:, :, :1], rows, None, False),
                              **TOLERANCE[dtype])  # fmt: skip


def test_a_cache_read_as_both_k_and_v_takes_the_fused_attention(compiled_steps, monkeypatch):
    """DeepSeek-V4 attends over one cache as keys and as values: the same tensors in K's places and V's.
    A graph traced with distinct aliases rejected them (Dynamo guards that an input passed twice is), and
    the key's calls ran eagerly (until the fifty-first run the failure turned the compiled path off)."""
    gen = torch.Generator().manual_seed(13)
    kv = PackedKV.from_float(torch.randn(1, 2, 120, 64, generator=gen), DEFAULT.v)
    q, new = torch.randn(1, 4, 1, 64, generator=gen), torch.randn(1, 2, 1, 64, generator=gen)

    def attend():
        return packed.attention(q, kv, kv, new, new, None, None, False)

    got = _second(attend)
    assert cpu_steps.enabled and compiled_steps.count(cpu_steps._decode_attention) == 1
    monkeypatch.setattr(cpu_steps, "enabled", False)
    torch.testing.assert_close(got, attend(), **TOLERANCE[torch.float32])


# Unrefined per-token caches (no second plane): K rotated with fp sinks and an offset, V asymmetric int8.
UNREFINED = (QuantSpec(4, "token", 32, rotate=True, clip=True, sinks=4, center=True),
             QuantSpec(8, "token", 64, symmetric=False))  # fmt: skip


@pytest.mark.parametrize(
    "specs, dtype, mask",
    [((DEFAULT.k, DEFAULT.v), torch.float32, None), ((DEFAULT.k, DEFAULT.v), torch.bfloat16, "bool"),
     ((DEFAULT.k, DEFAULT.v), torch.float16, None), (UNREFINED, torch.float32, None),
     (UNREFINED, torch.bfloat16, "bool")],
    ids=["default-fp32", "default-bf16-mask", "default-fp16", "unrefined-fp32", "unrefined-bf16-mask"],
)  # fmt: skip
def test_a_decode_steps_attention_and_appends_are_one_graph_and_store_the_references_bits(
    compiled_steps, monkeypatch, specs, dtype, mask
):
    k, v, k_new, v_new, q = _caches(specs, 3, 2, 150, dtype, seed=7)
    assert k.head.shape[2] and k.offset.shape[2]
    assert (k.query_scales is not None and v.fine_codes.shape[2]) if specs[1].refine else v.fine_codes is None
    attn_mask = None
    if mask is not None:  # row 1 misses its first 5 keys (left padding)
        attn_mask = torch.ones(3, 1, 1, k.shape[2] + 1, dtype=torch.bool)
        attn_mask[1, ..., :5] = False

    def step():
        return packed.attend_and_append(q, k, v, k_new, v_new, attn_mask, None, False, 0.0, query=q)

    step()  # a key's first call runs the three apart
    before = len(compiled_steps)
    out, k_grown, v_grown = step()
    assert compiled_steps[before:] == [cpu_steps._decode_step]
    monkeypatch.setattr(cpu_steps, "enabled", False)
    expected = packed.attention(q, k, v, k_new, v_new, attn_mask)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    assert same_stored_bits(k_grown, k.append(k_new, query=q)) and same_stored_bits(v_grown, v.append(v_new))


def test_a_decode_step_on_inputs_that_need_grad_is_compiled_and_stores_no_autograd_record(compiled_steps,
                                                                                           monkeypatch):  # fmt: skip
    """In grad mode the queries and new tokens need grad, and so may a float mask made from parameters
    (a learned bias). The compiled step takes them (its graph guards on requires_grad, which the aliases
    it is traced with carry over), its output keeps the record, so a backward raises instead of skipping
    the attention, and what the caches store keeps none."""
    k, v, k_new, v_new, q = _caches((DEFAULT.k, DEFAULT.v), 3, 2, 150, torch.float32, seed=7)
    bias = torch.zeros((), requires_grad=True)
    attn_mask = bias + torch.zeros(3, 1, 1, k.shape[2] + 1)
    q, k_new, v_new = (t.clone().requires_grad_() for t in (q, k_new, v_new))

    def step():
        return packed.attend_and_append(q, k, v, k_new, v_new, attn_mask, None, False, 0.0, query=q)

    step()  # a key's first call runs the three apart
    before = len(compiled_steps)
    out, k_grown, v_grown = step()
    assert compiled_steps[before:] == [cpu_steps._decode_step] and cpu_steps.enabled
    assert not any(t.requires_grad for t in (*k_grown._inner(), *v_grown._inner()))
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()
    monkeypatch.setattr(cpu_steps, "enabled", False)
    q, k_new, v_new, attn_mask = (t.detach() for t in (q, k_new, v_new, attn_mask))
    expected = packed.attention(q, k, v, k_new, v_new, attn_mask)
    torch.testing.assert_close(out.detach(), expected, **TOLERANCE[torch.float32])
    assert same_stored_bits(k_grown, k.append(k_new, query=q)) and same_stored_bits(v_grown, v.append(v_new))


@pytest.mark.parametrize("made_in_inference_mode", [True, False], ids=["made-in-inference-mode", "stepped-in-it"])
def test_a_cache_made_in_one_inference_mode_and_stepped_in_the_other_is_compiled(compiled_steps, monkeypatch, caplog,
                                                                                 made_in_inference_mode):  # fmt: skip
    """A prefix cache built under torch.inference_mode() and passed to generate (no_grad), or the
    reverse: a graph guards on whether each input is an inference tensor, and one traced on aliases
    that took the mode instead had rejected the cache's own parts, leaving that structure eager for the
    process."""
    with torch.inference_mode(made_in_inference_mode):
        k, v, k_new, v_new, q = _caches((DEFAULT.k, DEFAULT.v), 3, 2, 150, torch.float32, seed=7)
    with torch.inference_mode(not made_in_inference_mode):
        q, k_new, v_new = (t.clone() for t in (q, k_new, v_new))

        def step():
            return packed.attend_and_append(q, k, v, k_new, v_new, None, None, False, 0.0, query=q)

        step()  # a key's first call runs the three apart
        before = len(compiled_steps)
        with caplog.at_level(logging.WARNING, logger="kvpass"):
            out, k_grown, v_grown = step()
        assert compiled_steps[before:] == [cpu_steps._decode_step] and not caplog.text
        monkeypatch.setattr(cpu_steps, "enabled", False)
        torch.testing.assert_close(out, packed.attention(q, k, v, k_new, v_new), **TOLERANCE[torch.float32])
        assert same_stored_bits(k_grown, k.append(k_new, query=q)) and same_stored_bits(v_grown, v.append(v_new))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_attention_sinks_decode_step_is_one_graph_that_stores_the_new_token_alone(compiled_steps, monkeypatch,
                                                                                    dtype):  # fmt: skip
    # GPT-OSS's sink logit is read as a zero token after the new one (reference.with_sink), which the
    # appends do not store: a decode step of it is one graph too, since the fifty-fourth run.
    k, v, k_new, v_new, q = _caches((DEFAULT.k, DEFAULT.v), 3, 2, 150, dtype, seed=9)
    sink = torch.randn(3, q.shape[1], 1, 1, generator=torch.Generator().manual_seed(10)).to(dtype)
    attn_mask = torch.zeros(3, 1, 1, k.shape[2] + 1, dtype=dtype)
    attn_mask[1, ..., :5] = float("-inf")  # row 1 left-padded

    def step():
        return packed.attend_and_append(q, k, v, k_new, v_new, attn_mask, None, False, 0.0, query=q, sink=sink)

    step()  # a key's first call runs the three apart
    before = len(compiled_steps)
    out, k_grown, v_grown = step()
    assert compiled_steps[before:] == [cpu_steps._decode_step]
    monkeypatch.setattr(cpu_steps, "enabled", False)
    expected = packed.attention(q, k, v, *reference.with_sink(k_new, v_new, attn_mask, sink))
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    assert same_stored_bits(k_grown, k.append(k_new, query=q)) and same_stored_bits(v_grown, v.append(v_new))
    assert not torch.allclose(out, packed.attention(q, k, v, k_new, v_new, attn_mask), **TOLERANCE[dtype])


def test_a_decode_step_inductor_fails_on_runs_its_three_parts_compiled(compiled_steps, monkeypatch, caplog):
    # A refused key's calls run its eager form, which for a decode step is the attention and the two
    # appends apart: each compiled on its own, the same bits stored.
    compile_ = cpu_steps._compile

    def fails_on_the_step(fn, args):
        if fn is cpu_steps._decode_step:
            raise RuntimeError("Inductor cannot lower this graph")
        return compile_(fn, args)

    monkeypatch.setattr(cpu_steps, "_compile", fails_on_the_step)
    k, v, k_new, v_new, q = _caches((DEFAULT.k, DEFAULT.v), 2, 2, 150, torch.float32, seed=5)
    before = len(compiled_steps)  # the caches' own appends ran compiled too

    def step():
        return packed.attend_and_append(q, k, v, k_new, v_new, None, None, False, 0.0, query=q)

    with caplog.at_level(logging.WARNING, logger="kvpass"):
        for _ in range(3):  # eagerly, the step's failed compile with its parts' first calls, then compiled
            out, k_grown, v_grown = step()
    assert cpu_steps.enabled and [fn for fn, _ in cpu_steps._refused] == [cpu_steps._decode_step]
    ran = compiled_steps[before:]
    assert cpu_steps._decode_step not in ran and ran.count(cpu_steps._decode_attention) == 2
    assert ran[-3:] == [cpu_steps._decode_attention, reference.encode_refined, reference.encode_refined]
    assert caplog.text.count("_decode_step runs eagerly on CPU for one structure") == 1
    monkeypatch.setattr(cpu_steps, "enabled", False)
    torch.testing.assert_close(out, packed.attention(q, k, v, k_new, v_new), **TOLERANCE[torch.float32])
    assert same_stored_bits(k_grown, k.append(k_new, query=q)) and same_stored_bits(v_grown, v.append(v_new))


def test_the_fused_attention_takes_the_cache_length_as_a_symbol(compiled_steps):
    k, v, k_new, v_new, q = _caches((DEFAULT.k, DEFAULT.v), 1, 2, 100, torch.float32, seed=3)
    _second(lambda: packed.attention(q, k, v, k_new, v_new))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(3):  # as decode steps go: one more token each, and the refined plane moves along
        k, v = k.append(k_new, query=q), v.append(v_new)
        got = packed.attention(q, k, v, k_new, v_new)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert compiled_steps.count(cpu_steps._decode_attention) == 4
    by_scales = reference.by_query_scales  # packed.attention reads a query-scaled K with q / s
    expected = reference.attention(by_scales(q, k.query_scales, -1), k.codes, k.scales, k.residual, v.codes,
                                   v.scales, v.residual, by_scales(k_new, k.query_scales, 1), v_new, None, 0.125,
                                   False, k.spec, v.spec, 0.0, k.fine_codes, k.fine_scales, v.fine_codes,
                                   v.fine_scales, k.head, k.offset, v.head, v.offset)  # fmt: skip
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


def test_one_graph_serves_a_cache_passing_4096_keys(compiled_steps):
    # Inductor's CPU code sums more than 4,096 floats in chunks and fewer plainly, and guarded on the
    # choice for a backed length: the default's attention compiled twice more as a cache passed 4,096
    # keys (its sum over every key) and about 4,160 (over the keys outside V's second plane).
    k, v, k_new, v_new, q = _caches((DEFAULT.k, DEFAULT.v), 1, 1, 4090, torch.float32, seed=7, rep=1)
    _second(lambda: packed.attention(q, k, v, k_new, v_new))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(80):
        k, v = k.append(k_new, query=q), v.append(v_new)
        got = packed.attention(q, k, v, k_new, v_new)
    assert k.shape[2] + 1 == 4090 + 80 + 1 > 4096 + 64
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert compiled_steps.count(cpu_steps._decode_attention) == 1 + 80
    with cpu_steps.reference_attention():
        torch.testing.assert_close(got, packed.attention(q, k, v, k_new, v_new), **TOLERANCE[torch.float32])


def test_a_plane_of_one_row_and_a_longer_one_share_a_graph(compiled_steps):
    # A part of 0 or 1 rows is contiguous to torch whatever its row stride (an op's output has the
    # contiguous one): it keyed a graph of its own, compiled again as V's plane reached 2 rows.
    gen = torch.Generator().manual_seed(8)
    k = PackedKV.from_float(torch.randn(2, 2, 9, 64, generator=gen), DEFAULT.k)
    v = PackedKV.from_float(torch.randn(2, 2, 9, 64, generator=gen), DEFAULT.v)
    q = torch.randn(2, 6, 1, 64, generator=gen)
    lengths = []
    for step in range(10):
        k_new, v_new = torch.randn(2, 2, 1, 64, generator=gen), torch.randn(2, 2, 1, 64, generator=gen)
        if step == 2:  # the attention's first call ran eagerly, the second compiled, as V's append's
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        got = packed.attention(q, k, v, k_new, v_new)
        lengths.append(v.fine_codes.shape[2])
        if step < 9:
            k, v = k.append(k_new, query=q), v.append(v_new)
    assert lengths[:3] == [1, 1, 1] and lengths[-1] == 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert [fn for fn, _ in cpu_steps._compiled].count(cpu_steps._decode_attention) == 1
    with cpu_steps.reference_attention():
        torch.testing.assert_close(got, packed.attention(q, k, v, k_new, v_new), **TOLERANCE[torch.float32])


def test_prompts_static_caches_and_causal_single_queries_stay_with_the_reference(compiled_steps):
    k, v, k_new, v_new, q = _caches((DEFAULT.k, DEFAULT.v), 1, 2, 100, torch.float32, seed=4)
    k4, v4, q4 = (torch.cat([t] * 4, dim=2) for t in (k_new, v_new, q))
    for _ in range(2):
        packed.attention(q4, k, v, k4, v4)  # a chunk of 4 queries
        packed.attention(q, k, v)  # a static cache's step: its new token is in the buffer
        packed.attention(q, k, v, k_new, v_new, is_causal=True)  # top-left causal: the first key only
    assert cpu_steps._decode_attention not in compiled_steps
    assert all(fn is not cpu_steps._decode_attention for fn, _ in cpu_steps._compiled)


def _planes_rows_in(t: PackedKV, rows: int) -> PackedKV:
    """``t`` with its second planes ``rows`` rows into a storage of their own, sequence-major: where a
    graph compiled whole hands them (an append outside one starts them at its storage's first row)."""

    def moved(x):
        if x is not t.fine_codes and x is not t.fine_scales:
            return x
        by_row = x.movedim(2, 0)
        return torch.cat([by_row[:rows], by_row])[rows:].movedim(0, 2)

    return packed._map_inner(t, moved)


def test_a_cache_regrowing_and_its_planes_sliding_compile_nothing_more(compiled_steps, monkeypatch):
    # Codes live in a storage with spare rows that regrows, and a second plane's view can slide
    # through its storage, whose offset of 0 or 1 Dynamo specialised (a graph each time it came round).
    gen = torch.Generator().manual_seed(5)
    # 300 tokens: K's second plane has its 2 rows or more already (a shorter cache's grows from none,
    # and a plane of 0 or 1 rows is contiguous to torch, another structure than a longer one's view).
    k, v, k_new, v_new, q = _caches((DEFAULT.k, DEFAULT.v), 1, 2, 300, torch.float32, seed=5)
    assert k.fine_codes.shape[2] >= 2
    for _ in range(3):  # the graph compiles with the planes a row into their storage, as a symbol
        k, v = _planes_rows_in(k.append(k_new, query=q), 1), v.append(v_new)
        packed.attention(q, k, v, k_new, v_new)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    storage_bytes, plane_offsets = set(), set()
    for step in range(300):
        k_new, v_new = torch.randn(1, 2, 1, 64, generator=gen), torch.randn(1, 2, 1, 64, generator=gen)
        k, v = k.append(k_new, query=q), v.append(v_new)
        k = _planes_rows_in(k, step % 3)
        got = packed.attention(q, k, v, k_new, v_new)
        storage_bytes.add(k.codes.untyped_storage().nbytes())
        plane_offsets.add(k.fine_codes.storage_offset())
    assert len(storage_bytes) > 1 and 0 in plane_offsets and len(plane_offsets) == 3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert compiled_steps.count(cpu_steps._decode_attention) == 3 - 1 + 300
    monkeypatch.setattr(cpu_steps, "enabled", False)
    torch.testing.assert_close(got, packed.attention(q, k, v, k_new, v_new), **TOLERANCE[torch.float32])


def test_a_traced_graphs_fresh_caches_compile_nothing_more(compiled_steps):
    # A model compiled whole (kv4(inner="inductor")) states values, not storage reuse: every decode
    # step's cache is a new tensor, which Inductor lays out contiguous, so its strides grow with it. A
    # key of those strides was a graph per step (2 s a SmolLM2 step at 512 tokens, against 0.1 s).
    def as_traced(t):
        return packed._map_inner(t, torch.Tensor.contiguous)

    k, v, k_new, v_new, q = _caches((DEFAULT.k, DEFAULT.v), 1, 2, 300, torch.float32, seed=6)
    k, v = as_traced(k), as_traced(v)
    assert k.codes.is_contiguous() and k.codes.stride(1) == k.codes.shape[2] * k.codes.shape[3]
    _second(lambda: packed.attention(q, k, v, k_new, v_new))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(3):
        k, v = as_traced(k.append(k_new, query=q)), as_traced(v.append(v_new))
        got = packed.attention(q, k, v, k_new, v_new)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert compiled_steps.count(cpu_steps._decode_attention) == 1 + 3
    with cpu_steps.reference_attention():
        torch.testing.assert_close(got, packed.attention(q, k, v, k_new, v_new), **TOLERANCE[torch.float32])


def test_kvpass_evals_numbers_do_not_depend_on_the_compiled_path(compiled_steps, monkeypatch):
    # Its measurements run the reference attention, so documented numbers reproduce to the last bit;
    # the quantization is compiled all the same.
    from kvpass import eval as kv_eval

    model = kv_heavy_llama()
    ids = torch.randint(2, model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(1))
    runner = kv_eval.Runner(model, kv_eval.parse_method("kv4"))
    nll = {}
    for enabled in (True, False):
        monkeypatch.setattr(cpu_steps, "enabled", enabled)
        torch._dynamo.reset()
        nll[enabled], scored, _ = kv_eval.streaming_nll(runner, ids, 1, prefill=70)
    assert scored == 10 and nll[True] == nll[False]
    assert reference.encode_refined in compiled_steps and cpu_steps._decode_attention not in compiled_steps
    assert cpu_steps.fused_attention
