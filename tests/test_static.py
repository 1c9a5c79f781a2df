"""Static caches: int4 buffers from the first allocation, written in place, attended in int4."""

import logging
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, StaticCache
from transformers.generation import CompileConfig

import kvpass
from kvpass import ops, packed, reference
from kvpass.cache_argument import cache_arg, returned_cache
from kvpass.config import QuantSpec
from kvpass.coverage import tiny_config
from kvpass.models_zoo import build
from kvpass.packed import PackedKV
from kvpass.static import StaticKVCache, int4_static_caches
from tests.helpers import assert_latent_steps_match_twin, latent_decode


def _prompt(length=30):
    return torch.randint(2, 200, (1, length), generator=torch.Generator().manual_seed(0))


def test_opcheck_write():
    spec = QuantSpec(4, "token", 64, rotate=True)
    buffer = PackedKV.zeros((2, 3, 16, 64), torch.float32, "cpu", spec)
    args = (buffer.codes, buffer.scales, torch.tensor([3, 4]), torch.randn(2, 3, 2, 64), *ops.codec_args(spec))
    torch.library.opcheck(ops.write_, args)


def test_buffers_are_int4_from_the_first_allocation():
    model = build("llama_hd128")
    cache = StaticKVCache(model.config, max_cache_len=512)
    with torch.no_grad():
        model(input_ids=_prompt(), **cache_arg(cache), use_cache=True)
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            assert isinstance(t, PackedKV) and t.shape[2] == 512
            assert t.stored_bytes() <= 0.27 * t.numel() * 2
            # AOTAutograd reads the mark on the subclass input: its inner tensors become CUDA-graph static inputs
            assert getattr(t, "_dynamo_static_input_type", None)
    # the written slots hold the prompt, the others decode to zeros
    assert cache.layers[0].keys.dequantize()[:, :, 30:].abs().max() == 0
    assert cache.layers[0].keys.dequantize()[:, :, :30].abs().max() > 0


def test_bad_static_cache_arguments_are_named():
    """HF's StaticCache takes them and fails at the first write, on a storage size or an index."""
    config = build("llama").config
    for length in (0, -1, 8.0):
        with pytest.raises(ValueError, match=f"max_cache_len must be an int >= 1 .*, got {length}"):
            StaticKVCache(config, max_cache_len=length)
    with pytest.raises(TypeError, match="v_spec must be a kvpass.QuantSpec, got 'int4:token:64'"):
        StaticKVCache(config, max_cache_len=8, v_spec="int4:token:64")
    with pytest.raises(TypeError, match="k_spec must be a kvpass.QuantSpec, got 4"):
        int4_static_caches(build("llama"), k_spec=4)
    # HF's raise an AttributeError on the config's or the model's first attribute read
    with pytest.raises(TypeError, match=r"config must be a transformers PretrainedConfig \(model.config\), got None"):
        StaticKVCache(None, max_cache_len=8)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module \(.*\), got 'llama'"):
        int4_static_caches("llama")


def test_compiled_generate_rewrites_static_decode_and_matches_eager():
    torch._dynamo.reset()
    model = build("llama")
    expected = model.generate(
        _prompt(), max_new_tokens=10, do_sample=False, **cache_arg(StaticKVCache(model.config, max_cache_len=64))
    )
    backend = kvpass.kv4()
    model.compile(backend=backend)
    out = model.generate(
        _prompt(), max_new_tokens=10, do_sample=False, **cache_arg(StaticKVCache(model.config, max_cache_len=64))
    )
    assert torch.equal(out, expected)
    # the first graph too: StaticKVCache's int4 buffers are allocated inside it
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert sites and all(site.rewritten and site.phase == "static" for site in sites)


def test_a_static_buffer_allocated_before_compiling_keeps_its_spec_and_says_so():
    torch._dynamo.reset()
    model = build("llama")
    backend = kvpass.kv4(k_layer_bits={1: 8})
    model.compile(backend=backend)
    out = model.generate(_prompt(), max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                         **cache_arg(StaticKVCache(model.config, max_cache_len=64)))  # fmt: skip
    assert [layer.keys.spec.bits for layer in returned_cache(out).layers] == [4, 4]  # as StaticKVCache made them
    notes = {site.module: site.reason for graph in backend.graphs for site in graph.sites}
    assert notes["model.layers.0.self_attn"] == ""
    assert "allocated with int4:token:64:rot:mse and keeps it, not these settings' int8:" in notes["model.layers.1.self_attn"]


def test_generate_compile_route_with_a_static_kv_cache():
    torch._dynamo.reset()
    model = build("llama")
    expected = model.generate(
        _prompt(), max_new_tokens=8, do_sample=False, **cache_arg(StaticKVCache(model.config, max_cache_len=64))
    )
    config = CompileConfig(backend="kv4", fullgraph=False)
    config._compile_all_devices = True  # generate compiles on CUDA only unless told otherwise
    model.generation_config.compile_config = config
    before = len(kvpass.default_backend().graphs)
    out = model.generate(
        _prompt(), max_new_tokens=8, do_sample=False, **cache_arg(StaticKVCache(model.config, max_cache_len=64))
    )
    assert torch.equal(out, expected)
    sites = [site for graph in kvpass.default_backend().graphs[before:] for site in graph.sites]
    assert sites and all(site.rewritten for site in sites)


@pytest.mark.parametrize(
    "name, prompt, inner",
    [
        ("llama", 30, "eager"),
        ("llama", 30, "aot_eager"),
        ("gemma2", 30, "eager"),  # the sliding layer fills its 32 slots, then rolls
        ("gemma2", 30, "aot_eager"),
        ("gemma2", 40, "eager"),  # the prompt overflows the window: the layer keeps the newest 32
        ("mistral", 40, "eager"),  # sliding layers only
    ],
)
def test_static_cache_whose_first_forward_is_compiled_is_int4_from_the_first_graph(name, prompt, inner):
    """``model.compile`` + ``cache_implementation="static"``: the layers allocate inside the first
    graph, which then allocates int4 buffers (no fp zeros), and every later step stays int4."""
    torch._dynamo.reset()
    model = build(name)
    backend = kvpass.kv4(inner=inner)
    model.compile(backend=backend)
    out = model.generate(
        _prompt(prompt), max_new_tokens=8, do_sample=False, cache_implementation="static", return_dict_in_generate=True
    )
    layers = out.cache.layers
    assert all(isinstance(t, PackedKV) for layer in layers for t in (layer.keys, layer.values))
    prefill = backend.graphs[0]
    assert "torch.zeros" in prefill.before and "torch.zeros" not in prefill.after
    assert "kv4_zeros" in prefill.after
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert sites and all(site.rewritten for site in sites)
    assert all("dequantize" not in graph.after for graph in backend.graphs)  # no step materialises the cache
    torch._dynamo.reset()
    eager = build(name)
    size = max(layer.max_cache_len for layer in layers)
    expected = eager.generate(
        _prompt(prompt), max_new_tokens=8, do_sample=False, **cache_arg(StaticKVCache(eager.config, max_cache_len=size))
    )
    assert torch.equal(out.sequences, expected)


@torch.no_grad()
def test_a_second_static_generate_of_another_length_allocates_int4_as_the_first():
    # generate sizes its static cache to the prompt and the new tokens: a second call of another length
    # makes that length a symbol in the graph that allocates. The int4 buffer once took its shape from the
    # fp allocation's value, the symbol raw, and the step failed when it ran (NameError: s98).
    torch._dynamo.reset()
    model, eager = build("llama"), build("llama")
    model.compile(backend=kvpass.kv4())
    for prompt, new in ((30, 8), (40, 5)):
        settings = dict(max_new_tokens=new, do_sample=False)
        out = model.generate(_prompt(prompt), cache_implementation="static", return_dict_in_generate=True, **settings)
        layers = out.cache.layers
        assert all(isinstance(t, PackedKV) for layer in layers for t in (layer.keys, layer.values))
        stored = StaticKVCache(eager.config, max_cache_len=layers[0].max_cache_len)
        assert torch.equal(out.sequences, eager.generate(_prompt(prompt), **cache_arg(stored), **settings))


def _compiled_static_generate(config):
    """``(generate's output, the backend)``: 4 tokens after a 40-token prompt from a model of ``config``
    (seed 0) compiled with kv4, through ``cache_implementation="static"``."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    backend = kvpass.kv4()
    model.compile(backend=backend)
    out = model.generate(
        _prompt(40), max_new_tokens=4, do_sample=False, cache_implementation="static", return_dict_in_generate=True
    )
    return out, backend


def test_sliding_layer_that_upcasts_before_its_cache_update_keeps_an_overflowing_prompt_int4():
    """Beam casts K and V to fp32 before its cache update: a first update longer than the window is
    copied into the buffer from that cast, which the pass follows to allocate the buffer int4."""
    config = tiny_config("beam")
    assert config.sliding_window < 40 and "sliding_attention" in config.layer_types
    out, backend = _compiled_static_generate(config)
    assert all(isinstance(t, PackedKV) for layer in out.cache.layers for t in (layer.keys, layer.values))
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert sites and all(site.rewritten for site in sites)


def test_buffers_that_later_layers_read_are_allocated_int4_once():
    """Gemma 3n's layers 2 and 3 read the K/V of layers 0 and 1: the first graph's sites over one buffer
    allocate it int4 once (a second site packing its erased allocation again broke the graph's order), and
    the sliding layer's prompt, over its window, is copied in."""
    config = tiny_config("gemma3n_text")
    assert config.sliding_window < 40 and config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    out, backend = _compiled_static_generate(config)
    layers = out.cache.layers
    assert all(isinstance(t, PackedKV) for layer in layers[:2] for t in (layer.keys, layer.values))
    assert backend.graphs[0].after.count("kv4_zeros(") == 4
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert len(sites) == 4 * len(backend.graphs) and all(site.rewritten for site in sites)
    size = max(layer.max_cache_len for layer in layers[:2])
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    expected = model.generate(
        _prompt(40), max_new_tokens=4, do_sample=False, **cache_arg(StaticKVCache(config, max_cache_len=size))
    )
    assert torch.equal(out.sequences, expected)


@torch.no_grad()
def test_mla_static_latent_is_int4_and_attended_directly():
    """An MLA model's static cache holds its latent, written into slots: int4 from the graph that
    allocates it. A decode step attends over the int4 slots (the projections absorbed, as for a
    DynamicCache's latent), this step's tokens exact: their slots hidden, they come after the slots."""
    torch._dynamo.reset()
    model = build("deepseek_v3")
    ids = _prompt(40)
    cache = StaticCache(config=model.config, max_cache_len=64)
    backend, got = latent_decode(model, ids, cache)
    assert "kv4_zeros" in backend.graphs[0].after and "torch.zeros((" not in backend.graphs[0].after
    decode = [site for graph in backend.graphs[1:] for site in graph.sites]
    assert decode and all(site.reason.startswith("attends over its int4 latent cache directly") for site in decode)
    # the latent and the rope key
    assert (tuple(cache.layers[0].keys.shape), tuple(cache.layers[0].values.shape)) == ((1, 1, 64, 32), (1, 1, 64, 16))

    # Each slot quantized once as written (V's spec, as a slot stores it); new tokens read exact.
    assert_latent_steps_match_twin(model, ids, got, backend.config.v.for_slots)


@torch.no_grad()
def test_mla_static_latent_allocated_fp_before_the_graph_stays_fp16_and_says_why():
    torch._dynamo.reset()
    model = build("deepseek_v3")
    cache = StaticCache(config=model.config, max_cache_len=64)
    model(input_ids=_prompt(), **cache_arg(cache), use_cache=True)  # eager: fp buffers
    backend = kvpass.kv4()
    torch.compile(model, backend=backend)(input_ids=_prompt(1), **cache_arg(cache), use_cache=True)
    sites = backend.graphs[-1].sites
    assert sites and all(not site.rewritten for site in sites)
    assert all(
        site.reason.startswith("attends over K/V projected from a latent cache left fp16: latent cache static cache "
                               "buffer") and "allocated before this graph" in site.reason
        for site in sites
    )  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [
        "jetmoe",  # heads tiled by repeat, then the prefix sliced
        "gpt_oss",  # attention sinks, sliding and full layers
        "diffllama",  # two sites read each buffer; V is a chunk of its heads tiled back
    ],
)
@torch.no_grad()
def test_static_reads_with_tiled_heads_sinks_or_picked_v_heads_match_the_uncompiled_int4_run(name):
    """The uncompiled model over the same int4 buffers computes attention on their dequantized
    values: the rewritten graphs must agree with it."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(name)).eval()
    run = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    expected = model.generate(_prompt(40), **cache_arg(StaticKVCache(model.config, max_cache_len=64)), **run)
    backend = kvpass.kv4()
    model.compile(backend=backend)
    out = model.generate(_prompt(40), **cache_arg(StaticKVCache(model.config, max_cache_len=64)), **run)
    assert torch.equal(out.sequences, expected.sequences)
    for got, want in zip(out.scores, expected.scores):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert sites and all(site.rewritten for site in sites)
    # a sliding layer whose first write overflows its window attends over the exact new tokens
    assert {site.phase for site in sites} == ({"prefill", "static"} if name == "gpt_oss" else {"static"})


def test_static_cache_allocated_before_compilation_stays_fp_and_says_how_to_get_int4(caplog):
    """Said at WARNING, once: a user who compiled for int4 caches and logs nothing else learns they are not."""
    torch._dynamo.reset()
    model = build("llama")
    backend = kvpass.kv4()
    model.compile(backend=backend)
    config = model.config
    cache = StaticCache(config, max_cache_len=64)
    cache.early_initialization(1, config.num_key_value_heads, config.head_dim, model.dtype, model.device)
    with caplog.at_level(logging.WARNING, logger="kvpass"):
        model.generate(_prompt(), max_new_tokens=3, do_sample=False, **cache_arg(cache))
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert len(backend.graphs) == 2 and sites and not any(site.rewritten for site in sites)
    assert all("kvpass.StaticKVCache" in site.reason for site in sites)
    assert not isinstance(cache.layers[0].keys, PackedKV)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert re.match(r"kvpass: graph_\d+ leaves 2 of its 2 attention sites fp16; site 0 "
                    r"\(model.layers.0.self_attn\): .*kvpass.StaticKVCache", warning)  # fmt: skip


def _record_block_reads(monkeypatch) -> list[int]:
    """The first token of every block of stored K and V that attention dequantizes, from now on."""
    read = []
    original = reference._Stored.block

    def recording(self, start, stop):
        read.append(start)
        return original(self, start, stop)

    monkeypatch.setattr(reference._Stored, "block", recording)
    return read


def test_static_decode_reads_only_the_blocks_holding_tokens(monkeypatch):
    """A 1024-slot buffer holding under 40 tokens: decode dequantizes its first block only."""
    torch._dynamo.reset()
    model = build("llama")
    read = _record_block_reads(monkeypatch)
    model.compile(backend=kvpass.kv4())
    model.generate(
        _prompt(), max_new_tokens=4, do_sample=False, **cache_arg(StaticKVCache(model.config, max_cache_len=1024))
    )
    assert read and set(read) == {0}


def test_uncompiled_forward_reads_a_static_cache_block_by_block(monkeypatch):
    """No torch.compile (as in generate's eager prefill): SDPA over the int4 buffers goes through
    kv4's attention, which dequantizes only the blocks holding tokens, never the whole buffer."""
    model = build("llama")
    read = _record_block_reads(monkeypatch)
    monkeypatch.setattr(packed, "_fallback", lambda func, *_: pytest.fail(f"{func} went through the fallback"))
    out = model.generate(
        _prompt(), max_new_tokens=4, do_sample=False, **cache_arg(StaticKVCache(model.config, max_cache_len=1024))
    )
    assert read and set(read) == {0}
    monkeypatch.undo()
    expected = model.generate(
        _prompt(), max_new_tokens=4, do_sample=False, **cache_arg(StaticKVCache(model.config, max_cache_len=64))
    )
    assert torch.equal(out, expected)


def test_generate_own_static_cache_is_int4_when_the_model_opts_in():
    """``cache_implementation="static"`` with generate's kv4 compile route: int4 buffers, the
    same tokens as a ``StaticKVCache`` of the same size, and a plain forward once opted out."""
    torch._dynamo.reset()
    model = build("llama")
    config = CompileConfig(backend="kv4", fullgraph=True)
    config._compile_all_devices = True  # generate compiles on CUDA only unless told otherwise
    handle = int4_static_caches(model)
    before = len(kvpass.default_backend().graphs)
    out = model.generate(
        _prompt(), max_new_tokens=8, do_sample=False, cache_implementation="static", compile_config=config,
        return_dict_in_generate=True,
    )  # fmt: skip
    layers = out.cache.layers
    assert all(isinstance(t, PackedKV) for layer in layers for t in (layer.keys, layer.values))
    sites = [site for graph in kvpass.default_backend().graphs[before:] for site in graph.sites]
    assert sites and all(site.rewritten and site.phase == "static" for site in sites)
    size = layers[0].max_cache_len
    expected = model.generate(
        _prompt(), max_new_tokens=8, do_sample=False, **cache_arg(StaticKVCache(model.config, max_cache_len=size))
    )
    assert torch.equal(out.sequences, expected)

    handle.remove()
    cache = StaticCache(model.config, max_cache_len=64)
    with torch.no_grad():
        model(input_ids=_prompt(), **cache_arg(cache), use_cache=True)
    assert not isinstance(cache.layers[0].keys, PackedKV)


def test_opted_in_model_converts_an_early_initialized_empty_static_cache():
    """generate allocates a static cache ahead of a chunked prefill; still empty, it becomes int4."""
    model = build("llama_hd128")
    config = model.config
    cache = StaticCache(config, max_cache_len=64)
    cache.early_initialization(1, config.num_key_value_heads, config.head_dim, model.dtype, model.device)
    int4_static_caches(model)
    with torch.no_grad():
        model(input_ids=_prompt(), **cache_arg(cache), use_cache=True)
    keys = cache.layers[0].keys
    assert isinstance(keys, PackedKV) and keys.shape[2] == 64
    assert keys.dequantize()[:, :, :30].abs().max() > 0


def test_static_decode_compiles_through_aot_autograd():
    """aot_eager stands for inductor and reduce-overhead here: all three go through AOTAutograd."""
    torch._dynamo.reset()
    model = build("llama")
    expected = model.generate(
        _prompt(), max_new_tokens=4, do_sample=False, **cache_arg(StaticKVCache(model.config, max_cache_len=64))
    )
    model.compile(backend=kvpass.kv4(inner="aot_eager"))
    out = model.generate(
        _prompt(), max_new_tokens=4, do_sample=False, **cache_arg(StaticKVCache(model.config, max_cache_len=64))
    )
    assert torch.equal(out, expected)


def _dots3_note():
    """Layer 0 keeps its MLA latent in slots (``StaticIndexedLayer``), layer 1 in a sliding window of 32."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = tiny_config("dots3_note")
    model = AutoModelForCausalLM.from_config(config).eval()
    assert [type(layer).__name__ for layer in StaticCache(config=config, max_cache_len=64).layers] == [
        "StaticIndexedLayer", "StaticSlidingWindowLayer"]  # fmt: skip
    return model


@torch.no_grad()
def test_mla_latent_in_a_sliding_static_layer_is_int4_and_attended_directly():
    """A 40-token prompt overflows layer 1's window of 32 (the buffer keeps the newest 32, the
    projections read all 40 exact); each decode step then rolls the window and writes its last
    slot. Against the eager model whose buffers are quantized before each step: every stored slot
    read as stored, the new token exact. Both layers' decode attends over the latent: layer 0's
    slots, and layer 1's rolled window with its last slot hidden and this step's token after it."""
    model = _dots3_note()
    ids = _prompt(40)
    cache = StaticCache(config=model.config, max_cache_len=64)
    backend, got = latent_decode(model, ids, cache)
    decode = [site for graph in backend.graphs[1:] for site in graph.sites]
    assert decode and all(site.reason.startswith("attends over its int4 latent cache directly") for site in decode)
    window = cache.layers[1]  # the latent and the rope key, the newest 32 tokens of each
    assert (tuple(window.keys.shape), tuple(window.values.shape)) == ((1, 1, 32, 32), (1, 1, 32, 16))

    spec = backend.config.v.for_slots
    quantized = StaticCache(config=model.config, max_cache_len=64)
    model(input_ids=ids, **cache_arg(quantized), use_cache=True)
    for i, logits in enumerate(got):
        for layer in quantized.layers:  # quantizing a dequantized slot again gives it back
            for t in (layer.keys, layer.values):
                t.copy_(reference.quantize_dequantize(t, spec))
        expected = model(input_ids=ids[:, i : i + 1], **cache_arg(quantized), use_cache=True).logits
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_site_is_reported_int4_only_when_its_own_layer_stores_int4():
    """Three tokens at once into layer 1's full window (a continued chat): layer 0's latent is a
    slot write (int4), layer 1's a cat then copy_ of the newest (not built). Layer 1's attention
    descends from layer 0's latent read through the hidden states; that must not make its site
    read as rewritten, and its reason is its own layer's."""
    model = _dots3_note()
    backend = kvpass.kv4()
    step = torch.compile(model, backend=backend)
    ids = _prompt(40)
    cache = StaticCache(config=model.config, max_cache_len=64)
    step(input_ids=ids, **cache_arg(cache), use_cache=True)
    step(input_ids=ids[:, :1], **cache_arg(cache), use_cache=True)
    step(input_ids=ids[:, 1:4], **cache_arg(cache), use_cache=True)  # layer 1 reads its int4 window dequantized
    layer0, layer1 = backend.graphs[-1].sites
    assert layer0.rewritten and layer0.phase == "latent"
    assert not layer1.rewritten
    assert "takes several tokens into a full sliding window (cat, then copy_ of the newest)" in layer1.reason


def _cuda_graph_blockers(recorded) -> list[str]:
    """What would keep inductor's CUDA graphs (``mode="reduce-overhead"``) off these forward graphs,
    as far as a CPU run can tell: an input mutated in place but not at a static address (cudagraph
    trees then skip the graph, as ``check_for_mutation_ignore_cuda_graph_managed_tensor`` decides),
    or a value that depends on tensor data (a host sync, which capture forbids)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    blockers = []
    for gm, static in recorded:
        inputs = [node for node in gm.graph.nodes if node.op == "placeholder"]
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten.copy_.default and node.args[0] in inputs:
                if inputs.index(node.args[0]) not in static:
                    blockers.append(f"{node.args[0].name} is mutated but not static")
            if free_unbacked_symbols(node.meta.get("val")):
                blockers.append(f"{node.name} ({node.target}) depends on tensor data")
    return blockers


def _recording_aot_backend(recorded):
    """kv4's rewrite, then AOTAutograd as inductor calls it (input mutations kept in the graph);
    each forward graph is recorded with the input indices AOTAutograd hands inductor as static."""
    from torch._dynamo.backends.common import aot_autograd

    def forward_compiler(gm, example_inputs):
        static = torch._guards.TracingContext.try_get().fw_metadata.static_input_indices
        recorded.append((gm, set(static)))
        return gm.forward

    inner = aot_autograd(fw_compiler=forward_compiler, keep_inference_input_mutations=True)
    return kvpass.backend.rewrite_then(inner, kvpass.KVConfig())


def _inner_tensors(cache):
    return [getattr(t, name) for layer in cache.layers for t in (layer.keys, layer.values)
            for name in t.__tensor_flatten__()[0]]  # fmt: skip


@torch.no_grad()
def test_static_decode_through_generate_is_ready_for_cuda_graphs():
    """Generate's CUDA-graph route (``mode="reduce-overhead"``), checked on CPU up to the replay itself
    (``benchmarks/gpu_check.py`` replays it on a GPU): the decode graph mutates only static
    inputs and reads no tensor data on the host, the int4 buffers never move, and a second
    generate replays the same graph."""
    torch._dynamo.reset()
    model = build("gemma2")  # a full layer, and a sliding one whose window fills and then rolls in place each step
    ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=6, do_sample=False,
                              **cache_arg(StaticKVCache(model.config, max_cache_len=64)))  # fmt: skip
    int4_static_caches(model)
    recorded = []
    backend = _recording_aot_backend(recorded)
    config = CompileConfig(backend=backend, fullgraph=True)  # mode: "reduce-overhead", generate's default
    config._compile_all_devices = True  # generate compiles on CUDA only unless told otherwise
    model.generation_config.compile_config = config
    for attempt in range(2):
        cache = StaticCache(model.config, max_cache_len=64)
        addresses = []  # of every int4 buffer after each forward (prefill, then each decode step)

        def record(input_ids, scores):
            addresses.append([t.data_ptr() for t in _inner_tensors(cache)])
            return scores

        out = model.generate(ids, max_new_tokens=6, do_sample=False, **cache_arg(cache), logits_processor=[record])
        assert torch.equal(out, expected)
        assert len(addresses) == 6 and all(step == addresses[0] for step in addresses)
        if attempt == 0:
            graphs = len(recorded)
    assert all(isinstance(layer.keys, PackedKV) for layer in cache.layers)
    assert graphs and len(recorded) == graphs  # the second generate compiled nothing
    assert all(site.rewritten and site.phase == "static" for graph in backend.graphs for site in graph.sites)
    assert _cuda_graph_blockers(recorded) == []
