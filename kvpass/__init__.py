"""kvpass: int4 KV caches for Hugging Face causal LMs through ``torch.compile(backend="kv4")``."""
