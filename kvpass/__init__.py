"""kvpass: int4 KV caches for Hugging Face causal LMs through ``torch.compile(backend="kv4")``.

``model.compile(backend="kv4")`` needs no import of this package (the backend is an entry
point), nor do other settings as ``torch.compile``'s options (``options={"bits": 8}``, any
:func:`kv4` keyword); with it, ``torch.compile(model, backend=kvpass.kv4(bits=8))``.
"""

from kvpass.backend import default_backend, kv4
from kvpass.config import KVConfig, QuantSpec
from kvpass.packed import PackedKV
from kvpass.version import __version__

__all__ = [
    "KVConfig", "PackedKV", "QuantSpec", "StaticKVCache", "__version__", "default_backend", "int4_static_caches", "kv4",
]  # fmt: skip


def __getattr__(name):
    # kvpass.static imports transformers' cache classes; only pay for that when asked.
    if name in ("StaticKVCache", "int4_static_caches"):
        from kvpass import static

        return getattr(static, name)
    raise AttributeError(f"module 'kvpass' has no attribute {name!r}")
