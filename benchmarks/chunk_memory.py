"""What a prefill chunk leaves resident, on ``kvpass bench memory``'s model (kv4-bf16, 256-token chunks):

* ``calls``: one 256-token K append with its queries (K's query rounding), without them, a V append,
  and the chunk's attention over a 1K-token cache, each called alone after two untimed calls, with
  freed heap memory returned and the kernel's high-water mark reset before it: the resident set's
  rise at its peak and after;
* ``fill``: the fill the benchmark measures, the resident set sampled every millisecond from the
  same baseline: its rise during and after the first chunk, and at the end, beside the stored bytes
  and the bytes glibc's allocator has handed out (``mallinfo2``, sampled with it): the resident set
  above them is freed memory the allocator keeps, which a trim at the end hands back.

    python benchmarks/chunk_memory.py calls [--batch 4]
    python benchmarks/chunk_memory.py fill [--batch 1] [--context 16384]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import threading
import time

import torch

from kvpass import bench, packed
from kvpass.bench import memory
from kvpass.cache_argument import cache_arg, returned_cache
from kvpass.config import KVConfig
from kvpass.packed import PackedKV


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def allocated_mib() -> float:
    """Bytes glibc's malloc has handed out and not had back (heap chunks in use plus mmapped ones), in MiB."""
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def rise_mib(call) -> tuple[float, float]:
    """The resident set's rise over its trimmed baseline while ``call()`` runs, and after it."""
    gc.collect()
    base = memory._resident_baseline_mib()
    call()
    return memory._status_mib("VmHWM") - base, memory._status_mib("VmRSS") - base


def calls(batch: int) -> None:
    spec, (H, D, T) = KVConfig(), (8, 128, 256)
    past = [torch.randn(batch, H, 1024, D).bfloat16() for _ in range(3)]
    k, v = PackedKV.from_float(past[0], spec.k, past[2]), PackedKV.from_float(past[1], spec.v)
    k_new, v_new, query = (torch.randn(batch, H, T, D).bfloat16() for _ in range(3))
    jobs = {
        "K append with its queries": lambda: k.append(k_new, query),
        "K append without queries": lambda: k.append(k_new),
        "V append": lambda: v.append(v_new),
        "attention over 1K tokens": lambda: packed.attention(query, k, v, k_new, v_new, None, None, True),
    }
    print(f"batch {batch}, {T}-token chunk into a 1K-token cache: resident MiB over the baseline")
    for name, job in jobs.items():
        for _ in range(2):
            job()
        peak, after = rise_mib(job)
        print(f"  {name:<27} {peak:6.1f} at its peak, {after:6.1f} after")


def fill(batch: int, context: int) -> None:
    dtype, how = bench.CACHES["kv4-bf16"]
    model = bench.build_model(dtype)
    step, new_cache = bench.stepper(model, how)
    chunk = 256
    warm = bench.fill(step, new_cache(), batch, 3 * chunk, chunk=chunk, vocab=model.config.vocab_size)
    del warm
    gc.collect()
    base = memory._resident_baseline_mib()
    allocated_base = allocated_mib()
    samples, chunk_index, done = [], [0], threading.Event()

    def sample():
        while not done.is_set():
            samples.append((chunk_index[0], memory._status_mib("VmRSS") - base, allocated_mib() - allocated_base))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cache, gen = new_cache(), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for start in range(0, context, chunk):
            ids = torch.randint(2, model.config.vocab_size, (batch, chunk), generator=gen)
            cache = returned_cache(step(input_ids=ids, **cache_arg(cache), use_cache=True, logits_to_keep=1))
            chunk_index[0] = start // chunk + 1
    done.set()
    sampler.join()
    during_first = max(rss for i, rss, _ in samples if i == 0)
    after_first = [rss for i, rss, _ in samples if i == 1][:1] or [float("nan")]
    print(f"batch {batch}, {context} tokens in {chunk}-token chunks: resident MiB over the baseline")
    print(f"  first chunk: {during_first:.1f} during it, {after_first[0]:.1f} after")
    print(f"  whole fill: {memory._status_mib('VmHWM') - base:.1f} at its peak; "
          f"the cache stores {bench.stored_bytes(cache) / 2**20:.1f}")  # fmt: skip
    resident_end = memory._status_mib("VmRSS") - base
    print(f"  allocated by malloc over its baseline: {max(a for *_, a in samples):.1f} at its sampled peak, "
          f"{allocated_mib() - allocated_base:.1f} at the end (resident {resident_end:.1f}, "
          f"{memory._resident_baseline_mib() - base:.1f} after malloc_trim)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("calls", "fill"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=16384)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.what == "calls":
        calls(args.batch)
    else:
        fill(args.batch, args.context)


if __name__ == "__main__":
    main()
