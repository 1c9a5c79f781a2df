"""Settings of the kv4 backend: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Literal

import torch

SUPPORTED_BITS = (2, 4, 8)
# Tokens leave an fp window this many at a time, so lengths stay multiples of a constant.
WINDOW_BLOCK = 64
# A refinement plane never covers more than this fraction (1 / REFINE_SHARE) of a cache's
# tokens, so it costs at most 1/8 more bytes even in a short cache.
REFINE_SHARE = 8
# A centered spec's offset is the mean of a cache's first tokens after the first CENTER_SKIP
# (attention sinks, whose keys are outliers, not typical keys), at most CENTER_TOKENS of them
# unless the spec says more (QuantSpec.prefix_tokens); query scales come from the same tokens.
CENTER_SKIP = 4
CENTER_TOKENS = 64
# A cache takes its fp sinks and offset only from a first append (a prompt) of at least this
# many tokens: on a shorter cache their fixed bytes outweigh what they save, and a few tokens fix a
# poor offset.
PREFIX_MIN_TOKENS = 64
# A shorter prompt of at least this many tokens still keeps its first token as an fp sink (no
# offset): the first token (BOS) is the sink every later query reads most, and Gemma 3 loses 5x
# less on English after an 8-token prompt with it. With its one 16-bit row every cache from a
# 6-token prompt on stores at most 0.344x fp16 at head_dim 32 (0.345x at 64); from 5 tokens it
# would be 0.353x at 32. Decode steps from an empty cache, or a prompt under 6 tokens, take nothing.
SHORT_PREFIX_MIN_TOKENS = 6
SHORT_PREFIX_SINKS = 1
# The default query-rounded K rounds only appends of at least this many tokens (a prompt, a prefill
# chunk) against their queries: there the shares cost a small part of the append's compute per
# token, and there they gained (SmolLM2's code at 2K, 64 at a time: -0.40 ± 0.11 points); appends
# of a few tokens' queries (8 at a time, a decode step's one) gained nothing measurable and would pay
# the shares' fixed cost per token (docs/eval.md, twenty-third run).
ROUNDED_APPEND_TOKENS = 64
# That sink gives up at most one refined token, not the 3 its bytes are worth: a short cache's plane is
# a few tokens long, and each of them was worth more than the bytes (docs/eval.md). Groups of
# SHORT_PREFIX_FREE_GROUP channels or more (head_dim 64 and up) give up none: the worst case, 8 tokens
# after a 6-token prompt, stores 0.345x fp16 unpaid. Narrower groups (head_dim 32) give up one, which
# takes it from 0.361x to 0.344x. From then on the sink costs 2 to 3 int4 tokens' bytes, under
# 0.0001x fp16 at 4K.
SHORT_PREFIX_PLANE_COST = 1
SHORT_PREFIX_FREE_GROUP = 64
# Heads narrower than this (test-size models) spend a bit or more per value on fp16 scales: with a
# second code plane, fp sinks or an offset on top, a short cache would store more than 0.35x fp16,
# so they keep plain groups (:meth:`QuantSpec.for_head_dim`).
MIN_EXTRAS_HEAD_DIM = 32
# Of those, heads whose own channels make per-token groups narrower than this (head_dim 8, 12, 24)
# would spend 2 bits or more per value on scales: their groups span whole heads instead.
MIN_HEAD_GROUP = 16
SCHEMES = ("channel", "token")
INNER_COMPILERS = ("eager", "aot_eager", "inductor")


def _check_choice(name, value, accepted):
    # By type too: 4.0 == 4, but a float's bits made a spec tag ('int4.0:...') the graph ops cannot read back.
    if value not in accepted or type(value) is not type(accepted[0]):
        raise ValueError(f"{name} must be one of {list(accepted)}, got {value!r}")


def is_count(value) -> bool:
    """An int, not a bool (True would pass isinstance(value, int) as one token)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one of K or V is stored.

    ``scheme="token"`` groups ``group`` consecutive channels of one token (scale shape
    ``[B, H, S, D // group]``). ``scheme="channel"`` groups ``group`` consecutive tokens
    of one channel (scale shape ``[B, H, S // group, D]``); tokens of a group that is not
    full yet wait in an unquantized residual.

    ``symmetric=True`` stores one fp16 scale per group and signed codes on the grid
    ``-qmax..qmax``; ``symmetric=False`` stores a scale and a zero point (the group's
    minimum) per group and unsigned codes ``0..2**bits - 1`` (see :mod:`kvpass.reference`).

    ``clip=True`` (symmetric only) chooses each group's scale among clipped candidates
    ``±amax / t`` for the least squared error, on the full signed grid ``-(qmax+1)..qmax``:
    the same bytes, a smaller mean error, a larger worst case (:mod:`kvpass.reference`).

    ``window=W`` (per-token scheme) keeps the newest ``W`` to ``W + 63`` tokens unquantized
    in the residual; tokens are quantized ``WINDOW_BLOCK`` (64) at a time as they leave it.
    A cache of ``S`` tokens holds ``max(S - W, 0) // 64 * 64`` of them quantized.

    ``refine=R`` (per-token scheme, no window) quantizes every token once, as usual, and
    keeps for the newest ``min(R, S // 8)`` tokens a second plane of codes and scales: their
    quantization error, quantized with the same spec (:meth:`refined_tokens`). Those tokens
    read back at about twice the bits; a token leaving the plane just drops its second
    codes, so its first codes never change.

    ``sinks=N`` (per-token scheme, no window) keeps a cache's first ``N`` tokens unquantized,
    in 16 bits (the model's dtype, or bfloat16 for an fp32 model): attention sinks, which every
    query reads heavily, so their error reaches every token. They leave only with a sliding
    window's eviction.

    ``center=True`` (symmetric per-token scheme, no window) quantizes each token minus a fixed
    offset per sequence and head: the mean of the cache's first append after its first
    ``CENTER_SKIP`` tokens (at most ``prefix_tokens`` of them), stored in fp16. Reading adds it
    back, so the codes spend their levels on what differs between tokens, not on a direction all
    of them share (Gemma 3's keys).

    ``query_scaled=True`` (K's per-token scheme, no window) stores each token times a fixed scale
    per channel, sequence and head, and the attention reads it with the query divided by that
    scale, which changes no logit: the scales come from the first append's queries and keys
    (:func:`kvpass.reference.query_key_scales`), so the quantization error lands in the channels the
    queries read least.

    ``query_rounded=N`` (K's symmetric per-token scheme, no window, groups within a head) chooses
    each group's codes against the queries of the append that quantizes it, in appends of ``N``
    tokens or more, instead of rounding to nearest (the scales stay the same): the channels are
    rounded one after another, each passing its error on to the later ones so that what the queries
    read of it, ``q . e``, stays small (:func:`kvpass.reference.rounding_coefficients`). The same
    bytes; ``True`` is 1 (every append), ``False`` 0 (none). A shorter append, or one without queries
    (a static cache's slot write, a site whose query comes after its cache update), rounds to nearest.

    ``span_heads=True`` (per-token scheme) makes a token's group all channels of
    ``heads_per_group(H, D)`` consecutive heads instead (scale shape ``[B, H // n, S, 1]``): for
    heads so narrow that their own groups would be mostly scale (:meth:`for_head_dim`). The
    torch reference stores and reads it on every device.

    Sinks and offset come only from a first append of ``PREFIX_MIN_TOKENS`` (64) tokens or more;
    one of 6 to 63 tokens keeps just its first token as a sink (:meth:`prefix`).
    ``defer_prefix=True`` (with sinks, an offset or query scales) holds a shorter first append's
    tokens unquantized instead, in the residual, with their queries' energy, until the cache holds
    ``prefix_tokens`` (``PREFIX_MIN_TOKENS`` unless set higher): the append that brings it there
    quantizes all of them as one first append (so a chat from a short prompt keeps all three). Until
    then K costs what the model's dtype does (16 bits a value in a 16-bit model). A cache pays for
    what it took with fewer refined tokens (:meth:`plane_cost`: 15 for 4 sinks and an offset; for
    one sink, 1 in groups under 64 channels, else none) for as long as it holds them or its offset,
    so from 128 tokens on a long prompt's cache stores no more than it would without them (a short
    prompt's, 2 to 3 int4 tokens more).

    ``prefix_tokens`` (default ``CENTER_TOKENS``, 64) is how many tokens after the sinks the offset
    and query scales are computed over, at most (a longer first append gives them more), and what a
    ``defer_prefix`` cache waits for, its K unquantized until then. At 512, what gains is that exact K
    in shorter caches; the longer statistics gain nothing (docs/eval.md, nineteenth run).
    """

    bits: int = 4
    scheme: Literal["channel", "token"] = "token"
    group: int = 128
    # Orthogonal Hadamard rotation of the head dimension before quantization: spreads
    # channel outliers over all channels, so per-token groups see a flatter distribution.
    rotate: bool = False
    # Asymmetric (zero-point) grid when False: every code level lies inside [min, max] of the
    # group, so skewed groups (post-softmax-like, one-signed after rotation) lose no level.
    symmetric: bool = True
    # Newest tokens kept unquantized: the ones every next token attends to most, cheap at long context.
    window: int = 0
    # Least-squared-error scale per group instead of absmax / qmax: most groups are better off
    # clipping their largest element, which absmax spends a whole code level on.
    clip: bool = False
    # Newest tokens that also store their quantization error, quantized (a second code plane):
    # the neighbours attention reads most, at a few bytes per token of the whole cache.
    refine: int = 0
    # First tokens kept unquantized (attention sinks): every query reads them.
    sinks: int = 0
    # Quantize minus a fixed per-(sequence, head) offset, the mean of the first tokens.
    center: bool = False
    # Per-token groups over whole heads, several of them when they fit in ``group`` values.
    span_heads: bool = False
    # K times per-channel scales from the first append's queries (read with the query divided by them).
    query_scaled: bool = False
    # Short first appends wait unquantized for prefix_tokens tokens, which fix sinks, offset and scales.
    defer_prefix: bool = False
    # Tokens after the sinks whose statistics fix the offset and query scales, at most.
    prefix_tokens: int = CENTER_TOKENS
    # K's codes chosen against the queries of appends of at least this many tokens (0: none), not
    # rounded to nearest.
    query_rounded: int = 0

    def __post_init__(self):
        _check_choice("bits", self.bits, SUPPORTED_BITS)
        _check_choice("scheme", self.scheme, SCHEMES)
        if not isinstance(self.group, int) or self.group < 2 or self.group & (self.group - 1):
            raise ValueError(f"group must be a power of two >= 2, got {self.group!r}")
        if not isinstance(self.rotate, bool):
            raise ValueError(f"rotate must be True or False, got {self.rotate!r}")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric must be True or False, got {self.symmetric!r}")
        if not is_count(self.window) or self.window < 0:
            raise ValueError(f"window must be an int >= 0 (tokens kept unquantized), got {self.window!r}")
        if not isinstance(self.clip, bool):
            raise ValueError(f"clip must be True or False, got {self.clip!r}")
        if self.clip and not self.symmetric:
            raise ValueError("clip=True needs symmetric=True; asymmetric groups span their min..max, use clip=False")
        if not is_count(self.refine) or self.refine < 0:
            raise ValueError(f"refine must be an int >= 0 (newest tokens with a second code plane), got {self.refine!r}")
        if self.refine and (self.scheme != "token" or self.window):
            raise ValueError(
                f"refine={self.refine} needs scheme='token' and window=0, got scheme={self.scheme!r}, "
                f"window={self.window}: it refines quantized tokens, which those keep unquantized"
            )
        if not is_count(self.sinks) or self.sinks < 0:
            raise ValueError(f"sinks must be an int >= 0 (first tokens kept unquantized), got {self.sinks!r}")
        if not isinstance(self.center, bool):
            raise ValueError(f"center must be True or False, got {self.center!r}")
        if not isinstance(self.query_scaled, bool):
            raise ValueError(f"query_scaled must be True or False, got {self.query_scaled!r}")
        for name, value in (("sinks", self.sinks), ("center", self.center), ("query_scaled", self.query_scaled)):
            if value and (self.scheme != "token" or self.window):
                raise ValueError(
                    f"{name}={value} needs scheme='token' and window=0, got scheme={self.scheme!r}, window={self.window}"
                )
        if not isinstance(self.defer_prefix, bool):
            raise ValueError(f"defer_prefix must be True or False, got {self.defer_prefix!r}")
        if self.defer_prefix and not (self.sinks or self.center or self.query_scaled):
            raise ValueError(
                "defer_prefix=True needs sinks, center or query_scaled: it defers what a first append fixes, "
                "and this spec takes nothing from one"
            )
        if not isinstance(self.prefix_tokens, int) or self.prefix_tokens < PREFIX_MIN_TOKENS:
            raise ValueError(
                f"prefix_tokens must be an int >= {PREFIX_MIN_TOKENS} (tokens whose statistics fix K's prefix), "
                f"got {self.prefix_tokens!r}"
            )
        if self.prefix_tokens != CENTER_TOKENS and not (self.center or self.query_scaled or self.defer_prefix):
            raise ValueError(
                f"prefix_tokens={self.prefix_tokens} needs center, query_scaled or defer_prefix: it sets the tokens "
                "their statistics come from and a deferring cache waits for, and this spec has none of them"
            )
        if not isinstance(self.query_rounded, int) or self.query_rounded < 0:
            raise ValueError(
                "query_rounded must be an int >= 0 (the fewest tokens of an append rounded against its queries; "
                f"True: every append, False or 0: none), got {self.query_rounded!r}"
            )
        object.__setattr__(self, "query_rounded", int(self.query_rounded))  # True and 1 are one spec, one tag
        if self.query_rounded and (self.scheme != "token" or self.window or not self.symmetric or self.span_heads):
            raise ValueError(
                f"query_rounded={self.query_rounded} needs scheme='token', window=0, symmetric=True and "
                "span_heads=False (it rounds the channels of each token's groups within a head), "
                f"got scheme={self.scheme!r}, window={self.window}, "
                f"symmetric={self.symmetric}, span_heads={self.span_heads}"
            )
        if self.center and not self.symmetric:
            raise ValueError("center=True needs symmetric=True; an asymmetric grid's zero points already shift each group")
        if not isinstance(self.span_heads, bool):
            raise ValueError(f"span_heads must be True or False, got {self.span_heads!r}")
        if self.span_heads and self.scheme != "token":
            raise ValueError(
                f"span_heads=True needs scheme='token' (groups of a token's channels), got {self.scheme!r}"
            )
        if self.window and self.scheme != "token":
            raise ValueError(
                f"window={self.window} needs scheme='token'; per-channel groups already keep the "
                "tokens of their unfinished group unquantized"
            )

    @property
    def tag(self) -> str:
        """Compact, parseable name used in rewritten graphs:
        ``int4:token:64[:rot][:asym|:mse][:w64|:r64][:s4][:ctr][:heads][:qs][:p512][:dp][:qr|:qr64]``.

        Symmetric absmax specs keep the tags they always had (no suffix)."""
        return (
            f"int{self.bits}:{self.scheme}:{self.group}"
            + (":rot" if self.rotate else "")
            + ("" if self.symmetric else ":asym")
            + (":mse" if self.clip else "")
            + (f":w{self.window}" if self.window else "")
            + (f":r{self.refine}" if self.refine else "")
            + (f":s{self.sinks}" if self.sinks else "")
            + (":ctr" if self.center else "")
            + (":heads" if self.span_heads else "")
            + (":qs" if self.query_scaled else "")
            + (f":p{self.prefix_tokens}" if self.prefix_tokens != CENTER_TOKENS else "")
            + (":dp" if self.defer_prefix else "")
            + (":qr" if self.query_rounded else "")
            + (str(self.query_rounded) if self.query_rounded > 1 else "")
        )

    @classmethod
    def from_tag(cls, tag: str) -> QuantSpec:
        expected = "int<bits>:<scheme>:<group>[:rot][:asym|:mse][:w<tokens>|:r<tokens>][:s<tokens>][:ctr][:heads][:qs][:p<tokens>][:dp][:qr[<tokens>]]"
        try:
            bits, scheme, group, *flags = tag.split(":")

            def tokens(prefix):
                counts = [int(f[len(prefix):]) for f in flags if f.startswith(prefix) and f[len(prefix):].isdigit()]
                return counts[0] if counts else 0

            spec = cls(
                int(bits.removeprefix("int")), scheme, int(group), rotate="rot" in flags,
                symmetric="asym" not in flags, window=tokens("w"), clip="mse" in flags, refine=tokens("r"),
                sinks=tokens("s"), center="ctr" in flags, span_heads="heads" in flags, query_scaled="qs" in flags,
                defer_prefix="dp" in flags, prefix_tokens=tokens("p") or CENTER_TOKENS,
                query_rounded=tokens("qr") or "qr" in flags,
            )  # fmt: skip
        except ValueError as error:
            raise ValueError(f"bad QuantSpec tag {tag!r}: expected {expected} ({error})") from None
        if spec.tag != tag:  # unknown, repeated or reordered flags
            raise ValueError(f"bad QuantSpec tag {tag!r}: expected {expected}")
        return spec

    @property
    def qmax(self) -> int:
        """Largest code magnitude of the symmetric grid: 7 for int4."""
        return 2 ** (self.bits - 1) - 1

    @property
    def code_min(self) -> int:
        """Smallest code: ``-qmax`` (absmax), ``-(qmax + 1)`` (``clip``), 0 (asymmetric)."""
        if not self.symmetric:
            return 0
        return -self.qmax - 1 if self.clip else -self.qmax

    @property
    def code_max(self) -> int:
        """Largest code of this spec's grid: ``qmax`` (symmetric, codes ``-qmax..qmax``) or
        ``2**bits - 1`` (asymmetric, codes ``0..2**bits - 1``): 7 or 15 for int4."""
        return self.qmax if self.symmetric else 2**self.bits - 1

    @property
    def for_slots(self) -> QuantSpec:
        """This spec as a preallocated (static) cache stores it: each slot is quantized once as it
        is written, with no fp window, no second code plane, no fp sinks, no offset, no query scales and
        no query rounding (a slot write gets no queries)."""
        return dataclasses.replace(self, window=0, refine=0, sinks=0, center=False, query_scaled=False,
                                   defer_prefix=False, prefix_tokens=CENTER_TOKENS, query_rounded=False)  # fmt: skip

    def for_head_dim(self, head_dim: int) -> QuantSpec:
        """This spec for heads of ``head_dim`` channels: below ``MIN_EXTRAS_HEAD_DIM`` channels
        without its second code plane, sinks, offset, query scales and query rounding, and with groups spanning
        whole heads where its own would be narrower than ``MIN_HEAD_GROUP``."""
        if self.scheme != "token" or head_dim >= MIN_EXTRAS_HEAD_DIM:
            return self
        span_heads = self.span_heads or self.token_group(head_dim) < MIN_HEAD_GROUP
        return dataclasses.replace(self, refine=0, sinks=0, center=False, span_heads=span_heads, query_scaled=False,
                                   defer_prefix=False, prefix_tokens=CENTER_TOKENS, query_rounded=False)  # fmt: skip

    def heads_per_group(self, heads: int, head_dim: int) -> int:
        """KV heads whose channels of one token form one group: 1, or with ``span_heads`` as many as
        fit in ``group`` values (at least one) and divide ``heads``."""
        if not self.span_heads:
            return 1
        return max(n for n in range(1, heads + 1) if heads % n == 0 and n * head_dim <= max(self.group, head_dim))

    def prefix(self, first: int) -> tuple[int, bool]:
        """``(sinks, offset)``: how many fp sinks, and whether an offset, a first append of ``first``
        tokens fixes for this spec (``PREFIX_MIN_TOKENS``, ``SHORT_PREFIX_MIN_TOKENS``)."""
        if first >= PREFIX_MIN_TOKENS:
            return self.sinks, self.center
        if first >= SHORT_PREFIX_MIN_TOKENS:
            return min(self.sinks, SHORT_PREFIX_SINKS), False
        return 0, False

    @property
    def tokens_apart(self) -> bool:
        """Whether every token is quantized on its own as it comes (per-token groups, no fp window), so
        a token's slot can hold another's (a padded row's copies: ``PackedKV.filled_pads``)."""
        return self.scheme == "token" and not self.window

    @property
    def gathers_queries(self) -> bool:
        """Whether a waiting cache (``defer_prefix``) gathers its queries' energy for query scales."""
        return self.defer_prefix and self.query_scaled

    def waits(self, held: int) -> bool:
        """Whether a cache of this spec holding ``held`` tokens, none quantized, keeps them unquantized
        (``defer_prefix``) rather than quantizing them as a first append."""
        return self.defer_prefix and held < self.prefix_tokens

    def takes_query_scales(self, first: int) -> bool:
        """Whether a first append of ``first`` tokens fixes query scales: as for the offset, from
        ``PREFIX_MIN_TOKENS`` tokens on (a few tokens' statistics would misplace the error)."""
        return self.query_scaled and first >= PREFIX_MIN_TOKENS

    def rounds(self, tokens: int) -> bool:
        """Whether an append of ``tokens`` tokens with their queries is rounded against them
        (``query_rounded``, ``ROUNDED_APPEND_TOKENS``)."""
        return bool(self.query_rounded) and tokens >= self.query_rounded

    def plane_cost(self, n_head: int, has_offset: bool, head_dim: int) -> int:
        """Refined tokens a cache of ``head_dim``-channel heads holding ``n_head`` fp sinks (and an
        offset, if ``has_offset``) gives up: as many as those 16-bit rows (beyond the codes the sinks
        replace) take in quantized tokens' bytes, 15 for int4 in groups of 64 with 4 sinks and an
        offset. A short prompt's one sink and no offset gives up ``SHORT_PREFIX_PLANE_COST`` in groups
        narrower than ``SHORT_PREFIX_FREE_GROUP`` channels, none in wider ones. The offset outlives a
        sliding window's eviction of the sinks it came with and keeps paying for all of them: the plane
        cannot regain rows it dropped."""
        if not has_offset and n_head <= SHORT_PREFIX_SINKS:
            return SHORT_PREFIX_PLANE_COST * (n_head > 0 and self.token_group(head_dim) < SHORT_PREFIX_FREE_GROUP)
        group_bits = self.bits * self.group + 16 * (1 if self.symmetric else 2)  # a token's bits per group
        sinks = self.sinks if has_offset else n_head
        return -(-(sinks * (16 * self.group - group_bits) + 16 * self.group * has_offset) // group_bits)

    def refined_tokens(self, stored: int, head_dim: int, n_head: int = 0, has_offset: bool = False):
        """How many of the newest quantized tokens of a cache of ``head_dim``-channel heads holding
        ``stored`` tokens (sinks included) carry the second code plane: :meth:`plane_cost` fewer in one
        with sinks or an offset (a spec without sinks never pays: its offset alone was measured
        without payment)."""
        # sym_min / sym_max keep symbolic lengths free of guards.
        tokens = torch.sym_min(self.refine, stored // REFINE_SHARE)
        # The offset first: after a sliding window's eviction the sinks' count is unbacked (no guard).
        if not self.sinks or not (has_offset or n_head):
            return tokens
        return torch.sym_max(tokens - self.plane_cost(n_head, has_offset, head_dim), 0)

    def token_group(self, head_dim: int) -> int:
        """Channel-group size of a per-token scheme for this head_dim.

        The largest power of two that divides both ``group`` and ``head_dim``: 64 at
        head_dim 128, 16 at head_dim 80 (more scale overhead, but every head_dim works).
        """
        return math.gcd(self.group, head_dim)


def check_spec(spec, name: str = "spec") -> None:
    """Refuse anything but a :class:`QuantSpec` where one is taken, saying how to make one."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{name} must be a kvpass.QuantSpec, got {spec!r} ({type(spec).__name__}); QuantSpec."
                        "from_tag('int4:token:64:rot') reads a tag, kvpass.kv4(...).config.k is a backend's K")


@dataclasses.dataclass(frozen=True)
class KVConfig:
    """Everything the kv4 backend can be told. Build one through :func:`kvpass.kv4`."""

    # Chosen by measured streaming perplexity on SmolLM2 and Gemma 3 (docs/eval.md, docs/design.md).
    k: QuantSpec = QuantSpec(
        bits=4, scheme="token", group=64, rotate=True, clip=True, refine=64, sinks=4, center=True, query_scaled=True,
        defer_prefix=True, query_rounded=ROUNDED_APPEND_TOKENS,
    )
    v: QuantSpec = QuantSpec(bits=4, scheme="token", group=64, rotate=True, clip=True, refine=64)
    # K specs for chosen layers, as (layer index, spec) pairs: a layer's index is the last number
    # in its attention module's path (11 for model.layers.11.self_attn).
    k_layers: tuple[tuple[int, QuantSpec], ...] = ()
    inner: str = "eager"
    # Log the graph diff and site table for every compiled graph; a folder also saves them.
    debug: bool = False
    debug_dir: str | None = None

    def for_layer(self, layer: int | None) -> KVConfig:
        """The settings of the attention in layer ``layer`` (None: not known): K's spec from ``k_layers``."""
        k = dict(self.k_layers).get(layer)
        return self if k is None else dataclasses.replace(self, k=k, k_layers=())

    def __post_init__(self):
        _check_choice("inner", self.inner, INNER_COMPILERS)
        if not isinstance(self.debug, bool):
            raise ValueError(f"debug must be True or False, got {self.debug!r}")
        if self.debug_dir is not None and not isinstance(self.debug_dir, (str, os.PathLike)):
            raise ValueError(f"debug_dir must be a folder's path (a str or os.PathLike) or None, got "
                             f"{self.debug_dir!r}")  # fmt: skip
        if self.v.query_rounded:
            raise ValueError("v.query_rounded=True is not supported: only K's cache writes are handed their queries")
        if self.v.scheme == "channel":
            raise ValueError(
                "v_scheme='channel' is not supported: V has no channel outliers and "
                "per-token groups keep the attention output exact per token; use 'token'"
            )
