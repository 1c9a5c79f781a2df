"""The streaming-perplexity and greedy-agreement protocol of ``kvpass eval`` on a tiny model."""

import argparse
import dataclasses
import json
import math
import warnings

import pytest
import torch

import kvpass
from kvpass import eval as kv_eval
from kvpass import reference
from kvpass import text_data
from kvpass.cache_argument import cache_arg
from kvpass.config import KVConfig
from kvpass.coverage import TWIN_TOLERANCE
from kvpass.models_zoo import build
from tests.helpers import benchmark_script, kv_heavy_llama, save_tiny_model, sliding_mistral


@pytest.fixture(scope="module")
def model():
    return build("llama")


def _tokens(n, seed=0):
    # A short synthetic "text": a repeating pattern with noise, so a model has something to predict.
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(n) % 37 + 2
    noise = torch.randint(2, 256, (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.3, noise, base)


def test_chunk_size_does_not_change_fp_perplexity(model):
    ids = _tokens(96)[None]
    runner = kv_eval.Runner(model, kv_eval.parse_method("fp"))
    # Score the same tokens (all after the first 32) with chunks of 32, 8 and 1.
    nll32, n32, _ = kv_eval.streaming_nll(runner, ids, 32)
    full = model(input_ids=ids).logits.double().log_softmax(-1)
    expected = -full[0, 31:-1].gather(-1, ids[0, 32:, None]).sum().item()
    assert n32 == 64
    assert nll32 == pytest.approx(expected, rel=1e-5)
    for chunk in (8, 1):
        nll, n, _ = kv_eval.streaming_nll(runner, ids, chunk)
        # Chunks of c score every token after the first c: compare the common tokens' total.
        head = -full[0, chunk - 1 : 31].gather(-1, ids[0, chunk:32, None]).sum().item()
        assert n == 96 - chunk
        assert nll - head == pytest.approx(nll32, rel=1e-5)


def test_a_prefill_is_the_first_step_and_scoring_starts_after_it(model):
    ids = _tokens(96)[None]
    runner = kv_eval.Runner(model, kv_eval.parse_method("fp"))
    full = model(input_ids=ids).logits.double().log_softmax(-1)
    nll, n, _ = kv_eval.streaming_nll(runner, ids, 8, prefill=50)
    assert n == 46 and nll == pytest.approx(-full[0, 49:-1].gather(-1, ids[0, 50:, None]).sum().item(), rel=1e-5)
    steps = []
    kv4_runner = kv_eval.Runner(model, kv_eval.parse_method("kv4"))
    real_step = kv4_runner.step
    kv4_runner.step = lambda **kw: steps.append(kw["input_ids"].shape[1]) or real_step(**kw)
    kv_eval.streaming_nll(kv4_runner, ids, 8, prefill=50)
    assert steps == [50, 8, 8, 8, 8, 8, 6]
    with pytest.raises(ValueError, match="need more than the first step's tokens to score: 96 tokens, first step 96"):
        kv_eval.streaming_nll(runner, ids, 8, prefill=96)


def test_the_commands_forward_loops_pass_the_cache_by_the_name_transformers_takes(model):
    # transformers 5.24 warns (FutureWarning) on every forward given past_key_values, which its forwards
    # drop in 5.40; kvpass eval, sensitivity and bench pass the cache by the name the installed release takes.
    from transformers import DynamicCache

    from kvpass import bench

    ids = _tokens(24)[None]
    runner = kv_eval.Runner(model, kv_eval.parse_method("fp"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _, scored, cache = kv_eval.streaming_nll(runner, ids, 8)
        continuation = kv_eval.greedy(runner, ids, 3)
        filled = bench.decode_step(model, bench.fill(model, DynamicCache(), 1, 12, chunk=8, vocab=256), 1)
    assert scored == 16 and cache.get_seq_length() == 24
    assert continuation.shape == (1, 3) and filled.get_seq_length() == 13


# Sinks, offset, query scales and a deferred prefix need heads of 32 channels or more: the zoo's
# Llama has 16, kv_heavy_llama 64.
@pytest.mark.parametrize("variant", ["kv4-kivi", "kv4-rot", "kv4-rot-mse-r56-ks4-kc", "kv4", "kv4-kp96", "kv4-qr"])
def test_kv4_and_simulation_give_the_same_perplexity(model, variant):
    if variant in ("kv4-rot-mse-r56-ks4-kc", "kv4", "kv4-kp96", "kv4-qr"):  # kp96: K waits through three chunks
        model = kv_heavy_llama(layers=1)
    ids = _tokens(160, seed=1)[None]
    ppl_kv4 = kv_eval.perplexity(kv_eval.Runner(model, kv_eval.parse_method(variant)), ids, 32)
    torch._dynamo.reset()
    ppl_sim = kv_eval.perplexity(kv_eval.Runner(model, kv_eval.parse_method("sim-" + variant)), ids, 32)
    ppl_fp = kv_eval.perplexity(kv_eval.Runner(model, kv_eval.parse_method("fp")), ids, 32)
    assert ppl_kv4 == pytest.approx(ppl_sim, rel=1e-4)
    assert ppl_kv4 != ppl_fp  # the cache really was quantized


def test_simulation_stores_the_layers_k_layer_bits_names_as_kv4_does():
    model = kv_heavy_llama(layers=2)
    ids = _tokens(160, seed=1)[None]
    ppl = {}
    for name in ("kv4-k8@1", "sim-kv4-k8@1", "sim-kv4"):  # layer 1's K in int8, layer 0's in int4
        torch._dynamo.reset()
        ppl[name] = kv_eval.perplexity(kv_eval.Runner(model, kv_eval.parse_method(name)), ids, 32)
    # int8 keys in one layer move this model's perplexity by 1e-5 of it; the twin follows kv4 to 1e-8
    assert abs(ppl["sim-kv4-k8@1"] - ppl["kv4-k8@1"]) < abs(ppl["sim-kv4"] - ppl["kv4-k8@1"]) / 100


@pytest.mark.parametrize("chunk, tokens, method", [(1, 112, "kv4-qr"), (16, 150, "kv4")])
@torch.no_grad()
def test_kv4_under_a_sliding_window_reads_as_the_twin_does(chunk, tokens, method):
    """A sliding window (100 tokens) evicts the oldest tokens from kv4's cache as from the twin's
    (eval's caches are built from the config, as generate's are), so both hold, refine and read the
    same tokens; query-rounded keys keep the codes of the update that quantized them. Fed one token
    and 16 tokens at a time past the window."""
    model = sliding_mistral()
    ids = _tokens(tokens, seed=5)[None]
    ppl = {}
    for name in (method, "sim-" + method):
        torch._dynamo.reset()
        nll, count, cache = kv_eval.streaming_nll(kv_eval.Runner(model, kv_eval.parse_method(name)), ids, chunk, prefill=70)
        ppl[name] = math.exp(nll / count)
        assert cache.layers[0].keys.shape[2] == cache.layers[0].values.shape[2] == 99
    assert ppl[method] == pytest.approx(ppl["sim-" + method], rel=1e-6)


def test_kv4_waits_for_k_prefix_token_by_token_as_the_twin_does():
    """One token at a time from an empty cache: the decode step that brings K to 64 tokens quantizes
    all of them inside a graph, with the queries of every step gathered there (query-rounded: rounded
    against that step's queries, and every later token against its own)."""
    model = kv_heavy_llama(layers=1)
    ids = _tokens(90, seed=4)[None]
    ppl = {}
    for name in ("kv4", "sim-kv4", "kv4-rot-mse-r64-ks4-kc-qs", "kv4-qr", "sim-kv4-qr"):
        torch._dynamo.reset()
        ppl[name] = kv_eval.perplexity(kv_eval.Runner(model, kv_eval.parse_method(name)), ids, 1)
    assert ppl["kv4"] == pytest.approx(ppl["sim-kv4"], rel=1e-4)
    assert ppl["kv4-qr"] == pytest.approx(ppl["sim-kv4-qr"], rel=1e-4)
    assert ppl["kv4"] != ppl["kv4-rot-mse-r64-ks4-kc-qs"]  # it did defer
    assert ppl["kv4"] != ppl["kv4-qr"]  # and rounded


def test_greedy_agreement_of_fp_with_itself_is_one(model):
    prompts = kv_eval.prompts_from(_tokens(400, seed=2), 0, 3, 40)
    runner = kv_eval.Runner(model, kv_eval.parse_method("fp"))
    a = kv_eval.greedy(runner, prompts, 8)
    b = kv_eval.greedy(runner, prompts, 8)
    assert a.shape == (3, 8)
    assert kv_eval.agreed_tokens(a, b) == [8, 8, 8]


def test_top1_match_counts_every_position():
    ref = [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5]])]
    got = [torch.tensor([[1, 9, 3]]), torch.tensor([[4, 0]])]
    assert kv_eval.top1_match(got, ref) == pytest.approx(3 / 5)


def test_agreement_counts_tokens_before_the_first_divergence():
    ref = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    out = torch.tensor([[1, 2, 9, 4], [1, 2, 3, 4]])
    assert kv_eval.agreed_tokens(out, ref) == [2, 4]


def test_margin_at_divergence_is_the_references_at_the_first_differing_step():
    margins = torch.tensor([[0.5, 0.25, 3.0, 1.0], [2.0, 0.125, 0.75, 4.0]])
    assert kv_eval.margins_at_divergence([2, 4], margins) == [3.0, None]
    assert kv_eval.margins_at_divergence([0, 1], margins) == [0.5, 0.125]


def test_greedy_margins_are_the_gap_between_the_two_likeliest_tokens(model):
    prompts = kv_eval.prompts_from(_tokens(400, seed=2), 0, 2, 40)
    runner = kv_eval.Runner(model, kv_eval.parse_method("fp"))
    margins = []
    tokens = kv_eval.greedy(runner, prompts, 3, margins=margins)
    with torch.no_grad():
        logits = model(torch.cat([prompts, tokens[:, :2]], dim=1)).logits[:, -3:].float()
    top2 = logits.topk(2, dim=-1).values
    torch.testing.assert_close(torch.stack(margins, dim=1), top2[..., 0] - top2[..., 1], atol=1e-4, rtol=1e-4)


def test_paired_standard_error_of_a_perplexity_change():
    base = [10.0, 12.0, 11.0, 9.0]
    assert kv_eval.paired_delta_se([b + 0.5 for b in base], base, 256) == 0.0  # the same shift in every block
    diffs = [0.5, 1.5, -0.5, 0.5]  # mean 0.5, sample sd sqrt(2/3)
    se = kv_eval.paired_delta_se([b + d for b, d in zip(base, diffs)], base, 256)
    assert se == pytest.approx(100 * math.exp(2 / 256) * 2 * math.sqrt(2 / 3) / 256)
    assert kv_eval.paired_delta_se([1.0], [1.0], 64) is None


def test_rows_compare_with_another_method_block_by_block():
    def row(method, text, blocks):
        return dict(method=method, text=text, ctx=128, ppl=math.exp(sum(blocks) / 128), nll=sum(blocks) / 128,
                    scored=128, nll_blocks=blocks, kv_bytes_per_token=1.0)  # fmt: skip

    rows = [row("fp", "a", [100.0, 90.0]), row("x", "a", [101.0, 92.0]), row("y", "a", [102.0, 91.0]),
            row("y", "b", [50.0, 60.0]), {"method": "x", "text": "b", "ctx": 128, "error": "not run: ..."}]  # fmt: skip
    kv_eval.compare_with(rows, "y")
    fp, x, y, y_b, x_b = rows
    assert x["vs"] == fp["vs"] == "y" and "vs" not in y and "vs" not in y_b and "vs" not in x_b
    assert x["delta_vs_pct"] == pytest.approx(100 * (x["ppl"] / y["ppl"] - 1))  # 193 vs 193 NLL: no change
    assert x["delta_vs_pct"] == pytest.approx(0.0, abs=1e-12)
    assert x["delta_vs_se"] == kv_eval.paired_delta_se([101.0, 92.0], [102.0, 91.0], 128) > 0
    assert fp["delta_vs_pct"] == pytest.approx(100 * math.expm1(-3 / 128))
    table = kv_eval.format_table(rows)
    assert "vs y" in table.splitlines()[0] and "-2.32% ±" in table
    assert "delta vs fp  top-1 match" in kv_eval.format_table([row("fp", "a", [1.0])]).splitlines()[0]


def test_evaluate_grid_rows(model):
    texts = {"synthetic": _tokens(300, seed=3)}
    settings = kv_eval.Settings(contexts=(160,), chunk=32, prompts=2, prompt_tokens=40, new_tokens=4)
    methods = [kv_eval.parse_method(m) for m in ("fp", "sim-kv4-rot", "quanto")]
    rows = kv_eval.evaluate(model, texts, methods, settings)
    by_name = {r["method"]: r for r in rows}
    assert set(by_name) == {"fp", "sim-kv4-rot", "quanto"}
    assert all("ppl" in row for row in rows), rows  # quanto too: the test extra installs it
    assert by_name["fp"]["delta_pct"] == 0.0 and by_name["fp"]["agreement"] == 1.0
    assert by_name["fp"]["top1_match"] == 1.0
    for row in rows:
        assert math.isfinite(row["ppl"]) and 0 <= row["agreement"] <= 1 and 0 <= row["top1_match"] <= 1
        # the error-bar data: each prompt's agreed tokens, each 64 scored tokens' summed NLL
        assert len(row["agreed_tokens"]) == settings.prompts
        assert sum(row["agreed_tokens"]) / (settings.prompts * settings.new_tokens) == row["agreement"]
        # the fp pick's margin where each prompt first differs, None where it never does
        fp_margins = by_name["fp"]["greedy_margins"]
        assert row["fp_margin_at_divergence"] == [
            None if n == settings.new_tokens else fp_margins[i][n] for i, n in enumerate(row["agreed_tokens"])
        ]
        assert len(row["nll_blocks"]) == math.ceil(row["scored"] / 64)
        assert sum(row["nll_blocks"]) == pytest.approx(row["nll"] * row["scored"], abs=1e-4)
    assert by_name["sim-kv4-rot"]["delta_pct_se"] > 0 and "delta_pct_se" not in by_name["fp"]
    table = kv_eval.format_table(rows)
    assert "sim-kv4-rot" in table and "delta vs fp" in table


def test_prefix_starts_every_stream_and_prompt(model, monkeypatch):
    seen = []
    real_nll, real_greedy = kv_eval.streaming_nll, kv_eval.greedy
    monkeypatch.setattr(kv_eval, "streaming_nll", lambda runner, ids, *a, **k: seen.append(ids) or real_nll(runner, ids, *a, **k))
    monkeypatch.setattr(kv_eval, "greedy", lambda runner, prompts, *a, **k: seen.append(prompts) or real_greedy(runner, prompts, *a, **k))
    tokens = _tokens(300, seed=4)
    settings = kv_eval.Settings(contexts=(96,), chunk=32, prompts=2, prompt_tokens=40, new_tokens=2)
    rows = kv_eval.evaluate(model, {"t": tokens}, [kv_eval.parse_method("fp")], settings, prefix=torch.tensor([1]))
    prompts, stream = seen
    assert prompts.shape == (2, 41) and (prompts[:, 0] == 1).all() and torch.equal(prompts[0, 1:], tokens[96:136])
    assert stream.shape == (1, 96) and stream[0, 0] == 1 and torch.equal(stream[0, 1:], tokens[:95])
    assert rows[0]["scored"] == 64


def test_windows_pool_consecutive_streams_each_from_an_empty_cache(model, monkeypatch):
    seen = []
    real_nll, real_greedy = kv_eval.streaming_nll, kv_eval.greedy
    monkeypatch.setattr(kv_eval, "streaming_nll", lambda runner, ids, *a, **k: seen.append(ids) or real_nll(runner, ids, *a, **k))
    monkeypatch.setattr(kv_eval, "greedy", lambda runner, prompts, *a, **k: seen.append(prompts) or real_greedy(runner, prompts, *a, **k))
    tokens = _tokens(400, seed=5)
    settings = kv_eval.Settings(contexts=(96,), chunk=32, prompts=1, prompt_tokens=40, new_tokens=2, windows=3)
    (row,) = kv_eval.evaluate(model, {"t": tokens}, [kv_eval.parse_method("fp")], settings, prefix=torch.tensor([1]))
    prompts, *streams = seen
    assert [s[0, 0].item() for s in streams] == [1, 1, 1]
    assert torch.equal(torch.cat([s[0, 1:] for s in streams]), tokens[: 3 * 95])  # consecutive, none skipped
    assert torch.equal(prompts[0, 1:], tokens[3 * 96 : 3 * 96 + 40])  # greedy prompts follow the scored text
    runner = kv_eval.Runner(model, kv_eval.parse_method("fp"))
    parts = [kv_eval.streaming_nll(runner, s, 32)[:2] for s in streams]
    assert row["scored"] == 3 * 64 == sum(n for _, n in parts)
    assert row["nll"] == pytest.approx(sum(nll for nll, _ in parts) / row["scored"], rel=1e-9)
    assert len(row["nll_blocks"]) == 3  # one 64-token block per window: none straddles two streams

    settings = dataclasses.replace(settings, windows=5, greedy=False)
    (short,) = kv_eval.evaluate(model, {"t": tokens}, [kv_eval.parse_method("fp")], settings, prefix=torch.tensor([1]))
    assert short["error"] == "text has only 400 tokens, fewer than 5 window(s) of 96"


def test_kv4_settings_reach_every_kv4_method_under_its_own(tmp_path, capsys):
    """``kvpass eval --kv4-setting``, end to end on a saved model: the kv4 methods' schemes (and the
    bytes they stored) take the settings, each method keeping its own; fp does not; a combination a
    method's own settings refuse is named with the method."""
    from kvpass.cli import main

    torch._dynamo.reset()
    save_tiny_model(tmp_path / "model", head_dim=64)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"t{i * 7 % 31 + 1}" for i in range(600)))
    common = ["eval", "--model", str(tmp_path / "model"), "--texts", "", "--text-file", str(text), "--contexts",
              "128", "--chunk", "32", "--no-greedy", "--no-progress"]  # fmt: skip
    runs, asked = {}, ["--kv4-setting", "v_bits=8", "--kv4-setting", "k_layer_bits={0: 8}"]
    for name, settings in (("default", []), ("set", asked)):
        assert main([*common, "--methods", "fp,kv4,kv4-rot", "--json", str(tmp_path / f"{name}.json"), *settings]) == 0
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    methods = runs["set"]["methods"]
    assert methods["fp"] == "unquantized" and runs["set"]["kv4_settings"] == {"v_bits": 8, "k_layer_bits": {"0": 8}}
    for name in ("kv4", "kv4-rot"):
        assert ", V int8:" in methods[name] and methods[name].endswith("K int8 in layers 0"), methods[name]
        assert methods[name].split(", V ")[0] == runs["default"]["methods"][name].split(", V ")[0]  # K's own spec
    stored = {run: {r["method"]: r["kv_bytes_per_token"] for r in runs[run]["rows"]} for run in runs}
    assert stored["set"]["fp"] == stored["default"]["fp"] and stored["set"]["kv4"] > stored["default"]["kv4"]
    out = capsys.readouterr().out
    assert "kv4 methods with v_bits=8, k_layer_bits={0: 8}" in out and "chunk 32; no greedy; " in out
    with pytest.raises(SystemExit):  # valid for kv4, not over kv4-rot's own (no prefix statistics)
        main([*common, "--methods", "kv4,kv4-rot", "--kv4-setting", "k_prefix_tokens=128"])
    assert "--kv4-setting on kv4-rot: K spec: prefix_tokens=128 needs center" in capsys.readouterr().err


def test_method_names():
    m = kv_eval.parse_method("kv4-rot-g128")
    assert m.backend_kwargs == dict(k_scheme="token", k_group=128, k_rotate=True, v_scheme="token", v_group=128,
                                    v_rotate=True, clip=False, refine=0, k_sinks=0, k_center=False,
                                    k_query_scaled=False, k_defer_prefix=False, k_query_rounded=0)  # fmt: skip
    assert kv_eval.parse_method("int2").backend_kwargs == {"bits": 2, "clip": False, "refine": 0, "k_sinks": 0,
                                                           "k_center": False, "k_query_scaled": False,
                                                           "k_defer_prefix": False, "k_query_rounded": 0}  # fmt: skip
    # -rN: a second code plane for the newest N tokens (at most 1/8 of the cache)
    refined = kv_eval.parse_method("kv4-rot-mse-r64")
    assert all(s.refine == 64 for s in refined.specs) and refined.fp16_ratio(4096, 3, 64) == 34 / 128 * (1 + 64 / 4096)
    assert refined.fp16_ratio(256, 3, 64) == 34 / 128 * (1 + 1 / 8)
    # named variants keep the amax scales (and no plane, sinks or offset) they were measured with;
    # -mse clips and -r64 refines, as the default does; -ks4 keeps K sinks, -kc centers K, -qs
    # scales it by the queries, -kd defers all three to 64 tokens and -qr64 rounds prompt-sized appends
    assert all(s.clip and not s.refine and not s.sinks for s in kv_eval.parse_method("kv4-rot-mse").specs)
    assert kv_eval.parse_method("kv4-rot-mse-r64-ks4-kc-qs-kd-qr64").specs == (KVConfig().k, KVConfig().v)
    previous = kv_eval.parse_method("kv4-rot-mse-r64-ks4-kc-qs").specs[0]  # the default until the eighteenth run
    assert previous == dataclasses.replace(KVConfig().k, defer_prefix=False, query_rounded=0)
    # the default until the twenty-third run
    assert kv_eval.parse_method("kv4-qr0").specs[0] == dataclasses.replace(previous, defer_prefix=True)
    older = kv_eval.parse_method("kv4-rot-mse-r64-ks4-kc").specs[0]  # the default until the fifteenth run
    assert older == dataclasses.replace(previous, query_scaled=False)
    assert not any(s.sinks or s.center for s in kv_eval.parse_method("kv4-rot-mse-r64").specs)
    k, v = kv_eval.parse_method("kv4-rot-mse-r56-ks4-kc").specs
    assert (k.sinks, k.center, k.refine, v.sinks, v.center, v.refine) == (4, True, 56, 0, False, 56)
    assert kv_eval.parse_method("sim-kv4-kivi").kind == "sim"
    assert kv_eval.parse_method("kv4").specs == (KVConfig().k, KVConfig().v)
    parser = argparse.ArgumentParser()
    kv_eval.add_arguments(parser)
    default_run = [m for m in parser.parse_args([]).methods if m.kind == "kv4"]  # a bare `kvpass eval`
    assert [m.specs for m in default_run if not m.backend_kwargs] == [(KVConfig().k, KVConfig().v)]
    k, v = kv_eval.parse_method("kv4-kivi").specs
    assert (k.scheme, k.group, k.rotate, v.scheme, v.group, v.rotate) == ("channel", 64, False, "token", 128, False)
    # -kB@L.L: K bits B in layers L, the rest the default; bytes then depend on the model's layers
    mixed = kv_eval.parse_method("kv4-k8@11.15")
    assert mixed.backend_kwargs == {"k_layer_bits": {11: 8, 15: 8}}
    assert mixed.specs == (KVConfig().k, KVConfig().v) and mixed.fp16_ratio(4096, 3, 64) is None
    assert mixed.scheme.endswith(", K int8 in layers 11, 15")
    assert kv_eval.parse_method("sim-kv4-k8@11.15").backend_kwargs == mixed.backend_kwargs
    # -qr: K's codes rounded against each append's queries, in kv4 and in the twin
    assert kv_eval.parse_method("kv4-qr").specs == (dataclasses.replace(KVConfig().k, query_rounded=True), KVConfig().v)
    assert kv_eval.parse_method("kv4-qr").fp16_ratio(4096, 3, 64) == kv_eval.parse_method("kv4").fp16_ratio(4096, 3, 64)
    assert kv_eval.parse_method("sim-kv4-qr").specs == kv_eval.parse_method("kv4-qr").specs
    # -qrN from N tokens on (the default's 64), -qr0 none: the default before it rounded
    assert kv_eval.parse_method("kv4-qr64").specs == kv_eval.parse_method("kv4").specs
    assert kv_eval.parse_method("kv4-qr0").specs[0] == dataclasses.replace(KVConfig().k, query_rounded=0)
    assert kv_eval.parse_method("kv4-kd-qr8").specs[0].tag.endswith(":dp:qr8")
    with pytest.raises(ValueError):
        kv_eval.parse_method("kv4-g48")
    with pytest.raises(ValueError):
        kv_eval.parse_method("fp16-magic")
    assert kv_eval.parse_method("bf16").store_dtype == torch.bfloat16
    assert kv_eval.parse_method("kv4-qs").backend_kwargs == {"k_query_scaled": True}
    assert kv_eval.parse_method("sim-kv4-qs").specs[0].query_scaled
    # -kpN: K's prefix statistics over up to N tokens, and a deferring K waits for N
    assert kv_eval.parse_method("kv4-kp512").specs[0] == dataclasses.replace(KVConfig().k, prefix_tokens=512)
    with pytest.raises(ValueError, match="prefix_tokens=256 needs center, query_scaled or defer_prefix"):
        kv_eval.parse_method("kv4-rot-kp256")


def test_kjv_stripping():
    raw = "Genesis 1\n\n  1 In the beginning\nGod created.\n  2 And the earth.\n\n1 Kings 2\n\n  1 Now the days.\n"
    assert text_data.strip_kjv(raw) == "In the beginning God created. And the earth.\n\nNow the days.\n"


def test_fp_tokens_window_and_sinks_bounds():
    from kvpass.simulate import FpTokens

    fp = FpTokens(sinks=4, window=64, flush=32)
    previous = 0
    for stored in range(0, 400):
        start, stop = fp.quantized(stored)
        assert start == min(4, stored)
        n = stop - start
        assert n % 32 == 0 and n >= previous  # whole flush blocks, never un-quantized
        recent = stored - stop
        assert recent < 64 + 32 and (n == 0 or recent >= 64)
        previous = n
    assert FpTokens().quantized(100) == (0, 100)  # no fp tokens: everything is quantized
    assert FpTokens(sinks=4).quantized(100) == (4, 100)


def test_simulated_cache_reads_fp_sinks_and_window_and_reference_in_between(model):
    from kvpass.reference import quantize_dequantize
    from kvpass.simulate import FpTokens, SimulatedKVCache

    k_spec, v_spec = kv_eval.parse_method("kv4-rot").specs
    fp = FpTokens(sinks=3, window=16, flush=8)
    # Past lengths read below: 16..23 newest tokens stay fp, after 3 sinks.
    assert [fp.quantized(p) for p in (0, 40, 45, 46, 47)] == [(0, 0), (3, 19), (3, 27), (3, 27), (3, 27)]
    cache = SimulatedKVCache(model.config, k_spec, v_spec, fp)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    D = k_spec.group
    ks, vs = [], []
    for step in (40, 5, 1, 1, 20):  # a prefill, then chunks and single tokens
        k, v = torch.randn(1, 2, step, D, generator=g), torch.randn(1, 2, step, D, generator=g)
        ks.append(k)
        vs.append(v)
        read_k, read_v = layer.update(k, v)
        full_k, full_v = torch.cat(ks, 2), torch.cat(vs, 2)
        start, stop = fp.quantized(full_k.shape[2] - step)
        for read, full, spec in ((read_k, full_k, k_spec), (read_v, full_v, v_spec)):
            assert torch.equal(read[:, :, :start], full[:, :, :start])
            assert torch.equal(read[:, :, stop:], full[:, :, stop:])  # window and new tokens: exact
            assert torch.equal(read[:, :, start:stop], quantize_dequantize(full[:, :, start:stop], spec))
            assert stop == start or not torch.equal(read, full)


@torch.no_grad()
def test_simulated_query_scaled_keys_need_the_queries_observed():
    """Query scales come from a first update's queries, which only attention sees: outside
    ``observed_queries`` the next update refuses; a prompt too short to fix scales needs none.
    (Inside it, the twin equals kv4: tests/test_backend.py, the first decode step.)"""
    from kvpass.simulate import SimulatedKVCache, observed_queries

    model = kv_heavy_llama(layers=1)  # heads of 64 channels: narrower ones take no scales
    k_spec = KVConfig().k
    assert k_spec.query_scaled
    ids, nxt = _tokens(80)[None], torch.tensor([[5]])
    blind = SimulatedKVCache(model.config, k_spec, KVConfig().v)
    model(input_ids=ids, **cache_arg(blind), use_cache=True)
    with pytest.raises(RuntimeError, match=r"no attention call handed them over: run the model inside kvpass"):
        model(input_ids=nxt, **cache_arg(blind), use_cache=True)
    short = SimulatedKVCache(model.config, k_spec, KVConfig().v)
    for step in (ids[:, :40], nxt):
        model(input_ids=step, **cache_arg(short), use_cache=True)
    with observed_queries():
        seen = SimulatedKVCache(model.config, k_spec, KVConfig().v)
        for step in (ids, nxt):
            model(input_ids=step, **cache_arg(seen), use_cache=True)
        with pytest.raises(RuntimeError, match="already active"), observed_queries():
            pass
    # kvpass eval's sim- methods run the model inside it.
    assert kv_eval.perplexity(kv_eval.Runner(model, kv_eval.parse_method("sim-kv4-qs")), _tokens(100)[None], 80) > 1


def test_simulated_k_sinks_and_offset_are_what_kv4_stores(model):
    """``-ks2-kc``: K's first tokens exact until a window evicts them, the rest quantized minus
    the offset of the first update; V as before. The simulation reads what kv4 stores."""
    from kvpass.packed import PackedKV
    from kvpass.reference import center_offset, quantize_dequantize
    from kvpass.simulate import SimulatedKVCache

    method = kv_eval.parse_method("sim-kv4-rot-mse-ks2-kc")
    k_spec, v_spec = method.specs
    assert (k_spec.sinks, k_spec.center, v_spec.sinks, v_spec.center) == (2, True, 0, False)
    cache = SimulatedKVCache(model.config, k_spec, v_spec, method.fp_tokens)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(1)
    shared = 8 * torch.randn(1, 2, 1, 64, generator=g)  # keys sharing a mean direction, as Gemma 3's
    first = shared + torch.randn(1, 2, 70, 64, generator=g)  # a prompt long enough to fix both
    layer.update(first, torch.randn(1, 2, 70, 64, generator=g))
    new = shared + torch.randn(1, 2, 3, 64, generator=g)
    read_k, _ = layer.update(new, torch.randn(1, 2, 3, 64, generator=g))
    offset = center_offset(first, k_spec)
    assert torch.equal(read_k[:, :, :70], quantize_dequantize(first, k_spec, offset, sinks=2))
    # the sinks: rotated, stored in bfloat16 for this fp32 model
    sinks = reference.rotate(reference.rotate(first[:, :, :2]).bfloat16().float())
    torch.testing.assert_close(read_k[:, :, :2], sinks, rtol=0, atol=1e-5)
    assert torch.equal(read_k[:, :, 70:], new)
    packed = PackedKV.from_float(first, k_spec)  # what kv4 holds after the same first update
    assert packed.n_head == 2 and torch.equal(packed.offset, offset)
    torch.testing.assert_close(read_k[:, :, :70], packed.dequantize(), rtol=0, atol=1e-5)
    # The offset's point: less to quantize than K itself.
    uncentered = quantize_dequantize(first, dataclasses.replace(k_spec, center=False))[:, :, 2:]
    assert (read_k[:, :, 2:70] - first[:, :, 2:]).norm() < 0.5 * (uncentered - first[:, :, 2:]).norm()
    # A first update of 6 to 63 tokens keeps its first token and fixes no offset; a shorter one
    # fixes nothing, and the layer reads like a plain cache's.
    plain_spec = dataclasses.replace(k_spec, sinks=0, center=False)
    for tokens, sinks in ((40, 1), (5, 0)):
        short = SimulatedKVCache(model.config, k_spec, v_spec, method.fp_tokens).layers[0]
        short.update(first[:, :, :tokens], torch.randn(1, 2, tokens, 64, generator=g))
        read_k, _ = short.update(new, torch.randn(1, 2, 3, 64, generator=g))
        expected = quantize_dequantize(first[:, :, :tokens], k_spec, sinks=sinks)
        assert torch.equal(read_k[:, :, :tokens], expected)
        assert sinks or torch.equal(expected, quantize_dequantize(first[:, :, :tokens], plain_spec))
        packed = PackedKV.from_float(first[:, :, :tokens], k_spec)
        assert packed.n_head == sinks and packed.offset.shape[2] == 0
        torch.testing.assert_close(read_k[:, :, :tokens], packed.dequantize(), rtol=0, atol=1e-5)


def test_deferred_k_prefix_reads_k_exact_until_64_tokens_then_as_kv4_stores_them_all_at_once(model):
    """``-kd``: K exact while a layer holds under 64 tokens and in the update that brings it there
    (kv4 reads the past it held); from the next one on, the past as kv4's cache stores it after
    those appends. V is as without it."""
    from kvpass.packed import PackedKV
    from kvpass.simulate import SimulatedKVCache

    method = kv_eval.parse_method("sim-kv4-rot-mse-ks4-kc-kd")
    k_spec, v_spec = method.specs
    assert k_spec.defer_prefix and not k_spec.query_scaled  # this one needs no queries
    deferred = SimulatedKVCache(model.config, k_spec, v_spec, method.fp_tokens).layers[0]
    plain_k = dataclasses.replace(k_spec, defer_prefix=False)
    plain = SimulatedKVCache(model.config, plain_k, v_spec, method.fp_tokens).layers[0]
    g = torch.Generator().manual_seed(2)
    shared = 8 * torch.randn(1, 2, 1, 64, generator=g)
    ks, vs = [], []
    stored = PackedKV.from_float(shared[:, :, :0], k_spec)
    for step in (40, 20, 10, 3, 2):  # 60 tokens held, then 70: the third update fixes the prefix
        ks.append(shared + torch.randn(1, 2, step, 64, generator=g))
        vs.append(torch.randn(1, 2, step, 64, generator=g))
        read_k, read_v = deferred.update(ks[-1], vs[-1])
        assert torch.equal(read_v, plain.update(ks[-1], vs[-1])[1])
        full = torch.cat(ks, 2)
        past = full.shape[2] - step
        assert torch.equal(read_k[:, :, past:], ks[-1])  # new tokens: exact
        if past < 64:
            assert torch.equal(read_k, full)
        else:
            torch.testing.assert_close(read_k[:, :, :past], stored.dequantize(), rtol=0, atol=1e-5)
            assert not torch.equal(read_k[:, :, 4:past], full[:, :, 4:past])
        stored = stored.append(ks[-1])
    assert stored.n_head == 4 and stored.offset.shape[2] == 1
    # A first update of 64 tokens or more has nothing to wait for: the layer reads as without -kd.
    long_first = SimulatedKVCache(model.config, k_spec, v_spec, method.fp_tokens).layers[0]
    plain = SimulatedKVCache(model.config, plain_k, v_spec, method.fp_tokens).layers[0]
    for k, v in ((full[:, :, :70], torch.randn(1, 2, 70, 64, generator=g)), (full[:, :, 70:], vs[-1])):
        assert all(torch.equal(a, b) for a, b in zip(long_first.update(k, v), plain.update(k, v)))


@torch.no_grad()
def test_deferred_k_prefix_takes_query_scales_from_every_query_it_waited_through():
    """With query scales, the update that reaches 64 tokens fixes them from the queries of every
    update so far; the next update's attention reads the past scaled, centered and quantized as
    kv4's cache stores it, having gathered the same queries."""
    from kvpass import simulate
    from kvpass.packed import PackedKV
    from kvpass.simulate import QueriesNotObserved, SimulatedKVCache, observed_queries

    model = kv_heavy_llama(layers=1)
    k_spec, v_spec = kv_eval.parse_method("sim-kv4").specs
    assert k_spec.query_scaled and k_spec.defer_prefix
    g = torch.Generator().manual_seed(3)
    B, Hkv, Hq, D = 1, model.config.num_key_value_heads, model.config.num_attention_heads, 64
    steps = (40, 30, 2)
    keys = [torch.randn(B, Hkv, n, D, generator=g) for n in steps]
    queries = [torch.randn(B, Hq, n, D, generator=g) * torch.linspace(0.2, 3, D) for n in steps]
    seen = []
    attend = simulate._observing(lambda module, query, key, value, *args: seen.append(key))
    stored = PackedKV.from_float(keys[0][:, :, :0], k_spec)
    with observed_queries():
        layer = SimulatedKVCache(model.config, k_spec, v_spec).layers[0]
        for k, q in zip(keys, queries):
            read_k, read_v = layer.update(k, torch.randn(k.shape, generator=g))
            attend(torch.nn.Identity(), q, read_k, read_v)
            stored = stored.append(k, q)
            if len(seen) == 2:
                at_70 = stored
    assert torch.equal(seen[0], keys[0]) and torch.equal(seen[1], torch.cat(keys[:2], 2))  # exact
    assert at_70.query_scales.shape[2] == 1 and at_70.n_head == 4
    torch.testing.assert_close(seen[2][:, :, :70], at_70.dequantize(), rtol=0, atol=1e-5)
    assert torch.equal(seen[2][:, :, 70:], keys[2])
    # Outside observed_queries no attention hands the queries over, and the next update says so.
    blind = SimulatedKVCache(model.config, k_spec, v_spec).layers[0]
    held = []
    for k in keys[:2]:
        held.append(k)
        read_k, _ = blind.update(k, torch.randn(k.shape, generator=g))
        assert torch.equal(read_k, torch.cat(held, 2))  # unobserved, the prefix is never fixed
    with pytest.raises(QueriesNotObserved, match="observed_queries"):
        blind.update(keys[1][:, :, :1], keys[1][:, :, :1] + 1)
    # kvpass eval's sim- methods run a model so.
    ids = _tokens(100)[None]
    assert kv_eval.perplexity(kv_eval.Runner(model, kv_eval.parse_method("sim-kv4")), ids, 8) > 1


@pytest.mark.parametrize("name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_rounded_cache_holds_16_bit_tensors_and_reads_them_back(model, name, dtype):
    """``fp16`` / ``bf16``: the float32 model's K and V stored in 16 bits (half the bytes), read back
    exactly as stored, so its perplexity moves off fp's."""
    method = kv_eval.parse_method(name)
    assert method.kind == "rounded" and method.scheme == f"unquantized, stored in {dtype}"
    ids = _tokens(160, seed=2)[None]
    runner = kv_eval.Runner(model, method)
    nll, n, cache = kv_eval.streaming_nll(runner, ids, 32)
    fp_nll, _, fp_cache = kv_eval.streaming_nll(kv_eval.Runner(model, kv_eval.parse_method("fp")), ids, 32)
    assert all(layer.keys.dtype == layer.values.dtype == dtype for layer in cache.layers)
    assert kv_eval.cache_bytes(cache) * 2 == kv_eval.cache_bytes(fp_cache)
    layer = runner.new_cache().layers[0]
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    read_k, read_v = layer.update(k, v)
    assert read_k.dtype == torch.float32 and torch.equal(read_k, k.to(dtype).float())
    assert torch.equal(read_v, v.to(dtype).float()) and not torch.equal(read_k, k)
    assert nll != fp_nll


def test_window_longer_than_the_text_is_the_fp_baseline(model):
    ids = _tokens(128, seed=4)[None]
    ppl_fp = kv_eval.perplexity(kv_eval.Runner(model, kv_eval.parse_method("fp")), ids, 32)
    ppl_all_fp = kv_eval.perplexity(kv_eval.Runner(model, kv_eval.parse_method("sim-kv4-rot-w128")), ids, 32)
    ppl_w32 = kv_eval.perplexity(kv_eval.Runner(model, kv_eval.parse_method("sim-kv4-rot-w32-s4-f16")), ids, 32)
    assert ppl_all_fp == ppl_fp
    assert ppl_w32 != ppl_fp


@pytest.mark.parametrize("heads, head_dim", [(2, 8), (1, 8), (4, 12), (3, 64), (2, 256)])
def test_estimated_ratio_is_what_the_packed_cache_stores(heads, head_dim):
    # Heads narrower than 16 channels share a scale across heads (or keep 8-bit ones): the ratio
    # eval reports counts each head's share of it, as the cache stores it.
    from kvpass.packed import PackedKV

    for name in ("kv4-rot", "kv4-rot-mse-r64", "kv4-kivi", "kv4-qs"):  # kv4-qs: query scales from K's queries
        method = kv_eval.parse_method(name)
        query = torch.randn(1, heads, 512, head_dim, dtype=torch.float16)
        k, v = (PackedKV.from_float(torch.randn(1, heads, 512, head_dim, dtype=torch.float16), spec.for_head_dim(head_dim),
                                    query)
                for spec in method.specs)  # fmt: skip
        assert (k.query_scales is not None and k.query_scales.shape[2] == 1) == (name == "kv4-qs" and head_dim >= 32)
        assert method.fp16_ratio(512, heads, head_dim) == (k.stored_bytes() + v.stored_bytes()) / (2 * k.numel() * 2)


def test_fp_token_method_names_and_bytes():
    from kvpass.simulate import FpTokens

    m = kv_eval.parse_method("sim-kv4-rot-g32-k8-asym-w64-s4")
    k, v = m.specs
    assert (k.bits, v.bits, k.group, k.symmetric) == (8, 4, 32, False)
    assert (m.fp_tokens.sinks, m.fp_tokens.window, m.fp_tokens.flush) == (4, 64, 64)
    assert kv_eval.parse_method("sim-kv4-rot-w32-f16").fp_tokens.flush == 16
    assert kv_eval.parse_method("kv4-rot").fp16_ratio(4096, 3, 64) == 34 / 128  # 4 bits + an fp16 scale per 64
    # 4096 tokens: 4 sinks, 4092 - 64 = 4028 = 62 * 64 + 60 quantized in whole blocks, 124 fp.
    rot_k, rot_v = kv_eval.parse_method("kv4-rot").specs
    exact = FpTokens(4, 64, 64).fp16_ratio(4096, rot_k, rot_v, 3, 64)
    assert exact == pytest.approx((128 * 128 + 3968 * 34) / (4096 * 128))
    # The reported ratio is the worst of the flush cycle: 4 + 127 fp tokens at 4099 stored.
    ratio = kv_eval.parse_method("sim-kv4-rot-w64-s4").fp16_ratio(4096, 3, 64)
    assert ratio == pytest.approx((131 * 128 + 3968 * 34) / (4099 * 128))
    real = kv_eval.parse_method("kv4-rot-g32-w64")  # kv4's own window
    assert all(spec.window == 64 and spec.group == 32 for spec in real.specs) and real.kind == "kv4"
    assert real.fp16_ratio(4096, 3, 64) == kv_eval.parse_method("sim-kv4-rot-g32-w64").fp16_ratio(4096, 3, 64)
    with pytest.raises(ValueError, match="only in simulation"):
        kv_eval.parse_method("kv4-rot-w64-s4")  # the real backend has no fp sinks
    # K sinks and offset: 4 fp16 tokens instead of 4 quantized ones and one fp16 row, in K only,
    # paid for by 15 of K's refined tokens.
    real = kv_eval.parse_method("kv4-rot-mse-r56-ks4-kc")
    assert real.kind == "kv4" and (real.specs[0].sinks, real.specs[0].center, real.specs[1].sinks) == (4, True, 0)
    plain = kv_eval.parse_method("kv4-rot-mse-r56").fp16_ratio(4096, 3, 64)
    extra = (4 * (128 - 34) + 128 - 15 * 34) / (4096 * 4 * 64)
    assert real.fp16_ratio(4096, 3, 64) == pytest.approx(plain + extra)
    assert real.fp16_ratio(4096, 3, 64) < plain


def test_padded_rows_scores_a_padded_row_as_the_sequence_alone_when_nothing_is_quantized():
    padded_rows = benchmark_script("padded_rows")
    model, ids = kv_heavy_llama(layers=1), _tokens(2400, seed=6)
    settings = dict(prefix=torch.tensor([1]), prompt=100, continuation=64, chunk=16, windows=1)  # a BOS, as Gemma's
    alone, padded = (padded_rows.continuation_nll_blocks(model, None, ids, padded=p, **settings) for p in (False, True))
    assert len(padded) == 1 and padded == pytest.approx(alone, rel=1e-5)  # the mask and positions hide the pads
    quantized = padded_rows.continuation_nll_blocks(model, kvpass.kv4(), ids, padded=True, **settings)
    assert math.isfinite(quantized[0]) and quantized != padded


def test_padded_twin_reads_a_padded_batch_as_the_twin_does():
    """The script's check on one type: the padded row fills its pads in both layers, and the decode step
    is the twin's; a sliding-window type's copies leave with its window (Mistral's, under the prompt)."""
    padded_twin = benchmark_script("padded_twin")
    error, filled = padded_twin.padded_step_error("llama")
    assert error <= TWIN_TOLERANCE and filled == [[[0, 4], [padded_twin.PADS, 4]]] * 2
    error, filled = padded_twin.padded_step_error("mistral")
    assert error <= TWIN_TOLERANCE and filled == [[[0, 0], [padded_twin.PADS, 0]]] * 2


def test_eval_regions_splits_each_windows_blocks_at_a_token_position():
    eval_regions = benchmark_script("eval_regions")
    # Two windows of 320 tokens after a 64-token first step: 4 blocks each, blocks 0-1 before token 192.
    base = [10.0, 10.0, 10.0, 10.0] * 2
    mine = [11.0, 11.5, 10.0, 10.2, 11.0, 10.5, 10.0, 9.8]
    rows = [dict(method="a", ctx=320, chunk=64, prefill=64, nll_blocks=mine), dict(method="b", nll_blocks=base)]
    regions = eval_regions.region_changes(rows, "a", "b", 192)
    (early, n_early, change_early, se_early), (late, n_late, change_late, se_late) = regions
    assert (early, n_early, late, n_late) == ("tokens 64-191", 256, "tokens 192-319", 256)
    assert change_early == pytest.approx(100 * (math.exp(4.0 / 256) - 1))
    assert change_late == pytest.approx(0.0, abs=1e-12)
    assert se_early == kv_eval.paired_delta_se([11.0, 11.5, 11.0, 10.5], [10.0] * 4, 256)


def test_compare_eval_says_which_documented_rows_a_rerun_reproduced(tmp_path, capsys):
    compare_eval = benchmark_script("compare_eval")
    row = dict(method="kv4", text="kjv", ctx=512, chunk=64, prefill=64, ppl=5.0, nll_blocks=[1.0, 2.0], top1_match=0.9,
               delta_pct=0.3, delta_pct_se=0.1, ppl_s=10.0, nll=1.5 / 128, scored=128)  # fmt: skip
    moved = dict(row, text="code", ppl=6.0)
    documented, rerun, other = tmp_path / "documented.json", tmp_path / "rerun.json", tmp_path / "other.json"
    documented.write_text(json.dumps({"rows": [row, moved]}))
    # Timings differ in every rerun and decide nothing; one measured value does.
    rerun.write_text(json.dumps({"rows": [dict(row, ppl_s=11.0), dict(moved, nll_blocks=[1.0, 2.5], nll=2.0 / 128)]}))
    # Another chunk is another setting; a row from before --prefill existed started with a chunk.
    other.write_text(json.dumps({"rows": [dict(row, chunk=8, prefill=8)]}))
    older = tmp_path / "older.json"
    older.write_text(json.dumps({"rows": [{k: v for k, v in row.items() if k != "prefill"}]}))
    verdicts = compare_eval.compare(compare_eval.rows_by_setting(documented), compare_eval.rows_by_setting(rerun))
    assert [(key[1], same) for key, same, _, _ in verdicts] == [("code", False), ("kjv", True)]
    assert compare_eval.main([str(documented), str(rerun)]) == 1
    assert compare_eval.main([str(documented), str(documented)]) == 0
    assert compare_eval.main([str(documented), str(other)]) == 2
    assert compare_eval.main([str(older), str(documented)]) == 0
    printed = capsys.readouterr().out
    assert "| kv4 | code | 512 | 64 | 64 | no |" in printed
    # The moved row against itself as documented: its blocks' change, paired.
    paired = kv_eval._change(100 * math.expm1(0.5 / 128), kv_eval.paired_delta_se([1.0, 2.5], [1.0, 2.0], 128))
    assert f"| {paired} |" in printed and "| +0.00% ± 0.00 |" in printed
