"""The calls a rewritten graph makes: thin wrappers from PackedKV to the ``kv4::`` ops.

They take quantization specs as tags (``"int4:channel:64"``, ``"int4:token:64:rot:asym"``;
see :attr:`kvpass.config.QuantSpec.tag`) so a rewritten graph prints readably and holds
no Python objects as constants. An asymmetric spec's zero points ride in ``scales``.
"""

from __future__ import annotations

import functools

import torch

from kvpass import packed, reference
from kvpass.config import QuantSpec
from kvpass.packed import PackedKV


@functools.lru_cache(maxsize=None)
def _spec(tag: str) -> QuantSpec:
    return QuantSpec.from_tag(tag)


def _as_packed(past: torch.Tensor, spec: QuantSpec) -> PackedKV:
    # A cache filled outside kvpass arrives as plain floats: quantize it once, here.
    return past if isinstance(past, PackedKV) else PackedKV.from_float(past, spec)


def _pads(mask: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor | None:
    # Only a bool mask, as the twin reads only one: an additive one may carry a bias besides.
    return reference.masked_pads(mask, new.shape[0]) if mask is not None and mask.dtype == torch.bool else None


def kv4_pack(new: torch.Tensor, spec: str, query: torch.Tensor | None = None, mask: torch.Tensor | None = None,
             fills_pads: bool = False) -> PackedKV:  # fmt: skip
    """The first write into an empty cache; ``query``, the queries reading it, fixes query scales, and
    their attention ``mask`` says which slots of each row are left padding (whose first slots
    ``fills_pads`` fills with copies of the row's first tokens: ``PackedKV.filled_pads``)."""
    return PackedKV.from_float(new, _spec(spec), query, _pads(mask, new), fills_pads)


def kv4_append(past: torch.Tensor, new: torch.Tensor, spec: str, query: torch.Tensor | None = None,
               mask: torch.Tensor | None = None, fills_pads: bool = False) -> PackedKV:  # fmt: skip
    """``torch.cat([past, new], dim=-2)`` where ``past`` is (or becomes) int4; ``query``, the queries
    reading ``new``, is gathered by a cache waiting for its prefix (``QuantSpec.defer_prefix``), with
    the left padding their attention ``mask`` shows (read only where the cache takes it: not in decode)."""
    cache = _as_packed(past, _spec(spec))
    return cache.append(new, query, _pads(mask, new) if cache.takes_pads else None, fills_pads)


def kv4_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, spec: str) -> PackedKV:
    """``torch.zeros(shape)`` of a static cache layer allocating in the graph, as int4."""
    return PackedKV.zeros(shape, dtype, device, _spec(spec))


def kv4_write_(buffer: PackedKV, positions: torch.Tensor, new: torch.Tensor) -> None:
    """``buffer.index_copy_(2, positions, new)`` of a static cache, quantizing in place."""
    buffer.write_(positions, new)


def kv4_sdpa(
    q: torch.Tensor,
    past_k: torch.Tensor,
    k_new: torch.Tensor | None,
    past_v: torch.Tensor,
    v_new: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    is_causal: bool,
    k_spec: str,
    v_spec: str,
    softcap: float = 0.0,
    v_heads: list[int] | None = None,
) -> torch.Tensor:
    """``sdpa(q, cat([past_k, k_new]), cat([past_v, v_new]))`` reading the past as stored
    (:func:`kvpass.packed.attention`, which says what the other arguments are)."""
    k, v = _as_packed(past_k, _spec(k_spec)), _as_packed(past_v, _spec(v_spec))
    return packed.attention(q, k, v, k_new, v_new, attn_mask, scale, is_causal, softcap, v_heads)


def kv4_decode(
    q: torch.Tensor,
    past_k: torch.Tensor,
    k_new: torch.Tensor,
    past_v: torch.Tensor,
    v_new: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    is_causal: bool,
    k_spec: str,
    v_spec: str,
    softcap: float = 0.0,
    query: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    fills_pads: bool = False,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PackedKV, PackedKV]:
    """``(kv4_sdpa(q, past_k, k_new, past_v, v_new, ...), kv4_append(past_k, k_new, k_spec, query, mask,
    fills_pads), kv4_append(past_v, v_new, v_spec, ...))`` of a site whose appends only its attention and
    the cache object read: a decode step's three in one call (:func:`kvpass.packed.attend_and_append`).
    ``sink``: an attention sink's logits, which the attention reads after the new tokens."""
    k, v = _as_packed(past_k, _spec(k_spec)), _as_packed(past_v, _spec(v_spec))
    pads = _pads(mask, k_new) if k.takes_pads else None
    return packed.attend_and_append(q, k, v, k_new, v_new, attn_mask, scale, is_causal, softcap, query, pads, fills_pads,
                                    sink)  # fmt: skip

