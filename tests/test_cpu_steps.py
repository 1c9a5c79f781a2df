"""A CPU decode step's quantization compiled by Inductor (kvpass.cpu_steps): the eager reference's
codes and scales bit for bit, taken only where it composes, and eager again where it cannot compile."""

import logging
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import DynamicCache

from kvpass import cpu_steps, ops, reference
from kvpass.config import KVConfig, QuantSpec
from tests.helpers import bits_equal, hard_values, kv_heavy_llama

DEFAULT = KVConfig()


@pytest.fixture
def compiled_steps(monkeypatch):
    monkeypatch.setattr(cpu_steps, "enabled", True)


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
    offset = torch.randn(9, 3, 1, 64).half() if spec.center else None
    refined = spec.refine > 0
    encode = cpu_steps.encode_refined if refined else cpu_steps.encode
    expected = (reference.encode_refined(x, spec, offset=offset) if refined
                else reference.encode(x, spec, offset))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # compiling is silent: a user sees none of it
        got = encode(x, spec, offset)
    assert cpu_steps.enabled, "the compiled path failed and fell back"
    assert len(got) == len(expected)
    for out, ref in zip(got, expected):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert torch.equal(out, ref) if out.dtype == torch.uint8 else bits_equal(out, ref)
    assert any(s.isnan().any() for s in got[1::2]), "the hard values' non-finite tokens are in the batch"


def test_equal_specs_share_one_compiled_graph(compiled_steps):
    # ops.quantize_refined builds a new QuantSpec each call: the graph must guard on its values.
    x = torch.randn(2, 3, 1, 64)
    args = (x, *ops.codec_args(DEFAULT.v), DEFAULT.v.refine)
    ops.quantize_refined(*args)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(3):
        ops.quantize_refined(*args)
    assert cpu_steps.enabled and cpu_steps._compiled.cache_info().currsize, "it compiled, not fell back"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_only_plain_cpu_decode_steps_take_the_compiled_path(compiled_steps, monkeypatch):
    step = torch.randn(1, 2, 1, 64)
    assert cpu_steps._takes(step)
    assert not cpu_steps._takes(torch.randn(1, 2, 2, 64)), "a prompt or chunk stays eager"
    with FakeTensorMode() as mode:
        assert not cpu_steps._takes(mode.from_tensor(step))
    monkeypatch.setattr(cpu_steps, "enabled", False)
    assert not cpu_steps._takes(step)


def test_a_failed_compile_leaves_the_eager_reference_and_says_so(compiled_steps, monkeypatch, caplog):
    def no_compiler(fn, spec):
        def fails(*args):
            raise RuntimeError("no C++ compiler")

        return fails

    monkeypatch.setattr(cpu_steps, "_compiled", no_compiler)
    x = torch.randn(1, 2, 1, 64)
    with caplog.at_level(logging.WARNING, logger="kvpass"):
        got = cpu_steps.encode_refined(x, DEFAULT.v)
    assert all(torch.equal(a, b) for a, b in zip(got, reference.encode_refined(x, DEFAULT.v)))
    assert not cpu_steps.enabled
    assert "Inductor failed (RuntimeError: no C++ compiler)" in caplog.text


def test_an_input_the_reference_rejects_raises_its_error_and_keeps_the_compiled_path(compiled_steps):
    with pytest.raises(ValueError, match="head_dim 7 must be a multiple of 2"):
        cpu_steps.encode(torch.randn(1, 2, 1, 7), QuantSpec(4, "token", 16))
    assert cpu_steps.enabled


def test_opcheck_with_the_compiled_path(compiled_steps, monkeypatch):
    runs = []
    run = cpu_steps._run
    monkeypatch.setattr(cpu_steps, "_run", lambda *args: runs.append(args[0]) or run(*args))
    x = torch.randn(2, 3, 1, 64)
    torch.library.opcheck(ops.quantize_refined, (x, *ops.codec_args(DEFAULT.v), DEFAULT.v.refine))
    torch.library.opcheck(ops.quantize, (x, *ops.codec_args(QuantSpec(bits=4, scheme="token", group=32))))
    # opcheck calls the real kernel on plain tensors too: those calls went through the compiled code.
    assert reference.encode_refined in runs and reference.encode in runs
    assert cpu_steps.enabled


@torch.no_grad()
def test_a_kv4_model_decodes_the_same_logits_with_the_compiled_path(monkeypatch):
    model = kv_heavy_llama()
    ids = torch.randint(0, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(0))
    runs = []
    run = cpu_steps._run
    monkeypatch.setattr(cpu_steps, "_run", lambda *args: runs.append(args[0]) or run(*args))
    logits = {}
    for enabled in (False, True):
        monkeypatch.setattr(cpu_steps, "enabled", enabled)
        torch._dynamo.reset()
        step, cache, token, logits[enabled] = torch.compile(model, backend="kv4"), DynamicCache(), ids, []
        for _ in range(4):
            out = step(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
            logits[enabled].append(out)
            token = out.argmax(-1, keepdim=True)
    assert cpu_steps.enabled
    # K and V of 2 layers, 3 decode steps, all through the compiled reference.
    assert runs == [reference.encode_refined] * 12
    assert all(torch.equal(a, b) for a, b in zip(logits[True], logits[False]))


def test_more_specs_than_dynamos_recompile_limit_all_run_compiled(compiled_steps, monkeypatch):
    # kvpass eval tries a dozen schemes in one process, and Dynamo keeps recompile_limit (8) graphs per
    # code object: here a limit of 2 against 3 specs, which is cheaper to compile.
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    x = torch.randn(1, 2, 1, 64)
    specs = [QuantSpec(4, "token", group) for group in (16, 32, 64)]
    torch._dynamo.reset()  # a spec another test compiled compiles again here
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for spec in specs:
        assert all(torch.equal(a, b) for a, b in zip(cpu_steps.encode(x, spec), reference.encode(x, spec)))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + len(specs)


def test_a_tokens_stride_does_not_compile_another_graph(compiled_steps):
    # A one-token dimension's stride is arbitrary: V's new token arrives with another than K's.
    x = torch.randn(1, 1, 3, 64).transpose(1, 2)  # [1, 3, 1, 64], the token dimension's stride 192
    spec = QuantSpec(4, "token", 16, symmetric=False)
    assert x.is_contiguous() and x.stride(2) != torch.randn(1, 3, 1, 64).stride(2)
    cpu_steps.encode(x.contiguous(), spec)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    y = torch.randn(1, 3, 1, 64)
    got = cpu_steps.encode(y, spec)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert all(torch.equal(a, b) for a, b in zip(got, reference.encode(y, spec)))
