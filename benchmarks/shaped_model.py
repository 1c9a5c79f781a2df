"""Writes a causal LM with random weights in the attention shape of a model that is not available
offline, for ``kvpass bench decode --model DIR``.

- ``gpt-oss``: GPT-OSS's attention, 64 query heads and 8 KV heads of 64 channels, a learned sink logit
  per head (which kv4 reads as one more new token, ``kvpass/passes.py``), hidden size 2,880. Both layers
  are full attention (GPT-OSS alternates with a 128-token window, which reads few tokens at any context);
  4 experts of 512 channels, 2 of them per token.
- ``deepseek-v2-lite``: DeepSeek-V2-Lite's multi-head latent attention (MLA), 16 heads, a 512-channel
  latent and a 64-channel rotary key cached per token, K and V projected from the latent to 128 + 64 and
  128 channels a head, hidden size 2,048 (as DeepSeek-V3 on transformers' code). Layer 0 dense, layer 1
  4 routed experts of 512 channels, 2 per token, and a shared one.
- ``deepseek-v3``: DeepSeek-V3's MLA, the same latent and heads of the same widths as the above, but 128
  of them, queries through a 1,536-channel low-rank projection, hidden size 7,168; the same layers and
  experts otherwise. kv4 attends over its latent with 128 query heads a KV head.

The rest is shrunk so that the attention is a visible part of a CPU decode step: 2 layers, and a
vocabulary of 2,048 words (a word-level tokenizer, which the benchmark does not use: it feeds random
token ids).

    python benchmarks/shaped_model.py gpt-oss DIR
    kvpass bench decode --model DIR --methods fp,kv4 --contexts 1024,4096 --steps 40 --rounds 4
"""

from __future__ import annotations

import argparse

import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, DeepseekV3Config, GptOssConfig, PreTrainedTokenizerFast

VOCAB = 2048

SHAPES = {
    "gpt-oss": lambda: GptOssConfig(
        num_hidden_layers=2, hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=512, vocab_size=VOCAB,
        layer_types=["full_attention"] * 2,
    ),
    "deepseek-v2-lite": lambda: DeepseekV3Config(
        num_hidden_layers=2, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=1024,
        moe_intermediate_size=512, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, vocab_size=VOCAB, max_position_embeddings=16384,
    ),
    "deepseek-v3": lambda: DeepseekV3Config(
        num_hidden_layers=2, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=1024,
        moe_intermediate_size=512, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, vocab_size=VOCAB, max_position_embeddings=16384,
    ),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=list(SHAPES))
    parser.add_argument("directory")
    args = parser.parse_args()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(SHAPES[args.shape]()).save_pretrained(args.directory)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(args.directory)


if __name__ == "__main__":
    main()
