"""An eager, model-agnostic twin of the kv4 backend, for references and scheme studies.

``SimulatedKVCache`` is an HF ``DynamicCache`` whose attention layers hand attention
exactly what the kv4 backend's attention reads: every past token as
:func:`kvpass.reference.quantize_dequantize` gives it back, the new tokens exact. It keeps
fp copies and re-quantizes the whole past each step (groups stay aligned from token 0,
so this equals quantizing each token once), which is slow and simple: what a reference
should be. Layer types (full, sliding-window, recurrent) come from the model config as in
``DynamicCache``; only attention layers are simulated.

``FpTokens`` says which tokens stay unquantized: by default the specs' window, as kv4 keeps
it; also schemes kv4 does not have, such as the first ``sinks`` tokens of K and V alike, kept
fp wherever a sliding window has moved them (see :meth:`FpTokens.quantized`). A spec's own
``sinks`` and ``center`` are simulated as kv4 stores them: sinks at the start of the sequence (a
left-padded row's first tokens, copied into its first pads) until a sliding window evicts them, the
offset fixed by a layer's first update.

A query-scaled K spec (``QuantSpec.query_scaled``) takes its scales from the queries of a
layer's first update, which reach attention, never the cache: run the model inside
:func:`observed_queries`, which hands each attention call's queries to the layer just updated.
A K spec that defers its prefix (``QuantSpec.defer_prefix``) is read exact until a layer holds
``spec.prefix_tokens`` tokens, as kv4 holds it, and from the next update on quantized as one first
append of all the tokens it held then (with all their queries).
A query-rounded K spec (``QuantSpec.query_rounded``) rounds the tokens each update quantizes against
that update's queries where it brings enough of them (:meth:`QuantSpec.rounds`), as kv4's append
does; since those depend on the update, not on the tokens alone, each token is encoded once and its
codes kept between reads (the only exception to re-quantizing the past).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Collection

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.modeling_utils import AttentionInterface

from kvpass.config import WINDOW_BLOCK, QuantSpec
from kvpass.reference import (
    as_read, bits_per_value, by_query_scales, center_offset, evicted_fill, filled_pads, fixed_or_none, masked_pads,
    query_energy, query_key_scales, quantize, quantize_dequantize, rounding_coefficients, with_pads_filled,
)  # fmt: skip


class QueriesNotObserved(RuntimeError):
    """A query-scaled K layer's next update came without the queries of its first one."""


# Inside observed_queries: the layers whose first update waits for its queries (the attention call
# right after the update hands them over). None outside it.
_awaiting_queries: list[dict] | None = None


@dataclasses.dataclass(frozen=True)
class FpTokens:
    """Which stored tokens stay unquantized: the first ``sinks`` (attention sinks) and a
    recent window of ``window`` to ``window + flush - 1`` tokens.

    Tokens leave the window ``flush`` at a time: a cache holding ``S`` tokens quantizes
    tokens ``[sinks, sinks + n)`` with ``n`` the largest multiple of ``flush`` that leaves at
    least ``window`` tokens after them. So the quantized span only grows, in whole blocks,
    and each token is quantized once, as a real cache would.
    """

    sinks: int = 0
    window: int = 0
    flush: int = 1

    def __post_init__(self):
        if self.sinks < 0 or self.window < 0 or self.flush < 1:
            raise ValueError(f"need sinks >= 0, window >= 0, flush >= 1, got {self}")

    def quantized(self, stored: int) -> tuple[int, int]:
        """``[start, stop)``: the quantized tokens of a cache holding ``stored`` tokens."""
        start = min(self.sinks, stored)
        free = stored - start - self.window
        return start, start + (free // self.flush * self.flush if free > 0 else 0)

    def fp16_ratio(self, stored: int, k_spec: QuantSpec, v_spec: QuantSpec, heads: int, head_dim: int) -> float:
        """Bytes of a ``stored``-token cache of ``heads`` KV heads of ``head_dim`` channels built from
        one prompt (fp tokens in fp16, refined tokens' second code plane, the sinks, offset and query
        scales a spec takes from it included) over an all-fp16 cache."""
        start, stop = self.quantized(stored)
        total = 0
        for spec in (k_spec.for_head_dim(head_dim), v_spec.for_head_dim(head_dim)):
            if spec.waits(stored):  # 16 bits a value, and the queries' fp64 energy
                total += stored * 2 * head_dim + 8 * head_dim * spec.gathers_queries
                continue
            taken, has_offset = spec.prefix(stored)
            sinks = min(taken, stop)
            n_quant = stop - max(start, sinks)
            total += (stored - n_quant) * 2 * head_dim + 2 * head_dim * (has_offset + spec.takes_query_scales(stored))
            refined = spec.refined_tokens(n_quant + sinks, head_dim, sinks, has_offset)
            total += (n_quant + refined) * head_dim * bits_per_value(spec, heads, head_dim) / 8
        return total / (stored * 4 * head_dim)


def _simulated_update(base_update, k_spec, v_spec, fp_tokens, fills_pads, state, key_states, value_states, *args,
                      **kwargs):  # fmt: skip
    """The layer's own update (its bookkeeping, eviction included), quantized past on read.
    ``state`` (a dict per layer) counts the tokens seen and holds the sinks, offset and query scales
    each spec took; with ``fills_pads``, the left padding its first update's queries showed, its first
    slots holding copies of each row's first tokens as kv4 stores them (``PackedKV.filled_pads``)."""
    if value_states is key_states:  # one tensor read as both K and V: kv4 stores it with K's spec, unscaled
        # Nor does it wait for its prefix: V's reads would need it before it is fixed.
        k_spec = v_spec = None if k_spec is None else dataclasses.replace(
            k_spec, query_scaled=False, defer_prefix=False, query_rounded=False
        )  # fmt: skip
    k_spec, v_spec = (  # a tensor of no channels stays as it is in kv4 too (a layer without RoPE's rotary key)
        None if spec is None or not x.shape[-1] else spec.for_head_dim(x.shape[-1])
        for x, spec in ((key_states, k_spec), (value_states, v_spec))
    )
    first_update = not state
    if first_update:
        state.update(seen=0, prefixes=[(0, None), _prefix(value_states, v_spec)], fills_pads=fills_pads,
                     kv_heads=key_states.shape[1])  # fmt: skip
        if k_spec is not None and k_spec.defer_prefix:
            state["queries"] = []  # K waits, exact, for prefix_tokens tokens (and their queries)
    elif "first_keys" in state or "rounding_pending" in state:
        raise QueriesNotObserved(
            f"K spec {k_spec.tag} takes query scales or rounding from an update's queries, and no attention "
            "call handed them over: run the model inside kvpass.simulate.observed_queries()"
        )
    state["seen"] += key_states.shape[2]
    full_k, full_v = base_update(key_states, value_states, *args, **kwargs)
    past = full_k.shape[2] - key_states.shape[2]
    evicted = state["seen"] - full_k.shape[2]  # tokens a sliding window dropped from the front
    # The past as the cache stored it after the previous step; the new tokens are exact.
    where = (*fp_tokens.quantized(past), evicted, past)
    filled = state.get("filled_pads")
    filled = None if filled is None else evicted_fill(filled, evicted)
    read_v = _read(full_v, v_spec, state["prefixes"][1], None, *where, filled=filled)
    deferred = "queries" in state
    if k_spec is not None and k_spec.query_rounded and not (deferred and k_spec.waits(full_k.shape[2])):
        # The tokens this update quantizes, as kv4's append does: a first (or the crossing) append all the
        # layer holds, later ones their own; rounded against this update's queries once they come, if
        # it brings enough of them, else to nearest.
        seen = state["seen"]
        span = (0 if deferred or first_update else seen - key_states.shape[2], seen)
        if k_spec.rounds(key_states.shape[2]):
            state.update(rounding_pending=span, rounded_spec=k_spec)
            _await_queries(state)
        else:
            state.setdefault("rounding", []).append((*span, None))
    if deferred or first_update:
        # A first update fixes K's prefix from its tokens; a deferred prefix is fixed by the update that
        # brings the layer to prefix_tokens, from all of them, as a first append of them would.
        # Until then, and in that update (kv4 reads the past it held), K reads exact.
        first_keys = full_k if deferred else key_states
        if deferred and k_spec.waits(full_k.shape[2]):
            if k_spec.query_scaled:  # the scales will need every query so far
                _await_queries(state)
            return full_k, read_v
        if k_spec is not None and k_spec.takes_query_scales(first_keys.shape[2]):
            # K's sinks and offset are of k * s, so they wait for the scales.
            state.update(k_spec=k_spec, first_keys=first_keys)
            _await_queries(state)
            return full_k, read_v  # a first update reads its new tokens, exact
        state.pop("queries", None)
        state["prefixes"][0] = _prefix(first_keys, k_spec)
        if deferred:
            return full_k, read_v
    query_scales = state.get("query_scales")
    return _read(full_k, k_spec, state["prefixes"][0], query_scales, *where, state, filled), read_v


def _read(full, spec, prefix, query_scales, start, stop, evicted, past, state=None, filled=None):
    """``full`` (a layer's tokens) with its tokens ``[start, stop)`` (and the spec's sinks) as the
    cache stored them after the previous step, quantized with ``prefix``, ``(sinks, offset)``; a
    query-rounded spec's codes as ``state`` (the layer's) rounded them (:func:`_rounded_by_append`);
    where rows' pads are ``filled`` (:func:`kvpass.reference.filled_pads` after the eviction), every
    slot as stored (:func:`kvpass.reference.filled_slots`), then read as attention reads it."""
    sinks, offset = prefix
    held = max(min(sinks - evicted, past), 0)  # the spec's sinks, while the layer holds them
    first = max(start, held)
    if spec is None or stop <= first:
        return full
    if filled is not None:
        stored = _read(with_pads_filled(full, filled), spec, prefix, query_scales, start, stop, evicted, past, state)
        return as_read(stored, filled)
    quantizer = functools.partial(_rounded_by_append, state, evicted + first) if spec.query_rounded else quantize
    # The spec's sinks as kv4 stores them (16 bits), then its quantized tokens: of k * s, read as k.
    stored = by_query_scales(full[:, :, first - held : stop], query_scales, 1)
    stored = by_query_scales(quantize_dequantize(stored, spec, offset, sinks=held, quantizer=quantizer), query_scales, -1)
    return torch.cat([full[:, :, : first - held], stored, full[:, :, stop:]], 2)


def _rounded_by_append(state: dict, first: int, quantized: torch.Tensor, spec: QuantSpec):
    """``(codes, scales)`` of a query-rounded layer's stored tokens ``first ..`` (counted from the
    layer's first token), each rounded against the queries of the update that quantized it (to
    nearest where it brought too few), as kv4 stores them. Each token is encoded once: later reads
    take its codes from ``state``, as they take the same stored values."""
    stop = first + quantized.shape[2]
    start, codes, scales = state.get("encoded", (first, quantized.new_empty(0), None))
    if first > start:  # a sliding window dropped the oldest
        codes, scales, start = codes[:, :, first - start :], scales[:, :, first - start :], first
    parts = [(codes, scales)] if scales is not None and codes.shape[2] else []
    done = start + sum(part[0].shape[2] for part in parts)
    for lo, hi, rounding in state.get("rounding", ()):
        lo, hi = max(lo, done), min(hi, stop)
        if lo < hi:
            parts.append(quantize(quantized[:, :, lo - first : hi - first], spec, rounding))
            done = hi
    if start != first or done != stop:
        raise QueriesNotObserved(f"tokens {done}-{stop} of a query-rounded K layer have no update's queries")
    codes, scales = (torch.cat(tensors, 2) for tensors in zip(*parts))
    state["encoded"] = (first, codes, scales)
    return codes, scales


def _await_queries(state: dict) -> None:
    if _awaiting_queries is not None:
        _awaiting_queries.append(state)


def _prefix(first: torch.Tensor, spec: QuantSpec | None, pads=None) -> tuple[int, torch.Tensor | None]:
    """``(sinks, offset)`` a spec takes from a layer's first update ``first`` (its rows' left ``pads``
    skipped, where the queries came with them)."""
    sinks, takes_offset = (0, False) if spec is None else spec.prefix(first.shape[2])
    return sinks, center_offset(first, spec, pads=pads) if takes_offset else None


def _take_queries(state: dict, query: torch.Tensor, pads: torch.Tensor | None) -> None:
    """Hand a layer the queries of its latest update, and the left ``pads`` of its rows their mask shows
    (:func:`kvpass.reference.masked_pads`): kept while its K prefix waits (``queries``), else they fix
    its query scales, and K's sinks and offset with them; and they give the shares that round a
    query-rounded K's tokens of that update (:func:`kvpass.reference.rounding_coefficients`). A layer that
    fills its rows' pads takes them from its first update's."""
    if state["fills_pads"] and pads is not None and state["seen"] == query.shape[2] and "filled_pads" not in state:
        state["filled_pads"] = filled_pads(pads, query.shape[2])
    if "first_keys" in state:
        _fix_query_scales(state, query, pads)
    elif "queries" in state:
        state["queries"].append(query)
    if "rounding_pending" in state:
        lo, hi = state.pop("rounding_pending")
        rounding = rounding_coefficients(query, state["kv_heads"], state.get("query_scales"), state["rounded_spec"],
                                         pads=pads if lo == 0 else None, seen=hi - query.shape[2])  # fmt: skip
        state.setdefault("rounding", []).append((lo, hi, rounding))


def _fix_query_scales(state: dict, query: torch.Tensor, pads: torch.Tensor | None) -> None:
    """The query scales of a layer's first update (or the one that ends its wait), from ``query`` and
    the queries held before it, and K's sinks and offset with them."""
    first = state.pop("first_keys")
    query = torch.cat([*state.pop("queries", ()), query], 2)
    (B, kv_heads, T, D), (qB, heads, qT, qD) = first.shape, query.shape
    if (qB, qT, qD) != (B, T, D) or heads % kv_heads:
        raise ValueError(
            f"queries {tuple(query.shape)} do not read the first keys {tuple(first.shape)}: need the same batch, "
            "tokens and head_dim, and query heads a multiple of the KV heads"
        )
    spec = state.pop("k_spec")
    state["query_scales"] = query_key_scales(query_energy(query, kv_heads, spec, pads=pads), first, spec, pads)
    state["prefixes"][0] = _prefix(by_query_scales(first, state["query_scales"], 1), spec, pads)


def _in_grouped_order(query: torch.Tensor, key: torch.Tensor | None, kv_heads: int) -> torch.Tensor:
    """``query`` with its heads ordered as the KV heads they read, in groups (head ``g * n + r`` reads KV
    head ``g``): reordered where attention reads ``key`` as the layer's KV heads tiled ``n`` times
    (JetMoE's ``key.repeat(1, n, 1, 1)``: head ``r * H_kv + g`` reads ``g``), which shapes alone do not
    tell from groups (``repeat_kv``) and the key's values do."""
    heads = query.shape[1]
    tiles = heads // kv_heads
    if (tiles < 2 or not torch.is_tensor(key) or key.shape[1] != heads
            or not torch.equal(key, key[:, :kv_heads].repeat(1, tiles, 1, 1))):  # fmt: skip
        return query
    return query.unflatten(1, (tiles, kv_heads)).transpose(1, 2).flatten(1, 2)


def _observing(attention):
    """``attention`` (an HF attention function) handing its queries to the layer awaiting them."""
    if getattr(attention, "observes_queries", False):
        return attention

    @functools.wraps(attention)
    def observed(module, query, *args, **kwargs):
        if _awaiting_queries:
            # The latest update's layer is this call's; an older one missed its queries, and says so.
            state = _awaiting_queries.pop()
            _awaiting_queries.clear()
            key = kwargs.get("key", args[0] if args else None)
            mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
            bool_mask = torch.is_tensor(mask) and mask.dtype == torch.bool  # as kv4_append reads masks
            grouped = _in_grouped_order(query, key, state["kv_heads"])
            _take_queries(state, grouped, masked_pads(mask, query.shape[0]) if bool_mask else None)
        return attention(module, query, *args, **kwargs)

    observed.observes_queries = True
    return observed


@contextlib.contextmanager
def observed_queries():
    """Within it, the attention functions HF models look up (``sdpa``, their own ``eager``) hand the
    queries of a layer's first update to a :class:`SimulatedKVCache` whose K spec takes query scales
    from them. A model whose attention bypasses transformers' ``AttentionInterface`` hands nothing
    over, and its next update says so."""
    global _awaiting_queries
    if _awaiting_queries is not None:
        raise RuntimeError("observed_queries() is already active")
    get_interface, getitem = AttentionInterface.get_interface, AttentionInterface.__getitem__
    AttentionInterface.get_interface = lambda self, name, default: _observing(get_interface(self, name, default))
    AttentionInterface.__getitem__ = lambda self, key: _observing(getitem(self, key))
    _awaiting_queries = []
    try:
        yield
    finally:
        AttentionInterface.get_interface, AttentionInterface.__getitem__ = get_interface, getitem
        _awaiting_queries = None


class SimulatedKVCache(DynamicCache):
    """``k_spec``/``v_spec``: how K/V are stored (None: exact); ``layers``: the indices of the cache
    layers simulated (default: every attention layer), the others exact; ``k_layer_specs``: K's spec in
    the cache layers it names, in place of ``k_spec`` (``kvpass.kv4(k_layer_bits=...)``'s layers).

    A K spec that defers its prefix (``QuantSpec.defer_prefix``) keeps a sliding window shorter than
    ``spec.prefix_tokens`` exact for good, as kv4 does."""

    def __init__(
        self, config, k_spec: QuantSpec | None, v_spec: QuantSpec | None, fp_tokens: FpTokens | None = None,
        layers: Collection[int] | None = None, k_layer_specs: dict[int, QuantSpec] | None = None,
    ):  # fmt: skip
        super().__init__(config=config)
        if fp_tokens is None:  # what kv4 itself keeps fp: the specs' window
            windows = {spec.window for spec in (k_spec, v_spec) if spec is not None}
            if len(windows) > 1:
                raise ValueError(f"K and V windows differ ({k_spec.window}, {v_spec.window}); pass fp_tokens")
            window = windows.pop() if windows else 0
            fp_tokens = FpTokens(window=window, flush=WINDOW_BLOCK) if window else FpTokens()
        # As kv4 fills a padded row's pads (kvpass.passes._fills_pads): caches storing every token on its own.
        fills_pads = all(spec is None or spec.tokens_apart for spec in (k_spec, v_spec))
        for index, layer in enumerate(self.layers):
            if isinstance(layer, DynamicLayer) and (layers is None or index in layers):
                layer_k_spec = (k_layer_specs or {}).get(index, k_spec)
                layer.update = functools.partial(
                    _simulated_update, layer.update, layer_k_spec, v_spec, fp_tokens, fills_pads, {}
                )


def _rounded_update(base_update, dtype, key_states, value_states, *args, **kwargs):
    """The layer's own update on K and V cast to ``dtype``; read back in the model's dtype."""
    full_k, full_v = base_update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)
    return full_k.to(key_states.dtype), full_v.to(value_states.dtype)


class RoundedKVCache(DynamicCache):
    """An unquantized cache holding K and V in ``dtype`` (float16, bfloat16) for a model run in a
    wider one: what 16-bit storage alone costs, the floor under a quantized cache's comparison with
    the model's own. New tokens are read as stored, as a 16-bit model's cache would hand them over."""

    def __init__(self, config, dtype: torch.dtype):
        super().__init__(config=config)
        for layer in self.layers:
            if isinstance(layer, DynamicLayer):
                layer.update = functools.partial(_rounded_update, layer.update, dtype)


def k_spec_as_stored(k_spec: QuantSpec, keys) -> QuantSpec:
    """``k_spec`` as kv4 stored these packed K caches: without query scales where one holds none
    after a long enough prompt, without query rounding where one's spec lacks it (a site kept K
    unscaled or rounded to nearest: one where no query came, ``kvpass.passes._scales_query``)."""
    unscaled = any(t.spec.query_scaled and fixed_or_none(t.query_scales) is None for t in keys)
    unrounded = any(k_spec.for_head_dim(t.shape[-1]).query_rounded and not t.spec.query_rounded for t in keys)
    return dataclasses.replace(
        k_spec, query_scaled=k_spec.query_scaled and not unscaled, query_rounded=k_spec.query_rounded and not unrounded
    )  # fmt: skip


def observing_queries(model):
    """``model`` called inside :func:`observed_queries`: a step over :class:`SimulatedKVCache`."""

    def step(*args, **kwargs):
        with observed_queries():
            return model(*args, **kwargs)

    return step
