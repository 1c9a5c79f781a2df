"""The calls a rewritten graph makes: thin wrappers from PackedKV to the ``kv4::`` ops.

They take quantization specs as tags (``"int4:channel:64"``, ``"int4:token:64:rot:asym"``;
see :attr:`kvpass.config.QuantSpec.tag`) so a rewritten graph prints readably and holds
no Python objects as constants. An asymmetric spec's zero points ride in ``scales``.
"""

from __future__ import annotations

import functools
import math

import torch

from kvpass import ops, reference
from kvpass.config import QuantSpec
from kvpass.packed import PackedKV


@functools.lru_cache(maxsize=None)
def _spec(tag: str) -> QuantSpec:
    return QuantSpec.from_tag(tag)


def _as_packed(past: torch.Tensor, spec: QuantSpec) -> PackedKV:
    # A cache filled outside kvpass arrives as plain floats: quantize it once, here.
    return past if isinstance(past, PackedKV) else PackedKV.from_float(past, spec)


def kv4_pack(new: torch.Tensor, spec: str) -> PackedKV:
    """The first write into an empty cache."""
    return PackedKV.from_float(new, _spec(spec))


def kv4_append(past: torch.Tensor, new: torch.Tensor, spec: str) -> PackedKV:
    """``torch.cat([past, new], dim=-2)`` where ``past`` is (or becomes) int4."""
    return _as_packed(past, _spec(spec)).append(new)


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
    """``sdpa(q, cat([past_k, k_new]), cat([past_v, v_new]))`` reading the past as stored.

    ``softcap`` is Gemma-2's ``cap * tanh(scores / cap)``, found in eager attention graphs.
    No new tokens (``None``): a static cache, whose buffer already holds them.
    ``v_heads[j]`` is the stored V head that head ``j`` of V reads (DiffLlama: a chunk of the
    heads tiled back); it copies the picked heads' codes.
    """
    k_spec_, v_spec_ = _spec(k_spec), _spec(v_spec)
    k, v = _as_packed(past_k, k_spec_), _as_packed(past_v, v_spec_)
    if k_new is None:
        k_new, v_new = k.residual[:, :, :0], v.residual[:, :, :0]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    v_stored = [v.codes, v.scales, v.residual, v.fine_codes, v.fine_scales, v.head, v.offset]
    if v_heads is not None:
        index = torch.tensor(v_heads, device=q.device)
        # Groups spanning heads (span_heads) first give each head its own scale row to pick.
        v_stored[1], v_stored[4] = (None if t is None else reference.per_head_scales(t, v.codes.shape[1])
                                    for t in (v.scales, v.fine_scales))  # fmt: skip
        v_new, *v_stored = (None if t is None else t.index_select(1, index) for t in (v_new, *v_stored))
    v_codes, v_scales, v_residual, v_fine_codes, v_fine_scales, v_head, v_offset = v_stored
    return ops.attention(
        q, k.codes, k.scales, k.residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale, is_causal,
        *ops.spec_args(k_spec_), *ops.spec_args(v_spec_), softcap,
        k.fine_codes, k.fine_scales, v_fine_codes, v_fine_scales,  # a refined spec's second planes
        k.head, k.offset, v_head, v_offset,  # fp sinks and a centered spec's offset
    )  # fmt: skip
