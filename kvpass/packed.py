"""``PackedKV``: one layer's K or V cache, stored in int4, shaped like the fp cache it replaces."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import math
from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensor, disable_fake_tensor_cache
from torch.utils._python_dispatch import return_and_correct_aliasing

from kvpass import ops, reference
from kvpass.cpu_steps import storage_view
from kvpass.config import WINDOW_BLOCK, QuantSpec, check_spec

log = logging.getLogger("kvpass")
aten = torch.ops.aten

# aten op -> implementation(func, args, kwargs). Everything else goes through _fallback.
_IMPLEMENTATIONS = {}
# Each op the fallback ran on real tensors, counted: its first run warns, and `kvpass coverage` calls a type
# whose steps ran any "read dequantized", however exact its logits.
fallback_ops: Counter = Counter()


_AUTOCAST_DEVICES = ("cpu", "cuda")


def _autocast_off(fn):
    """``fn`` run with autocast off. kv4's numerics are the reference's in the dtypes it states, whatever
    autocast the model runs under: under it the rotation's and statistics' matmuls would run in 16 bits,
    and CPU autocast's type promotion rejects fp16 (a ``cat`` of scales raised)."""

    @functools.wraps(fn)
    def without_autocast(*args, **kwargs):
        # One flag read on a decode step's path, as torch's own RNN modules check it.
        if not torch._C._is_any_autocast_enabled():
            return fn(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for device in _AUTOCAST_DEVICES:
                if torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            return fn(*args, **kwargs)

    return without_autocast


def _implements(*aten_ops):
    def register(fn):
        for op in aten_ops:
            _IMPLEMENTATIONS[op] = fn
        return fn

    return register


class PackedKV(torch.Tensor):
    """A quantized KV cache tensor of logical shape ``[B, H, S, D]`` and float dtype.

    HF cache code sees an ordinary ``[B, H, S, D]`` tensor (``.shape``, ``cat`` along the
    sequence, batch indexing for beam search, sequence slicing for ``crop``; an uncompiled SDPA
    reads it block by block, :func:`attention`); the storage is

    * ``codes``: ``uint8 [B, H, S_q, D * bits // 8]``, the quantized tokens, packed along D
      (signed codes offset by ``2**(bits-1)`` when ``spec.symmetric``, else unsigned);
    * ``scales``: ``fp16 [B, H, S_q, D // g]`` (``scheme="token"``; ``[B, H // n, S_q, 1]`` when its
      groups span ``n`` whole heads, ``spec.span_heads``, and ``uint8``, 8-bit scales, where that is
      still under 16 values: :func:`kvpass.reference.scale_dtype`) or
      ``fp16 [B, H, S_q // g, D]`` (``scheme="channel"``); an asymmetric spec
      (``spec.symmetric=False``) adds a trailing dimension of 2, ``[..., 0]`` the scale and
      ``[..., 1]`` the zero point: ``fp16 [B, H, S_q, D // g, 2]`` or
      ``fp16 [B, H, S_q // g, D, 2]``;
    * ``residual``: ``[B, H, S - S_q, D]`` in the logical dtype: tokens not quantized yet,
      those of a per-channel group that is not full, or the newest ``spec.window`` to
      ``spec.window + 63`` tokens of a windowed per-token spec (else empty for ``scheme="token"``);
    * ``fine_codes``, ``fine_scales`` (``spec.refine`` only, else None): ``[B, H, F, ...]`` laid
      out like ``codes`` and ``scales``, the quantized error of the newest ``F`` quantized tokens
      (``F = spec.refined_tokens(S_h + S_q, ...)`` after an append; fewer after a crop),
      added on reading;
    * ``head`` (``spec.sinks`` only, else None): ``[B, H, S_h, D]`` in 16 bits (the logical
      dtype, bfloat16 for fp32: :func:`kvpass.reference.sink_dtype`), the first ``S_h`` tokens,
      unquantized (attention sinks): ``spec.sinks`` of them from a first append of at least
      ``PREFIX_MIN_TOKENS``, one from a shorter one of at least ``SHORT_PREFIX_MIN_TOKENS``, else
      none (:meth:`QuantSpec.prefix`); the logical tensor is ``[head | codes | residual]``,
      ``S = S_h + S_q + R``;
    * ``offset`` (``spec.center`` only, else None): ``fp16 [B, H, 1, D]``, subtracted from every
      token before quantizing and added back on reading (:func:`kvpass.reference.center_offset`);
      ``[B, H, 0, D]`` (none) until a first append long enough to fix it, and for good after a
      shorter one;
    * ``query_scales`` (``spec.query_scaled`` only, else None): ``fp16 [B, H, 1, D]``, per-channel
      scales every token is multiplied by before anything else, and divided by on reading (the
      attention divides the query instead): :func:`kvpass.reference.query_key_scales` of the first
      append and its queries; ``[B, H, 0, D]`` (none) when that append had no queries or was too short;
    * ``query_energy`` (``spec.defer_prefix`` with ``spec.query_scaled`` only, else None): ``fp64
      [B, H, 1, D]`` while the cache waits (below), the energy of the queries of the tokens it holds
      (:func:`kvpass.reference.query_energy`), else ``[B, H, 0, D]``;
    * ``filled_pads``: ``int64 [B, 2]`` where a first append knew its rows' left padding and was told
      to fill it (``fills_pads``), else ``[B, 0]``: each row's pads whose first slots hold copies of
      its first tokens, and how many such copies the cache still holds
      (:func:`kvpass.reference.filled_pads`, :func:`kvpass.reference.filled_slots`), so the sinks
      ``head`` are the row's own first tokens; the attention reads a copy for its token and hides the
      token's own slot (:func:`kvpass.reference.mask_with_filled_pads`), as does the logical tensor
      (:func:`kvpass.reference.as_read`: the filled pads read as their copies).

    **Waiting** (``spec.defer_prefix``): until a cache holds ``spec.prefix_tokens`` tokens it quantizes
    none of them; they sit in ``residual`` (stored domain, as the kernels read it) and every other
    part is empty. The append that brings it to that length quantizes all of them (the held ones
    read back) as :meth:`from_float` quantizes one first append, with all their queries.

    All of them but ``query_scales`` live in the stored domain (Hadamard-rotated along D when ``spec.rotate``).
    Dimensions 0 (batch) and 2 (tokens or token groups) mean the same in all of them (``filled_pads``
    has no tokens), which is what every op below slices, indexes and concatenates.
    Build one with :meth:`from_float`.

    **Growth.** A cache built by :meth:`from_float` or :meth:`append` (outside tracing)
    keeps ``codes`` and ``scales`` as sequence-major views (``movedim(2, 0)`` is
    contiguous) of storages with spare rows at the end. The next append writes its rows
    there in place and returns a longer view of the same storage; when the rows run out,
    the storage grows by a fraction of itself (``untyped_storage().resize_``, which every
    view follows), so appending costs amortized O(new tokens), not O(cache). Only the
    view that ends at the last written row appends in place; any other view (a crop, a
    stale reference) copies into a storage of its own, so no view ever sees its tokens
    change. Strides do not depend on length or capacity, so compiled graphs see one layout.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    residual: torch.Tensor
    spec: QuantSpec
    fine_codes: torch.Tensor | None
    fine_scales: torch.Tensor | None
    head: torch.Tensor | None
    offset: torch.Tensor | None
    query_scales: torch.Tensor | None
    query_energy: torch.Tensor | None
    filled_pads: torch.Tensor
    _rows: _WrittenRows | None  # set when codes/scales are growable storages

    @staticmethod
    def __new__(cls, codes, scales, residual, spec, shape=None, rows=None, fine=None, head=None, offset=None,
                query_scales=None, query_energy=None, filled_pads=None):
        if shape is None:
            B, H, S_q, _ = codes.shape
            n_head = 0 if head is None else head.shape[2]
            shape = (B, H, n_head + S_q + residual.shape[2], residual.shape[3])
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=residual.dtype, device=codes.device, requires_grad=False
        )

    def __init__(self, codes, scales, residual, spec, shape=None, rows=None, fine=None, head=None, offset=None,
                 query_scales=None, query_energy=None, filled_pads=None):
        if (fine is not None) != bool(spec.refine):
            raise ValueError(f"a spec with refine={spec.refine} needs {'a' if spec.refine else 'no'} second code plane")
        if (head is not None) != bool(spec.sinks):
            raise ValueError(f"a spec with sinks={spec.sinks} needs {'a' if spec.sinks else 'no'} head of fp tokens")
        if (offset is not None) != spec.center:
            raise ValueError(f"a spec with center={spec.center} needs {'an' if spec.center else 'no'} offset")
        if (query_scales is not None) != spec.query_scaled:
            raise ValueError(f"a spec with query_scaled={spec.query_scaled} needs {'' if spec.query_scaled else 'no '}query scales")
        if (query_energy is not None) != spec.gathers_queries:
            raise ValueError(f"a spec {spec.tag} needs {'' if spec.gathers_queries else 'no '}query energy")
        self.codes = codes
        self.scales = scales
        self.residual = residual
        self.spec = spec
        self.fine_codes, self.fine_scales = fine if fine is not None else (None, None)
        self.head = head
        self.offset = offset
        self.query_scales = query_scales
        self.query_energy = query_energy
        # None: no row fills its pads (what every cache but a padded batch's first append builds).
        self.filled_pads = codes.new_zeros((codes.shape[0], 0), dtype=torch.long) if filled_pads is None else filled_pads
        self._rows = rows

    @classmethod
    def from_float(cls, x: torch.Tensor, spec: QuantSpec, query: torch.Tensor | None = None,
                   pads: torch.Tensor | None = None, fills_pads: bool = False) -> PackedKV:  # fmt: skip
        """Quantize ``x [B, H, S, D]``; with ``scheme="channel"`` the last ``S % group`` tokens wait unquantized.
        ``query [B, Hq, S, D]``: the queries reading ``x``, which fix a ``query_scaled`` spec's scales;
        ``pads`` and ``fills_pads``: as :meth:`append` takes them."""
        check_spec(spec)
        if x.dim() != 4:
            raise ValueError(f"a KV cache tensor must be [B, H, S, D], got shape {tuple(x.shape)}")
        if not x.dtype.is_floating_point:
            raise ValueError(f"a KV cache tensor must be floating point, got {x.dtype}")
        x = _without_history(x)
        return _empty_like(x, spec).append(x, query, pads, fills_pads)

    @classmethod
    def zeros(cls, shape, dtype: torch.dtype, device, spec: QuantSpec) -> PackedKV:
        """A preallocated ``[B, H, S, D]`` cache of zeros (static caches), never materialised in fp."""
        check_spec(spec)
        if spec.scheme != "token":
            raise ValueError(
                f"a preallocated (static) cache needs per-token groups, got scheme={spec.scheme!r}; "
                "per-channel groups need their tokens in order"
            )
        if spec != spec.for_slots:
            raise ValueError(
                "a preallocated (static) cache quantizes every slot it writes once; "
                f"got window={spec.window}, refine={spec.refine}, sinks={spec.sinks}, center={spec.center}: "
                "use QuantSpec.for_slots"
            )
        B, H, S, D = shape
        empty = _empty_like(torch.empty((B, H, 0, D), dtype=dtype, device=device), spec)
        # Zero scales decode every slot to exactly zero, whatever its codes.
        return _static_heads(PackedKV(
            empty.codes.new_zeros((B, H, S, *empty.codes.shape[3:])),
            empty.scales.new_zeros((B, empty.scales.shape[1], S, *empty.scales.shape[3:])),
            empty.residual, spec,
        ))  # fmt: skip

    @_autocast_off
    def append(self, new: torch.Tensor, query: torch.Tensor | None = None, pads: torch.Tensor | None = None,
               fills_pads: bool = False) -> PackedKV:  # fmt: skip
        """This cache followed by ``new [B, H, T, D]``: only the new tokens are quantized. ``query
        [B, Hq, T, D]`` (the queries reading them) fixes a ``query_scaled`` spec's scales in a first
        append, and in every append while a ``defer_prefix`` cache waits; a ``query_rounded`` spec rounds
        the tokens an append quantizes against its queries if it brings enough of them
        (:meth:`QuantSpec.rounds`; else to nearest). ``pads`` (``int64 [B]``, with the queries:
        :func:`kvpass.reference.masked_pads` of their mask) are the slots each row opens with as left
        padding, which the statistics a first append takes with its queries (query scales, offset,
        rounding) skip. With ``fills_pads`` a first append also copies each padded row's first tokens into
        its first pad slots (``filled_pads``); a cache's K and V must be told alike, as attention reads
        them slot by slot."""
        if new.dim() != 4 or (*new.shape[:2], new.shape[3]) != (*self.shape[:2], self.shape[3]):
            raise ValueError(
                f"cannot append tokens of shape {tuple(new.shape)} to a kv4 cache of shape {tuple(self.shape)}: "
                "batch, heads and head_dim must be the cache's (a cache of another batch or model?)"
            )
        if fills_pads and not self.spec.tokens_apart:
            raise ValueError(
                f"{self.spec.tag} cannot fill a row's pads: only per-token groups without an fp window store "
                "each token on its own"
            )
        if query is not None and (query.shape[0] != new.shape[0] or query.shape[2] != new.shape[2]
                                  or query.shape[1] % new.shape[1]):  # fmt: skip
            raise ValueError(
                f"queries {tuple(query.shape)} do not read the new tokens {tuple(new.shape)}: need the same batch "
                "and tokens, and query heads a multiple of the KV heads"
            )
        new, query = _without_history(new), _without_history(query)
        # The first append (a waiting cache's first held one) fixes which slots hold copies, for good.
        first = self._is_empty and not self.residual.shape[2]
        fills = first and fills_pads and pads is not None
        filled = reference.filled_pads(pads, new.shape[2]) if fills else self.filled_pads
        with _fake_dispatch_uncached(self.codes, new):
            if self.waiting:
                return _marked_growing(self._held_append(new, query, pads, filled))
            # Only a first append takes query scales: decode steps skip the energy.
            energy = None
            if query is not None and self._is_empty:
                energy = reference.query_energy(query, new.shape[1], self.spec, pads=pads)
            return _marked_growing(self._quantized_append(new, energy, query, pads, filled))

    def _quantized_append(self, new: torch.Tensor, q_energy: torch.Tensor | None, query: torch.Tensor | None,
                          pads: torch.Tensor | None, filled: torch.Tensor) -> PackedKV:  # fmt: skip
        """:meth:`append` quantizing ``new``; ``q_energy`` (:func:`kvpass.reference.query_energy`) of
        its queries fixes a first append's query scales (after the ``pads`` of :meth:`append`), and the
        append's ``query`` rounds a ``query_rounded`` spec's codes. The cache's ``filled_pads`` after
        the append are ``filled`` (a first append stores its rows' tokens with them)."""
        pads = pads if self._is_empty else None  # a later append fixes no statistic
        takes_scales = self._is_empty and q_energy is not None and self.spec.takes_query_scales(new.shape[2])
        query_scales = reference.query_key_scales(q_energy, new, self.spec, pads) if takes_scales else self.query_scales
        new = reference.by_query_scales(new, query_scales, 1)
        rounding = None
        if query is not None and self.spec.rounds(query.shape[2]):
            # The queries are of the latest tokens (a held cache's earlier ones are gone).
            rounding = reference.rounding_coefficients(query, new.shape[1], query_scales, self.spec, ops.rotate,
                                                       pads, new.shape[2] - query.shape[2])  # fmt: skip
        # The offset skips the pads where query scales are taken: the eager twin learns them with the queries.
        head, offset, new = self._sinks_and_offset(new, pads if takes_scales else None, filled)
        if self.spec.refine:
            return self._refined_append(new, head, offset, query_scales, rounding, filled)
        if self.spec.tokens_apart:  # kv4::quantize rotates as it quantizes
            stored = ops.call(ops.quantize, new.to(self.dtype), *ops.codec_args(self.spec), offset, rounding)
            return self._extended_by(stored, head, offset, query_scales, filled)
        # Residual tokens join the new ones; those that may leave it are quantized now: whole
        # per-channel groups, or whole blocks older than the window.
        stored = ops.rotate(new) if self.spec.rotate else new
        pending = torch.cat([self.residual, stored.to(self.dtype)], dim=2)
        n_leaving = _leaving(pending.shape[2], self.spec)
        codes, scales = ops.call(ops.quantize, pending[:, :, :n_leaving], *ops.codec_args(_unrotated(self.spec)))
        return self._extended(codes, scales, pending[:, :, n_leaving:], head=head, offset=offset)

    def _held_append(self, new: torch.Tensor, query: torch.Tensor | None, pads: torch.Tensor | None,
                     filled: torch.Tensor) -> PackedKV:  # fmt: skip
        """:meth:`append` while waiting: hold ``new`` unquantized (a first append's rows with their pads
        ``filled``), or with it reach ``spec.prefix_tokens`` and quantize every token as one first append."""
        held = self.residual.shape[2]
        q_energy = None
        # The queries of every held token, or none: scales from some of them would be another statistic.
        if query is not None and self.spec.gathers_queries and (held == 0 or self.query_energy.shape[2]):
            q_energy = reference.query_energy(query, new.shape[1], self.spec, held, pads)
            if held:
                q_energy = q_energy + self.query_energy
        if self.spec.waits(held + new.shape[2]):
            stored = ops.rotate(new) if self.spec.rotate else new
            stored = reference.with_pads_filled(stored, filled) if held == 0 else stored
            residual = _cat(self.residual, stored.to(self.dtype))
            parts = self._parts()
            parts["filled_pads"] = filled
            if self.spec.gathers_queries:
                parts["query_energy"] = self._no_energy if q_energy is None else q_energy
            return PackedKV(self.codes, self.scales, residual, self.spec, **parts)
        tokens = torch.cat([self.dequantize(), new.to(self.dtype)], dim=2)
        # The held tokens' queries are gone (only their energy is kept): all of them are rounded
        # against this append's.
        return _empty_like(tokens, self.spec)._quantized_append(tokens, q_energy, query, pads, filled)

    def _sinks_and_offset(self, new: torch.Tensor, pads: torch.Tensor | None, filled: torch.Tensor):
        """``(head, offset, rest)``: the fp sinks and a centered spec's offset after this append
        (a first append fixes them, :meth:`QuantSpec.prefix`: the offset from its rows' own tokens, the
        sinks once their pads are ``filled``) and the new tokens left to quantize."""
        head, offset = self.head, self.offset
        if not self._is_empty:
            return head, offset, new
        sinks, takes_offset = self.spec.prefix(new.shape[2])
        if takes_offset and _shapes_only(new):  # a mean's statistics, traced only for its shape
            offset = new.new_empty((*new.shape[:2], 1, new.shape[3]), dtype=reference.SCALE_DTYPE)
        elif takes_offset:
            offset = reference.center_offset(new, self.spec, rotator=ops.rotate, pads=pads)
        new = reference.with_pads_filled(new, filled)
        if sinks:
            first = new[:, :, :sinks]
            head = (ops.rotate(first) if self.spec.rotate else first).to(reference.sink_dtype(self.dtype))
            new = new[:, :, sinks:]
        return head, offset, new

    def _refined_append(self, new: torch.Tensor, head, offset, query_scales, rounding, filled) -> PackedKV:
        """:meth:`append` for ``spec.refine``: codes as usual, then the newest tokens' error, quantized."""
        # One layout for every inner compiler (inductor may lay the new tokens out otherwise).
        new = new.to(self.dtype).contiguous()
        # The op computes the plane for the newest min(T, refine) new tokens (older new tokens
        # never carry it): bounded by refine, not by the cache's length, so decode graphs need
        # no guard on that length.
        stored = ops.call(ops.quantize_refined, new, *ops.refined_codec_args(self.spec), offset, rounding)
        return self._extended_by(stored, head, offset, query_scales, filled)

    def _extended_by(self, stored, head, offset, query_scales, filled) -> PackedKV:
        """This per-token cache followed by new tokens ``stored`` as ``kv4::quantize_refined`` returns
        them (an unrefined spec's: ``kv4::quantize``'s two, or those and second planes of 0 rows, dropped)."""
        codes, scales, *new_planes = stored
        fine = None
        if self.spec.refine:
            # Counted over every token the cache holds, sinks too: K's plane then changes length at the
            # same steps as V's, and decode graphs mark both dynamic at once.
            held = _head_len(head) + self.codes.shape[2] + codes.shape[2]  # per-token codes: a row a token
            n_fine = reference.refined_tokens(self.spec, held, self.shape[-1], _head_len(head), offset)
            fine = tuple(_newest_rows(old, new, n_fine) for old, new in zip(self._fine_planes(), new_planes))
        return self._extended(codes, scales, self.residual, fine, head, offset, query_scales, filled)

    @_autocast_off
    def write_(self, positions: torch.Tensor, new: torch.Tensor) -> PackedKV:
        """Quantize ``new [B, H, T, D]`` into token slots ``positions`` in place (static caches)."""
        ops.write_(self.codes, self.scales, positions, new.to(self.dtype), *ops.codec_args(self.spec))
        return self

    def _extended(self, codes, scales, residual, fine=None, head=None, offset=None, query_scales=None,
                  filled_pads=None) -> PackedKV:  # fmt: skip
        """This cache's ``codes``/``scales`` followed by these rows, with ``residual`` as the new tail
        (and ``fine``, ``head``, ``offset``, ``query_scales`` and ``filled_pads`` as the new second code
        plane, sinks, offset, query scales and filled pads; None: this cache's filled pads); a cache with
        quantized tokens waits for nothing, so holds no query energy."""
        filled_pads = self.filled_pads if filled_pads is None else filled_pads
        parts = dict(fine=fine, head=head, offset=offset, query_scales=query_scales, query_energy=self._no_energy,
                     filled_pads=filled_pads)  # fmt: skip
        if not all(type(t) is torch.Tensor for t in (self.codes, codes)):
            # Traced (fake or functional tensors): a graph states values, not storage reuse. The length
            # grows from this cache's own (_outer_shape).
            sinks_taken = 0 if head is self.head else _head_len(head) - self.n_head
            grown = sinks_taken + codes.shape[2] + residual.shape[2] - self.residual.shape[2]
            return PackedKV(_cat(self.codes, codes), _cat(self.scales, scales), residual, self.spec,
                            _outer_shape(self, self.shape[2] + grown), **parts)  # fmt: skip
        rows = self._rows
        spans = (_row_span(self.codes), _row_span(self.scales)) if rows is not None else (None, None)
        if rows is not None and rows.ends_at(*spans):
            (_, codes_end), (_, scales_end) = spans
            new_codes, new_scales = _grow(self.codes, codes, codes_end), _grow(self.scales, scales, scales_end)
            rows.codes_end, rows.scales_end = codes_end + codes.shape[2], scales_end + scales.shape[2]
        else:
            new_codes, new_scales = _copy_with_headroom(self.codes, codes), _copy_with_headroom(self.scales, scales)
            rows = _WrittenRows(new_codes.shape[2], new_scales.shape[2])  # a fresh storage's rows start at 0
        return PackedKV(new_codes, new_scales, residual, self.spec, rows=rows, **parts)

    @_autocast_off
    def dequantize(self) -> torch.Tensor:
        """The logical fp tensor. Materialises the whole cache: for tests and fallbacks."""
        stored = ops.dequantize(
            self.codes, self.scales, self.residual, *ops.spec_args(self.spec),
            self.fine_codes, self.fine_scales, self.head, self.offset,
        )  # fmt: skip
        return reference.by_query_scales(reference.as_read(stored, self.filled_pads), self.query_scales, -1)

    @property
    def _no_energy(self) -> torch.Tensor | None:
        """The query energy of a cache that no longer waits (None for a spec that never gathers it)."""
        return None if self.query_energy is None else self.query_energy[:, :, :0]

    @property
    def waiting(self) -> bool:
        """A ``defer_prefix`` cache that has quantized nothing yet: its appends hold the tokens unquantized
        until it has ``spec.prefix_tokens``."""
        return self.spec.defer_prefix and self._is_empty

    @property
    def takes_pads(self) -> bool:
        """Whether :meth:`append` reads ``pads``: only a first append (or one while waiting) fixes the
        statistics a row's left padding would skew, so a decode step need not work them out."""
        return self._is_empty

    @property
    def _is_empty(self) -> bool:
        """No token stored yet: the next append is the first, which fixes what a spec takes from it."""
        return not (self.codes.shape[2] or self.n_head)

    @property
    def n_head(self) -> int:
        """Tokens in the fp sinks (0 without ``spec.sinks``)."""
        return _head_len(self.head)

    def _parts(self) -> dict:
        """The optional inner tensors, as the constructor takes them."""
        return dict(fine=self._fine_planes() or None, head=self.head, offset=self.offset, query_scales=self.query_scales,
                    query_energy=self.query_energy, filled_pads=self.filled_pads)  # fmt: skip

    def _fine_planes(self) -> tuple[torch.Tensor, ...]:
        """``(fine_codes, fine_scales)``, or ``()`` without a refined spec."""
        return () if self.fine_codes is None else (self.fine_codes, self.fine_scales)

    def _inner(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.__tensor_flatten__()[0]]

    def stored_bytes(self) -> int:
        """Bytes of the tokens this cache holds (its logical contents, not spare capacity). Not counted,
        as the spec is not: ``filled_pads``, two integers a row saying which slots hold what (every
        cache a site hands a mask carries them, padded or not, 16 bytes a row)."""
        return sum(t.numel() * t.element_size() for t in self._token_parts())

    def reserved_bytes(self) -> int:
        """Bytes allocated for this cache: :meth:`stored_bytes` plus the rows kept for growth."""
        return sum(t.untyped_storage().nbytes() for t in self._token_parts())

    def _token_parts(self) -> list[torch.Tensor]:
        return [t for t in self._inner() if t is not self.filled_pads]

    def repeat_interleave(self, repeats, dim=None, *, output_size=None):
        # Tensor.repeat_interleave reaches __torch_dispatch__ decomposed (unsqueeze, expand, clone, view),
        # which a packed cache has no form of; repeating whole batch rows (transformers'
        # batch_repeat_interleave) is a row selection, which it has.
        if isinstance(repeats, int) and dim is not None and dim % self.dim() == 0:
            rows = torch.arange(self.shape[0], device=self.device).repeat_interleave(repeats, output_size=output_size)
            return self.index_select(0, rows)
        return super().repeat_interleave(repeats, dim, output_size=output_size)

    def __getitem__(self, index):
        result = super().__getitem__(index)
        if isinstance(result, PackedKV) and result._is_view() and type(result.codes) is torch.Tensor:
            # A crop outside graphs (DynamicCache.crop) must not stay an autograd view of the
            # longer cache: Dynamo would rebuild it from that base by replaying the slice, whose
            # length is a constant, and compile a graph per length (assisted decoding).
            return _marked_growing(PackedKV(result.codes, result.scales, result.residual, result.spec, result.shape,
                                            rows=result._rows, **result._parts()))  # fmt: skip
        return result

    def __repr__(self):
        return (
            f"PackedKV(shape={tuple(self.shape)}, dtype={self.dtype}, {self.spec.bits}-bit {self.spec.scheme} "
            f"groups of {self.spec.group}{', rotated' if self.spec.rotate else ''}"
            f"{'' if self.spec.symmetric else ', asymmetric'}{', clipped scales' if self.spec.clip else ''}"
            f", residual={self.residual.shape[2]}"
            f"{'' if self.fine_codes is None else f', newest {self.fine_codes.shape[2]} refined'}"
            f"{'' if self.head is None else f', first {self.n_head} fp'}{'' if self.offset is None else ', centered'}"
            f"{'' if self.query_scales is None else ', query-scaled'}"
            f"{f', rounded against the queries of appends of {self.spec.query_rounded}+ tokens' if self.spec.query_rounded else ''}"
            f"{', left padding filled with the first tokens' if self.filled_pads.shape[1] else ''}"
            f"{', waiting for its prefix' if self.waiting else ''})"
        )

    # --- tracing ------------------------------------------------------------------------

    def __tensor_flatten__(self):
        spec = self.spec
        optional = (["fine_codes", "fine_scales"] if spec.refine else []) + (["head"] if spec.sinks else [])
        optional += (["offset"] if spec.center else []) + (["query_scales"] if spec.query_scaled else [])
        optional += ["query_energy"] if spec.gathers_queries else []
        return ["codes", "scales", "residual", *optional, "filled_pads"], spec

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        fine = (inner["fine_codes"], inner["fine_scales"]) if spec.refine else None
        return PackedKV(inner["codes"], inner["scales"], inner["residual"], spec, outer_size, fine=fine,
                        head=inner.get("head"), offset=inner.get("offset"), query_scales=inner.get("query_scales"),
                        query_energy=inner.get("query_energy"), filled_pads=inner["filled_pads"])  # fmt: skip

    def __reduce_ex__(self, protocol):
        # contiguous(): a growable cache's views would otherwise save their spare rows too.
        return _rebuild, (self.codes.contiguous(), self.scales.contiguous(), self.residual, self.spec, self._parts())

    # Torch functions reach __torch_dispatch__ as aten ops, where the table below applies.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _IMPLEMENTATIONS.get(func)
        if impl is not None:
            result = impl(func, args, kwargs)
            if result is not NotImplemented:
                return result
        return _fallback(func, args, kwargs)


def _rebuild(codes, scales, residual, spec, parts=None):
    # Files saved before sinks and offsets existed pass the second code plane (or None) here.
    parts = parts if isinstance(parts, dict) else dict(fine=parts)
    return PackedKV(codes, scales, residual, spec, **parts)


torch.serialization.add_safe_globals([PackedKV, QuantSpec, _rebuild])


def _unrotated(spec: QuantSpec) -> QuantSpec:
    # The residual is already in the rotated domain, so quantizing it must not rotate again.
    return dataclasses.replace(spec, rotate=False)


def _leaving(n_pending: int, spec: QuantSpec):
    """How many of ``n_pending`` unquantized tokens are quantized now (oldest first)."""
    # Floor division and sym_max instead of branches keep symbolic lengths free of guards.
    if spec.scheme == "channel":
        return n_pending // spec.group * spec.group
    return torch.sym_max(n_pending - spec.window, 0) // WINDOW_BLOCK * WINDOW_BLOCK


def _without_history(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` without its autograd record. A cache is inference state: quantizing has no gradient, and
    tokens stored with their record would keep a forward's activations alive for the cache's life
    (a model called without ``torch.no_grad()``), and hand a compiled decode step inputs that need
    grad where it traced none."""
    return t.detach() if t is not None and t.requires_grad else t


def _cat(a, b):
    """``torch.cat([a, b], dim=2)``; only its shape where :func:`_shapes_only`."""
    if _shapes_only(a, b):
        return _empty_rows(a, a.shape[2] + b.shape[2])
    return torch.cat([a, b], dim=2)


def _shapes_only(*tensors: torch.Tensor) -> bool:
    """Whether ``tensors`` are fake and no trace records what is done with them: Dynamo working out
    a graph's shapes. A graph that kv4 rewrote then runs kv4's own ops (``graph_ops``) on real
    caches, so an append there needs its outputs' shapes alone, as a custom op's fake implementation
    gives them. The cats and symbolic slices that compute them cost the fake tensors' dispatch cache
    a symbolic check per output: about a third of a SmolLM2 decode graph's trace (docs/design.md)."""
    return (all(type(t) is FakeTensor for t in tensors)
            and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is None
            and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is None)  # fmt: skip


def _fake_dispatch_uncached(*tensors: torch.Tensor):
    """Where :func:`_shapes_only`: the fake tensors' dispatch cache off. For an append's many small ops
    it costs more than the ops: making an entry, and rebuilding an output from one, checks the
    output's sizes symbolically (over half of a SmolLM2 first generate's fake cats, docs/design.md)."""
    return disable_fake_tensor_cache(tensors[0].fake_mode) if _shapes_only(*tensors) else contextlib.nullcontext()


def _empty_rows(like: torch.Tensor, rows) -> torch.Tensor:
    """An uninitialised ``like`` with ``rows`` rows along dimension 2, laid out as ``torch.cat``'s
    output (``empty_strided`` of a symbolic length would guard on whether it is 0)."""
    return torch.empty((*like.shape[:2], rows, *like.shape[3:]), dtype=like.dtype, device=like.device)


# Spare rows a growable storage gets: a fraction of its length (amortized O(1) copies per
# appended row) but at least a decode stretch, so short caches do not regrow every step.
GROWTH_FRACTION = 8
MIN_SPARE_ROWS = 256


def spare_rows(rows: int) -> int:
    """Rows a growable storage holding ``rows`` gets on top: appends until the next regrowth."""
    return max(rows // GROWTH_FRACTION, MIN_SPARE_ROWS)


def _capacity(rows: int) -> int:
    return rows + spare_rows(rows)


def _row_span(t: torch.Tensor) -> tuple[int, int] | None:
    """``(first, end)`` rows of storage a sequence-major ``[B, H, S, ...]`` view covers; None if not one."""
    # Sizes and strides with the sequence first, read as tuples: a decode append asks twice, and a
    # movedim view to ask it cost more than the rest of the question.
    shape, strides = t.shape, t.stride()
    sizes, steps = (shape[2], *shape[:2], *shape[3:]), (strides[2], *strides[:2], *strides[3:])
    row = math.prod(sizes[1:])
    if row == 0 or t.storage_offset() % row:
        return None
    dense = 1
    for size, step in zip(reversed(sizes), reversed(steps)):
        if shape[2] and size != 1 and step != dense:  # as is_contiguous(): an empty view is dense
            return None
        dense *= size
    first = t.storage_offset() // row
    return first, first + shape[2]


@dataclasses.dataclass
class _WrittenRows:
    """The end rows of the last writes into a growable cache's ``codes`` and ``scales`` storages.

    Shared by every PackedKV over those storages; only a view ending there may write beyond.
    """

    codes_end: int
    scales_end: int

    def ends_at(self, codes_span: tuple[int, int] | None, scales_span: tuple[int, int] | None) -> bool:
        """Whether views of codes and scales covering these :func:`_row_span` rows end at the last writes."""
        if codes_span is None or scales_span is None:
            return False
        (c_first, c_end), (s_first, s_end) = codes_span, scales_span
        # A view over mostly dead rows (a sliding window's evicted front) compacts instead.
        live = c_end - c_first >= c_first and s_end - s_first >= s_first
        return live and (c_end, s_end) == (self.codes_end, self.scales_end)


def _grow(past: torch.Tensor, new: torch.Tensor, end: int) -> torch.Tensor:
    """``cat([past, new], dim=2)`` written into ``past``'s storage after its last row, ``end``
    (:func:`_row_span`)."""
    row_bytes = past.stride(2) * past.element_size()
    storage = past.untyped_storage()
    if storage.nbytes() < (end + new.shape[2]) * row_bytes:
        nbytes = _capacity(end + new.shape[2]) * row_bytes
        _release_freed_heap(past.device, nbytes)
        storage.resize_(nbytes)
    shape = (*past.shape[:2], past.shape[2] + new.shape[2], *past.shape[3:])
    out = storage_view(past, shape, past.stride(), past.storage_offset())
    out[:, :, past.shape[2] :].copy_(new)
    return out


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the process's C library has none."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # TypeError: Windows has no CDLL(None)
        return None


# Storages smaller than this regrow without trimming the heap first: a trim walks the whole heap
# (4-8 ms in a SmolLM2 process), and a model's layers regrow on the same decode step, so trimming
# before each of SmolLM2's 120 small storages stalled that step by 0.6 s (docs/bench-memory.md),
# for copies too small to set the process's peak.
TRIM_MIN_BYTES = 4 * 2**20


def _release_freed_heap(device: torch.device, nbytes: int) -> None:
    """Before allocating a cache storage of ``nbytes``: hand the heap's free pages back to the OS.

    glibc keeps freed heap memory resident, and after freeing a large storage it serves more of the
    per-step temporaries from its heap (its mmap threshold rises to that size). A regrowth's copy
    then lands on top of that retained memory; trimming first keeps the copy the only addition to
    the process's peak (``docs/bench-memory.md``, 2026-11-30: 162-176 MiB instead of 176-196 MiB at
    16K, batch 4). Only for storages of at least ``TRIM_MIN_BYTES``, on CPU."""
    trim = _malloc_trim() if device.type == "cpu" and nbytes >= TRIM_MIN_BYTES else None
    if trim is not None:
        trim(0)


def _copy_with_headroom(past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``cat([past, new], dim=2)`` in a fresh sequence-major storage with spare rows."""
    length = past.shape[2] + new.shape[2]
    shape = (_capacity(length), *past.shape[:2], *past.shape[3:])
    _release_freed_heap(past.device, math.prod(shape) * past.element_size())
    rows = past.new_empty(shape)
    view = rows.movedim(0, 2)[:, :, :length]
    out = storage_view(rows, view.shape, view.stride(), 0)
    out[:, :, : past.shape[2]].copy_(past)
    out[:, :, past.shape[2] :].copy_(new)
    return out


def _empty_like(x: torch.Tensor, spec: QuantSpec) -> PackedKV:
    B, H, _, D = x.shape
    codes, scales = ops.quantize(x[:, :, :0], *ops.codec_args(spec))
    fine = (codes.new_empty(codes.shape), scales.new_empty(scales.shape)) if spec.refine else None  # no aliases
    head = x.new_empty((B, H, 0, D), dtype=reference.sink_dtype(x.dtype)) if spec.sinks else None
    # Set by the first append.
    offset, query_scales = (x.new_empty((B, H, 0, D), dtype=reference.SCALE_DTYPE) if wanted else None
                            for wanted in (spec.center, spec.query_scaled))  # fmt: skip
    query_energy = x.new_empty((B, H, 0, D), dtype=torch.float64) if spec.gathers_queries else None
    return PackedKV(codes, scales, x.new_empty((B, H, 0, D)), spec, fine=fine, head=head, offset=offset,
                    query_scales=query_scales, query_energy=query_energy)  # fmt: skip


def _newest_rows(old: torch.Tensor, new: torch.Tensor, keep) -> torch.Tensor:
    """The newest ``keep`` rows (dimension 2) of ``old`` followed by ``new``, sequence-major (as codes
    are): strides do not depend on the length, and slicing off the oldest rows keeps it dense, so
    decode graphs need no guard on either. Only its shape where :func:`_shapes_only`."""
    if _shapes_only(old, new):
        return _empty_rows(old, torch.sym_min(old.shape[2] + new.shape[2], keep))
    old, new = old.movedim(2, 0), new.movedim(2, 0)
    if type(old) is torch.Tensor and type(new) is torch.Tensor:
        # Sliced before the copy, so the rows start a storage: a graph taking them would specialise
        # a storage offset of 0 (after a step that slides no row) and compile again.
        drop = max(old.shape[0] + new.shape[0] - keep, 0)
        rows = torch.cat([old[drop:], new[max(drop - old.shape[0], 0) :]])
        view = rows.movedim(0, 2)
        # A batch of one: a 1-row plane's batch stride equals its row stride, which Dynamo reads as
        # rows x row stride and guards on (a graph more at 2 rows, the model's and the attention's).
        # A dimension of size 1 takes any stride; 0 reads the same at every length.
        stride = view.stride() if view.shape[0] > 1 else (0, *view.stride()[1:])
        return storage_view(rows, view.shape, stride, 0)
    # Traced with values (AOT's functional tensors): one slice of symbolic bounds rather than two.
    rows = torch.cat([old, new])
    return rows[torch.sym_max(rows.shape[0] - keep, 0) :].movedim(0, 2)


def _marked_growing(t: PackedKV) -> PackedKV:
    """``t``, with the lengths later appends change marked dynamic for Dynamo where ``t`` holds real
    tensors: the next graph to take the cache (a model's first decode step) then compiles them as
    symbols, where Dynamo would first specialise on them and compile again once one changed. Lengths
    of 0 and 1 stay specialised (Dynamo's rule) but a second plane's, which is unbacked; parts that
    hold a fixed count (sinks, offset), and planes at the length every longer cache's has, stay
    constants: each symbol costs the trace."""
    if type(t.codes) is not torch.Tensor:
        return t
    planes = t._fine_planes()
    if planes and planes[0].shape[2] == reference.refined_tokens(t.spec, 2**62, t.shape[-1], t.n_head, t.offset):
        planes = ()
    for part in (t.codes, t.scales, t.residual):
        if part.shape[2] > 1:
            torch._dynamo.maybe_mark_dynamic(part, 2)
    # A plane's length passes through 0 and 1 at steps that depend on the prompt (K's after a deferred
    # prefix: 0 up to 127 tokens, 1 up to 135), each a graph of its own as a backed length; as an
    # unbacked one it is a guard nowhere, and one graph serves every length. The trace of an append
    # computes shapes alone (_shapes_only), which need no decision on it.
    for part in planes:
        torch._dynamo.decorators.mark_unbacked(part, 2)
    # The cache's own length, marked as maybe_mark_dynamic marks a plain tensor: on a subclass it
    # also marks every inner tensor of its rank, sinks and final-length planes too, whose symbols
    # made a first decode graph's trace a quarter slower (benchmarks/decode_compiles.py).
    t._dynamo_weak_dynamic_indices = {2}
    return _static_heads(t)


def _static_heads(t: PackedKV) -> PackedKV:
    """``t`` with its heads and head_dim marked static for Dynamo. A cache's never change, but unmarked,
    automatic dynamic shapes make them symbols once a model of other sizes ran the same frame (every
    transformers forward runs in one deprecate_kwarg wrapper), and the rewrite reads them as numbers."""
    t._dynamo_static_indices = {1, 3}
    t._has_dynamo_dim_marking = True
    return t


def _map_inner(t: PackedKV, fn) -> PackedKV:
    fine = tuple(fn(x) for x in t._fine_planes()) or None
    head, offset, query_scales, query_energy = (None if x is None else fn(x)
                                                for x in (t.head, t.offset, t.query_scales, t.query_energy))  # fmt: skip
    codes = fn(t.codes)
    return PackedKV(codes, fn(t.scales), fn(t.residual), t.spec, (codes.shape[0], *t.shape[1:]), fine=fine, head=head,
                    offset=offset, query_scales=query_scales, query_energy=query_energy,
                    filled_pads=fn(t.filled_pads))  # fmt: skip


def _outer_shape(t: PackedKV, length) -> tuple:
    """``t``'s shape holding ``length`` tokens. Given rather than summed from the parts, so a graph reads
    a cache's length as a symbol of its own even where the sinks' count is unbacked (_evicted_head):
    SDPA's checks of it against the mask would be guards on that count, which a trace cannot make."""
    return (*t.shape[:2], length, t.shape[3])


def _head_len(head: torch.Tensor | None) -> int:
    """Tokens in fp sinks ``head`` (None: a spec without sinks)."""
    return 0 if head is None else head.shape[2]


def _fine_between(t: PackedKV, start, stop, head: torch.Tensor | None):
    """The second code plane of ``t``'s quantized tokens ``[start, stop)`` (None without one), in a
    cache of those tokens after the sinks ``head``.

    At most as many of them keep it as a cache that holds just those tokens would refine: a
    sliding window's eviction then matches a cache built at its length.
    """
    if t.fine_codes is None:
        return None
    fine_start = t.codes.shape[2] - t.fine_codes.shape[2]
    # sym_max instead of max keeps symbolic lengths free of guards.
    hi = torch.sym_max(stop - fine_start, 0)
    kept = reference.refined_tokens(t.spec, _head_len(head) + stop - start, t.shape[-1], _head_len(head), t.offset)
    lo = torch.sym_max(torch.sym_max(start - fine_start, 0), hi - kept)
    # Copied to start a storage, as an append's are: a view's storage offset would be a symbol of the
    # next graph, and duck sizing guards on it equalling any other of the same value (V's codes').
    return _own_rows(t.fine_codes, lo, hi), _own_rows(t.fine_scales, lo, hi)


def _seq_dim(dim: int, ndim: int = 4) -> bool:
    return dim % ndim == 2


# --- supported ops ------------------------------------------------------------------------


@_implements(aten.cat.default)
def _cat_impl(func, args, kwargs):
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not _seq_dim(dim) or not isinstance(tensors[0], PackedKV):
        return NotImplemented
    past, *rest = tensors
    if any(isinstance(t, PackedKV) for t in rest):
        return NotImplemented
    # HF's first update concatenates onto an empty 1-D tensor; torch.cat skips those, and so does this.
    rest = [t for t in rest if t.shape != (0,)]
    return past.append(torch.cat(rest, dim=2)) if rest else past


@_implements(aten.index_copy_.default)
def _index_copy_impl(func, args, kwargs):
    t, dim, index, source = args
    if not _seq_dim(dim) or not _is_slot_buffer(t) or isinstance(source, PackedKV):
        return NotImplemented
    return t.write_(index, source)  # StaticLayer.update: straight into the slots


def _is_slot_buffer(t: PackedKV) -> bool:
    """Every token in a slot of its own (per-token groups, nothing unquantized): a static buffer."""
    return t.spec == t.spec.for_slots and t.spec.scheme == "token" and t.residual.shape[2] == 0


@_implements(aten.roll.default)
def _roll_impl(func, args, kwargs):
    t, shifts, dims = (list(args) + [[]][len(args) - 2 :])[:3]
    if len(shifts) != 1 or len(dims) != 1 or not _seq_dim(dims[0]) or not _is_slot_buffer(t):
        return NotImplemented
    # StaticSlidingWindowLayer, once full: per-token rows move whole, so rolling is exact.
    return PackedKV(t.codes.roll(shifts[0], 2), t.scales.roll(shifts[0], 2), t.residual, t.spec)


@_implements(aten.index_put_.default)
def _index_put_impl(func, args, kwargs):
    t, indices, values = args[:3]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    slots_only = len(indices) == 3 and indices[0] is None and indices[1] is None and indices[2] is not None
    if accumulate or not slots_only or indices[2].dim() != 1 or not _is_slot_buffer(t) or isinstance(values, PackedKV):
        return NotImplemented
    # cache[:, :, positions] = new (StaticLayer's fallback write, the sliding layer's last slot);
    # torch drops the leading size-1 dims of ``new``, so broadcast it back to [B, H, T, D].
    B, H, _, D = t.shape
    values = torch.broadcast_to(values, (B, H, indices[2].numel(), D))
    return t.write_(indices[2] % t.shape[2], values)


@_implements(aten.copy_.default)
def _copy_impl(func, args, kwargs):
    dst, src = args[:2]
    if isinstance(dst, PackedKV) and not isinstance(src, PackedKV) and _is_slot_buffer(dst):
        if src.shape != dst.shape:
            return NotImplemented
        # Overwriting every slot (the sliding layer keeping its newest tokens): quantize in place,
        # so the buffers keep their addresses.
        return dst.write_(torch.arange(dst.shape[2], device=src.device), src)
    if not (isinstance(dst, PackedKV) and isinstance(src, PackedKV)) or dst.spec != src.spec:
        return NotImplemented
    if any(d.shape != s.shape for d, s in zip(dst._inner(), src._inner())):
        return NotImplemented
    # AOTAutograd writes a mutated cache input back with copy_ (static caches after
    # kv4::write_); copying the stored form keeps that write exact and functional.
    for d, s in zip(dst._inner(), src._inner()):
        d.copy_(s)
    return dst


@_implements(aten.index_select.default)
def _index_select_impl(func, args, kwargs):
    t, dim, index = args
    if dim % 4 != 0:
        return NotImplemented
    return _map_inner(t, lambda x: x.index_select(0, index))


@_implements(aten.index.Tensor)
def _index_impl(func, args, kwargs):
    t, indices = args
    # Only `cache[batch_indices]` (beam search, batch_select_indices) is native.
    if len(indices) != 1 or indices[0] is None:
        return NotImplemented
    return _map_inner(t, lambda x: x[indices[0]])


@_implements(aten.slice.Tensor)
def _slice_impl(func, args, kwargs):
    t, dim, start, end, step = (list(args) + [0, None, None, 1][len(args) - 1 :])[:5]
    if step != 1:
        return NotImplemented
    if dim % 4 == 0:
        return _map_inner(t, lambda x: x[start:end])
    if not _seq_dim(dim):
        return NotImplemented
    start, end = (_slice_bound(bound, t.shape[2], default) for bound, default in ((start, 0), (end, t.shape[2])))
    if start == 0 and t.filled_pads.shape[1] and not _keeps_filled_slots(t, end):
        return NotImplemented  # the fallback crops the tokens as read
    # Marked growing by __getitem__, which rebuilds the result (HF slices by indexing).
    if start == 0:
        return _crop(t, end)
    if t.spec.scheme == "token":  # sliding-window eviction: per-token groups are independent
        return _token_range(t, start, end)
    return NotImplemented


def _keeps_filled_slots(t: PackedKV, end) -> bool:
    """Whether a crop to ``end`` tokens of a cache whose rows fill their pads keeps every copied token
    (else a later append's tokens would take those slots, and read as the copies). Reads the pads (a
    host sync): crops run outside graphs."""
    if type(t.filled_pads) is not torch.Tensor:  # traced: its values are not known
        return False
    return end >= int(t.filled_pads.sum(1).max())


def _slice_bound(bound, length, default):
    """``bound`` clamped into ``[0, length]`` as ``slice.indices`` would, without its ``int()``: that
    would specialise a compiled graph on the cache's length (a sliding layer's eviction every step)."""
    if bound is None:
        return default
    if bound < 0:
        bound = bound + length
    return torch.sym_min(torch.sym_max(bound, 0), length)


def _own_rows(x: torch.Tensor, lo, hi) -> torch.Tensor:
    """Rows ``[lo, hi)`` (dimension 2) of ``x`` in a storage of their own, sequence-major (as
    :func:`_newest_rows` lays them out); only their shape where :func:`_shapes_only`."""
    if _shapes_only(x):
        return _empty_sequence_major(x, _row_count(lo, hi))
    return _newest_rows(x[:, :, lo:hi], x[:, :, :0], hi - lo)


def _rows_between(x: torch.Tensor, lo, hi) -> torch.Tensor:
    """``x[:, :, lo:hi]``; only its shape where :func:`_shapes_only`."""
    return _empty_sequence_major(x, _row_count(lo, hi)) if _shapes_only(x) else x[:, :, lo:hi]


def _empty_sequence_major(like: torch.Tensor, rows) -> torch.Tensor:
    """An uninitialised ``like`` with ``rows`` rows along dimension 2, sequence-major as a cache's parts
    are: its strides do not involve ``rows``, which spares the fake tensors' dispatch cache symbolic
    checks of them (nested min/max bounds of an eviction: most of its trace, docs/design.md)."""
    shape = (*like.shape[:2], rows, *like.shape[3:])
    strides = reference.sequence_major_strides(like.shape)
    return torch.empty_strided(shape, strides, dtype=like.dtype, device=like.device)


def _row_count(lo, hi):
    # hi >= lo always; stated as a max, a shape env sees the count is not negative without proving it
    # over nested min/max bounds (sympy's proof was a third of an eviction graph's trace).
    return torch.sym_max(hi - lo, 0)


def _evicted_head(head: torch.Tensor, start, end, unbacked: bool) -> torch.Tensor:
    """The fp sinks of ``head`` among tokens ``[start, end)``. A sliding window evicts them one a step
    (4, 3, 2, 1, 0 left), and as a backed length each count was a graph of its own (Gemma 3: 16-18 s
    each), so the sinks an eviction leaves are ``unbacked`` where nothing branches on their count: one
    graph serves every count. They are copied sequence-major, whose strides do not depend on the count:
    a view's offset, or contiguous strides (which torch computes for 0 rows as for 1), would each be a
    guard."""
    n = head.shape[2]
    lo, hi = torch.sym_min(start, n), torch.sym_min(end, n)
    if not start:  # a crop
        return _rows_between(head, 0, hi)
    kept = _own_rows(head, lo, hi)
    if unbacked and type(kept) is torch.Tensor:
        torch._dynamo.decorators.mark_unbacked(kept, 2)
    return kept


def _token_range(t: PackedKV, start: int, end: int) -> PackedKV:
    """Tokens ``[start, end)`` of a per-token cache, ``[head | codes | residual]`` each sliced
    where the range meets it; the offset stays. A sliding window's eviction drops the sinks first, and
    with them a padded row's copies (:func:`kvpass.reference.evicted_fill`)."""
    n_head, n_quant = t.n_head, t.codes.shape[2]
    lo, hi = (torch.sym_min(torch.sym_max(bound - n_head, 0), n_quant) for bound in (start, end))
    behind = n_head + n_quant
    # Unbacked where nothing reads the count: a refined spec's plane cost does, without an offset
    # (QuantSpec.plane_cost).
    unbacked = t.fine_codes is None or reference.fixed_or_none(t.offset) is not None
    head = None if t.head is None else _evicted_head(t.head, start, end, unbacked)
    return PackedKV(
        _rows_between(t.codes, lo, hi), _rows_between(t.scales, lo, hi),
        _rows_between(t.residual, torch.sym_max(start - behind, 0), torch.sym_max(end - behind, 0)),
        t.spec, _outer_shape(t, torch.sym_max(end - start, 0)), rows=t._rows, fine=_fine_between(t, lo, hi, head),
        head=head, offset=t.offset,
        query_scales=t.query_scales, query_energy=t.query_energy,
        filled_pads=reference.evicted_fill(t.filled_pads, start),
    )  # fmt: skip


def _crop(t: PackedKV, length: int) -> PackedKV:
    """The first ``length`` tokens (``DynamicCache.crop``).

    Views of the same storages keep the growth bookkeeping: one that still ends at the last
    written row (a crop inside the residual) goes on appending in place.
    """
    before_residual = t.n_head + t.codes.shape[2]
    if length >= before_residual:
        residual = t.residual[:, :, : length - before_residual]
        return PackedKV(t.codes, t.scales, residual, t.spec, _outer_shape(t, length), rows=t._rows, **t._parts())
    if t.spec.scheme == "token":
        return _token_range(t, 0, length)
    # A per-channel group cut in two: its surviving tokens go back to the residual, with
    # the values they had (dequantized), so no token changes value.
    g = t.spec.group
    keep = length // g * g
    cut = PackedKV(t.codes[:, :, keep : keep + g], t.scales[:, :, keep // g : keep // g + 1], t.residual[:, :, :0], t.spec)
    tail = _stored(cut)[:, :, : length - keep]
    return PackedKV(t.codes[:, :, :keep], t.scales[:, :, : keep // g], tail, t.spec)


def _stored(t: PackedKV) -> torch.Tensor:
    """The cache's values in the stored (possibly rotated) domain."""
    return ops.dequantize(t.codes, t.scales, t.residual, *ops.spec_args(_unrotated(t.spec)))


@_implements(aten._to_copy.default)
def _to_copy_impl(func, args, kwargs):
    (t,) = args
    if set(kwargs) - {"device", "dtype", "non_blocking", "layout", "copy"}:
        return NotImplemented
    device = kwargs.get("device", t.device)
    dtype = kwargs.get("dtype", t.dtype)
    moved = _map_inner(t, lambda x: x.to(device=device, non_blocking=kwargs.get("non_blocking", False)))
    # The logical dtype is the residual's (and sets the sinks'); codes, scales and the offset keep theirs.
    parts = moved._parts()
    parts["head"] = None if moved.head is None else moved.head.to(reference.sink_dtype(dtype))
    return PackedKV(moved.codes, moved.scales, moved.residual.to(dtype), t.spec, t.shape, **parts)


@_implements(aten.detach.default, aten.clone.default, aten.alias.default)
def _elementwise_identity_impl(func, args, kwargs):
    t = args[0]
    if func is aten.clone.default:
        return _map_inner(t, torch.clone)
    return return_and_correct_aliasing(func, args, kwargs, _map_inner(t, func))


# --- attention ----------------------------------------------------------------------------


@_autocast_off
def attention(
    q: torch.Tensor,
    k: PackedKV,
    v: PackedKV,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    v_heads: list[int] | None = None,
) -> torch.Tensor:
    """``sdpa(q, cat([k, k_new]), cat([v, v_new]))`` through ``kv4::attention``: the stored
    tokens are read a block at a time, never as a whole fp tensor.

    No new tokens (``None``): a static cache, whose buffer already holds them. ``softcap`` is
    Gemma-2's ``cap * tanh(scores / cap)``. ``v_heads[j]`` is the stored V head that head ``j`` of V
    reads (DiffLlama: a chunk of the heads tiled back); it copies the picked heads' codes.
    """
    return ops.call(ops.attention, *_attention_args(q, k, v, k_new, v_new, attn_mask, scale, is_causal, softcap, v_heads))


def _attention_args(q, k: PackedKV, v: PackedKV, k_new, v_new, attn_mask, scale, is_causal, softcap, v_heads,
                    query_scaled: bool = True) -> tuple:  # fmt: skip
    """``kv4::attention``'s arguments for :func:`attention`'s; ``query_scaled=False`` leaves ``q`` and
    ``k_new`` as given, for an op that applies K's query scales itself (``kv4::decode_step``)."""
    if reference.fixed_or_none(v.query_scales) is not None:
        raise ValueError(f"V ({v.spec.tag}) holds query scales: attention reads V as stored; store it unscaled")
    if k.filled_pads.shape[1] != v.filled_pads.shape[1]:
        raise ValueError("K and V filled their rows' pads differently: attention reads them slot by slot; "
                         "append both with the same fills_pads")  # fmt: skip
    if k_new is None:
        k_new, v_new = k.residual[:, :, :0], v.residual[:, :, :0]
    if k.filled_pads.shape[1]:  # copies read as their tokens, whose own slots are hidden
        keys = k.shape[2] + k_new.shape[2]
        attn_mask = reference.mask_with_filled_pads(attn_mask, k.filled_pads, q.shape[2], keys, is_causal)
        is_causal = False
    if query_scaled:
        q, k_new = reference.read_with_query_scales(q, k_new, k.query_scales)
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
    return (
        q, k.codes, k.scales, k.residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale, is_causal,
        *ops.spec_args(k.spec), *ops.spec_args(v.spec), softcap,
        k.fine_codes, k.fine_scales, v_fine_codes, v_fine_scales,  # a refined spec's second planes
        k.head, k.offset, v_head, v_offset,  # fp sinks and a centered spec's offset
    )  # fmt: skip


def _steps_as_one(q: torch.Tensor, k: PackedKV, v: PackedKV, k_new: torch.Tensor, is_causal: bool,
                  query: torch.Tensor | None) -> bool:  # fmt: skip
    """Whether :func:`attend_and_append` is one ``kv4::decode_step``: a decode step (one query, one new
    token, not causal) of two per-token caches (``QuantSpec.tokens_apart``) past their first append,
    neither rounding it."""
    return (q.shape[2] == 1 and k_new.shape[2] == 1 and not is_causal and k.spec.tokens_apart and v.spec.tokens_apart
            and not (k._is_empty or v._is_empty) and not (query is not None and k.spec.rounds(query.shape[2])))  # fmt: skip


@_autocast_off
def attend_and_append(q: torch.Tensor, k: PackedKV, v: PackedKV, k_new: torch.Tensor, v_new: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, scale: float | None = None, is_causal: bool = False,
                      softcap: float = 0.0, query: torch.Tensor | None = None, pads: torch.Tensor | None = None,
                      fills_pads: bool = False, sink: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, PackedKV, PackedKV]:  # fmt: skip
    """``(attention(q, k, v, k_new, v_new, ...), k.append(k_new, query, pads, fills_pads), v.append(v_new, ...))``:
    a layer's attention and both appends, which read only the past (V gets the ``pads`` to fill them), and
    attention reads a ``sink`` logit too (:func:`kvpass.reference.with_sink`). A decode step of two per-token
    caches is one op call (``kv4::decode_step``), the rest the three calls."""
    if not _steps_as_one(q, k, v, k_new, is_causal, query):
        k_grown = k.append(k_new, query, pads, fills_pads)
        # V needs the pads only to fill them (K's statistics skip them).
        v_grown = v.append(v_new, pads=pads if fills_pads else None, fills_pads=fills_pads)
        k_read, v_read, attn_mask = reference.with_sink(k_new, v_new, attn_mask, sink)
        return attention(q, k, v, k_read, v_read, attn_mask, scale, is_causal, softcap), k_grown, v_grown
    args = _attention_args(q, k, v, k_new, v_new, attn_mask, scale, is_causal, softcap, None, query_scaled=False)
    (q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask, scale, _), rest = (
        args[:12], args[12 + 2 * ops.SPEC_ARGS :]
    )  # fmt: skip
    out, *stored = ops.call(
        ops.decode_step, q, k_codes, k_scales, k_residual, v_codes, v_scales, v_residual, k_new, v_new, attn_mask,
        scale, *ops.refined_codec_args(k.spec), *ops.refined_codec_args(v.spec), *rest, k.query_scales, sink,
    )  # fmt: skip
    # The output keeps the queries' autograd record (a backward through it raises); what is stored does not.
    stored = [_without_history(t) for t in stored]
    # The op scaled the new key by K's query scales, as an append stores it.
    k_grown = k._extended_by(stored[:4], k.head, k.offset, k.query_scales, k.filled_pads)
    v_grown = v._extended_by(stored[4:], v.head, v.offset, v.query_scales, v.filled_pads)
    return out, _marked_growing(k_grown), _marked_growing(v_grown)


# SDPA's fused kernels, which F.scaled_dot_product_attention dispatches to, and the name of each
# one's mask argument (None: it takes none). An uncompiled forward over a kv4 cache reaches them
# (generate's eager prefill into a static cache, a model run without torch.compile).
_SDPA_MASK_ARGUMENT = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
    aten._scaled_dot_product_flash_attention.default: None,
}


def _bound(func, args, kwargs) -> dict:
    """``func``'s arguments by name, defaults filled in."""
    schema = func._schema.arguments
    named = {a.name: a.default_value for a in schema if a.has_default_value()}
    named.update(zip((a.name for a in schema), args))
    named.update(kwargs)
    return named


@_implements(*_SDPA_MASK_ARGUMENT)
def _sdpa_impl(func, args, kwargs):
    arg = _bound(func, args, kwargs)
    q, k, v = arg["query"], arg["key"], arg["value"]
    if isinstance(q, PackedKV) or not (isinstance(k, PackedKV) and isinstance(v, PackedKV)):
        return NotImplemented
    if arg["dropout_p"] or q.requires_grad:
        return NotImplemented  # training: the fallback runs the real kernel, whose logsumexp a backward needs
    mask_argument = _SDPA_MASK_ARGUMENT[func]
    if _shapes_only(q, k.codes, v.codes):  # kv4::attention's fake, without the mask it would first build
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    else:
        out = attention(
            q, k, v, attn_mask=arg[mask_argument] if mask_argument else None, scale=arg["scale"],
            is_causal=arg["is_causal"],
        )  # fmt: skip
    # The kernel's other outputs (logsumexp, RNG state, sequence bounds) are read only by its backward,
    # which an input without grad never runs: shaped as the kernel's meta function says, NaN or zero.
    meta_args, meta_kwargs = torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), (args, kwargs)
    )
    _, *rest = func(*meta_args, **meta_kwargs)
    unused = torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: torch.full(t.shape, math.nan if t.is_floating_point() else 0, dtype=t.dtype, device=q.device),
        rest,
    )  # fmt: skip
    return (out.to(q.dtype), *unused)


# --- everything else ----------------------------------------------------------------------


def _fallback(func, args, kwargs):
    """Correct but slow: run ``func`` on dequantized tensors.

    An op that writes into a PackedKV stores its result back quantized, so the cache
    object the caller holds still sees the write.
    """
    name = str(func)
    tracing = any(isinstance(a, PackedKV) and isinstance(a.codes, FakeTensor) for a in args)
    if not tracing:
        fallback_ops[name] += 1
        if fallback_ops[name] == 1:
            needs_grad = torch.is_grad_enabled() and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in torch.utils._pytree.tree_leaves((args, kwargs))
            )  # fmt: skip
            log.warning(
                "kvpass: %s has no int4 implementation; computing it on the dequantized cache (a kv4 cache read "
                "outside a kv4-compiled graph: an uncompiled model, a graph break, or Dynamo's recompile_limit)%s",
                name, "; its inputs need grad, which int4 attention keeps no record for: for inference, call the "
                "model under torch.no_grad() or torch.inference_mode()" if needs_grad else "",
            )  # fmt: skip

    def plain(x):
        if not isinstance(x, PackedKV):
            return x
        # Dynamo working out shapes (transformers' repeat_kv over a cache in a prefill): dequantizing
        # fake parts would trace the whole codec for values nothing reads. Contiguous, as dequantize's is.
        return x.codes.new_empty(x.shape, dtype=x.dtype) if _shapes_only(x.codes) else x.dequantize()

    plain_args, plain_kwargs = torch.utils._pytree.tree_map(plain, (args, kwargs))
    result = func(*plain_args, **plain_kwargs)
    for i, schema_arg in enumerate(func._schema.arguments[: len(args)]):
        target = args[i]
        if schema_arg.is_write and isinstance(target, PackedKV):
            # func wrote into the dequantized copy; store that back into the caller's cache.
            updated = PackedKV.from_float(plain_args[i], target.spec)
            target.codes, target.scales, target.residual = updated.codes, updated.scales, updated.residual
            target.fine_codes, target.fine_scales, target._rows = updated.fine_codes, updated.fine_scales, updated._rows
            target.head, target.offset, target.query_scales = updated.head, updated.offset, updated.query_scales
            target.query_energy, target.filled_pads = updated.query_energy, updated.filled_pads
            if result is plain_args[i]:
                result = target
    return result
