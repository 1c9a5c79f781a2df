"""Memory and time of a query-rounded K append (``reference.rounding_coefficients``, then
``reference.quantize`` with those shares) for a prompt's queries and keys: the largest bytes each
call's new tensors held at once (each storage counted from the op that made it until it is freed;
the inputs themselves not counted), and the wall time of a call without that accounting, for
SmolLM2's and a Llama-3-8B-shaped 4K-token prompt and one 256-token chunk of the bench model at
batch 4 (``kvpass bench memory``'s fill). Run it against another checkout with ``PYTHONPATH``.

    python benchmarks/rounding_memory.py
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kvpass import reference
from kvpass.config import KVConfig


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages made by the ops it sees, alive at once: now and at most."""

    def __init__(self, known: torch.Tensor):
        super().__init__()
        self.sizes = {known.untyped_storage().data_ptr(): 0}  # the input's, already there
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.sizes:
                storage = t.untyped_storage()
                self.sizes[storage.data_ptr()] = storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._freed, storage.data_ptr())
        return out

    def _freed(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)


SHAPES = {  # name: (batch, query heads, KV heads, tokens, head_dim)
    "SmolLM2, 4K-token prompt": (1, 9, 3, 4096, 64),
    "Llama-3-8B shape, 4K-token prompt": (1, 32, 8, 4096, 128),
    "bench model, 256-token chunk, batch 4": (4, 8, 8, 256, 128),
}


def measured(call, known: torch.Tensor) -> tuple[float, float]:
    """``(peak MiB of the call's new tensors, ms of a call without accounting)``, after a warm call."""
    call()
    start = time.perf_counter()
    call()
    ms = 1e3 * (time.perf_counter() - start)
    live = LiveBytes(known)
    with live:
        call()
    return live.peak / 2**20, ms


@torch.no_grad()
def main() -> None:
    torch.manual_seed(0)
    spec = KVConfig().k
    print(f"{'queries and keys':<38} {'fp32 MiB':>8} {'shares MiB':>10} {'ms':>5} {'codes MiB':>9} {'ms':>5}"
          f"  ({torch.get_num_threads()} threads)")  # fmt: skip
    for name, (B, Hq, kv_heads, T, D) in SHAPES.items():
        query, keys = torch.randn(B, Hq, T, D), reference.rotate(torch.randn(B, kv_heads, T, D))
        shares = reference.rounding_coefficients(query, kv_heads, None, spec)
        share_mib, share_ms = measured(lambda: reference.rounding_coefficients(query, kv_heads, None, spec), query)
        code_mib, code_ms = measured(lambda: reference.quantize(keys, spec, shares), keys)
        print(f"{name:<38} {query.numel() * 4 / 2**20:8.0f} {share_mib:10.1f} {share_ms:5.0f} "
              f"{code_mib:9.1f} {code_ms:5.0f}")


if __name__ == "__main__":
    main()
