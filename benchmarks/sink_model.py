"""Writes a GPT-OSS-shaped causal LM with random weights, for ``kvpass bench decode --model DIR``.

No GPT-OSS checkpoint is available offline, and the benchmark model (a Llama) has no attention sinks.
This one has GPT-OSS's attention: 64 query heads and 8 KV heads of 64 channels, a learned sink logit
per head (which kv4 reads as one more new token, ``kvpass/passes.py``), hidden size 2,880. The rest
is shrunk so that the attention is a visible part of a CPU decode step: 2 layers, both full attention
(GPT-OSS alternates with a 128-token window, which reads few tokens at any context), 4 experts of 512
channels, 2 of them per token, and a vocabulary of 2,048 words (a word-level tokenizer, which the
benchmark does not use: it feeds random token ids).

    python benchmarks/sink_model.py DIR
    kvpass bench decode --model DIR --methods fp,kv4 --contexts 1024,4096 --steps 40 --rounds 4
"""

from __future__ import annotations

import argparse

import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, GptOssConfig, PreTrainedTokenizerFast

VOCAB = 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    args = parser.parse_args()
    config = GptOssConfig(num_hidden_layers=2, hidden_size=2880, num_attention_heads=64, num_key_value_heads=8,
                          head_dim=64, num_local_experts=4, num_experts_per_tok=2, intermediate_size=512,
                          vocab_size=VOCAB, layer_types=["full_attention"] * 2)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(args.directory)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(args.directory)


if __name__ == "__main__":
    main()
