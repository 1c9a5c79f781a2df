"""The support matrix's tiny-config builder: shrunk configs stay consistent (no full matrix run here)."""

import json
import sys
import time

import pytest
import torch

from kvpass import cli, coverage, passes
from kvpass.coverage import causal_lm_types, check_one, site_status, summarize, tiny_config
from kvpass.models_zoo import build
from kvpass.passes import SiteReport


def test_mla_dims_follow_each_other():
    config = tiny_config("deepseek_v3")
    assert config.hidden_size == 128 and config.num_hidden_layers == 2
    assert config.qk_head_dim == config.qk_nope_head_dim + config.qk_rope_head_dim  # derived by the constructor
    assert config.head_dim == config.qk_rope_head_dim  # DeepSeek's rotary width
    assert config.num_key_value_heads == config.num_attention_heads  # latent K/V expanded to every head
    assert config.v_head_dim != config.qk_head_dim  # K and V head dims stay unequal, as in the real model
    assert config.n_routed_experts % config.n_group == 0


def test_head_dim_equal_to_the_rope_dim_stays_equal():
    config = tiny_config("longcat_flash")
    assert config.head_dim == config.qk_rope_head_dim == 16


def test_property_without_setter_is_derived_not_set():
    config = tiny_config("falcon")
    assert config.head_dim == config.hidden_size // config.num_attention_heads == 32


def test_partial_rotary_dim_fits_the_head():
    config = tiny_config("codegen")
    assert config.rotary_dim < config.n_embd // config.n_head


def test_per_layer_lists_match_the_depth_and_keep_every_kind():
    config = tiny_config("kimi_linear")
    assert len(config.layer_types) == len(config.mlp_layer_types) == config.num_hidden_layers
    assert set(config.layer_types) == {"linear_attention", "full_attention"}
    assert set(config.mlp_layer_types) == {"dense", "sparse"}


def test_ssm_heads_times_head_dim_is_the_inner_width():
    config = tiny_config("mamba2")
    assert config.num_heads * config.head_dim == config.expand * config.hidden_size


def test_ssm_groups_share_out_the_heads_of_narrow_configs(monkeypatch):
    # hidden 32 leaves 2 SSM heads, which Mamba-2's default 8 groups of B and C cannot share out.
    from kvpass import coverage

    monkeypatch.setattr(coverage, "TINY", dict(coverage.TINY))
    monkeypatch.setattr(coverage, "UNSET", dict(coverage.UNSET))
    coverage.set_head_dim(8)
    for model_type, heads in (("mamba2", "num_heads"), ("nemotron_h", "mamba_num_heads")):
        config = tiny_config(model_type)
        assert getattr(config, heads) == 2 and config.n_groups == 2, model_type


def test_sub_configs_shrink_and_keep_their_ties_to_the_text_model():
    config = tiny_config("dots3_note")
    assert config.text_config.hidden_size == config.vision_config.hidden_size == 128
    assert config.vision_config.adapter_out_dim == config.text_config.hidden_size


def test_nested_attention_config_gets_what_the_model_reads():
    config = tiny_config("dbrx")
    assert config.attn_config.rope_theta > 0 and config.attn_config.kv_n_heads == 2
    assert config.ffn_config.moe_num_experts == 4


def test_encoder_decoder_config_shrinks_its_decoder():
    config = tiny_config("blenderbot")
    assert config.decoder_layers == config.encoder_layers == 2 and config.d_model == 128


def test_encoder_decoder_pad_token_fits_the_tiny_vocab():
    config = tiny_config("marian")  # its real pad id is 58100
    assert config.pad_token_id == 0 and config.eos_token_id is None


def test_kv_heads_follow_their_shrunk_query_heads():
    config = tiny_config("inkling_text")  # sliding layers: 64 query heads over 16 K/V heads
    assert config.swa_num_attention_heads % config.swa_num_key_value_heads == 0
    assert config.swa_num_key_value_heads < config.swa_num_attention_heads


@pytest.mark.parametrize("model_type", ["deepseek_v3", "falcon", "gptj"])
def test_fixed_types_generate_eagerly(model_type):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 14)


def test_types_that_cannot_run_get_a_named_reason():
    row = check_one("gemma4_assistant")
    assert row["status"] == "cannot run" and "target model" in row["reason"]


def test_inklings_attention_over_its_layers_is_no_site_to_rewrite():
    # Inkling2 attends, per token, over its layers' outputs (a "block attention residual"): no cache holds
    # them. Its 4 attentions over its KV cache are rewritten; the 8 others read no cache and are counted out.
    row = check_one("inkling2_text")
    assert (row["status"], row["sites"]) == ("rewritten", "4/4"), row
    assert row["reason"] == "8 attentions read no KV cache, left as they are (nothing to store)"


def test_a_causal_lm_only_another_auto_mapping_names_is_checked_too():
    # transformers 5.24 maps Mistral4ForCausalLM (MLA, a text LM) as image-text-to-text only, which the
    # causal-LM types the matrix ran missed; the check builds it by that class.
    assert "mistral4" in causal_lm_types()
    row = check_one("mistral4")
    assert (row["status"], row["sites"]) == ("rewritten", "4/4"), row


def test_an_image_text_model_is_checked_on_text_alone_with_m_rope_sections_that_fit_its_tiny_head():
    # Qwen2.5-VL has no causal-LM class: the check builds its image-text-to-text model, whose M-RoPE sections
    # (its modeling code's default [16, 24, 24], for 128-channel heads) must add up to the tiny head's pairs.
    assert "qwen2_5_vl" not in causal_lm_types()
    row = check_one("qwen2_5_vl")
    assert (row["status"], row["sites"]) == ("rewritten", "4/4"), row


def test_unknown_model_type_is_named():
    with pytest.raises(ValueError, match="unknown model type 'llama9'"):
        tiny_config("llama9")


@pytest.mark.parametrize("model_type", ["llama", "diffllama"])  # DiffLlama's V reads heads picked from a chunk
def test_narrow_heads_are_packed_at_under_035_of_fp16(monkeypatch, model_type):
    # head_dim 8 (hidden 32), as small test configs have: groups span both KV heads.
    from kvpass import coverage

    monkeypatch.setattr(coverage, "TINY", dict(coverage.TINY))
    monkeypatch.setattr(coverage, "UNSET", dict(coverage.UNSET))
    coverage.set_head_dim(8)
    config = tiny_config(model_type)
    assert (config.head_dim, config.hidden_size) == (8, 32)
    row = check_one(model_type)
    assert row["status"] == "rewritten" and row["bytes_ratio"] == 0.312 and row["logits_error"] < 1e-4
    with pytest.raises(ValueError, match="head_dim must be an even int >= 2"):
        coverage.set_head_dim(7)


def test_a_model_the_twin_sees_no_queries_of_is_checked_without_what_k_takes_from_them():
    # Bloom's attention bypasses transformers' AttentionInterface; checked with K also rounded
    # against the queries, its check must leave both out, and say so.
    row = check_one("bloom", settings={"k_query_rounded": True})
    assert row["status"] == "rewritten" and row["logits_error"] < 1e-5, row
    assert "logits checked without query scales and query rounding" in row["reason"]


def test_logits_that_part_from_the_twin_are_a_finding_not_a_rewrite(monkeypatch):
    # A tiny random ZAYA's all-zero keys once gave NaN query scales and NaN logits, reported as rewritten.
    twin = coverage._twin_logits
    monkeypatch.setattr(coverage, "_twin_logits", lambda *args: twin(*args) * float("nan"))
    row = check_one("gpt2")
    assert row["status"] == "wrong logits" and "differ from the eager twin's by nan" in row["reason"], row
    assert summarize([row, {"model_type": "x", "status": "rewritten"}])["fully_rewritten"] == 1


def test_a_type_whose_steps_read_the_cache_dequantized_is_a_finding_not_a_rewrite(monkeypatch):
    # Granite scales its attention's output by sigmoid(logsumexp(scores) - sink). Read as no sink (as before
    # the pass knew the form), that read of the scores keeps K's fp cat of the int4 cache in the graph:
    # every site is rewritten and the logits are exact, but each step dequantizes the cache.
    monkeypatch.setattr(passes, "_peel_scaled_sink", lambda scores, out, nodes: (out, None))
    row = check_one("granite_swa")
    assert row["status"] == "read dequantized" and row["sites"] == "4/4", row
    assert "ran aten.unsqueeze.default on the int4 cache dequantized" in row["reason"]
    assert summarize([row])["fully_rewritten"] == 0 and summarize([row])["with_attention_cache_running_eagerly"] == 1


def test_settings_reach_the_checked_model_type_through_its_subprocess():
    # k_layer_bits' layer numbers reach it as ints (JSON alone would make them strings, which kv4 refuses).
    row = coverage._run_isolated("gpt2", 300, 32, settings={"k_query_rounded": True, "k_layer_bits": {0: 8}})
    assert row["status"] == "rewritten" and row["logits_error"] < 1e-5, row
    # gpt2 goes through AttentionInterface: kv4 with query rounding agrees with its rounding twin.
    assert "checked without" not in row["reason"]
    bad = coverage._run_isolated("gpt2", 300, 32, settings={"k_query_rounded": "yes"})
    assert "query_rounded must be an int >= 0" in bad["reason"] and "got 'yes'" in bad["reason"], bad


def test_status_names_cache_tensors_left_fp16_by_layers_no_kv4_graph_ran():
    done = SiteReport(0, "model.layers.0.self_attn", "sdpa", "decode", True)
    refused = SiteReport(1, "model.layers.1.self_attn", "sdpa", "decode", False, "K does not come from a cache write")
    assert site_status([done], 4, 4) == ("rewritten", [])
    # Every site seen was rewritten, yet a layer's cache stayed fp16: its layer ran outside any kv4 graph.
    status, reasons = site_status([done], 4, 2)
    assert status == "partly rewritten" and reasons == [
        "2 of 4 cache tensors stayed fp16 with every site seen rewritten: their layers ran outside kv4 graphs"
    ]
    assert site_status([done, refused], 4, 2) == ("partly rewritten", ["K does not come from a cache write"])
    assert site_status([refused], 4, 0) == ("left fp16", ["K does not come from a cache write"])
    # Every cache int4, but a site attends over K/V a graph before it expanded from an MLA latent (GLM-5-next's
    # indexer breaks the graph between): not "left fp16", which it had said.
    status, reasons = site_status([done, refused], 4, 4)
    assert status == "read dequantized" and reasons[-1].startswith("every cache tensor is int4; the sites left read")
    assert site_status([], 4, 0)[0] == "no site found"
    # An attention over no cache (Inkling2's over its layers' outputs) is no site to rewrite.
    no_cache = SiteReport(2, "model.layers.1.mlp_input", "sdpa", "no cache", False, "reads no KV cache: ...")
    assert site_status([done, no_cache], 4, 4) == (
        "rewritten", ["1 attentions read no KV cache, left as they are (nothing to store)"])
    assert site_status([no_cache], 4, 0)[0] == "no site found"


def test_update_replaces_the_rerun_rows_and_names_every_command():
    saved = {
        "commands": ["kvpass coverage --head-dim 8"],
        "rows": [
            {"model_type": "llama", "status": "rewritten", "sites": "2/2", "bytes_ratio": 0.3, "logits_error": 0.0},
            {"model_type": "longcat_flash", "status": "timed out", "reason": "over 150 s"},
        ],
    }
    rerun = [{"model_type": "longcat_flash", "status": "rewritten", "sites": "4/4", "bytes_ratio": 0.31,
              "logits_error": 0.0}]  # fmt: skip
    rows, commands = coverage.merged(saved, rerun, "kvpass coverage longcat_flash --update")
    assert sorted((r["model_type"], r["status"]) for r in rows) == [("llama", "rewritten"), ("longcat_flash", "rewritten")]
    assert commands == ["kvpass coverage --head-dim 8", "kvpass coverage longcat_flash --update"]
    page = coverage.markdown(rows, coverage.summarize(rows), commands)
    assert "Made by `kvpass coverage --head-dim 8`, then `kvpass coverage longcat_flash --update` (each later" in page
    assert "**2 of 2**" in page

    # a type the matrix lacks is added (a sweep grown in parts)
    rows, _ = coverage.merged(saved, [{"model_type": "gpt2", "status": "rewritten"}], "kvpass coverage gpt2 --update")
    assert sorted(r["model_type"] for r in rows) == ["gpt2", "llama", "longcat_flash"]
    with pytest.raises(ValueError, match="does not name the command"):
        coverage.merged({"rows": saved["rows"]}, rerun, "kvpass coverage longcat_flash --update")


def test_update_keeps_the_pages_notes_and_replaces_its_rows(tmp_path, monkeypatch):
    saved, page = tmp_path / "matrix.json", tmp_path / "matrix.md"
    rows = [{"model_type": "llama", "status": "left fp16", "sites": "0/2", "reason": "before"}]
    saved.write_text(json.dumps({"commands": ["kvpass coverage llama"], "rows": rows}))
    page.write_text(coverage.markdown(rows, coverage.summarize(rows), ["kvpass coverage llama"],
                                      "**Rerun at `abc1234`**, after a fix.\n\nA second note."))  # fmt: skip
    rerun = {"model_type": "llama", "status": "rewritten", "sites": "2/2", "bytes_ratio": 0.3, "logits_error": 0.0}
    monkeypatch.setattr(coverage, "_run_isolated", lambda *args: rerun)
    monkeypatch.setattr(sys, "argv", ["kvpass", "coverage", "llama", "--update"])
    cli.main(["coverage", "--update", "--json", str(saved), "--output", str(page), "llama"])
    text = page.read_text()
    assert text.startswith("# Support matrix\n\n**Rerun at `abc1234`**, after a fix.\n\nA second note.\n\nMade by `")
    assert "| llama | rewritten | 2/2 |" in text and "before" not in text
    assert coverage.page_notes(page) == "**Rerun at `abc1234`**, after a fix.\n\nA second note."


def test_update_needs_the_json_it_updates_and_the_types_to_rerun(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["coverage", "--update", "llama"])
    assert exit_.value.code == 2
    assert "--update reruns the named model types into an existing --json file" in capsys.readouterr().err


def test_update_refuses_a_json_without_its_command_before_running_anything(tmp_path, monkeypatch, capsys):
    saved = tmp_path / "matrix.json"
    saved.write_text(json.dumps({"rows": []}))
    monkeypatch.setattr(coverage, "_run_isolated", lambda *args: pytest.fail("ran a model type"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["coverage", "--update", "--json", str(saved), "--output", str(tmp_path / "m.md"), "llama"])
    assert exit_.value.code == 2
    assert "does not name the command that made it" in capsys.readouterr().err


def test_a_misspelt_model_type_is_refused_before_running_anything(tmp_path, monkeypatch, capsys):
    """It was a row of the matrix ("no tiny model"), written over the page, and the exit status 0."""
    monkeypatch.setattr(coverage, "_run_isolated", lambda *args: pytest.fail("ran a model type"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["coverage", "--output", str(tmp_path / "m.md"), "llama", "lama"])
    assert exit_.value.code == 2
    assert "not a causal-LM model type of transformers" in (err := capsys.readouterr().err)
    assert "'lama' (close: llama" in err
    assert not (tmp_path / "m.md").exists()


def test_named_types_leave_the_default_page_to_update(tmp_path, monkeypatch, capsys):
    """``kvpass coverage llama`` in this checkout wrote a one-row page over the 197-row docs/coverage.md."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(coverage, "_run_isolated", lambda *args: pytest.fail("ran a model type"))
    page = tmp_path / coverage.DEFAULT_PAGE
    page.parent.mkdir()
    page.write_text("the whole matrix")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["coverage", "llama"])
    assert exit_.value.code == 2
    assert "docs/coverage.md exists, and a run of named types would replace it" in capsys.readouterr().err
    assert page.read_text() == "the whole matrix"


def test_a_stopped_run_resumes_from_the_rows_it_wrote(tmp_path, monkeypatch, capsys):
    """An hour-long matrix stopped near its end keeps every row it had: ``--resume`` runs the rest."""
    monkeypatch.setattr(coverage, "TINY", dict(coverage.TINY))  # --head-dim sets it
    monkeypatch.setattr(coverage, "UNSET", dict(coverage.UNSET))
    types = ["gpt2", "llama", "mistral", "qwen2"]
    out, matrix = tmp_path / "m.md", tmp_path / "m.json"

    def stopped_at_mistral(model_type, *args):
        if model_type == "mistral":
            # Once the rows before it are written: rows that finished together come out of
            # as_completed in any order, and mistral's could come first.
            rows_file = coverage.rows_file_of(str(out))
            deadline = time.monotonic() + 30
            while len(rows_file.read_text().splitlines()) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            raise KeyboardInterrupt
        return {"model_type": model_type, "status": "rewritten"}

    monkeypatch.setattr(coverage, "_run_isolated", stopped_at_mistral)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["coverage", "--jobs", "1", "--json", str(matrix), "--output", str(out), *types])
    rows_file = coverage.rows_file_of(str(out))
    kept = {r["model_type"] for r in coverage.rows_so_far(rows_file, {"head_dim": 32, "routes": False})}
    assert kept and "mistral" not in kept  # which others finished first is up to the pool
    with open(rows_file, "a") as f:
        f.write('{"model_type": "mis')  # a row cut off mid-write is run again
    assert not out.exists()

    ran = []
    monkeypatch.setattr(coverage, "_run_isolated", lambda t, *args: ran.append(t) or {"model_type": t, "status": "rewritten"})
    with pytest.raises(SystemExit) as exit_:
        cli.main(["coverage", "--resume", "--head-dim", "8", "--json", str(matrix), "--output", str(out), *types])
    assert exit_.value.code == 2
    assert "were checked with {'head_dim': 32, 'routes': False}, not {'head_dim': 8" in capsys.readouterr().err
    assert ran == []

    cli.main(["coverage", "--resume", "--json", str(matrix), "--output", str(out), *types])
    assert sorted(ran) == sorted(set(types) - kept)
    assert sorted(r["model_type"] for r in json.loads(matrix.read_text())["rows"]) == types
    assert "**4 of 4**" in out.read_text()
    assert not rows_file.exists()
    with pytest.raises(SystemExit):
        cli.main(["coverage", "--resume", "--output", str(out), "gpt2"])
    assert "found no rows of an interrupted run" in capsys.readouterr().err


def test_routes_generate_int4_through_beam_search_a_padded_batch_and_a_static_cache():
    """What a user tries first on a compiled model, each route's cache checked for int4; a config
    that turns the cache off (MPT's does) still gets one, or there would be nothing to check."""
    model = build("llama")
    model.config.use_cache = model.generation_config.use_cache = False
    routes = coverage.check_routes(model)
    assert list(routes) == list(coverage.ROUTES)
    for route, result in routes.items():
        kind, ratio = result.split()
        assert kind == "int4" and float(ratio) <= 0.35, (route, result)


def test_a_route_left_fp16_by_no_site_names_the_graph_break():
    from torch._dynamo.utils import counters

    counters["graph_break"].clear()
    assert coverage._outside_kv4_graphs() == "no kv4 graph held their attention"
    counters["graph_break"]["Unsupported Tensor.item() call with capture_scalar_outputs=False\n  Explanation: ..."] += 1
    assert coverage._outside_kv4_graphs() == ("no kv4 graph held their attention; Dynamo broke the graph: "
                                              "Unsupported Tensor.item() call with capture_scalar_outputs=False")  # fmt: skip
    counters["graph_break"].clear()


def test_route_columns_appear_when_rows_have_them():
    rows = [
        {"model_type": "llama", "status": "rewritten", "sites": "2/2", "bytes_ratio": 0.3, "logits_error": 0.0,
         "routes": {"beam search": "int4 0.317", "padded batch": "int4 0.317", "static cache": "fp16 2/4: why"}},
        {"model_type": "mamba", "status": "no attention KV cache", "reason": "the cache holds no growing K/V tensors"},
    ]  # fmt: skip
    page = coverage.markdown(rows, coverage.summarize(rows), ["kvpass coverage --routes"])
    assert "| model type | status | sites | bytes | logits error | beam search | padded batch | static cache | reason |" in page
    assert "| llama | rewritten | 2/2 | 0.300 | 0.0e+00 | int4 0.317 | int4 0.317 | fp16 2/4: why |  |" in page
    assert "| mamba | no attention KV cache |  |  |  |  |  |  | the cache holds no growing K/V tensors |" in page
    assert "beam search" not in coverage.markdown(rows[1:], coverage.summarize(rows[1:]), ["kvpass coverage"])
