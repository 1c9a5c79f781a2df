"""Shared pieces of the end-to-end tests."""

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from kvpass import ops
from kvpass.cache_argument import cache_arg, returned_cache
from kvpass.packed import PackedKV


def benchmark_script(name: str):
    """A script of ``benchmarks/`` (not a package) as a module."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kv_heavy_llama(layers=2, head_dim=64, dtype=torch.float32, seed=0, kv_heads=2):
    """A tiny Llama whose head_dim is realistic, so scale overhead is what it is at scale."""
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=2048,
        eos_token_id=None, pad_token_id=0, bos_token_id=1,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def glm5_next_dsa():
    """A tiny GLM-5-next (an image-text model that generate drives on text alone) of two DSA layers: MLA
    without RoPE, the first layer's indexer shared by the second. Its linear-attention layers are left out
    (minutes to compile on CPU)."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=32,
                v_head_dim=32, index_n_heads=2, index_head_dim=32, index_topk=32, n_routed_experts=4,
                num_experts_per_tok=2, pad_token_id=0, layer_types=["indexed_attention"] * 2,
                indexer_types=["full", "shared"])  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text)).eval()


def sliding_mistral(window=100):
    """A one-layer Mistral whose sliding window keeps ``window - 1`` past tokens, heads of 64 channels
    (wide enough for every extra of K's spec)."""
    from transformers import MistralConfig

    cfg = MistralConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=window, max_position_embeddings=512,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model.eval()


def cache_tensors(cache):
    """Every attention layer's K and V (a hybrid cache's recurrent layers hold neither)."""
    for layer in cache.layers:
        if hasattr(layer, "keys"):
            yield layer.keys
            yield layer.values


def packed_and_fp16_bytes(cache, unwritten=()):
    """Bytes the cache stores, and what the same logical tensors take in fp16. The layers ``unwritten``
    names must hold nothing (they read other layers' K/V)."""
    assert [i for i, layer in enumerate(cache.layers) if getattr(layer, "keys", 0) is None] == list(unwritten)
    stored = fp16 = 0
    for t in cache_tensors(cache):
        if t is None or not t.numel():  # no values, nothing to store (an MLA layer without RoPE's rotary key)
            continue
        assert isinstance(t, PackedKV), f"cache holds a {type(t).__name__}, not PackedKV"
        stored += t.stored_bytes()
        fp16 += t.numel() * 2
    return stored, fp16


@torch.no_grad()
def greedy_forward_loop(step, ids, new_tokens, cache=None):
    """Greedy decoding by calling the (compiled) model's forward, as a serving loop does."""
    cache = DynamicCache() if cache is None else cache
    out = step(input_ids=ids, **cache_arg(cache), use_cache=True)
    tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(new_tokens - 1):
        out = step(input_ids=tokens[-1], **cache_arg(returned_cache(out)), use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat([ids, *tokens], dim=1), returned_cache(out)


@torch.no_grad()
def latent_decode(model, ids, cache, steps=3):
    """An MLA model through a kv4 compile: the prompt ``ids``, then ``steps`` one-token steps into
    ``cache``. Checks that every site was rewritten (phases prefill and latent) and that every
    latent cache tensor is int4 at <= 0.35x fp16; returns the backend and each step's logits."""
    import kvpass

    backend = kvpass.kv4()
    step = torch.compile(model, backend=backend)
    step(input_ids=ids, **cache_arg(cache), use_cache=True)
    got = [step(input_ids=ids[:, i : i + 1], **cache_arg(cache), use_cache=True).logits for i in range(steps)]
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert all(site.rewritten for site in sites) and {s.phase for s in sites} == {"prefill", "latent"}
    stored, fp16 = packed_and_fp16_bytes(cache)
    assert stored <= 0.35 * fp16
    return backend, got


def assert_latent_steps_match_twin(model, ids, got, spec):
    """:func:`latent_decode`'s step logits ``got`` against the eager model reading the past as kv4 stored
    it, both latents with ``spec`` (nothing attends over them as keys)."""
    from kvpass.simulate import SimulatedKVCache

    reference = SimulatedKVCache(model.config, spec, spec)
    model(input_ids=ids, **cache_arg(reference), use_cache=True)
    for i, logits in enumerate(got):
        expected = model(input_ids=ids[:, i : i + 1], **cache_arg(reference), use_cache=True).logits
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def hard_values(shape, dtype, generator):
    """Random groups plus the cases the reference defines: zeros, flush-to-zero, non-finite, ties."""
    x = torch.randn(shape, generator=generator) * 3
    x[0, 0, 0] = 0.0
    x[0, 0, 1] = 1e-9
    x[0, -1, 2, 3] = float("nan")
    x[-1, 0, 3, 1] = float("inf")
    x[-1, -1, 4, 0] = -float("inf")
    # amax 7 gives scale 1, so these land exactly on rounding ties (half to even).
    x[0, 0, 5] = torch.tensor([7.0, 2.5, -2.5, 0.5, -1.5, 3.5, 6.5, -6.5]).repeat(shape[-1] // 8)
    if shape[2] > 7:
        # Asymmetric int4: min 0, max 15 give scale 1 and zero point 0, so ties again.
        x[0, 0, 6] = torch.tensor([0.0, 15.0, 2.5, 0.5, 7.5, 13.5, 1.5, 14.5]).repeat(shape[-1] // 8)
        x[0, 0, 7] = -3.3  # all-equal groups whose value fp16 cannot hold
    return x.to(dtype)


def bits_equal(a, b):
    # NaN scales may differ in payload bits between backends; everything else is compared bitwise.
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    return torch.equal(a.nan_to_num(0.0).view(torch.int16), b.nan_to_num(0.0).view(torch.int16))


def decode_step_args(q, k: PackedKV, v: PackedKV, k_new, v_new, attn_mask=None, scale=0.125) -> tuple:
    """``kv4::decode_step``'s arguments for query ``q`` and new tokens ``k_new``, ``v_new`` after caches
    ``k`` and ``v`` (K's query scales last, None where it has none)."""
    return (q, k.codes, k.scales, k.residual, v.codes, v.scales, v.residual, k_new, v_new, attn_mask, scale,
            *ops.refined_codec_args(k.spec), *ops.refined_codec_args(v.spec), 0.0, k.fine_codes, k.fine_scales,
            v.fine_codes, v.fine_scales, k.head, k.offset, v.head, v.offset, k.query_scales)  # fmt: skip


def same_stored_bits(a, b) -> bool:
    """Whether PackedKV caches ``a`` and ``b`` hold the same inner tensors, bit for bit, and shape."""
    names = a.__tensor_flatten__()[0]
    return (names == b.__tensor_flatten__()[0] and a.shape == b.shape
            and all(bits_equal(getattr(a, name), getattr(b, name)) for name in names))  # fmt: skip


def hub_cache(root, monkeypatch, repo_id: str, commit: str = "0" * 40):
    """A local Hugging Face cache under ``root`` (made the process's) holding ``repo_id``'s ``main``
    at ``commit``, laid out as the hub client writes it; returns the snapshot directory."""
    from huggingface_hub import constants

    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    return snapshot


def save_tiny_model(directory, head_dim: int = 8) -> None:
    """A 1-layer Llama (2 query heads, 1 KV head) and a 32-word tokenizer (words split at spaces), as
    ``save_pretrained`` writes them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=2 * head_dim, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory)
    _save_word_tokenizer(directory, 32)


def save_zoo_model(directory, name: str) -> None:
    """models_zoo model ``name`` and a tokenizer of its vocabulary's words ``t0``, ``t1``, ..., as
    ``save_pretrained`` writes them."""
    from kvpass.models_zoo import build

    model = build(name)
    model.save_pretrained(directory)
    _save_word_tokenizer(directory, model.config.vocab_size)


def _save_word_tokenizer(directory, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(directory)
