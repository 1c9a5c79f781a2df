"""Per-layer key sensitivity: the one-layer simulation it rests on, and the command."""

import dataclasses
import math

import torch
from transformers import DynamicCache

from kvpass import sensitivity
from kvpass.config import KVConfig
from kvpass.eval import streaming_nll
from kvpass.models_zoo import build
from kvpass.simulate import SimulatedKVCache
from tests.helpers import kv_heavy_llama

# Updates made directly hand over no queries.
K = dataclasses.replace(KVConfig().k, query_scaled=False, query_rounded=0)


def test_simulating_one_layers_keys_leaves_every_other_tensor_exact():
    config = kv_heavy_llama().config
    g = torch.Generator().manual_seed(0)
    prompt = [torch.randn(1, 2, 80, 64, generator=g) for _ in range(2)]
    step = [torch.randn(1, 2, 1, 64, generator=g) for _ in range(2)]
    one = SimulatedKVCache(config, K, None, layers={0})
    every = SimulatedKVCache(config, K, KVConfig().v)
    for cache in (one, every):
        for layer in (0, 1):
            cache.update(*prompt, layer)
    exact_k, exact_v = (torch.cat([p, s], dim=2) for p, s in zip(prompt, step))
    k0, v0 = one.update(*step, 0)
    k1, v1 = one.update(*step, 1)
    assert torch.equal(k0, every.update(*step, 0)[0])  # layer 0's K read back as kv4 stores it
    assert not torch.equal(k0, exact_k)
    assert torch.equal(v0, exact_v) and torch.equal(k1, exact_k) and torch.equal(v1, exact_v)


def test_layer_costs_score_each_attention_layer_alone():
    model = kv_heavy_llama()
    ids = torch.randint(2, 256, (1, 96), generator=torch.Generator().manual_seed(1))
    rows = sensitivity.layer_costs(model, ids, 32, K)
    fp_nll, count, _ = streaming_nll(sensitivity._Run(model, DynamicCache), ids, 32)
    assert [r["layer"] for r in rows] == [0, 1]
    for r in rows:
        assert r["fp_ppl"] == math.exp(fp_nll / count)
        assert r["ppl"] != r["fp_ppl"]  # int4 keys change the scores
        assert math.isclose(r["delta_pct"], 100 * (r["ppl"] / r["fp_ppl"] - 1))
    worst = max(rows, key=lambda r: r["delta_pct"])
    assert sensitivity.costly_layers(rows, worst["delta_pct"] - 1e-9) == [worst["layer"]]


def test_attention_layers_leave_out_recurrent_ones():
    config = build("lfm2").config
    want = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert 0 < len(want) < config.num_hidden_layers
    assert sensitivity.attention_layers(config) == want


def test_kv4_settings_set_the_k_spec_measured_and_the_suggestion(tmp_path, capsys, monkeypatch):
    import pytest

    from kvpass.cli import main
    from tests.helpers import save_tiny_model

    save_tiny_model(tmp_path / "model", head_dim=64)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"t{i * 7 % 31 + 1}" for i in range(600)))
    measured = []

    def costs(model, ids, chunk, k_spec, progress):  # a random model's layer costs next to nothing: say 1%
        measured.append(k_spec)
        return [dict(layer=0, type="attention", ppl=1.01, fp_ppl=1.0, delta_pct=1.0)]

    monkeypatch.setattr(sensitivity, "layer_costs", costs)
    common = ["sensitivity", "--model", str(tmp_path / "model"), "--text", str(text), "--context", "256",
              "--chunk", "32", "--no-progress"]  # fmt: skip
    assert main([*common, "--kv4-setting", "bits=2", "--kv4-setting", "k_defer_prefix=False"]) == 0
    assert measured == [dataclasses.replace(KVConfig().k, bits=2, defer_prefix=False)]
    out = capsys.readouterr().out
    assert f"K stored as {measured[0].tag} in one layer at a time" in out
    assert "try kvpass.kv4(bits=2, k_defer_prefix=False, k_layer_bits={0: 8})" in out
    assert "--methods fp,kv4,kv4-k8@0 --kv4-setting bits=2 --kv4-setting k_defer_prefix=False" in out
    with pytest.raises(SystemExit):  # V is never measured here
        main([*common, "--kv4-setting", "v_bits=8"])
    assert "kv4 settings ['v_bits'] are not kvpass.kv4 settings kvpass sensitivity takes" in capsys.readouterr().err
